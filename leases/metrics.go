package leases

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/sticky"
	"github.com/leasehold/leasehold/leases/txn"
)

// metrics is the agent's Prometheus instrumentation, on a registry of its own so that
// several agents in one process (tests) do not collide.
type metrics struct {
	reg        *prometheus.Registry
	ops        *prometheus.HistogramVec
	casRetries prometheus.Counter
	leaseLost  prometheus.Counter
	reclaims   prometheus.Counter
	etcdRTT    *prometheus.HistogramVec

	claimBatches  *prometheus.CounterVec
	claimsBatched prometheus.Counter
	// unquarantined counts releases made without quarantine because etcd was out of space;
	// noSpace every refusal by etcd's NOSPACE alarm that an ADD or DEL met.
	unquarantined, noSpace prometheus.Counter
	// Blocks: claims made, empty blocks given back, addresses borrowed from others' blocks.
	blockClaims, blocksGivenBack, borrowed prometheus.Counter
	// Sticky claims: taken over by a new holder, and ADDs refused because a live pod held them.
	claimHandovers, claimsRefused prometheus.Counter
	// imports counts the addresses of imports from other IPAM plugins by what became of them.
	imports *prometheus.CounterVec
	// Expiry and recovery: held-back addresses handed out because the pool had no other room;
	// DELs recorded while etcd was away; DELs that stopped a lost pod's re-claim; conflicts
	// resolved, and open.
	expiredReused, releasesDeferred, reclaimsCancelled, conflictsResolved prometheus.Counter
	conflictsOpen                                                         prometheus.Gauge
	// A live lease is not proof (leases/audit): keys of running pods found missing or changed,
	// and the times etcd was found to have gone back in time.
	podKeysLost, wentBack, audits prometheus.Counter
	// Selection (Agent.Add): ADDs passed from a full pool to the next of their list, by both
	// pools; ADDs refused as exhausted, by the pool their list ended at.
	fallbacks, exhaustedRefusals *prometheus.CounterVec
	// live counts live migrations (issue 35) this node takes part in.
	live *liveMigrationMetrics
}

// liveMigrationMetrics counts the live migrations (issue 35, docs/proposals/live-migration.md)
// this agent sees, from either side: the source's agent counts a completion by its DEL and a
// target's death; the target's agent a start, a failure by its DEL, a completion by its
// promotion after the source's death, and a third pod refused. Its gauges read the migrations
// in progress from the func given to Watch, at each scrape.
type liveMigrationMetrics struct {
	started, refused  prometheus.Counter
	completed, failed *prometheus.CounterVec
	inProgress        atomic.Pointer[func() []time.Time]
	// bound is the age above which a migration has hung (Config.LiveMigrationBound).
	bound time.Duration
}

// How a live migration ended: the values of Completed's and Failed's how.
const (
	// LiveMigrationSourceDeleted: the source's DEL completed it (T2, counted by the source's agent).
	LiveMigrationSourceDeleted = sticky.SourceDeleted
	// LiveMigrationSourceExpired: the source's lease expired and the target took the claim's
	// keys over (T4, counted by the target's agent).
	LiveMigrationSourceExpired = sticky.SourceExpired
	// LiveMigrationTargetDeleted: the target's DEL failed it (T3, counted by the target's agent).
	LiveMigrationTargetDeleted = sticky.TargetDeleted
	// LiveMigrationTargetExpired: the target's lease expired (T5, seen by the source's audit).
	LiveMigrationTargetExpired = sticky.TargetExpired
)

var _ sticky.LiveMetrics = (*liveMigrationMetrics)(nil)

func newLiveMigrationMetrics(bound time.Duration) *liveMigrationMetrics {
	l := &liveMigrationMetrics{bound: bound,
		started: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_live_migrations_started_total",
			Help: "Live migrations this node's pods started as their target: a second pod of a migratable claim given its addresses while the holder on another node ran.",
		}),
		completed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_live_migrations_completed_total",
			Help: "Live migrations that left their target the claim's sole holder, by how: source_deleted (the source's DEL, counted on the source's node), source_expired (the source's lease expired and the target took the keys over, counted on the target's node).",
		}, []string{"how"}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_live_migrations_failed_total",
			Help: "Live migrations that left their source the claim's sole holder, by how: target_deleted (the target's DEL, counted on the target's node), target_expired (the target's lease expired, seen on the source's node).",
		}, []string{"how"}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_live_migrations_refused_total",
			Help: "ADDs naming a claim held by two pods during a live migration, refused: a third pod gets the addresses only once one of the two is gone.",
		}),
	}
	for _, how := range []string{LiveMigrationSourceDeleted, LiveMigrationSourceExpired} {
		l.completed.WithLabelValues(how)
	}
	for _, how := range []string{LiveMigrationTargetDeleted, LiveMigrationTargetExpired} {
		l.failed.WithLabelValues(how)
	}
	return l
}

// Started counts a live migration this node's pod started as its target (T1).
func (l *liveMigrationMetrics) Started() { l.started.Inc() }

// Completed counts a live migration that left its target the sole holder; how is
// LiveMigrationSourceDeleted or LiveMigrationSourceExpired.
func (l *liveMigrationMetrics) Completed(how string) { l.completed.WithLabelValues(how).Inc() }

// Failed counts a live migration that left its source the sole holder; how is
// LiveMigrationTargetDeleted or LiveMigrationTargetExpired.
func (l *liveMigrationMetrics) Failed(how string) { l.failed.WithLabelValues(how).Inc() }

// Refused counts an ADD refused because two pods held its claim during a live migration (T6).
func (l *liveMigrationMetrics) Refused() { l.refused.Inc() }

// Watch sets where the gauges read the live migrations in progress this node takes part in,
// as source or target: the start time of each. Until it is called they read none.
func (l *liveMigrationMetrics) Watch(inProgress func() []time.Time) { l.inProgress.Store(&inProgress) }

// now is the start time of each live migration in progress this node takes part in.
func (l *liveMigrationMetrics) now() []time.Time {
	if f := l.inProgress.Load(); f != nil {
		return (*f)()
	}
	return nil
}

// collectors are the live migration metrics to register.
func (l *liveMigrationMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{l.started, l.completed, l.failed, l.refused,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_live_migrations_in_progress",
			Help: "Live migrations in progress this node's pods take part in, as source or target (a migration between two nodes is counted on both).",
		}, func() float64 { return float64(len(l.now())) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_live_migration_oldest_seconds",
			Help: "Seconds the oldest live migration in progress this node's pods take part in has run; 0 when none. Above --live-migration-bound (default 1h) it has hung (leasehold_live_migrations_too_old).",
		}, func() float64 {
			var oldest time.Time
			for _, t := range l.now() {
				if oldest.IsZero() || t.Before(oldest) {
					oldest = t
				}
			}
			if oldest.IsZero() {
				return 0
			}
			return max(time.Since(oldest).Seconds(), 0)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_live_migrations_too_old",
			Help: "Live migrations in progress this node's pods take part in that have run longer than this agent's --live-migration-bound (default 1h): hung; each is logged once. Alert on the max over the nodes above 0.",
		}, func() float64 {
			n := 0
			for _, t := range l.now() {
				if time.Since(t) > l.bound {
					n++
				}
			}
			return float64(n)
		}),
	}
}

func newMetrics(a *Agent) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "leasehold_operation_duration_seconds",
			Help:    "Time the agent spent on a CNI operation, by operation and result.",
			Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"op", "result"}),
		casRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_cas_retries_total",
			Help: "Claim transactions retried because another owner took a chosen address first.",
		}),
		leaseLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_keepalive_failures_total",
			Help: "Leases this agent held that stopped being renewed (agent or etcd away longer than the TTL).",
		}),
		reclaims: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_reclaims_total",
			Help: "Pods whose keys were re-claimed after their lease was lost.",
		}),
		etcdRTT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "leasehold_etcd_request_duration_seconds",
			Help:    "Round-trip time of the agent's etcd transactions, by kind.",
			Buckets: []float64{.0002, .0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"kind"}),
		claimBatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_claim_batches_total",
			Help: "Transactions that carried the claims of several concurrent ADDs, by outcome: committed, split (a compare failed; each claim ran again alone), lost (no answer).",
		}, []string{"result"}),
		claimsBatched: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_claims_batched_total",
			Help: "Claims committed as part of a batch.",
		}),
		unquarantined: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_releases_without_quarantine_total",
			Help: "Attachments released without quarantining their addresses because etcd was out of space (NOSPACE alarm).",
		}),
		noSpace: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_etcd_nospace_refusals_total",
			Help: "Requests etcd refused because its NOSPACE alarm is raised (its database reached its quota), as CNI operations met them: an ADD refused, a DEL released without quarantine.",
		}),
		blockClaims: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_block_claims_total",
			Help: "Blocks this node claimed (its blocks had no free address left).",
		}),
		blocksGivenBack: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_blocks_given_back_total",
			Help: "Blocks this node gave back after they stayed empty for --block-idle.",
		}),
		claimHandovers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_claim_handovers_total",
			Help: "ADDs that took a sticky claim's addresses over from an earlier holder (released, or gone with its node).",
		}),
		claimsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_claim_handovers_refused_total",
			Help: "ADDs naming a sticky claim that failed because a live pod still held its addresses.",
		}),
		borrowed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_borrowed_addresses_total",
			Help: "Addresses chosen inside other nodes' blocks because every block was claimed and this node's were full.",
		}),
		imports: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_import_addresses_total",
			Help: "Addresses of imports from host-local or whereabouts, by result: imported, already (imported before), released (imported before, released since), conflict (held by another owner: not taken), outside_pool.",
		}, []string{"result"}),
		expiredReused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_expired_addresses_reused_total",
			Help: "Addresses whose holder expired without a release (its node cut off or dead) that this agent handed out before the reuse delay ended, because the pool had no other room.",
		}),
		releasesDeferred: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_releases_deferred_total",
			Help: "DELs answered while etcd could not be reached: recorded in the journal and released once etcd answered.",
		}),
		reclaimsCancelled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_reclaims_cancelled_total",
			Help: "Attachments of pods whose lease was lost that a DEL ended before they were re-claimed: never re-claimed (a deleted pod stays deleted).",
		}),
		conflictsResolved: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_conflicts_resolved_total",
			Help: "Conflicted addresses taken back for their running pod after the other holder let them go.",
		}),
		conflictsOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_conflicts_open",
			Help: "Addresses of this node's running pods held by another owner now (conflicts not yet resolved).",
		}),
		podKeysLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_pod_keys_lost_total",
			Help: "Keys of running pods (pod records, owner indexes, allocations, sticky claims) the agent's check found missing, on another lease or overwritten in etcd; each such pod is re-claimed (leasehold_reclaims_total), a sticky claim's keys put back on its claim lease.",
		}),
		audits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_key_audits_total",
			Help: "Checks of every key the agent keeps in etcd (node record, block claims, running pods' keys) that ran to the end: one every half lease TTL, and one each time etcd may have gone back in time.",
		}),
		wentBack: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_etcd_went_back_total",
			Help: "Times the agent found etcd gone back in time (restored from a backup, or replaced): an answer of another cluster or below a revision already seen, or a node record, block claim or pod keys lost after a compacted watch.",
		}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_pool_fallbacks_total",
			Help: "ADDs that found pool `from` full and passed to pool `to`, the next of the list their selection rules or request gave.",
		}, []string{"from", "to"}),
		exhaustedRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_pool_exhausted_refusals_total",
			Help: "ADDs refused as exhausted (CNI code 102) by the last pool they tried: it was full, and so was every pool before it in their list. Given from the pool's first ADD on, at 0.",
		}, []string{"pool"}),
		live: newLiveMigrationMetrics(a.cfg.LiveMigrationBound),
	}
	// Results known in advance are exported at 0 from the start: a dashboard shows 0, not
	// nothing, and an alert on increase() sees the first one.
	for _, r := range []string{"imported", "already", "released", "conflict", "outside_pool"} {
		m.imports.WithLabelValues(r)
	}
	for _, r := range []string{"committed", "split", "lost"} {
		m.claimBatches.WithLabelValues(r)
	}
	m.reg.MustRegister(m.ops, m.expiredReused, m.releasesDeferred, m.reclaimsCancelled, m.conflictsResolved, m.conflictsOpen, m.podKeysLost, m.wentBack, m.audits, m.casRetries, m.leaseLost, m.reclaims, m.etcdRTT, m.claimBatches, m.claimsBatched, m.unquarantined, m.noSpace,
		m.blockClaims, m.blocksGivenBack, m.borrowed, m.claimHandovers, m.claimsRefused, m.fallbacks, m.exhaustedRefusals,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_claims_held",
			Help: "Sticky claims held by attachments of this node.",
		}, func() float64 { return float64(len(a.pods.ClaimLeases())) }), m.imports,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_blocks_held",
			Help: "Blocks this node holds, over every pool it serves.",
		}, func() float64 {
			n := 0
			a.pools.ForEachView(func(v *poolview.View) { n += v.Claims().Count() })
			return float64(n)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_leases_held",
			Help: "Leases this agent keeps alive: pods, the node, pre-granted spares.",
		}, func() float64 { return float64(a.keeper.Held()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "leasehold_conflicts_total",
			Help: "Addresses found held by another owner when re-claiming a lost lease.",
		}, func() float64 { return float64(a.conflicts.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_pods",
			Help: "Pods this agent holds a lease for.",
		}, func() float64 {
			return float64(a.pods.Count())
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "leasehold_journal_write_failures_total",
			Help: "Writes of the local journal that failed (a full or failing --state-dir disk); each is retried until one succeeds.",
		}, func() float64 { return float64(a.jw.Failures()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_journal_healthy",
			Help: "1 while the local journal is written; 0 from a failed write until a retry writes every change it missed.",
		}, func() float64 {
			if a.jw.Health() != nil {
				return 0
			}
			return 1
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "leasehold_ready",
			Help: "1 while the agent is ready (what /readyz answers: etcd answers and the journal is written), else 0.",
		}, func() float64 {
			if a.Ready(a.ctx) != nil {
				return 0
			}
			return 1
		}),
		&poolCollector{a: a},
	)
	m.reg.MustRegister(m.live.collectors()...)
	return m
}

// observe records one operation; use as defer a.metrics.observe("add", time.Now(), &err).
func (m *metrics) observe(op string, start time.Time, err *error) {
	result := "ok"
	if *err != nil {
		result = "error"
		if txn.NoSpace(*err) {
			m.noSpace.Inc()
		}
	}
	m.ops.WithLabelValues(op, result).Observe(time.Since(start).Seconds())
}

// batched counts what came of a transaction that carried n claims of concurrent ADDs
// (txn.BatcherConfig.OnBatch).
func (m *metrics) batched(result string, n int) {
	m.claimBatches.WithLabelValues(result).Inc()
	if result == "committed" {
		m.claimsBatched.Add(float64(n))
	}
}

// tried counts what came of an ADD's try of pools[i], the pools it was given in order
// (Agent.Add): found full, it passed to pools[i+1], or, the last, the ADD was refused. At the
// first try, every series this list can count is made at 0, so that an alert on increase()
// sees the first.
func (m *metrics) tried(pools []allocator.PoolSpec, i int, err error) {
	if i == 0 {
		for j, p := range pools {
			m.exhaustedRefusals.WithLabelValues(p.Name)
			if j+1 < len(pools) {
				m.fallbacks.WithLabelValues(p.Name, pools[j+1].Name)
			}
		}
	}
	switch {
	case !errors.Is(err, allocator.ErrPoolExhausted):
	case i+1 < len(pools):
		m.fallbacks.WithLabelValues(pools[i].Name, pools[i+1].Name).Inc()
	default:
		m.exhaustedRefusals.WithLabelValues(pools[i].Name).Inc()
	}
}

// rtt records an etcd round trip that started at start.
func (m *metrics) rtt(kind string, start time.Time) {
	m.etcdRTT.WithLabelValues(kind).Observe(time.Since(start).Seconds())
}

// poolCollector reports, at scrape time, each served pool's size, allocated, quarantined
// and free addresses per range set, from the agent's view (no etcd call), and the ADDs
// refused because it was exhausted.
type poolCollector struct{ a *Agent }

var poolDesc = prometheus.NewDesc("leasehold_pool_addresses",
	"Addresses of a pool's range set by state (size, allocated, quarantined, free), as this agent's view sees them: in the block layout allocated and quarantined count this node's blocks, and free is not given.",
	[]string{"pool", "set", "state"}, nil)

var (
	exhaustedDesc = prometheus.NewDesc("leasehold_pool_exhausted_total",
		"ADDs that found the pool with no free address in a range set (only resting or held-back addresses, or none at all): refused (leasehold_pool_exhausted_refusals_total), or passed to the next pool of their list (leasehold_pool_fallbacks_total).",
		[]string{"pool"}, nil)
	heldBackDesc = prometheus.NewDesc("leasehold_held_back_addresses",
		"Addresses this agent passes over because their holder expired without a release (its node cut off from etcd or dead): in its own blocks, and in the pool as its last borrowing read saw it. They go to other pods only when the pool has no other room, or when the hold ends.",
		[]string{"pool"}, nil)
	heldBackEndDesc = prometheus.NewDesc("leasehold_held_back_first_reusable_seconds",
		"Seconds until the first hold this agent knows of ends (the holder's block lease expires) and its address is free again; absent when none is known.",
		[]string{"pool"}, nil)
)

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- poolDesc
	ch <- exhaustedDesc
	ch <- heldBackDesc
	ch <- heldBackEndDesc
}

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range c.a.pools.Served() {
		// From the pool's first use, at 0: an alert on its increase sees the first refusal.
		ch <- prometheus.MustNewConstMetric(exhaustedDesc, prometheus.CounterValue, float64(p.View.Exhausted()), p.Spec.Name)
		if p.Rev <= 0 {
			continue
		}
		n, first := p.View.HeldBackCount()
		ch <- prometheus.MustNewConstMetric(heldBackDesc, prometheus.GaugeValue, float64(n), p.Spec.Name)
		if !first.IsZero() {
			ch <- prometheus.MustNewConstMetric(heldBackEndDesc, prometheus.GaugeValue, max(time.Until(first).Seconds(), 0), p.Spec.Name)
		}
		alloc, quar := p.View.PerSet(&p.Spec)
		for set := range p.Spec.Ranges {
			size, _ := new(big.Float).SetInt(p.Spec.SetSize(set)).Float64()
			label := fmt.Sprint(set)
			emit := func(state string, v float64) {
				ch <- prometheus.MustNewConstMetric(poolDesc, prometheus.GaugeValue, v, p.Spec.Name, label, state)
			}
			emit("size", size)
			emit("allocated", float64(alloc[set]))
			emit("quarantined", float64(quar[set]))
			if p.View.Blocks().Flat() {
				// In the block layout the view holds this node's blocks only: the pool's free
				// count is leaseholdctl pool list's to give.
				emit("free", max(size-float64(alloc[set]+quar[set]), 0))
			}
		}
	}
}

// Metrics is the agent's Prometheus registry (leaseholdd serves it on --metrics-addr).
func (a *Agent) Metrics() *prometheus.Registry { return a.metrics.reg }

// ErrNotReady is wrapped by Ready's errors.
var ErrNotReady = errors.New("agent not ready")

// Ready reports whether the agent can serve ADDs and keep them: it has heard from etcd within
// the last few seconds, or etcd answers a small read now, and its journal is being written.
// It backs leaseholdd's /readyz. While the journal cannot be written the error also wraps
// ErrJournalUnwritable; ADDs still succeed then, DELs wait for it (podbook.Writer.Sync).
func (a *Agent) Ready(ctx context.Context) error {
	if a.ctx.Err() != nil {
		return fmt.Errorf("%w: shutting down", ErrNotReady)
	}
	if err := a.gate.Answers(ctx, keyspace.NodeKey(a.cfg.Cluster, a.cfg.Node), probeAfter); err != nil {
		return fmt.Errorf("%w: %w", ErrNotReady, err)
	}
	if err := a.jw.Health(); err != nil {
		return fmt.Errorf("%w: %w", ErrNotReady, err)
	}
	return nil
}
