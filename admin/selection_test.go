package admin

import (
	"errors"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/selection"
)

// TestSelectionRulesAreCheckedWhenWritten: a rule naming a pool that does not exist, a node
// rule without a match and a bad name are refused, and etcd is unchanged; good rules list
// back as written, and a deleted one is gone.
func TestSelectionRulesAreCheckedWhenWritten(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	cluster, a, b := etcdtest.Uniq("c"), etcdtest.Uniq("sp"), etcdtest.Uniq("sp")
	for i, name := range []string{a, b} {
		if _, err := CreatePool(ctx, cli, adminPool(name, allocator.RangeSet{adminRange([]string{"10.70.0.0/24", "10.71.0.0/24"}[i])})); err != nil {
			t.Fatal(err)
		}
	}
	before := etcdtest.Dump(t, cli, keyspace.SelectionPrefix(cluster, ""))
	for _, tt := range []struct {
		name string
		set  func() error
		want error
		says string
	}{
		{"a pool that does not exist", func() error {
			return SetNamespaceRule(ctx, cli, cluster, "net", "ns1", keyspace.NamespaceRule{Pools: []string{a, "nope"}})
		}, ErrNotFound, "nope"},
		{"no pool", func() error { return SetNamespaceRule(ctx, cli, cluster, "net", "ns1", keyspace.NamespaceRule{}) },
			allocator.ErrInvalidConfig, "names no pool"},
		{"a pool twice", func() error {
			return SetNamespaceRule(ctx, cli, cluster, "net", "ns1", keyspace.NamespaceRule{Pools: []string{a, a}})
		}, allocator.ErrInvalidConfig, "twice"},
		{"a node rule without a match", func() error {
			return SetNodeRule(ctx, cli, cluster, "net", "r", keyspace.NodeRule{Pools: []string{a}})
		}, allocator.ErrInvalidConfig, "needs a match"},
		{"a bad pattern", func() error {
			return SetNodeRule(ctx, cli, cluster, "net", "r", keyspace.NodeRule{Names: []string{"rack["}, Pools: []string{a}})
		}, allocator.ErrInvalidConfig, "shell pattern"},
		{"a bad namespace name", func() error {
			return SetNamespaceRule(ctx, cli, cluster, "net", "../x", keyspace.NamespaceRule{Pools: []string{a}})
		}, allocator.ErrInvalidName, "namespace"},
	} {
		if err := tt.set(); !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.says) {
			t.Errorf("%s: want %v saying %q, got %v", tt.name, tt.want, tt.says, err)
		}
	}
	if after := etcdtest.Dump(t, cli, keyspace.SelectionPrefix(cluster, "")); !reflect.DeepEqual(before, after) {
		t.Fatalf("refused rules changed etcd: %v -> %v", before, after)
	}

	if err := SetNamespaceRule(ctx, cli, cluster, "net", "ns1", keyspace.NamespaceRule{Pools: []string{b, a}}); err != nil {
		t.Fatal(err)
	}
	node := keyspace.NodeRule{Names: []string{"rack1-*"}, Labels: map[string]string{"zone": "a"}, Pools: []string{a}, Order: 5}
	if err := SetNodeRule(ctx, cli, cluster, "net", "rack1", node); err != nil {
		t.Fatal(err)
	}
	rules, err := ListRules(ctx, cli, cluster)
	if err != nil {
		t.Fatal(err)
	}
	got := Rules(rules, cluster, "net")
	want := selection.Rules{Namespaces: map[string]keyspace.NamespaceRule{"ns1": {Pools: []string{b, a}}},
		Nodes: map[string]keyspace.NodeRule{"rack1": node}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("rules listed %+v, want %+v", got, want)
	}
	if del, err := DeleteRule(ctx, cli, cluster, "net", keyspace.RuleNode, "rack1"); err != nil || !del {
		t.Fatalf("delete: %v, %v", del, err)
	}
	if del, err := DeleteRule(ctx, cli, cluster, "net", keyspace.RuleNode, "rack1"); err != nil || del {
		t.Fatalf("delete again: want nothing deleted, got %v, %v", del, err)
	}
	if rules, _ := ListRules(ctx, cli, cluster); len(rules) != 1 || rules[0].Kind != keyspace.RuleNamespace {
		t.Fatalf("after delete: %+v", rules)
	}
}

// TestPoolAccessSurvivesDefinitionChanges: closing and locking a pool keep its definition,
// and adding a range keeps its access; setting what is already set writes nothing.
func TestPoolAccessSurvivesDefinitionChanges(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	name := etcdtest.Uniq("sp")
	if _, err := CreatePool(ctx, cli, adminPool(name, allocator.RangeSet{adminRange("10.72.0.0/24")})); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := SetPoolAccess(ctx, cli, etcdtest.Uniq("nope"), func(a *keyspace.PoolAccess) { a.Closed = true }); !errors.Is(err, ErrNotFound) {
		t.Fatalf("closing a pool that does not exist: want ErrNotFound, got %v", err)
	}
	_, now, changed, err := SetPoolAccess(ctx, cli, name, func(a *keyspace.PoolAccess) {
		a.Closed, a.Namespaces = true, []string{"b", "a", "b"}
	})
	if err != nil || !changed || !now.Closed || !reflect.DeepEqual(now.Namespaces, []string{"a", "b"}) {
		t.Fatalf("close and lock: %+v changed=%v err=%v", now, changed, err)
	}
	rev := mustPool(t, readState(t, cli), name).ModRevision
	if _, _, changed, err := SetPoolAccess(ctx, cli, name, func(a *keyspace.PoolAccess) { a.Closed = true }); err != nil || changed {
		t.Fatalf("closing a closed pool: want no change, got changed=%v err=%v", changed, err)
	}
	if _, err := AddRange(ctx, cli, name, 0, adminRange("10.72.1.0/24")); err != nil {
		t.Fatal(err)
	}
	p := mustPool(t, readState(t, cli), name)
	if p.ModRevision == rev || !p.Access.Closed || !reflect.DeepEqual(p.Access.Namespaces, []string{"a", "b"}) || len(p.Value.Ranges[0]) != 2 {
		t.Fatalf("after add-range: access %+v, ranges %v (revision %d, was %d)", p.Access, p.Value.Ranges, p.ModRevision, rev)
	}
	if _, now, _, err := SetPoolAccess(ctx, cli, name, func(a *keyspace.PoolAccess) { a.Closed, a.Namespaces = false, nil }); err != nil || now.Closed || now.Namespaces != nil {
		t.Fatalf("open and unlock: %+v, %v", now, err)
	}
}

// TestExplainSaysWhatAnAddWouldTry reads rules and pools from etcd as leaseholdctl does.
func TestExplainSaysWhatAnAddWouldTry(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	cluster, dflt, tenant, closed := etcdtest.Uniq("c"), etcdtest.Uniq("sp"), etcdtest.Uniq("sp"), etcdtest.Uniq("sp")
	for i, name := range []string{dflt, tenant, closed} {
		if _, err := CreatePool(ctx, cli, adminPool(name, allocator.RangeSet{adminRange([]string{"10.73.0.0/24", "10.74.0.0/24", "10.75.0.0/24"}[i])})); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, _, err := SetPoolAccess(ctx, cli, closed, func(a *keyspace.PoolAccess) { a.Closed = true }); err != nil {
		t.Fatal(err)
	}
	if err := SetNamespaceRule(ctx, cli, cluster, "net", "t", keyspace.NamespaceRule{Pools: []string{closed, tenant}}); err != nil {
		t.Fatal(err)
	}
	c, err := Explain(ctx, cli, cluster, "net", dflt, nil, selection.Node{Name: "n1"}, selection.Pod{Namespace: "t"})
	if err != nil {
		t.Fatal(err)
	}
	if c.Source != "namespace rule t" || !reflect.DeepEqual(c.PerFamily, map[int][]string{4: {tenant}}) ||
		!reflect.DeepEqual(c.Passed, []selection.Passed{{Pool: closed, Why: "closed"}}) {
		t.Fatalf("explain namespace t: %+v", c)
	}
	if c, err := Explain(ctx, cli, cluster, "net", dflt, nil, selection.Node{Name: "n1"}, selection.Pod{Namespace: "u"}); err != nil ||
		!reflect.DeepEqual(c.Pools, []string{dflt}) {
		t.Fatalf("explain namespace u: %+v, %v", c, err)
	}
	if _, err := Explain(ctx, cli, cluster, "net", etcdtest.Uniq("unstored"), nil, selection.Node{Name: "n1"}, selection.Pod{Namespace: "u"}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("an unstored configuration pool without families: want ErrNotFound, got %v", err)
	}
}

// TestOutsideSelection: what doctor can tell, without a node's labels or a pod's request, of
// whether a new ADD of a pod of namespace "team" on node "rack1-n1" would get pool p now.
func TestOutsideSelection(t *testing.T) {
	nodeRule := func(pools []string, names []string, labels map[string]string) keyspace.NodeRule {
		return keyspace.NodeRule{Names: names, Labels: labels, Pools: pools}
	}
	for _, tt := range []struct {
		name   string
		ns     map[string][]string
		nodes  map[string]keyspace.NodeRule
		access keyspace.PoolAccess
		says   string // "" wants no finding
	}{
		// No rule at all: the network configuration's pool, or a pool the pod asked for.
		{name: "no rules"},
		// The namespace's rule names the pool.
		{name: "in the namespace's rule", ns: map[string][]string{"team": {"q", "p"}}},
		// The namespace's rule was changed to other pools: a pod may ask only for those.
		{name: "namespace rule without the pool", ns: map[string][]string{"team": {"q"}}, says: "namespace team gives pools q"},
		// Another namespace's rule is not this pod's.
		{name: "another namespace's rule", ns: map[string][]string{"web": {"q"}}},
		// Locked to other namespaces since.
		{name: "locked to others", access: keyspace.PoolAccess{Namespaces: []string{"web"}}, says: "locked to namespaces web"},
		// Locked to this namespace among others.
		{name: "locked to it", access: keyspace.PoolAccess{Namespaces: []string{"team", "web"}}},
		// Closed: a drain; its pods are its allocations, not findings.
		{name: "closed", access: keyspace.PoolAccess{Closed: true}},
		// The pool serves only nodes of a rule whose name pattern this node does not match.
		{name: "given to other nodes", nodes: map[string]keyspace.NodeRule{"rack2": nodeRule([]string{"p"}, []string{"rack2-*"}, nil)},
			says: "serves only the nodes of node rules rack2, and node rack1-n1 matches none"},
		// The same even with a namespace rule naming it: a pool given to some nodes is theirs.
		{name: "namespace rule, pool given to other nodes", ns: map[string][]string{"team": {"p"}},
			nodes: map[string]keyspace.NodeRule{"rack2": nodeRule([]string{"p"}, []string{"rack2-*"}, nil)}, says: "matches none"},
		// A rule by label may match this node: doctor does not know its labels.
		{name: "given to nodes by label", nodes: map[string]keyspace.NodeRule{"zone": nodeRule([]string{"p"}, nil, map[string]string{"zone": "a"})}},
		// A rule by label whose name patterns exclude the node surely does not match.
		{name: "by label and name, other nodes", nodes: map[string]keyspace.NodeRule{"z": nodeRule([]string{"p"}, []string{"rack2-*"}, map[string]string{"zone": "a"})},
			says: "matches none"},
		// The node surely matches a rule giving other pools, and the namespace has none: only a
		// request, which etcd does not record, gives the pod this pool.
		{name: "node rule with other pools", nodes: map[string]keyspace.NodeRule{"rack1": nodeRule([]string{"q"}, []string{"rack1-*"}, nil)},
			says: "matches node rules rack1, which do not name pool p (unless the pod asked for it"},
		// The same with the namespace's rule naming the pool: the namespace's rule comes first.
		{name: "node rule with other pools, namespace rule with it", ns: map[string][]string{"team": {"p"}},
			nodes: map[string]keyspace.NodeRule{"rack1": nodeRule([]string{"q"}, []string{"rack1-*"}, nil)}},
		// A label rule naming the pool may match too: the list may hold it.
		{name: "node rule with other pools, label rule with it", nodes: map[string]keyspace.NodeRule{
			"rack1": nodeRule([]string{"q"}, []string{"rack1-*"}, nil), "zone": nodeRule([]string{"p"}, nil, map[string]string{"zone": "a"})}},
		// Only a label rule with other pools: it may not match, and then the configuration's pool is used.
		{name: "label rule with other pools", nodes: map[string]keyspace.NodeRule{"zone": nodeRule([]string{"q"}, nil, map[string]string{"zone": "a"})}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rules := selection.Rules{Namespaces: map[string]keyspace.NamespaceRule{}, Nodes: tt.nodes}
			for ns, pools := range tt.ns {
				rules.Namespaces[ns] = keyspace.NamespaceRule{Pools: pools}
			}
			got := outsideSelection(rules, "p", tt.access, "rack1-n1", "team")
			if (got == "") != (tt.says == "") || !strings.Contains(got, tt.says) {
				t.Errorf("outsideSelection = %q, want %q", got, tt.says)
			}
		})
	}
}

// TestDoctorPodsOutsideTheirSelection: a real agent's pods get pools by the rules; the rules
// and a pool's lock change; doctor tells of each pod a new ADD would put elsewhere, as
// information (doctor stays clean), and of nothing else; an unreadable rule is a warning.
func TestDoctorPodsOutsideTheirSelection(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	cluster, network := etcdtest.Uniq("c"), etcdtest.Uniq("net")
	dflt, a, b, c := etcdtest.Uniq("sd"), etcdtest.Uniq("sa"), etcdtest.Uniq("sb"), etcdtest.Uniq("sc")
	subnets := map[string]string{dflt: "10.76.0.0/24", a: "10.76.1.0/24", b: "10.76.2.0/24", c: "10.76.3.0/24"}
	for name, subnet := range subnets {
		if _, err := CreatePool(ctx, cli, adminPool(name, allocator.RangeSet{adminRange(subnet)})); err != nil {
			t.Fatal(err)
		}
	}
	if err := SetNamespaceRule(ctx, cli, cluster, network, "team", keyspace.NamespaceRule{Pools: []string{a}}); err != nil {
		t.Fatal(err)
	}
	agent := startAgent(t, cluster, "rack1-n1", etcdtest.Uniq("uid"))
	// add makes pod container of namespace ns, which must get its address from pool; it
	// returns the attachment's owner index.
	add := func(container, ns, pool string, asked ...string) string {
		t.Helper()
		req := allocator.Request{Network: network, Pool: allocator.PoolSpec{Name: dflt}, ContainerID: container, IfName: "eth0",
			Pod: allocator.PodRef{UID: "u-" + container, Namespace: ns, Name: container}, Pools: asked}
		res, err := agent.Add(ctx, req)
		if err != nil {
			t.Fatalf("ADD %s: %v", container, err)
		}
		if got := res.IPs[0].Address.Addr(); !netip.MustParsePrefix(subnets[pool]).Contains(got) {
			t.Fatalf("ADD %s of namespace %s got %s, want one of pool %s (%s)", container, ns, got, pool, subnets[pool])
		}
		return keyspace.OwnerKey(cluster, "u-"+container, "eth0", pool)
	}
	owners := map[string]string{
		"team":       add("p1", "team", a),     // by its namespace's rule
		"other":      add("p2", "other", dflt), // the configuration's pool
		"asked":      add("p3", "other", c, c), // asked for
		"team2":      add("p4", "team2", dflt),
		"team-again": add("p5", "team", a),
	}
	found := func() map[string]Finding {
		t.Helper()
		out := map[string]Finding{}
		for _, f := range Check(readState(t, cli)) {
			if f.Kind == KindOutsideSelection || slices.ContainsFunc(f.Keys, func(k string) bool { return strings.Contains(k, "/selection/") }) {
				out[f.Keys[0]] = f
			}
		}
		return out
	}
	if fs := found(); len(fs) != 0 {
		t.Fatalf("every pod is where its rules put it; doctor found %+v", fs)
	}

	// team's pods go to b from now on; the configuration's pool is locked to team2; c serves
	// rack2's nodes only; a rule by label (doctor cannot tell whether it matches) gives b.
	if err := SetNamespaceRule(ctx, cli, cluster, network, "team", keyspace.NamespaceRule{Pools: []string{b}}); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := SetPoolAccess(ctx, cli, dflt, func(acc *keyspace.PoolAccess) { acc.Namespaces = []string{"team2"} }); err != nil {
		t.Fatal(err)
	}
	for name, r := range map[string]keyspace.NodeRule{
		"rack2": {Names: []string{"rack2-*"}, Pools: []string{c}},
		"zone":  {Labels: map[string]string{"zone": "a"}, Pools: []string{b}},
	} {
		if err := SetNodeRule(ctx, cli, cluster, network, name, r); err != nil {
			t.Fatal(err)
		}
	}
	fs := found()
	for who, says := range map[string]string{
		"team":       "namespace team gives pools " + b,
		"team-again": "namespace team gives pools " + b,
		"other":      "locked to namespaces team2",
		"asked":      "node rules rack2, and node rack1-n1 matches none",
	} {
		f, ok := fs[owners[who]]
		if !ok {
			t.Errorf("%s: no finding for %s; found %+v", who, owners[who], fs)
			continue
		}
		if f.Severity != SeverityInfo || f.Problem() || f.Fix != "" || f.Cluster != cluster || !strings.Contains(f.Message, says) ||
			!strings.Contains(f.Message, "It keeps them") || !strings.Contains(f.Message, "network "+network) {
			t.Errorf("%s: finding %+v; want information without a fix, saying %q", who, f, says)
		}
	}
	if f, ok := fs[owners["team2"]]; ok || len(fs) != 4 {
		t.Errorf("team2's pod is in a pool locked to its namespace, and no rule gives its namespace or node another: %+v; all: %d", f, len(fs))
	}

	// A rule every rack1 node surely matches now gives rack1's pods b: team2's pod, with no
	// namespace rule, would get b unless it asked for its pool.
	if err := SetNodeRule(ctx, cli, cluster, network, "rack1", keyspace.NodeRule{Names: []string{"rack1-*"}, Pools: []string{b}}); err != nil {
		t.Fatal(err)
	}
	if f, ok := found()[owners["team2"]]; !ok || !strings.Contains(f.Message, "unless the pod asked for it") {
		t.Errorf("team2's pod under a node rule with other pools: %+v", f)
	}

	// An unreadable rule: agents pass it over, so it is a warning, with the command that deletes it.
	bad := keyspace.NamespaceRuleKey(cluster, network, "junk")
	put(t, cli, bad, "{", 0)
	f, ok := found()[bad]
	if !ok || f.Kind != KindUnreadable || f.Severity != SeverityWarning ||
		f.Fix != "leaseholdctl selection delete-namespace junk --cluster "+cluster+" --network "+network {
		t.Errorf("unreadable rule: %+v", f)
	}
}
