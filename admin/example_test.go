package admin_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// The examples run against the embedded etcd the package's TestMain starts (etcdtest.Endpoint);
// an operator's program dials its own endpoints the same way. Where an example needs
// allocations, a real agent (package leases) makes them, as leaseholdd does on a node.

// An operator defines a pool before any network uses it. Defining it again is a no-op when
// the definitions allocate the same addresses, however spelled; a different one is refused.
func ExampleCreatePool() {
	ctx, cli, done, err := etcdtest.Connect()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	spec := allocator.PoolSpec{Name: "example-pool",
		Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.78.0.0/24")}}}}
	created, err := admin.CreatePool(ctx, cli, spec)
	fmt.Println(created, err)

	// host-local's defaults written out: the same pool.
	spelled := allocator.PoolSpec{Name: "example-pool", Ranges: []allocator.RangeSet{{{
		Subnet: netip.MustParsePrefix("10.78.0.0/24"), Gateway: netip.MustParseAddr("10.78.0.1"),
		RangeStart: netip.MustParseAddr("10.78.0.1"), RangeEnd: netip.MustParseAddr("10.78.0.254")}}}}
	created, err = admin.CreatePool(ctx, cli, spelled)
	fmt.Println(created, err)

	other := allocator.PoolSpec{Name: "example-pool",
		Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.78.1.0/24")}}}}
	_, err = admin.CreatePool(ctx, cli, other)
	fmt.Println(errors.Is(err, allocator.ErrPoolMismatch))
	// Output:
	// true <nil>
	// false <nil>
	// true
}

// A full pool grows by another range; the pool's allocations stay where they are. ReadState
// then shows the stored definition, with host-local's defaults filled in.
func ExampleAddRange() {
	ctx, cli, done, err := etcdtest.Connect()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	subnet := netip.MustParsePrefix("10.78.2.0/24")
	first := allocator.Range{Subnet: subnet, RangeStart: netip.MustParseAddr("10.78.2.10"), RangeEnd: netip.MustParseAddr("10.78.2.19")}
	if _, err := admin.CreatePool(ctx, cli, allocator.PoolSpec{Name: "example-grow", Ranges: []allocator.RangeSet{{first}}}); err != nil {
		fmt.Println(err)
		return
	}
	more := allocator.Range{Subnet: subnet, RangeStart: netip.MustParseAddr("10.78.2.100"), RangeEnd: netip.MustParseAddr("10.78.2.109")}
	if _, err := admin.AddRange(ctx, cli, "example-grow", -1, more); err != nil { // -1: the set of more's family
		fmt.Println(err)
		return
	}

	st, err := admin.ReadState(ctx, cli)
	if err != nil {
		fmt.Println(err)
		return
	}
	pool, _ := st.Pool("example-grow")
	for _, r := range pool.Value.Ranges[0] {
		fmt.Println(r)
	}
	fmt.Println(pool.Value.Size())
	// Output:
	// 10.78.2.0/24 [10.78.2.10-10.78.2.19] gw 10.78.2.1
	// 10.78.2.0/24 [10.78.2.100-10.78.2.109] gw 10.78.2.1
	// [20]
}

// The doctor checks the invariants over one read of the keys and gives each problem the
// command that fixes it. Here an address was written by hand with a plain put, on no lease:
// it would never expire. ReadKeys narrows the read to one pool and one cluster (ReadState
// reads everything).
func ExampleCheck() {
	ctx, cli, done, err := etcdtest.Connect()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	pool, ip := "example-doctor", netip.MustParseAddr("10.78.3.7")
	if _, err := admin.CreatePool(ctx, cli, allocator.PoolSpec{Name: pool,
		Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.78.3.0/24")}}}}); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := cli.Put(ctx, keyspace.IPKey(pool, allocator.DefaultBlocks, ip), `{"owner":"by-hand","cluster":"example","ifName":"eth0"}`); err != nil {
		fmt.Println(err)
		return
	}

	keys := []string{keyspace.PoolKey(pool), keyspace.IPsPrefix(pool), keyspace.QuarantinePrefix(pool),
		keyspace.OwnersPrefix("example"), keyspace.NodesPrefix("example")}
	for range 2 {
		st, err := admin.ReadKeys(ctx, cli, keys...)
		if err != nil {
			fmt.Println(err)
			return
		}
		findings := admin.Check(st)
		fmt.Println(len(findings), "finding(s)")
		for _, f := range findings {
			fmt.Println(f.Kind, f.Keys)
			fmt.Println("fix:", f.Fix)
		}
		if len(findings) > 0 { // the fix, as leaseholdctl runs it
			_, err = admin.Release(ctx, cli, pool, ip, admin.ReleaseOptions{})
			fmt.Println("released:", err)
		}
	}
	// Output:
	// 1 finding(s)
	// no-lease [/leasehold/v1/ips/example-doctor/10.78.3.0-26/10.78.3.7]
	// fix: leaseholdctl alloc release 10.78.3.7 --pool example-doctor
	// released: <nil>
	// 0 finding(s)
}

// An operator frees an address whose pod is gone but whose agent still renews its lease (say
// the runtime never sent the DEL). Release refuses a live lease unless forced, and takes the
// whole attachment: its other addresses and its owner index go too.
func ExampleRelease() {
	ctx, cli, agent, done, err := exampleAgent()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	// 10.78.4.0/30 hands out only 10.78.4.2 (.1 is the gateway).
	req := allocator.Request{Network: "example-release", ContainerID: "c0ffee", IfName: "eth0",
		Pool: allocator.PoolSpec{Name: "example-release", Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.78.4.0/30")}}}},
		Pod:  allocator.PodRef{UID: "pod-uid-1", Namespace: "default", Name: "web-0"}}
	res, err := agent.Add(ctx, req)
	if err != nil {
		fmt.Println(err)
		return
	}
	ip := res.IPs[0].Address.Addr()

	_, err = admin.Release(ctx, cli, "example-release", ip, admin.ReleaseOptions{})
	fmt.Println("without force:", errors.Is(err, admin.ErrLeaseAlive))
	rel, err := admin.Release(ctx, cli, "example-release", ip, admin.ReleaseOptions{Force: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, a := range rel.Addresses {
		fmt.Println("released", a.IP, "of", a.Pod.Namespace+"/"+a.Pod.Name, "on", a.Node)
	}
	fmt.Println("owner index:", rel.OwnerIndex)
	// The pod's DEL, if it comes, finds nothing left to release and gives up the pod lease.
	fmt.Println("DEL:", agent.Del(ctx, req))
	// Output:
	// without force: true
	// released 10.78.4.2 of default/web-0 on node-1
	// owner index: /leasehold/v1/owners/example/pod-uid-1/eth0/example-release
	// DEL: <nil>
}

// ListAllocations says who holds each address of a pool: owner, pod, node and lease. Here
// the operator defined the pool and the network's configuration names it without ranges.
func ExampleListAllocations() {
	ctx, cli, agent, done, err := exampleAgent()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	if _, err := admin.CreatePool(ctx, cli, allocator.PoolSpec{Name: "example-list",
		Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.78.5.0/24")}}}}); err != nil {
		fmt.Println(err)
		return
	}
	var reqs []allocator.Request
	for i, ip := range []string{"10.78.5.11", "10.78.5.10"} { // static addresses, for a stable output
		req := allocator.Request{Network: "example-list", Pool: allocator.PoolSpec{Name: "example-list"},
			ContainerID: fmt.Sprint("ctr-", i), IfName: "eth0", RequestedIPs: []netip.Addr{netip.MustParseAddr(ip)},
			Pod: allocator.PodRef{UID: fmt.Sprint("pod-uid-", i), Namespace: "default", Name: fmt.Sprint("web-", i)}}
		if _, err := agent.Add(ctx, req); err != nil {
			fmt.Println(err)
			return
		}
		reqs = append(reqs, req)
	}

	allocs, err := admin.ListAllocations(ctx, cli, "example-list")
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, a := range allocs {
		fmt.Println(a.IP, a.Owner, a.Pod.Namespace+"/"+a.Pod.Name, a.Node, "on a lease:", a.BoundLease != 0)
	}
	for _, req := range reqs {
		if err := agent.Del(ctx, req); err != nil {
			fmt.Println(err)
		}
	}
	// Output:
	// 10.78.5.10 pod-uid-1 default/web-1 node-1 on a lease: true
	// 10.78.5.11 pod-uid-0 default/web-0 node-1 on a lease: true
}

// exampleAgent connects to etcd and starts the agent of node-1 in cluster "example", as
// leases' ExampleStart shows in full; done stops it and closes the client.
func exampleAgent() (ctx context.Context, cli *clientv3.Client, agent *leases.Agent, done func(), err error) {
	ctx, cli, closeCli, err := etcdtest.Connect()
	if err != nil {
		return nil, nil, nil, nil, err
	}
	agent, err = leases.Start(ctx, cli, leases.Config{Cluster: "example", Node: "node-1", NodeUID: "node-1-boot-1",
		LeaseTTL: 5 * time.Second, Quarantine: -1, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		closeCli()
		return nil, nil, nil, nil, err
	}
	return ctx, cli, agent, func() { agent.Close(); closeCli() }, nil
}
