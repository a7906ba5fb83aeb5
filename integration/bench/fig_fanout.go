package main

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/leasehold/leasehold/cniplugin/agentapi"
	"github.com/leasehold/leasehold/leases"
)

// figFanout measures what one ADD costs etcd (CPU, watch events sent) as the number of agents
// serving its pool grows: with W agents simulated in one process (each its own client, node
// identity and socket), and with W real leaseholdd processes. Every agent serves the pool (it
// has answered a STATUS for it: definition read, block claims listed, watches open); one of
// them takes sequential ADDs, in the blocks it claims. Issue 16's targets: at every size at most
// 1.3x the etcd CPU of one agent, and at most 2 watch events sent per ADD.
func figFanout(ctx context.Context, env *env, res *results) error {
	cfg := env.cfg
	sim := func(e *etcdProc, i int) (string, func(), error) {
		a, err := startInproc(ctx, env, e, fmt.Sprintf("fan-%04d", i), "", func(c *leases.Config) { c.SpareLeases = 1 })
		if err != nil {
			return "", nil, err
		}
		return a.Socket, a.close, nil
	}
	proc := func(e *etcdProc, i int) (string, func(), error) {
		node := fmt.Sprintf("fanp-%04d", i)
		dir, err := env.tempDir("fanout-state-" + node)
		if err != nil {
			return "", nil, err
		}
		a, err := startLeaseholdd(ctx, env, e.URL, node, dir, "")
		if err != nil {
			return "", nil, err
		}
		return a.Socket, a.stop, nil
	}
	if err := fanout(ctx, env, res, "agents in one process", cfg.fanoutLevels, sim); err != nil {
		return err
	}
	return fanout(ctx, env, res, "leaseholdd processes", cfg.fanoutProcs, proc)
}

// fanout runs the fan-out figure for one kind of agent, started by start.
func fanout(ctx context.Context, env *env, res *results, kind string, levels []int,
	start func(e *etcdProc, i int) (socket string, stop func(), err error)) error {
	cfg := env.cfg
	e, err := startEtcd(ctx, env, "fanout")
	if err != nil {
		return err
	}
	defer e.stop()
	const pool = "fanout"
	subnet := netip.MustParsePrefix("10.70.0.0/16")
	var sockets []string
	var stops []func()
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	type point struct {
		w int
		addCost
	}
	var points []point
	for _, w := range levels {
		// Grow to w agents, 8 starting at a time, each warm on the pool.
		var mu sync.Mutex
		var wg sync.WaitGroup
		var firstErr error
		sem := make(chan struct{}, 8)
		for i := len(sockets); i < w; i++ {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				socket, stop, err := start(e, i)
				if err == nil {
					cl := &agentapi.Client{Socket: socket, Timeout: 60 * time.Second}
					_, err = invoke(ctx, cl, agentapi.NewInvocation("STATUS", leaseholdConf(pool, socket, subnet), "", ""))
				}
				mu.Lock()
				defer mu.Unlock()
				if stop != nil {
					sockets, stops = append(sockets, socket), append(stops, stop)
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
		c, err := measureAddCost(ctx, env, res, e, sockets[0], leaseholdConf(pool, sockets[0], subnet), cfg.fanoutAdds,
			fmt.Sprintf("Fan-out with %d %s", w, kind))
		if err != nil {
			return err
		}
		p := point{w: w, addCost: c}
		progress("fan-out: %d %s watching: ADD p50 %.2f ms, etcd CPU %.0f µs and %.1f watch events sent per ADD (idle etcd %.1f%% CPU)",
			w, kind, ms(p.p50), p.etcdCPU, p.events, 100*p.idleRate)
		points = append(points, p)
	}
	base := points[0]
	for _, p := range points {
		r := row{Figure: fmt.Sprintf("watch fan-out: etcd CPU per ADD, %s, %s", agentsN(p.w), kind), Leasehold: p.etcdCPU, Unit: "µs"}
		if p.w != base.w {
			r.Peer, r.hasPeer, r.PeerName, r.Target = base.etcdCPU, true, agentsN(base.w), "<= 1.3x 1 agent"
			q, _ := r.ratio()
			r.judge(q <= 1.3)
		}
		res.add(r)
		r = row{Figure: fmt.Sprintf("watch fan-out: watch events sent per ADD, %s, %s", agentsN(p.w), kind), Leasehold: p.events,
			Target: "<= 2"}
		r.judge(p.events <= 2)
		res.add(r)
	}
	desc := ""
	for _, p := range points {
		desc += fmt.Sprintf("%s: ADD p50 %.2f ms, etcd CPU %.0f µs and %.1f watch events sent per ADD, idle etcd CPU %.1f%%; ",
			agentsN(p.w), ms(p.p50), p.etcdCPU, p.events, 100*p.idleRate)
	}
	res.note("Watch fan-out (%s): W agents, each with its own etcd client, node identity and socket, all serving one /16 "+
		"(each has answered a STATUS for it: read the definition and the block claims, opened its watches; in the block layout "+
		"an agent follows only the blocks it claimed); one of them takes %d sequential ADDs through its socket. etcd CPU per ADD is "+
		"etcd's CPU time during the ADDs less its idle rate measured just before (keep-alives of the idle agents' node and "+
		"spare leases); watch events sent = delta of etcd_debugging_mvcc_events_total. %s",
		kind, cfg.fanoutAdds, desc)
	return nil
}

func agentsN(n int) string {
	if n == 1 {
		return "1 agent"
	}
	return fmt.Sprintf("%d agents", n)
}

// addCost is what n sequential ADDs through one agent's socket cost etcd.
type addCost struct {
	p50 time.Duration
	// etcdCPU is etcd's CPU time per ADD in µs, less its idle rate; events the watch events
	// etcd sent per ADD; idleRate etcd's CPU seconds per second before the ADDs.
	etcdCPU, events, idleRate float64
}

// measureAddCost measures etcd's idle CPU rate over 5 s, then n sequential ADDs of new pods
// through socket with conf: their p50, etcd's CPU per ADD above the idle rate and the watch
// events etcd sent per ADD (etcd_debugging_mvcc_events_total). A failed ADD is noted (as
// what), not fatal: the figures are simulations. etcd's CPU time is counted in 10 ms ticks,
// so the idle window and the ADDs must both be long enough for the subtraction to mean
// something.
func measureAddCost(ctx context.Context, env *env, res *results, e *etcdProc, socket string, conf []byte, n int, what string) (addCost, error) {
	c0, t0 := e.cpu().etcd, time.Now()
	time.Sleep(5 * time.Second)
	idle := float64(e.cpu().etcd-c0) / float64(time.Since(t0)) // etcd CPU seconds per second with nothing allocated
	m0, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return addCost{}, err
	}
	cl := &agentapi.Client{Socket: socket, Timeout: 60 * time.Second}
	var lat durations
	failed := 0
	var firstFail error
	c0, t0 = e.cpu().etcd, time.Now()
	for range n {
		if err := ctx.Err(); err != nil {
			return addCost{}, err
		}
		t := time.Now()
		inv, _ := podAdd(conf, env.netns)
		if _, err := invoke(ctx, cl, inv); err != nil {
			failed++
			if firstFail == nil {
				firstFail = err
			}
			continue
		}
		lat = append(lat, time.Since(t))
	}
	if failed > 0 {
		res.note("%s: %d of %d ADDs failed, the first with: %v.", what, failed, n, firstFail)
		progress("%s: %d ADDs failed: %v", what, failed, firstFail)
	}
	elapsed := time.Since(t0)
	busy := float64(e.cpu().etcd-c0) - idle*float64(elapsed)
	time.Sleep(200 * time.Millisecond)
	m1, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return addCost{}, err
	}
	events := sum(m1, "etcd_debugging_mvcc_events_total", nil) - sum(m0, "etcd_debugging_mvcc_events_total", nil)
	return addCost{p50: lat.pct(50), etcdCPU: busy / float64(n) / float64(time.Microsecond), events: events / float64(n), idleRate: idle}, nil
}
