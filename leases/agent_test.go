package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

func dualStack(name, v4, v6 string) allocator.PoolSpec {
	return allocator.PoolSpec{Name: name, Ranges: []allocator.RangeSet{
		{{Subnet: netip.MustParsePrefix(v4)}},
		{{Subnet: netip.MustParsePrefix(v6)}},
	}}
}

func addReq(pool allocator.PoolSpec, container, ifName, podUID string) allocator.Request {
	return allocator.Request{Network: pool.Name, Pool: pool, ContainerID: container, IfName: ifName,
		Pod: allocator.PodRef{UID: podUID, Namespace: "default", Name: "pod-" + container}}
}

// ctxT is the test's context (etcdtest.Ctx): no test here is bounded by the clock, only by
// the outcomes it waits for.
func ctxT(t *testing.T) context.Context { return etcdtest.Ctx(t) }

func TestAddIsIdempotentAndWritesOneLeasePerOwner(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	a := startAgent(t, cluster, "n1", "uid1")
	pool := dualStack(etcdtest.Uniq("p"), "10.1.0.0/24", "fd01::/64")
	ctx := ctxT(t)

	first, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatalf("add: %v", err)
	}
	if len(first.IPs) != 2 || !first.IPs[0].Address.Addr().Is4() || !first.IPs[1].Address.Addr().Is6() {
		t.Fatalf("want one IPv4 and one IPv6 address, got %+v", first)
	}
	again, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatalf("repeated add: %v", err)
	}
	if fmt.Sprint(again) != fmt.Sprint(first) {
		t.Errorf("repeated ADD returned %v, first returned %v", again, first)
	}
	// A second interface of the same pod shares the pod lease.
	if _, err := a.Add(ctx, addReq(pool, "c1", "net1", "u1")); err != nil {
		t.Fatalf("add net1: %v", err)
	}
	keys := etcdtest.Dump(t, etcdtest.Client(t), keyspace.Prefix)
	leases := map[int64]bool{}
	for k, l := range keys {
		if k == keyspace.PoolKey(pool.Name) {
			if l != 0 {
				t.Errorf("pool definition %s is on lease %x, want none", k, l)
			}
			continue
		}
		if !strings.HasPrefix(k, keyspace.IPsPrefix(pool.Name)) && !strings.HasPrefix(k, keyspace.OwnerPrefix(cluster, "u1")) &&
			k != keyspace.PodKey(cluster, "n1", "u1") {
			continue
		}
		if l == 0 {
			t.Errorf("key %s has no lease", k)
		}
		leases[l] = true
	}
	if len(leases) != 1 {
		t.Errorf("want every key of pod u1 on one lease, got %d leases: %v", len(leases), keys)
	}
	if n := etcdtest.Count(keys, keyspace.IPsPrefix(pool.Name)); n != 4 {
		t.Errorf("want 4 allocation keys (2 interfaces x 2 families), got %d", n)
	}
}

func TestConcurrentAddsFromTwoAgentsGetDistinctAddresses(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	agents := []*Agent{startAgent(t, cluster, "n1", "uid1"), startAgent(t, cluster, "n2", "uid2")}
	pool := dualStack(etcdtest.Uniq("p"), "10.2.0.0/25", "fd02::/120")
	ctx := ctxT(t)
	const n = 100
	results := make([]allocator.Result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			results[i], errs[i] = agents[i%2].Add(ctx, addReq(pool, fmt.Sprintf("ctr%d", i), "eth0", ""))
		})
	}
	wg.Wait()
	seen := map[netip.Addr]int{}
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("add %d: %v", i, errs[i])
		}
		for _, ip := range results[i].IPs {
			if j, dup := seen[ip.Address.Addr()]; dup {
				t.Errorf("address %s given to containers %d and %d", ip.Address.Addr(), j, i)
			}
			seen[ip.Address.Addr()] = i
		}
	}
	if len(seen) != 2*n {
		t.Errorf("want %d distinct addresses, got %d", 2*n, len(seen))
	}
}

func TestExhaustedPoolNamesPoolAndSize(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.3.0.0/29")}}}}
	ctx := ctxT(t)
	for i := range 5 { // .2 to .6: .0 network, .1 gateway, .7 broadcast
		if _, err := a.Add(ctx, addReq(pool, fmt.Sprintf("x%d", i), "eth0", "")); err != nil {
			t.Fatalf("add %d: %v", i, err)
		}
	}
	_, err := a.Add(ctx, addReq(pool, "x-last", "eth0", ""))
	if !errors.Is(err, allocator.ErrPoolExhausted) {
		t.Fatalf("want ErrPoolExhausted, got %v", err)
	}
	if !strings.Contains(err.Error(), pool.Name) || !strings.Contains(err.Error(), "5") {
		t.Errorf("error should name pool %s and its size 5: %v", pool.Name, err)
	}
}

func TestCheck(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	pool := dualStack(etcdtest.Uniq("p"), "10.6.0.0/24", "fd06::/64")
	ctx := ctxT(t)
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", ""))
	if err != nil {
		t.Fatal(err)
	}
	got, err := a.Check(ctx, addReq(pool, "c1", "eth0", ""))
	if err != nil || fmt.Sprint(got) != fmt.Sprint(res) {
		t.Errorf("CHECK = %v, %v; want %v", got, err, res)
	}
	if _, err := a.Check(ctx, addReq(pool, "c2", "eth0", "")); !errors.Is(err, allocator.ErrNotAllocated) {
		t.Errorf("CHECK of an unknown container: want ErrNotAllocated, got %v", err)
	}
	// Someone rewrites the allocation by hand onto another lease: CHECK reports a conflict.
	cli := etcdtest.Client(t)
	l, err := cli.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	key := keyspace.IPKey(pool.Name, allocator.DefaultBlocks, res.IPs[0].Address.Addr())
	if _, err := cli.Put(ctx, key, `{"owner":"intruder"}`, clientv3.WithLease(l.ID)); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Check(ctx, addReq(pool, "c1", "eth0", "")); !errors.Is(err, allocator.ErrConflict) {
		t.Errorf("CHECK after a foreign rewrite: want ErrConflict, got %v", err)
	}
	// DEL leaves the intruder's key alone: it is not on the owner's lease.
	if err := a.Del(ctx, addReq(pool, "c1", "eth0", "")); err != nil {
		t.Fatal(err)
	}
	if keys := etcdtest.Dump(t, cli, key); len(keys) != 1 {
		t.Errorf("DEL removed a key that was not on the owner's lease")
	}
}

func TestPoolDefinitionMismatchShowsBoth(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	name := etcdtest.Uniq("p")
	ctx := ctxT(t)
	if _, err := a.Add(ctx, addReq(dualStack(name, "10.7.0.0/24", "fd07::/64"), "c1", "eth0", "")); err != nil {
		t.Fatal(err)
	}
	_, err := a.Add(ctx, addReq(dualStack(name, "10.8.0.0/24", "fd07::/64"), "c2", "eth0", ""))
	if !errors.Is(err, allocator.ErrPoolMismatch) {
		t.Fatalf("want ErrPoolMismatch, got %v", err)
	}
	if !strings.Contains(err.Error(), "10.7.0.0/24") || !strings.Contains(err.Error(), "10.8.0.0/24") {
		t.Errorf("mismatch error should show both definitions: %v", err)
	}
}

func TestRefusedRequestsLeaveEtcdUnchanged(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	a := startAgent(t, cluster, "n1", "uid1")
	pool := dualStack(etcdtest.Uniq("p"), "10.9.0.0/24", "fd09::/64")
	ctx := ctxT(t)
	taken, err := a.Add(ctx, addReq(pool, "holder", "eth0", ""))
	if err != nil {
		t.Fatal(err)
	}
	cli := etcdtest.Client(t)
	before := etcdtest.Dump(t, cli, keyspace.Prefix)
	cases := []struct {
		name string
		req  allocator.Request
		want error
	}{
		// The requested address is someone else's.
		{"requested taken", func() allocator.Request {
			r := addReq(pool, "x1", "eth0", "")
			r.RequestedIPs = []netip.Addr{taken.IPs[0].Address.Addr()}
			return r
		}(), allocator.ErrAddressInUse},
		// Outside every range of the pool.
		{"requested outside", func() allocator.Request {
			r := addReq(pool, "x2", "eth0", "")
			r.RequestedIPs = []netip.Addr{netip.MustParseAddr("192.168.1.1")}
			return r
		}(), allocator.ErrNotInRange},
		// A container ID that would escape its key component.
		{"container with slash", addReq(pool, "../../x", "eth0", ""), allocator.ErrInvalidName},
		// An interface name that is empty.
		{"empty ifname", addReq(pool, "x3", "", ""), allocator.ErrInvalidName},
		// A pool definition that disagrees with the stored one.
		{"pool mismatch", addReq(dualStack(pool.Name, "10.10.0.0/24", "fd09::/64"), "x4", "eth0", ""), allocator.ErrPoolMismatch},
		// Ranges that overlap.
		{"overlap", addReq(dualStack(etcdtest.Uniq("p"), "10.11.0.0/24", "10.11.0.0/25"), "x5", "eth0", ""), allocator.ErrInvalidConfig},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := a.Add(ctx, tc.req); !errors.Is(err, tc.want) {
				t.Errorf("want %v, got %v", tc.want, err)
			}
		})
	}
	after := etcdtest.Dump(t, cli, keyspace.Prefix)
	for k := range after {
		// The node record may be renewed; a pool mismatch leaves its report for the pool's
		// other users (poolconflicts/). Neither is allocation state.
		if _, ok := before[k]; !ok && !strings.HasPrefix(k, keyspace.NodesPrefix(cluster)+"n1") && !strings.HasPrefix(k, keyspace.PoolConflictsPrefix("")) {
			t.Errorf("refused request wrote %s", k)
		}
	}
	for k := range before {
		if _, ok := after[k]; !ok {
			t.Errorf("refused request removed %s", k)
		}
	}
}

// TestLivenessReleasesAGoneSandboxOnlyAfterTheGrace: a pod whose netns path vanishes is
// released by the node itself, but never within the grace after its ADD.
func TestLivenessReleasesAGoneSandboxOnlyAfterTheGrace(t *testing.T) {
	const grace = 2 * time.Second
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1", func(c *Config) {
		c.LivenessInterval = 100 * time.Millisecond
		c.LivenessGrace = grace
	})
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.14.0.0/24")}}}}
	ctx := ctxT(t)
	netns := t.TempDir() + "/netns"
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	req := addReq(pool, "ctr", "eth0", "uid-x")
	req.Netns = netns
	added := time.Now() // the grace runs from inside Add, so from no earlier than this
	res, err := a.Add(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(netns); err != nil {
		t.Fatal(err)
	}
	cli := etcdtest.Client(t)
	key := keyspace.IPKey(pool.Name, allocator.DefaultBlocks, res.IPs[0].Address.Addr())
	// A read that answers before the grace has passed must find the key: the grace runs from
	// inside Add, so a release no earlier than it cannot be seen then, however slow the read.
	for {
		gone := len(etcdtest.Dump(t, cli, key)) == 0
		since := time.Since(added)
		if gone && since < grace {
			t.Fatalf("released %s after the ADD, inside the %s grace", since, grace)
		}
		if gone || since >= grace {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	etcdtest.Eventually(t, "the gone sandbox's address is released", func() error {
		n := len(etcdtest.Dump(t, cli, key))
		return etcdtest.Saw(n == 0, "%d keys at %s", n, key)
	})
	// The keys go in the release transaction; the agent forgets the pod after it has also
	// revoked the lease, one round trip later.
	etcdtest.Eventually(t, "the agent gives up the gone pod's lease after its keys", func() error {
		l, held := a.pods.Lease("uid-x")
		return etcdtest.Saw(!held, "the agent still holds lease %x", l)
	})
}

// TestRestartWithoutJournalRebuildsItFromEtcd: an agent whose state directory was wiped
// resumes its pods from their records in etcd and writes their attachments to the journal
// again, so a later lease loss can still be re-claimed.
func TestRestartWithoutJournalRebuildsItFromEtcd(t *testing.T) {
	cluster, state := etcdtest.Uniq("c"), t.TempDir()
	netns := t.TempDir() + "/netns"
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	withState := func(c *Config) { c.StateDir = state }
	pool := dualStack(etcdtest.Uniq("p"), "10.15.0.0/24", "fd15::/64")
	ctx := ctxT(t)
	first := startAgent(t, cluster, "n1", "uid1", withState)
	req := addReq(pool, "ctr", "eth0", "uid-j")
	req.Netns = netns
	res, err := first.Add(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	first.Close() // pod leases live on
	if err := os.RemoveAll(state); err != nil {
		t.Fatal(err)
	}
	second := startAgent(t, cluster, "n1", "uid1", withState)
	if _, ok := second.pods.Lease("uid-j"); !ok {
		t.Fatal("restarted agent did not resume the pod's lease")
	}
	var pods []podState
	var errs []error
	etcdtest.Eventually(t, "the rebuilt journal lists the pod", func() error { // written off the ADD path
		var l podbook.Loaded
		l, errs = podbook.Load(state)
		pods = l.Pods
		return etcdtest.Saw(len(pods) == 1, "%d pods (load errors %v)", len(pods), errs)
	})
	if len(errs) > 0 || len(pods) != 1 || len(pods[0].Attachments) != 1 {
		t.Fatalf("rebuilt journal: %+v, errors %v", pods, errs)
	}
	if got := pods[0].Attachments[0].IPs; fmt.Sprint(got) != fmt.Sprint([]netip.Addr{res.IPs[0].Address.Addr(), res.IPs[1].Address.Addr()}) {
		t.Errorf("journal names %v, the pod holds %v", got, res.IPs)
	}
}

// TestSecondAgentForTheSameNodeIsRefused: two agents on one node's state directory would both
// renew and release its pods; the second is refused while the first runs, and starts once
// the first is gone.
func TestSecondAgentForTheSameNodeIsRefused(t *testing.T) {
	cluster, state := etcdtest.Uniq("c"), t.TempDir()
	first := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.StateDir = state })
	ctx := ctxT(t)
	_, err := Start(ctx, etcdtest.Client(t), Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", StateDir: state, LeaseTTL: 10 * time.Second})
	if !errors.Is(err, ErrAgentRunning) || !strings.Contains(err.Error(), "locked by pid") {
		t.Fatalf("second agent on the same state directory: want ErrAgentRunning naming the holder, got %v", err)
	}
	first.Close()
	second, err := Start(ctx, etcdtest.Client(t), Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", StateDir: state, LeaseTTL: 10 * time.Second})
	if err != nil {
		t.Fatalf("agent after the first stopped: %v", err)
	}
	second.Close()
}

// TestRepeatedAddInAFullPoolReturnsTheAddresses: idempotency does not depend on free space.
// Found by TestModelRandomHistories: a repeated ADD in an exhausted pool failed with
// "pool exhausted" because candidates were chosen before the attachment was recognised.
func TestRepeatedAddInAFullPoolReturnsTheAddresses(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.16.0.0/30")}}}}
	ctx := ctxT(t)
	first, err := a.Add(ctx, addReq(pool, "only", "eth0", "")) // the /30's only address
	if err != nil {
		t.Fatal(err)
	}
	again, err := a.Add(ctx, addReq(pool, "only", "eth0", ""))
	if err != nil || fmt.Sprint(again) != fmt.Sprint(first) {
		t.Errorf("repeated ADD in a full pool: got %v, %v; want %v", again, err, first)
	}
	if _, err := a.Add(ctx, addReq(pool, "another", "eth0", "")); !errors.Is(err, allocator.ErrPoolExhausted) {
		t.Errorf("a new attachment in the full pool: want ErrPoolExhausted, got %v", err)
	}
}
