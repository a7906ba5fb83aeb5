package integration

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestLeaseholddRefusesANodeIdentityServedFromAnotherHost runs the real leaseholdd for a node
// identity whose record names another host, live: it exits with code 1 naming both hosts.
// Then a running leaseholdd whose node lease is lost while another host registers the
// identity exits with the reason instead of serving on.
func TestLeaseholddRefusesANodeIdentityServedFromAnotherHost(t *testing.T) {
	f := newFixture(t, withoutAgent())
	node, uid := uniq("node-"), uniq("node-uid-")
	nodeKey := keyspace.NodeKey(f.Cluster, node)
	other := func() clientv3.LeaseID {
		g, err := f.Cli.Grant(f.Ctx, 30)
		if err != nil {
			t.Fatal(err)
		}
		rec, _ := json.Marshal(keyspace.NodeRecord{UID: uid, Host: "other-host/boot-1", PID: 4242, LeaseID: keyspace.LeaseHex(g.ID)})
		if _, err := f.Cli.Put(f.Ctx, nodeKey, string(rec), clientv3.WithLease(g.ID)); err != nil {
			t.Fatal(err)
		}
		return g.ID
	}

	// At start.
	otherLease := other()
	out := runAgentExpectingFailure(t, "--etcd-endpoints", f.Endpoint, "--cluster", f.Cluster, "--node", node, "--node-uid", uid, "--lease-ttl", "10s")
	if !strings.Contains(out, `other-host/boot-1`) || !strings.Contains(out, "already served") {
		t.Fatalf("leaseholdd for an identity served from another host: want a refusal naming the other host:\n%s", out)
	}
	if _, err := f.Cli.Revoke(f.Ctx, otherLease); err != nil {
		t.Fatal(err)
	}

	// While running: the node lease is lost (here revoked) and another host registered.
	agent := f.startAgent("--node", node, "--node-uid", uid)
	resp, err := f.Cli.Get(f.Ctx, nodeKey)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("node record: %v", err)
	}
	own := clientv3.LeaseID(resp.Kvs[0].Lease)
	other()
	if _, err := f.Cli.Revoke(f.Ctx, own); err != nil {
		t.Fatal(err)
	}
	select {
	case <-agent.done:
	case <-time.After(etcdtest.Patience):
		t.Fatalf("leaseholdd kept running for %s after another host took its node identity", etcdtest.Patience)
	}
	if code := agent.cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(agent.logs.String(), `other-host/boot-1`) {
		t.Errorf("leaseholdd whose identity was taken: exit %d, want 1 with a log naming the other host", code)
	}
	agent.cmd = nil
	if resp, err := f.Cli.Get(f.Ctx, nodeKey); err != nil || len(resp.Kvs) != 1 || !strings.Contains(string(resp.Kvs[0].Value), "other-host") {
		t.Errorf("the node record after the exit is not the other host's: %v %v", resp, err)
	}
}
