package leases

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/claimloop"
	"github.com/leasehold/leasehold/leases/etcdgate"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/restorehold"
)

// reclaimer is the agent's recovery: the loop that, whenever woken (wake, checkNow), checks
// the keys the agent keeps if that is due, re-claims the pods whose lease or keys were lost,
// finishes the releases recorded while etcd was away, claims again the blocks of its running
// pods after etcd went back in time, frees the held keys no pod holds and sweeps its leases
// of keys a restore put back; and the liveness loop, which releases the pods whose sandbox
// is gone. It owns both loops and the goroutines they start (wait), the wake channel and the
// restore generation its last sweep ran for. The agent calls it from start (start), the keeper's
// and views' signals (wake, checkNow) and a DEL of a pod whose lease was lost (othersSince);
// what it needs of the agent is handed in when Start makes it (Agent.newRecovery).
type reclaimer struct {
	cfg    reclaimConfig
	ctx    context.Context // the agent's: its loops end with it
	cli    *clientv3.Client
	gate   *etcdgate.Gate // History: a key's history, where a compaction is an answer
	keeper *keeper.Keeper
	log    *slog.Logger
	pods   reclaimBook
	locks  *ownerlock.Locks
	pools  *poolview.Pools
	hold   *restorehold.Hold
	blocks *blockLeases

	// auditIfDue runs the audit if one is due (audit.Auditor.IfDue); auditDue makes one due.
	auditIfDue func(context.Context) (lost int, err error)
	auditDue   func()
	// watchConflicts follows the conflicted addresses the pods list (conflicts.go);
	// noteRestoredHolds records held keys a restore brought back (Agent.noteRestoredHolds);
	// repaired says that the repair started at notice gen is done (the pods' addresses at
	// the notice tell nothing more).
	watchConflicts    func()
	noteRestoredHolds func(owner string, at attachment, holds map[netip.Addr]int64)
	repaired          func(gen uint64)
	// dropCopies deletes a pod's own values on other leases (audit.Auditor.DropCopies).
	dropCopies func(context.Context, []*mvccpb.KeyValue) error
	// register writes the node record again; nodeLease is its lease (0: none yet).
	register  func(context.Context) error
	nodeLease func() clientv3.LeaseID
	// What the ADD and DEL paths of the agent do, for a re-claim and a recorded release.
	releaseOwner      func(context.Context, *ownerlock.Owned) error
	releaseAttachment func(context.Context, allocator.Request, *ownerlock.Owned) (int64, error)
	dropPodIfEmpty    func(ctx context.Context, own *ownerlock.Owned, left int64) error
	reportTakenAtDel  func(ctx context.Context, owner string, at attachment)
	heldFor           func(ctx context.Context, owner string) (clientv3.LeaseID, keyspace.HeldRecord, error)
	allocation        func(req allocator.Request, owner string, lease clientv3.LeaseID, created time.Time) keyspace.Allocation
	// loops makes the claim loop of a re-claim and records what a claim applied
	// (leases/claimloop).
	loops *claimloop.Claims
	// keepClaimsOf puts a re-claimed pod's sticky claims back (stickyClaims.keepClaimsOf).
	keepClaimsOf func(context.Context, *ownerlock.Owned) error
	// fail stops the agent: another host took its node identity.
	fail func(error)
	// conflictsFound counts the addresses found taken by another owner (Agent.Conflicts);
	// reclaims the pods re-claimed.
	conflictsFound func(int64) int64
	reclaims       prometheus.Counter

	lost  chan struct{} // wakes the recovery loop (wake)
	swept atomic.Uint64 // the restore hold's generation sweepLeases last ran for
	wg    sync.WaitGroup
}

// reclaimConfig is what the recovery uses of the agent's Config.
type reclaimConfig struct {
	Cluster, Node, NodeUID string
	OpTimeout, ReuseDelay  time.Duration
	// AuditInterval is the time between audits; LivenessInterval between looks for gone
	// sandboxes (<0: none), a pod left alone within LivenessGrace of an ADD.
	AuditInterval, LivenessInterval, LivenessGrace time.Duration
	WallClock                                      func() time.Time
}

// reclaimBook is what the recovery asks of the pod book (podbook.Book).
type reclaimBook interface {
	Lost() []string
	LostPod(owner string) (podState, bool)
	PendingReleases() []string
	ReleasedAttachments(owner string) []attachment
	Idle(grace time.Duration) map[string]string
	StillIdle(owner string, grace time.Duration) (string, bool)
	Snapshot(owner string) (podState, bool)
	Change(o *ownerlock.Owned) podbook.Change
	LeaseOwners() map[clientv3.LeaseID]string
	AddrsByPool() map[string][]netip.Addr
	Wanted(cluster string) map[string]bool
	OwnsAddr(pool string, addr netip.Addr) bool
}

// start starts the recovery loop and the liveness loop, which end with the agent's context.
func (r *reclaimer) start() {
	r.wg.Go(r.reclaimLoop)
	r.wg.Go(r.livenessLoop)
}

// wait returns once the loops and the goroutines they started are done.
func (r *reclaimer) wait() {
	if r != nil {
		r.wg.Wait()
	}
}

// opCtx bounds one etcd request by the operation timeout.
func (r *reclaimer) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, r.cfg.OpTimeout)
}

// wall is the time written into records; see Config.WallClock.
func (r *reclaimer) wall() time.Time { return r.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (r *reclaimer) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// checkNow makes the recovery loop check every key the agent keeps (the audit) and then run
// a whole pass: a key was found changed, a lease that carries keys was lost, etcd may have
// gone back in time, or the agent just started.
func (r *reclaimer) checkNow() {
	r.auditDue()
	r.wake()
}

// wake makes the recovery loop run a whole pass (reclaimAll): a pod's lease or keys were
// lost, a DEL was recorded while etcd was away or while its pod was being re-claimed, or a
// held key of this node no pod lists was found.
func (r *reclaimer) wake() {
	select {
	case r.lost <- struct{}{}:
	default:
	}
}

// reclaimLoop is the agent's recovery: whenever woken (a lease lost, a DEL recorded while
// etcd was away or of a pod being re-claimed, a start, etcd gone back in time) it checks the
// keys it keeps if that is due, re-claims lost leases, finishes recorded releases and frees
// the held keys no pod of this node holds any more, retrying with backoff until etcd answers.
// Every Config.AuditInterval it checks the keys it keeps (leases/audit), and does the rest only
// if that found something.
func (r *reclaimer) reclaimLoop() {
	audits := time.NewTimer(r.auditEvery())
	defer audits.Stop()
	for {
		full, fired := true, false
		select {
		case <-r.ctx.Done():
			return
		case <-r.lost:
		case <-audits.C:
			r.auditDue()
			full, fired = false, true
		}
		backoff := reclaimRetryFirst
		for r.ctx.Err() == nil {
			err := r.reclaimAll(r.ctx, full)
			if err == nil {
				break
			}
			if errors.Is(err, ErrAgentRunning) {
				r.fail(err) // another host took this node identity while etcd could not hear us
				return
			}
			full = true // whatever the pass found, do it all again
			r.log.Warn("recovery incomplete; retrying", "err", err, "retry_in", backoff)
			select {
			case <-r.ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, reclaimRetryMax)
		}
		if fired {
			audits.Reset(r.auditEvery()) // from the end of this audit, however long it took
		}
	}
}

// auditEvery is the time to the next audit: Config.AuditInterval, less up to a tenth at
// random, so that agents started together do not check at once.
func (r *reclaimer) auditEvery() time.Duration {
	d := r.cfg.AuditInterval
	return d - time.Duration(rand.Int64N(int64(d/10)+1))
}

// reclaimAll is one pass of the recovery loop. A pass only for the periodic audit (full
// false) stops after it unless it found lost keys.
func (r *reclaimer) reclaimAll(ctx context.Context, full bool) error {
	gen := r.hold.Pending()
	lost, err := r.auditIfDue(ctx)
	if err != nil {
		return err
	}
	if !full && lost == 0 && r.hold.Pending() == gen {
		return nil
	}
	node := r.nodeLease()
	nodeLost := node != 0 && !r.keeper.Holds(node)
	owners := r.pods.Lost()
	if nodeLost {
		if err := r.register(ctx); err != nil {
			return err
		}
	}
	var errs []error
	for _, owner := range owners {
		errs = append(errs, r.reclaim(ctx, owner))
	}
	for _, owner := range r.pods.PendingReleases() {
		errs = append(errs, r.releasePending(ctx, owner))
	}
	r.watchConflicts()
	if r.hold.Repairing() {
		errs = append(errs, r.reclaimBlocks(ctx))
	}
	// The held keys of pods still being re-claimed stay: the pods list their addresses.
	errs = append(errs, r.settleHeld(ctx))
	if g := r.hold.Generation(); g != r.swept.Load() {
		err := r.sweepLeases(ctx)
		if err == nil {
			r.swept.Store(g)
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if len(r.pods.Lost()) == 0 {
		r.hold.Done(gen) // every running pod holds its keys again: ADDs go on
		r.repaired(gen)  // re-claimed since: what the pods held at the notice tells nothing more
	}
	return nil
}

// livenessLoop releases the pods whose sandbox is gone: the node's own knowledge, never
// another component's. A pod is left alone within LivenessGrace of an ADD.
func (r *reclaimer) livenessLoop() {
	if r.cfg.LivenessInterval < 0 {
		return
	}
	t := time.NewTicker(r.cfg.LivenessInterval)
	defer t.Stop()
	for {
		select {
		case <-r.ctx.Done():
			return
		case <-t.C:
			r.releaseGoneSandboxes(r.ctx)
		}
	}
}

func (r *reclaimer) releaseGoneSandboxes(ctx context.Context) {
	grace := r.cfg.LivenessGrace
	for owner, netns := range r.pods.Idle(grace) {
		if !sandboxGone(netns) {
			continue
		}
		own := r.locks.Lock(owner)
		if netns, ok := r.pods.StillIdle(owner, grace); ok && sandboxGone(netns) {
			r.log.Info("sandbox gone (network namespace removed); releasing its addresses", "owner", owner, "netns", netns)
			if err := r.releaseOwner(ctx, own); err != nil {
				r.log.Warn("release of a gone sandbox failed; will retry", "owner", owner, "err", err)
			}
		}
		own.Unlock()
	}
}
