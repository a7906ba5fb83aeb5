package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/selection"
)

// Selection rules (docs/proposals/pool-selection.md): which pools a namespace's or a node's
// pods get their addresses from, in order, and who may use a pool.

// ruleScope checks --cluster and --network, which every rule command needs: a rule is one
// cluster's (its namespaces) and one network's.
func ruleScope(e *env) (cluster, network string, err error) {
	if e.cluster == "" || e.network == "" {
		return "", "", usagef("selection rules are per cluster and network: give --cluster C and --network N (the CNI network name)")
	}
	if err := allocator.ValidateName("network", e.network); err != nil {
		return "", "", usageError{err.Error()}
	}
	return e.cluster, e.network, nil
}

// labelsFlag parses --labels k=v,k2=v2.
func labelsFlag(values []string) (map[string]string, error) {
	var out map[string]string
	for _, v := range values {
		k, val, ok := strings.Cut(v, "=")
		if !ok || k == "" {
			return nil, usagef("--labels %q: want KEY=VALUE, comma-separated", v)
		}
		if out == nil {
			out = map[string]string{}
		}
		out[k] = val
	}
	return out, nil
}

func selectionSetNamespace(ctx context.Context, e *env) error {
	cluster, network, err := ruleScope(e)
	if err != nil {
		return err
	}
	ns := e.args[0]
	if err := admin.SetNamespaceRule(ctx, e.cli, cluster, network, ns, keyspace.NamespaceRule{Pools: e.pools}); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "pods of namespace %s on network %s of cluster %s get their addresses from pools %s, in that order "+
		"(every agent follows from its next ADD)\n", ns, network, cluster, strings.Join(e.pools, ", "))
	return nil
}

func selectionSetNode(ctx context.Context, e *env) error {
	cluster, network, err := ruleScope(e)
	if err != nil {
		return err
	}
	labels, err := labelsFlag(e.labels)
	if err != nil {
		return err
	}
	rule := keyspace.NodeRule{Names: e.names, Labels: labels, Pools: e.pools, Order: e.order}
	if err := admin.SetNodeRule(ctx, e.cli, cluster, network, e.args[0], rule); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "nodes matching rule %s (%s) on network %s of cluster %s get pools %s, in that order; those pools "+
		"serve only nodes a rule naming them matches\n", e.args[0], matchText(rule), network, cluster, strings.Join(e.pools, ", "))
	return nil
}

func selectionDelete(kind string) func(context.Context, *env) error {
	return func(ctx context.Context, e *env) error {
		cluster, network, err := ruleScope(e)
		if err != nil {
			return err
		}
		deleted, err := admin.DeleteRule(ctx, e.cli, cluster, network, kind, e.args[0])
		if err != nil {
			return err
		}
		if !deleted {
			fmt.Fprintf(e.stdout, "no %s rule %s on network %s of cluster %s: nothing to delete\n", kind, e.args[0], network, cluster)
			return nil
		}
		fmt.Fprintf(e.stdout, "deleted the %s rule %s on network %s of cluster %s\n", kind, e.args[0], network, cluster)
		return nil
	}
}

func matchText(r keyspace.NodeRule) string {
	var parts []string
	if len(r.Names) > 0 {
		parts = append(parts, "names "+strings.Join(r.Names, ","))
	}
	if len(r.Labels) > 0 {
		var ls []string
		for _, k := range slices.Sorted(maps.Keys(r.Labels)) {
			ls = append(ls, k+"="+r.Labels[k])
		}
		parts = append(parts, "labels "+strings.Join(ls, ","))
	}
	return strings.Join(parts, ", ")
}

func selectionList(ctx context.Context, e *env) error {
	rules, err := admin.ListRules(ctx, e.cli, e.cluster)
	if err != nil {
		return err
	}
	if e.network != "" {
		rules = slices.DeleteFunc(rules, func(r admin.RuleEntry) bool { return r.Network != e.network })
	}
	if e.output == "json" {
		return writeJSON(e.stdout, rules)
	}
	t := newTable(e.stdout, "CLUSTER", "NETWORK", "KIND", "NAME", "POOLS", "MATCH", "ORDER")
	for _, r := range rules {
		match, order := "-", "-"
		if r.Node != nil {
			match, order = matchText(*r.Node), strconv.Itoa(r.Node.Order)
		}
		pools := strings.Join(r.Pools, ",")
		if r.Unreadable != "" {
			pools = "UNREADABLE: " + r.Unreadable + " (agents pass it over)"
		}
		t.row(r.Cluster, r.Network, strings.TrimSuffix(r.Kind, "s"), r.Name, pools, match, order)
	}
	return t.flush()
}

func selectionExplain(ctx context.Context, e *env) error {
	cluster, network, err := ruleScope(e)
	if err != nil {
		return err
	}
	if e.node == "" {
		return usagef("selection explain needs --node NAME (with --labels as the agent of that node is given)")
	}
	labels, err := labelsFlag(e.labels)
	if err != nil {
		return err
	}
	var families []int
	for _, f := range e.families {
		switch f {
		case "4", "6":
			families = append(families, int(f[0]-'0'))
		default:
			return usagef("--family %q: want 4, 6 or 4,6", f)
		}
	}
	dflt := e.pool
	if dflt == "" {
		dflt = network // a network configuration without a pool name uses the network's
	}
	c, err := admin.Explain(ctx, e.cli, cluster, network, dflt, families,
		selection.Node{Name: e.node, Labels: labels}, selection.Pod{Namespace: e.ns, Asked: e.ask})
	if e.output == "json" {
		out := struct {
			selection.Choice
			Error string `json:"error,omitempty"`
		}{Choice: c}
		if err != nil {
			out.Error = err.Error()
		}
		if werr := writeJSON(e.stdout, out); werr != nil {
			return werr
		}
		return err
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "from %s:\n", c.Source)
	t := newTable(e.stdout, "FAMILY", "POOLS, IN ORDER")
	for _, f := range slices.Sorted(maps.Keys(c.PerFamily)) {
		t.row("IPv"+strconv.Itoa(f), strings.Join(c.PerFamily[f], ", "))
	}
	if err := t.flush(); err != nil {
		return err
	}
	switch {
	case c.Split:
		fmt.Fprintln(e.stdout, "each family from its own pool: a pool of the list lacks a family the network needs, so each "+
			"family takes the first pool of its list with a free address (one first for both gives both in one attachment), "+
			"and the interface gets an attachment in each pool, all claimed in one transaction (all or none); a full pool "+
			"passes its family alone to the next")
	case len(c.PerFamily) > 1:
		fmt.Fprintln(e.stdout, "every family from one pool: the first of the list with a free address")
	}
	for _, p := range c.Passed {
		fmt.Fprintf(e.stdout, "passed over: %s\n", p)
	}
	for _, p := range c.Unused {
		fmt.Fprintf(e.stdout, "not used: %s\n", p)
	}
	return nil
}

func poolAccess(what string, set func(*keyspace.PoolAccess, *env)) func(context.Context, *env) error {
	return func(ctx context.Context, e *env) error {
		name, err := poolArg(e.args[0])
		if err != nil {
			return err
		}
		if what == "lock" && len(e.namespaces) == 0 {
			return usagef("pool lock needs --namespaces NS[,NS...]: the only namespaces that may use the pool (pool unlock opens it to all)")
		}
		_, now, changed, err := admin.SetPoolAccess(ctx, e.cli, name, func(a *keyspace.PoolAccess) { set(a, e) })
		if err != nil {
			return err
		}
		state := "open to new addresses"
		if now.Closed {
			state = "closed: no new address; its allocations stay, and re-claims and sticky claims still get theirs"
		}
		who := "any namespace"
		if len(now.Namespaces) > 0 {
			who = "only namespaces " + strings.Join(now.Namespaces, ", ")
		}
		if !changed {
			fmt.Fprintf(e.stdout, "pool %s was already so: %s, for %s\n", name, state, who)
			return nil
		}
		fmt.Fprintf(e.stdout, "pool %s is %s, for %s\n", name, state, who)
		return nil
	}
}

var (
	poolClose  = poolAccess("close", func(a *keyspace.PoolAccess, _ *env) { a.Closed = true })
	poolOpen   = poolAccess("open", func(a *keyspace.PoolAccess, _ *env) { a.Closed = false })
	poolLock   = poolAccess("lock", func(a *keyspace.PoolAccess, e *env) { a.Namespaces = e.namespaces })
	poolUnlock = poolAccess("unlock", func(a *keyspace.PoolAccess, _ *env) { a.Namespaces = nil })
)
