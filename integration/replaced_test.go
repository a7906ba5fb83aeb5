package integration

import (
	"fmt"
	"strings"
	"testing"
)

// TestEtcdDataReplaced: etcd's data is lost (an empty etcd at the same endpoints, its
// revision far below the old one). A watch resumed at the old revision reports nothing, so an
// agent's view still holds the addresses the old etcd had; the agent must not answer "no free
// address" from it. It lists the pool again and allocates from what etcd now holds, and it
// registers its node again.
func TestEtcdDataReplaced(t *testing.T) {
	f := newFixture(t, withAgents(2))
	filler, server := f.Agents[0], f.Agents[1]
	// A /29 hands out .2-.6: the filler takes all five.
	fillerConf, conf := v4conf(f.Pool, filler.Socket, "10.43.0.0/29"), v4conf(f.Pool, server.Socket, "10.43.0.0/29")
	for i := range 5 {
		f.ipv4(fillerConf, fmt.Sprintf("fill-%d", i), fmt.Sprintf("K8S_POD_UID=uid-fill-%d", i))
	}
	// The server's view follows the pool and is full.
	eventually(t, "the server's view sees the pool full", func() error {
		_, err := f.add(conf, "early", "eth0", "K8S_POD_UID=uid-early")
		return saw(cniCode(err) == 102, "ADD: %v", err)
	})
	// The writes above raised the revision: the server's watch resumes past anything the
	// empty etcd will reach during the test.
	for i := range 50 {
		if _, err := f.Cli.Put(f.Ctx, fmt.Sprintf("/unrelated/%d", i), "x"); err != nil {
			t.Fatal(err)
		}
	}
	filler.kill() // its pods are gone with the data; nobody re-claims them
	f.Etcd = replaceEtcdProcess(t, f.Etcd)

	eventually(t, "an ADD through the server succeeds in the empty etcd", func() error {
		_, err := f.add(conf, "after", "eth0", "K8S_POD_UID=uid-after")
		return err
	})
	nodeKey := "/leasehold/v1/nodes/" + server.Cluster + "/" + server.Node
	eventually(t, "the server registers its node again in the new etcd", func() error {
		return saw(exists(t, f.Cli, nodeKey), "no %s", nodeKey)
	})
	if !strings.Contains(server.logs.String(), "etcd went back in time") {
		t.Errorf("the server did not say that etcd went back in time:\n%s", server.logs.String())
	}
}
