package keyspace

import "time"

// Live migrations (issue 35, docs/proposals/live-migration.md): while a VM moves between
// nodes, the claim's holder (the source) and one target pod on another node both hold the
// claim's addresses. The target lives beside the claim record, on its own pod lease, so that
// a dead target leaves nothing for anyone to clear, and the holder's keys are not touched
// while the migration runs.

const liveMigrationsDir = Prefix + "livemigrations/"

// LiveMigrationKey is /leasehold/v1/livemigrations/<cluster>/<pool>/<claim>: the one target
// of a migratable claim, on the target's pod lease, created only if absent.
func LiveMigrationKey(cluster, pool, claim string) string {
	return claimKeyIn(liveMigrationsDir, cluster, pool, claim)
}

// LiveMigrationsPrefix is the prefix of cluster's live migrations; with cluster "" of every
// cluster's.
func LiveMigrationsPrefix(cluster string) string { return clusterPrefixIn(liveMigrationsDir, cluster) }

// ParseLiveMigrationKey splits a live migration key into its cluster, pool and claim name,
// none of them empty.
func ParseLiveMigrationKey(key string) (cluster, pool, claim string, err error) {
	return parseClaimKeyIn(liveMigrationsDir, key, true)
}

// LiveMigrationRecord is the value of a live migration key: the target attachment, the
// target agent's leases that completion (the source's DEL) or promotion (the source's
// expiry) moves the claim's keys onto, and the source it was started against.
type LiveMigrationRecord struct {
	Target ClaimHolder `json:"target"`
	// ClaimLease and BlockLease are the target agent's claim lease for this claim and its
	// block lease, in etcdctl's hex form.
	ClaimLease string              `json:"claimLease"`
	BlockLease string              `json:"blockLease"`
	Source     LiveMigrationSource `json:"source"`
	Since      time.Time           `json:"since"`
}

// LiveMigrationSource names the holder a migration started from.
type LiveMigrationSource struct {
	Owner string `json:"owner"`
	Node  string `json:"node"`
	// LeaseID is the source's pod lease, in etcdctl's hex form.
	LeaseID string `json:"leaseID"`
}
