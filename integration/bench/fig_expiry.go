package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// figExpiry: a dead node's pods, or a whole rack's, expire together. 10,000 leases with one
// key each are granted within a few seconds and left to expire; meanwhile a claim-shaped
// transaction (create-if-absent put) runs every 20 ms. Reported: how long etcd took from the
// first lease's expiry to the last key gone, and the transaction's p50 and p99 before and
// during the expiry. etcd's leader revokes expired leases in batches (at most 1,000 a
// second in v3.6), and each revoke is a raft proposal.
func figExpiry(ctx context.Context, env *env, res *results) error {
	const leases, ttl = 10000, 10
	_, cli, done, err := startEtcdClient(ctx, env, "expiry")
	if err != nil {
		return err
	}
	defer done()
	probe := func(i int) (time.Duration, error) {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		key := fmt.Sprintf("/bench/expiry/probe/%d", i)
		t := time.Now()
		_, err := cli.Txn(c).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, "x")).Commit()
		return time.Since(t), err
	}
	var before durations
	for i := range 100 {
		d, err := probe(i)
		if err != nil {
			return err
		}
		before = append(before, d)
		time.Sleep(20 * time.Millisecond)
	}
	// Grant and bind, 64 at a time.
	granted := time.Now()
	sem := make(chan struct{}, 64)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for i := range leases {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			c, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			l, err := cli.Grant(c, ttl)
			if err == nil {
				_, err = cli.Put(c, fmt.Sprintf("/bench/expiry/keys/%05d", i), "x", clientv3.WithLease(l.ID))
			}
			if err != nil {
				mu.Lock()
				if firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	grantTook := time.Since(granted)
	firstExpiry := granted.Add(ttl * time.Second)
	time.Sleep(time.Until(firstExpiry))
	var during durations
	var gone time.Time
	for i := 100; ; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		d, err := probe(i)
		if err != nil {
			return err
		}
		during = append(during, d)
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		left, err := cli.Get(c, "/bench/expiry/keys/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		cancel()
		if err != nil {
			return err
		}
		if left.Count == 0 {
			gone = time.Now()
			break
		}
		if time.Since(firstExpiry) > 5*time.Minute {
			return fmt.Errorf("mass expiry: %d keys left after 5 minutes", left.Count)
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := gone.Sub(firstExpiry)
	fig := fmt.Sprintf("mass expiry of %s leases (one key each)", thousands(leases))
	res.add(row{Figure: fig + ": first expiry to last key gone", Leasehold: took.Seconds(), Unit: "s"})
	res.add(row{Figure: fig + ": claim-shaped Txn p50 during it", Leasehold: ms(during.pct(50)), Unit: "ms",
		Peer: ms(before.pct(50)), hasPeer: true, PeerName: "before"})
	res.add(row{Figure: fig + ": claim-shaped Txn p99 during it", Leasehold: ms(during.pct(99)), Unit: "ms",
		Peer: ms(before.pct(99)), hasPeer: true, PeerName: "before"})
	res.note("Mass expiry: %d leases of TTL %d s, one key each, granted in %s (64 at a time) and left to expire, as a dead "+
		"rack's pods do; a create-if-absent Txn every 20 ms before (%d samples) and from the first expiry until the last key "+
		"was gone (%d samples). etcd's leader revokes expired leases itself, each revoke one raft proposal.",
		leases, ttl, grantTook.Round(time.Millisecond), len(before), len(during))
	progress("expiry: %d leases gone %.1f s after the first expired; Txn p50 %.2f ms before, %.2f ms during (p99 %.1f ms)",
		leases, took.Seconds(), ms(before.pct(50)), ms(during.pct(50)), ms(during.pct(99)))
	return nil
}
