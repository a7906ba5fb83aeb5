package main

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The rules figure's network and pools: rulesPools[0] is the network configuration's pool;
// with the rules in place, the bench namespace's pods get rulesPools[1].
const (
	rulesNetwork = "rules"
	rulesNode    = "rules-node"
	rulesCluster = "default" // leaseholdd's default
)

var rulesPools = []struct {
	name   string
	subnet netip.Prefix
}{
	{rulesNetwork, netip.MustParsePrefix("10.70.0.0/16")},
	{"rules-b", netip.MustParsePrefix("10.71.0.0/16")},
	{"rules-c", netip.MustParsePrefix("10.72.0.0/16")},
	{"rules-d", netip.MustParsePrefix("10.73.0.0/16")},
	{"rules-e", netip.MustParsePrefix("10.74.0.0/16")},
	{"rules-f", netip.MustParsePrefix("10.75.0.0/16")},
}

// figRules: what selection rules cost an ADD. Sequential plugin ADDs against a leaseholdd
// process, in rounds that alternate between no rule at all (the configuration's pool, chosen
// without looking at any rule) and five rules in place: three namespace rules (the bench
// namespace's gives it another pool first, with the configuration's as fallback) and two node
// rules (one matching the agent's node label, one not). The rules are written and deleted
// with admin, as leaseholdctl does; each round starts once an ADD shows the agent follows the
// change.
func figRules(ctx context.Context, env *env, res *results) error {
	e, cli, done, err := startEtcdClient(ctx, env, "rules")
	if err != nil {
		return err
	}
	defer done()
	for _, p := range rulesPools[1:] {
		spec := allocator.PoolSpec{Name: p.name, Ranges: []allocator.RangeSet{{{Subnet: p.subnet}}}}
		if _, err := admin.CreatePool(ctx, cli, spec); err != nil {
			return fmt.Errorf("create pool %s: %w", p.name, err)
		}
	}
	state, err := env.tempDir("rules-state")
	if err != nil {
		return err
	}
	agent, err := startLeaseholdd(ctx, env, e.URL, rulesNode, state, "", "--node-label", "rack=r1")
	if err != nil {
		return err
	}
	defer agent.stop()
	lh := newPlugin(env.bin, "leasehold")
	conf := leaseholdConf(rulesNetwork, agent.Socket, rulesPools[0].subnet)
	add := func() (netip.Addr, time.Duration, error) {
		addrs, took, err := lh.add(ctx, call{container: ids.containerID(), podUID: ids.podUID(), netns: env.netns, conf: conf})
		if err != nil {
			return netip.Addr{}, took, err
		}
		if len(addrs) != 1 {
			return netip.Addr{}, took, fmt.Errorf("ADD returned %v, want one address", addrs)
		}
		time.Sleep(idleGap)
		return addrs[0], took, nil
	}
	// settle ADDs until one comes from the pool the rules now give: the agent follows the
	// rules by a watch, so the change reaches it a round-trip later.
	settle := func(want netip.Prefix) error {
		for range 1000 {
			ip, _, err := add()
			if err != nil {
				return err
			}
			if want.Contains(ip) {
				return nil
			}
			time.Sleep(10 * time.Millisecond)
		}
		return fmt.Errorf("the agent's ADDs never came from %s", want)
	}
	for range 10 { // the pool definition, the view and the spares in place
		if _, _, err := add(); err != nil {
			return err
		}
	}
	n := max(env.cfg.samples, 20)
	var none, five durations
	for round := range 4 {
		with := round%2 == 1
		want := rulesPools[0].subnet
		if with {
			if err := writeRules(ctx, cli); err != nil {
				return err
			}
			want = rulesPools[1].subnet
		} else if err := deleteRules(ctx, cli); err != nil {
			return err
		}
		if err := settle(want); err != nil {
			return err
		}
		for range n {
			ip, took, err := add()
			if err != nil {
				return err
			}
			if !want.Contains(ip) {
				return fmt.Errorf("ADD with rules=%v got %s, outside %s", with, ip, want)
			}
			if with {
				five = append(five, took)
			} else {
				none = append(none, took)
			}
		}
	}
	r := row{Figure: "plugin ADD p50, five selection rules in place", Leasehold: ms(five.pct(50)), Peer: ms(none.pct(50)),
		hasPeer: true, Unit: "ms", PeerName: "no rules, interleaved", Target: "<= 1.05x no rules"}
	q, _ := r.ratio()
	r.judge(q <= 1.05)
	res.add(r)
	res.note("Rules: %d sequential plugin ADDs per round through the plugin binary against a leaseholdd process, 4 rounds "+
		"alternating no rule and five rules (three namespace rules, two node rules, one matching the node's label); p90 "+
		"with rules %.2f ms, without %.2f ms.", n, ms(five.pct(90)), ms(none.pct(90)))
	progress("rules: ADD p50 with five rules %.2f ms, without %.2f ms", ms(five.pct(50)), ms(none.pct(50)))
	return nil
}

func writeRules(ctx context.Context, cli *clientv3.Client) error {
	for ns, pools := range map[string][]string{"bench": {"rules-b", rulesNetwork}, "other-1": {"rules-c"}, "other-2": {"rules-d"}} {
		if err := admin.SetNamespaceRule(ctx, cli, rulesCluster, rulesNetwork, ns, keyspace.NamespaceRule{Pools: pools}); err != nil {
			return fmt.Errorf("namespace rule %s: %w", ns, err)
		}
	}
	for name, rule := range map[string]keyspace.NodeRule{
		"rack-r1": {Labels: map[string]string{"rack": "r1"}, Pools: []string{"rules-b", "rules-e"}, Order: 10},
		"rack-r2": {Labels: map[string]string{"rack": "r2"}, Pools: []string{"rules-f"}, Order: 20},
	} {
		if err := admin.SetNodeRule(ctx, cli, rulesCluster, rulesNetwork, name, rule); err != nil {
			return fmt.Errorf("node rule %s: %w", name, err)
		}
	}
	return nil
}

func deleteRules(ctx context.Context, cli *clientv3.Client) error {
	for _, ns := range []string{"bench", "other-1", "other-2"} {
		if _, err := admin.DeleteRule(ctx, cli, rulesCluster, rulesNetwork, keyspace.RuleNamespace, ns); err != nil {
			return err
		}
	}
	for _, name := range []string{"rack-r1", "rack-r2"} {
		if _, err := admin.DeleteRule(ctx, cli, rulesCluster, rulesNetwork, keyspace.RuleNode, name); err != nil {
			return err
		}
	}
	return nil
}
