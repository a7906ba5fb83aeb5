package leases

import (
	"errors"
	"net/netip"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/adopt"
)

// The consumers of an interface whose IPv4 and IPv6 came from two pools (issue 34): each
// must see both of its attachments, neither ignored nor counted twice.

// splitWorld is a dual-stack network net whose rule for namespace tenant names an IPv4 pool
// v4 and an IPv6 pool v6, none with both families: an ADD of a tenant pod gets an attachment
// in each.
type splitWorld struct {
	cli     *clientv3.Client
	cluster string
	net     allocator.PoolSpec
	v4, v6  allocator.PoolSpec
}

func newSplitWorld(t *testing.T) *splitWorld {
	t.Helper()
	w := &splitWorld{cli: etcdtest.Client(t), cluster: etcdtest.Uniq("c"),
		net: dualStack(etcdtest.Uniq("net"), "10.97.0.0/24", "fd97::/64")}
	stored := func(p allocator.PoolSpec) allocator.PoolSpec {
		p.Blocks = allocator.DefaultBlocks
		storePool(t, w.cli, p, keyspace.PoolAccess{})
		return p
	}
	w.v4 = stored(rangePool(etcdtest.Uniq("v4"), "10.97.1.0/24", "10.97.1.10", "10.97.1.50"))
	w.v6 = stored(rangePool(etcdtest.Uniq("v6"), "fd97:1::/64", "fd97:1::10", "fd97:1::50"))
	if _, err := w.cli.Put(ctxT(t), keyspace.NamespaceRuleKey(w.cluster, w.net.Name, "tenant"),
		keyspace.Encode(keyspace.NamespaceRule{Pools: []string{w.v4.Name, w.v6.Name}})); err != nil {
		t.Fatal(err)
	}
	return w
}

// req is the request of tenant pod uid's eth0, its container named as the pod.
func (w *splitWorld) req(uid string) allocator.Request {
	r := addReq(w.net, uid, "eth0", uid)
	r.Pod.Namespace = "tenant"
	return r
}

// add adds pod uid and checks that it got IPv4 from v4 and IPv6 from v6.
func (w *splitWorld) add(t *testing.T, a *Agent, req allocator.Request) (ip4, ip6 netip.Addr) {
	t.Helper()
	res, err := a.Add(ctxT(t), req)
	if err != nil {
		t.Fatalf("ADD of %s: %v", req.ContainerID, err)
	}
	ips := addrs(res)
	if len(ips) != 2 || !w.v4.Ranges[0][0].Subnet.Contains(ips[0]) || !w.v6.Ranges[0][0].Subnet.Contains(ips[1]) {
		t.Fatalf("ADD of %s: %v, want IPv4 from %s and IPv6 from %s", req.ContainerID, ips, w.v4.Name, w.v6.Name)
	}
	return ips[0], ips[1]
}

// keysOf counts owner's keys: owner indexes (by pool), allocations of ips, and its pod record.
func (w *splitWorld) keysOf(t *testing.T, owner string, ips ...netip.Addr) (owners map[string]bool, allocs int, pod bool) {
	t.Helper()
	owners = map[string]bool{}
	for k := range etcdtest.Dump(t, w.cli, keyspace.OwnerPrefix(w.cluster, owner)) {
		_, _, _, pool, err := keyspace.ParseOwnerKey(k)
		if err != nil {
			t.Fatal(err)
		}
		owners[pool] = true
	}
	for _, ip := range ips {
		pool := w.v4
		if ip.Is6() {
			pool = w.v6
		}
		if allocOwner(t, w.cli, pool, ip) == owner {
			allocs++
		}
	}
	pod = len(etcdtest.Dump(t, w.cli, keyspace.PodKey(w.cluster, "n1", owner))) == 1
	return owners, allocs, pod
}

// attached says whether owner holds both its attachments (want true) or nothing at all.
func (w *splitWorld) attached(t *testing.T, owner string, want bool, ips ...netip.Addr) error {
	owners, allocs, pod := w.keysOf(t, owner, ips...)
	if want {
		return etcdtest.Saw(len(owners) == 2 && owners[w.v4.Name] && owners[w.v6.Name] && allocs == 2 && pod,
			"%s: owner indexes in %v, %d of its 2 allocations, pod record %v; want all", owner, owners, allocs, pod)
	}
	return etcdtest.Saw(len(owners) == 0 && allocs == 0 && !pod,
		"%s: owner indexes in %v, %d allocations, pod record %v; want none", owner, owners, allocs, pod)
}

// TestGCAndLivenessReleaseBothAttachmentsOfAnInterface: GC releases both attachments of an
// interface the runtime no longer lists, and its pod record, and keeps both of one it lists;
// the liveness loop does the same for a pod whose sandbox is gone.
func TestGCAndLivenessReleaseBothAttachmentsOfAnInterface(t *testing.T) {
	w := newSplitWorld(t)
	a := startAgent(t, w.cluster, "n1", "uid1", func(c *Config) {
		c.GCGrace, c.LivenessInterval, c.LivenessGrace = -1, 50*time.Millisecond, time.Nanosecond
	})
	ctx := ctxT(t)
	k4, k6 := w.add(t, a, w.req("kept"))
	g4, g6 := w.add(t, a, w.req("gone"))
	if err := errors.Join(w.attached(t, "kept", true, k4, k6), w.attached(t, "gone", true, g4, g6)); err != nil {
		t.Fatal(err)
	}
	err := a.GC(ctx, allocator.GCRequest{Network: w.net.Name, Pool: allocator.PoolSpec{Name: w.net.Name},
		ValidAttachments: []allocator.Attachment{{ContainerID: "kept", IfName: "eth0"}}})
	if err != nil {
		t.Fatalf("GC: %v", err)
	}
	if err := errors.Join(w.attached(t, "kept", true, k4, k6), w.attached(t, "gone", false, g4, g6)); err != nil {
		t.Fatalf("after a GC listing only kept: %v", err)
	}
	if _, held := a.pods.Lease("gone"); held {
		t.Errorf("the agent still holds the lease of the collected pod")
	}

	// The liveness loop: a pod whose network namespace path is gone.
	netns := t.TempDir() + "/netns"
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	req := w.req("sandbox")
	req.Netns = netns
	s4, s6 := w.add(t, a, req)
	if err := w.attached(t, "sandbox", true, s4, s6); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(netns); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "both attachments of the gone sandbox are released", func() error {
		return w.attached(t, "sandbox", false, s4, s6)
	})
	if err := w.attached(t, "kept", true, k4, k6); err != nil {
		t.Fatalf("the liveness loop touched a pod without netns path: %v", err)
	}
}

// TestCheckSeesBothAttachmentsOfAnInterface: CHECK returns both families' addresses, and
// fails, naming it, when the second attachment's allocation is gone.
func TestCheckSeesBothAttachmentsOfAnInterface(t *testing.T) {
	w := newSplitWorld(t)
	// The audit, which would put the deleted key back, waits a whole lease TTL.
	a := startAgent(t, w.cluster, "n1", "uid1", func(c *Config) { c.LeaseTTL, c.AuditInterval = time.Minute, time.Minute })
	ctx := ctxT(t)
	ip4, ip6 := w.add(t, a, w.req("p1"))
	if res, err := a.Check(ctx, w.req("p1")); err != nil || !reflect.DeepEqual(addrs(res), []netip.Addr{ip4, ip6}) {
		t.Fatalf("CHECK: %v, %v; want %v and %v", res, err, ip4, ip6)
	}
	if _, err := w.cli.Delete(ctx, keyspace.IPKey(w.v6.Name, w.v6.Blocks, ip6)); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Check(ctx, w.req("p1")); !errors.Is(err, allocator.ErrConflict) || !strings.Contains(err.Error(), ip6.String()) {
		t.Fatalf("CHECK with the IPv6 allocation gone: %v; want a conflict naming %s", err, ip6)
	}
}

// TestImportUnderSplitRulesStaysInItsPool: an import claims addresses in the pool the
// network's configuration names, where they lie, whatever the rules now give the namespace
// (a family in each of two pools). The imported container's repeated ADD, CHECK and DEL by
// its pod UID find the imported attachment there: the ADD claims nothing in the rules' pools.
func TestImportUnderSplitRulesStaysInItsPool(t *testing.T) {
	w := newSplitWorld(t)
	storePool(t, w.cli, w.net, keyspace.PoolAccess{})
	a := startAgent(t, w.cluster, "n1", "uid1", func(c *Config) { c.GCGrace = -1 })
	ctx := ctxT(t)
	ip := netip.MustParseAddr
	imported := []netip.Addr{ip("10.97.0.200"), ip("fd97::200")}
	rep, err := a.Import(ctx, Import{Network: w.net.Name, Source: "test", Attachments: []adopt.Attachment{
		{ContainerID: "ctr-a", IfName: "eth0", IPs: imported},
		{ContainerID: "ctr-b", IfName: "eth0", IPs: []netip.Addr{ip("10.97.1.20")}}, // in v4's range, not the network's
	}})
	if err != nil {
		t.Fatal(err)
	}
	if got := addrsOf(rep.Imported); !sameAddrs(got, imported) || len(got) != 2 {
		t.Fatalf("imported %v, want %v", rep.Imported, imported)
	}
	if got := addrsOf(rep.OutsidePool); len(got) != 1 || got[0] != ip("10.97.1.20") {
		t.Fatalf("outside the pool %v, want 10.97.1.20: an import never moves an address to another pool", rep.OutsidePool)
	}
	req := w.req("uid-a")
	req.ContainerID = "ctr-a"
	only := func(when string) {
		t.Helper()
		keys := etcdtest.Dump(t, w.cli, keyspace.Prefix)
		if n := etcdtest.Count(keys, "/"+w.v4.Name+"/") + etcdtest.Count(keys, "/"+w.v6.Name+"/"); n != 0 {
			t.Fatalf("%s: %d keys in the rules' pools: %v", when, n, keys)
		}
	}
	if res, err := a.Add(ctx, req); err != nil || !reflect.DeepEqual(addrs(res), imported) {
		t.Fatalf("repeated ADD of the imported container by its pod UID: %v, %v; want %v", res, err, imported)
	}
	only("after the repeated ADD")
	if res, err := a.Check(ctx, req); err != nil || !reflect.DeepEqual(addrs(res), imported) {
		t.Fatalf("CHECK of the imported container: %v, %v; want %v", res, err, imported)
	}
	if err := a.Del(ctx, req); err != nil {
		t.Fatal(err)
	}
	only("after the DEL")
	if keys := etcdtest.Dump(t, w.cli, keyspace.Prefix); etcdtest.Count(keys, "/ctr-a/") != 0 || etcdtest.Count(keys, "10.97.0.200") != 0 {
		t.Fatalf("after the DEL the imported keys remain: %v", keys)
	}
}
