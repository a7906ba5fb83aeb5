package keyspace

import (
	"fmt"
	"path"
	"slices"
	"strings"

	"github.com/leasehold/leasehold/allocator"
)

// Selection rules say which pools an ADD tries, in order (package selection). They are
// per cluster, whose namespaces they name, and per CNI network, so that a secondary network
// keeps its own pools. Admins write them with `leaseholdctl selection`; every agent follows
// its cluster's with one watch.
const selectionDir = Prefix + "selection/"

// Kinds of selection rule, the path component after the network.
const (
	RuleNamespace = "namespaces"
	RuleNode      = "nodes"
)

// SelectionPrefix is the prefix of cluster's selection rules; with network, of one network's;
// with neither, of every cluster's.
func SelectionPrefix(cluster, network string) string {
	switch {
	case cluster == "":
		return selectionDir
	case network == "":
		return selectionDir + cluster + "/"
	}
	return selectionDir + cluster + "/" + network + "/"
}

// NamespaceRuleKey is /leasehold/v1/selection/<cluster>/<network>/namespaces/<namespace>:
// the pools of the namespace's pods on network, in order (NamespaceRule).
func NamespaceRuleKey(cluster, network, namespace string) string {
	return SelectionPrefix(cluster, network) + RuleNamespace + "/" + namespace
}

// NodeRuleKey is /leasehold/v1/selection/<cluster>/<network>/nodes/<rule>: the pools of
// the nodes the rule matches (NodeRule).
func NodeRuleKey(cluster, network, rule string) string {
	return SelectionPrefix(cluster, network) + RuleNode + "/" + rule
}

// ParseSelectionKey splits a selection rule key into its parts; kind is RuleNamespace or
// RuleNode, name the namespace or the node rule's name.
func ParseSelectionKey(key string) (cluster, network, kind, name string, err error) {
	parts := strings.Split(strings.TrimPrefix(key, selectionDir), "/")
	if !strings.HasPrefix(key, selectionDir) || len(parts) != 4 || (parts[2] != RuleNamespace && parts[2] != RuleNode) {
		return "", "", "", "", fmt.Errorf("key %q: want %s<cluster>/<network>/{%s,%s}/<name>", key, selectionDir, RuleNamespace, RuleNode)
	}
	if err := ValidateNames("cluster", parts[0], "network", parts[1], "rule", parts[3]); err != nil {
		return "", "", "", "", fmt.Errorf("key %q: %w", key, err)
	}
	return parts[0], parts[1], parts[2], parts[3], nil
}

// NamespaceRule is the value of a namespace's selection rule: the pools its pods get their
// addresses from, tried in order per address family.
type NamespaceRule struct {
	Pools []string `json:"pools"`
}

// NodeRule is the value of a node selection rule: the pools of the nodes it matches, tried
// in order per address family. A node matches when its name matches one of Names (shell
// patterns, path.Match), if any, and its labels include every one of Labels, if any. A pool
// a node rule names serves only the nodes some rule naming it matches.
type NodeRule struct {
	Names  []string          `json:"names,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
	Pools  []string          `json:"pools"`
	// Order sorts the rules a node matches: lower first, then by name.
	Order int `json:"order,omitempty"`
}

// Matches tells whether the rule applies to the node named name with labels.
func (r NodeRule) Matches(name string, labels map[string]string) bool {
	if len(r.Names) > 0 && !slices.ContainsFunc(r.Names, func(p string) bool { ok, _ := path.Match(p, name); return ok }) {
		return false
	}
	for k, v := range r.Labels {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// ValidatePools checks a rule's list of pools: at least one, each a valid name, none twice.
// Whether each exists is the writer's check (admin), made against etcd.
func ValidatePools(pools []string) error {
	if len(pools) == 0 {
		return fmt.Errorf("%w: the rule names no pool; give at least one", allocator.ErrInvalidConfig)
	}
	for i, p := range pools {
		if err := allocator.ValidateName("pool", p); err != nil {
			return err
		}
		if slices.Contains(pools[:i], p) {
			return fmt.Errorf("%w: the rule names pool %q twice; name each pool once, in the order to try them",
				allocator.ErrInvalidConfig, p)
		}
	}
	return nil
}

// Validate checks a node rule: a match (names or labels), valid patterns and labels, pools.
func (r NodeRule) Validate() error {
	if len(r.Names) == 0 && len(r.Labels) == 0 {
		return fmt.Errorf("%w: a node rule needs a match: node name patterns, labels, or both", allocator.ErrInvalidConfig)
	}
	for _, p := range r.Names {
		if _, err := path.Match(p, ""); err != nil || p == "" {
			return fmt.Errorf("%w: node name pattern %q is not a shell pattern (such as rack1-*)", allocator.ErrInvalidConfig, p)
		}
	}
	for k, v := range r.Labels {
		if k == "" || strings.ContainsAny(k, "=,") || strings.ContainsAny(v, ",") {
			return fmt.Errorf("%w: node label %q=%q: a label is key=value, the key non-empty and neither with a comma",
				allocator.ErrInvalidConfig, k, v)
		}
	}
	return ValidatePools(r.Pools)
}

// Rule is one stored selection rule, decoded: a namespace's or a node rule's pools.
type Rule struct {
	Cluster, Network string
	// Kind is RuleNamespace or RuleNode; Name the namespace or the node rule's name.
	Kind, Name string
	Pools      []string
	// Node is the node rule (its match and order); nil for a namespace's rule.
	Node *NodeRule `json:",omitempty"`
}

// DecodeRule reads the selection rule stored at key. A rule that does not decode or does not
// validate is an error naming the key: readers pass it over (an agent keeps its ADDs on the
// other rules), and leaseholdctl shows it.
func DecodeRule(key string, value []byte) (Rule, error) {
	var r Rule
	var err error
	if r.Cluster, r.Network, r.Kind, r.Name, err = ParseSelectionKey(key); err != nil {
		return r, err
	}
	if r.Kind == RuleNamespace {
		ns, err := Decode[NamespaceRule](key, value)
		r.Pools = ns.Pools
		if err == nil {
			err = ValidatePools(ns.Pools)
		}
		return r, ruleError(key, err)
	}
	node, err := Decode[NodeRule](key, value)
	r.Pools, r.Node = node.Pools, &node
	if err == nil {
		err = node.Validate()
	}
	return r, ruleError(key, err)
}

func ruleError(key string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("selection rule %s: %w; fix it with leaseholdctl selection set-*, or delete it", key, err)
}
