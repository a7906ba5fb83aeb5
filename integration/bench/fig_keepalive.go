package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// figKeepalive: what renewing pod leases costs etcd when nothing else happens, the floor of a
// large cluster. 1,000 clients (one per simulated node, as each agent has one keep-alive
// stream) hold 100 leases each, of the agents' default 90 s TTL, renewed as clientv3 renews
// them (at a third of the TTL); etcd's CPU is measured over a window after every lease is
// held. The 100,000 leases are a 1,000-node cluster at 100 pods a node.
func figKeepalive(ctx context.Context, env *env, res *results) error {
	const nodes, perNode, ttl = 1000, 100, 90
	e, err := startEtcd(ctx, env, "keepalive")
	if err != nil {
		return err
	}
	defer e.stop()
	clients := make([]*clientv3.Client, nodes)
	defer func() {
		for _, c := range clients {
			if c != nil {
				c.Close()
			}
		}
	}()
	sem := make(chan struct{}, 32)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if firstErr == nil {
			firstErr = err
		}
	}
	start := time.Now()
	for i := range clients {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			cli, err := e.client()
			if err != nil {
				fail(err)
				return
			}
			clients[i] = cli
			for range perNode {
				c, cancel := context.WithTimeout(ctx, 30*time.Second)
				l, err := cli.Grant(c, ttl)
				cancel()
				if err != nil {
					fail(err)
					return
				}
				ch, err := cli.KeepAlive(ctx, l.ID)
				if err != nil {
					fail(err)
					return
				}
				go func() {
					for range ch {
					}
				}()
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	progress("keepalive: %d leases on %d clients held after %s", nodes*perNode, nodes, time.Since(start).Round(time.Second))
	// Every lease's first renewal comes a third of the TTL after its grant: measure a whole
	// renewal period from then.
	time.Sleep(ttl * time.Second / 3)
	c0, t0 := e.cpu().etcd, time.Now()
	time.Sleep(ttl * time.Second / 3)
	core := float64(e.cpu().etcd-c0) / float64(time.Since(t0))
	res.add(row{Figure: fmt.Sprintf("keep-alives: etcd CPU for %s pod leases on %s clients, nothing else happening",
		thousands(nodes*perNode), thousands(nodes)), Leasehold: 100 * core, Unit: "% of a core"})
	res.note("Keep-alives: %d clients, each one keep-alive stream as an agent has, holding %d leases of %d s TTL (renewed at a third "+
		"of it by clientv3); etcd's CPU over %d s once every lease was in its renewal cycle.", nodes, perNode, ttl, ttl/3)
	progress("keepalive: etcd %.1f%% of a core for %d leases", 100*core, nodes*perNode)
	return nil
}
