package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
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
// its answer is lost. The ADD fails (try again later); the runtime's retry of the same
// container gets the same addresses, no second key exists, and the lease the lost claim
// bound stays with that pod: it is never handed to another pod as a spare.
func TestAmbiguousCommitIsRetriedIntoTheSameAddresses(t *testing.T) {
	cli := newClient(t)
	var armed atomic.Bool
	cli.KV = lostResponseKV{KV: cli.KV, armed: &armed}
	cluster := uniq("c")
	a, err := Start(ctxT(t), cli, Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", Quarantine: -1, SpareLeases: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	pool := dualStack(uniq("p"), "10.17.0.0/24", "fd17::/64")
	ctx := ctxT(t)
	if _, err := a.Add(ctx, addReq(pool, "warm", "eth0", "uid-warm")); err != nil { // pool defined, view loaded
		t.Fatal(err)
	}
	armed.Store(true)
	if _, err := a.Add(ctx, addReq(pool, "ctr", "eth0", "uid-x")); !errors.Is(err, allocator.ErrUnavailable) {
		t.Fatalf("ADD whose answer was lost: want ErrUnavailable (the runtime retries), got %v", err)
	}
	keys := dump(t, newClient(t), IPsPrefix(pool.Name))
	var lost []string
	var lostLease int64
	for k, l := range keys {
		if l != 0 && l != mustLease(t, a, "uid-warm") {
			lost = append(lost, k)
			lostLease = l
		}
	}
	if len(lost) != 2 {
		t.Fatalf("etcd applied the lost claim: want its 2 keys, got %v", lost)
	}
	res, err := a.Add(ctx, addReq(pool, "ctr", "eth0", "uid-x"))
	if err != nil {
		t.Fatalf("retried ADD: %v", err)
	}
	for _, ip := range res.IPs {
		if _, ok := keys[IPKey(pool.Name, ip.Address.Addr())]; !ok {
			t.Errorf("retried ADD returned %s, not the address the lost claim wrote (%v)", ip.Address, lost)
		}
	}
	if after := dump(t, newClient(t), IPsPrefix(pool.Name)); len(after) != len(keys) {
		t.Errorf("the retry wrote a second set of keys: %d keys before, %d after", len(keys), len(after))
	}
	// Another pod never receives the lost claim's lease.
	if _, err := a.Add(ctx, addReq(pool, "other", "eth0", "uid-other")); err != nil {
		t.Fatal(err)
	}
	if l := mustLease(t, a, "uid-other"); l == lostLease {
		t.Errorf("pod uid-other was given lease %x, which already carries uid-x's keys", l)
	}
}

func mustLease(t *testing.T, a *Agent, owner string) int64 {
	t.Helper()
	l, ok := a.podLease(owner)
	if !ok {
		t.Fatalf("agent holds no lease for %s", owner)
	}
	return int64(l)
}

var _ = fmt.Sprint
var _ = netip.Addr{}
