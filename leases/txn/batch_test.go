package txn

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestARefusedBatchSplitsAndEachLearns: etcd refuses a batch outright (one claim's lease is
// gone: nothing of the batch applies). The batcher answers each claim alone, as it would
// have been answered without the batch; it used to read the nil response of the refusal.
func TestARefusedBatchSplitsAndEachLearns(t *testing.T) {
	cli := etcdtest.Client(t)
	ctx := etcdtest.Ctx(t)
	lease := func() clientv3.LeaseID {
		resp, err := cli.Grant(ctx, 60)
		if err != nil {
			t.Fatal(err)
		}
		return resp.ID
	}
	live, gone := lease(), lease()
	if _, err := cli.Revoke(ctx, gone); err != nil {
		t.Fatal(err)
	}
	prefix := etcdtest.Uniq("/batch-refused/")
	claimOn := func(name string, l clientv3.LeaseID) *queued {
		key := prefix + name
		return &queued{cmps: []clientv3.Cmp{keyspace.Absent(key)}, puts: []clientv3.Op{clientv3.OpPut(key, "x", clientv3.WithLease(l))},
			gets: []clientv3.Op{clientv3.OpGet(key)}, keys: []string{key}, done: make(chan struct{})}
	}
	ok, refusedOne := claimOn("ok", live), claimOn("gone", gone)
	var splits []int
	b := NewBatcher(cli, BatcherConfig{Timeout: 10 * time.Second, OnBatch: func(result string, claims int) {
		if result == "split" {
			splits = append(splits, claims)
		}
	}})
	b.run([]*queued{ok, refusedOne})
	if ok.err != nil || ok.resp == nil || !ok.resp.Succeeded {
		t.Errorf("the claim on a live lease: %v, %+v; want it applied alone", ok.err, ok.resp)
	}
	if !LeaseGone(refusedOne.err) {
		t.Errorf("the claim on a gone lease: %v; want etcd's refusal, alone", refusedOne.err)
	}
	if len(splits) != 1 || splits[0] != 2 {
		t.Errorf("split batches told: %v, want one of 2 claims", splits)
	}
}

// TestTakeFitsABatchToOneTransaction checks the batch's composition (no I/O): etcd's
// operation limit, and no key put twice in one transaction.
func TestTakeFitsABatchToOneTransaction(t *testing.T) {
	mk := func(cmps int, keys ...string) *queued {
		c := &queued{cmps: make([]clientv3.Cmp, cmps), keys: keys}
		for _, k := range keys {
			c.puts = append(c.puts, clientv3.OpPut(k, ""))
		}
		return c
	}
	a, b, dup, big, d := mk(6, "a1", "a2", "a3"), mk(6, "b1", "b2", "b3"), mk(6, "a2", "x", "y"), mk(120, "z"), mk(6, "d1")
	q := &Batcher{queue: []*queued{a, b, dup, big, d}}
	if got := q.take(); len(got) != 3 || got[0] != a || got[1] != b || got[2] != d {
		t.Fatalf("first batch: got %d claims, want a, b, d (dup puts a2 again, big exceeds %d compares)", len(got), keyspace.MaxTxnOps)
	}
	if got := q.take(); len(got) != 2 || got[0] != dup || got[1] != big {
		t.Fatalf("second batch: want dup and big, got %d", len(got))
	}
	alone := &Batcher{queue: []*queued{mk(keyspace.MaxTxnOps+10, "k")}}
	if got := alone.take(); len(got) != 1 {
		t.Fatal("a claim too large for a batch is still taken, alone")
	}
}

// TestQueuedClaimLeavesWithItsDeadline: a claim waiting behind a transaction in flight
// returns when its ADD's deadline passes, and is withdrawn from the queue (no I/O: the
// batcher is marked busy and never reaches etcd).
func TestQueuedClaimLeavesWithItsDeadline(t *testing.T) {
	b := &Batcher{busy: true}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	cmps, puts, gets := (&Claim{OwnerKey: "k", Lease: 1}).ops()
	resp, err := b.commit(ctx, cmps, puts, gets)
	if !errors.Is(err, context.DeadlineExceeded) || resp != nil {
		t.Fatalf("queued claim past its deadline: got %v, %v", resp, err)
	}
	if len(b.queue) != 0 {
		t.Errorf("the claim stayed queued after its ADD gave up: %d queued", len(b.queue))
	}
}

// TestAJointClaimAppliesBothPartsOrNeither: one interface's claims in an IPv4 and an IPv6
// pool, sent as one (CommitJoint). While the IPv6 address is held, nothing of either part
// applies and the IPv6 part's outcome names the holder; once it is free both apply, at one
// revision.
func TestAJointClaimAppliesBothPartsOrNeither(t *testing.T) {
	cli, ctx := etcdtest.Client(t), etcdtest.Ctx(t)
	grant, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	cluster, owner := etcdtest.Uniq("c"), "o"
	v4, v6 := netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd01::5")
	part := func(pool string, addr netip.Addr) *Claim {
		put, err := cli.Put(ctx, keyspace.PoolKey(pool), "{}")
		if err != nil {
			t.Fatal(err)
		}
		return &Claim{Add: true, Lease: grant.ID, Pool: pool, Blocks: allocator.DefaultBlocks, PoolRev: put.Header.Revision,
			Addrs: []netip.Addr{addr}, OwnerKey: keyspace.OwnerKey(cluster, owner, "eth0", pool), Index: keyspace.OwnerRecord{IPs: []netip.Addr{addr}}}
	}
	p4, p6 := part(etcdtest.Uniq("v4"), v4), part(etcdtest.Uniq("v6"), v6)
	p4.PodKey, p4.NewPod = keyspace.PodKey(cluster, "n", owner), true
	held := keyspace.IPKey(p6.Pool, p6.Blocks, v6)
	if _, err := cli.Put(ctx, held, "{}"); err != nil {
		t.Fatal(err)
	}
	b := NewBatcher(cli, BatcherConfig{Timeout: 10 * time.Second})
	outs, err := b.CommitJoint(ctx, []*Claim{p4, p6})
	if err != nil {
		t.Fatal(err)
	}
	if outs[0].Applied || outs[1].Applied || outs[0].Addrs[0].Taken() || outs[1].Addrs[0].Holder == nil ||
		outs[0].PoolChanged || outs[1].PoolChanged {
		t.Fatalf("with the IPv6 address held: %+v; want neither applied, the IPv6 part naming its holder, no pool changed", outs)
	}
	for _, key := range []string{p4.OwnerKey, p4.PodKey, keyspace.IPKey(p4.Pool, p4.Blocks, v4), p6.OwnerKey} {
		if n := len(etcdtest.Dump(t, cli, key)); n != 0 {
			t.Fatalf("a refused joint claim wrote %s", key)
		}
	}
	if _, err := cli.Delete(ctx, held); err != nil {
		t.Fatal(err)
	}
	outs, err = b.CommitJoint(ctx, []*Claim{p4, p6})
	if err != nil || !outs[0].Applied || !outs[1].Applied || outs[0].Revision != outs[1].Revision {
		t.Fatalf("with both addresses free: %+v, %v; want both applied at one revision", outs, err)
	}
	for _, key := range []string{p4.OwnerKey, p4.PodKey, p6.OwnerKey, held} {
		if n := len(etcdtest.Dump(t, cli, key)); n != 1 {
			t.Fatalf("an applied joint claim did not write %s", key)
		}
	}
}
