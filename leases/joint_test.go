package leases

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// twoPoolNet is a dual-stack network whose namespace "tenant" has a rule naming pools, in
// order, stored with the default block layout (returned as stored), and an agent serving it.
func twoPoolNet(t *testing.T, v4, v6 string, pools ...allocator.PoolSpec) (allocator.PoolSpec, []allocator.PoolSpec, *Agent, string) {
	t.Helper()
	cli, cluster := etcdtest.Client(t), etcdtest.Uniq("c")
	net := dualStack(etcdtest.Uniq("net"), v4, v6)
	var names []string
	for i := range pools {
		pools[i].Blocks = allocator.DefaultBlocks
		storePool(t, cli, pools[i], keyspace.PoolAccess{})
		names = append(names, pools[i].Name)
	}
	if _, err := cli.Put(ctxT(t), keyspace.NamespaceRuleKey(cluster, net.Name, "tenant"),
		keyspace.Encode(keyspace.NamespaceRule{Pools: names})); err != nil {
		t.Fatal(err)
	}
	return net, pools, startAgent(t, cluster, "n1", "uid1"), cluster
}

// v4AndV6 is twoPoolNet with an IPv4 pool of 10.<n>.1.10-20 and an IPv6 pool of
// fd<n>:1::10 to fd<n>:1::<v6end>, in that order.
func v4AndV6(t *testing.T, n int, v6end string) (net, v4, v6 allocator.PoolSpec, a *Agent, cluster string) {
	t.Helper()
	v4p, v6p := fmt.Sprintf("10.%d.1.", n), fmt.Sprintf("fd%d:1::", n)
	net, pools, a, cluster := twoPoolNet(t, fmt.Sprintf("10.%d.0.0/24", n), fmt.Sprintf("fd%d::/64", n),
		rangePool(etcdtest.Uniq("v4"), v4p+"0/24", v4p+"10", v4p+"20"),
		rangePool(etcdtest.Uniq("v6"), v6p+"/64", v6p+"10", v6p+v6end))
	return net, pools[0], pools[1], a, cluster
}

// ownerIPs are the addresses the owner index of owner's eth0 in pool lists, nil without one.
func ownerIPs(t *testing.T, cluster, owner string, pool allocator.PoolSpec) []netip.Addr {
	t.Helper()
	key := keyspace.OwnerKey(cluster, owner, "eth0", pool.Name)
	resp, err := etcdtest.Client(t).Get(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	rec, err := keyspace.Decode[keyspace.OwnerRecord](key, resp.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	return rec.IPs
}

func inPool(p allocator.PoolSpec, ip netip.Addr) bool {
	return slices.ContainsFunc(p.Ranges, func(s allocator.RangeSet) bool { return s.Contains(ip) })
}

// TestMixedListsGiveEachFamilyItsFirstPool: a rule mixing an IPv4 pool, a dual-stack pool and
// an IPv6 pool gives each family the first pool of the list that has it: IPv4 from the IPv4
// pool and IPv6 from the dual-stack one (its owner index lists only that), until the IPv4 pool
// is full (IPv4 then from the dual-stack pool) and the dual-stack pool's IPv6 is full (IPv6
// then from the IPv6 pool); once the IPv4 pool has room again, IPv4 comes from it again.
// CHECK and DEL take every attachment.
func TestMixedListsGiveEachFamilyItsFirstPool(t *testing.T) {
	ctx := ctxT(t)
	v4 := rangePool(etcdtest.Uniq("v4"), "10.94.1.0/24", "10.94.1.10", "10.94.1.11")
	dual := rangePool(etcdtest.Uniq("dual"), "10.94.2.0/24", "10.94.2.10", "10.94.2.20")
	dual.Ranges = append(dual.Ranges, rangePool("", "fd94:2::/64", "fd94:2::10", "fd94:2::11").Ranges...)
	v6 := rangePool(etcdtest.Uniq("v6"), "fd94:3::/64", "fd94:3::10", "fd94:3::20")
	net, pools, a, cluster := twoPoolNet(t, "10.94.0.0/24", "fd94::/64", v4, dual, v6)
	v4, dual, v6 = pools[0], pools[1], pools[2]
	req := func(uid string) allocator.Request {
		r := addReq(net, uid, "eth0", uid)
		r.Pod.Namespace = "tenant"
		return r
	}
	from := func(uid string, p4, p6 allocator.PoolSpec) []netip.Addr {
		t.Helper()
		res, err := a.Add(ctx, req(uid))
		ips := addrs(res)
		if err != nil || len(ips) != 2 || !ips[0].Is4() || !inPool(p4, ips[0]) || !inPool(p6, ips[1]) {
			t.Fatalf("ADD of %s: %v, %v; want IPv4 from %s and IPv6 from %s", uid, ips, err, p4.Name, p6.Name)
		}
		return ips
	}

	p1 := from("p1", v4, dual)
	if got := ownerIPs(t, cluster, "p1", dual); !reflect.DeepEqual(got, p1[1:]) {
		t.Fatalf("p1's owner index in the dual-stack pool lists %v; want its IPv6 address %v alone", got, p1[1])
	}
	from("p2", v4, dual)
	// IPv4 pool full: IPv4 from the dual-stack pool; its IPv6 full: IPv6 from the IPv6 pool.
	p3 := from("p3", dual, v6)
	if got := ownerIPs(t, cluster, "p3", dual); !reflect.DeepEqual(got, p3[:1]) {
		t.Fatalf("p3's owner index in the dual-stack pool lists %v; want its IPv4 address %v alone", got, p3[0])
	}
	if checked, err := a.Check(ctx, req("p3")); err != nil || !reflect.DeepEqual(addrs(checked), p3) {
		t.Fatalf("CHECK of p3: %v, %v; want %v", addrs(checked), err, p3)
	}

	// p1's DEL gives the IPv4 pool and the dual-stack pool's IPv6 room: the next pod's
	// families come from the first pools of their lists again.
	if err := a.Del(ctx, req("p1")); err != nil {
		t.Fatal(err)
	}
	if ownerIPs(t, cluster, "p1", v4) != nil || ownerIPs(t, cluster, "p1", dual) != nil {
		t.Fatalf("an owner index of p1 outlived its DEL")
	}
	from("p4", v4, dual)
	if err := a.Del(ctx, req("p3")); err != nil {
		t.Fatal(err)
	}
	if ownerIPs(t, cluster, "p3", dual) != nil || ownerIPs(t, cluster, "p3", v6) != nil {
		t.Fatalf("an owner index of p3 outlived its DEL")
	}
}

// TestRequestedAddressesGoToThePoolOfTheirFamily: on a dual-stack network whose IPv4 and
// IPv6 come from two pools, each requested address is claimed in the pool that has it, a
// family asked for nothing gets the pool's choice, an address of no chosen pool is refused
// (code 7, naming it) and an address held elsewhere refuses the whole ADD, with etcd
// unchanged both times.
func TestRequestedAddressesGoToThePoolOfTheirFamily(t *testing.T) {
	ctx, cli := ctxT(t), etcdtest.Client(t)
	net, v4, v6, a, cluster := v4AndV6(t, 93, "20")
	req := func(uid string, ips ...string) allocator.Request {
		r := addReq(net, uid, "eth0", uid)
		r.Pod.Namespace = "tenant"
		for _, ip := range ips {
			r.RequestedIPs = append(r.RequestedIPs, netip.MustParseAddr(ip))
		}
		return r
	}
	want := []netip.Addr{netip.MustParseAddr("10.93.1.15"), netip.MustParseAddr("fd93:1::15")}
	// Asked for in the other order: each address goes to its family's pool all the same.
	res, err := a.Add(ctx, req("p1", "fd93:1::15", "10.93.1.15"))
	if err != nil || !reflect.DeepEqual(addrs(res), want) {
		t.Fatalf("ADD asking for %v: %v, %v", want, addrs(res), err)
	}
	if g4, g6 := ownerIPs(t, cluster, "p1", v4), ownerIPs(t, cluster, "p1", v6); !reflect.DeepEqual(g4, want[:1]) || !reflect.DeepEqual(g6, want[1:]) {
		t.Fatalf("owner indexes of p1: %v in %s, %v in %s; want %v and %v", g4, v4.Name, g6, v6.Name, want[0], want[1])
	}
	res, err = a.Add(ctx, req("p2", "fd93:1::16"))
	if ips := addrs(res); err != nil || len(ips) != 2 || !inPool(v4, ips[0]) || ips[1] != netip.MustParseAddr("fd93:1::16") {
		t.Fatalf("ADD asking for an IPv6 address only: %v, %v; want an IPv4 address of %s and fd93:1::16", ips, err, v4.Name)
	}

	before := etcdtest.Dump(t, cli, keyspace.Prefix)
	if _, err := a.Add(ctx, req("p3", "10.93.1.17", "10.93.9.9")); !errors.Is(err, allocator.ErrInvalidConfig) || !strings.Contains(err.Error(), "10.93.9.9") {
		t.Fatalf("ADD asking for an address of no chosen pool: %v; want code 7 naming it", err)
	}
	if _, err := a.Add(ctx, req("p4", "10.93.1.17", "fd93:1::15")); !errors.Is(err, allocator.ErrAddressInUse) {
		t.Fatalf("ADD asking for p1's IPv6 address: %v; want it in use", err)
	}
	if after := etcdtest.Dump(t, cli, keyspace.Prefix); !reflect.DeepEqual(before, after) {
		t.Fatalf("a refused ADD changed etcd")
	}
}

// TestAStickyClaimWithTwoPoolsKeepsBothFamilies: a StatefulSet pod on a dual-stack network
// whose families come from two pools makes its claim in both, a record per pool. Its DEL
// releases both onto their hold (no other pod gets either address); its next incarnation gets
// both back, in one transaction. With one family's record deleted by hand, the next
// incarnation gets that family's address back and a new address of the other, never one
// another live claim holds or the claim's old one, and the claim is made again in that pool.
func TestAStickyClaimWithTwoPoolsKeepsBothFamilies(t *testing.T) {
	ctx, cli := ctxT(t), etcdtest.Client(t)
	net, v4, v6, a, cluster := v4AndV6(t, 92, "12")
	const name = "tenant.web-0"
	req := func(uid, claim string) allocator.Request {
		r := stickyReq(net, uid+"-c", uid, claim)
		r.Pod.Namespace = "tenant"
		return r
	}
	key4, key6 := keyspace.ClaimKey(cluster, v4.Name, name), keyspace.ClaimKey(cluster, v6.Name, name)
	holds := func(key, owner string, ip netip.Addr) error {
		rec, ok := readClaimRecord(t, cli, key)
		held := ok && (owner == "") == (rec.Holder == nil) && (rec.Holder == nil || rec.Holder.Owner == owner)
		return etcdtest.Saw(held && reflect.DeepEqual(rec.IPs, []netip.Addr{ip}), "claim %s: %+v (present %v); want %v held by %q",
			key, rec, ok, ip, owner)
	}

	g1, err := a.Add(ctx, req("g1", name))
	ips := addrs(g1)
	if err != nil || len(ips) != 2 || !inPool(v4, ips[0]) || !inPool(v6, ips[1]) {
		t.Fatalf("the first incarnation: %v, %v; want IPv4 from %s and IPv6 from %s", ips, err, v4.Name, v6.Name)
	}
	if err := errors.Join(holds(key4, "g1", ips[0]), holds(key6, "g1", ips[1])); err != nil {
		t.Fatal(err)
	}
	other, err := a.Add(ctx, req("other", "tenant.web-1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, req("g1", name)); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(holds(key4, "", ips[0]), holds(key6, "", ips[1])); err != nil {
		t.Fatalf("after the DEL: %v", err)
	}
	// Neither address goes to a pod without the claim.
	asks := addReq(net, "thief-c", "eth0", "thief")
	asks.Pod.Namespace, asks.RequestedIPs = "tenant", []netip.Addr{ips[1]}
	if _, err := a.Add(ctx, asks); !errors.Is(err, allocator.ErrAddressInUse) {
		t.Fatalf("another pod asking for the claim's IPv6 address: %v; want it in use", err)
	}

	g2, err := a.Add(ctx, req("g2", name))
	if err != nil || !reflect.DeepEqual(addrs(g2), ips) {
		t.Fatalf("the next incarnation: %v, %v; want the claim's %v", addrs(g2), err, ips)
	}
	if err := errors.Join(holds(key4, "g2", ips[0]), holds(key6, "g2", ips[1])); err != nil {
		t.Fatal(err)
	}
	if n := metricValue(t, a, "leasehold_claim_handovers_total"); n != 2 {
		t.Errorf("hand-overs counted: %v, want 2 (one per pool)", n)
	}
	if again, err := a.Add(ctx, req("g2", name)); err != nil || !reflect.DeepEqual(addrs(again), ips) {
		t.Fatalf("repeated ADD of g2: %v, %v; want %v", addrs(again), err, ips)
	}
	if err := a.Del(ctx, req("g2", name)); err != nil {
		t.Fatal(err)
	}

	// The IPv6 record deleted by hand: IPv4 comes back; IPv6 is new, made a claim again.
	if _, err := cli.Delete(ctx, key6); err != nil {
		t.Fatal(err)
	}
	g3, err := a.Add(ctx, req("g3", name))
	got := addrs(g3)
	if err != nil || len(got) != 2 || got[0] != ips[0] || !inPool(v6, got[1]) {
		t.Fatalf("the incarnation after the IPv6 record went: %v, %v; want %v and an IPv6 address of %s", got, err, ips[0], v6.Name)
	}
	if got[1] == ips[1] || got[1] == addrs(other)[1] {
		t.Fatalf("the claim half gone got IPv6 %v: the claim's old one or another live claim's (%v)", got[1], addrs(other)[1])
	}
	if err := errors.Join(holds(key4, "g3", ips[0]), holds(key6, "g3", got[1])); err != nil {
		t.Fatal(err)
	}
}
