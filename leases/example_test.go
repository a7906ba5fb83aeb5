package leases_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// The examples run against the embedded etcd the package's TestMain starts (etcdtest.Endpoint);
// a real program dials its own endpoints the same way. Each one cleans up what it made.

// examplePool is 10.77.0.0/30: its range is .1-.2 and .1 is the gateway, so the only address
// it hands out is 10.77.0.2, whichever node asks.
var examplePool = allocator.PoolSpec{Name: "example-net",
	Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.77.0.0/30")}}}}

// An agent serves the CNI operations of one node: ADD claims an address on the pod's own lease,
// DEL deletes it.
func ExampleStart() {
	cli, err := keyspace.ClientConfig{Endpoints: []string{etcdtest.Endpoint}}.Dial()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	agent, err := leases.Start(ctx, cli, leases.Config{Cluster: "example", Node: "node-1", NodeUID: "node-1-boot-1",
		LeaseTTL: 5 * time.Second, Quarantine: -1, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer agent.Close()

	req := allocator.Request{Network: "example-net", Pool: examplePool, ContainerID: "c0ffee", IfName: "eth0",
		Pod: allocator.PodRef{UID: "pod-uid-1", Namespace: "default", Name: "web-0"}}
	res, err := agent.Add(ctx, req)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(res.IPs[0].Address, "via", res.IPs[0].Gateway)
	key := keyspace.IPKey(examplePool.Name, allocator.DefaultBlocks, res.IPs[0].Address.Addr())
	got, err := cli.Get(ctx, key)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(key, "on a lease:", got.Kvs[0].Lease != 0)

	if err := agent.Del(ctx, req); err != nil {
		fmt.Println(err)
		return
	}
	got, err = cli.Get(ctx, key)
	fmt.Println(key, "keys after DEL:", got.Count, err)
	// Output:
	// 10.77.0.2/30 via 10.77.0.1
	// /leasehold/v1/ips/example-net/10.77.0.0-26/10.77.0.2 on a lease: true
	// /leasehold/v1/ips/example-net/10.77.0.0-26/10.77.0.2 keys after DEL: 0 <nil>
}

// A runtime may ask for static addresses (CNI_ARGS IP=): one per range set of the pool. An ADD
// repeated for the same attachment returns what it already has; another pod asking for a held
// address is refused.
func ExampleAgent_Add() {
	ctx, _, agent, done, err := exampleAgent()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	dual := allocator.PoolSpec{Name: "example-dual", Ranges: []allocator.RangeSet{
		{{Subnet: netip.MustParsePrefix("10.77.1.0/24")}}, {{Subnet: netip.MustParsePrefix("fd77::/64")}}}}
	req := allocator.Request{Network: "example-dual", Pool: dual, ContainerID: "c0ffee", IfName: "eth0",
		Pod:          allocator.PodRef{UID: "pod-uid-1", Namespace: "default", Name: "db-0"},
		RequestedIPs: []netip.Addr{netip.MustParseAddr("10.77.1.10"), netip.MustParseAddr("fd77::10")}}
	for range 2 {
		res, err := agent.Add(ctx, req)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(res.IPs[0].Address, res.IPs[1].Address)
	}
	other := req
	other.ContainerID, other.Pod = "beef", allocator.PodRef{UID: "pod-uid-2", Namespace: "default", Name: "db-1"}
	_, err = agent.Add(ctx, other)
	fmt.Println("db-1:", errors.Is(err, allocator.ErrAddressInUse))

	fmt.Println(agent.Del(ctx, req))
	// Output:
	// 10.77.1.10/24 fd77::10/64
	// 10.77.1.10/24 fd77::10/64
	// db-1: true
	// <nil>
}

// CHECK asks whether the attachment still holds its addresses in etcd, on a lease this agent
// renews. After its DEL it does not.
func ExampleAgent_Check() {
	ctx, _, agent, done, err := exampleAgent()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	req := allocator.Request{Network: "example-net", Pool: examplePool, ContainerID: "c0ffee", IfName: "eth0",
		Pod: allocator.PodRef{UID: "pod-uid-1", Namespace: "default", Name: "web-0"}}
	if _, err := agent.Add(ctx, req); err != nil {
		fmt.Println(err)
		return
	}
	res, err := agent.Check(ctx, req)
	fmt.Println(res.IPs, err)

	if err := agent.Del(ctx, req); err != nil {
		fmt.Println(err)
		return
	}
	_, err = agent.Check(ctx, req)
	fmt.Println(errors.Is(err, allocator.ErrNotAllocated))
	// Output:
	// [{10.77.0.2/30 10.77.0.1}] <nil>
	// true
}

// DEL releases only what the attachment still holds: replayed after its address went to
// another pod, it releases nothing and is not an error.
func ExampleAgent_Del() {
	ctx, _, agent, done, err := exampleAgent()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	web0 := allocator.Request{Network: "example-net", Pool: examplePool, ContainerID: "c0ffee", IfName: "eth0",
		Pod: allocator.PodRef{UID: "pod-uid-1", Namespace: "default", Name: "web-0"}}
	web1 := web0
	web1.ContainerID, web1.Pod = "beef", allocator.PodRef{UID: "pod-uid-2", Namespace: "default", Name: "web-1"}
	res, err := agent.Add(ctx, web0)
	fmt.Println("ADD web-0:", res.IPs, err)
	fmt.Println("DEL web-0:", agent.Del(ctx, web0))
	res, err = agent.Add(ctx, web1) // the pool's only address is free again
	fmt.Println("ADD web-1:", res.IPs, err)
	fmt.Println("DEL web-0 again:", agent.Del(ctx, web0))
	res, err = agent.Check(ctx, web1)
	fmt.Println("CHECK web-1:", res.IPs, err)
	fmt.Println("DEL web-1:", agent.Del(ctx, web1))
	// Output:
	// ADD web-0: [{10.77.0.2/30 10.77.0.1}] <nil>
	// DEL web-0: <nil>
	// ADD web-1: [{10.77.0.2/30 10.77.0.1}] <nil>
	// DEL web-0 again: <nil>
	// CHECK web-1: [{10.77.0.2/30 10.77.0.1}] <nil>
	// DEL web-1: <nil>
}

// Close stops renewing the pod leases without revoking them: an agent restarted with the same
// node identity (Cluster, Node, NodeUID) adopts them, so the node's pods keep their addresses
// across an agent upgrade.
func ExampleAgent_Close() {
	ctx, cli, done, err := etcdtest.Connect()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()
	cfg := leases.Config{Cluster: "example", Node: "node-1", NodeUID: "node-1-boot-1",
		LeaseTTL: 5 * time.Second, Quarantine: -1, Logger: slog.New(slog.DiscardHandler)}
	req := allocator.Request{Network: "example-net", Pool: examplePool, ContainerID: "c0ffee", IfName: "eth0",
		Pod: allocator.PodRef{UID: "pod-uid-1", Namespace: "default", Name: "web-0"}}

	for i := range 2 {
		agent, err := leases.Start(ctx, cli, cfg)
		if err != nil {
			fmt.Println(err)
			return
		}
		if i == 0 {
			_, err = agent.Add(ctx, req)
			fmt.Println("ADD:", err)
		} else {
			res, err := agent.Check(ctx, req)
			fmt.Println("CHECK after the restart:", res.IPs, err)
			fmt.Println("DEL:", agent.Del(ctx, req))
		}
		agent.Close()
	}
	// Output:
	// ADD: <nil>
	// CHECK after the restart: [{10.77.0.2/30 10.77.0.1}] <nil>
	// DEL: <nil>
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
