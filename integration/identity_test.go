package integration

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/keyspace"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestLeaseholddRefusesANodeIdentityServedFromAnotherHost runs the real leaseholdd for a node
// identity whose record names another host, live: it exits with code 1 naming both hosts.
// Then a running leaseholdd whose node lease is lost while another host registers the
// identity exits with the reason instead of serving on.
func TestLeaseholddRefusesANodeIdentityServedFromAnotherHost(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nodeKey := keyspace.NodeKey("default", "node-a")
	other := func() clientv3.LeaseID {
		g, err := cli.Grant(ctx, 30)
		if err != nil {
			t.Fatal(err)
		}
		rec, _ := json.Marshal(keyspace.NodeRecord{UID: "uid-a", Host: "other-host/boot-1", PID: 4242, LeaseID: keyspace.LeaseHex(g.ID)})
		if _, err := cli.Put(ctx, nodeKey, string(rec), clientv3.WithLease(g.ID)); err != nil {
			t.Fatal(err)
		}
		return g.ID
	}

	// At start.
	otherLease := other()
	out := runAgentExpectingFailure(t, "--etcd-endpoints", etcd.URL, "--node", "node-a", "--node-uid", "uid-a", "--lease-ttl", "10s")
	if !strings.Contains(out, `other-host/boot-1`) || !strings.Contains(out, "already served") {
		t.Fatalf("leaseholdd for an identity served from another host: want a refusal naming the other host:\n%s", out)
	}
	if _, err := cli.Revoke(ctx, otherLease); err != nil {
		t.Fatal(err)
	}

	// While running: the node lease is lost (here revoked) and another host registered.
	agent := startAgent(t, etcd.URL)
	resp, err := cli.Get(ctx, nodeKey)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("node record: %v", err)
	}
	own := clientv3.LeaseID(resp.Kvs[0].Lease)
	other()
	if _, err := cli.Revoke(ctx, own); err != nil {
		t.Fatal(err)
	}
	select {
	case <-agent.done:
	case <-time.After(20 * time.Second):
		t.Fatal("leaseholdd kept running after another host took its node identity")
	}
	if code := agent.cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(agent.logs.String(), `other-host/boot-1`) {
		t.Errorf("leaseholdd whose identity was taken: exit %d, want 1 with a log naming the other host", code)
	}
	agent.cmd = nil
	if resp, err := cli.Get(ctx, nodeKey); err != nil || len(resp.Kvs) != 1 || !strings.Contains(string(resp.Kvs[0].Value), "other-host") {
		t.Errorf("the node record after the exit is not the other host's: %v %v", resp, err)
	}
}
