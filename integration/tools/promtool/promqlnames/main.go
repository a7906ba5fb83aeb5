// Command promqlnames prints the metric names PromQL expressions select, as Prometheus's own
// parser reads them: integration tests use it to check that the dashboard and the alert rules
// of deploy/monitoring name only metrics leaseholdd exports, without the Prometheus module in
// leasehold's own.
//
// It reads a JSON array of expressions on stdin and writes a JSON array of as many results:
// {"names": [...]} with the name of every vector selector in the expression in order (an
// empty string for a selector that names no metric), or {"error": "..."} for an expression
// that does not parse. It exits 1 only when its input is not a JSON array of strings.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

// result is what promqlnames says of one expression.
type result struct {
	Names []string `json:"names,omitempty"`
	Error string   `json:"error,omitempty"`
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintf(os.Stderr, "promqlnames: stdin must be a JSON array of PromQL expressions: %v\n", err)
		os.Exit(1)
	}
	p := parser.NewParser(parser.Options{})
	out := make([]result, len(exprs))
	for i, e := range exprs {
		out[i] = names(p, e)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "promqlnames: %v\n", err)
		os.Exit(1)
	}
}

// names parses expr and lists the metric name of each of its vector selectors.
func names(p parser.Parser, expr string) result {
	ast, err := p.ParseExpr(expr)
	if err != nil {
		return result{Error: err.Error()}
	}
	r := result{Names: []string{}}
	parser.Inspect(ast, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			r.Names = append(r.Names, selectorName(vs))
		}
		return nil
	})
	return r
}

// selectorName is the metric a selector names: `name{...}` or `{__name__="name"}`; empty when
// it names none (no name, or a regular expression over names).
func selectorName(vs *parser.VectorSelector) string {
	if vs.Name != "" {
		return vs.Name
	}
	for _, m := range vs.LabelMatchers {
		if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
			return m.Value
		}
	}
	return ""
}
