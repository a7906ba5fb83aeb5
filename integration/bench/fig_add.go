package main

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The occupancy sweep's pools: leasehold's in etcd, host-local's in its data directory,
// over the same subnet, pre-filled with the same addresses.
const (
	sweepPool   = "sweep"
	hlNetwork   = "hl-sweep"
	sweepNode   = "bench-node"
	emptyPool   = "exhaust-empty"
	emptySubnet = "10.21.0.0/16"
	// refPool stays (almost) empty: at every level, ADDs into it are interleaved with the
	// sweep's, so that "as its own empty figure" is measured at the same moments, under the
	// same load from elsewhere on the machine.
	refPool      = "sweep-ref"
	refSubnet    = "10.22.0.0/16"
	rssNode      = "rss-node"
	spaceSeed    = 1
	warmupAddsLH = 1
)

// sweep is the state of the occupancy sweep, shared with the near-exhaustion and RSS
// figures that continue filling the same pool in the same etcd.
type sweep struct {
	env      *env
	etcd     *etcdProc
	cli      *clientv3.Client
	lhSpace  *addrSpace
	hlSpace  *addrSpace
	stateDir string
	hlData   string
	lh, hl   pluginBin
	agent    *agentProc
	refAdds  int
}

// figAddSweep: sequential ADD p50 through the real plugin binaries at increasing occupancy of
// a /16, leasehold (against a leaseholdd process) and host-local (its disk store) side by
// side; then the near-exhaustion figure and the RSS figure on the same pool.
func figAddSweep(ctx context.Context, env *env, res *results) error {
	cfg := env.cfg
	e, cli, done, err := startEtcdClient(ctx, env, "sweep")
	if err != nil {
		return err
	}
	defer done()
	s := &sweep{env: env, etcd: e, cli: cli, lh: newPlugin(env.bin, "leasehold"), hl: newPlugin(env.bin, "cni/host-local")}
	if s.lhSpace, err = newAddrSpace(sweepPool, cfg.sweepSubnet, spaceSeed); err != nil {
		return err
	}
	if s.hlSpace, err = newAddrSpace(hlNetwork, cfg.sweepSubnet, spaceSeed); err != nil {
		return err
	}
	if s.stateDir, err = env.tempDir("state-" + sweepNode); err != nil {
		return err
	}
	if s.hlData, err = env.tempDir("host-local"); err != nil {
		return err
	}
	defer func() {
		if s.agent != nil {
			s.agent.stop()
		}
	}()
	hlConf := hostLocalConf(hlNetwork, s.hlData, cfg.sweepSubnet)

	var firstAdd []string
	for _, level := range cfg.lhLevels {
		if level > s.lhSpace.size() {
			return fmt.Errorf("level %d is more than the %d addresses of %s", level, s.lhSpace.size(), cfg.sweepSubnet)
		}
		withHL := slices.Contains(cfg.hlLevels, level)
		if err := s.fill(ctx, level, withHL); err != nil {
			return err
		}
		if err := s.restartAgent(ctx, ""); err != nil {
			return err
		}
		conf := leaseholdConf(sweepPool, s.agent.Socket, cfg.sweepSubnet)
		refConf := leaseholdConf(refPool, s.agent.Socket, netip.MustParsePrefix(refSubnet))
		// The agent's first ADD of a pool defines or reads it and lists it into the view;
		// it is reported apart, and every level starts from a warm agent.
		took, err := s.addLH(ctx, conf)
		if err != nil {
			return err
		}
		if _, err := s.addRef(ctx, refConf); err != nil {
			return err
		}
		firstAdd = append(firstAdd, fmt.Sprintf("%d: %.1f ms", level, ms(took)))
		if withHL {
			if _, err := s.addHL(ctx, hlConf); err != nil {
				return err
			}
		}
		var lhT, hlT, refT durations
		var fl *floor
		if level == 0 {
			// At the empty pool, what an ADD is made of is measured in the same loop.
			if fl, err = s.newFloor(ctx); err != nil {
				return err
			}
		}
		hlStop := time.Now().Add(cfg.hlBudget)
		for range cfg.samples {
			if err := ctx.Err(); err != nil {
				return err
			}
			took, err := s.addLH(ctx, conf)
			if err != nil {
				return err
			}
			lhT = append(lhT, took)
			if withHL && time.Now().Before(hlStop) {
				took, err := s.addHL(ctx, hlConf)
				if err != nil {
					return err
				}
				hlT = append(hlT, took)
			}
			took, err = s.addRef(ctx, refConf)
			if err != nil {
				return err
			}
			refT = append(refT, took)
			if fl != nil {
				if err := fl.sample(ctx); err != nil {
					return fmt.Errorf("floor: %w", err)
				}
			}
		}
		size := s.lhSpace.size()
		res.sweep = append(res.sweep, sweepPoint{Plugin: "leasehold", Allocated: level, Size: size, P50: lhT.pct(50), P90: lhT.pct(90), N: len(lhT)})
		res.sweep = append(res.sweep, sweepPoint{Plugin: "leasehold-ref", Allocated: level, Size: size, P50: refT.pct(50), P90: refT.pct(90), N: len(refT)})
		line := fmt.Sprintf("level %d: leasehold ADD p50 %.2f ms (n=%d; empty reference pool %.2f ms)", level, ms(lhT.pct(50)), len(lhT), ms(refT.pct(50)))
		if withHL {
			res.sweep = append(res.sweep, sweepPoint{Plugin: "host-local", Allocated: level, Size: size, P50: hlT.pct(50), P90: hlT.pct(90), N: len(hlT)})
			line += fmt.Sprintf(", host-local %.2f ms (n=%d)", ms(hlT.pct(50)), len(hlT))
		}
		progress("%s", line)
		if fl != nil {
			if err := fl.report(ctx, res, lhT); err != nil {
				return fmt.Errorf("floor: %w", err)
			}
		}
	}
	s.sweepRows(res)
	res.note("Plugin ADD: one sequential ADD at a time through the real binary (fork+exec, CNI_* environment, netconf on stdin, "+
		"CNI_ARGS with K8S_POD_*), leasehold against a leaseholdd process (--etcd-endpoints, --metrics-addr \"\", "+
		"--publish-host-addresses=false, defaults otherwise: 90 s leases, 8 spare leases, 30 s quarantine), host-local with its "+
		"dataDir on the same disk; one /16 (%s allocatable addresses). At each level the pool is pre-filled first: for leasehold "+
		"each pre-filled pod gets the three keys an ADD writes (allocation, owner index, pod record) with leasehold's JSON "+
		"values %s, as pods of %d other nodes, written in batched transactions "+
		"before leaseholdd is (re)started; for host-local its files are written as its disk backend writes them. "+
		"The agent's first ADD after each start (pool read + view listing) is not in the samples: %s. At every level each leasehold "+
		"sample is followed by one into a second /16 served by the same agent that stays nearly empty (%d ADDs in all): "+
		"the reference for \"its own empty figure\", taken at the same moments.",
		thousands(s.lhSpace.size()), leaseDesc(cfg.leaseGroup), prefillNodes, joinComma(firstAdd), s.refAdds)

	if err := s.exhaustion(ctx, res); err != nil {
		return fmt.Errorf("near exhaustion: %w", err)
	}
	if err := s.rss(ctx, res); err != nil {
		return fmt.Errorf("rss: %w", err)
	}
	return nil
}

// fill tops both pools up to level allocated addresses.
func (s *sweep) fill(ctx context.Context, level int, withHL bool) error {
	start := time.Now()
	addrs := s.lhSpace.fillTo(level)
	if s.agent != nil && len(addrs) > 0 {
		// Pre-filled before the agent starts, as the brief asks: the view lists them.
		s.agent.stop()
		s.agent = nil
	}
	if err := prefillLeasehold(ctx, s.cli, sweepPool, addrs, s.env.cfg.leaseGroup); err != nil {
		return err
	}
	var hl []netip.Addr
	if withHL {
		hl = s.hlSpace.fillTo(level)
		if err := prefillHostLocal(s.hlData, hlNetwork, hl); err != nil {
			return err
		}
	}
	if len(addrs)+len(hl) > 0 {
		progress("pre-filled %d leasehold and %d host-local allocations in %s (now %d / %d)", len(addrs), len(hl),
			time.Since(start).Round(time.Millisecond), s.lhSpace.count(), s.hlSpace.count())
	}
	return nil
}

// restartAgent (re)starts the sweep node's leaseholdd with its state directory.
func (s *sweep) restartAgent(ctx context.Context, metricsAddr string) error {
	if s.agent != nil {
		s.agent.stop()
		s.agent = nil
	}
	a, err := startLeaseholdd(ctx, s.env, s.etcd.URL, sweepNode, s.stateDir, metricsAddr)
	if err != nil {
		return err
	}
	s.agent = a
	return nil
}

func (s *sweep) addLH(ctx context.Context, conf []byte) (time.Duration, error) {
	addrs, took, err := s.lh.add(ctx, call{container: ids.containerID(), podUID: ids.podUID(), netns: s.env.netns, conf: conf})
	if err != nil {
		return took, fmt.Errorf("%w\nleaseholdd log tail:\n%s", err, s.agent.logs)
	}
	for _, a := range addrs {
		s.lhSpace.mark(a)
	}
	return took, nil
}

// addRef is an ADD into the reference pool, which stays nearly empty.
func (s *sweep) addRef(ctx context.Context, conf []byte) (time.Duration, error) {
	_, took, err := s.lh.add(ctx, call{container: ids.containerID(), podUID: ids.podUID(), netns: s.env.netns, conf: conf})
	if err != nil {
		return took, fmt.Errorf("%w\nleaseholdd log tail:\n%s", err, s.agent.logs)
	}
	s.refAdds++
	return took, nil
}

func (s *sweep) addHL(ctx context.Context, conf []byte) (time.Duration, error) {
	addrs, took, err := s.hl.add(ctx, call{container: ids.containerID(), podUID: ids.podUID(), netns: s.env.netns, conf: conf})
	if err != nil {
		return took, err
	}
	for _, a := range addrs {
		s.hlSpace.mark(a)
	}
	return took, nil
}

// sweepRows turns the sweep into the table's ADD rows.
func (s *sweep) sweepRows(res *results) {
	point := func(plugin string, level int) *sweepPoint {
		for i := range res.sweep {
			if p := &res.sweep[i]; p.Plugin == plugin && p.Allocated == level {
				return p
			}
		}
		return nil
	}
	if lh, hl := point("leasehold", 0), point("host-local", 0); lh != nil && hl != nil {
		// No target here: host-local writes a file without fsync, leasehold waits for etcd's
		// commit. The target is against the floor the bench measures (floor.go).
		res.add(row{Figure: "plugin ADD p50, empty /16", Leasehold: ms(lh.P50), Peer: ms(hl.P50), hasPeer: true, Unit: "ms",
			PeerName: "host-local", Target: "—"})
	}
	if lh, hl := point("leasehold", 5000), point("host-local", 5000); lh != nil && hl != nil {
		r := row{Figure: "plugin ADD p50, 5,000 allocated", Leasehold: ms(lh.P50), Peer: ms(hl.P50), hasPeer: true, Unit: "ms",
			PeerName: "host-local", Target: "<= 0.2x host-local"}
		q, _ := r.ratio()
		r.judge(q <= 0.2)
		res.add(r)
	}
	top := s.env.cfg.lhLevels[len(s.env.cfg.lhLevels)-1]
	if lh, empty := point("leasehold", top), point("leasehold-ref", top); lh != nil && empty != nil && top > 0 {
		r := row{Figure: fmt.Sprintf("plugin ADD p50, %s allocated", thousands(top)), Leasehold: ms(lh.P50), Peer: ms(empty.P50),
			hasPeer: true, Unit: "ms", PeerName: "leasehold, empty pool, interleaved", Target: "<= 1.5x own empty"}
		q, _ := r.ratio()
		r.judge(q <= 1.5)
		res.add(r)
		if e0 := point("leasehold", 0); e0 != nil {
			res.note("Plugin ADD at %s allocated: %.2f ms p50, against %.2f ms for ADDs into an empty /16 interleaved with them "+
				"(the row's peer) and %.2f ms for the sweep's own empty level, measured minutes earlier.",
				thousands(top), ms(lh.P50), ms(empty.P50), ms(e0.P50))
		}
	}
}
