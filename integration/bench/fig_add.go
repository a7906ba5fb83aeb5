package main

import (
	"context"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
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
		r := row{Figure: "plugin ADD p50, empty /16", Leasehold: ms(lh.P50), Peer: ms(hl.P50), hasPeer: true, Unit: "ms",
			PeerName: "host-local", Target: "<= 0.75x host-local"}
		q, _ := r.ratio()
		r.judge(q <= 0.75)
		res.add(r)
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

// exhaustion: ADDs into the sweep pool at 99.9% occupancy against ADDs into an empty /16,
// served by one leaseholdd with its metrics on: claim transactions per ADD (the agent's
// leasehold_etcd_request_duration_seconds_count{kind="claim"} over its ADD count) and every
// unary request etcd served per ADD (etcd's grpc_server_handled_total), plus p50.
func (s *sweep) exhaustion(ctx context.Context, res *results) error {
	cfg := s.env.cfg
	size := s.lhSpace.size()
	target := int(math.Ceil(cfg.exhaustOcc * float64(size)))
	if size-target < cfg.exhaustN+warmupAddsLH {
		return fmt.Errorf("a pool of %d at %.2f%% leaves %d free addresses, fewer than -exhaust-samples %d", size, 100*cfg.exhaustOcc, size-target, cfg.exhaustN)
	}
	if err := s.fill(ctx, target-warmupAddsLH, false); err != nil {
		return err
	}
	maddr, err := freeLoopbackURL()
	if err != nil {
		return err
	}
	maddr = maddr[len("http://"):]
	if err := s.restartAgent(ctx, maddr); err != nil {
		return err
	}
	emptySub := netip.MustParsePrefix(emptySubnet)
	fullConf := leaseholdConf(sweepPool, s.agent.Socket, cfg.sweepSubnet)
	emptyConf := leaseholdConf(emptyPool, s.agent.Socket, emptySub)
	// Warm both pools' views.
	if _, err := s.addLH(ctx, fullConf); err != nil {
		return err
	}
	if _, _, err := s.lh.add(ctx, call{container: ids.containerID(), podUID: ids.podUID(), netns: s.env.netns, conf: emptyConf}); err != nil {
		return err
	}
	type phase struct {
		lat                 durations
		adds, claims, etcdN float64
		addSec, claimSec    float64 // agent-side time in ADDs and in claim Txns
		occFrom, occTo      int
	}
	// Blocks of a few ADDs alternate between the two pools, so that both see the same load
	// from elsewhere; each block is counted on its own (metrics scraped around it).
	measure := func(p *phase, conf []byte, full bool, n int) error {
		// Let the spare-lease refill of the previous ADD settle, so that the counts are this block's own.
		time.Sleep(300 * time.Millisecond)
		a0, err := scrape(ctx, "http://"+maddr+"/metrics")
		if err != nil {
			return err
		}
		e0, err := scrape(ctx, s.etcd.URL+"/metrics")
		if err != nil {
			return err
		}
		for range n {
			if err := ctx.Err(); err != nil {
				return err
			}
			var took time.Duration
			if full {
				took, err = s.addLH(ctx, conf)
			} else {
				_, took, err = s.lh.add(ctx, call{container: ids.containerID(), podUID: ids.podUID(), netns: s.env.netns, conf: conf})
			}
			if err != nil {
				return err
			}
			p.lat = append(p.lat, took)
		}
		time.Sleep(300 * time.Millisecond) // the last ADD's spare-lease refill
		a1, err := scrape(ctx, "http://"+maddr+"/metrics")
		if err != nil {
			return err
		}
		e1, err := scrape(ctx, s.etcd.URL+"/metrics")
		if err != nil {
			return err
		}
		add := map[string]string{"op": "add"}
		claim := map[string]string{"kind": "claim"}
		unary := map[string]string{"grpc_type": "unary"}
		adds := sum(a1, "leasehold_operation_duration_seconds_count", add) - sum(a0, "leasehold_operation_duration_seconds_count", add)
		if adds != float64(n) {
			return fmt.Errorf("agent counted %.0f ADDs, the bench made %d", adds, n)
		}
		p.adds += adds
		p.claims += sum(a1, "leasehold_etcd_request_duration_seconds_count", claim) - sum(a0, "leasehold_etcd_request_duration_seconds_count", claim)
		p.etcdN += sum(e1, "grpc_server_handled_total", unary) - sum(e0, "grpc_server_handled_total", unary)
		p.addSec += sum(a1, "leasehold_operation_duration_seconds_sum", add) - sum(a0, "leasehold_operation_duration_seconds_sum", add)
		p.claimSec += sum(a1, "leasehold_etcd_request_duration_seconds_sum", claim) - sum(a0, "leasehold_etcd_request_duration_seconds_sum", claim)
		return nil
	}
	empty, full := &phase{}, &phase{occFrom: s.lhSpace.count()}
	// A block is as many ADDs as leaseholdd takes spare leases between two refills (half of
	// its 8): any 4 ADDs in a row carry exactly one refill, whose grants then count where
	// they belong instead of falling into one phase's block or the other's.
	const block = 4
	for done := 0; done < cfg.exhaustN; done += block {
		n := min(block, cfg.exhaustN-done)
		if err := measure(empty, emptyConf, false, n); err != nil {
			return err
		}
		if err := measure(full, fullConf, true, n); err != nil {
			return err
		}
	}
	full.occTo = s.lhSpace.count()
	s.agent.stop()
	s.agent = nil
	res.sweep = append(res.sweep, sweepPoint{Plugin: "leasehold", Allocated: full.occFrom, Size: size, P50: full.lat.pct(50), P90: full.lat.pct(90), N: len(full.lat)})
	occ := fmt.Sprintf("%.2f-%.2f%%", 100*float64(full.occFrom)/float64(size), 100*float64(full.occTo)/float64(size))
	r := row{Figure: "ADD p50 at " + occ + " of a /16", Leasehold: ms(full.lat.pct(50)), Peer: ms(empty.lat.pct(50)), hasPeer: true,
		Unit: "ms", PeerName: "leasehold, empty", Target: ""}
	res.add(r)
	r = row{Figure: "etcd claim Txns per ADD at " + occ, Leasehold: full.claims / full.adds, Peer: empty.claims / empty.adds, hasPeer: true,
		Unit: "", PeerName: "leasehold, empty", Target: "O(1): as empty"}
	r.judge(r.Leasehold <= r.Peer)
	res.add(r)
	r = row{Figure: "etcd requests per ADD at " + occ, Leasehold: full.etcdN / full.adds, Peer: empty.etcdN / empty.adds, hasPeer: true,
		Unit: "", PeerName: "leasehold, empty", Target: "O(1): <= 1.1x empty"}
	r.judge(r.Leasehold <= 1.1*r.Peer)
	res.add(r)
	res.note("Near exhaustion: the sweep pool filled to %d of %d (%s during the %d measured ADDs, free addresses spread pseudo-randomly), "+
		"against an empty /16 served by the same leaseholdd (metrics on), in alternating blocks of %d ADDs counted apart (one spare-lease refill of 4 grants in each); claim Txns per ADD = delta of "+
		"leasehold_etcd_request_duration_seconds_count{kind=\"claim\"} / delta of leasehold_operation_duration_seconds_count{op=\"add\"}; "+
		"etcd requests = delta of etcd's grpc_server_handled_total{grpc_type=\"unary\"} (every unary call etcd served: the claim Txn "+
		"and the keeper's LeaseGrants refilling its spares); p90 %.2f ms at %s vs %.2f ms empty. Inside the agent (its own histograms): "+
		"ADD mean %.2f ms of which claim Txn %.2f ms at %s; %.2f ms of which %.2f ms empty.",
		target, size, occ, cfg.exhaustN, block, ms(full.lat.pct(90)), occ, ms(empty.lat.pct(90)),
		1000*full.addSec/full.adds, 1000*full.claimSec/full.claims, occ, 1000*empty.addSec/empty.adds, 1000*empty.claimSec/empty.claims)
	progress("near exhaustion (%s): ADD p50 %.2f ms (empty %.2f ms), claims/ADD %.2f (empty %.2f), etcd requests/ADD %.2f (empty %.2f)",
		occ, ms(full.lat.pct(50)), ms(empty.lat.pct(50)), full.claims/full.adds, empty.claims/empty.adds, full.etcdN/full.adds, empty.etcdN/empty.adds)
	return nil
}

// rss: a fresh leaseholdd process (a node with no pods of its own) against the sweep pool
// filled to all its addresses but one; one ADD makes it load the pool into its view and
// takes the last address; then its VmRSS.
func (s *sweep) rss(ctx context.Context, res *results) error {
	size := s.lhSpace.size()
	if err := s.fill(ctx, size-1, false); err != nil {
		return err
	}
	stateDir, err := s.env.tempDir("state-" + rssNode)
	if err != nil {
		return err
	}
	a, err := startLeaseholdd(ctx, s.env, s.etcd.URL, rssNode, stateDir, "")
	if err != nil {
		return err
	}
	defer a.stop()
	pid := a.cmd.Process.Pid
	before, err := procStatusKB(pid, "VmRSS")
	if err != nil {
		return err
	}
	conf := leaseholdConf(sweepPool, a.Socket, s.env.cfg.sweepSubnet)
	addrs, took, err := s.lh.add(ctx, call{container: ids.containerID(), podUID: ids.podUID(), netns: s.env.netns, conf: conf})
	if err != nil {
		return fmt.Errorf("%w\n%s", err, a.logs)
	}
	for _, ad := range addrs {
		s.lhSpace.mark(ad)
	}
	c, cancel := context.WithTimeout(ctx, 30*time.Second)
	cnt, err := s.cli.Get(c, keyspace.IPsPrefix(sweepPool), clientv3.WithPrefix(), clientv3.WithCountOnly())
	cancel()
	if err != nil {
		return err
	}
	if cnt.Count != int64(size) {
		return fmt.Errorf("pool %s has %d allocation keys, want all %d", sweepPool, cnt.Count, size)
	}
	time.Sleep(2 * time.Second)
	rss, err := procStatusKB(pid, "VmRSS")
	if err != nil {
		return err
	}
	hwm, err := procStatusKB(pid, "VmHWM")
	if err != nil {
		return err
	}
	r := row{Figure: fmt.Sprintf("leaseholdd RSS, /16 fully allocated (%s keys)", thousands(size)), Leasehold: float64(rss) / 1024,
		Unit: "MB", Target: "< 100 MB"}
	r.judge(float64(rss)/1024 < 100)
	res.add(r)
	res.note("RSS: a fresh leaseholdd process (no pods of its own) against etcd holding %d allocations of the /16 (plus their owner "+
		"and pod keys, and the sweep's other pools); VmRSS %.1f MB before its first ADD, %.1f MB 2 s after the ADD that listed the "+
		"pool into its view (%.0f ms) and took the last free address; peak VmHWM %.1f MB.",
		size-1, float64(before)/1024, float64(rss)/1024, ms(took), float64(hwm)/1024)
	progress("RSS: %.1f MB before the view, %.1f MB after (peak %.1f MB)", float64(before)/1024, float64(rss)/1024, float64(hwm)/1024)
	return nil
}

func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func joinComma(ss []string) string {
	out := ""
	for i, s := range ss {
		if i > 0 {
			out += "; "
		}
		out += s
	}
	return out
}

func leaseDesc(group int) string {
	if group <= 1 {
		return "on a lease of its own (as leasehold gives each pod)"
	}
	return fmt.Sprintf("on leases shared by %d pods each", group)
}
