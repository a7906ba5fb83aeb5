package leases

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
)

func TestDelReleasesOnlyTheOwnersKeysAndGivesUpTheLease(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	pool := dualStack(etcdtest.Uniq("p"), "10.4.0.0/24", "fd04::/64")
	ctx := ctxT(t)
	var dropped []netip.Addr
	for _, c := range []string{"keep", "drop"} {
		res, err := a.Add(ctx, addReq(pool, c, "eth0", "uid-"+c))
		if err != nil {
			t.Fatalf("add %s: %v", c, err)
		}
		if c == "drop" {
			dropped = addrs(res)
		}
	}
	cli := etcdtest.Client(t)
	before := etcdtest.Dump(t, cli, keyspace.Prefix)
	dropLease, _ := a.pods.Lease("uid-drop")
	if err := a.Del(ctx, addReq(pool, "drop", "eth0", "uid-drop")); err != nil {
		t.Fatalf("del: %v", err)
	}
	if err := a.Del(ctx, addReq(pool, "drop", "eth0", "uid-drop")); err != nil {
		t.Fatalf("repeated del must succeed: %v", err)
	}
	after := etcdtest.Dump(t, cli, keyspace.Prefix)
	for k, l := range before {
		_, still := after[k]
		// The owner's keys: those on its lease, and the held keys of its addresses.
		_, _, ip, err := keyspace.ParseHeldKey(k)
		mine := l == int64(dropLease) || err == nil && slices.Contains(dropped, ip)
		if mine && still {
			t.Errorf("key %s of the deleted owner survived DEL", k)
		}
		if !mine && !still {
			t.Errorf("DEL of another owner removed %s", k)
		}
	}
	givenUp(t, cli, a.keeper, dropLease)
}

// givenUp checks that a gone pod's lease was given up: revoked, or recycled as a spare with
// no key left on it.
func givenUp(t *testing.T, cli *clientv3.Client, k *keeper.Keeper, lease clientv3.LeaseID) {
	t.Helper()
	ttl, err := cli.TimeToLive(context.Background(), lease, clientv3.WithAttachedKeys())
	switch {
	case err != nil:
		t.Errorf("pod lease %s: %v", keyspace.LeaseHex(lease), err)
	case ttl.TTL <= 0: // revoked
	case len(ttl.Keys) > 0 || !slices.Contains(spares(k), lease):
		t.Errorf("pod lease %s is alive with keys %q and is not a spare; want it revoked, or a spare without keys",
			keyspace.LeaseHex(lease), ttl.Keys)
	}
}

func TestStaleDelOfAnotherContainerReleasesNothing(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	pool := dualStack(etcdtest.Uniq("p"), "10.5.0.0/24", "fd05::/64")
	ctx := ctxT(t)
	first, err := a.Add(ctx, addReq(pool, "sandbox-1", "eth0", "pod-uid"))
	if err != nil {
		t.Fatal(err)
	}
	// The pod's sandbox is re-created without a DEL: the attachment moves to the new container.
	second, err := a.Add(ctx, addReq(pool, "sandbox-2", "eth0", "pod-uid"))
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(first) != fmt.Sprint(second) {
		t.Errorf("same pod, same interface: want the same addresses, got %v then %v", first, second)
	}
	// The old sandbox's late DEL must not release the new sandbox's addresses.
	if err := a.Del(ctx, addReq(pool, "sandbox-1", "eth0", "pod-uid")); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Check(ctx, addReq(pool, "sandbox-2", "eth0", "pod-uid")); err != nil {
		t.Errorf("CHECK of the new sandbox after the stale DEL: %v", err)
	}
}

func TestQuarantineHoldsReleasedAddress(t *testing.T) {
	const quarantine = 3 * time.Second
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1", func(c *Config) { c.Quarantine = quarantine })
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.12.0.0/30")}}}}
	ctx := ctxT(t)
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "")) // the /30's only address: .2
	if err != nil {
		t.Fatal(err)
	}
	// The quarantine holds from the release transaction, which runs inside Del: measure from
	// before the call, so time Del spends after its transaction cannot shorten it.
	released := time.Now()
	if err := a.Del(ctx, addReq(pool, "c1", "eth0", "")); err != nil {
		t.Fatal(err)
	}
	// The agent's view knows its own release when DEL returns, not once the watch brings it.
	if allocated, quarantined, _, _ := a.pools.ViewOf(pool.Name).Counts(); allocated != 0 || quarantined != 1 {
		t.Errorf("view right after DEL: %d allocated, %d quarantined; want 0 and 1", allocated, quarantined)
	}
	_, err = a.Add(ctx, addReq(pool, "c2", "eth0", ""))
	switch {
	case errors.Is(err, allocator.ErrOnlyQuarantined) && errors.Is(err, allocator.ErrPoolExhausted):
	case err == nil && time.Since(released) >= quarantine:
		// A busy machine let the quarantine pass before the ADD was asked: it may succeed.
		t.Logf("the ADD came %s after the release, past the quarantine: its refusal is not checked", time.Since(released))
	default:
		t.Fatalf("while quarantined: want ErrOnlyQuarantined, got %v", err)
	}
	var got allocator.Result
	etcdtest.Eventually(t, "the address leaves quarantine", func() error {
		got, err = a.Add(ctx, addReq(pool, "c2", "eth0", ""))
		return err
	})
	if waited := time.Since(released); waited < quarantine {
		t.Errorf("address reused after %s, before the %s quarantine", waited, quarantine)
	}
	if got.IPs[0].Address != res.IPs[0].Address {
		t.Errorf("want the released %s again, got %s", res.IPs[0].Address, got.IPs[0].Address)
	}
}

// TestStaleDelAfterTheAddressWentToAnotherOwner is the ABA case: owner A's address is released,
// rests in quarantine, goes to owner B; A's DEL replayed now must not touch B.
func TestStaleDelAfterTheAddressWentToAnotherOwner(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1", func(c *Config) { c.Quarantine = 2 * time.Second })
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.13.0.0/30")}}}}
	ctx := ctxT(t)
	first, err := a.Add(ctx, addReq(pool, "ctr-a", "eth0", "uid-a"))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, addReq(pool, "ctr-a", "eth0", "uid-a")); err != nil {
		t.Fatal(err)
	}
	var second allocator.Result
	etcdtest.Eventually(t, "owner B's ADD succeeds once the quarantine ends", func() error {
		second, err = a.Add(ctx, addReq(pool, "ctr-b", "eth0", "uid-b"))
		return err
	})
	if second.IPs[0].Address != first.IPs[0].Address {
		t.Fatalf("owner B should get A's old address %s after quarantine: %v %v", first.IPs[0].Address, second, err)
	}
	if err := a.Del(ctx, addReq(pool, "ctr-a", "eth0", "uid-a")); err != nil {
		t.Fatalf("replayed DEL: %v", err)
	}
	if _, err := a.Check(ctx, addReq(pool, "ctr-b", "eth0", "uid-b")); err != nil {
		t.Errorf("owner B lost its address to A's replayed DEL: %v", err)
	}
}

// countingKV wraps a client's real KV API and counts its Get calls, and in under those of
// the key prefix, if set.
type countingKV struct {
	clientv3.KV
	gets   atomic.Int64
	prefix string
	under  atomic.Int64
}

func (c *countingKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	c.gets.Add(1)
	if c.prefix != "" && key == c.prefix {
		c.under.Add(1)
	}
	return c.KV.Get(ctx, key, opts...)
}

// TestDelCountsWhatIsLeftInItsOwnTransaction: the release transaction itself counts the
// owner's attachments left, and the agent remembers the owner index it wrote, so a DEL reads
// nothing before its transaction: the pod lease stays while another attachment of the pod
// lives and is given up with the last one.
func TestDelCountsWhatIsLeftInItsOwnTransaction(t *testing.T) { delReadsNothingFirst(t, false) }

// TestDelAfterAReclaimReadsNothingFirst: a re-claim rewrites the owner indexes on a new lease;
// the agent remembers the revisions it wrote, so the DELs that follow read nothing either.
func TestDelAfterAReclaimReadsNothingFirst(t *testing.T) { delReadsNothingFirst(t, true) }

func delReadsNothingFirst(t *testing.T, reclaimFirst bool) {
	cli := etcdtest.Client(t)
	kv := &countingKV{KV: cli.KV}
	cli.KV = kv
	ctx := ctxT(t)
	a, err := Start(ctx, cli, Config{Cluster: etcdtest.Uniq("c"), Node: "n1", NodeUID: "uid1", LeaseTTL: 10 * time.Second,
		Quarantine: time.Minute, SpareLeases: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.5.0.0/24")}}}}
	for _, ifName := range []string{"eth0", "net1"} {
		if _, err := a.Add(ctx, addReq(pool, "ctr", ifName, "uid-two")); err != nil {
			t.Fatalf("add %s: %v", ifName, err)
		}
	}
	lease, ok := a.pods.Lease("uid-two")
	if !ok {
		t.Fatal("no pod lease after ADD")
	}
	if reclaimFirst {
		if _, err := cli.Revoke(ctx, lease); err != nil {
			t.Fatal(err)
		}
		lost := lease
		etcdtest.Eventually(t, "the pod is re-claimed after its lease's revoke", func() error {
			if l, ok := a.pods.Lease("uid-two"); ok {
				lease = l
			}
			return etcdtest.Saw(lease != lost, "the pod's lease is still the revoked %x", lost)
		})
		if got := etcdtest.Dump(t, cli, keyspace.OwnerPrefix(a.cfg.Cluster, "uid-two")); len(got) != 2 || got[keyspace.OwnerKey(a.cfg.Cluster, "uid-two", "net1", pool.Name)] != int64(lease) {
			t.Fatalf("owner index after the re-claim: %v, want both attachments on lease %x", got, lease)
		}
	}
	del := func(ifName string) {
		t.Helper()
		before := kv.gets.Load()
		if err := a.Del(ctx, addReq(pool, "ctr", ifName, "uid-two")); err != nil {
			t.Fatalf("del %s: %v", ifName, err)
		}
		if n := kv.gets.Load() - before; n != 0 {
			t.Errorf("DEL of %s made %d Get requests, want none", ifName, n)
		}
	}
	del("eth0")
	if ttl, err := cli.TimeToLive(ctx, lease); err != nil || ttl.TTL <= 0 {
		t.Fatalf("pod lease after the first of two DELs: ttl=%v err=%v; want it kept for net1", ttl.TTL, err)
	}
	if got := etcdtest.Dump(t, cli, keyspace.OwnerPrefix(a.cfg.Cluster, "uid-two")); len(got) != 1 {
		t.Fatalf("owner index after DEL of eth0: %v, want net1's alone", got)
	}
	del("net1")
	givenUp(t, cli, a.keeper, lease)
	if got := etcdtest.Dump(t, cli, keyspace.PodKey(a.cfg.Cluster, "n1", "uid-two")); len(got) != 0 {
		t.Errorf("pod record after the last DEL: %v", got)
	}
}

// waitSpares waits for at least n spares.
func waitSpares(t *testing.T, k *keeper.Keeper, n int) {
	t.Helper()
	etcdtest.Eventually(t, fmt.Sprintf("at least %d spares", n), func() error {
		have := len(spares(k))
		return etcdtest.Saw(have >= n, "%d spares", have)
	})
}

// podWithRoomForItsLease starts an agent with 10 spare leases and ADDs pod uid-a (container
// "a", eth0) into a pool of subnet, leaving the keeper room to take the pod's lease back.
func podWithRoomForItsLease(t *testing.T, cluster, subnet string) (*Agent, allocator.PoolSpec, clientv3.LeaseID) {
	t.Helper()
	a := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.SpareLeases = 10; c.Quarantine = time.Minute })
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix(subnet)}}}}
	// A first pod makes the node claim its block, on a lease of its own taken from the spares.
	if _, err := a.Add(ctxT(t), addReq(pool, "first", "eth0", "uid-first")); err != nil {
		t.Fatal(err)
	}
	// 10, less the node lease if it took a spare, less the block and first pod leases; the
	// next ADD leaves more than the low water (5), so nothing refills the room away.
	waitSpares(t, a.keeper, 7)
	if _, err := a.Add(ctxT(t), addReq(pool, "a", "eth0", "uid-a")); err != nil {
		t.Fatal(err)
	}
	return a, pool, clientv3.LeaseID(mustLease(t, a, "uid-a"))
}

// TestDelRecyclesTheEmptyPodLeaseAsASpare: the release of a pod's last attachment deletes
// its pod record too, so no key is left on its lease, and the keeper takes the lease back
// as a spare instead of revoking it: the next new pod gets it and nobody granted.
func TestDelRecyclesTheEmptyPodLeaseAsASpare(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	a, pool, lease := podWithRoomForItsLease(t, cluster, "10.7.0.0/24")
	cli := etcdtest.Client(t)
	ctx := ctxT(t)
	if err := a.Del(ctx, addReq(pool, "a", "eth0", "uid-a")); err != nil {
		t.Fatal(err)
	}
	if got := spares(a.keeper); !slices.Contains(got, lease) {
		t.Fatalf("spares after DEL: %v; want the pod's lease %v among them", got, lease)
	}
	ttl, err := cli.TimeToLive(ctx, lease, clientv3.WithAttachedKeys())
	if err != nil || ttl.TTL <= 0 || len(ttl.Keys) != 0 {
		t.Fatalf("recycled lease: ttl=%v keys=%q err=%v; want alive and without keys", ttl.TTL, ttl.Keys, err)
	}
	if n := len(etcdtest.Dump(t, cli, keyspace.QuarantinePrefix(pool.Name))); n != 1 {
		t.Errorf("quarantine keys after DEL: %d, want 1", n)
	}
	if _, err := a.Add(ctx, addReq(pool, "b", "eth0", "uid-b")); err != nil {
		t.Fatal(err)
	}
	if got := clientv3.LeaseID(mustLease(t, a, "uid-b")); got != lease {
		t.Errorf("the next new pod got lease %v, want the recycled %v", got, lease)
	}
	if keys := etcdtest.Dump(t, cli, keyspace.PodKey(cluster, "n1", "uid-b")); keys[keyspace.PodKey(cluster, "n1", "uid-b")] != int64(lease) {
		t.Errorf("pod record of uid-b: %v, want it on lease %v", keys, lease)
	}
}

// TestDelRevokesAPodLeaseThatStillCarriesKeys: a key left on the pod's lease (here one
// written by hand) makes DEL revoke the lease, deleting the key with it, instead of handing a
// lease with keys to another pod.
func TestDelRevokesAPodLeaseThatStillCarriesKeys(t *testing.T) {
	a, pool, lease := podWithRoomForItsLease(t, etcdtest.Uniq("c"), "10.8.0.0/24")
	cli := etcdtest.Client(t)
	ctx := ctxT(t)
	stray := etcdtest.Uniq("stray/")
	if _, err := cli.Put(ctx, stray, "x", clientv3.WithLease(lease)); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, addReq(pool, "a", "eth0", "uid-a")); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(spares(a.keeper), lease) {
		t.Error("a lease that still carried a key went back to the spares")
	}
	if ttl, err := cli.TimeToLive(ctx, lease); err != nil || ttl.TTL > 0 {
		t.Errorf("lease after DEL: ttl=%v err=%v; want it revoked", ttl.TTL, err)
	}
	if n := len(etcdtest.Dump(t, cli, stray)); n != 0 {
		t.Errorf("the stray key survived the revoke")
	}
}

// TestDelReadsAnOwnerIndexThatChangedBehindTheAgent: when the owner index is no longer at
// the revision the agent wrote it (here rewritten by hand with the same record, as a re-claim
// would), DEL's first transaction fails its compare, and DEL reads the owner index and
// releases the attachment all the same.
func TestDelReadsAnOwnerIndexThatChangedBehindTheAgent(t *testing.T) {
	cli := etcdtest.Client(t)
	kv := &countingKV{KV: cli.KV}
	cli.KV = kv
	ctx := ctxT(t)
	cluster := etcdtest.Uniq("c")
	a, err := Start(ctx, cli, Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", LeaseTTL: 10 * time.Second,
		Quarantine: -1, SpareLeases: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.9.0.0/24")}}}}
	req := addReq(pool, "ctr", "eth0", "uid-moved")
	if _, err := a.Add(ctx, req); err != nil {
		t.Fatal(err)
	}
	other := etcdtest.Client(t)
	ownerKey := keyspace.OwnerKey(cluster, "uid-moved", "eth0", pool.Name)
	got, err := other.Get(ctx, ownerKey)
	if err != nil || len(got.Kvs) != 1 {
		t.Fatalf("owner index: %v, %v", got, err)
	}
	if _, err := other.Put(ctx, ownerKey, string(got.Kvs[0].Value), clientv3.WithLease(clientv3.LeaseID(got.Kvs[0].Lease))); err != nil {
		t.Fatal(err)
	}
	before := kv.gets.Load()
	if err := a.Del(ctx, req); err != nil {
		t.Fatal(err)
	}
	if n := kv.gets.Load() - before; n != 1 {
		t.Errorf("DEL made %d Get requests, want 1 (the owner index, after the remembered one failed its compare)", n)
	}
	if left := etcdtest.Dump(t, other, keyspace.OwnerPrefix(cluster, "uid-moved")); len(left) != 0 {
		t.Errorf("owner index after DEL: %v", left)
	}
	if left := etcdtest.Dump(t, other, keyspace.IPsPrefix(pool.Name)); len(left) != 0 {
		t.Errorf("allocations after DEL: %v", left)
	}
}

// TestALeaseWhoseKeysAreGoneAtADELIsGivenUp: a pod's keys gone from etcd while the keeper
// still renews its lease, as after a restore from a backup older than the pod, when the lease
// was a deleted pod's before (a recycled spare) and carries that pod's keys again. The DEL
// of the pod finds no key of it: the lease goes, and the deleted pod's keys with it. Found by
// the fault run: the lease was renewed for good, the deleted pod's address held.
func TestALeaseWhoseKeysAreGoneAtADELIsGivenUp(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.76.0.0/24", 28)
	// The audit as seldom as allowed: the DEL meets the change first.
	a := startAgent(t, cluster, "n1", "uid-n1", func(c *Config) { c.AuditInterval = c.LeaseTTL })
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	lease, ok := a.pods.Lease("u1")
	if !ok {
		t.Fatal("the agent holds no lease for the pod")
	}
	// What the restore does: the pod's keys gone, a deleted pod's record back on the lease.
	k := keysOf(cluster, "n1", "u1", pool, addrs(res)[0])
	gone := keyspace.PodKey(cluster, "n1", "u-deleted")
	rec := keyspace.PodRecord{Owner: "u-deleted", NodeUID: "uid-n1"}
	if _, err := cli.Txn(ctx).Then(clientv3.OpDelete(k.pod), clientv3.OpDelete(k.owner), clientv3.OpDelete(k.alloc),
		clientv3.OpPut(gone, keyspace.Encode(rec), clientv3.WithLease(lease))).Commit(); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, addReq(pool, "c1", "eth0", "u1")); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "the lease given up, and the deleted pod's record with it", func() error {
		resp, err := cli.Get(ctx, gone)
		if err != nil {
			return err
		}
		return etcdtest.Saw(len(resp.Kvs) == 0 && !a.keeper.Holds(lease), "record there %v, lease %s renewed %v",
			len(resp.Kvs) > 0, keyspace.LeaseHex(lease), a.keeper.Holds(lease))
	})
}
