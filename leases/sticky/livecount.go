package sticky

import (
	"context"
	"maps"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// Counting the live migrations this node takes part in, from either side (the agent's
// leasehold_live_migrations_* metrics). The target's agent counts what it does: a start (T1),
// a failure by its DEL (T3), a completion by its promotion (T4); the source's agent a
// completion by its DEL (T2). The source's agent also reads, every audit, the migration keys
// of the claims it holds: one it saw that vanished without its DEL, whose target's node record
// is gone too, is a target's death (T5). The same read gives the start of every migration in
// progress, for the gauges, and logs once each one older than the bound.

// How a live migration ended: the values of LiveMetrics' Completed and Failed.
const (
	SourceDeleted = "source_deleted" // T2, counted by the source's agent
	SourceExpired = "source_expired" // T4, counted by the target's agent
	TargetDeleted = "target_deleted" // T3, counted by the target's agent
	TargetExpired = "target_expired" // T5, seen by the source's audit
)

// LiveMetrics counts live migrations (the agent's metrics).
type LiveMetrics interface {
	Started()
	Completed(how string)
	Failed(how string)
	Refused()
}

// liveSeen is what the agent last knew of the live migrations its pods take part in, by
// migration key, and the start of each it logged as older than the bound (overBound).
type liveSeen struct {
	mu   sync.Mutex
	m    map[string]seenMigration
	told map[string]time.Time
}

// seenMigration is one live migration: when it started, its target's node, whether this
// node's pod is its source, and when it was found vanished (readMigrations), if it was.
type seenMigration struct {
	since                 time.Time
	targetNode, targetUID string
	source                bool
	vanished              time.Time
}

func (s *liveSeen) put(key string, m seenMigration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]seenMigration{}
	}
	s.m[key] = m
}

// none tells whether no live migration is known.
func (s *liveSeen) none() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m) == 0
}

func (s *liveSeen) drop(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, key)
}

// swap makes now what is known and returns what was. It keeps a copy of now: the caller
// goes on reading now while the agent's transitions change what is known.
func (s *liveSeen) swap(now map[string]seenMigration) map[string]seenMigration {
	s.mu.Lock()
	defer s.mu.Unlock()
	was := s.m
	s.m = maps.Clone(now)
	return was
}

// overBound returns the migrations known, not vanished, that started more than bound before
// now and were not returned before (a migration is its key and its start), and forgets those
// returned that are no longer known.
func (s *liveSeen) overBound(now time.Time, bound time.Duration) map[string]seenMigration {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key, since := range s.told {
		if m, ok := s.m[key]; !ok || !m.since.Equal(since) {
			delete(s.told, key)
		}
	}
	out := map[string]seenMigration{}
	for key, m := range s.m {
		if !m.vanished.IsZero() || now.Sub(m.since) <= bound {
			continue
		}
		if since, ok := s.told[key]; ok && since.Equal(m.since) {
			continue
		}
		if s.told == nil {
			s.told = map[string]time.Time{}
		}
		s.told[key] = m.since
		out[key] = m
	}
	return out
}

// MigrationsSince is the start of each live migration in progress this node's pods take part
// in, as source or target, as last known (the audit reads them; this agent's transitions
// update them at once).
func (sc *Claims) MigrationsSince() []time.Time {
	sc.seen.mu.Lock()
	defer sc.seen.mu.Unlock()
	out := make([]time.Time, 0, len(sc.seen.m))
	for _, m := range sc.seen.m {
		if m.vanished.IsZero() {
			out = append(out, m.since)
		}
	}
	return out
}

// started records a live migration this agent's pod is the target of, started (T1) or
// found again.
func (sc *Claims) started(key string, m keyspace.LiveMigrationRecord) {
	sc.seen.put(key, seenMigration{since: m.Since, targetNode: m.Target.Node, targetUID: m.Target.NodeUID})
}

// readMigrations reads the cluster's live migration keys (a handful: one per VM migrating)
// and keeps those this node's pods take part in: as target, or as the holder of the claim.
// One this node's pod was the source of that vanished while the pod still holds the claim
// ended without the source's DEL: by the target's DEL (T3, counted on the target's node) or
// its node's death (T5). The source tells them by the target's node record: gone, the node
// died, and the failure is counted here. While it lives, the vanished migration is looked at
// again by the next audits, until the node record goes too (the pod lease expired first) or
// two lease TTLs have passed (it was the target's DEL).
//
// A node none of whose pods is a target or holds a migratable claim (Attachment.
// ClaimMigratable), and that knows of no migration, skips the read: no migration can name it
// (T1 starts only from a migratable record, which its holder's attachment marks: on its ADD,
// or once the claim's keep read it), and at thousands of nodes each reading the whole prefix
// every audit is a steady load on etcd for nothing. A migration still looked at after it
// vanished keeps the read going until it is settled.
func (sc *Claims) readMigrations(ctx context.Context) error {
	if sc.seen.none() && !sc.pods.MayMigrate() {
		sc.logOverBound(time.Now()) // forgets what it logged of migrations gone
		return nil
	}
	octx, cancel := sc.opCtx(ctx)
	resp, err := sc.cli.Get(octx, keyspace.LiveMigrationsPrefix(sc.cfg.Cluster), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return sc.unavailable("read the live migrations", err)
	}
	now := map[string]seenMigration{}
	for _, kv := range resp.Kvs {
		_, pool, claim, err := keyspace.ParseLiveMigrationKey(string(kv.Key))
		if err != nil {
			continue
		}
		m, err := keyspace.Decode[keyspace.LiveMigrationRecord](string(kv.Key), kv.Value)
		if err != nil {
			continue
		}
		seen := seenMigration{since: m.Since, targetNode: m.Target.Node, targetUID: m.Target.NodeUID}
		switch {
		case m.Target.NodeUID == sc.cfg.NodeUID:
			now[string(kv.Key)] = seen
		case sc.pods.HoldsClaim(pool, claim):
			seen.source = true
			now[string(kv.Key)] = seen
		}
	}
	for key, m := range sc.seen.swap(now) {
		if _, ok := now[key]; ok || !m.source {
			continue
		}
		_, pool, claim, err := keyspace.ParseLiveMigrationKey(key)
		if err != nil || !sc.pods.HoldsClaim(pool, claim) {
			continue // this pod's DEL ended it (T2), or the claim is not this node's any more
		}
		died, err := sc.nodeGone(ctx, m.targetNode, m.targetUID)
		switch {
		case err != nil || !died && m.vanished.IsZero():
			if m.vanished.IsZero() {
				m.vanished = time.Now()
			}
			sc.seen.put(key, m) // looked at again by the next audit
		case died:
			sc.cfg.Live.Failed(TargetExpired)
			sc.log.Warn("live migration failed: its target's node is gone; this node's pod keeps the claim", "claim", claim, "pool", pool,
				"target_node", m.targetNode)
		case time.Since(m.vanished) < 2*sc.cfg.LeaseTTL:
			sc.seen.put(key, m)
		}
	}
	sc.logOverBound(time.Now())
	return nil
}

// logOverBound logs, once each, the live migrations this node takes part in that have run
// longer than the bound (--live-migration-bound): KubeVirt has not finished them, and two
// pods use their claims' addresses. The gauge leasehold_live_migrations_too_old counts them
// from MigrationsSince.
func (sc *Claims) logOverBound(now time.Time) {
	if sc.cfg.LiveMigrationBound <= 0 {
		return
	}
	for key, m := range sc.seen.overBound(now, sc.cfg.LiveMigrationBound) {
		_, pool, claim, err := keyspace.ParseLiveMigrationKey(key)
		if err != nil {
			continue
		}
		role := "target"
		if m.source {
			role = "source"
		}
		sc.log.Warn("a live migration this node takes part in has run longer than --live-migration-bound: KubeVirt has not "+
			"finished it, and both its pods use the claim's addresses; the source pod's DEL completes it, the target pod's fails it",
			"claim", claim, "pool", pool, "this_node_is", role, "target_node", m.targetNode, "since", m.since.UTC().Format(time.RFC3339),
			"age", now.Sub(m.since).Round(time.Second), "bound", sc.cfg.LiveMigrationBound)
	}
}

// nodeGone tells whether node's record, of identity uid, is gone from etcd.
func (sc *Claims) nodeGone(ctx context.Context, node, uid string) (bool, error) {
	key := keyspace.NodeKey(sc.cfg.Cluster, node)
	octx, cancel := sc.opCtx(ctx)
	resp, err := sc.cli.Get(octx, key)
	cancel()
	if err != nil {
		return false, err
	}
	if len(resp.Kvs) == 0 {
		return true, nil
	}
	rec, err := keyspace.Decode[keyspace.NodeRecord](key, resp.Kvs[0].Value)
	return err == nil && rec.UID != uid, nil
}
