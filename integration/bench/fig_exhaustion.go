package main

import (
	"context"
	"fmt"
	"math"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

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
