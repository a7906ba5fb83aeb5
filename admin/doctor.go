package admin

import (
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// Kinds of doctor findings; scripts match on them (-o json "kind").
const (
	KindBadKey          = "bad-key"                        // a key of a leasehold family with a malformed name
	KindUnreadable      = "unreadable"                     // a value that does not decode as its record type
	KindPoolInvalid     = "pool-invalid"                   // a pool definition that does not canonicalize or names another pool
	KindPoolOnLease     = "pool-on-lease"                  // a pool definition bound to a lease: it would vanish
	KindPoolUndefined   = "pool-undefined"                 // allocations of a pool that has no definition
	KindNoLease         = "no-lease"                       // a key that must be on a lease has none: it never expires
	KindOutOfRange      = "out-of-range"                   // an allocation its pool does not hand out (no range, excluded, gateway)
	KindOrphan          = "allocation-without-owner-index" // no owner index names the allocation: no DEL releases it
	KindOwnerNoAlloc    = "owner-index-without-allocation" // the owner index names an address no key holds
	KindOwnerOtherAlloc = "owner-index-names-other-holder" // the owner index names an address another attachment holds
	KindLeaseMismatch   = "lease-mismatch"                 // keys of one attachment or pod on different leases
	KindPodMissing      = "pod-record-missing"             // an attachment whose pod record is missing
	KindDuplicate       = "duplicate"                      // one address held in two pools whose ranges overlap

	// The block layout (issue 16; docs/proposals/blocks.md).
	KindBlockInvalid   = "block-claim-invalid" // warning: a block claim that is no block of its pool: wrong size, flat or undefined pool, no valid node
	KindBlockStale     = "block-claim-stale"   // info: a block claim of a node whose agent is gone or was replaced; it expires with its lease
	KindWrongLayout    = "key-in-wrong-layout" // an allocation or quarantine key not where its pool's layout puts the address
	KindPoolMigrating  = "pool-migrating"      // warning: a pool frozen by an unfinished pool migrate; its ADDs are refused
	KindPoolFlat       = "pool-flat"           // info: a pool still in the flat layout (run pool migrate once every agent is upgraded)
	KindUnclaimedBlock = "block-unclaimed"     // info: allocations of a gone node in a block no node claims; they expire with their leases

	// Sticky claims (issue 19; docs/proposals/sticky.md). Malformed, unreadable and leaseless
	// claim records are bad-key, unreadable and no-lease findings.
	KindClaimPoolUndefined = "claim-pool-undefined" // warning: a claim of a pool that has no definition; no ADD can hand its addresses over
	KindClaimHolderGone    = "claim-holder-gone"    // info: a claim naming a holder whose owner index is gone; it goes when its lease runs out

	// Held keys (issue 23, "expired is not free"). Malformed, unreadable and leaseless held keys
	// are bad-key, unreadable and no-lease findings; an expired block is block-claim-stale.
	KindAddressExpired  = "address-expired"         // info: held keys without allocation: addresses of a node cut off or gone, held back until their lease expires
	KindHeldOtherHolder = "held-names-other-holder" // a held key naming another node or owner than the allocation of its address

	// Keys of running pods deleted by hand (issue 32). An owner index on a live lease naming an
	// address without allocation is owner-index-without-allocation.
	KindPodAddrMissing = "running-pod-address-missing" // a held key without allocation or owner index, of a pod whose pod record or owner index is on a live lease

	// Live migrations (issue 35; docs/proposals/live-migration.md). Malformed, unreadable and
	// leaseless migration keys are bad-key, unreadable and no-lease findings.
	KindLiveMigration           = "live-migration"              // info: a claim's addresses used by its holder and one migration target on another node
	KindLiveMigrationTooOld     = "live-migration-too-old"      // warning: a live migration running longer than the bound (--live-migration-bound)
	KindLiveMigrationSameNode   = "live-migration-same-node"    // a migration target on its claim holder's node
	KindLiveMigrationNotAllowed = "live-migration-not-allowed"  // a migration of a claim that is not migratable
	KindLiveMigrationOrphan     = "live-migration-orphan"       // warning: a migration key without claim record or live holder
	KindClaimForeignOwner       = "claim-address-foreign-owner" // an address of a held or migrating claim allocated to neither holder nor target
	KindLiveMigrationOldAgent   = "live-migration-old-agent"    // warning: a live agent that predates live migrations, in a cluster with migratable claims

	// Selection rules (issue 34; docs/proposals/pool-selection.md). Malformed rule keys are
	// bad-key findings; an unreadable rule is an unreadable warning (agents pass it over).
	KindOutsideSelection = "pod-outside-selection" // info: an attachment in a pool its pod's rules, or the pool's lock, no longer give; it keeps it
)

// What doctor tells of a running pod's key that etcd no longer holds (issue 32): the agent of
// its node checks its pods' keys every half lease TTL and puts them back, logging and counting
// it so (leases). Doctor names the log line and the metric to look at when that does not happen.
const (
	podKeysLostLog    = "keys of a running pod were deleted or changed in etcd; re-claiming its addresses"
	podKeysLostMetric = "leasehold_pod_keys_lost_total"
)

// AgentPutsBack says that the agent of node puts a running pod's keys back by itself, how
// soon, and what to look at when this finding stays: doctor's findings of a running pod's
// missing keys say it, and leaseholdctl pool show of the addresses of such pods.
func AgentPutsBack(node string) string {
	return fmt.Sprintf("The agent of node %s puts the pod's keys back by itself within half a lease TTL (leaseholdd --lease-ttl, "+
		"default 90s: 45s): it revokes the pod's lease and re-claims the pod's addresses on a new one, logging %q and counting %s. "+
		"If this is still reported after that, that agent is not running, cannot reach etcd, or is a version that does not check "+
		"its pods' keys: look for that log line and metric on node %s", dash(node), podKeysLostLog, podKeysLostMetric, dash(node))
}

// Severities of findings. Doctor fails (leaseholdctl: exit 3) on errors and warnings; info
// findings describe a state that is normal for a while or a step still to take.
const (
	SeverityError   = "error"   // an invariant is broken: an address may get two holders, leak, or expire under its pod
	SeverityWarning = "warning" // nothing is wrong with the data, but something is refused until an admin acts
	SeverityInfo    = "info"    // normal for a while, or a recommended step; fails nothing
)

// Finding is one problem Check reports. Fix is one shell command; etcdctl commands take
// their connection from ETCDCTL_* as usual, leaseholdctl ones from the same flags as this run.
// Fix is "" when nothing needs doing (some info findings).
type Finding struct {
	Kind     string   `json:"kind"`
	Severity string   `json:"severity"`
	Keys     []string `json:"keys"`
	Cluster  string   `json:"cluster,omitempty"`
	Message  string   `json:"message"`
	Fix      string   `json:"fix"`
}

// Problem reports whether f is an error or a warning, which fail doctor; info findings do not.
func (f Finding) Problem() bool { return f.Severity != SeverityInfo }

// delFix deletes one key.
func delFix(key string) string { return "etcdctl del " + ShellQuote(key) }

// forgetFix is the leaseholdctl command that frees what a gone node still holds back.
func forgetFix(cluster, node string) string {
	return "leaseholdctl node forget " + ShellQuote(node) + " --cluster " + ShellQuote(cluster)
}

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
	return txnFix(guards, putOp(key, value, lease))
}

// moveFix moves key old (as read at rev) to new, keeping value and lease, unless old changed
// or new exists: one etcdctl transaction.
func moveFix(old, new string, value []byte, lease clientv3.LeaseID, rev int64) string {
	return txnFix([]string{modGuard(old, rev), absentGuard(new)}, putOp(new, value, lease), "del "+old)
}

func putOp(key string, value []byte, lease clientv3.LeaseID) string {
	op := "put " + key + " " + strconv.Quote(string(value))
	if lease != 0 {
		op += " --lease=" + keyspace.LeaseHex(lease)
	}
	return op
}

// txnFix is an etcdctl transaction of compares and success requests, as one pasteable line.
func txnFix(guards []string, ops ...string) string {
	parts := []string{"printf '%s\\n'"}
	for _, g := range guards {
		parts = append(parts, ShellQuote(g))
	}
	parts = append(parts, "''")
	for _, op := range ops {
		parts = append(parts, ShellQuote(op))
	}
	parts = append(parts, "''", "''", "| etcdctl txn")
	return strings.Join(parts, " ")
}

// sortFindings orders findings by kind, then by first key, for stable output.
func sortFindings(fs []Finding) {
	sort.SliceStable(fs, func(i, j int) bool {
		if fs[i].Kind != fs[j].Kind {
			return fs[i].Kind < fs[j].Kind
		}
		return fs[i].Keys[0] < fs[j].Keys[0]
	})
}

// ShellQuote quotes s for a POSIX shell, so printed fix commands can be pasted as they are.
func ShellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("/._:@,=-", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// dash is s, or "-" when s is empty.
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// short is a container ID cut to the 12 characters runtimes show.
func short(id string) string { return dash(id[:min(len(id), 12)]) }
