package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
)

// Issues 23 and 27 in-process, against a real etcd: expired is not free, a deleted pod stays
// deleted, a running pod keeps its key. The same properties are proved with real processes,
// network namespaces and cut-offs by the fault run (integration/chaos).

// crash stops a as kill -9 would: nothing is revoked, given back or written any more; what
// the journal has not written yet is lost.
func crash(a *Agent) {
	a.closeOnce.Do(func() {
		a.jw.Abandon()
		a.cancel()
		a.wg.Wait()
		a.keeper.Abandon()
		a.jw.Close()
		a.unlock()
	})
}

// holdDelay is the tests' reuse delay: far longer than any of them runs.
const holdDelay = 5 * time.Minute

func withHold(dir string) func(*Config) {
	return func(c *Config) { c.StateDir, c.ReuseDelay, c.LivenessInterval, c.GCGrace = dir, holdDelay, -1, -1 }
}

// expire revokes the pod leases of owners on a, as etcd does a TTL after their agent was cut
// off: their keys go, their held keys (on the block lease) stay.
func expire(t *testing.T, cli *clientv3.Client, a *Agent, owners ...string) {
	t.Helper()
	for _, o := range owners {
		ps, ok := a.pods.Snapshot(o)
		if !ok || ps.Lease() == 0 {
			t.Fatalf("agent knows no lease of %s", o)
		}
		if _, err := cli.Revoke(context.Background(), ps.Lease()); err != nil && !keyspace.IsLeaseNotFound(err) {
			t.Fatal(err)
		}
	}
}

func allocOwner(t *testing.T, cli *clientv3.Client, pool allocator.PoolSpec, ip netip.Addr) string {
	t.Helper()
	resp, err := cli.Get(context.Background(), keyspace.IPKey(pool.Name, pool.Blocks, ip))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return ""
	}
	rec, _ := keyspace.Decode[keyspace.Allocation](string(resp.Kvs[0].Key), resp.Kvs[0].Value)
	return rec.Owner
}

// ownerIs is a condition for etcdtest.Eventually: that ip is allocated to owner want.
func ownerIs(t *testing.T, cli *clientv3.Client, pool allocator.PoolSpec, ip netip.Addr, want string) error {
	got := allocOwner(t, cli, pool, ip)
	return etcdtest.Saw(got == want, "%s allocated to %q, want %q", ip, got, want)
}

// TestExpiredAddressesAreHeldBackWhileThePoolHasRoom: a node is cut off (it stops renewing)
// and its pods' leases expire. Another node fills the pool: it gets every address no expired
// holder had first, then the expired ones (the longest expired first; never for a new sticky
// claim), then the pool is full.
// When the cut-off node comes back, it re-claims what was not taken and records the rest as
// conflicts; nothing was ever handed out twice.
func TestExpiredAddressesAreHeldBackWhileThePoolHasRoom(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.66.0.0/27", 29) // four blocks of 8
	cutDir := t.TempDir()
	cut := startAgent(t, cluster, "cut", "uid-cut", withHold(cutDir))
	other := startAgent(t, cluster, "other", "uid-other", withHold(t.TempDir()))
	held := map[netip.Addr]string{}
	var owners []string
	for i := range 6 {
		owner := fmt.Sprintf("cut-%d", i)
		res, err := cut.Add(ctx, addReq(pool, owner, "eth0", owner))
		if err != nil {
			t.Fatal(err)
		}
		held[addrs(res)[0]] = owner
		owners = append(owners, owner)
	}
	crash(cut)
	expire(t, cli, cut, owners...)
	for ip := range held {
		if o := allocOwner(t, cli, pool, ip); o != "" {
			t.Fatalf("%s still held by %s after its lease was revoked", ip, o)
		}
	}
	spec := pool
	if err := spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	size := int(spec.SetSize(0).Int64()) // without network, broadcast and gateway
	free := size - len(held)
	var got []netip.Addr
	for i := 0; ; i++ {
		if len(got) == free {
			// Only held-back addresses are left: a new sticky claim would keep one for its hold.
			_, err := other.Add(ctx, stickyReq(pool, "sts-0-c", "sts-0", "ns.sts-0"))
			if !errors.Is(err, allocator.ErrPoolExhausted) || !strings.Contains(err.Error(), "sticky claim does not take") {
				t.Errorf("a new sticky claim with only held-back addresses free: %v, want the pool exhausted for it", err)
			}
		}
		res, err := other.Add(ctx, addReq(pool, fmt.Sprintf("o-%d", i), "eth0", fmt.Sprintf("o-%d", i)))
		if errors.Is(err, allocator.ErrPoolExhausted) {
			break
		}
		if err != nil {
			t.Fatalf("ADD %d: %v", i, err)
		}
		a := addrs(res)[0]
		if _, ok := held[a]; ok && len(got) < free {
			t.Errorf("ADD %d got %s, an address held back for %s, while %d addresses no expired holder had were free",
				i, a, held[a], free-len(got))
		}
		got = append(got, a)
		if i > 40 {
			t.Fatal("the pool never ran out")
		}
	}
	if len(got) != size {
		t.Errorf("the pool of %d addresses gave %d before it was full: an ADD failed while an expired address was free", size, len(got))
	}
	if n := metricValue(t, other, "leasehold_expired_addresses_reused_total"); n != float64(len(held)) {
		t.Errorf("leasehold_expired_addresses_reused_total = %v, want %d", n, len(held))
	}
}

// TestACutOffNodeThatComesBackWithinTheDelayGetsEverythingBack: while the node is away other
// ADDs find room elsewhere; back, it re-claims every address with no conflict, its blocks are
// still its own, and what it does not re-claim (a pod deleted while it was away) is free at once.
func TestACutOffNodeThatComesBackWithinTheDelayGetsEverythingBack(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.67.0.0/26", 29)
	cutDir := t.TempDir()
	cut := startAgent(t, cluster, "cut", "uid-cut", withHold(cutDir))
	other := startAgent(t, cluster, "other", "uid-other", withHold(t.TempDir()))
	mine := map[string]netip.Addr{}
	var owners []string
	sandboxes := t.TempDir()
	for i := range 8 {
		owner := fmt.Sprintf("cut-%d", i)
		req := addReq(pool, owner, "eth0", owner)
		req.Netns = sandboxes + "/" + owner // the agent only looks whether the path exists
		if err := os.WriteFile(req.Netns, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		res, err := cut.Add(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		mine[owner] = addrs(res)[0]
		owners = append(owners, owner)
	}
	blocksBefore := blockClaims(t, cli, pool.Name)
	crash(cut)
	expire(t, cli, cut, owners...)
	for i := range 20 {
		res, err := other.Add(ctx, addReq(pool, fmt.Sprintf("o-%d", i), "eth0", fmt.Sprintf("o-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		for o, a := range mine {
			if addrs(res)[0] == a {
				t.Errorf("another node got %s of the cut-off node's %s while the pool had room", a, o)
			}
		}
	}
	for b, rec := range blocksBefore {
		if got := blockClaims(t, cli, pool.Name)[b]; got.Node != rec.Node {
			t.Errorf("block %s of the cut-off node is claimed by %q now", b, got.Node)
		}
	}
	// One pod was deleted while its node was away: its sandbox is gone, its DEL not sent.
	gone := owners[0]
	if err := os.Remove(sandboxes + "/" + gone); err != nil {
		t.Fatal(err)
	}
	back := startAgent(t, cluster, "cut", "uid-cut", withHold(cutDir))
	// The addresses are back in etcd before the agent has read the answers of its re-claims,
	// and it counts a conflict only after such an answer: wait for it to hold every pod again.
	etcdtest.Eventually(t, "the cut-off node's pods are re-claimed", func() error {
		for _, o := range owners[1:] {
			if err := ownerIs(t, cli, pool, mine[o], o); err != nil {
				return err
			}
		}
		lost := back.pods.Lost()
		return etcdtest.Saw(len(lost) == 0, "the agent still re-claims %v", lost)
	})
	if back.Conflicts() != 0 {
		t.Errorf("%d conflicts after coming back within the delay; want 0", back.Conflicts())
	}
	etcdtest.Eventually(t, "the held key of the pod deleted meanwhile is freed", etcdtest.Keys(t, cli, keyspace.HeldKey(pool.Name, pool.Blocks, mine[gone]), 0))
	for _, o := range owners[1:] {
		key := keyspace.HeldKey(pool.Name, pool.Blocks, mine[o])
		if len(etcdtest.Dump(t, cli, key)) != 1 {
			t.Errorf("re-claimed %s has no held key", mine[o])
		}
	}
}

// TestAnAgentStoppingWithNoPodGivesItsBlocksBackAtOnce: the reuse delay is for what expired,
// not for a node that left cleanly.
func TestAnAgentStoppingWithNoPodGivesItsBlocksBackAtOnce(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.68.0.0/27", 29)
	a := startAgent(t, cluster, "n", "uid-n", withHold(t.TempDir()))
	for i := range 10 {
		if _, err := a.Add(ctx, addReq(pool, fmt.Sprint(i), "eth0", fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 10 {
		if err := a.Del(ctx, addReq(pool, fmt.Sprint(i), "eth0", fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	if len(blockClaims(t, cli, pool.Name)) == 0 {
		t.Fatal("no block was claimed")
	}
	a.Close()
	if n := len(blockClaims(t, cli, pool.Name)); n != 0 {
		t.Errorf("%d block claims left by an agent that stopped with no pod", n)
	}
	if n := len(etcdtest.Dump(t, cli, keyspace.HeldPrefix(pool.Name))); n != 0 {
		t.Errorf("%d held keys left by an agent that stopped with no pod", n)
	}
}

// TestADeletedPodStaysDeletedAfterACrash: ADD, DEL answered, the agent killed at once (the
// journal's later writes lost) and started again: the pod is never brought back. And the pod
// added just before a crash is kept even if the agent stays away past its lease.
func TestADeletedPodStaysDeletedAfterACrash(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.69.0.0/24", 26)
	dir := t.TempDir()
	a := startAgent(t, cluster, "n", "uid-n", withHold(dir))
	for round := range 20 {
		owner, kept := fmt.Sprintf("del-%d", round), fmt.Sprintf("kept-%d", round)
		res, err := a.Add(ctx, addReq(pool, owner, "eth0", owner))
		if err != nil {
			t.Fatal(err)
		}
		ip := addrs(res)[0]
		kres, err := a.Add(ctx, addReq(pool, kept, "eth0", kept))
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Del(ctx, addReq(pool, owner, "eth0", owner)); err != nil {
			t.Fatal(err)
		}
		crash(a)                // right after the DEL's answer
		expire(t, cli, a, kept) // away past its lease: only the journal knows it
		a = startAgent(t, cluster, "n", "uid-n", withHold(dir))
		etcdtest.Eventually(t, "the pod added before the crash is re-claimed", func() error { return ownerIs(t, cli, pool, addrs(kres)[0], kept) })
		if o := allocOwner(t, cli, pool, ip); o == owner {
			t.Fatalf("round %d: %s's DEL was answered, and after a crash and restart it holds %s again", round, owner, ip)
		}
		if _, ok := a.pods.Snapshot(owner); ok {
			t.Fatalf("round %d: the restarted agent knows the deleted pod %s", round, owner)
		}
		if err := a.Del(ctx, addReq(pool, kept, "eth0", kept)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestADelOfAPodBeingReclaimedIsFinal: the pod's lease is lost and its DEL races the re-claim.
// Whichever goes first, the DEL's answer is final: no key of the pod is left, and nothing
// writes one later.
func TestADelOfAPodBeingReclaimedIsFinal(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.70.0.0/24", 26)
	a := startAgent(t, cluster, "n", "uid-n", withHold(t.TempDir()), func(c *Config) { c.LeaseTTL = 3 * time.Second })
	for round := range 8 {
		owner := fmt.Sprintf("race-%d", round)
		res, err := a.Add(ctx, addReq(pool, owner, "eth0", owner))
		if err != nil {
			t.Fatal(err)
		}
		ip := addrs(res)[0]
		// Hold the owner, so that the re-claim waits with the DEL until the lease is lost.
		own := a.locks.Lock(owner)
		expire(t, cli, a, owner)
		etcdtest.Eventually(t, "the agent finds the lease lost", func() error {
			_, lost := a.pods.LostPod(owner)
			return etcdtest.Saw(lost, "the agent holds %s's lease as live", owner)
		})
		var wg sync.WaitGroup
		var delErr error
		wg.Go(func() { delErr = a.Del(ctx, addReq(pool, owner, "eth0", owner)) })
		time.Sleep(time.Duration(round%4) * 5 * time.Millisecond) // let the re-claim or the DEL queue first
		own.Unlock()
		wg.Wait()
		if delErr != nil {
			t.Fatal(delErr)
		}
		// Give any late re-claim its chance, then look.
		etcdtest.Eventually(t, "the agent forgets the deleted pod", func() error {
			_, known := a.pods.Snapshot(owner)
			return etcdtest.Saw(!known, "the agent still knows %s", owner)
		})
		time.Sleep(200 * time.Millisecond)
		if o := allocOwner(t, cli, pool, ip); o == owner {
			t.Fatalf("round %d: %s holds %s after its DEL was answered", round, owner, ip)
		}
		if n := len(etcdtest.Dump(t, cli, keyspace.OwnerPrefix(cluster, owner))); n != 0 {
			t.Fatalf("round %d: %d owner keys of %s after its DEL", round, n, owner)
		}
	}
}

// TestNoAddGetsAnAddressOfTheNodesOwnExpiredPods: the node's pod leases expired (a freeze) and
// the agent has not re-claimed them yet; a burst of ADDs on the same node takes none of them,
// and every pod gets its address back.
func TestNoAddGetsAnAddressOfTheNodesOwnExpiredPods(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.71.0.0/26", 29)
	a := startAgent(t, cluster, "n", "uid-n", withHold(t.TempDir()))
	mine := map[netip.Addr]string{}
	var owners []string
	for i := range 6 {
		owner := fmt.Sprintf("run-%d", i)
		res, err := a.Add(ctx, addReq(pool, owner, "eth0", owner))
		if err != nil {
			t.Fatal(err)
		}
		mine[addrs(res)[0]] = owner
		owners = append(owners, owner)
	}
	var unlocks []*ownerlock.Owned
	for _, o := range owners {
		unlocks = append(unlocks, a.locks.Lock(o)) // no re-claim before the burst is done
	}
	expire(t, cli, a, owners...)
	etcdtest.Eventually(t, "the agent's view takes the expired allocations for free", func() error {
		// Gone, and found on this node's own block lease: nothing of another node holds them.
		v := a.pools.ViewOf(pool.Name)
		for ip := range mine {
			if ok, held := v.Inspect().Addr(ip).Allocated, v.Inspect().Addr(ip).Passed(); ok || held {
				return fmt.Errorf("%s allocated %v, held back %v", ip, ok, held)
			}
		}
		return nil
	})
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			res, err := a.Add(ctx, addReq(pool, fmt.Sprintf("new-%d", i), "eth0", fmt.Sprintf("new-%d", i)))
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if o, ok := mine[addrs(res)[0]]; ok {
				t.Errorf("a new pod got %s of the node's running pod %s", addrs(res)[0], o)
			}
		})
	}
	wg.Wait()
	for _, own := range unlocks {
		own.Unlock()
	}
	// The addresses are back in etcd before the agent has read the answers of its re-claims,
	// and it counts a conflict only after such an answer: wait for it to hold every pod again.
	etcdtest.Eventually(t, "every running pod holds its address again", func() error {
		for ip, o := range mine {
			if err := ownerIs(t, cli, pool, ip, o); err != nil {
				return err
			}
		}
		lost := a.pods.Lost()
		return etcdtest.Saw(len(lost) == 0, "the agent still re-claims %v", lost)
	})
	if a.Conflicts() != 0 {
		t.Errorf("%d conflicts: the node gave its own running pods' addresses away", a.Conflicts())
	}
}

// TestARunningPodGetsItsAddressBackWhenTheOtherHolderLetsItGo: while a pod's lease was lost
// another owner took its address; the re-claim records the conflict; when the other owner's
// DEL comes, the running pod holds its address again at once, and CHECK passes.
func TestARunningPodGetsItsAddressBackWhenTheOtherHolderLetsItGo(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.72.0.0/24", 26)
	a := startAgent(t, cluster, "a", "uid-a", withHold(t.TempDir()), func(c *Config) { c.Quarantine = 30 * time.Second })
	b := startAgent(t, cluster, "b", "uid-b", withHold(t.TempDir()), func(c *Config) { c.Quarantine = 30 * time.Second })
	res, err := a.Add(ctx, addReq(pool, "run", "eth0", "run"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	thief := takenWhileLost(t, cli, a, b, pool, "run", "thief", ip)
	etcdtest.Eventually(t, "the re-claim records the conflict", etcdtest.Keys(t, cli, keyspace.ConflictKey(cluster, "run", "eth0", pool.Name), 1))
	if _, err := a.Check(ctx, addReq(pool, "run", "eth0", "run")); !errors.Is(err, allocator.ErrConflict) {
		t.Errorf("CHECK of the conflicted pod: %v, want a conflict", err)
	}
	if err := b.Del(ctx, thief); err != nil {
		t.Fatal(err)
	}
	// etcd shows the address back before the agent has read the answer of its own commit:
	// wait for the agent to have counted the resolution too.
	etcdtest.Eventually(t, "the running pod holds its address again", func() error {
		if err := ownerIs(t, cli, pool, ip, "run"); err != nil {
			return err
		}
		n := metricValue(t, a, "leasehold_conflicts_resolved_total")
		return etcdtest.Saw(n == 1, "leasehold_conflicts_resolved_total = %v, want 1", n)
	})
	if _, err := a.Check(ctx, addReq(pool, "run", "eth0", "run")); err != nil {
		t.Errorf("CHECK after the conflict was resolved: %v", err)
	}
	if n := len(etcdtest.Dump(t, cli, keyspace.ConflictKey(cluster, "run", "eth0", pool.Name))); n != 0 {
		t.Errorf("the conflict record outlived the resolution")
	}
	if ps, _ := a.pods.Snapshot("run"); slices.ContainsFunc(ps.Attachments, func(at attachment) bool { return len(at.Conflicts) > 0 }) {
		t.Errorf("the pod's state still lists conflicts: %+v", ps.Attachments)
	}
}

// TestAReclaimThatFindsNoConflictEndsTheOldOnes: the agent took a conflicted address back
// (its other holder let it go) and crashed before its journal recorded it: started again with
// the pod's lease expired meanwhile, it re-claims from a journal that lists the address as
// taken, and finds it the pod's own. The re-claim's finding is what the pod has: no conflict
// is left in the agent's state (else the address is a conflict for good: no watch ends it,
// and the audit leaves its keys alone), and its key rewritten by hand without the lease is put
// back on it.
func TestAReclaimThatFindsNoConflictEndsTheOldOnes(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.79.0.0/24", 26)
	dir := t.TempDir()
	a := startAgent(t, cluster, "n", "uid-n", withHold(dir))
	res, err := a.Add(ctx, addReq(pool, "run", "eth0", "run"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	// The journal as written while another owner held ip, the resolution not written yet.
	own := a.locks.Lock("run")
	a.pods.Change(own).SetConflicts("eth0", pool.Name, []netip.Addr{ip})
	own.Unlock()
	if err := a.jw.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	crash(a)
	expire(t, cli, a, "run")
	a = startAgent(t, cluster, "n", "uid-n", withHold(dir), auditFast)
	k := keysOf(cluster, "n", "run", pool, ip)
	heldFor(t, cli, a, "run", k, ip) // re-claimed, with no conflict: nobody else holds ip
	if ps, _ := a.pods.Snapshot("run"); slices.ContainsFunc(ps.Attachments, func(at attachment) bool { return len(at.Conflicts) > 0 }) {
		t.Errorf("the re-claim found no conflict, and the pod's state lists conflicts: %+v", ps.Attachments)
	}
	// The pod's own value without its lease, as an admin's etcdctl put: no conflict watch
	// sees it (it waits for a deletion), the audit does, unless it takes ip for a conflict.
	kv, err := cli.Get(ctx, k.alloc)
	if err != nil || len(kv.Kvs) == 0 {
		t.Fatalf("%s: %v %v", k.alloc, kv, err)
	}
	if _, err := cli.Put(ctx, k.alloc, string(kv.Kvs[0].Value)); err != nil {
		t.Fatal(err)
	}
	heldFor(t, cli, a, "run", k, ip) // the audit puts it back on the pod's lease
}

// TestStaleSnapshotsNeverHandOutAHeldBackAddress: many nodes, more than the pool has blocks,
// so that most borrow from snapshots read while the pods of two nodes were still being
// added. The two nodes die; the others fill the pool: every address no expired holder had
// goes first, whatever a stale snapshot said (the claim compares the held key absent), then
// the held-back ones.
func TestStaleSnapshotsNeverHandOutAHeldBackAddress(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.73.0.0/23", 26) // 8 blocks for 12 nodes
	var agents []*Agent
	for i := range 12 {
		agents = append(agents, startAgent(t, cluster, fmt.Sprint("n", i), fmt.Sprint("u", i), withHold(t.TempDir())))
	}
	dead := map[netip.Addr]bool{}
	var owners [2][]string
	var mu sync.Mutex
	var wg sync.WaitGroup
	for n, a := range agents {
		wg.Go(func() {
			for j := range 20 {
				o := fmt.Sprintf("p%d-%d", n, j)
				res, err := a.Add(ctx, addReq(pool, o, "eth0", o))
				if err != nil {
					t.Error(err)
					return
				}
				if n < 2 {
					mu.Lock()
					dead[addrs(res)[0]], owners[n] = true, append(owners[n], o)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	for n := range 2 {
		crash(agents[n])
		expire(t, cli, agents[n], owners[n]...)
	}
	live := agents[2:]
	reused := 0
	for i := 0; ; i++ {
		res, err := live[i%len(live)].Add(ctx, addReq(pool, fmt.Sprint("f", i), "eth0", fmt.Sprint("f", i)))
		if errors.Is(err, allocator.ErrPoolExhausted) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if a := addrs(res)[0]; dead[a] {
			reused++
		} else if reused > 0 {
			t.Fatalf("ADD %d got %s, which no expired holder had, after %d held-back addresses were reused", i, a, reused)
		}
	}
	if reused != len(dead) {
		t.Errorf("%d of the %d held-back addresses were reused before the pool was exhausted", reused, len(dead))
	}
}

// TestAClaimOnALeaseReportedLostIsRenewedOrReclaimed: a spare lease whose renewals stopped
// while etcd had no leader is reported lost, though etcd, which extends every lease on a new
// leader, still has it; an ADD that took it just before sees its claim apply on it. The pod
// must not be left on a lease nobody renews: the agent resumes the lease, or, when etcd no
// longer has it, re-claims the pod.
func TestAClaimOnALeaseReportedLostIsRenewedOrReclaimed(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	a := startAgent(t, cluster, "n", "uid-n", withHold(t.TempDir()))
	alive, err := a.keeper.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	a.keeper.Forget(alive) // reported lost: no longer renewed
	own := a.locks.Lock("alive")
	a.loops.ClaimedOn(ctx, allocator.Request{}, own, alive)
	own.Unlock()
	if !a.keeper.Holds(alive) {
		t.Errorf("a pod's lease that etcd still has is not renewed")
	}
	gone, err := a.keeper.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	a.keeper.Forget(gone)
	if _, err := cli.Revoke(ctx, gone); err != nil {
		t.Fatal(err)
	}
	own = a.locks.Lock("gone") // keep the re-claim from running before the look
	a.loops.ClaimedOn(ctx, allocator.Request{}, own, gone)
	if _, lost := a.pods.LostPod("gone"); !lost {
		t.Errorf("a pod whose lease etcd no longer has is not queued for re-claim")
	}
	own.Unlock()
}

// TestTheRestOfAPodSurvivesADelOfOneAttachment: the pod's lease expired before the agent
// noticed, and the runtime deletes one of its two attachments, or replays a DEL of an older
// sandbox. The other attachment, and the pod, are re-claimed; the deleted one is not, and its
// held key is freed.
func TestTheRestOfAPodSurvivesADelOfOneAttachment(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.0.0/24", 26)
	a := startAgent(t, cluster, "a", "uid-a", withHold(t.TempDir()))
	eth0, err := a.Add(ctx, addReq(pool, "run", "eth0", "run"))
	if err != nil {
		t.Fatal(err)
	}
	net1, err := a.Add(ctx, addReq(pool, "run", "net1", "run"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := a.Add(ctx, addReq(pool, "other", "eth0", "other"))
	if err != nil {
		t.Fatal(err)
	}
	expire(t, cli, a, "run", "other")
	if err := a.Del(ctx, addReq(pool, "run", "eth0", "run")); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, addReq(pool, "other-old", "eth0", "other")); err != nil { // an older sandbox's
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "the attachments not deleted are re-claimed", func() error {
		return errors.Join(ownerIs(t, cli, pool, addrs(net1)[0], "run"), ownerIs(t, cli, pool, addrs(other)[0], "other"))
	})
	etcdtest.Eventually(t, "the deleted attachment's held key is freed", etcdtest.Keys(t, cli, keyspace.HeldKey(pool.Name, pool.Blocks, addrs(eth0)[0]), 0))
	if o := allocOwner(t, cli, pool, addrs(eth0)[0]); o != "" {
		t.Errorf("the deleted attachment's %s is held by %q", addrs(eth0)[0], o)
	}
}

// TestAConflictOutlivesARepeatedAddAndLeavesWithItsAttachment: a conflicted attachment's ADD
// is repeated (the owner index does not list its conflicts, the agent does), and the conflict
// is still resolved when the other holder lets go; a conflicted attachment deleted while its
// pod keeps another takes its conflict record with it.
func TestAConflictOutlivesARepeatedAddAndLeavesWithItsAttachment(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.75.0.0/24", 26)
	quarantine := func(c *Config) { c.Quarantine = 30 * time.Second }
	a := startAgent(t, cluster, "a", "uid-a", withHold(t.TempDir()), quarantine)
	b := startAgent(t, cluster, "b", "uid-b", withHold(t.TempDir()), quarantine)
	conflict := func(ifName string) (netip.Addr, allocator.Request) {
		res, err := a.Add(ctx, addReq(pool, "run", ifName, "run"))
		if err != nil {
			t.Fatal(err)
		}
		ip := addrs(res)[0]
		thief := takenWhileLost(t, cli, a, b, pool, "run", "thief-"+ifName, ip)
		etcdtest.Eventually(t, "the re-claim records the conflict", etcdtest.Keys(t, cli, keyspace.ConflictKey(cluster, "run", ifName, pool.Name), 1))
		return ip, thief
	}
	ip, thief := conflict("eth0")
	if _, err := a.Add(ctx, addReq(pool, "run", "eth0", "run")); err != nil {
		t.Fatalf("repeated ADD: %v", err)
	}
	if err := b.Del(ctx, thief); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "the running pod holds its address again after a repeated ADD", func() error { return ownerIs(t, cli, pool, ip, "run") })
	conflict("net1")
	if err := a.Del(ctx, addReq(pool, "run", "net1", "run")); err != nil {
		t.Fatal(err)
	}
	if n := len(etcdtest.Dump(t, cli, keyspace.ConflictKey(cluster, "run", "net1", pool.Name))); n != 0 {
		t.Errorf("the conflict record of the deleted attachment is left while its pod lives")
	}
}

// TestWhatGCReleasedStaysReleasedAfterACrash: GC answers once the journal records what it
// released: a crash right after, and the agent away past the TTL, bring nothing back.
func TestWhatGCReleasedStaysReleasedAfterACrash(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.76.0.0/24", 26)
	dir := t.TempDir()
	noGrace := func(c *Config) { c.GCGrace = -1 }
	a := startAgent(t, cluster, "a", "uid-a", withHold(dir), noGrace)
	for round := range 5 {
		gone, kept := fmt.Sprintf("gc-%d", round), fmt.Sprintf("kept-%d", round)
		for _, o := range []string{gone, kept} {
			if _, err := a.Add(ctx, addReq(pool, o, "eth0", o)); err != nil {
				t.Fatal(err)
			}
		}
		gc := allocator.GCRequest{Network: pool.Name, Pool: pool, ValidAttachments: []allocator.Attachment{{ContainerID: kept, IfName: "eth0"}}}
		if err := a.GC(ctx, gc); err != nil {
			t.Fatal(err)
		}
		crash(a)
		expire(t, cli, a, kept)
		a = startAgent(t, cluster, "a", "uid-a", withHold(dir), noGrace)
		etcdtest.Eventually(t, "the kept pod is re-claimed", etcdtest.Keys(t, cli, keyspace.OwnerPrefix(cluster, kept), 1))
		if n := len(etcdtest.Dump(t, cli, keyspace.OwnerPrefix(cluster, gone))); n != 0 {
			t.Fatalf("round %d: the attachment GC released came back after a crash", round)
		}
		if err := a.Del(ctx, addReq(pool, kept, "eth0", kept)); err != nil {
			t.Fatal(err)
		}
	}
}

// awayPastTheDelay runs pod "run" on node "away", which then stops renewing for longer than
// TTL plus the reuse delay: the pod's lease expires, then the block lease holding its held
// key. It returns the node's state directory (to bring it back), another node "b", and the
// running pod's address, free in etcd now. Each of before runs on the agent just before it
// stops.
func awayPastTheDelay(t *testing.T, cluster string, pool allocator.PoolSpec, before ...func(*Agent)) (string, *Agent, netip.Addr) {
	t.Helper()
	cli, ctx := etcdtest.Client(t), ctxT(t)
	dir := t.TempDir()
	a := startAgent(t, cluster, "away", "uid-away", withHold(dir))
	b := startAgent(t, cluster, "b", "uid-b", withHold(t.TempDir()))
	res, err := a.Add(ctx, addReq(pool, "run", "eth0", "run"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	for _, f := range before {
		f(a)
	}
	crash(a)
	expire(t, cli, a, "run")
	held, err := cli.Get(ctx, keyspace.HeldKey(pool.Name, pool.Blocks, ip))
	if err != nil || len(held.Kvs) != 1 {
		t.Fatalf("held key of %s: %v %v", ip, held, err)
	}
	if _, err := cli.Revoke(ctx, keyspace.LeaseOf(held.Kvs[0])); err != nil {
		t.Fatal(err)
	}
	return dir, b, ip
}

// takenThenBack has b's pod req ask for ip, the running pod's address, free after
// awayPastTheDelay; then node "away" comes back (its state in dir), finds it taken and records
// the conflict. It returns the agent back.
func takenThenBack(t *testing.T, b *Agent, req allocator.Request, ip netip.Addr, cluster, dir string) *Agent {
	t.Helper()
	req.RequestedIPs = []netip.Addr{ip}
	if _, err := b.Add(ctxT(t), req); err != nil {
		t.Fatalf("another pod asks for the address, free now: %v", err)
	}
	back := startAgent(t, cluster, "away", "uid-away", withHold(dir))
	// The re-claim counts the conflict once etcd answered its claim, and only after the answer
	// of the pod record that follows does it record the pod, conflict and all, for its journal:
	// wait for the journal to hold the conflict too.
	etcdtest.Eventually(t, "the running pod's re-claim records the conflict", func() error {
		if n := back.Conflicts(); n != 1 {
			return fmt.Errorf("%d conflicts", n)
		}
		return journalsConflict(dir, "run", ip)
	})
	return back
}

// journalsConflict is a condition for etcdtest.Eventually: that the journal in dir lists ip
// as a conflict of owner's attachment.
func journalsConflict(dir, owner string, ip netip.Addr) error {
	l, errs := podbook.Load(dir)
	for _, ps := range l.Pods {
		if ps.Owner != owner {
			continue
		}
		for _, at := range ps.Attachments {
			if slices.Contains(at.Conflicts, ip) {
				return nil
			}
		}
		return fmt.Errorf("the journal lists %s's attachments %+v without the conflict on %s (load errors %v)", owner, ps.Attachments, ip, errs)
	}
	return fmt.Errorf("the journal does not list %s (load errors %v)", owner, errs)
}

// takenWhileLost loses the lease of a's pod owner and has b's pod thief ask for ip, one of
// owner's addresses, meanwhile; the re-claim that follows finds ip taken. It returns thief's
// request.
func takenWhileLost(t *testing.T, cli *clientv3.Client, a, b *Agent, pool allocator.PoolSpec, owner, thief string,
	ip netip.Addr) allocator.Request {
	t.Helper()
	own := a.locks.Lock(owner)
	defer own.Unlock()
	expire(t, cli, a, owner)
	req := addReq(pool, thief, "eth0", thief)
	req.RequestedIPs = []netip.Addr{ip}
	if _, err := b.Add(ctxT(t), req); err != nil {
		t.Fatalf("another node asks for the expired address: %v", err)
	}
	return req
}

// hadAndLetGo has b's pod "thief" ask for ip, then deletes it.
func hadAndLetGo(t *testing.T, b *Agent, pool allocator.PoolSpec, ip netip.Addr) {
	t.Helper()
	thief := addReq(pool, "thief", "eth0", "thief")
	thief.RequestedIPs = []netip.Addr{ip}
	if _, err := b.Add(ctxT(t), thief); err != nil {
		t.Fatalf("another node asks for the address, free now: %v", err)
	}
	if err := b.Del(ctxT(t), thief); err != nil {
		t.Fatal(err)
	}
}

// TestAnAddressHadMeanwhileIsAConflictEvenIfLetGo: a node is away longer than the reuse
// delay, so its block lease and held keys are gone; another pod asks for its running pod's
// address, gets it, and is deleted before the node comes back. The re-claim finds the
// address free, and yet two pods ran with it at once: the agent counts and logs the conflict
// it reads in etcd's history.
func TestAnAddressHadMeanwhileIsAConflictEvenIfLetGo(t *testing.T) {
	cluster, cli := etcdtest.Uniq("c"), etcdtest.Client(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.73.0.0/24", 26)
	dir, b, ip := awayPastTheDelay(t, cluster, pool)
	hadAndLetGo(t, b, pool, ip)
	back := startAgent(t, cluster, "away", "uid-away", withHold(dir))
	etcdtest.Eventually(t, "the running pod's address is re-claimed", func() error { return ownerIs(t, cli, pool, ip, "run") })
	etcdtest.Eventually(t, "the conflict had meanwhile is counted", func() error {
		return etcdtest.Saw(back.Conflicts() == 1, "%d conflicts", back.Conflicts())
	})
	if got := back.Conflicts(); got != 1 {
		t.Errorf("%d conflicts counted; want 1", got)
	}
}

// TestAReleasedClaimGivesUpARunningPodsAddress: a node is away longer than the reuse delay; a
// StatefulSet pod's new sticky claim takes its running pod's address (free by then) and so is
// that pod's conflict. The StatefulSet pod is deleted: the claim would keep the address for a
// day, and its next pod would be refused for as long as the running pod lives. Instead the
// running pod, which had it first, takes it back, and the claim gives it up: its next pod gets
// a new address.
func TestAReleasedClaimGivesUpARunningPodsAddress(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.0.0/24", 26)
	dir, b, ip := awayPastTheDelay(t, cluster, pool)
	sts := stickyReq(pool, "web-2-a", "web-2-a", "ns.web-2")
	takenThenBack(t, b, sts, ip, cluster, dir)
	if err := b.Del(ctx, sts); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "the running pod holds its address again", func() error { return ownerIs(t, cli, pool, ip, "run") })
	claimKey := keyspace.ClaimKey(cluster, pool.Name, "ns.web-2")
	if rec, ok := readClaimRecord(t, cli, claimKey); ok {
		t.Errorf("the claim kept %v after giving up its only address", rec.IPs)
	}
	if q, err := cli.Get(ctx, keyspace.QuarantineKey(pool.Name, pool.Blocks, ip)); err != nil || len(q.Kvs) != 0 {
		t.Errorf("the running pod's address still rests under the claim: %v %v", q, err)
	}
	next, err := b.Add(ctx, stickyReq(pool, "web-2-b", "web-2-b", "ns.web-2"))
	if err != nil {
		t.Fatalf("the claim's next pod: %v", err)
	}
	if got := addrs(next); len(got) != 1 || got[0] == ip {
		t.Errorf("the claim's next pod got %v; want one new address, not the running pod's %s", got, ip)
	}
	if rec, ok := readClaimRecord(t, cli, claimKey); !ok || !slices.Equal(rec.IPs, addrs(next)) {
		t.Errorf("the claim holds %v (present %v); want the next pod's %v", rec.IPs, ok, addrs(next))
	}
}

// TestAConflictedAddressIsHeldForItsRunningPod: a node away past the reuse delay comes back to
// find its running pod's address taken: a conflict, and a wanted key. The node is cut off
// again (its agent stops), and the other holder lets the address go meanwhile: no other ADD
// gets it, asked for or not, although the pool has room; when the node is back, its pod
// takes it back and the wanted key goes.
func TestAConflictedAddressIsHeldForItsRunningPod(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.75.0.0/24", 26)
	dir, b, ip := awayPastTheDelay(t, cluster, pool)
	thief := addReq(pool, "thief", "eth0", "thief")
	back := takenThenBack(t, b, thief, ip, cluster, dir)
	wantedKey := keyspace.WantedKey(pool.Name, pool.Blocks, ip, cluster, "run")
	if resp, err := cli.Get(ctx, wantedKey); err != nil || len(resp.Kvs) != 1 || !back.blockLeases.mine(keyspace.LeaseOf(resp.Kvs[0])) {
		t.Fatalf("wanted key %s: %v %v; want it on the node's block lease", wantedKey, resp, err)
	}
	if err := back.jw.Sync(ctx); err != nil { // the journal has the conflict, as it has within milliseconds
		t.Fatal(err)
	}
	crash(back) // cut off again, within the TTL
	if err := b.Del(ctx, thief); err != nil {
		t.Fatal(err)
	}
	third := startAgent(t, cluster, "third", "uid-third")
	asked := addReq(pool, "asks", "eth0", "asks")
	asked.RequestedIPs = []netip.Addr{ip}
	if _, err := third.Add(ctx, asked); !errors.Is(err, allocator.ErrAddressInUse) || !strings.Contains(err.Error(), "wanted back") {
		t.Errorf("an ADD asking for the conflicted address while its pod's node is away: %v; want it in use, wanted back", err)
	}
	for i := range 70 { // more than a block: the search walks past the address
		res, err := third.Add(ctx, addReq(pool, fmt.Sprint("new-", i), "eth0", fmt.Sprint("new-", i)))
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(addrs(res), ip) {
			t.Fatalf("ADD %d got %s, which the running pod wants back, while the pool has room", i, ip)
		}
	}
	startAgent(t, cluster, "away", "uid-away", withHold(dir))
	etcdtest.Eventually(t, "the running pod holds its address again", func() error { return ownerIs(t, cli, pool, ip, "run") })
	if resp, err := cli.Get(ctx, wantedKey); err != nil || len(resp.Kvs) != 0 {
		t.Errorf("wanted key after the pod got its address back: %v %v", resp, err)
	}
}

// TestADelAnsweredWhileAwayReportsWhoHadTheAddress: a pod's DEL is answered while its node is
// cut off (journaled, released once etcd answers); the node stays away past the reuse delay,
// so the pod's keys expire and another pod gets its address, and lets it go again, before the
// node is back. Nothing is left to release then, and yet two pods ran with one address: the
// agent reads it in etcd's history and logs the conflict.
func TestADelAnsweredWhileAwayReportsWhoHadTheAddress(t *testing.T) {
	cluster, cli := etcdtest.Uniq("c"), etcdtest.Client(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.76.0.0/24", 26)
	// The DEL as a cut-off agent answers it (deferRelease), then the agent is gone. It is
	// answered after the other pod below got the address (a cut-off agent cannot know that):
	// the answer's time says so.
	dir, b, ip := awayPastTheDelay(t, cluster, pool, func(a *Agent) {
		own := a.locks.Lock("run")
		a.pods.Change(own).MarkReleased("eth0", pool.Name, "run", time.Now().Add(time.Minute))
		own.Unlock()
		if err := a.jw.Sync(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	})
	hadAndLetGo(t, b, pool, ip)
	back := startAgent(t, cluster, "away", "uid-away", withHold(dir))
	etcdtest.Eventually(t, "the overlap found at the DEL is counted", func() error {
		return etcdtest.Saw(back.Conflicts() == 1, "%d conflicts", back.Conflicts())
	})
	if n := allocOwner(t, cli, pool, ip); n != "" {
		t.Errorf("%s is allocated to %q; the deleted pod's DEL must leave it free", ip, n)
	}
}

// TestADelAfterACompactionReportsWhoHoldsTheAddress: as above, but the other pod still holds
// the address when the node is back and the DEL is processed, and etcd's history was
// compacted meanwhile (a compaction, or a restore marked compacted): the history no longer
// names that pod, the key does, and the agent logs the conflict.
func TestADelAfterACompactionReportsWhoHoldsTheAddress(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.77.0.0/24", 26)
	dir, b, ip := awayPastTheDelay(t, cluster, pool, func(a *Agent) {
		own := a.locks.Lock("run")
		a.pods.Change(own).MarkReleased("eth0", pool.Name, "run", time.Now().Add(time.Minute))
		own.Unlock()
		if err := a.jw.Sync(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	})
	thief := addReq(pool, "thief", "eth0", "thief")
	thief.RequestedIPs = []netip.Addr{ip}
	if _, err := b.Add(ctx, thief); err != nil {
		t.Fatalf("another node asks for the address, free now: %v", err)
	}
	now, err := cli.Get(ctx, "/", clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, now.Header.Revision); err != nil {
		t.Fatal(err)
	}
	back := startAgent(t, cluster, "away", "uid-away", withHold(dir))
	etcdtest.EventuallyTrue(t, "the overlap found at the DEL is counted", func() bool {
		return back.Conflicts() == 1
	})
	if n := allocOwner(t, cli, pool, ip); n != "thief" {
		t.Errorf("%s is allocated to %q; the deleted pod's DEL must leave it to the other pod", ip, n)
	}
}

// TestAStaleViewIsListedAgainBeforeAHeldBackAddressIsReused: a node whose view is behind etcd
// (an agent paused while its pods' neighbours were deleted: the watch events wait) believes
// its block full. The pool's other block holds back a dead node's addresses. The ADD must not
// take one of those while its own block has room in etcd: it checks its view against etcd,
// lists the pool again, and gets the free address.
func TestAStaleViewIsListedAgainBeforeAHeldBackAddressIsReused(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.75.0.0/27", 28) // two blocks: one per node
	dead := startAgent(t, cluster, "dead", "u-dead", withHold(t.TempDir()))
	live := startAgent(t, cluster, "live", "u-live", withHold(t.TempDir()))
	// fill gives n more pods to ag; all land in its one block, claimed by the first.
	fill := func(ag *Agent, name string, n int) (block netip.Prefix, owners []string, got []netip.Addr) {
		for i := range n {
			o := fmt.Sprintf("%s-%d", name, i)
			res, err := ag.Add(ctx, addReq(pool, o, "eth0", o))
			if err != nil {
				t.Fatalf("ADD %s: %v", o, err)
			}
			ip := addrs(res)[0]
			if i == 0 {
				block = netip.PrefixFrom(ip, 28).Masked()
			} else if !block.Contains(ip) {
				t.Fatalf("ADD %s got %s, outside its node's block %s", o, ip, block)
			}
			owners, got = append(owners, o), append(got, ip)
		}
		return block, owners, got
	}
	liveBlock, _, _ := fill(live, "live", 1)
	p, err := live.pools.Ensure(ctx, allocator.PoolSpec{Name: pool.Name})
	if err != nil {
		t.Fatal(err)
	}
	room := func(block netip.Prefix) int {
		n := 0
		for a := block.Addr(); block.Contains(a); a = a.Next() {
			if p.Spec.Allocatable(a) == nil {
				n++
			}
		}
		return n
	}
	other := netip.MustParsePrefix("10.75.0.0/28")
	if other == liveBlock {
		other = netip.MustParsePrefix("10.75.0.16/28")
	}
	deadBlock, deadOwners, _ := fill(dead, "dead", room(other))
	if deadBlock == liveBlock {
		t.Fatalf("both nodes in block %s", deadBlock)
	}
	_, _, more := fill(live, "live-more", room(liveBlock)-2)
	crash(dead)
	expire(t, cli, dead, deadOwners...) // held back for them on the block lease
	// The last free address of the live node's block, which its view believes allocated.
	var free netip.Addr
	taken := map[netip.Addr]bool{}
	for _, a := range more {
		taken[a] = true
	}
	for a := liveBlock.Addr(); liveBlock.Contains(a); a = a.Next() {
		if p.Spec.Allocatable(a) == nil && !taken[a] && !live.pods.OwnsAddr(pool.Name, a) {
			free = a
		}
	}
	if !free.IsValid() {
		t.Fatalf("no free address left in %s (room %d, given %v)", liveBlock, room(liveBlock), more)
	}
	p.View.MarkAllocated(free, 1)
	res, err := live.Add(ctx, addReq(pool, "new", "eth0", "new"))
	if err != nil {
		t.Fatal(err)
	}
	if got := addrs(res)[0]; got != free {
		t.Errorf("the ADD got %s, not %s, the address its node's block had free in etcd", got, free)
	}
}
