package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// figHoldback: what the reuse delay costs (issue 23). 20 agents hold 50 pods each in one
// pool; 10% of them (2 nodes) die at once, and after their pods' leases expire their
// addresses are held back. Reported: how many addresses that holds back, the ADD latency of
// the other nodes while the pool still has addresses no expired holder had (the last 100
// before they run out: borrowing near exhaustion included), and once only held-back
// addresses remain (each ADD then reads the pool and asks etcd when each hold ends).
func figHoldback(ctx context.Context, env *env, res *results) error {
	const (
		nodes, podsPerNode, dead = 20, 50, 2
		ttl                      = 5 * time.Second
		reuseN                   = 60
	)
	subnet := netip.MustParsePrefix("10.60.0.0/21") // 2,046 addresses in 32 blocks of 64
	e, err := startEtcd(ctx, env, "holdback")
	if err != nil {
		return err
	}
	defer e.stop()
	agents := make([]*inproc, nodes)
	{
		var wg sync.WaitGroup
		errs := make([]error, nodes)
		for i := range agents {
			wg.Go(func() {
				agents[i], errs[i] = startInproc(ctx, env, e, fmt.Sprintf("hold-%02d", i), "", func(c *leases.Config) {
					c.LeaseTTL, c.ReuseDelay, c.Quarantine = ttl, 10*time.Minute, -1
				})
			})
		}
		wg.Wait()
		for _, a := range agents {
			if a != nil {
				defer a.close()
			}
		}
		if err := errors.Join(errs...); err != nil {
			return err
		}
	}
	const pool = "holdback"
	add := func(a *inproc) ([]netip.Addr, time.Duration, error) {
		inv, _ := podAdd(a.conf(pool, subnet), env.netns)
		start := time.Now()
		ips, err := invoke(ctx, a.client(), inv)
		return ips, time.Since(start), err
	}
	deadAddrs := map[netip.Addr]bool{}
	{
		var wg sync.WaitGroup
		var mu sync.Mutex
		errs := make([]error, nodes)
		for i, a := range agents {
			wg.Go(func() {
				for range podsPerNode {
					ips, _, err := add(a)
					if err != nil {
						errs[i] = err
						return
					}
					if i < dead {
						mu.Lock()
						deadAddrs[ips[0]] = true
						mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
	}
	// Two nodes die: their agents stop renewing; their pods' leases expire after the TTL,
	// their block leases (and held keys) only after the reuse delay.
	for _, a := range agents[:dead] {
		a.close()
	}
	cli, err := e.client()
	if err != nil {
		return err
	}
	defer cli.Close()
	expired := time.Now()
	var held int
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, gone, err := heldBack(ctx, cli, pool, deadAddrs)
		if err != nil {
			return err
		}
		if gone == len(deadAddrs) {
			held = n
			break
		}
		if time.Since(expired) > 2*time.Minute {
			return fmt.Errorf("holdback: %d of %d dead pods' allocations left after 2 minutes", len(deadAddrs)-gone, len(deadAddrs))
		}
		time.Sleep(200 * time.Millisecond)
	}
	// The live nodes fill the pool: first every address no expired holder had, then the
	// held-back ones; an ADD is exhausted only when none is left.
	live := agents[dead:]
	var room, reuse durations
	reused := 0
	for i := 0; ; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		ips, took, err := add(live[i%len(live)])
		if errors.Is(err, allocator.ErrPoolExhausted) {
			break
		}
		if err != nil {
			return err
		}
		if deadAddrs[ips[0]] {
			reused++
			reuse = append(reuse, took)
			if reused == reuseN {
				break
			}
			continue
		}
		if reused > 0 {
			return fmt.Errorf("holdback: an address no expired holder had (%s) came after %d held-back ones", ips[0], reused)
		}
		room = append(room, took)
	}
	if len(room) > 100 {
		room = room[len(room)-100:]
	}
	fig := fmt.Sprintf("%d of %d nodes lost at once (%s pods)", dead, nodes, thousands(dead*podsPerNode))
	res.add(row{Figure: fig + ": addresses held back", Leasehold: float64(held), Unit: "addresses"})
	res.add(row{Figure: fig + ": ADD p50, the pool still has other room (last 100)", Leasehold: ms(room.pct(50)), Unit: "ms"})
	res.add(row{Figure: fig + ": ADD p99, the pool still has other room (last 100)", Leasehold: ms(room.pct(99)), Unit: "ms"})
	res.add(row{Figure: fig + ": ADD p50, only held-back addresses left", Leasehold: ms(reuse.pct(50)), Unit: "ms"})
	res.add(row{Figure: fig + ": ADD p99, only held-back addresses left", Leasehold: ms(reuse.pct(99)), Unit: "ms"})
	res.note("Hold-back: %d in-process agents, %d pods each, in a /21 of /26 blocks; TTL %s, reuse delay 10 min, no quarantine. %d "+
		"agents stopped at once; once their %d pods' leases expired, the other nodes' ADDs (one at a time, through the socket) "+
		"took every other address first, then %d held-back ones, the hold ending first first.",
		nodes, podsPerNode, ttl, dead, len(deadAddrs), len(reuse))
	progress("holdback: %d addresses held back; ADD p50 %.2f ms with room, %.2f ms from held-back addresses (p99 %.2f / %.2f ms)",
		held, ms(room.pct(50)), ms(reuse.pct(50)), ms(room.pct(99)), ms(reuse.pct(99)))
	return nil
}

// heldBack counts pool's held keys with no allocation, and how many of the addresses of
// dead have no allocation left.
func heldBack(ctx context.Context, cli *clientv3.Client, pool string, dead map[netip.Addr]bool) (held, gone int, err error) {
	c, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := cli.Txn(c).Then(
		clientv3.OpGet(keyspace.IPsPrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.HeldPrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	).Commit()
	if err != nil {
		return 0, 0, err
	}
	alloc := map[netip.Addr]bool{}
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		if _, _, ip, err := keyspace.ParseIPKey(string(kv.Key)); err == nil {
			alloc[ip] = true
		}
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		if _, _, ip, err := keyspace.ParseHeldKey(string(kv.Key)); err == nil && !alloc[ip] {
			held++
		}
	}
	for a := range dead {
		if !alloc[a] {
			gone++
		}
	}
	return held, gone, nil
}
