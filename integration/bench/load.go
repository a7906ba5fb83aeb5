package main

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/allocator"
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

// podRequest is an ADD for a new pod on pool (as the plugin builds it from its netconf).
func podRequest(pool allocator.PoolSpec, netns string) allocator.Request {
	uid, cid := ids.podUID(), ids.containerID()
	return allocator.Request{Network: pool.Name, Pool: pool, ContainerID: cid, IfName: "eth0", Netns: netns,
		Pod: allocator.PodRef{UID: uid, Namespace: "bench", Name: "pod-" + cid[:10]}}
}
