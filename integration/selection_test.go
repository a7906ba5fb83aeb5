package integration

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// TestSelectionRulesOnRealAgents (issue 34): two agents (the leaseholdd binary) on nodes
// labelled zone=a and zone=b, the real plugin, rules in etcd. Pods of three namespaces get
// the pools their rules give: ns-a its namespace's list, whose first pool (one address) is
// full at the second pod, which passes to the next; ns-b its node's pool by label; ns-c its
// namespace's list, whose first pool is then closed: a new pod gets the next pool, the
// running pod's repeated ADD its own address, a pod asking for the closed pool nothing. A
// pod asking for a pool it may not use gets code 7 and etcd is unchanged. Every DEL releases.
func TestSelectionRulesOnRealAgents(t *testing.T) {
	f := newFixture(t, withoutAgent())
	pools := map[string]string{} // name -> IPv4 subnet
	pool := func(name, subnet string) string {
		t.Helper()
		name = uniq(name)
		if _, err := admin.CreatePool(f.Ctx, f.Cli, allocator.PoolSpec{Name: name,
			Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix(subnet)}}}}); err != nil {
			t.Fatal(err)
		}
		pools[name] = subnet
		return name
	}
	alpha, alpha2 := pool("alpha", "10.51.1.0/30"), pool("alpha2", "10.51.2.0/28") // alpha: one address
	zoneA, zoneB := pool("zone-a", "10.51.3.0/28"), pool("zone-b", "10.51.4.0/28")
	closing, gamma := pool("closing", "10.51.5.0/28"), pool("gamma", "10.51.6.0/28")
	network := f.Pool
	for ns, list := range map[string][]string{"ns-a": {alpha, alpha2}, "ns-c": {closing, gamma}} {
		if err := admin.SetNamespaceRule(f.Ctx, f.Cli, f.Cluster, network, ns, keyspace.NamespaceRule{Pools: list}); err != nil {
			t.Fatal(err)
		}
	}
	for name, r := range map[string]keyspace.NodeRule{
		"za": {Labels: map[string]string{"zone": "a"}, Pools: []string{zoneA}},
		"zb": {Labels: map[string]string{"zone": "b"}, Pools: []string{zoneB}},
	} {
		if err := admin.SetNodeRule(f.Ctx, f.Cli, f.Cluster, network, name, r); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, _, err := admin.SetPoolAccess(f.Ctx, f.Cli, alpha, func(a *keyspace.PoolAccess) { a.Namespaces = []string{"ns-a"} }); err != nil {
		t.Fatal(err)
	}
	// The agents start after the rules: their first listing holds them.
	n1 := f.startAgent("--node", uniq("rack1-"), "--node-label", "zone=a")
	n2 := f.startAgent("--node", uniq("rack2-"), "--node-label", "zone=b,rack=2")
	conf := map[*agentProc][]byte{
		n1: v4conf(network, n1.Socket, "10.51.0.0/24"),
		n2: v4conf(network, n2.Socket, "10.51.0.0/24"),
	}
	type pod struct {
		node      *agentProc
		container string
		args      string
	}
	podOf := func(node *agentProc, ns, name string, asked ...string) pod {
		args := fmt.Sprintf("K8S_POD_UID=%s;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s", uniq("uid-"), ns, name)
		if len(asked) > 0 {
			args += ";LEASEHOLD_POOL=" + strings.Join(asked, ",")
		}
		return pod{node, uniq("ctr-"), args}
	}
	in := func(ip netip.Addr, name string) bool { return netip.MustParsePrefix(pools[name]).Contains(ip) }
	var made []pod
	add := func(p pod, want string) netip.Addr {
		t.Helper()
		ip := f.ipv4(conf[p.node], p.container, p.args)
		if !in(ip, want) {
			t.Errorf("pod %s (%s) on %s got %s, want one of pool %s (%s)", p.container, p.args, p.node.Node, ip, want, pools[want])
		}
		made = append(made, p)
		return ip
	}

	// Three namespaces, two nodes.
	add(podOf(n1, "ns-a", "a1"), alpha)
	add(podOf(n2, "ns-a", "a2"), alpha2) // alpha is full: the ADD passes to the next pool
	add(podOf(n1, "ns-b", "b1"), zoneA)  // no namespace rule: its node's, by label
	add(podOf(n2, "ns-b", "b2"), zoneB)
	c1 := podOf(n2, "ns-c", "c1")
	c1IP := add(c1, closing)

	// Refused with code 7, etcd unchanged: a pool locked to another namespace, one outside the
	// namespace's rule, one that does not exist.
	before := snapshot(t, f.Cli, keyspace.Prefix)
	for _, p := range []pod{
		podOf(n1, "ns-b", "x1", alpha),
		podOf(n2, "ns-a", "x2", zoneB),
		podOf(n1, "ns-b", "x3", "no-such-pool"),
	} {
		_, err := f.add(conf[p.node], p.container, "eth0", p.args)
		if code := cniCode(err); code != 7 || !strings.Contains(err.Error(), "pool") {
			t.Errorf("pod %s asking for a pool it may not use: code %d, %v; want 7 naming the pool", p.args, code, err)
		}
	}
	if after := snapshot(t, f.Cli, keyspace.Prefix); !maps.Equal(before, after) {
		t.Errorf("refused ADDs changed etcd:\nbefore %v\nafter  %v", before, after)
	}

	// Closed: no new address from it, the running pod keeps its own.
	if _, _, _, err := admin.SetPoolAccess(f.Ctx, f.Cli, closing, func(a *keyspace.PoolAccess) { a.Closed = true }); err != nil {
		t.Fatal(err)
	}
	c2 := podOf(n1, "ns-c", "c2")
	var c2IP netip.Addr
	eventually(t, "an ADD of ns-c after the close", func() error { // an ADD that chose the pool before the close is refused
		res, err := f.add(conf[n1], c2.container, "eth0", c2.args)
		if err == nil {
			c2IP = netip.MustParseAddr(res.IPs[0].Address.IP.String())
		}
		return err
	})
	made = append(made, c2)
	if !in(c2IP, gamma) {
		t.Errorf("a new ns-c pod got %s with pool %s closed, want one of %s (%s)", c2IP, closing, gamma, pools[gamma])
	}
	if ip := f.ipv4(conf[n2], c1.container, c1.args); ip != c1IP {
		t.Errorf("the running pod's repeated ADD got %s, want its own %s from the closed pool", ip, c1IP)
	}
	asks := podOf(n2, "ns-c", "c3", closing)
	if _, err := f.add(conf[n2], asks.container, "eth0", asks.args); cniCode(err) != 7 || !strings.Contains(err.Error(), closing) {
		t.Errorf("a pod asking for the closed pool: %v; want code 7 naming it", err)
	}

	// Every DEL releases, whatever the rules say now.
	for _, p := range made {
		if err := f.del(conf[p.node], p.container, "eth0", p.args); err != nil {
			t.Errorf("DEL %s: %v", p.container, err)
		}
	}
	for name := range pools {
		if list, err := admin.ListAllocations(f.Ctx, f.Cli, name); err != nil || len(list) != 0 {
			t.Errorf("pool %s after every DEL: %d allocations, %v", name, len(list), err)
		}
	}
}

// TestARuleChangedUnderLoadStrandsNobody (issue 34): two agents ADD new pods of one namespace
// without pause while its rule is changed from one pool to another. The change reaches every
// node without a restart: each node's ADDs come from the new pool, and once a node gave one
// from it, never again from the old. Nobody is stranded or moved: a pod from before the change
// gets its own address on a repeated ADD, no address goes to two pods, and every DEL
// releases, so that no allocation is left in either pool.
func TestARuleChangedUnderLoadStrandsNobody(t *testing.T) {
	f := newFixture(t, withoutAgent())
	before, after := uniq("before"), uniq("after")
	subnets := map[string]netip.Prefix{before: netip.MustParsePrefix("10.52.0.0/24"), after: netip.MustParsePrefix("10.52.1.0/24")}
	for name, subnet := range subnets {
		if _, err := admin.CreatePool(f.Ctx, f.Cli, allocator.PoolSpec{Name: name, Ranges: []allocator.RangeSet{{{Subnet: subnet}}}}); err != nil {
			t.Fatal(err)
		}
	}
	network := f.Pool
	rule := func(pool string) {
		t.Helper()
		if err := admin.SetNamespaceRule(f.Ctx, f.Cli, f.Cluster, network, "ns-l", keyspace.NamespaceRule{Pools: []string{pool}}); err != nil {
			t.Fatal(err)
		}
	}
	rule(before)
	nodes := []*agentProc{f.startAgent("--node", uniq("l1-")), f.startAgent("--node", uniq("l2-"))}
	type pod struct {
		node            int
		container, args string
		ip              netip.Addr
	}
	var (
		mu      sync.Mutex
		made    []pod
		errs    []error
		changed bool
		sawNew  = map[int]bool{} // nodes that gave an address of the new pool after the change
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 { // two workers per node
		node := w % 2
		conf := v4conf(network, nodes[node].Socket, "10.52.9.0/24")
		wg.Go(func() {
			for i := 0; i < 100; i++ { // bounded: 400 pods at most, far below the pools' room
				select {
				case <-stop:
					return
				default:
				}
				p := pod{node: node, container: uniq("ctr-"),
					args: fmt.Sprintf("K8S_POD_UID=%s;K8S_POD_NAMESPACE=ns-l;K8S_POD_NAME=p%d-%d", uniq("uid-"), w, i)}
				res, err := f.add(conf, p.container, "eth0", p.args)
				mu.Lock()
				if err != nil {
					errs = append(errs, fmt.Errorf("ADD %s on node %d: %w", p.container, node, err))
					mu.Unlock()
					return
				}
				p.ip = netip.MustParseAddr(res.IPs[0].Address.IP.String())
				made = append(made, p)
				switch {
				case subnets[after].Contains(p.ip) && !changed:
					errs = append(errs, fmt.Errorf("pod %s got %s of %s before the rule named it", p.container, p.ip, after))
				case subnets[after].Contains(p.ip):
					sawNew[node] = true
				case sawNew[node]:
					errs = append(errs, fmt.Errorf("node %d gave %s of %s after it had given addresses of %s", node, p.ip, before, after))
				}
				mu.Unlock()
			}
		})
	}
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(made) }
	eventually(t, "ADDs under way", func() error { return saw(count() >= 10, "%d pods", count()) })
	mu.Lock()
	early := made[0]
	changed = true // set before the write: an ADD of the new pool may answer right after it
	mu.Unlock()
	rule(after)
	eventually(t, "both nodes give addresses of the new pool", func() error {
		mu.Lock()
		defer mu.Unlock()
		return saw(sawNew[0] && sawNew[1] || len(errs) > 0, "nodes that did: %v; errors %v", sawNew, errs)
	})
	close(stop)
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	conf := func(p pod) []byte { return v4conf(network, nodes[p.node].Socket, "10.52.9.0/24") }
	if ip := f.ipv4(conf(early), early.container, early.args); ip != early.ip {
		t.Errorf("a pod from before the change got %s on a repeated ADD, want its own %s", ip, early.ip)
	}
	seen := map[netip.Addr]string{}
	for _, p := range made {
		if other, dup := seen[p.ip]; dup {
			t.Errorf("%s went to %s and to %s", p.ip, other, p.container)
		}
		seen[p.ip] = p.container
	}
	for _, p := range made {
		if err := f.del(conf(p), p.container, "eth0", p.args); err != nil {
			t.Errorf("DEL %s: %v", p.container, err)
		}
	}
	for name := range subnets {
		if list, err := admin.ListAllocations(f.Ctx, f.Cli, name); err != nil || len(list) != 0 {
			t.Errorf("pool %s after every DEL: %d allocations, %v", name, len(list), err)
		}
	}
	t.Logf("%d pods ADDed while the rule changed, every one released", len(made))
}

// TestSplitFamiliesOnRealAgents (issue 34): a dual-stack network whose namespace rule names
// an IPv4 pool v4a (one address), an IPv6 pool v6a and another IPv4 pool v4b, through the real
// plugin and agent. Each pod's interface gets IPv4 and IPv6, one attachment per pool: the
// first from v4a and v6a, the next, v4a full, IPv4 from v4b and IPv6 still from v6a. A
// repeated ADD answers the same, CHECK passes, and both survive a restart of the agent (the
// same lease, renewed by the new process: CHECK says so); DEL releases both, leaving etcd no
// key of the pod. Each pod has a network namespace: the agent releases a pod whose sandbox
// went while it was away.
func TestSplitFamiliesOnRealAgents(t *testing.T) {
	f := newFixture(t, withoutAgent(), withNetns()) // a sandbox gone at a restart is released: the pods have theirs
	subnets := map[string]netip.Prefix{}
	pool := func(name, subnet string) string {
		t.Helper()
		name = uniq(name)
		subnets[name] = netip.MustParsePrefix(subnet)
		if _, err := admin.CreatePool(f.Ctx, f.Cli, allocator.PoolSpec{Name: name,
			Ranges: []allocator.RangeSet{{{Subnet: subnets[name]}}}}); err != nil {
			t.Fatal(err)
		}
		return name
	}
	v4a, v6a, v4b := pool("v4a", "10.53.1.0/30"), pool("v6a", "fd53:1::/120"), pool("v4b", "10.53.2.0/28") // v4a: one address
	network := f.Pool
	if err := admin.SetNamespaceRule(f.Ctx, f.Cli, f.Cluster, network, "ns-d", keyspace.NamespaceRule{Pools: []string{v4a, v6a, v4b}}); err != nil {
		t.Fatal(err)
	}
	n1 := f.startAgent()
	conf := netconf(network, n1.Socket, dualStackIPAM("10.53.0.0/24", "fd53::/120"))
	type pod struct {
		uid, container, args string
		ips                  []netip.Addr // IPv4, IPv6
		pools                []string     // theirs
	}
	newPod := func(name string) *pod {
		uid := uniq("uid-")
		return &pod{uid: uid, container: f.sandbox("lh-split-"), args: fmt.Sprintf("K8S_POD_UID=%s;K8S_POD_NAMESPACE=ns-d;K8S_POD_NAME=%s", uid, name)}
	}
	add := func(p *pod) []netip.Addr {
		t.Helper()
		res, err := f.add(conf, p.container, "eth0", p.args)
		if err != nil {
			t.Fatalf("ADD %s: %v", p.args, err)
		}
		var ips []netip.Addr
		for _, ip := range res.IPs {
			a, _ := netip.AddrFromSlice(ip.Address.IP)
			ips = append(ips, a.Unmap())
		}
		return ips
	}
	from := func(p *pod, p4, p6 string) {
		t.Helper()
		p.pools = []string{p4, p6}
		if len(p.ips) != 2 || !p.ips[0].Is4() || !subnets[p4].Contains(p.ips[0]) || !subnets[p6].Contains(p.ips[1]) {
			t.Fatalf("pod %s got %v, want IPv4 from %s (%s) and IPv6 from %s (%s)", p.args, p.ips, p4, subnets[p4], p6, subnets[p6])
		}
		for _, pl := range []string{p4, p6} {
			if keys := snapshot(t, f.Cli, keyspace.OwnerKey(f.Cluster, p.uid, "eth0", pl)); len(keys) != 1 {
				t.Errorf("pod %s: owner index in pool %s: %v, want one", p.args, pl, keys)
			}
		}
	}
	same := func(when string, pods ...*pod) {
		t.Helper()
		for _, p := range pods {
			if got := add(p); !slices.Equal(got, p.ips) {
				t.Errorf("%s: repeated ADD of %s got %v, want %v", when, p.args, got, p.ips)
			}
			if err := f.check(conf, p.container, "eth0", p.args); err != nil {
				t.Errorf("%s: CHECK of %s: %v", when, p.args, err)
			}
		}
	}

	p1, p2 := newPod("d1"), newPod("d2")
	p1.ips = add(p1)
	from(p1, v4a, v6a)
	p2.ips = add(p2) // v4a is full: IPv4 passes to v4b, IPv6 stays in v6a
	from(p2, v4b, v6a)
	same("before the restart", p1, p2)

	leases := func() map[string]int64 {
		out := map[string]int64{}
		for _, p := range []*pod{p1, p2} {
			for i, pl := range p.pools {
				list, err := admin.ListAllocations(f.Ctx, f.Cli, pl)
				if err != nil {
					t.Fatal(err)
				}
				at := slices.IndexFunc(list, func(a admin.AllocationEntry) bool { return a.IP == p.ips[i] && a.Owner == p.uid })
				if at < 0 {
					t.Fatalf("pool %s holds no allocation of %s for %s: %+v", pl, p.ips[i], p.args, list)
				}
				out[p.ips[i].String()] = int64(list[at].BoundLease)
			}
		}
		return out
	}
	before := leases()
	n1.stop()
	n1.restart(t)
	if after := leases(); !maps.Equal(before, after) {
		t.Errorf("allocations' leases across the restart: %v, then %v; want them kept", before, after)
	}
	same("after the restart", p1, p2)

	for _, p := range []*pod{p1, p2} {
		if err := f.del(conf, p.container, "eth0", p.args); err != nil {
			t.Fatalf("DEL %s: %v", p.args, err)
		}
		for k, v := range snapshot(t, f.Cli, keyspace.Prefix) {
			if strings.Contains(k, p.uid) || strings.Contains(v, p.uid) {
				t.Errorf("after the DEL of %s etcd still has %s = %s", p.args, k, v)
			}
		}
	}
	for name := range subnets {
		if list, err := admin.ListAllocations(f.Ctx, f.Cli, name); err != nil || len(list) != 0 {
			t.Errorf("pool %s after every DEL: %d allocations, %v", name, len(list), err)
		}
	}
}
