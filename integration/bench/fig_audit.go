package main

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases"
)

// figAudit: what the agents' check of their keys (leases/audit) costs etcd. Agents with
// 110 dual-stack pods each (a full node: four keys a pod, two of them compared: the
// allocations are in blocks the agent's view watches) run their audit every second
// instead of every half TTL, and etcd's CPU over a window is compared with the same agents
// auditing once in the window's time; the difference per pod audited, times the pods of a
// 5,000-node cluster at the default interval, is what the audit adds to etcd at that scale.
func figAudit(ctx context.Context, env *env, res *results) error {
	const nodes, perNode, window = 10, 110, 20 * time.Second
	e, err := startEtcd(ctx, env, "audit")
	if err != nil {
		return err
	}
	defer e.stop()
	pool := allocator.PoolSpec{Name: "audit", Ranges: []allocator.RangeSet{
		{{Subnet: netip.MustParsePrefix("10.90.0.0/16")}}, {{Subnet: netip.MustParsePrefix("fd90::/64")}}}}
	states := make([]string, nodes)
	for i := range states {
		if states[i], err = env.tempDir(fmt.Sprintf("audit-state-%d", i)); err != nil {
			return err
		}
	}
	measure := func(interval time.Duration, fill bool) (cpu time.Duration, audits float64, err error) {
		agents := make([]*inproc, nodes)
		for i := range agents {
			p, err := startInproc(ctx, env, e, fmt.Sprintf("audit-%d", i), states[i], func(c *leases.Config) {
				c.AuditInterval = interval
			})
			if err != nil {
				return 0, 0, err
			}
			defer p.close()
			agents[i] = p
		}
		if fill {
			for i, p := range agents {
				for j := range perNode {
					owner := fmt.Sprintf("pod-%d-%d", i, j)
					req := allocator.Request{Network: pool.Name, Pool: pool, ContainerID: owner, IfName: "eth0",
						Pod: allocator.PodRef{UID: owner, Namespace: "bench", Name: owner}}
					if _, err := p.agent.Add(ctx, req); err != nil {
						return 0, 0, fmt.Errorf("ADD %s: %w", owner, err)
					}
				}
			}
		}
		// The first audits read every key; from the next on they compare.
		time.Sleep(3 * time.Second)
		count := func() (float64, error) {
			var n float64
			for _, p := range agents {
				s, err := gather(p.agent.Metrics())
				if err != nil {
					return 0, err
				}
				n += sum(s, "leasehold_key_audits_total", nil)
			}
			return n, nil
		}
		a0, err := count()
		if err != nil {
			return 0, 0, err
		}
		c0 := e.cpu().etcd
		time.Sleep(window)
		c1 := e.cpu().etcd
		a1, err := count()
		return c1 - c0, a1 - a0, err
	}
	// The agents stop (their pods' leases live on) and start again: the same pods, now
	// auditing every second, then every TTL (none in the window).
	if _, _, err := measure(leases.DefaultLeaseTTL, true); err != nil {
		return err
	}
	busy, audits, err := measure(time.Second, false)
	if err != nil {
		return err
	}
	idle, idleAudits, err := measure(leases.DefaultLeaseTTL, false)
	if err != nil {
		return err
	}
	if audits-idleAudits < nodes {
		return fmt.Errorf("audit: %v audits in the busy window and %v in the idle one: the agents did not audit", audits, idleAudits)
	}
	perPod := float64(busy-idle) / (audits - idleAudits) / perNode
	const clusterPods, interval = 5000 * 110, float64(leases.DefaultLeaseTTL / 2)
	res.add(row{Figure: "audit: etcd CPU per running pod checked (pod record and owner index compared)", Leasehold: perPod / 1e3, Unit: "µs"})
	res.add(row{Figure: "audit: etcd CPU at 5,000 nodes x 110 dual-stack pods, every half TTL (projected)",
		Leasehold: 100 * perPod * clusterPods / interval, Unit: "% of a core"})
	res.note("Audit: %d in-process agents with %d dual-stack pods each; etcd's CPU over %s with each agent auditing every second "+
		"(%.0f audits) less the same over %s with audits every TTL (%.0f), divided by the pods audited; projected to 550,000 pods "+
		"audited every %s.", nodes, perNode, window, audits, window, idleAudits, leases.DefaultLeaseTTL/2)
	progress("audit: %.1f µs of etcd CPU per pod audited (%.0f audits vs %.0f)", perPod/1e3, audits, idleAudits)
	return nil
}
