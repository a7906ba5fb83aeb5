package main

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"
)

// figFanout simulates a large cluster in one process: W agents (each its own client, node
// identity and socket) serve one pool, so each keeps a watch on it; one of them takes
// sequential ADDs. What each ADD costs etcd (CPU, watch events sent) as W grows is what
// changes with the number of nodes.
func figFanout(ctx context.Context, env *env, res *results) error {
	cfg := env.cfg
	e, err := startEtcd(ctx, env, "fanout")
	if err != nil {
		return err
	}
	defer e.stop()
	const pool = "fanout"
	subnet := netip.MustParsePrefix("10.70.0.0/16")
	var agents []*inproc
	defer func() {
		for _, a := range agents {
			a.close()
		}
	}()
	type point struct {
		w                         int
		p50                       time.Duration
		etcdCPU, events, idleRate float64
	}
	var points []point
	for _, w := range cfg.fanoutLevels {
		// Grow to w agents, 8 starting at a time, each warm on the pool.
		var mu sync.Mutex
		var wg sync.WaitGroup
		var firstErr error
		sem := make(chan struct{}, 8)
		for i := len(agents); i < w; i++ {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				a, err := startInproc(ctx, env, e, fmt.Sprintf("fan-%04d", i), "", nil)
				if err == nil {
					err = a.status(ctx, a.conf(pool, subnet))
				}
				mu.Lock()
				defer mu.Unlock()
				if a != nil {
					agents = append(agents, a)
				}
				if err != nil && firstErr == nil {
					firstErr = err
				}
			})
		}
		wg.Wait()
		if firstErr != nil {
			return firstErr
		}
		time.Sleep(time.Second) // spares granted, views synced
		c0, t0 := e.cpu().etcd, time.Now()
		time.Sleep(2 * time.Second)
		idle := float64(e.cpu().etcd-c0) / float64(time.Since(t0)) // etcd CPU seconds per second with nothing allocated
		m0, err := scrape(ctx, e.URL+"/metrics")
		if err != nil {
			return err
		}
		cl, conf := agents[0].client(), agents[0].conf(pool, subnet)
		var lat durations
		failed := 0
		var firstFail error
		c0, t0 = e.cpu().etcd, time.Now()
		for range cfg.fanoutAdds {
			if err := ctx.Err(); err != nil {
				return err
			}
			t := time.Now()
			inv, _ := podAdd(conf, env.netns)
			if _, err := invoke(ctx, cl, inv); err != nil {
				// A simulation: a failed ADD is reported, not fatal.
				failed++
				if firstFail == nil {
					firstFail = err
				}
				continue
			}
			lat = append(lat, time.Since(t))
		}
		if failed > 0 {
			res.note("Fan-out with %d agents: %d of %d ADDs failed, the first with: %v.", w, failed, cfg.fanoutAdds, firstFail)
			progress("fan-out: %d agents: %d ADDs failed: %v", w, failed, firstFail)
		}
		elapsed := time.Since(t0)
		busy := float64(e.cpu().etcd-c0) - idle*float64(elapsed)
		time.Sleep(200 * time.Millisecond)
		m1, err := scrape(ctx, e.URL+"/metrics")
		if err != nil {
			return err
		}
		events := sum(m1, "etcd_debugging_mvcc_events_total", nil) - sum(m0, "etcd_debugging_mvcc_events_total", nil)
		p := point{w: w, p50: lat.pct(50), etcdCPU: busy / float64(cfg.fanoutAdds) / float64(time.Microsecond),
			events: events / float64(cfg.fanoutAdds), idleRate: idle}
		points = append(points, p)
		progress("fan-out: %s watching: ADD p50 %.2f ms, etcd CPU %.0f µs and %.0f watch events sent per ADD (idle etcd %.1f%% CPU)",
			agentsN(w), ms(p.p50), p.etcdCPU, p.events, 100*idle)
	}
	base := points[0]
	for _, p := range points {
		r := row{Figure: fmt.Sprintf("watch fan-out: etcd CPU per ADD, %s watching the pool", agentsN(p.w)), Leasehold: p.etcdCPU, Unit: "µs"}
		if p.w != base.w {
			r.Peer, r.hasPeer, r.PeerName = base.etcdCPU, true, agentsN(base.w)
		}
		res.add(r)
	}
	desc := ""
	for _, p := range points {
		desc += fmt.Sprintf("%s: ADD p50 %.2f ms, etcd CPU %.0f µs and %.1f watch events sent per ADD, idle etcd CPU %.1f%%; ",
			agentsN(p.w), ms(p.p50), p.etcdCPU, p.events, 100*p.idleRate)
	}
	res.note("Watch fan-out (a cluster simulated in one process): W in-process agents, each with its own etcd client, node identity "+
		"and socket, all serving one /16 (each has listed it and watches it); one of them takes %d sequential ADDs through its socket. "+
		"etcd CPU per ADD is etcd's CPU time during the ADDs less its idle rate measured just before (keep-alives of the idle agents' "+
		"node and spare leases); watch events sent = delta of etcd_debugging_mvcc_events_total. %s",
		cfg.fanoutAdds, desc)
	return nil
}

func agentsN(n int) string {
	if n == 1 {
		return "1 agent"
	}
	return fmt.Sprintf("%d agents", n)
}
