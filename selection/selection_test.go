package selection

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// TestPrecedenceAndFilters walks the precedence (the pod's request, its namespace's rule,
// its node's rules, the network configuration) and each reason a pool of the list is passed
// over, per address family: every family from the pools that have all, or, when a pool lacks
// one, each family from the pools that have it (split); a pool lacking the one family of a
// network is unused.
func TestPrecedenceAndFilters(t *testing.T) {
	pools := map[string]Pool{
		"net":        {Families: []int{4, 6}},
		"tenant-a":   {Families: []int{4}, Namespaces: []string{"a"}},
		"tenant-a6":  {Families: []int{6}, Namespaces: []string{"a"}},
		"shared":     {Families: []int{4, 6}},
		"rack1":      {Families: []int{4}},
		"rack2":      {Families: []int{4}},
		"zone-a":     {Families: []int{4, 6}},
		"draining":   {Families: []int{4}, Closed: true},
		"a-on-rack1": {Families: []int{4}},
		"s4a":        {Families: []int{4}},
		"s4b":        {Families: []int{4}},
		"s6":         {Families: []int{6}},
	}
	rules := Rules{
		Namespaces: map[string]keyspace.NamespaceRule{
			"a":     {Pools: []string{"draining", "tenant-a", "a-on-rack1", "tenant-a6", "shared"}},
			"b":     {Pools: []string{"tenant-a", "shared"}},
			"empty": {Pools: []string{"draining"}},
			"split": {Pools: []string{"s4a", "s6", "draining", "s4b"}},
		},
		Nodes: map[string]keyspace.NodeRule{
			"racks-1":  {Names: []string{"rack1-*"}, Pools: []string{"rack1", "a-on-rack1"}, Order: 20},
			"racks-2":  {Names: []string{"rack2-*"}, Pools: []string{"rack2"}},
			"zone":     {Labels: map[string]string{"zone": "a"}, Pools: []string{"zone-a"}, Order: 10},
			"zone-and": {Names: []string{"rack9-*"}, Labels: map[string]string{"zone": "a"}, Pools: []string{"zone-a"}},
		},
	}
	rack1 := Node{Name: "rack1-n3", Labels: map[string]string{"zone": "a"}}
	rack2 := Node{Name: "rack2-n1"}
	dual := []int{4, 6}
	for _, tt := range []struct {
		name       string
		node       Node
		pod        Pod
		families   []int
		source     string
		perFamily  map[int][]string
		split      bool
		passed     []Passed
		unused     []Passed
		errHas     []string
		invalidCfg bool
	}{
		{name: "no rule: the network configuration's pool", node: Node{Name: "other"}, pod: Pod{Namespace: "c"}, families: dual,
			source: "the network configuration", perFamily: map[int][]string{4: {"net"}, 6: {"net"}}},
		{name: "node rules by order then name, pools once", node: rack1, pod: Pod{Namespace: "c"}, families: []int{4},
			source: "node rules zone, racks-1", perFamily: map[int][]string{4: {"zone-a", "rack1", "a-on-rack1"}}},
		{name: "a label and a name must both match", node: Node{Name: "rack9-x"}, pod: Pod{Namespace: "c"}, families: dual,
			source: "the network configuration", perFamily: map[int][]string{4: {"net"}, 6: {"net"}}},
		{name: "namespace rule beats node rules; a mixed list per family; pools given to other nodes and closed ones passed over",
			node: rack2, pod: Pod{Namespace: "a"}, families: dual, source: "namespace rule a",
			perFamily: map[int][]string{4: {"tenant-a", "shared"}, 6: {"tenant-a6", "shared"}}, split: true,
			passed: []Passed{{"draining", "closed"}, {"a-on-rack1", "given to the nodes of rules racks-1"}}},
		{name: "namespace rule combined with the node's rack", node: rack1, pod: Pod{Namespace: "a"}, families: []int{4},
			source: "namespace rule a", perFamily: map[int][]string{4: {"tenant-a", "a-on-rack1", "shared"}},
			passed: []Passed{{"draining", "closed"}},
			unused: []Passed{{"tenant-a6", "has no IPv4 range set, and pools tenant-a, a-on-rack1, shared of the list have every " +
				"family the network needs"}}},
		{name: "a rule of single-family pools: each family from its own", node: rack2, pod: Pod{Namespace: "split"}, families: dual,
			source: "namespace rule split", perFamily: map[int][]string{4: {"s4a", "s4b"}, 6: {"s6"}}, split: true,
			passed: []Passed{{"draining", "closed"}}},
		{name: "a rule naming a pool locked to another namespace passes it over", node: rack2, pod: Pod{Namespace: "b"},
			families: dual, source: "namespace rule b", perFamily: map[int][]string{4: {"shared"}, 6: {"shared"}},
			passed: []Passed{{"tenant-a", "locked to namespaces a"}}},
		{name: "the pod's request beats its namespace's rule", node: rack2, pod: Pod{Namespace: "a", Asked: []string{"shared"}},
			families: dual, source: "the pod's request", perFamily: map[int][]string{4: {"shared"}, 6: {"shared"}}},
		{name: "a pod asks for a pool its namespace's rule does not give", node: rack2,
			pod: Pod{Namespace: "a", Name: "p", Asked: []string{"rack2"}}, families: []int{4}, invalidCfg: true,
			errHas: []string{`pool "rack2"`, `namespace "a" may use only pools`, "a/p"}},
		{name: "a pod asks for another tenant's pool", node: rack2, pod: Pod{Namespace: "c", Name: "p", Asked: []string{"tenant-a"}},
			families: []int{4}, invalidCfg: true, errHas: []string{`pool "tenant-a"`, "locked to namespaces a", `not "c"`}},
		{name: "a pod asks for a pool that does not exist", node: rack2, pod: Pod{Namespace: "c", Name: "p", Asked: []string{"nope"}},
			families: []int{4}, invalidCfg: true, errHas: []string{`pool "nope"`, "does not exist"}},
		{name: "a rule that leaves a family without a pool says so", node: rack2, pod: Pod{Namespace: "empty", Name: "p"},
			families: []int{4}, invalidCfg: true,
			errHas: []string{"no pool gives pod empty/p an IPv4 address", "namespace rule empty", "draining (closed)"}},
		{name: "a family no pool of the list has", node: rack2, pod: Pod{Namespace: "c", Asked: []string{"rack2"}},
			families: dual, invalidCfg: true, errHas: []string{"IPv6", "the pod's request names rack2"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Choose(rules, pools, tt.node, tt.pod, "net", tt.families)
			if tt.invalidCfg {
				if !errors.Is(err, allocator.ErrInvalidConfig) {
					t.Fatalf("want ErrInvalidConfig, got %v (choice %+v)", err, c)
				}
				for _, s := range tt.errHas {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not say %q", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Source != tt.source {
				t.Errorf("source %q, want %q", c.Source, tt.source)
			}
			if !reflect.DeepEqual(c.PerFamily, tt.perFamily) {
				t.Errorf("per family %v, want %v", c.PerFamily, tt.perFamily)
			}
			if !reflect.DeepEqual(c.Passed, tt.passed) {
				t.Errorf("passed over %v, want %v", c.Passed, tt.passed)
			}
			if c.Split != tt.split || !reflect.DeepEqual(c.Unused, tt.unused) {
				t.Errorf("split %v, unused %v; want %v, %v", c.Split, c.Unused, tt.split, tt.unused)
			}
		})
	}
}

// TestAnUnstoredPoolIsOnlyTheConfigurations: the network configuration's pool may not be
// stored yet (its first ADD stores it), but a pod may not name a pool nobody defined.
func TestAnUnstoredPoolIsOnlyTheConfigurations(t *testing.T) {
	pools := map[string]Pool{"net": {Families: []int{4}, Unstored: true}, "other": {Families: []int{4}, Unstored: true}}
	c, err := Choose(Rules{}, pools, Node{Name: "n"}, Pod{Namespace: "a", Asked: []string{"net"}}, "net", []int{4})
	if err != nil || !reflect.DeepEqual(c.Pools, []string{"net"}) {
		t.Fatalf("asking for the configuration's own unstored pool: %v, %v", c, err)
	}
	if _, err := Choose(Rules{}, pools, Node{Name: "n"}, Pod{Namespace: "a", Asked: []string{"other"}}, "net", []int{4}); !errors.Is(err, allocator.ErrInvalidConfig) {
		t.Fatalf("asking for an unstored pool that is not the configuration's: want ErrInvalidConfig, got %v", err)
	}
}
