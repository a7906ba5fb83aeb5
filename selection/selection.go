// Package selection decides which pools an ADD tries, in order, for each address family:
// from the pod's request, its namespace's rule, its node's rules or the network
// configuration's pool, the first that gives any (docs/proposals/pool-selection.md). It is
// pure: the agent hands it the rules and pools it follows, leaseholdctl the ones it read, so
// that `selection explain` says exactly what an ADD would do.
//
// Selection runs only when an attachment is made. Nothing that comes after (DEL, CHECK, GC,
// re-claim, sticky claims, import) asks it: they find an attachment in the pool it was
// allocated from, whatever the rules say now.
package selection

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Rules are one network's selection rules in one cluster, as stored.
type Rules struct {
	Namespaces map[string]keyspace.NamespaceRule // by namespace
	Nodes      map[string]keyspace.NodeRule      // by rule name
}

// Gather collects the rules of one cluster's network, from rules as stored (readable ones).
func Gather(rules []keyspace.Rule, cluster, network string) Rules {
	out := Rules{Namespaces: map[string]keyspace.NamespaceRule{}, Nodes: map[string]keyspace.NodeRule{}}
	for _, r := range rules {
		switch {
		case r.Cluster != cluster || r.Network != network:
		case r.Kind == keyspace.RuleNamespace:
			out.Namespaces[r.Name] = keyspace.NamespaceRule{Pools: r.Pools}
		case r.Node != nil:
			out.Nodes[r.Name] = *r.Node
		}
	}
	return out
}

// Node is the node the ADD runs on: its name and the labels the agent was given at start.
type Node struct {
	Name   string
	Labels map[string]string
}

// Pod is what the ADD says about the pod: its namespace, and the pools it asks for
// (LEASEHOLD_POOL, args.cni.pool), in order.
type Pod struct {
	Namespace, Name string
	Asked           []string
}

// Pool is what selection needs to know of a pool.
type Pool struct {
	// Families are the address families of its range sets (4, 6).
	Families []int
	// Closed and Namespaces are the pool record's (keyspace.PoolRecord).
	Closed     bool
	Namespaces []string
	// Unstored: the network configuration defines the pool and no agent stored it yet (the
	// ADD stores it); only the configuration's own pool may be unstored.
	Unstored bool
}

// PoolOf is what selection needs of a stored pool: its families and its access.
func PoolOf(spec allocator.PoolSpec, access keyspace.PoolAccess) Pool {
	p := Pool{Closed: access.Closed, Namespaces: access.Namespaces}
	for _, set := range spec.Ranges {
		if f := set.Family(); f != 0 && !slices.Contains(p.Families, f) {
			p.Families = append(p.Families, f)
		}
	}
	return p
}

// Choice is the pools an ADD tries and why.
type Choice struct {
	// Source says where the list comes from: "the pod's request", "namespace rule <ns>",
	// "node rules <a>, <b>" or "the network configuration".
	Source string
	// Pools are the pools of the list the ADD may use, in order; PerFamily, for each family
	// the network needs, the pools of Pools that have it, in order: the pools the ADD tries
	// for it.
	Pools     []string
	PerFamily map[int][]string
	// Split: the network needs several families and a pool of Pools lacks one, so each
	// family comes from the first pool of its own list with a free address: a pool first
	// in several lists gives those families in one attachment, and the interface gets an
	// attachment in each pool, all claimed in one transaction. Otherwise every pool of
	// Pools gives every family, tried pool by pool.
	Split bool
	// Passed are the pools of the list passed over, each with why.
	Passed []Passed
	// Unused are the pools of Pools that lack the one family the network needs.
	Unused []Passed
}

// Passed is a pool of the list that the ADD may not use, and why.
type Passed struct {
	Pool, Why string
}

func (p Passed) String() string { return p.Pool + " (" + p.Why + ")" }

// Choose returns the pools an ADD of pod on node tries, for network configuration pool
// dflt whose range sets are of families. pools holds every pool the rules or the pod may
// name (dflt among them). A pod asking for a pool that does not exist, or that its namespace
// may not use, is refused, as is a list that leaves a family without a pool: the errors wrap
// allocator.ErrInvalidConfig (CNI code 7) and name the pool, the namespace and the rule.
func Choose(rules Rules, pools map[string]Pool, node Node, pod Pod, dflt string, families []int) (Choice, error) {
	var c Choice
	var list []string
	nsRule, hasNSRule := rules.Namespaces[pod.Namespace]
	switch {
	case len(pod.Asked) > 0:
		c.Source = "the pod's request"
		for _, name := range pod.Asked {
			p, ok := pools[name]
			if !ok || p.Unstored && name != dflt {
				return Choice{}, fmt.Errorf("%w: pod %s asks for pool %q, which does not exist; ask for one of the pools "+
					"its namespace may use (leaseholdctl selection explain --namespace %s)", allocator.ErrInvalidConfig,
					podName(pod), name, pod.Namespace)
			}
			if !allowsNamespace(p, pod.Namespace) {
				return Choice{}, fmt.Errorf("%w: pod %s asks for pool %q, which is locked to namespaces %s, not %q",
					allocator.ErrInvalidConfig, podName(pod), name, strings.Join(p.Namespaces, ", "), pod.Namespace)
			}
			if hasNSRule && !slices.Contains(nsRule.Pools, name) {
				return Choice{}, fmt.Errorf("%w: pod %s asks for pool %q, but namespace %q may use only pools %s "+
					"(its selection rule)", allocator.ErrInvalidConfig, podName(pod), name, pod.Namespace,
					strings.Join(nsRule.Pools, ", "))
			}
		}
		list = pod.Asked
	case hasNSRule:
		c.Source = "namespace rule " + pod.Namespace
		list = nsRule.Pools
	default:
		matched := nodeRules(rules, node)
		for _, r := range matched {
			for _, p := range rules.Nodes[r].Pools {
				if !slices.Contains(list, p) {
					list = append(list, p)
				}
			}
		}
		if len(list) > 0 {
			c.Source = "node rules " + strings.Join(matched, ", ")
		} else {
			c.Source, list = "the network configuration", []string{dflt}
		}
	}
	served := servedBy(rules)
	for _, name := range list {
		if why := passOver(name, pools, served, rules, node, pod.Namespace); why != "" {
			c.Passed = append(c.Passed, Passed{Pool: name, Why: why})
			continue
		}
		c.Pools = append(c.Pools, name)
	}
	c.PerFamily = make(map[int][]string, len(families))
	for _, f := range families {
		for _, name := range c.Pools {
			if slices.Contains(pools[name].Families, f) {
				c.PerFamily[f] = append(c.PerFamily[f], name)
			}
		}
		if len(c.PerFamily[f]) == 0 {
			return Choice{}, c.noPool(f, pod, list)
		}
	}
	var whole []string
	for _, name := range c.Pools {
		if lacks := lacking(pools[name], families); len(lacks) == 0 {
			whole = append(whole, name)
		}
	}
	if len(families) > 1 && len(whole) < len(c.Pools) {
		c.Split = true
		return c, nil
	}
	others := "pools " + strings.Join(whole, ", ") + " of the list have"
	if len(whole) == 1 {
		others = "pool " + whole[0] + " of the list has"
	}
	for _, name := range c.Pools {
		if lacks := lacking(pools[name], families); len(lacks) > 0 {
			c.Unused = append(c.Unused, Passed{Pool: name, Why: "has no " + strings.Join(lacks, " or ") + " range set, and " +
				others + " every family the network needs"})
		}
	}
	return c, nil
}

// lacking are the families of families ("IPv4", "IPv6") pool p has no range set of.
func lacking(p Pool, families []int) []string {
	var out []string
	for _, f := range families {
		if !slices.Contains(p.Families, f) {
			out = append(out, fmt.Sprintf("IPv%d", f))
		}
	}
	return out
}

// noPool is the error of a list that leaves family f without a pool.
func (c Choice) noPool(f int, pod Pod, list []string) error {
	var why []string
	for _, p := range c.Passed {
		why = append(why, p.String())
	}
	msg := fmt.Sprintf("no pool gives pod %s an IPv%d address: %s names %s", podName(pod), f, c.Source,
		strings.Join(list, ", "))
	if len(why) > 0 {
		msg += "; passed over: " + strings.Join(why, ", ")
	}
	return fmt.Errorf("%w: %s; give the rule a pool of that family, or open one (leaseholdctl selection explain)",
		allocator.ErrInvalidConfig, msg)
}

// passOver says why the ADD may not use pool name, or "" when it may.
func passOver(name string, pools map[string]Pool, served map[string][]string, rules Rules, node Node, ns string) string {
	p, ok := pools[name]
	switch {
	case !ok:
		return "does not exist"
	case p.Closed:
		return "closed"
	case !allowsNamespace(p, ns):
		return "locked to namespaces " + strings.Join(p.Namespaces, ", ")
	}
	if by := served[name]; len(by) > 0 && !slices.ContainsFunc(by, func(r string) bool {
		return rules.Nodes[r].Matches(node.Name, node.Labels)
	}) {
		return "given to the nodes of rules " + strings.Join(by, ", ")
	}
	return ""
}

func allowsNamespace(p Pool, ns string) bool {
	return len(p.Namespaces) == 0 || slices.Contains(p.Namespaces, ns)
}

// nodeRules are the names of the node rules that match node, lowest Order first, then by name.
func nodeRules(rules Rules, node Node) []string {
	var out []string
	for name, r := range rules.Nodes {
		if r.Matches(node.Name, node.Labels) {
			out = append(out, name)
		}
	}
	slices.SortFunc(out, func(a, b string) int {
		return cmp.Or(cmp.Compare(rules.Nodes[a].Order, rules.Nodes[b].Order), cmp.Compare(a, b))
	})
	return out
}

// servedBy maps each pool a node rule names to the rules naming it, sorted: such a pool
// serves only the nodes one of them matches.
func servedBy(rules Rules) map[string][]string {
	out := map[string][]string{}
	for name, r := range rules.Nodes {
		for _, p := range r.Pools {
			out[p] = append(out[p], name)
		}
	}
	for _, rs := range out {
		slices.Sort(rs)
	}
	return out
}

func podName(p Pod) string {
	if p.Name == "" {
		return "of namespace " + p.Namespace
	}
	return p.Namespace + "/" + p.Name
}
