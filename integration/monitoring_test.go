package integration

// Tests of deploy/monitoring: promtool checks and unit-tests the alert rules, each alert is
// documented where its runbook annotation points and tested firing and quiet, and every
// metric the dashboard and the rules name is one a real agent exports.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"sigs.k8s.io/yaml"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
)

const (
	monitoringDir  = "../deploy/monitoring"
	rulesFile      = "leasehold-rules.yaml"
	rulesTestFile  = "leasehold-rules.test.yaml"
	dashboardFile  = "leasehold-dashboard.json"
	operationsDocs = "../docs/operations.md"
)

// TestMonitoringRulesPassPromtool: `promtool check rules` accepts the rule file and its unit
// tests (`promtool test rules`) pass.
func TestMonitoringRulesPassPromtool(t *testing.T) {
	promtool := toolBin(t, "promtool")
	for _, args := range [][]string{{"check", "rules", rulesFile}, {"test", "rules", rulesTestFile}} {
		cmd := exec.CommandContext(t.Context(), promtool, args...)
		cmd.Dir = monitoringDir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestMonitoringAlertsAreDocumentedAndTested: every alert has a severity, a summary, a
// description and a runbook naming its section of docs/operations.md, which exists; and the
// promtool tests make each alert fire at least once and stay quiet at least once.
func TestMonitoringAlertsAreDocumentedAndTested(t *testing.T) {
	rules := loadRules(t)
	var tests struct {
		RuleFiles []string `json:"rule_files"`
		Tests     []struct {
			AlertRuleTest []struct {
				Alertname string            `json:"alertname"`
				ExpAlerts []json.RawMessage `json:"exp_alerts"`
			} `json:"alert_rule_test"`
		} `json:"tests"`
	}
	if err := yaml.Unmarshal(readMonitoring(t, rulesTestFile), &tests); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(tests.RuleFiles, []string{rulesFile}) {
		t.Errorf("%s tests rule files %v, want [%s]", rulesTestFile, tests.RuleFiles, rulesFile)
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, at := range tc.AlertRuleTest {
			if len(at.ExpAlerts) > 0 {
				fires[at.Alertname] = true
			} else {
				quiet[at.Alertname] = true
			}
		}
	}
	docs, err := os.ReadFile(operationsDocs)
	if err != nil {
		t.Fatal(err)
	}
	headings := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^### (\S+)$`).FindAllStringSubmatch(string(docs), -1) {
		headings[m[1]] = true
	}
	alerts := 0
	for _, r := range rules.alerts() {
		alerts++
		if s := r.Labels["severity"]; !slices.Contains([]string{"critical", "warning", "info"}, s) {
			t.Errorf("%s: severity %q, want critical, warning or info", r.Alert, s)
		}
		for _, a := range []string{"summary", "description"} {
			if strings.TrimSpace(r.Annotations[a]) == "" {
				t.Errorf("%s: no %s annotation", r.Alert, a)
			}
		}
		if want := "docs/operations.md#" + strings.ToLower(r.Alert); r.Annotations["runbook"] != want {
			t.Errorf("%s: runbook %q, want %q", r.Alert, r.Annotations["runbook"], want)
		}
		if !headings[r.Alert] {
			t.Errorf("%s: docs/operations.md has no section \"### %s\" saying what it means and what to do", r.Alert, r.Alert)
		}
		if !fires[r.Alert] || !quiet[r.Alert] {
			t.Errorf("%s: %s makes it fire: %v, checks it quiet: %v; want both", r.Alert, rulesTestFile, fires[r.Alert], quiet[r.Alert])
		}
	}
	if alerts < 11 {
		t.Errorf("%s has %d alerts, want the 11 docs/operations.md describes", rulesFile, alerts)
	}
}

// TestMonitoringQueriesNameExportedMetrics scrapes a real agent that served ADDs and a DEL
// (so that its histograms and pool gauges have series), one of them asking for two pools
// in order (so that the fallback counter has its series), and checks, with Prometheus's own
// PromQL parser, that every query of the dashboard (panel targets and template variables)
// and every rule expression names only metrics the agent exports (histograms by their
// _bucket, _sum and _count series; the rules may also read the scrape's own `up`). promtool
// also lints the scrape (`promtool check metrics`: names, units, help texts).
func TestMonitoringQueriesNameExportedMetrics(t *testing.T) {
	promtool, names := toolBin(t, "promtool"), toolBin(t, "promqlnames")
	addr := strings.TrimPrefix(freeURL(t), "http://")
	f := newFixture(t, withAgentFlags("--metrics-addr", addr))
	conf := netconf(f.Pool, f.Agent.Socket, dualStackIPAM("10.43.0.0/28", "fd43::/64"))
	for i := range 2 {
		if _, err := f.add(conf, fmt.Sprintf("mon%d", i), "eth0", ""); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.del(conf, "mon0", "eth0", ""); err != nil {
		t.Fatal(err)
	}
	next := uniq("mon-next")
	if _, err := admin.CreatePool(f.Ctx, f.Cli, allocator.PoolSpec{Name: next, Ranges: []allocator.RangeSet{
		{{Subnet: netip.MustParsePrefix("10.43.1.0/28")}}, {{Subnet: netip.MustParsePrefix("fd43:1::/64")}}}}); err != nil {
		t.Fatal(err)
	}
	// Refused (code 7, nothing written) until the agent has read the new pool.
	eventually(t, "an ADD asking for two pools in order", func() error {
		_, err := f.add(conf, "mon2", "eth0", "K8S_POD_UID=mon2;K8S_POD_NAMESPACE=mon;K8S_POD_NAME=mon2;LEASEHOLD_POOL="+f.Pool+","+next)
		return err
	})
	_, text := httpGet(t, "http://"+addr+"/metrics")
	exported := exportedSeries(t, text)

	lint := exec.CommandContext(t.Context(), promtool, "check", "metrics")
	lint.Stdin = strings.NewReader(text)
	if out, err := lint.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics on the agent's /metrics: %v\n%s", err, out)
	}

	type query struct{ where, expr string }
	var queries []query
	for _, q := range dashboardQueries(t) {
		queries = append(queries, query{q.where, q.expr})
	}
	dashboardCount := len(queries)
	for _, r := range loadRules(t).alerts() {
		queries = append(queries, query{"rule " + r.Alert, r.Expr})
	}
	exprs := make([]string, len(queries))
	for i, q := range queries {
		exprs[i] = q.expr
	}
	in, err := json.Marshal(exprs)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), names)
	cmd.Stdin, cmd.Stderr = bytes.NewReader(in), os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("promqlnames: %v", err)
	}
	var results []struct {
		Names []string `json:"names"`
		Error string   `json:"error"`
	}
	if err := json.Unmarshal(out, &results); err != nil || len(results) != len(queries) {
		t.Fatalf("promqlnames answered %d results for %d queries (%v): %s", len(results), len(queries), err, out)
	}
	for i, q := range queries {
		r := results[i]
		if r.Error != "" {
			t.Errorf("%s: %q does not parse: %s", q.where, q.expr, r.Error)
			continue
		}
		if len(r.Names) == 0 {
			t.Errorf("%s: %q names no metric", q.where, q.expr)
		}
		for _, n := range r.Names {
			if n == "up" && i >= dashboardCount {
				continue
			}
			if !exported[n] {
				t.Errorf("%s: %q reads %q, which the agent does not export", q.where, q.expr, n)
			}
		}
	}
}

// TestMonitoringDashboardShape: the dashboard takes its data source from a variable, filters
// by agent and pool, and every panel has queries on that data source.
func TestMonitoringDashboardShape(t *testing.T) {
	d := loadDashboard(t)
	if d.SchemaVersion < 39 {
		t.Errorf("schemaVersion %d, want at least 39 (Grafana 10.4)", d.SchemaVersion)
	}
	vars := map[string]dashboardVar{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v
	}
	if ds := vars["datasource"]; ds.Type != "datasource" || string(ds.Query) != `"prometheus"` {
		t.Errorf("variable datasource: type %q, query %s; want a Prometheus data source variable", ds.Type, ds.Query)
	}
	for _, name := range []string{"instance", "pool"} {
		if v := vars[name]; v.Type != "query" || v.Datasource.UID != "${datasource}" {
			t.Errorf("variable %s: type %q on data source %q; want a query on ${datasource}", name, v.Type, v.Datasource.UID)
		}
	}
	ids := map[int]bool{}
	panels := 0
	for _, p := range d.allPanels() {
		if ids[p.ID] {
			t.Errorf("panel id %d is used twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q is wider than the grid: %+v", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			continue
		}
		panels++
		if p.Datasource.UID != "${datasource}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: data source %q, %d queries; want queries on ${datasource}", p.Title, p.Datasource.UID, len(p.Targets))
		}
		for _, tg := range p.Targets {
			if tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q query %s: data source %q, want ${datasource}", p.Title, tg.RefID, tg.Datasource.UID)
			}
		}
	}
	if panels < 15 {
		t.Errorf("the dashboard has %d panels, want the 15 or more deploy/monitoring describes", panels)
	}
}

func readMonitoring(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(monitoringDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// promRules is a Prometheus rule file, decoded as strictly as the chart's PrometheusRule.
type promRules struct {
	Groups []deployRuleGroup `json:"groups"`
}

func loadRules(t *testing.T) promRules {
	t.Helper()
	var r promRules
	if err := yaml.UnmarshalStrict(readMonitoring(t, rulesFile), &r); err != nil {
		t.Fatalf("%s: %v", rulesFile, err)
	}
	return r
}

// alerts lists the alerting rules of every group.
func (r promRules) alerts() []deployRule {
	var out []deployRule
	for _, g := range r.Groups {
		for _, rule := range g.Rules {
			if rule.Alert != "" {
				out = append(out, rule)
			}
		}
	}
	return out
}

// grafanaDashboard is the part of a Grafana dashboard the tests read.
type grafanaDashboard struct {
	SchemaVersion int            `json:"schemaVersion"`
	Panels        []grafanaPanel `json:"panels"`
	Templating    struct {
		List []dashboardVar `json:"list"`
	} `json:"templating"`
}

type grafanaDatasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type grafanaPanel struct {
	ID         int               `json:"id"`
	Type       string            `json:"type"`
	Title      string            `json:"title"`
	Datasource grafanaDatasource `json:"datasource"`
	GridPos    struct{ X, Y, W, H int }
	Targets    []struct {
		RefID      string            `json:"refId"`
		Expr       string            `json:"expr"`
		Datasource grafanaDatasource `json:"datasource"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's
}

type dashboardVar struct {
	Name       string            `json:"name"`
	Type       string            `json:"type"`
	Datasource grafanaDatasource `json:"datasource"`
	// Query is a string (data source variables, older query variables) or an object whose
	// "query" is the string.
	Query json.RawMessage `json:"query"`
}

func loadDashboard(t *testing.T) grafanaDashboard {
	t.Helper()
	var d grafanaDashboard
	if err := json.Unmarshal(readMonitoring(t, dashboardFile), &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// allPanels lists the panels, those inside collapsed rows included.
func (d grafanaDashboard) allPanels() []grafanaPanel {
	var out []grafanaPanel
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			out = append(out, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// dashboardQueries returns the PromQL of every panel query and template variable query, with
// Grafana's variables replaced by values PromQL parses.
func dashboardQueries(t *testing.T) []struct{ where, expr string } {
	t.Helper()
	d := loadDashboard(t)
	var out []struct{ where, expr string }
	for _, p := range d.allPanels() {
		for _, tg := range p.Targets {
			out = append(out, struct{ where, expr string }{fmt.Sprintf("panel %q query %s", p.Title, tg.RefID), grafanaToPromQL(tg.Expr)})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q string
		if json.Unmarshal(v.Query, &q) != nil {
			var obj struct {
				Query string `json:"query"`
			}
			if err := json.Unmarshal(v.Query, &obj); err != nil {
				t.Fatalf("variable %s: query %s: %v", v.Name, v.Query, err)
			}
			q = obj.Query
		}
		out = append(out, struct{ where, expr string }{"variable " + v.Name, grafanaToPromQL(variableSelector(q))})
	}
	if len(out) < 20 {
		t.Fatalf("found %d queries in the dashboard: the test would prove little", len(out))
	}
	return out
}

// variableSelector is the PromQL of a Prometheus variable query: label_values(SELECTOR,
// LABEL) and query_result(EXPR) give theirs; any other form is returned as it is and fails to
// parse (label_values(LABEL) names no metric, and is refused too).
func variableSelector(q string) string {
	q = strings.TrimSpace(q)
	if inner, ok := strings.CutPrefix(q, "query_result("); ok {
		return strings.TrimSuffix(inner, ")")
	}
	if inner, ok := strings.CutPrefix(q, "label_values("); ok {
		inner = strings.TrimSuffix(inner, ")")
		if i := strings.LastIndex(inner, ","); i >= 0 {
			return inner[:i]
		}
	}
	return q
}

var (
	grafanaIntervals = regexp.MustCompile(`\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}`)
	grafanaVariables = regexp.MustCompile(`\$\{\w+(:\w+)?\}|\$\w+|\[\[\w+\]\]`)
)

// grafanaToPromQL replaces Grafana's interval variables by a duration and the others by a
// regular expression matching anything (they stand in label matchers).
func grafanaToPromQL(q string) string {
	q = grafanaIntervals.ReplaceAllString(q, "5m")
	return grafanaVariables.ReplaceAllString(q, ".*")
}

// exportedSeries parses a scrape and returns the names of the series it holds: each family's
// name, and for histograms and summaries the _bucket, _sum and _count series they stand for.
func exportedSeries(t *testing.T, text string) map[string]bool {
	t.Helper()
	var p expfmt.TextParser
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	out := map[string]bool{}
	for name, f := range fams {
		out[name] = true
		switch f.GetType().String() {
		case "HISTOGRAM":
			out[name+"_bucket"], out[name+"_sum"], out[name+"_count"] = true, true, true
		case "SUMMARY":
			out[name+"_sum"], out[name+"_count"] = true, true
		}
	}
	for _, must := range []string{"leasehold_operation_duration_seconds", "leasehold_pool_addresses", "leasehold_ready"} {
		if !out[must] {
			t.Fatalf("the scrape has no %s: it cannot stand for what the agent exports:\n%s", must, text)
		}
	}
	return out
}
