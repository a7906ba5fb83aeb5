package leases

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/restorehold"
)

// restoreNotices is what the agent does when it finds etcd gone back in time (restored from
// a backup, or replaced): by the gate's proof or suspicion, an audit's finding, or another
// agent's word under keyspace.RestoredKey (restored.go). It starts the repair and the settle
// time (leases/restorehold), lists the views' pools again, has the recovery check every key and
// register the node again, tells the other agents, and saves the settle time for a restart
// (restorefile.go). It owns the loop that follows the other agents' word (restoredLoop) and
// the goroutines that tell them and save the settle time. The gate calls it (etcdWentBackFrom,
// etcdMayHaveGoneBack), as do the audit and the start-up pass (etcdWentBack); what it needs of
// the agent is handed in when Start makes it (Agent.newRecovery).
type restoreNotices struct {
	cfg    noticeConfig
	ctx    context.Context // the agent's: its loop ends with it
	cli    *clientv3.Client
	log    *slog.Logger
	hold   *restorehold.Hold
	keeper *keeper.Keeper
	pools  *poolview.Pools
	// heldAddrs are the addresses the pods held at a time (podbook.Book.HeldAddrs);
	// noteBackHeld keeps them, as of the notice generation gen gives, read under its own
	// lock so that two notices close together leave the later one (conflictWatch.wentBack).
	heldAddrs    func(lostSince time.Time) map[conflictRef]bool
	noteBackHeld func(held map[conflictRef]bool, gen func() uint64)
	// nodeLease is the node record's lease (0: none yet).
	nodeLease func() clientv3.LeaseID
	// checkNow and wake are the recovery's (reclaimer): check every key and run a whole
	// pass, or run a whole pass.
	checkNow, wake func()
	// suspect marks etcd suspected of going back, for the next audit; it reports whether it
	// was already.
	suspect func() (already bool)
	// wentBackCount counts the notices.
	wentBackCount prometheus.Counter

	wg sync.WaitGroup
}

// noticeConfig is what the restore notices use of the agent's Config.
type noticeConfig struct {
	Cluster, Node string
	// LeaseTTL is the pods' lease TTL: the backup's leases of pods deleted since live it out.
	LeaseTTL, OpTimeout time.Duration
	// StateDir keeps the settle time (settleFile); "" keeps none.
	StateDir string
}

// start follows the other agents' word from rev, the revision Start read it at.
func (w *restoreNotices) start(rev int64) {
	w.wg.Go(func() { w.restoredLoop(rev) })
}

// wait returns once the loop is done.
func (w *restoreNotices) wait() {
	if w != nil {
		w.wg.Wait()
	}
}

// opCtx bounds one etcd request by the operation timeout.
func (w *restoreNotices) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, w.cfg.OpTimeout)
}

// etcdWentBack is the gate's proof, or an audit's finding, that etcd went back in time. The
// pods are checked, the views listed again (keeping what they knew allocated for the settle
// time), the node registered again and the spare leases revoked with whatever a backup put
// back on them; ADDs wait for the repair (leases/restorehold).
func (w *restoreNotices) etcdWentBack(why string) { w.etcdWentBackFrom(why, time.Now()) }

// etcdWentBackFrom is etcdWentBack for the gate's proof, which dates the new history from
// the first answer of it the gate heard (from): a pod lease the keeper found lost on such an
// answer before the proof was lost to the restore, and its pod held its addresses until then.
func (w *restoreNotices) etcdWentBackFrom(why string, from time.Time) {
	until := w.wentBackFrom(why, from)
	go w.announceRestore(until, why)
}

// wentBack is etcdWentBack without telling the other agents (restored.go), for a restore
// they told this agent of. It returns the end of the settle time.
func (w *restoreNotices) wentBack(why string) time.Time { return w.wentBackFrom(why, time.Now()) }

// wentBackFrom is wentBack with the new history dated from from (etcdWentBackFrom).
func (w *restoreNotices) wentBackFrom(why string, from time.Time) time.Time {
	held := w.heldAddrs(from) // before the audit takes the pods whose keys went
	until := w.hold.Notice(why)
	// A notice before the repair of an earlier one is done (another sign of the same restore,
	// found by the audit a moment later) adds to what the pods held at the first: a pod whose
	// lease the restore took in between held its addresses then.
	w.noteBackHeld(held, w.hold.Generation)
	w.wentBackCount.Inc()
	_, settled, _ := w.hold.SettleEnds()
	w.log.Error("etcd went back in time (restored from a backup, or replaced); checking every key of this node's pods, "+
		"listing every pool again and registering the node again; ADDs wait until the pods hold their addresses again",
		"why", why, "no_new_blocks_until", settled.UTC().Format(time.RFC3339), "keeps_known_addresses_until", until.UTC().Format(time.RFC3339))
	go w.saveSettle(w.pools.RestartAll(until))
	if node := w.nodeLease(); node != 0 {
		w.keeper.Forget(node) // the re-claim loop registers a node whose lease it no longer holds
	}
	w.keeper.DropSpares()
	w.checkNow()
	// The backup's leases of pods deleted since live out their TTL, and their allocations
	// keep the held keys of their addresses from being freed (settleHeld) until then.
	time.AfterFunc(w.cfg.LeaseTTL*3/2, w.wake)
	return until
}

// etcdMayHaveGoneBack is the gate's suspicion that etcd went back in time without a sign in
// its revisions (a compacted watch): the pods are checked at once, and keys found lost then
// count as the proof.
func (w *restoreNotices) etcdMayHaveGoneBack(why string) {
	if !w.suspect() {
		w.log.Info("etcd may have gone back in time; checking every key of this node's pods", "why", why)
	}
	w.checkNow()
}
