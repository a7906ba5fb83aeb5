package leases

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

func stickyReq(pool allocator.PoolSpec, container, uid, claim string) allocator.Request {
	r := addReq(pool, container, "eth0", uid)
	r.Pod.Name = "web-2"
	r.Claim = claim
	return r
}

func readClaimRecord(t *testing.T, cli *clientv3.Client, key string) (keyspace.ClaimRecord, bool) {
	t.Helper()
	resp, err := cli.Get(etcdtest.Ctx(t), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return keyspace.ClaimRecord{}, false
	}
	rec, err := keyspace.Decode[keyspace.ClaimRecord](key, resp.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	return rec, true
}

func resultAddrs(res allocator.Result) []netip.Addr {
	var out []netip.Addr
	for _, ip := range res.IPs {
		out = append(out, ip.Address.Addr())
	}
	return out
}

// TestStickyClaimFollowsThePodAcrossNodes is a StatefulSet's web-2: ADD on one node, an ADD
// of its replacement on another node while it lives (refused, naming it), its DEL, and the
// replacement's ADD, which gets the same addresses; meanwhile no other pod can take them.
func TestStickyClaimFollowsThePodAcrossNodes(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	a := startAgent(t, cluster, "n1", "uid1")
	b := startAgent(t, cluster, "n2", "uid2")
	pool := dualStack(etcdtest.Uniq("p"), "10.67.0.0/24", "fd67::/64")
	ctx := ctxT(t)
	first, err := a.Add(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2"))
	if err != nil {
		t.Fatal(err)
	}
	key := keyspace.ClaimKey(cluster, pool.Name, "default.web-2")
	rec, ok := readClaimRecord(t, cli, key)
	if !ok || rec.Holder == nil || rec.Holder.Owner != "pod-uid-1" || len(rec.IPs) != 2 {
		t.Fatalf("claim record after the first ADD: %+v (present %v)", rec, ok)
	}

	// The replacement while the first pod lives: waits, then names the holder.
	short, cancel := context.WithTimeout(ctx, 5*time.Second)
	_, err = b.Add(short, stickyReq(pool, "c2", "pod-uid-2", "default.web-2"))
	cancel()
	if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), "pod-uid-1") {
		t.Fatalf("ADD of the replacement while web-2 lives: %v, want ErrUnavailable naming pod-uid-1", err)
	}

	if err := a.Del(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2")); err != nil {
		t.Fatal(err)
	}
	if rec, ok := readClaimRecord(t, cli, key); !ok || rec.Holder != nil || rec.Released.IsZero() {
		t.Fatalf("claim record after the DEL: %+v (present %v), want it released", rec, ok)
	}
	// Another pod asking for the address without the claim does not get it.
	other := addReq(pool, "c3", "eth0", "pod-uid-3")
	other.RequestedIPs = []netip.Addr{resultAddrs(first)[0]}
	if _, err := a.Add(ctx, other); !errors.Is(err, allocator.ErrAddressInUse) || !strings.Contains(err.Error(), `claim "default.web-2"`) {
		t.Fatalf("ADD of another pod for a claimed address: %v, want ErrAddressInUse naming the claim", err)
	}

	second, err := b.Add(ctx, stickyReq(pool, "c2", "pod-uid-2", "default.web-2"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := resultAddrs(second), resultAddrs(first); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("the replacement got %v, want the claim's %v", got, want)
	}
	rec, _ = readClaimRecord(t, cli, key)
	if rec.Holder == nil || rec.Holder.Owner != "pod-uid-2" || rec.Holder.Node != "n2" {
		t.Errorf("claim record after the hand-over: %+v", rec)
	}
	if n := metricValue(t, b, "leasehold_claim_handovers_total"); n != 1 {
		t.Errorf("hand-overs counted: %v, want 1", n)
	}
	// A repeated ADD of the holder is idempotent.
	again, err := b.Add(ctx, stickyReq(pool, "c2", "pod-uid-2", "default.web-2"))
	if err != nil || resultAddrs(again)[0] != resultAddrs(first)[0] {
		t.Fatalf("repeated ADD of the holder: %v %v", again, err)
	}
}

// slowAfterFirstKV is etcd's KV, except that every read of key after the first waits until
// its context ends: an etcd that became too slow to answer.
type slowAfterFirstKV struct {
	clientv3.KV
	key   string
	reads *atomic.Int32
}

func (k slowAfterFirstKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	if key == k.key && k.reads.Add(1) > 1 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return k.KV.Get(ctx, key, opts...)
}

// TestAStickyWaitThatRunsOutNamesTheHolder: an ADD waiting for a claim's live holder ends
// during a read that etcd is too slow to answer; it still fails naming the holder the last
// answer named, not as a failed read.
func TestAStickyWaitThatRunsOutNamesTheHolder(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	pool := v4Pool(etcdtest.Uniq("p"), "10.69.0.0/24", 26)
	ctx := ctxT(t)
	a := startAgent(t, cluster, "n1", "uid1")
	if _, err := a.Add(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2")); err != nil {
		t.Fatal(err)
	}
	var reads atomic.Int32
	cli := etcdtest.Client(t)
	cli.KV = slowAfterFirstKV{KV: cli.KV, key: keyspace.ClaimKey(cluster, pool.Name, "default.web-2"), reads: &reads}
	b, err := Start(ctx, cli, Config{Cluster: cluster, Node: "n2", NodeUID: "uid2", Quarantine: -1, SpareLeases: 1,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = b.Add(short, stickyReq(pool, "c2", "pod-uid-2", "default.web-2"))
	cancel()
	if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), "still held by") || !strings.Contains(err.Error(), "pod-uid-1") {
		t.Errorf("ADD whose wait ran out in a slow read: %v; want ErrUnavailable naming pod-uid-1 as the holder", err)
	}
	if n := reads.Load(); n < 2 {
		t.Errorf("the claim was read %d times; the test needs a slow read after the first", n)
	}
}

// TestStickyClaimOutlivesItsNodesDeath: the holder's node stops renewing; once its pod lease
// has expired, the claim (on its own, longer lease) hands the addresses to the replacement.
func TestStickyClaimOutlivesItsNodesDeath(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	pool := v4Pool(etcdtest.Uniq("p"), "10.68.0.0/24", 26)
	ctx := ctxT(t)
	mod := func(c *Config) { c.LeaseTTL, c.ClaimHold = 2*time.Second, 8*time.Second }
	dead := startAgent(t, cluster, "n1", "uid1", mod)
	first, err := dead.Add(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2"))
	if err != nil {
		t.Fatal(err)
	}
	dead.Close()
	live := startAgent(t, cluster, "n2", "uid2", mod)
	second, err := live.Add(ctx, stickyReq(pool, "c2", "pod-uid-2", "default.web-2"))
	if err != nil {
		t.Fatal(err)
	}
	if resultAddrs(second)[0] != resultAddrs(first)[0] {
		t.Fatalf("after the node's death the replacement got %v, want %v", resultAddrs(second), resultAddrs(first))
	}
}

// TestStickyClaimExpiresAfterTheHold: released and not taken again, the claim and its
// addresses' reservation go after the hold, and the addresses return to the pool.
func TestStickyClaimExpiresAfterTheHold(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.69.0.0/24", 26)
	ctx := ctxT(t)
	a := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.LeaseTTL, c.ClaimHold = 2*time.Second, 2*time.Second })
	res, err := a.Add(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2"))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2")); err != nil {
		t.Fatal(err)
	}
	key := keyspace.ClaimKey(cluster, pool.Name, "default.web-2")
	etcdtest.Eventually(t, "the released claim expired", func() error {
		rec, ok := readClaimRecord(t, cli, key)
		return etcdtest.Saw(!ok, "claim %+v", rec)
	})
	other := addReq(pool, "c3", "eth0", "pod-uid-3")
	other.RequestedIPs = resultAddrs(res)
	if _, err := a.Add(ctx, other); err != nil {
		t.Fatalf("ADD of another pod for the address after the hold: %v", err)
	}
}

// TestReleasedClaimLeavesOrdinaryQuarantine: a claim an admin released while its pod lived
// (its record deleted) is not brought back by the pod's DEL, whose addresses then rest in
// ordinary quarantine, not under the gone claim for its hold.
func TestReleasedClaimLeavesOrdinaryQuarantine(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.70.0.0/24", 26)
	ctx := ctxT(t)
	a := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.Quarantine = 30 * time.Second })
	res, err := a.Add(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2"))
	if err != nil {
		t.Fatal(err)
	}
	key := keyspace.ClaimKey(cluster, pool.Name, "default.web-2")
	if _, err := cli.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, stickyReq(pool, "c1", "pod-uid-1", "default.web-2")); err != nil {
		t.Fatal(err)
	}
	if _, ok := readClaimRecord(t, cli, key); ok {
		t.Fatal("the DEL brought the released claim back")
	}
	qKey := keyspace.QuarantineKey(pool.Name, pool.Blocks, resultAddrs(res)[0])
	resp, err := cli.Get(ctx, qKey)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("quarantine key %s after the DEL: %v %v", qKey, resp, err)
	}
	q, _ := keyspace.Decode[keyspace.QuarantineRecord](qKey, resp.Kvs[0].Value)
	if q.Claim != "" || time.Until(q.Until) > time.Minute {
		t.Errorf("quarantine after the DEL of a released claim: %+v, want ordinary (no claim, about 30 s)", q)
	}
}

// TestANewClaimPassesOverAddressesHeldBackUnknownToTheView is an ADD making a new sticky
// claim whose chosen addresses turn out taken: held back for another node's expired pods,
// which the view does not watch (after a restore, say). The claim is no one's yet, so there
// is nothing to read again: the ADD learns, as any ADD, that they are taken, and passes them
// over, rather than choose them again until it gives up (seed 1795819823702537815).
func TestANewClaimPassesOverAddressesHeldBackUnknownToTheView(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	a := startAgent(t, cluster, "n1", "uid1")
	pool := v4Pool(etcdtest.Uniq("p"), "10.69.0.0/28", 29)
	ctx := ctxT(t)
	first, err := a.Add(ctx, addReq(pool, "c1", "eth0", "pod-uid-1"))
	if err != nil {
		t.Fatal(err)
	}
	mine := resultAddrs(first)[0]
	block := netip.PrefixFrom(mine, 29).Masked() // the node's block
	// Every other address of the node's block held back for a gone node's pods, behind the
	// view's back.
	lease, err := cli.Grant(ctx, 3600)
	if err != nil {
		t.Fatal(err)
	}
	held := map[netip.Addr]bool{}
	for ip := block.Addr(); block.Contains(ip); ip = ip.Next() {
		if ip == mine {
			continue
		}
		rec := keyspace.Encode(keyspace.HeldRecord{Cluster: cluster, Node: "gone", Owner: "gone-" + ip.String()})
		if _, err := cli.Put(ctx, keyspace.HeldKey(pool.Name, pool.Blocks, ip), rec, clientv3.WithLease(lease.ID)); err != nil {
			t.Fatal(err)
		}
		held[ip] = true
	}
	res, err := a.Add(ctx, stickyReq(pool, "c2", "pod-uid-2", "default.web-0"))
	if err != nil {
		t.Fatalf("ADD making a new claim, its first choices held back: %v", err)
	}
	for _, ip := range resultAddrs(res) {
		if held[ip] {
			t.Errorf("ADD making a new claim got %s, held back for another node's pod", ip)
		}
	}
	rec, ok := readClaimRecord(t, cli, keyspace.ClaimKey(cluster, pool.Name, "default.web-0"))
	if !ok || rec.Holder == nil || rec.Holder.Owner != "pod-uid-2" {
		t.Errorf("claim record after the ADD: %+v (present %v)", rec, ok)
	}
}
