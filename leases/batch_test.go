package leases

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestConcurrentAddsInOneAgentShareClaimTransactions: a burst of ADDs on one agent commits
// its claims several to a transaction, and every ADD still gets its own addresses, on its own
// lease, exactly as alone.
func TestConcurrentAddsInOneAgentShareClaimTransactions(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1", func(c *Config) { c.SpareLeases = 64 })
	pool := dualStack(etcdtest.Uniq("p"), "10.50.0.0/24", "fd50::/120")
	ctx := ctxT(t)
	cli := etcdtest.Client(t)
	const n = 48
	results := make([]allocator.Result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			results[i], errs[i] = a.Add(ctx, addReq(pool, fmt.Sprintf("c%d", i), "eth0", fmt.Sprintf("uid-%d", i)))
		})
	}
	wg.Wait()
	seen := map[netip.Addr]int{}
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("ADD %d: %v", i, errs[i])
		}
		for _, ip := range results[i].IPs {
			if j, dup := seen[ip.Address.Addr()]; dup {
				t.Fatalf("ADDs %d and %d both got %s", j, i, ip.Address)
			}
			seen[ip.Address.Addr()] = i
			resp, err := cli.Get(ctx, keyspace.IPKey(pool.Name, allocator.DefaultBlocks, ip.Address.Addr()))
			if err != nil || len(resp.Kvs) != 1 {
				t.Fatalf("key of %s: %v", ip.Address, err)
			}
			rec, err := keyspace.Decode[keyspace.Allocation]("", resp.Kvs[0].Value)
			lease, held := a.pods.Lease(fmt.Sprintf("uid-%d", i))
			if err != nil || rec.Owner != fmt.Sprintf("uid-%d", i) || !held || resp.Kvs[0].Lease != int64(lease) {
				t.Fatalf("%s: held by %q on lease %x, want uid-%d on its own lease %x (%v)", ip.Address, rec.Owner, resp.Kvs[0].Lease, i, lease, err)
			}
		}
		again, err := a.Add(ctx, addReq(pool, fmt.Sprintf("c%d", i), "eth0", fmt.Sprintf("uid-%d", i)))
		if err != nil || fmt.Sprint(again) != fmt.Sprint(results[i]) {
			t.Fatalf("repeated ADD %d: %v, %v; want %v", i, again, err, results[i])
		}
	}
	batched := counterValue(a.metrics.claimsBatched)
	if batched == 0 {
		t.Fatalf("%d concurrent ADDs on one agent and no claim was committed in a batch", n)
	}
	t.Logf("%d of %d claims committed in batches", int(batched), n)
}

// TestBatchWithAClaimThatLosesSplitsAndEachLearns: a batch holding a claim for an address
// another agent holds cannot commit; its claims run again alone: the losing one is refused
// as it would be alone, the others get their addresses.
func TestBatchWithAClaimThatLosesSplitsAndEachLearns(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	a := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.SpareLeases = 32 })
	b := startAgent(t, cluster, "n2", "uid2")
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.51.0.0/22")}}}}
	ctx := ctxT(t)
	for round := 0; round < 20 && counterValue(a.metrics.claimBatches.WithLabelValues("split")) == 0; round++ {
		taken := netip.AddrFrom4([4]byte{10, 51, byte(round / 200), byte(10 + round%200)})
		held := addReq(pool, fmt.Sprintf("held-%d", round), "eth0", "")
		held.RequestedIPs = []netip.Addr{taken}
		if _, err := b.Add(ctx, held); err != nil {
			t.Fatal(err)
		}
		const n = 16
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				req := addReq(pool, fmt.Sprintf("r%d-%d", round, i), "eth0", "")
				if i == n/2 {
					req.RequestedIPs = []netip.Addr{taken}
				}
				_, errs[i] = a.Add(ctx, req)
			})
		}
		wg.Wait()
		for i, err := range errs {
			switch {
			case i == n/2 && !errors.Is(err, allocator.ErrAddressInUse):
				t.Fatalf("round %d: the claim for %s, held by another agent: want ErrAddressInUse, got %v", round, taken, err)
			case i != n/2 && err != nil:
				t.Fatalf("round %d: ADD %d: %v", round, i, err)
			}
		}
	}
	if counterValue(a.metrics.claimBatches.WithLabelValues("split")) == 0 {
		t.Fatal("in 20 rounds no batch held the losing claim: the split path never ran")
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// TestLostAnswerOfABatchIsRetriedIntoTheSameAddresses: etcd applies a batch of claims and
// the answer is lost. Each ADD of the batch sends its claim again and gets the addresses its
// lost claim wrote, on its own lease, with no second key.
func TestLostAnswerOfABatchIsRetriedIntoTheSameAddresses(t *testing.T) {
	cli := etcdtest.Client(t)
	var armed atomic.Bool
	cli.KV = lostResponseKV{KV: cli.KV, armed: &armed, minCmps: 14} // more than one dual-stack claim has (13)
	a, err := Start(ctxT(t), cli, Config{Cluster: etcdtest.Uniq("c"), Node: "n1", NodeUID: "uid1", Quarantine: -1, SpareLeases: 32})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	pool := dualStack(etcdtest.Uniq("p"), "10.52.0.0/22", "fd52::/118")
	ctx := ctxT(t)
	if _, err := a.Add(ctx, addReq(pool, "warm", "eth0", "uid-warm")); err != nil {
		t.Fatal(err)
	}
	adds := 1
	for round := 0; round < 10; round++ {
		armed.Store(true)
		const n = 16
		results := make([]allocator.Result, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { results[i], errs[i] = a.Add(ctx, addReq(pool, fmt.Sprintf("r%d-%d", round, i), "eth0", "")) })
		}
		wg.Wait()
		adds += n
		for i, err := range errs {
			if err != nil {
				t.Fatalf("round %d: ADD %d: %v", round, i, err)
			}
		}
		if armed.Load() {
			continue // no batch formed this round
		}
		keys := etcdtest.Dump(t, etcdtest.Client(t), keyspace.IPsPrefix(pool.Name))
		if len(keys) != 2*adds {
			t.Fatalf("want the 2 keys of each of %d ADDs, got %d: a claim was applied twice or not at all", adds, len(keys))
		}
		for i, res := range results {
			lease := mustLease(t, a, fmt.Sprintf("r%d-%d", round, i))
			for _, ip := range res.IPs {
				if l, ok := keys[keyspace.IPKey(pool.Name, allocator.DefaultBlocks, ip.Address.Addr())]; !ok || l != lease {
					t.Errorf("ADD %d returned %s; its key is missing or not on its lease", i, ip.Address)
				}
			}
		}
		if n := counterValue(a.metrics.claimBatches.WithLabelValues("lost")); n != 1 {
			t.Errorf("lost batches counted: %v, want 1", n)
		}
		return
	}
	t.Fatal("in 10 rounds of 16 concurrent ADDs no batch formed")
}
