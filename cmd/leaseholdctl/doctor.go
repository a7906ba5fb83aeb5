package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/leasehold/leasehold/admin"
)

// doctorJSON is doctor's -o json output. Clean is true when no finding is an error or a
// warning; info findings are listed all the same.
type doctorJSON struct {
	Revision int64           `json:"revision"`
	Clean    bool            `json:"clean"`
	Findings []admin.Finding `json:"findings"`
}

func doctor(ctx context.Context, e *env) error {
	if err := boundArg(e); err != nil {
		return err
	}
	st, err := admin.ReadState(ctx, e.cli)
	if err != nil {
		return err
	}
	all := admin.CheckWith(st, admin.CheckOptions{LiveMigrationBound: e.liveMigrationBound})
	found := []admin.Finding{}
	for _, f := range all {
		if e.cluster == "" || f.Cluster == "" || f.Cluster == e.cluster {
			found = append(found, f)
		}
	}
	problems := 0
	for _, f := range found {
		if f.Problem() {
			problems++
		}
	}
	if e.output == "json" {
		if err := writeJSON(e.stdout, doctorJSON{Revision: st.Revision, Clean: problems == 0, Findings: found}); err != nil {
			return err
		}
	} else {
		printFindings(e, st, found, problems)
	}
	if problems > 0 {
		return errProblems
	}
	return nil
}

func printFindings(e *env, st *admin.State, found []admin.Finding, problems int) {
	scope := "all clusters"
	if e.cluster != "" {
		scope = "cluster " + e.cluster + " and the shared pools"
	}
	for _, f := range found {
		shown := f.Keys
		if len(shown) > 5 {
			shown = append(slices.Clip(shown[:5]), fmt.Sprintf("(and %d more; -o json lists them all)", len(f.Keys)-5))
		}
		fmt.Fprintf(e.stdout, "[%s] (%s) %s\n", f.Kind, f.Severity, strings.Join(shown, "\n    "))
		if f.Cluster != "" {
			fmt.Fprintf(e.stdout, "  cluster: %s\n", f.Cluster)
		}
		fix := f.Fix
		if fix == "" {
			fix = "none needed"
		}
		fmt.Fprintf(e.stdout, "  %s\n  fix: %s\n\n", f.Message, fix)
	}
	notes := ""
	if n := len(found) - problems; n > 0 {
		notes = fmt.Sprintf(", %d info finding(s) above", n)
	}
	if problems == 0 {
		fmt.Fprintf(e.stdout, "no problems found (%d allocations, %d owner indexes, %d pods, %d pools, %d block claims, %d held keys; %s; revision %d%s)\n",
			len(st.Allocations), len(st.Owners), len(st.Pods), len(st.Pools), len(st.Blocks), len(st.Held), scope, st.Revision, notes)
		return
	}
	fmt.Fprintf(e.stdout, "%d problem(s) found (%s; revision %d%s). etcdctl fixes read ETCDCTL_ENDPOINTS etc.; "+
		"guarded ones print FAILURE and change nothing when the key changed since this check.\n", problems, scope, st.Revision, notes)
}
