package leases

import (
	"errors"
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
