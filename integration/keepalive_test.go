package integration

import (
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/leases/keeper"
)

// TestLateFirstRenewalKeepsTheLease: etcd stops answering (SIGSTOP, as an etcd too busy to
// answer) just as the keeper starts renewing a lease, for longer than the client waits for a
// first renewal (its dial timeout plus a second), and far less than the lease's TTL. The
// client gives up on the lease; the keeper must find that etcd still has it and renew it
// again, not report it lost (which would make an agent re-claim its pods under new leases).
// The lease then outlives its TTL.
func TestLateFirstRenewalKeepsTheLease(t *testing.T) {
	e := startEtcdProcess(t)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.URL}, DialTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	var lost atomic.Int64
	k, err := keeper.New(cli, keeper.Config{TTL: 8 * time.Second, OpTimeout: 10 * time.Second,
		OnLost: func(clientv3.LeaseID) { lost.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	ctx, cancel := testCtx(t)
	defer cancel()
	g, err := cli.Grant(ctx, 8)
	if err != nil {
		t.Fatal(err)
	}

	if err := e.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	if err := k.Resume(g.ID); err != nil {
		_ = e.cmd.Process.Signal(syscall.SIGCONT)
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond) // past the client's 1.2 s wait for a first answer
	if err := e.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}

	// Past the TTL from the grant: only renewals keep it.
	for time.Since(stopped) < 12*time.Second {
		if n := lost.Load(); n > 0 {
			t.Fatalf("the keeper reported the lease lost %d times; etcd still had it", n)
		}
		time.Sleep(100 * time.Millisecond)
	}
	ttl, err := cli.TimeToLive(ctx, g.ID)
	if err != nil {
		t.Fatal(err)
	}
	if ttl.TTL <= 0 || !k.Holds(g.ID) {
		t.Fatalf("12 s after a grant of 8 s the lease has TTL %d (held: %v): its renewals stopped", ttl.TTL, k.Holds(g.ID))
	}
}
