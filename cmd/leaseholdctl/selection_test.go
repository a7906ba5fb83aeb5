package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/internal/etcdtest"
)

// TestSelectionCommands drives the rule and pool access commands as an admin types them:
// refusals exit with their code and change nothing, explain shows what an ADD would try.
func TestSelectionCommands(t *testing.T) {
	cluster, a, b := etcdtest.Uniq("c"), etcdtest.Uniq("sel"), etcdtest.Uniq("sel")
	for _, p := range []struct{ name, rng string }{{a, "10.80.0.0/24"}, {b, "fd80::/120"}} {
		if r := ctl("pool", "create", p.name, "--range", p.rng); r.code != exitOK {
			t.Fatalf("pool create: %+v", r)
		}
	}
	scope := []string{"--cluster", cluster, "--network", "net"}
	for _, tt := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"selection", "set-namespace", "ns1", "--pools", a}, exitUsage, "--cluster C and --network N"},
		{append([]string{"selection", "set-namespace", "ns1", "--pools", a + ",missing"}, scope...), exitNotFound, "missing"},
		{append([]string{"selection", "set-node", "r1", "--pools", a}, scope...), exitError, "needs a match"},
		{append([]string{"selection", "set-node", "r1", "--pools", a, "--labels", "zone"}, scope...), exitUsage, "KEY=VALUE"},
		{[]string{"pool", "lock", a}, exitUsage, "--namespaces"},
		{[]string{"pool", "close", "missing-pool"}, exitNotFound, "missing-pool"},
	} {
		r := ctl(tt.args...)
		if r.code != tt.code || !strings.Contains(r.stderr, tt.says) {
			t.Errorf("%v: want exit %d saying %q, got %+v", tt.args, tt.code, tt.says, r)
		}
	}
	if r := ctl(append([]string{"selection", "list", "-o", "json"}, scope...)...); r.code != exitOK || strings.TrimSpace(r.stdout) != "[]" {
		t.Fatalf("refused rules were written: %+v", r)
	}

	for _, args := range [][]string{
		append([]string{"selection", "set-namespace", "ns1", "--pools", b, "--pools", a}, scope...),
		append([]string{"selection", "set-node", "r1", "--pools", a, "--names", "rack1-*", "--labels", "zone=a", "--order", "3"}, scope...),
		{"pool", "close", b},
	} {
		if r := ctl(args...); r.code != exitOK {
			t.Fatalf("%v: %+v", args, r)
		}
	}
	var rules []admin.RuleEntry
	jsonOf(t, ctl(append([]string{"selection", "list", "-o", "json"}, scope...)...), &rules)
	if len(rules) != 2 || strings.Join(rules[0].Pools, ",") != b+","+a || rules[1].Node == nil || rules[1].Node.Order != 3 {
		t.Fatalf("rules listed: %+v", rules)
	}
	var all []admin.RuleEntry // without --cluster: every cluster's
	jsonOf(t, ctl("selection", "list", "-o", "json"), &all)
	if !slices.ContainsFunc(all, func(e admin.RuleEntry) bool { return e.Cluster == cluster && e.Name == "r1" }) {
		t.Fatalf("selection list without --cluster misses cluster %s's rules: %+v", cluster, all)
	}
	r := ctl(append([]string{"selection", "explain", "--node", "rack1-n1", "--labels", "zone=a", "--namespace", "ns1", "--pool", a}, scope...)...)
	if r.code != exitOK || !strings.Contains(r.stdout, "from namespace rule ns1") || !strings.Contains(r.stdout, b+" (closed)") ||
		!strings.Contains(strings.Join(strings.Fields(r.stdout), " "), "IPv4 "+a) {
		t.Fatalf("explain on rack1: %+v", r)
	}
	// On another node the rack's pool is not the pod's, and the closed one leaves it none.
	r = ctl(append([]string{"selection", "explain", "--node", "rack2-n1", "--namespace", "ns1", "--pool", a}, scope...)...)
	if r.code != exitError || !strings.Contains(r.stderr, "no pool gives pod") || !strings.Contains(r.stderr, "given to the nodes of rules r1") {
		t.Fatalf("explain on rack2: %+v", r)
	}
	if r := ctl("pool", "close", b); r.code != exitOK || !strings.Contains(r.stdout, "already") {
		t.Fatalf("closing again: %+v", r)
	}
	if r := ctl(append([]string{"selection", "delete-node", "r1"}, scope...)...); r.code != exitOK || !strings.Contains(r.stdout, "deleted") {
		t.Fatalf("delete-node: %+v", r)
	}
}

// TestSelectionExplainPerFamily: for a dual-stack network, explain says which pools give each
// family and how: a rule naming IPv4 pools and an IPv6 pool gives each family its own, one
// attachment per pool in one transaction; a rule mixing single-family pools with a dual-stack
// one is split per family too, the dual-stack pool in both families' lists.
func TestSelectionExplainPerFamily(t *testing.T) {
	cluster, v4a, v4b, v6, dual := etcdtest.Uniq("c"), etcdtest.Uniq("v4a"), etcdtest.Uniq("v4b"), etcdtest.Uniq("v6"), etcdtest.Uniq("dual")
	for _, args := range [][]string{
		{"pool", "create", v4a, "--range", "10.81.1.0/24"},
		{"pool", "create", v4b, "--range", "10.81.2.0/24"},
		{"pool", "create", v6, "--range", "fd81:1::/120"},
		{"pool", "create", dual, "--range", "10.81.0.0/24", "--range", "fd81::/120"},
		{"selection", "set-namespace", "split", "--pools", v4a + "," + v6 + "," + v4b, "--cluster", cluster, "--network", "net"},
		{"selection", "set-namespace", "mixed", "--pools", v4a + "," + dual, "--cluster", cluster, "--network", "net"},
	} {
		if r := ctl(args...); r.code != exitOK {
			t.Fatalf("%v: %+v", args, r)
		}
	}
	explain := func(ns string, more ...string) result {
		return ctl(append([]string{"selection", "explain", "--cluster", cluster, "--network", "net", "--node", "n1",
			"--namespace", ns, "--pool", dual}, more...)...)
	}
	r := explain("split")
	out := strings.Join(strings.Fields(r.stdout), " ")
	for _, s := range []string{"from namespace rule split", "IPv4 " + v4a + ", " + v4b + " IPv6 " + v6, "each family from its own pool",
		"one transaction"} {
		if r.code != exitOK || !strings.Contains(out, s) {
			t.Errorf("explain of a split rule does not say %q: %+v", s, r)
		}
	}
	var c struct {
		PerFamily map[int][]string
		Split     bool
	}
	jsonOf(t, explain("split", "-o", "json"), &c)
	if !c.Split || strings.Join(c.PerFamily[4], ",") != v4a+","+v4b || strings.Join(c.PerFamily[6], ",") != v6 {
		t.Errorf("explain -o json of a split rule: %+v", c)
	}
	r = explain("mixed")
	out = strings.Join(strings.Fields(r.stdout), " ")
	for _, s := range []string{"IPv4 " + v4a + ", " + dual + " IPv6 " + dual, "each family from its own pool"} {
		if r.code != exitOK || !strings.Contains(out, s) {
			t.Errorf("explain of a mixed rule does not say %q: %+v", s, r)
		}
	}
	if strings.Contains(out, "not used") || strings.Contains(out, "every family from one pool") {
		t.Errorf("explain of a mixed rule says a pool is not used, or every family comes from one pool: %s", out)
	}
}
