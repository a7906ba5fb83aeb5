package main

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// loadResult is what a closed-loop load run measured.
type loadResult struct {
	ops     int
	elapsed time.Duration
	lat     durations
}

func (r loadResult) rate() float64 { return float64(r.ops) / r.elapsed.Seconds() }

// closedLoop runs conc workers that call op back to back until d has passed; it counts the
// operations that completed and the time until the last one did. The first error stops it.
func closedLoop(ctx context.Context, conc int, d time.Duration, op func(ctx context.Context) error) (loadResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu       sync.Mutex
		lat      durations
		firstErr error
		n        atomic.Int64
		wg       sync.WaitGroup
	)
	start := time.Now()
	stopAt := start.Add(d)
	for range conc {
		wg.Go(func() {
			var mine durations
			for time.Now().Before(stopAt) && ctx.Err() == nil {
				t := time.Now()
				if err := op(ctx); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					cancel()
					break
				}
				mine = append(mine, time.Since(t))
				n.Add(1)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if firstErr != nil {
		return loadResult{}, firstErr
	}
	return loadResult{ops: int(n.Load()), elapsed: time.Since(start), lat: lat}, ctx.Err()
}

// podRequest is an ADD for a new pod on pool as the agent's Service takes it (the
// allocator request the plugin's CNI logic builds from its netconf), for calls to an
// in-process agent that bypass the socket.
func podRequest(pool allocator.PoolSpec, netns string) allocator.Request {
	uid, cid := ids.podUID(), ids.containerID()
	return allocator.Request{Network: pool.Name, Pool: pool, ContainerID: cid, IfName: "eth0", Netns: netns,
		Pod: allocator.PodRef{UID: uid, Namespace: "bench", Name: "pod-" + cid[:10]}}
}

// podAdd is the ADD of a new pod with the network configuration conf as the plugin binary
// sends it to the agent (operation cni): new container and pod IDs, the pod's CNI_ARGS as
// a runtime sets them, netns as its namespace. It returns the pod UID too.
func podAdd(conf []byte, netns string) (*agentapi.Invocation, string) {
	uid, cid := ids.podUID(), ids.containerID()
	inv := agentapi.NewInvocation("ADD", conf, cid, "eth0")
	inv.Netns = netns
	inv.Args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-" + cid[:10] + ";K8S_POD_UID=" + uid
	return inv, uid
}

// invoke sends inv through cl as the plugin binary does and reads the answer as a runtime
// does: the addresses of the printed result (none for commands that print none), or the
// CNI error as an *agentapi.Error.
func invoke(ctx context.Context, cl *agentapi.Client, inv *agentapi.Invocation) ([]netip.Addr, error) {
	out, err := cl.Invoke(ctx, inv)
	if err != nil {
		return nil, err
	}
	res, err := out.Result()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", inv.Command, err)
	}
	addrs := make([]netip.Addr, 0, len(res.IPs))
	for _, ip := range res.IPs {
		addrs = append(addrs, ip.Address.Addr())
	}
	return addrs, nil
}
