package admin

import (
	"errors"
	"reflect"
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
