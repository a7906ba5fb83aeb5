package keeper

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestRenewNowRenewsEveryLeaseAndNamesTheGone: a restarted agent renews all resumed pod
// leases at once on one stream, and learns which ones etcd no longer has.
func TestRenewNowRenewsEveryLeaseAndNamesTheGone(t *testing.T) {
	cli := etcdtest.Client(t)
	ctx := etcdtest.Ctx(t)
	k := newKeeper(t, cli, Config{TTL: 10 * time.Second, Spares: 1,
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	defer k.Close()
	const leaseTTL = 30 * time.Second // far longer than granting 300 leases takes, however busy the machine
	var ids []clientv3.LeaseID
	var granted []time.Time // each lease was granted no earlier than this
	for range 300 {
		granted = append(granted, time.Now())
		g, err := cli.Grant(ctx, int64(leaseTTL.Seconds()))
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, g.ID)
	}
	if _, err := cli.Revoke(ctx, ids[7]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // every lease now has at most 27 s left
	gone, err := k.RenewNow(ctx, ids)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gone, []clientv3.LeaseID{ids[7]}) {
		t.Errorf("gone: got %v, want only the revoked %v", gone, ids[7])
	}
	for i, id := range ids {
		if i == 7 {
			continue
		}
		// Not renewed, it would have at most unrenewed left, 3 s less than a lease renewed
		// after the sleep: a slow machine shortens both alike.
		before := time.Now()
		ttl, err := cli.TimeToLive(ctx, id)
		unrenewed := leaseTTL - before.Sub(granted[i])
		if err != nil || ttl.TTL <= 0 || time.Duration(ttl.TTL)*time.Second <= unrenewed {
			t.Fatalf("lease %d after RenewNow: %+v, %v (want more than the %s it has if not renewed)", i, ttl, err, unrenewed.Round(time.Millisecond))
		}
	}
	if gone, err := k.RenewNow(ctx, nil); gone != nil || err != nil {
		t.Errorf("nothing to renew: %v, %v", gone, err)
	}
}

// registrations wraps a client's real lease API and records when each lease's keep-alive
// was registered; everything still goes to etcd.
type registrations struct {
	clientv3.Lease
	mu sync.Mutex
	at map[clientv3.LeaseID]time.Time
}

func (r *registrations) KeepAlive(ctx context.Context, id clientv3.LeaseID) (<-chan *clientv3.LeaseKeepAliveResponse, error) {
	r.mu.Lock()
	r.at[id] = time.Now()
	r.mu.Unlock()
	return r.Lease.KeepAlive(ctx, id)
}

func (r *registrations) when(id clientv3.LeaseID) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	at, ok := r.at[id]
	return at, ok
}

// TestFreshLeaseIsRenewedWhenDueAndNotBefore: a lease the keeper grants has its whole TTL,
// so its keep-alive (which renews at once) is registered only when a third of the TTL is
// gone, less one tick of the client's loop; from then on it is renewed as every held lease
// is. A lease adopted after a restart is registered at once.
func TestFreshLeaseIsRenewedWhenDueAndNotBefore(t *testing.T) {
	cli := etcdtest.Client(t)
	reg := &registrations{Lease: cli.Lease, at: map[clientv3.LeaseID]time.Time{}}
	cli.Lease = reg
	ctx := etcdtest.Ctx(t)
	const ttl = 6 * time.Second
	k := newKeeper(t, cli, Config{TTL: ttl})
	defer k.Close()
	granted := time.Now() // the lease is granted no earlier than this
	id, err := k.grant(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var at time.Time
	etcdtest.Eventually(t, "the fresh lease's keep-alive is registered (due 1.5 s after the grant)", func() error {
		var ok bool
		at, ok = reg.when(id)
		return etcdtest.Saw(ok, "not registered %s after the grant", time.Since(granted).Round(time.Millisecond))
	})
	if early := at.Sub(granted); early < 1400*time.Millisecond {
		t.Errorf("keep-alive registered %s after the grant, want at 1.5 s (a third of 6 s, less 500 ms)", early)
	}
	// Registered, it is renewed: it comes to have more left than a lease never renewed could.
	etcdtest.Eventually(t, "the fresh lease is renewed", func() error {
		before := time.Now()
		r, err := cli.TimeToLive(ctx, id)
		if err != nil {
			return err
		}
		unrenewed := ttl - before.Sub(granted)
		return etcdtest.Saw(r.TTL > 0 && time.Duration(r.TTL)*time.Second > unrenewed,
			"%d s left %s after the grant, no more than without a renewal", r.TTL, before.Sub(granted).Round(time.Millisecond))
	})
	if !k.Holds(id) {
		t.Error("the keeper no longer holds the lease")
	}
	other, err := cli.Grant(ctx, 6)
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Adopt(ctx, other.ID); err != nil {
		t.Fatal(err)
	}
	if _, ok := reg.when(other.ID); !ok {
		t.Error("an adopted lease's keep-alive was not registered at once")
	}
}

// TestFreshLeaseRevokedFromOutsideIsReportedLost: a fresh lease revoked by someone else
// is found lost when its renewals start, as a renewed lease is at its next renewal.
func TestFreshLeaseRevokedFromOutsideIsReportedLost(t *testing.T) {
	cli := etcdtest.Client(t)
	ctx := etcdtest.Ctx(t)
	lost := make(chan clientv3.LeaseID, 4)
	k := newKeeper(t, cli, Config{TTL: 6 * time.Second, OnLost: func(id clientv3.LeaseID) { lost <- id }})
	defer k.Close()
	id, err := k.grant(ctx)
	if err != nil {
		t.Fatal(err)
	}
	released, err := k.grant(ctx)
	if err != nil {
		t.Fatal(err)
	}
	k.Forget(released) // not renewed, and not reported: it was let go on purpose
	if _, err := cli.Revoke(ctx, id); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-lost:
		if got != id {
			t.Fatalf("lost %s, want %s", keyspace.LeaseHex(got), keyspace.LeaseHex(id))
		}
	case <-time.After(etcdtest.Patience):
		t.Fatalf("a revoked fresh lease was not reported lost after %s (due after 1.5 s)", etcdtest.Patience)
	}
	if k.Holds(id) {
		t.Error("the keeper still holds the lost lease")
	}
	select {
	case got := <-lost:
		t.Errorf("lease %s reported lost; only %s was", keyspace.LeaseHex(got), keyspace.LeaseHex(id))
	case <-time.After(2 * time.Second):
	}
	if r, err := cli.TimeToLive(ctx, released); err != nil || r.TTL > 3 {
		t.Errorf("the released lease was renewed: %+v, %v", r, err)
	}
}

// grants wraps a client's real lease API and counts the leases granted through it.
type grants struct {
	clientv3.Lease
	n atomic.Int64
}

func (g *grants) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	g.n.Add(1)
	return g.Lease.Grant(ctx, ttl)
}

// TestSparesAreRefilledAtLowWaterAllAtOnce: taking a spare does not grant a new one until
// half of the spares are gone; then the keeper tops them all up.
func TestSparesAreRefilledAtLowWaterAllAtOnce(t *testing.T) {
	cli := etcdtest.Client(t)
	g := &grants{Lease: cli.Lease}
	cli.Lease = g
	ctx := etcdtest.Ctx(t)
	k := newKeeper(t, cli, Config{TTL: 30 * time.Second, Spares: 8})
	defer k.Close()
	spares := func() int {
		k.spares.mu.Lock()
		defer k.spares.mu.Unlock()
		return len(k.spares.ids)
	}
	waitSpares := func(want int) {
		t.Helper()
		etcdtest.Eventually(t, fmt.Sprintf("%d spares", want), func() error {
			n := spares()
			return etcdtest.Saw(n == want, "%d spares", n)
		})
	}
	waitSpares(8)
	if n := g.n.Load(); n != 8 {
		t.Fatalf("grants to fill 8 spares: %d", n)
	}
	for i := range 3 {
		if _, err := k.Take(ctx); err != nil {
			t.Fatal(err)
		}
		k.Refill()
		if n := spares(); n != 7-i {
			t.Fatalf("after take %d: %d spares, want %d", i+1, n, 7-i)
		}
	}
	// Five left, above the low water of four: nothing is granted, however long we wait.
	time.Sleep(500 * time.Millisecond)
	if n, s := g.n.Load(), spares(); n != 8 || s != 5 {
		t.Fatalf("with 5 of 8 spares left: %d grants in all and %d spares, want 8 and 5", n, s)
	}
	if _, err := k.Take(ctx); err != nil {
		t.Fatal(err)
	}
	k.Refill()
	waitSpares(8)
	if n := g.n.Load(); n != 12 {
		t.Errorf("grants after topping up from the low water: %d, want 12", n)
	}
}

func newKeeper(t *testing.T, cli *clientv3.Client, cfg Config) *Keeper {
	t.Helper()
	k, err := New(cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestARecycledSpareWithKeysAgainIsRevoked: a pod lease recycled as a spare (no key left on
// it) gets a key back, as an etcd restored from a backup of its pod's time gives it. The
// check of recycled spares revokes it, key and all, instead of handing it to a new pod; a
// spare granted fresh is not asked about.
func TestARecycledSpareWithKeysAgainIsRevoked(t *testing.T) {
	cli, ctx := etcdtest.Client(t), etcdtest.Ctx(t)
	k := newKeeper(t, cli, Config{TTL: 30 * time.Second, Spares: 2})
	defer k.Close()
	etcdtest.EventuallyTrue(t, "two spares granted", func() bool {
		k.spares.mu.Lock()
		defer k.spares.mu.Unlock()
		return len(k.spares.ids) == 2
	})
	id, err := k.Take(ctx) // a spare; the refill waits for the low water
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := k.Recycle(ctx, id); err != nil || !ok {
		t.Fatalf("recycle a keyless young lease: %v %v, want it a spare", ok, err)
	}
	key := etcdtest.Uniq("/restored/pod-record-")
	if _, err := cli.Put(ctx, key, "back from a backup", clientv3.WithLease(id)); err != nil {
		t.Fatal(err)
	}
	if err := k.CheckRecycled(ctx); err != nil {
		t.Fatal(err)
	}
	k.spares.mu.Lock()
	still := slices.Contains(k.spares.ids, id)
	k.spares.mu.Unlock()
	if still {
		t.Fatalf("lease %x is still a spare with a key on it", id)
	}
	etcdtest.EventuallyTrue(t, "the key goes with the revoked lease", func() bool {
		resp, err := cli.Get(ctx, key)
		return err == nil && len(resp.Kvs) == 0
	})
	// The other spares were granted fresh: never asked about, still there.
	k.spares.mu.Lock()
	n := len(k.spares.recycled)
	k.spares.mu.Unlock()
	if n != 0 {
		t.Errorf("%d recycled spares left to check, want 0", n)
	}
}

// TestALeaseReturnedWithKeysOnItIsNoSpare: a lease an ADD took before etcd went back, and
// gave back unused after the spares were dropped, carries the keys a restore put back on it
// (a deleted pod's, whose lease it had been): it is revoked, key and all, not handed to the
// next pod. One returned without a key is a spare again.
func TestALeaseReturnedWithKeysOnItIsNoSpare(t *testing.T) {
	cli, ctx := etcdtest.Client(t), etcdtest.Ctx(t)
	k := newKeeper(t, cli, Config{TTL: 30 * time.Second, Spares: 2})
	defer k.Close()
	dirty, err := k.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	clean, err := k.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	key := etcdtest.Uniq("/restored/allocation-")
	if _, err := cli.Put(ctx, key, "back from a backup", clientv3.WithLease(dirty)); err != nil {
		t.Fatal(err)
	}
	k.DropSpares()
	k.Return(dirty)
	k.Return(clean)
	etcdtest.EventuallyTrue(t, "the returned lease with a key revoked, key and all", func() bool {
		resp, err := cli.Get(ctx, key)
		return err == nil && len(resp.Kvs) == 0
	})
	etcdtest.EventuallyTrue(t, "the clean lease a spare again", func() bool {
		k.spares.mu.Lock()
		defer k.spares.mu.Unlock()
		return slices.Contains(k.spares.ids, clean)
	})
	k.spares.mu.Lock()
	dirtySpare := slices.Contains(k.spares.ids, dirty)
	k.spares.mu.Unlock()
	if dirtySpare {
		t.Errorf("lease %x, with a key on it, is a spare", dirty)
	}
}
