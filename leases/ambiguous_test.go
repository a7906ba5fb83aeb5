package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
)

// lostResponseKV is etcd's KV with one twist: while armed, the next transaction that etcd
// applies successfully reports a lost response instead, as when the connection breaks after
// etcd committed. etcd itself is real; only the answer goes missing. With minCmps set, only a
// transaction with at least that many compares loses its answer (a batch of claims).
type lostResponseKV struct {
	clientv3.KV
	armed   *atomic.Bool
	minCmps int
}

func (k lostResponseKV) Txn(ctx context.Context) clientv3.Txn {
	return &lostResponseTxn{Txn: k.KV.Txn(ctx), armed: k.armed, minCmps: k.minCmps}
}

type lostResponseTxn struct {
	clientv3.Txn
	armed         *atomic.Bool
	minCmps, cmps int
}

func (t *lostResponseTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	t.Txn, t.cmps = t.Txn.If(cs...), t.cmps+len(cs)
	return t
}
func (t *lostResponseTxn) Then(ops ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Then(ops...); return t }
func (t *lostResponseTxn) Else(ops ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Else(ops...); return t }

func (t *lostResponseTxn) Commit() (*clientv3.TxnResponse, error) {
	resp, err := t.Txn.Commit()
	if err == nil && resp.Succeeded && t.cmps >= t.minCmps && t.armed.CompareAndSwap(true, false) {
		return nil, errors.New("rpc error: code = Unavailable desc = connection reset after the request was sent")
	}
	return resp, err
}

// TestAmbiguousCommitIsRetriedIntoTheSameAddresses: the claim transaction is applied but
// its answer is lost. The ADD sends its claim again; that one finds the owner index the
// lost one wrote and returns its addresses: no second key exists, and the lease the lost
// claim bound stays with that pod: it is never handed to another pod as a spare, not even
// after the pod's DEL, which revokes it.
func TestAmbiguousCommitIsRetriedIntoTheSameAddresses(t *testing.T) {
	cli := etcdtest.Client(t)
	var armed atomic.Bool
	cli.KV = lostResponseKV{KV: cli.KV, armed: &armed}
	cluster := etcdtest.Uniq("c")
	a, err := Start(ctxT(t), cli, Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", Quarantine: -1, SpareLeases: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	pool := dualStack(etcdtest.Uniq("p"), "10.17.0.0/24", "fd17::/64")
	ctx := ctxT(t)
	if _, err := a.Add(ctx, addReq(pool, "warm", "eth0", "uid-warm")); err != nil { // pool defined, view loaded
		t.Fatal(err)
	}
	armed.Store(true)
	res, err := a.Add(ctx, addReq(pool, "ctr", "eth0", "uid-x"))
	if err != nil {
		t.Fatalf("ADD whose first answer was lost: %v", err)
	}
	if armed.Load() {
		t.Fatal("no answer was lost: the test did not test anything")
	}
	keys := etcdtest.Dump(t, etcdtest.Client(t), keyspace.IPsPrefix(pool.Name))
	if len(keys) != 4 {
		t.Fatalf("want the 2 keys of each of 2 pods, got %d: %v", len(keys), keys)
	}
	lease := mustLease(t, a, "uid-x")
	for _, ip := range res.IPs {
		if l, ok := keys[keyspace.IPKey(pool.Name, allocator.DefaultBlocks, ip.Address.Addr())]; !ok || l != lease {
			t.Errorf("ADD returned %s; its key is missing or not on the pod's lease %x (%v)", ip.Address, lease, keys)
		}
	}
	again, err := a.Add(ctx, addReq(pool, "ctr", "eth0", "uid-x"))
	if err != nil || fmt.Sprint(again) != fmt.Sprint(res) {
		t.Errorf("repeated ADD: %v, %v; want %v", again, err, res)
	}
	// Another pod never receives the lost claim's lease.
	if _, err := a.Add(ctx, addReq(pool, "other", "eth0", "uid-other")); err != nil {
		t.Fatal(err)
	}
	if l := mustLease(t, a, "uid-other"); l == lease {
		t.Errorf("pod uid-other was given lease %x, which already carries uid-x's keys", l)
	}
	// Its DEL revokes the lease even with room among the spares: a claim whose answer was
	// lost could still be applied late, and must then find the lease gone.
	// Take the spare out, and again if a refill already in motion puts one back, so that
	// the keeper has room for the lease and only the lost answer can keep it out.
	for i := 0; len(spares(a.keeper)) > 0; i++ {
		if i == 5 {
			t.Fatal("the keeper keeps refilling its spare")
		}
		spare, err := a.keeper.Take(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer a.keeper.Return(spare)
		time.Sleep(200 * time.Millisecond)
	}
	if err := a.Del(ctx, addReq(pool, "ctr", "eth0", "uid-x")); err != nil {
		t.Fatal(err)
	}
	if ttl, err := etcdtest.Client(t).TimeToLive(ctx, clientv3.LeaseID(lease)); err != nil || ttl.TTL > 0 {
		t.Errorf("lease %x of the pod whose claim lost its answer, after DEL: ttl=%v err=%v; want it revoked", lease, ttl.TTL, err)
	}
}

func mustLease(t *testing.T, a *Agent, owner string) int64 {
	t.Helper()
	l, ok := a.pods.Lease(owner)
	if !ok {
		t.Fatalf("agent holds no lease for %s", owner)
	}
	return int64(l)
}

var _ = netip.Addr{}

// TestAmbiguousReclaimNeverLeavesKeysOnASpare: after its lease is lost, a pod with two
// attachments is re-claimed on a new lease, and the first re-claim transaction is applied
// but its answer is lost. That lease is revoked, not handed back as a spare with the first
// attachment's keys on it (a new pod taking it would delete them at its DEL), and the
// re-claim that follows puts every key of the pod on one lease of its own.
func TestAmbiguousReclaimNeverLeavesKeysOnASpare(t *testing.T) {
	cli := etcdtest.Client(t)
	var armed atomic.Bool
	cli.KV = lostResponseKV{KV: cli.KV, armed: &armed}
	cluster := etcdtest.Uniq("c")
	a, err := Start(ctxT(t), cli, Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", LeaseTTL: 6 * time.Second,
		Quarantine: -1, SpareLeases: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	pool := dualStack(etcdtest.Uniq("p"), "10.18.0.0/24", "fd18::/64")
	ctx := ctxT(t)
	for _, ifName := range []string{"eth0", "net1"} {
		if _, err := a.Add(ctx, addReq(pool, "ctr", ifName, "uid-r")); err != nil {
			t.Fatal(err)
		}
	}
	lost := clientv3.LeaseID(mustLease(t, a, "uid-r"))
	other := etcdtest.Client(t)
	if _, err := other.Revoke(ctx, lost); err != nil {
		t.Fatal(err)
	}
	armed.Store(true) // the next transaction the agent commits is the first re-claim
	etcdtest.Eventually(t, "a re-claim after the revoke", func() error {
		return etcdtest.Saw(!armed.Load(), "no transaction committed since the revoke")
	})
	// A new pod right then takes a spare: it must not get the lease of the lost answer.
	if _, err := a.Add(ctx, addReq(pool, "new", "eth0", "uid-s")); err != nil {
		t.Fatal(err)
	}
	fresh := clientv3.LeaseID(mustLease(t, a, "uid-s"))
	if ttl, err := other.TimeToLive(ctx, fresh, clientv3.WithAttachedKeys()); err != nil || len(ttl.Keys) != 4 {
		t.Errorf("lease of the new pod carries %q (err %v); want its own 4 keys alone", ttl.Keys, err)
	}
	var now clientv3.LeaseID
	etcdtest.Eventually(t, "the pod is re-claimed", func() error {
		l, ok := a.pods.Lease("uid-r")
		if ok && l != lost {
			now = l
			return nil
		}
		return fmt.Errorf("the pod's lease is %x (held %v), the lost one %x", l, ok, lost)
	})
	for _, id := range spares(a.keeper) {
		if ttl, err := other.TimeToLive(ctx, id, clientv3.WithAttachedKeys()); err != nil || len(ttl.Keys) > 0 {
			t.Errorf("spare lease %s carries keys %q (err %v)", keyspace.LeaseHex(id), ttl.Keys, err)
		}
	}
	mine := 0
	for k, l := range etcdtest.Dump(t, other, keyspace.Prefix) {
		if strings.Contains(k, "/"+cluster+"/") && strings.Contains(k, "/uid-r") || strings.HasPrefix(k, keyspace.IPsPrefix(pool.Name)) && l != int64(fresh) {
			if l != int64(now) {
				t.Errorf("key %s of the re-claimed pod is on lease %x, not on its lease %x", k, l, now)
			}
			mine++
		}
	}
	if mine != 2+2+2+1 { // 2 addresses and 1 owner index per attachment, the pod record
		t.Errorf("keys of the re-claimed pod: %d, want 7", mine)
	}
}

// spares is a copy of the keeper's spare leases.
func spares(k *keeper.Keeper) []clientv3.LeaseID { return k.Spares() }
