package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/leasehold/leasehold/admin"
)

// doctorJSON is doctor's -o json output.
type doctorJSON struct {
	Revision int64           `json:"revision"`
	Clean    bool            `json:"clean"`
	Findings []admin.Finding `json:"findings"`
}

func doctor(ctx context.Context, e *env) error {
	st, err := admin.ReadState(ctx, e.cli)
	if err != nil {
		return err
	}
	all := admin.Check(st)
	found := []admin.Finding{}
	for _, f := range all {
		if e.cluster == "" || f.Cluster == "" || f.Cluster == e.cluster {
			found = append(found, f)
		}
	}
	if e.output == "json" {
		if err := writeJSON(e.stdout, doctorJSON{Revision: st.Revision, Clean: len(found) == 0, Findings: found}); err != nil {
			return err
		}
	} else {
		printFindings(e, st, found)
	}
	if len(found) > 0 {
		return errProblems
	}
	return nil
}

func printFindings(e *env, st *admin.State, found []admin.Finding) {
	scope := "all clusters"
	if e.cluster != "" {
		scope = "cluster " + e.cluster + " and the shared pools"
	}
	if len(found) == 0 {
		fmt.Fprintf(e.stdout, "no problems found (%d allocations, %d owner indexes, %d pods, %d pools; %s; revision %d)\n",
			len(st.Allocations), len(st.Owners), len(st.Pods), len(st.Pools), scope, st.Revision)
		return
	}
	for _, f := range found {
		shown := f.Keys
		if len(shown) > 5 {
			shown = append(slices.Clip(shown[:5]), fmt.Sprintf("(and %d more; -o json lists them all)", len(f.Keys)-5))
		}
		fmt.Fprintf(e.stdout, "[%s] %s\n", f.Kind, strings.Join(shown, "\n    "))
		if f.Cluster != "" {
			fmt.Fprintf(e.stdout, "  cluster: %s\n", f.Cluster)
		}
		fmt.Fprintf(e.stdout, "  %s\n  fix: %s\n\n", f.Message, f.Fix)
	}
	fmt.Fprintf(e.stdout, "%d problem(s) found (%s; revision %d). etcdctl fixes read ETCDCTL_ENDPOINTS etc.; "+
		"guarded ones print FAILURE and change nothing when the key changed since this check.\n", len(found), scope, st.Revision)
}
