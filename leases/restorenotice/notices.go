// Package restorenotice is what the agent does when it finds etcd gone back in time
// (restored from a backup, or replaced), or another agent tells it so; docs/agent.md,
// "Restore notices".
package restorenotice

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/restorehold"
)

// Notices is what the agent does when it finds etcd gone back in time (restored from a
// backup, or replaced): by the gate's proof or suspicion, an audit's finding, or another
// agent's word under keyspace.RestoredKey (restored.go). It starts the repair and the settle
// time (leases/restorehold), lists the views' pools again, has the recovery check every key and
// register the node again, tells the other agents, and saves the settle time for a restart
// (settlefile.go). It owns the loop that follows the other agents' word (restoredLoop) and
// the goroutines that tell them and save the settle time. The gate calls it (EtcdWentBackFrom,
// EtcdMayHaveGoneBack), as do the audit and the start-up pass (EtcdWentBack); what it needs of
// the agent is handed in when the agent makes it (Config).
type Notices struct {
	cfg Config
	ctx context.Context // the agent's: its loop ends with it
	wg  sync.WaitGroup
	// mu guards waiting: once Wait began, work for the background (a notice's announcement
	// and its settle file) runs on the caller's goroutine, so that none outlives Wait.
	mu      sync.Mutex
	waiting bool
}

// Config is what the restore notices are handed of the agent.
type Config struct {
	Cluster, Node string
	// LeaseTTL is the pods' lease TTL: the backup's leases of pods deleted since live it out.
	LeaseTTL, OpTimeout time.Duration
	// RetryFirst and RetryMax bound the backoff of the loop that follows the restored key.
	RetryFirst, RetryMax time.Duration
	// StateDir keeps the settle time (settleFile); "" keeps none.
	StateDir string

	Client *clientv3.Client // the gate's
	Log    *slog.Logger
	Hold   *restorehold.Hold
	Keeper *keeper.Keeper
	Pools  *poolview.Pools
	// Relist lists again the selection rules and pools' access the ADDs choose by.
	Relist func()
	// HeldAddrs are the addresses the pods held at a time (podbook.Book.HeldAddrs);
	// NoteBackHeld keeps them, and since, the lowest revision known of etcd's new history
	// (0: none), as of the notice generation gen gives, read under its own lock so that two
	// notices close together leave the later one (the agent's conflicts).
	HeldAddrs    func(lostSince time.Time) map[podbook.ConflictRef]bool
	NoteBackHeld func(held map[podbook.ConflictRef]bool, since int64, gen func() uint64)
	// FirstOfHistory is the gate's lowest revision of etcd's history since its proof
	// (etcdgate.Gate.FirstOfHistory).
	FirstOfHistory func() int64
	// NodeLease is the node record's lease (0: none yet).
	NodeLease func() clientv3.LeaseID
	// CheckNow and Wake are the recovery's: check every key and run a whole pass, or run a
	// whole pass.
	CheckNow, Wake func()
	// Suspect marks etcd suspected of going back, for the next audit; it reports whether it
	// was already.
	Suspect func() (already bool)
	// WentBackCount counts the notices.
	WentBackCount prometheus.Counter
}

// New makes the restore notices; ctx is the agent's, which the loop Start runs ends with.
func New(ctx context.Context, cfg Config) *Notices { return &Notices{cfg: cfg, ctx: ctx} }

// Start follows the other agents' word from rev, the revision the agent's start read it at
// (ReadRestored; 0: read it first).
func (w *Notices) Start(rev int64) {
	w.wg.Go(func() { w.restoredLoop(rev) })
}

// Wait returns once the loop, and the work a notice left to the background, is done; a
// nil Notices has none.
func (w *Notices) Wait() {
	if w != nil {
		w.mu.Lock()
		w.waiting = true
		w.mu.Unlock()
		w.wg.Wait()
	}
}

// background runs f on a goroutine Wait waits for, or, once Wait began, at once.
func (w *Notices) background(f func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.waiting {
		f()
		return
	}
	w.wg.Go(f)
}

// opCtx bounds one etcd request by the operation timeout.
func (w *Notices) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, w.cfg.OpTimeout)
}

// EtcdWentBack is the gate's proof, or an audit's finding, that etcd went back in time. The
// pods are checked, the views listed again (keeping what they knew allocated for the settle
// time), the node registered again and the spare leases revoked with whatever a backup put
// back on them; ADDs wait for the repair (leases/restorehold).
func (w *Notices) EtcdWentBack(why string) {
	until := w.wentBackFrom(why, time.Now(), 0)
	w.background(func() { w.announceRestore(until, why) })
}

// EtcdWentBackFrom is EtcdWentBack for the gate's proof, which dates the new history from
// the first answer of it the gate heard (from): a pod lease the keeper found lost on such an
// answer before the proof was lost to the restore, and its pod held its addresses until then.
// The gate's lowest revision of the new history comes with it.
func (w *Notices) EtcdWentBackFrom(why string, from time.Time) {
	until := w.wentBackFrom(why, from, w.cfg.FirstOfHistory())
	w.background(func() { w.announceRestore(until, why) })
}

// WentBack is EtcdWentBack without telling the other agents (restored.go), for a restore
// they told this agent of. It returns the end of the settle time.
func (w *Notices) WentBack(why string) time.Time { return w.wentBackFrom(why, time.Now(), 0) }

// wentBackFrom is WentBack with the new history dated from from (EtcdWentBackFrom), and
// since, the lowest revision known of it (0: none): a held key of another owner with a lower
// ModRevision may be one the restore brought back (leases/conflicts).
func (w *Notices) wentBackFrom(why string, from time.Time, since int64) time.Time {
	held := w.cfg.HeldAddrs(from) // before the audit takes the pods whose keys went
	until := w.cfg.Hold.Notice(why)
	// A notice before the repair of an earlier one is done (another sign of the same restore,
	// found by the audit a moment later) adds to what the pods held at the first: a pod whose
	// lease the restore took in between held its addresses then.
	w.cfg.NoteBackHeld(held, since, w.cfg.Hold.Generation)
	w.cfg.WentBackCount.Inc()
	_, settled, _ := w.cfg.Hold.SettleEnds()
	w.cfg.Log.Error("etcd went back in time (restored from a backup, or replaced); checking every key of this node's pods, "+
		"listing every pool again and registering the node again; ADDs wait until the pods hold their addresses again",
		"why", why, "no_new_blocks_until", settled.UTC().Format(time.RFC3339), "keeps_known_addresses_until", until.UTC().Format(time.RFC3339))
	kept := w.cfg.Pools.RestartAll(until)
	if w.cfg.Relist != nil {
		w.cfg.Relist()
	}
	w.background(func() { w.saveSettle(kept) })
	if node := w.cfg.NodeLease(); node != 0 {
		w.cfg.Keeper.Forget(node) // the re-claim loop registers a node whose lease it no longer holds
	}
	w.cfg.Keeper.DropSpares()
	w.cfg.CheckNow()
	// The backup's leases of pods deleted since live out their TTL, and their allocations
	// keep the held keys of their addresses from being freed (settleHeld) until then.
	time.AfterFunc(w.cfg.LeaseTTL*3/2, w.cfg.Wake)
	return until
}

// EtcdMayHaveGoneBack is the gate's suspicion that etcd went back in time without a sign in
// its revisions (a compacted watch): the pods are checked at once, and keys found lost then
// count as the proof.
func (w *Notices) EtcdMayHaveGoneBack(why string) {
	if !w.cfg.Suspect() {
		w.cfg.Log.Info("etcd may have gone back in time; checking every key of this node's pods", "why", why)
	}
	w.cfg.CheckNow()
}
