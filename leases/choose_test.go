package leases

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// storePool writes pool's definition with access, as leaseholdctl pool create and pool
// close/lock do.
func storePool(t *testing.T, cli *clientv3.Client, spec allocator.PoolSpec, access keyspace.PoolAccess) {
	t.Helper()
	if err := spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	if spec.Blocks.Flat() {
		spec.Blocks = allocator.DefaultBlocks
	}
	if _, err := cli.Put(ctxT(t), keyspace.PoolKey(spec.Name), keyspace.EncodePoolWith(spec, access)); err != nil {
		t.Fatal(err)
	}
}

func rangePool(name, subnet, start, end string) allocator.PoolSpec {
	return allocator.PoolSpec{Name: name, Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix(subnet),
		RangeStart: netip.MustParseAddr(start), RangeEnd: netip.MustParseAddr(end)}}}}
}

// TestPoolsChosenByRulesFallBackAndClose: a namespace's rule gives its pods their pools in
// order, a full pool passes the ADD to the next, a DEL and a CHECK under the network
// configuration's pool find a pod where it was allocated, a closed pool gives no new address
// while its pod's repeated ADD still gets its own, and a pod asking for another tenant's pool
// is refused with etcd unchanged.
func TestPoolsChosenByRulesFallBackAndClose(t *testing.T) {
	ctx, cli := ctxT(t), etcdtest.Client(t)
	cluster := etcdtest.Uniq("c")
	net := rangePool(etcdtest.Uniq("net"), "10.97.0.0/24", "10.97.0.10", "10.97.0.200")
	small := rangePool(etcdtest.Uniq("small"), "10.97.1.0/24", "10.97.1.10", "10.97.1.11")
	next := rangePool(etcdtest.Uniq("next"), "10.97.2.0/24", "10.97.2.10", "10.97.2.20")
	other := rangePool(etcdtest.Uniq("other"), "10.97.3.0/24", "10.97.3.10", "10.97.3.20")
	storePool(t, cli, small, keyspace.PoolAccess{})
	storePool(t, cli, next, keyspace.PoolAccess{})
	storePool(t, cli, other, keyspace.PoolAccess{Namespaces: []string{"tenant-b"}})
	if _, err := cli.Put(ctx, keyspace.NamespaceRuleKey(cluster, net.Name, "tenant-a"),
		keyspace.Encode(keyspace.NamespaceRule{Pools: []string{small.Name, next.Name}})); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, cluster, "n1", "uid1")
	req := func(uid string) allocator.Request {
		r := addReq(net, uid, "eth0", uid)
		r.Network, r.Pod.Namespace = net.Name, "tenant-a"
		return r
	}
	in := func(res allocator.Result, p allocator.PoolSpec) bool {
		ips := addrs(res)
		return len(ips) == 1 && p.Ranges[0][0].Subnet.Contains(ips[0])
	}
	var got []allocator.Result
	for _, uid := range []string{"p1", "p2", "p3"} {
		res, err := a.Add(ctx, req(uid))
		if err != nil {
			t.Fatalf("ADD %s: %v", uid, err)
		}
		got = append(got, res)
	}
	if !in(got[0], small) || !in(got[1], small) || !in(got[2], next) {
		t.Fatalf("want p1 and p2 in %s and p3 in %s (the next once the first is full), got %v", small.Name, next.Name, got)
	}
	// A pod of a namespace without a rule gets the configuration's pool.
	plain := req("plain")
	plain.Pod.Namespace = "elsewhere"
	if res, err := a.Add(ctx, plain); err != nil || !in(res, net) {
		t.Fatalf("a namespace without a rule: %v, %v; want an address of %s", res, err, net.Name)
	}

	// CHECK and DEL name the configuration's pool; the pod is found in the pool it is in.
	if _, err := a.Check(ctx, req("p3")); err != nil {
		t.Fatalf("CHECK of p3: %v", err)
	}
	if err := a.Del(ctx, req("p3")); err != nil {
		t.Fatal(err)
	}
	if keys := etcdtest.Dump(t, cli, keyspace.OwnerKey(cluster, "p3", "eth0", next.Name)); len(keys) != 0 {
		t.Fatalf("p3's owner index in %s outlived its DEL: %v", next.Name, keys)
	}

	// Closed: no new address from it, but p3 again... is new; p1's repeated ADD is not.
	storePool(t, cli, next, keyspace.PoolAccess{Closed: true})
	etcdtest.Eventually(t, "the closed pool refuses a new pod", func() error {
		_, err := a.Add(ctx, req("p4"))
		return etcdtest.Saw(errors.Is(err, allocator.ErrPoolExhausted) && strings.Contains(err.Error(), next.Name+" (closed)"),
			"ADD p4: %v", err)
	})
	storePool(t, cli, small, keyspace.PoolAccess{Closed: true})
	if res, err := a.Add(ctx, req("p1")); err != nil || !reflect.DeepEqual(res.IPs, got[0].IPs) {
		t.Fatalf("repeated ADD of p1 in a closed pool: %v, %v; want its own %v", res, err, got[0].IPs)
	}

	// A pod asking for another tenant's pool is refused, and etcd is unchanged.
	before := etcdtest.Dump(t, cli, keyspace.Prefix)
	asks := req("p5")
	asks.Pools = []string{other.Name}
	if _, err := a.Add(ctx, asks); !errors.Is(err, allocator.ErrInvalidConfig) || !strings.Contains(err.Error(), other.Name) ||
		!strings.Contains(err.Error(), "tenant-a") {
		t.Fatalf("asking for another tenant's pool: %v; want an invalid configuration naming the pool and the namespace", err)
	}
	if after := etcdtest.Dump(t, cli, keyspace.Prefix); !reflect.DeepEqual(before, after) {
		t.Fatalf("a refused ADD changed etcd")
	}
}

// TestAStickyClaimIsFoundWhereItWasMade: a StatefulSet pod's claim is made in the pool its
// namespace's rule gave. When the rule later names another pool, and when the claim's pool is
// closed, the pod's next incarnation still gets the claim's addresses there, while a new
// claim goes where the rule says now, and none comes from the closed pool. A pool opened
// is open to the very next ADD, whatever the agent's watch has delivered.
func TestAStickyClaimIsFoundWhereItWasMade(t *testing.T) {
	ctx, cli := ctxT(t), etcdtest.Client(t)
	cluster := etcdtest.Uniq("c")
	net := rangePool(etcdtest.Uniq("net"), "10.98.0.0/24", "10.98.0.10", "10.98.0.200")
	first := rangePool(etcdtest.Uniq("first"), "10.98.1.0/24", "10.98.1.10", "10.98.1.20")
	then := rangePool(etcdtest.Uniq("then"), "10.98.2.0/24", "10.98.2.10", "10.98.2.20")
	storePool(t, cli, first, keyspace.PoolAccess{})
	storePool(t, cli, then, keyspace.PoolAccess{})
	rule := func(p allocator.PoolSpec) {
		t.Helper()
		if _, err := cli.Put(ctx, keyspace.NamespaceRuleKey(cluster, net.Name, "tenant"),
			keyspace.Encode(keyspace.NamespaceRule{Pools: []string{p.Name}})); err != nil {
			t.Fatal(err)
		}
	}
	rule(first)
	a := startAgent(t, cluster, "n1", "uid1")
	req := func(uid, claim string) allocator.Request {
		r := stickyReq(net, uid+"-c", uid, claim)
		r.Network, r.Pod.Namespace = net.Name, "tenant"
		return r
	}
	in := func(res allocator.Result, p allocator.PoolSpec) bool {
		ips := resultAddrs(res)
		return len(ips) == 1 && p.Ranges[0][0].Subnet.Contains(ips[0])
	}
	g1, err := a.Add(ctx, req("g1", "tenant.web-0"))
	if err != nil || !in(g1, first) {
		t.Fatalf("the first incarnation: %v, %v; want an address of %s", g1, err, first.Name)
	}
	if err := a.Del(ctx, req("g1", "tenant.web-0")); err != nil {
		t.Fatal(err)
	}

	// The rule now names another pool: new claims go there, the claim made stays.
	rule(then)
	tries := 0
	etcdtest.Eventually(t, "a new claim goes to the pool the rule names now", func() error {
		tries++ // a new pod and claim each time: one made before the agent saw the rule stays
		res, err := a.Add(ctx, req(fmt.Sprintf("other-%d", tries), fmt.Sprintf("tenant.web-1-%d", tries)))
		return etcdtest.Saw(err == nil && in(res, then), "ADD of a new claim: %v, %v", res, err)
	})
	g2, err := a.Add(ctx, req("g2", "tenant.web-0"))
	if err != nil || !reflect.DeepEqual(resultAddrs(g2), resultAddrs(g1)) {
		t.Fatalf("the next incarnation after the rule changed: %v, %v; want the claim's %v", resultAddrs(g2), err, resultAddrs(g1))
	}
	if err := a.Del(ctx, req("g2", "tenant.web-0")); err != nil {
		t.Fatal(err)
	}

	// The claim's pool closed, and named by the rule again: no new claim gets an address
	// from it, the claim made gets its own.
	storePool(t, cli, first, keyspace.PoolAccess{Closed: true})
	rule(first)
	etcdtest.Eventually(t, "a new claim is refused by the closed pool", func() error {
		tries++
		_, err := a.Add(ctx, req(fmt.Sprintf("new-%d", tries), fmt.Sprintf("tenant.web-2-%d", tries)))
		return etcdtest.Saw(errors.Is(err, allocator.ErrInvalidConfig) && strings.Contains(err.Error(), first.Name), "ADD of a new claim: %v", err)
	})
	g3, err := a.Add(ctx, req("g3", "tenant.web-0"))
	if err != nil || !reflect.DeepEqual(resultAddrs(g3), resultAddrs(g1)) {
		t.Fatalf("the next incarnation in the closed pool: %v, %v; want the claim's %v", resultAddrs(g3), err, resultAddrs(g1))
	}

	// Opened: the next ADD gets an address, without waiting for the watch.
	storePool(t, cli, first, keyspace.PoolAccess{})
	if res, err := a.Add(ctx, req("opened", "tenant.web-3")); err != nil || !in(res, first) {
		t.Fatalf("ADD right after the pool was opened: %v, %v; want an address of %s", res, err, first.Name)
	}
}

// TestOneInterfaceGetsIPv4AndIPv6FromTwoPools: a namespace's rule for a dual-stack network
// names IPv4 pools and an IPv6 pool, none with both families. One ADD claims an attachment in
// each, an owner index per pool listing its family's address, in one transaction; a repeated
// ADD and a CHECK return both; a full IPv4 pool passes IPv4 alone to the next; a full IPv6
// pool refuses the ADD with nothing claimed in the IPv4 pool; a lost lease re-claims both
// attachments; a DEL releases both.
func TestOneInterfaceGetsIPv4AndIPv6FromTwoPools(t *testing.T) {
	ctx, cli := ctxT(t), etcdtest.Client(t)
	cluster := etcdtest.Uniq("c")
	net := dualStack(etcdtest.Uniq("net"), "10.96.0.0/24", "fd96::/64")
	stored := func(p allocator.PoolSpec) allocator.PoolSpec {
		p.Blocks = allocator.DefaultBlocks
		storePool(t, cli, p, keyspace.PoolAccess{})
		return p
	}
	v4a := stored(rangePool(etcdtest.Uniq("v4a"), "10.96.1.0/24", "10.96.1.10", "10.96.1.11"))
	v4b := stored(rangePool(etcdtest.Uniq("v4b"), "10.96.2.0/24", "10.96.2.10", "10.96.2.20"))
	v6 := stored(rangePool(etcdtest.Uniq("v6"), "fd96:1::/64", "fd96:1::10", "fd96:1::12"))
	if _, err := cli.Put(ctx, keyspace.NamespaceRuleKey(cluster, net.Name, "tenant"),
		keyspace.Encode(keyspace.NamespaceRule{Pools: []string{v4a.Name, v6.Name, v4b.Name}})); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, cluster, "n1", "uid1", withHold(t.TempDir()))
	req := func(uid string) allocator.Request {
		r := addReq(net, uid, "eth0", uid)
		r.Pod.Namespace = "tenant"
		return r
	}
	from := func(res allocator.Result, p4, p6 allocator.PoolSpec) error {
		ips := addrs(res)
		return etcdtest.Saw(len(ips) == 2 && p4.Ranges[0][0].Subnet.Contains(ips[0]) && p6.Ranges[0][0].Subnet.Contains(ips[1]),
			"addresses %v, want IPv4 from %s and IPv6 from %s", ips, p4.Name, p6.Name)
	}
	index := func(owner string, p allocator.PoolSpec) []netip.Addr {
		t.Helper()
		resp, err := cli.Get(ctx, keyspace.OwnerKey(cluster, owner, "eth0", p.Name))
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 0 {
			return nil
		}
		rec, err := keyspace.Decode[keyspace.OwnerRecord](string(resp.Kvs[0].Key), resp.Kvs[0].Value)
		if err != nil {
			t.Fatal(err)
		}
		return rec.IPs
	}

	r1, err := a.Add(ctx, req("p1"))
	if err != nil {
		t.Fatalf("ADD of p1: %v", err)
	}
	if err := from(r1, v4a, v6); err != nil {
		t.Fatal(err)
	}
	ip4, ip6 := addrs(r1)[0], addrs(r1)[1]
	if got4, got6 := index("p1", v4a), index("p1", v6); !reflect.DeepEqual(got4, []netip.Addr{ip4}) || !reflect.DeepEqual(got6, []netip.Addr{ip6}) {
		t.Fatalf("owner indexes of p1: %v in %s, %v in %s; want %v and %v", got4, v4a.Name, got6, v6.Name, ip4, ip6)
	}
	if again, err := a.Add(ctx, req("p1")); err != nil || !reflect.DeepEqual(again.IPs, r1.IPs) {
		t.Fatalf("repeated ADD of p1: %v, %v; want %v", again, err, r1.IPs)
	}
	if checked, err := a.Check(ctx, req("p1")); err != nil || !reflect.DeepEqual(addrs(checked), addrs(r1)) {
		t.Fatalf("CHECK of p1: %v, %v; want %v", checked, err, addrs(r1))
	}

	// The IPv4 pool full: IPv4 from the next, IPv6 still from its own.
	r2, err := a.Add(ctx, req("p2"))
	if err != nil || from(r2, v4a, v6) != nil {
		t.Fatalf("ADD of p2: %v, %v; want the last IPv4 address of %s", r2, err, v4a.Name)
	}
	r3, err := a.Add(ctx, req("p3"))
	if err != nil {
		t.Fatalf("ADD of p3: %v", err)
	}
	if err := from(r3, v4b, v6); err != nil {
		t.Fatalf("ADD of p3 once %s is full: %v", v4a.Name, err)
	}

	// The IPv6 pool full: neither family is claimed.
	before := etcdtest.Dump(t, cli, keyspace.Prefix)
	if _, err := a.Add(ctx, req("p4")); !errors.Is(err, allocator.ErrPoolExhausted) || !strings.Contains(err.Error(), v6.Name) {
		t.Fatalf("ADD of p4 with %s full: %v; want exhausted naming it", v6.Name, err)
	}
	if after := etcdtest.Dump(t, cli, keyspace.Prefix); !reflect.DeepEqual(before, after) {
		t.Fatalf("an ADD refused for want of an IPv6 address changed etcd")
	}

	// The pod's lease lost: both attachments come back.
	expire(t, cli, a, "p1")
	etcdtest.Eventually(t, "both attachments of p1 are re-claimed", func() error {
		return errors.Join(ownerIs(t, cli, v4a, ip4, "p1"), ownerIs(t, cli, v6, ip6, "p1"),
			etcdtest.Saw(len(index("p1", v4a)) == 1 && len(index("p1", v6)) == 1, "owner indexes of p1 not back"))
	})

	// DEL releases both, and the pod with them.
	if err := a.Del(ctx, req("p1")); err != nil {
		t.Fatal(err)
	}
	if o4, o6 := allocOwner(t, cli, v4a, ip4), allocOwner(t, cli, v6, ip6); o4 != "" || o6 != "" {
		t.Fatalf("after p1's DEL %s is held by %q and %s by %q", ip4, o4, ip6, o6)
	}
	if index("p1", v4a) != nil || index("p1", v6) != nil {
		t.Fatalf("an owner index of p1 outlived its DEL")
	}
	if keys := etcdtest.Dump(t, cli, keyspace.PodKey(cluster, "n1", "p1")); len(keys) != 0 {
		t.Fatalf("p1's pod record outlived its DEL: %v", keys)
	}
}
