package admin

import (
	"errors"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/keyspace"
)

// Live migrations (issue 35, docs/proposals/live-migration.md): the operator's side. While a
// VM moves between nodes, the holder of its claim (the source) and one target pod on another
// node both use the claim's addresses. The target is named by the live migration key
// livemigrations/<cluster>/<pool>/<claim>, on the target's pod lease; the claim record still
// names the source, which owns the allocation keys until the migration completes.

// DefaultLiveMigrationBound is how long a live migration may run before doctor reports it as
// too old (leaseholdctl doctor --live-migration-bound, leaseholdd --live-migration-bound): a
// migration KubeVirt has not finished in an hour has hung.
const DefaultLiveMigrationBound = time.Hour

// ErrMigrationInProgress: claim release of a claim whose live migration key exists, without
// Force; the error is a *MigrationInProgressError naming the target.
var ErrMigrationInProgress = errors.New("claim has a live migration in progress")

// LiveMigrationEntry is a live migration key livemigrations/<cluster>/<pool>/<claim>: the
// target attachment of a migratable claim, on the target's pod lease (Record.Lease).
type LiveMigrationEntry struct {
	Record[keyspace.LiveMigrationRecord]
	Cluster, Pool, Claim string
}

// Age is how long the migration has run at now (0 when its record is unreadable or has no
// start time).
func (m *LiveMigrationEntry) Age(now time.Time) time.Duration {
	if m == nil || m.Unreadable != "" || m.Value.Since.IsZero() {
		return 0
	}
	return max(now.Sub(m.Value.Since), 0)
}

// TargetText names the migration's target pod and node for messages.
func (m *LiveMigrationEntry) TargetText() string {
	if m.Unreadable != "" {
		return "an unknown target (its live migration key " + m.Key + " is unreadable)"
	}
	t := m.Value.Target
	who := "pod " + podName(t.Pod)
	if t.Pod.Name == "" {
		who = "owner " + dash(t.Owner)
	}
	return fmt.Sprintf("%s on node %s (pod lease %s)", who, dash(t.Node), dash(t.LeaseID))
}

// MigrationInProgressError is ReleaseClaim's refusal of a claim being migrated: releasing it
// would take the stickiness from both pods while each uses the addresses.
type MigrationInProgressError struct {
	Claim     ClaimEntry
	Migration LiveMigrationEntry
}

func (e *MigrationInProgressError) Error() string {
	return fmt.Sprintf("claim %s of pool %s in cluster %s is being migrated to %s since %s (key %s): releasing it would "+
		"leave both pods using its addresses with no claim between them. Wait for the migration to end (its source's or "+
		"its target's DEL), or give --force to delete the migration key too",
		e.Claim.Name, e.Claim.Pool, e.Claim.Cluster, e.Migration.TargetText(), sinceText(e.Migration), e.Migration.Key)
}

func (e *MigrationInProgressError) Unwrap() error { return ErrMigrationInProgress }

// sinceText is when m started, in UTC, or "an unknown time".
func sinceText(m LiveMigrationEntry) string {
	if m.Unreadable != "" || m.Value.Since.IsZero() {
		return "an unknown time"
	}
	return m.Value.Since.UTC().Format(time.RFC3339)
}

// linkMigrations sets each claim's Migration to its live migration key, if the state read one.
func (st *State) linkMigrations() {
	if len(st.LiveMigrations) == 0 {
		return
	}
	byKey := map[string]*LiveMigrationEntry{}
	for i := range st.LiveMigrations {
		m := &st.LiveMigrations[i]
		byKey[keyspace.ClaimKey(m.Cluster, m.Pool, m.Claim)] = m
	}
	for i := range st.Claims {
		st.Claims[i].Migration = byKey[st.Claims[i].Key]
	}
}
