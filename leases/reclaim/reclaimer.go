package reclaim

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
	"github.com/leasehold/leasehold/leases/node"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/restorehold"
)

// Reclaimer is the agent's recovery: the loop that, whenever woken (Wake, CheckNow), checks
// the keys the agent keeps if that is due, re-claims the pods whose lease or keys were lost,
// finishes the releases recorded while etcd was away, claims again the blocks of its running
// pods after etcd went back in time, puts back the held keys a lost block lease took
// (keepHeld), frees the held keys no pod holds and sweeps its leases of keys a restore put
// back; and the liveness loop, which releases the pods whose sandbox
// is gone. It owns both loops and the goroutines they start (Wait), the wake channel and the
// restore generation its last sweep ran for. The agent calls it from start (Start), the keeper's
// and views' signals (Wake, CheckNow) and a DEL of a pod whose lease was lost (OthersSince);
// what it needs of the agent is handed in when the agent makes it (Config).
type Reclaimer struct {
	cfg Config
	ctx context.Context // the agent's: its loops end with it

	lost  chan struct{} // wakes the recovery loop (Wake)
	swept atomic.Uint64 // the restore hold's generation SweepLeases last ran for
	wg    sync.WaitGroup

	// heldGone: a block lease of this node was lost, and with it held keys of its running
	// pods; the next pass puts them back (keepHeld, HeldLost).
	heldGone atomic.Bool
}

// Config is what the recovery is handed of the agent.
type Config struct {
	Cluster, Node, NodeUID string
	OpTimeout, ReuseDelay  time.Duration
	// AuditInterval is the time between audits; LivenessInterval between looks for gone
	// sandboxes (<0: none), a pod left alone within LivenessGrace of an ADD.
	AuditInterval, LivenessInterval, LivenessGrace time.Duration
	WallClock                                      func() time.Time

	Client *clientv3.Client // the gate's
	Gate   *etcdgate.Gate   // History: a key's history, where a compaction is an answer
	Keeper *keeper.Keeper
	Log    *slog.Logger
	Pods   Book
	Locks  *ownerlock.Locks
	Pools  *poolview.Pools
	Hold   *restorehold.Hold
	// BlockLeases are this node's block leases; MineBlockLease tells whether a lease is one.
	BlockLeases    func() []clientv3.LeaseID
	MineBlockLease func(clientv3.LeaseID) bool

	// AuditIfDue runs the audit if one is due (audit.Auditor.IfDue); AuditDue makes one due.
	AuditIfDue func(context.Context) (lost int, err error)
	AuditDue   func()
	// WatchConflicts follows the conflicted addresses the pods list (the conflicts);
	// NoteRestoredHolds records held keys a restore brought back; Repaired says that the
	// repair started at notice gen is done (the pods' addresses at the notice tell nothing
	// more).
	WatchConflicts    func()
	NoteRestoredHolds func(owner string, at podbook.Attachment, holds map[netip.Addr]int64)
	Repaired          func(gen uint64)
	// DropCopies deletes a pod's own values on other leases (audit.Auditor.DropCopies).
	DropCopies func(context.Context, []*mvccpb.KeyValue) error
	// Register writes the node record again; NodeLease is its lease (0: none yet).
	Register  func(context.Context) error
	NodeLease func() clientv3.LeaseID
	// What the ADD and DEL paths of the agent do, for a re-claim and a recorded release.
	ReleaseOwner      func(context.Context, *ownerlock.Owned) error
	ReleaseAttachment func(context.Context, allocator.Request, *ownerlock.Owned) (int64, error)
	DropPodIfEmpty    func(ctx context.Context, own *ownerlock.Owned, left int64) error
	ReportTakenAtDel  func(ctx context.Context, owner string, at podbook.Attachment)
	HeldFor           func(ctx context.Context, owner string) (clientv3.LeaseID, keyspace.HeldRecord, error)
	Allocation        func(req allocator.Request, owner string, lease clientv3.LeaseID, created time.Time) keyspace.Allocation
	// Loops makes the claim loop of a re-claim and records what a claim applied
	// (leases/claimloop).
	Loops *claimloop.Claims
	// KeepClaimsOf puts a re-claimed pod's sticky claims back (the sticky claims').
	KeepClaimsOf func(context.Context, *ownerlock.Owned) error
	// ReclaimTarget re-claims a live migration's target on lease (the sticky claims'
	// ReclaimTarget): rev is its owner index's ModRevision, promoted that it holds the claim
	// alone now, claimLease the claim lease its keys name; ok false: re-claimed as any
	// attachment.
	ReclaimTarget func(ctx context.Context, ps podbook.PodState, at podbook.Attachment, lease clientv3.LeaseID,
		blocks allocator.Blocks) (rev int64, claimLease clientv3.LeaseID, promoted, ok bool, err error)
	// Fail stops the agent: another host took its node identity.
	Fail func(error)
	// ConflictsFound counts the addresses found taken by another owner (Agent.Conflicts);
	// Reclaims the pods re-claimed.
	ConflictsFound func(int64) int64
	Reclaims       prometheus.Counter
}

// Book is what the recovery asks of the pod book (podbook.Book).
type Book interface {
	Lost() []string
	LostPod(owner string) (podbook.PodState, bool)
	PendingReleases() []string
	ReleasedAttachments(owner string) []podbook.Attachment
	Idle(grace time.Duration) map[string]string
	StillIdle(owner string, grace time.Duration) (string, bool)
	Snapshot(owner string) (podbook.PodState, bool)
	Change(o *ownerlock.Owned) podbook.Change
	LeaseOwners() map[clientv3.LeaseID]string
	AddrsByPool() map[string][]netip.Addr
	Wanted(cluster string) map[string]bool
	OwnsAddr(pool string, addr netip.Addr) bool
}

var _ Book = (*podbook.Book)(nil)

// Bounds of the recovery's retries: a pass that fails is run again after retryFirst,
// doubling up to retryMax, while it waits for etcd to come back.
const (
	retryFirst = 200 * time.Millisecond
	retryMax   = 10 * time.Second
)

// New makes the recovery; Start starts its loops, which end with ctx, the agent's.
func New(ctx context.Context, cfg Config) *Reclaimer {
	return &Reclaimer{cfg: cfg, ctx: ctx, lost: make(chan struct{}, 1)}
}

// Start starts the recovery loop and the liveness loop, which end with the agent's context.
func (r *Reclaimer) Start() {
	r.wg.Go(r.reclaimLoop)
	r.wg.Go(r.livenessLoop)
}

// Wait returns once the loops and the goroutines they started are done.
func (r *Reclaimer) Wait() {
	if r != nil {
		r.wg.Wait()
	}
}

// opCtx bounds one etcd request by the operation timeout.
func (r *Reclaimer) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, r.cfg.OpTimeout)
}

// wall is the time written into records; see Config.WallClock.
func (r *Reclaimer) wall() time.Time { return r.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (r *Reclaimer) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// CheckNow makes the recovery loop check every key the agent keeps (the audit) and then run
// a whole pass: a key was found changed, a lease that carries keys was lost, etcd may have
// gone back in time, or the agent just started.
func (r *Reclaimer) CheckNow() {
	r.cfg.AuditDue()
	r.Wake()
}

// Wake makes the recovery loop run a whole pass (reclaimAll): a pod's lease or keys were
// lost, a DEL was recorded while etcd was away or while its pod was being re-claimed, or a
// held key of this node no pod lists was found.
func (r *Reclaimer) Wake() {
	select {
	case r.lost <- struct{}{}:
	default:
	}
}

// HeldLost makes the recovery loop put back the held keys of the running pods (keepHeld) in
// its next pass: a block lease of this node is gone from etcd.
func (r *Reclaimer) HeldLost() {
	r.heldGone.Store(true)
	r.Wake()
}

// reclaimLoop is the agent's recovery: whenever woken (a lease lost, a DEL recorded while
// etcd was away or of a pod being re-claimed, a start, etcd gone back in time) it checks the
// keys it keeps if that is due, re-claims lost leases, finishes recorded releases and frees
// the held keys no pod of this node holds any more, retrying with backoff until etcd answers.
// Every Config.AuditInterval it checks the keys it keeps (leases/audit), and does the rest only
// if that found something.
func (r *Reclaimer) reclaimLoop() {
	audits := time.NewTimer(r.auditEvery())
	defer audits.Stop()
	for {
		full, fired := true, false
		select {
		case <-r.ctx.Done():
			return
		case <-r.lost:
		case <-audits.C:
			r.cfg.AuditDue()
			full, fired = false, true
		}
		backoff := retryFirst
		for r.ctx.Err() == nil {
			err := r.reclaimAll(r.ctx, full)
			if err == nil {
				break
			}
			if errors.Is(err, node.ErrAgentRunning) {
				r.cfg.Fail(err) // another host took this node identity while etcd could not hear us
				return
			}
			full = true // whatever the pass found, do it all again
			r.cfg.Log.Warn("recovery incomplete; retrying", "err", err, "retry_in", backoff)
			select {
			case <-r.ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, retryMax)
		}
		if fired {
			audits.Reset(r.auditEvery()) // from the end of this audit, however long it took
		}
	}
}

// auditEvery is the time to the next audit: Config.AuditInterval, less up to a tenth at
// random, so that agents started together do not check at once.
func (r *Reclaimer) auditEvery() time.Duration {
	d := r.cfg.AuditInterval
	return d - time.Duration(rand.Int64N(int64(d/10)+1))
}

// reclaimAll is one pass of the recovery loop. A pass only for the periodic audit (full
// false) stops after it unless it found lost keys.
func (r *Reclaimer) reclaimAll(ctx context.Context, full bool) error {
	gen := r.cfg.Hold.Pending()
	lost, err := r.cfg.AuditIfDue(ctx)
	if err != nil {
		return err
	}
	if !full && lost == 0 && r.cfg.Hold.Pending() == gen {
		return nil
	}
	node := r.cfg.NodeLease()
	nodeLost := node != 0 && !r.cfg.Keeper.Holds(node)
	owners := r.cfg.Pods.Lost()
	if nodeLost {
		if err := r.cfg.Register(ctx); err != nil {
			return err
		}
	}
	var errs []error
	for _, owner := range owners {
		errs = append(errs, r.reclaim(ctx, owner))
	}
	for _, owner := range r.cfg.Pods.PendingReleases() {
		errs = append(errs, r.releasePending(ctx, owner))
	}
	r.cfg.WatchConflicts()
	if r.cfg.Hold.Repairing() {
		errs = append(errs, r.reclaimBlocks(ctx))
	}
	if r.heldGone.Swap(false) {
		if err := r.keepHeld(ctx); err != nil {
			r.heldGone.Store(true)
			errs = append(errs, err)
		}
	}
	// The held keys of pods still being re-claimed stay: the pods list their addresses.
	errs = append(errs, r.settleHeld(ctx))
	if g := r.cfg.Hold.Generation(); g != r.swept.Load() {
		err := r.SweepLeases(ctx)
		if err == nil {
			r.swept.Store(g)
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if len(r.cfg.Pods.Lost()) == 0 {
		r.cfg.Hold.Done(gen) // every running pod holds its keys again: ADDs go on
		r.cfg.Repaired(gen)  // re-claimed since: what the pods held at the notice tells nothing more
	}
	return nil
}
