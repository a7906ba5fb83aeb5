package admin

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/selection"
)

// The doctor's checks of selection rules (docs/proposals/pool-selection.md). Selection runs
// only when an attachment is made: a rule changed, or a pool locked, since then never moves a
// running pod, so a pod in a pool its rules no longer give is information, not a problem.

// ruleDeleteFix is the leaseholdctl command that deletes rule r.
func ruleDeleteFix(r keyspace.Rule) string {
	kind := "node"
	if r.Kind == keyspace.RuleNamespace {
		kind = "namespace"
	}
	return "leaseholdctl selection delete-" + kind + " " + ShellQuote(r.Name) + " --cluster " + ShellQuote(r.Cluster) +
		" --network " + ShellQuote(r.Network)
}

// selectionRules reports the unreadable rules, which agents pass over, and each attachment
// whose pool a new ADD of its pod would not get now (outsideSelection).
func (c *checker) selectionRules() {
	if !c.st.Covers(keyspace.SelectionPrefix("", "")) {
		return
	}
	type scope struct{ cluster, network string }
	rules := map[scope][]keyspace.Rule{}
	for _, r := range c.st.Rules {
		if r.Unreadable != "" {
			c.note(SeverityWarning, KindUnreadable, r.Cluster, fmt.Sprintf("selection rule is unreadable (%s): every agent passes "+
				"it over, so the pods it names get their pools from the other rules or the network configuration. Write it "+
				"again (leaseholdctl selection set-%s) or delete it", r.Unreadable, strings.TrimSuffix(r.Kind, "s")),
				ruleDeleteFix(r.Rule), r.Key)
			continue
		}
		k := scope{r.Cluster, r.Network}
		rules[k] = append(rules[k], r.Rule)
	}
	for i := range c.st.Owners {
		o := &c.st.Owners[i]
		pk := keyspace.PodKey(o.Cluster, o.Value.Node, o.Owner)
		pod, p := c.pods[pk], c.pools[o.Pool]
		if o.Unreadable != "" || pod == nil || pod.Unreadable != "" || !p.Usable() || !c.st.Covers(keyspace.PoolKey(o.Pool)) {
			continue // the namespace or the pool is unknown; other findings tell of it
		}
		ns := pod.Value.Pod.Namespace
		rs := selection.Gather(rules[scope{o.Cluster, o.Value.Network}], o.Cluster, o.Value.Network)
		why := outsideSelection(rs, o.Pool, p.Access, o.Value.Node, ns)
		if why == "" {
			continue
		}
		c.note(SeverityInfo, KindOutsideSelection, o.Cluster, fmt.Sprintf("pod %s (owner %s, interface %s, network %s, node %s) "+
			"holds %s in pool %s, which a new ADD of it would not get now: %s. It keeps them: selection runs only when an "+
			"attachment is made, and a rule changed since never moves a running pod; DEL, CHECK and re-claim find it in %s. "+
			"Its next incarnation gets a pool its rules give (leaseholdctl selection explain). Nothing to do",
			podName(pod.Value.Pod), o.Owner, dash(o.IfName), dash(o.Value.Network), dash(o.Value.Node), ipsText(o.Value.IPs),
			o.Pool, why, o.Pool), "", o.Key)
	}
}

// outsideSelection says why pool is not one that an ADD of a pod of namespace ns on node
// would get now by rules (one network's) and the pool's access, or "" when it may be, or when
// doctor cannot tell. It judges what it can without what only the ADD knew: a node's labels
// (a rule matching by label may match), and the pools the pod asked for (a request is not
// recorded; it counts only where the rules leave the pod no choice). A closed pool is not
// reported: closing drains a pool, and its pods are its allocations (leaseholdctl pool show).
func outsideSelection(rules selection.Rules, pool string, access keyspace.PoolAccess, node, ns string) string {
	if len(access.Namespaces) > 0 && !slices.Contains(access.Namespaces, ns) {
		return fmt.Sprintf("pool %s is locked to namespaces %s (leaseholdctl pool lock)", pool, strings.Join(access.Namespaces, ", "))
	}
	nsRule, hasNSRule := rules.Namespaces[ns]
	if hasNSRule && !slices.Contains(nsRule.Pools, pool) {
		return fmt.Sprintf("the selection rule of namespace %s gives pools %s, and a pod may ask only for those", ns,
			strings.Join(nsRule.Pools, ", "))
	}
	var naming, matched []string // node rules naming the pool; node rules surely matching node
	here := false                // a rule naming the pool matches node, or may
	for _, name := range slices.Sorted(maps.Keys(rules.Nodes)) {
		r := rules.Nodes[name]
		sure, may := nodeRuleMatches(r, node)
		if sure {
			matched = append(matched, name)
		}
		if slices.Contains(r.Pools, pool) {
			naming = append(naming, name)
			here = here || may
		}
	}
	switch {
	case len(naming) > 0 && !here:
		return fmt.Sprintf("pool %s serves only the nodes of node rules %s, and node %s matches none", pool,
			strings.Join(naming, ", "), dash(node))
	case !hasNSRule && len(matched) > 0 && !here:
		return fmt.Sprintf("node %s matches node rules %s, which do not name pool %s (unless the pod asked for it: "+
			"LEASEHOLD_POOL or args.cni.pool, which etcd does not record)", dash(node), strings.Join(matched, ", "), pool)
	}
	return ""
}

// nodeRuleMatches tells whether r surely matches the node named node, and whether it may:
// doctor knows a node's name, not the labels its agent was given (--node-label), so a rule
// with labels may match any node its name patterns allow.
func nodeRuleMatches(r keyspace.NodeRule, node string) (sure, may bool) {
	if !(keyspace.NodeRule{Names: r.Names}).Matches(node, nil) {
		return false, false
	}
	return len(r.Labels) == 0, true
}
