package main

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/leases"
)

// Kinds of doctor findings; scripts match on them (-o json "kind").
const (
	kindBadKey          = "bad-key"                        // a key of a leasehold family with a malformed name
	kindUnreadable      = "unreadable"                     // a value that does not decode as its record type
	kindPoolInvalid     = "pool-invalid"                   // a pool definition that does not canonicalize or names another pool
	kindPoolOnLease     = "pool-on-lease"                  // a pool definition bound to a lease: it would vanish
	kindPoolUndefined   = "pool-undefined"                 // allocations of a pool that has no definition
	kindNoLease         = "no-lease"                       // a key that must be on a lease has none: it never expires
	kindOutOfRange      = "out-of-range"                   // an allocation its pool does not hand out (no range, excluded, gateway)
	kindOrphan          = "allocation-without-owner-index" // no owner index names the allocation: no DEL releases it
	kindOwnerNoAlloc    = "owner-index-without-allocation" // the owner index names an address no key holds
	kindOwnerOtherAlloc = "owner-index-names-other-holder" // the owner index names an address another attachment holds
	kindLeaseMismatch   = "lease-mismatch"                 // keys of one attachment or pod on different leases
	kindPodMissing      = "pod-record-missing"             // an attachment whose pod record is missing
	kindDuplicate       = "duplicate"                      // one address held in two pools whose ranges overlap
)

// finding is one problem doctor reports. Fix is one shell command; etcdctl commands take
// their connection from ETCDCTL_* as usual, leaseholdctl ones from the same flags as this run.
type finding struct {
	Kind    string   `json:"kind"`
	Keys    []string `json:"keys"`
	Cluster string   `json:"cluster,omitempty"`
	Message string   `json:"message"`
	Fix     string   `json:"fix"`
}

// doctorJSON is doctor's -o json output.
type doctorJSON struct {
	Revision int64     `json:"revision"`
	Clean    bool      `json:"clean"`
	Findings []finding `json:"findings"`
}

func doctor(ctx context.Context, e *env) error {
	st, err := leases.ReadState(ctx, e.cli)
	if err != nil {
		return err
	}
	all := check(st)
	found := []finding{}
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

func printFindings(e *env, st *leases.State, found []finding) {
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

// delFix deletes one key.
func delFix(key string) string { return "etcdctl del " + shellQuote(key) }

// releaseFix is the leaseholdctl command that releases ip's allocation in pool.
func releaseFix(ip netip.Addr, pool string, lease clientv3.LeaseID) string {
	s := "leaseholdctl alloc release " + ip.String() + " --pool " + pool
	if lease != 0 {
		s += " --force"
	}
	return s
}

// modGuard compares that key was not written since doctor read it; absentGuard that it does
// not exist. Both are etcdctl txn compare lines.
func modGuard(key string, rev int64) string {
	return fmt.Sprintf("mod(%q) = %q", key, strconv.FormatInt(rev, 10))
}

func absentGuard(key string) string { return fmt.Sprintf("create(%q) = \"0\"", key) }

// putFix writes value to key on lease (0: none) in an etcdctl transaction guarded by guards,
// as one pasteable line: etcdctl txn reads compares, a blank line, the success requests and a
// blank line, then the (empty) failure requests from stdin.
func putFix(key string, value []byte, lease clientv3.LeaseID, guards ...string) string {
	op := "put " + key + " " + strconv.Quote(string(value))
	if lease != 0 {
		op += " --lease=" + leases.LeaseHex(lease)
	}
	parts := []string{"printf '%s\\n'"}
	for _, g := range guards {
		parts = append(parts, shellQuote(g))
	}
	parts = append(parts, "''", shellQuote(op), "''", "''", "| etcdctl txn")
	return strings.Join(parts, " ")
}

// sortFindings orders findings by kind, then by first key, for stable output.
func sortFindings(fs []finding) {
	sort.SliceStable(fs, func(i, j int) bool {
		if fs[i].Kind != fs[j].Kind {
			return fs[i].Kind < fs[j].Kind
		}
		return fs[i].Keys[0] < fs[j].Keys[0]
	})
}
