// Package conflicts resolves the agent's conflicts. A conflict is an address of a running
// pod that another owner took while the pod's lease was lost (a cut-off longer than the reuse
// delay, or a pool with no other room). The re-claim leaves it to that owner and records it
// (the conflict record, CHECK code 104, the attachment's Conflicts). It is resolved when it
// can be: the agent watches the address's allocation key, and as soon as the other owner lets
// it go (its DEL, or its lease's expiry) puts it back on the running pod's lease, before any
// other ADD can take it (a release leaves the address in quarantine, which the resolution,
// like every re-claim, does not compare). A running pod's address so never sits without a key.
package conflicts

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
)

// Retry bounds of a resolution that failed, as of the agent's other background retries.
const (
	retryFirst = 100 * time.Millisecond
	retryMax   = 5 * time.Second
)

// Watch is the agent's part that resolves conflicts: it follows each conflicted address of
// the node's pods with a goroutine of its own, and puts the address back on the running pod's
// lease once its other holder lets it go. It owns those goroutines and what it knows of a
// restore's held keys on the pods' addresses (what the pods held when the agent found etcd
// gone back, and the held keys of other owners the re-claim found on them). The agent calls
// it from the re-claim pass (Follow, NoteRestoredHolds, Repaired), DEL (Stop), the notices of
// etcd going back (WentBack, HeldAlso) and Close (Wait). What it needs of the agent is handed
// in when Start makes it (New).
type Watch struct {
	cfg   Config
	ctx   context.Context  // the agent's: the watches end with it
	cli   *clientv3.Client // the gate's
	log   *slog.Logger
	pods  Book
	locks *ownerlock.Locks
	pools *poolview.Pools

	wg sync.WaitGroup // the goroutines following an address
	// mu is over following: the cancel of each address's goroutine.
	mu        sync.Mutex
	following map[podbook.ConflictRef]context.CancelFunc
	// backHeld are the addresses this node's pods held when the agent last found etcd gone
	// back in time (of notice backGen), until the repair after it is done; backSince the
	// lowest revision the agent knows of etcd's history since (0: none); backStart, if
	// started, the lowest HistoryStart read since (the last after notice startGen);
	// restoredHolds the held keys of other owners a restore brought back that the re-claim
	// found on such addresses, by ModRevision.
	rmu           sync.Mutex
	backHeld      map[podbook.ConflictRef]bool
	backGen       uint64
	backSince     int64
	backStart     int64
	startGen      uint64
	started       bool
	restoredHolds map[podbook.ConflictRef]int64
}

// Config is what the conflict watch uses of the agent's Config, and what it is handed of the
// agent's other parts.
type Config struct {
	Cluster   string
	OpTimeout time.Duration
	Log       *slog.Logger
	// HeldFor is the lease and record of the held keys of owner's addresses (the agent's
	// heldFor); Allocation the allocation record of an attachment (the agent's allocation);
	// Mine tells a block lease of this node's.
	HeldFor    func(ctx context.Context, owner string) (clientv3.LeaseID, keyspace.HeldRecord, error)
	Allocation func(req allocator.Request, owner string, lease clientv3.LeaseID, created time.Time) keyspace.Allocation
	Mine       func(clientv3.LeaseID) bool
	// KeepClaim checks the sticky claim of owner's attachment on ifName in pool, and puts
	// back what is not as written, under the owner lock own (sticky.Claims.KeepClaimLocked).
	KeepClaim func(ctx context.Context, own *ownerlock.Owned, owner, ifName, pool string) error
	// HistoryStart is a revision at or below the one etcd's history started from
	// (etcdgate.Gate.HistoryStart).
	HistoryStart func(ctx context.Context) (int64, error)
	// Open is set to the number of addresses followed; Resolved counts the resolutions.
	Open     prometheus.Gauge
	Resolved prometheus.Counter
}

// Book is what the conflict watch asks of the pod book (podbook.Book): the conflicted
// attachments, a pod, and of a change SetConflicts.
type Book interface {
	Conflicted() map[string][]podbook.Attachment
	Snapshot(owner string) (podbook.PodState, bool)
	Change(o *ownerlock.Owned) podbook.Change
}

// New returns a conflict watch following nothing yet, whose goroutines end with ctx (the
// agent's), of the agent whose etcd client (the gate's) is cli, whose pod book is pods, whose
// owner locks are locks and whose pools are pools.
func New(ctx context.Context, cli *clientv3.Client, pods Book, locks *ownerlock.Locks, pools *poolview.Pools, cfg Config) *Watch {
	return &Watch{cfg: cfg, ctx: ctx, cli: cli, log: cfg.Log, pods: pods, locks: locks, pools: pools,
		following: map[podbook.ConflictRef]context.CancelFunc{}, restoredHolds: map[podbook.ConflictRef]int64{}}
}

// Wait returns once every goroutine following an address has ended; the agent's context is
// cancelled first, so that none starts after.
func (cw *Watch) Wait() {
	cw.mu.Lock() // a watch that started goroutines before the cancel is done adding them
	cw.mu.Unlock()
	cw.wg.Wait()
}

// opCtx bounds one etcd request by the operation timeout.
func (cw *Watch) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, cw.cfg.OpTimeout)
}

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (cw *Watch) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// Follow starts following every conflicted address the agent's pods list, and stops
// following those no pod lists any more.
func (cw *Watch) Follow() {
	want := map[podbook.ConflictRef]bool{}
	for owner, ats := range cw.pods.Conflicted() {
		for _, at := range ats {
			for _, addr := range at.Conflicts {
				want[podbook.ConflictRef{Owner: owner, IfName: at.IfName, Pool: at.Pool, Addr: addr}] = true
			}
		}
	}
	cw.rmu.Lock()
	maps.DeleteFunc(cw.restoredHolds, func(ref podbook.ConflictRef, _ int64) bool { return !want[ref] })
	cw.rmu.Unlock()
	cw.mu.Lock()
	defer cw.mu.Unlock()
	if cw.ctx.Err() != nil {
		return
	}
	for ref, stop := range cw.following {
		if !want[ref] {
			stop()
			delete(cw.following, ref)
		}
	}
	for ref := range want {
		if _, ok := cw.following[ref]; !ok {
			cw.followLocked(ref)
		}
	}
	cw.cfg.Open.Set(float64(len(cw.following)))
}

// followLocked starts a goroutine following ref; cw.mu is held.
func (cw *Watch) followLocked(ref podbook.ConflictRef) {
	ctx, stop := context.WithCancel(cw.ctx)
	cw.following[ref] = stop
	cw.wg.Add(1)
	go cw.followConflict(ctx, ref)
}

// followConflict tries to resolve ref, and while the address is held by another owner waits
// for that owner's key to go, until the conflict is resolved or no longer the agent's. The
// other owner lets the address go by its release, which deletes its allocation and held key:
// an expiry of its lease leaves its held key, for its pod may still run on a node cut off, and
// the address stays held back until that hold ends too (but for another pod of the running
// pod's own sticky claim, heldForClaim, and for a hold a restore brought back from before the
// running pod had the address, restoredHold).
func (cw *Watch) followConflict(ctx context.Context, ref podbook.ConflictRef) {
	defer cw.wg.Done()
	defer func() {
		cw.mu.Lock()
		if cw.following[ref] != nil && ctx.Err() == nil {
			delete(cw.following, ref)
		}
		cw.cfg.Open.Set(float64(len(cw.following)))
		cw.mu.Unlock()
	}()
	backoff := retryFirst
	for ctx.Err() == nil {
		key, rev, done, err := cw.resolveConflict(ctx, ref)
		if done {
			return
		}
		if err != nil || key == "" { // key "": the conflict record moved meanwhile
			if err != nil {
				cw.log.Warn("resolving a conflict failed; retrying", "owner", ref.Owner, "ip", ref.Addr, "err", err, "retry_in", backoff)
			}
			wait := time.NewTimer(backoff)
			select {
			case <-ctx.Done():
				wait.Stop()
				return
			case <-wait.C:
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		backoff = retryFirst
		cw.log.Debug("a conflicted address is held by another owner; waiting for its key to go", "owner", ref.Owner, "ip", ref.Addr, "key", key)
		cw.awaitDelete(ctx, key, rev)
	}
}

// awaitDelete returns once key is deleted after revision rev, or the watch breaks, or ctx ends.
func (cw *Watch) awaitDelete(ctx context.Context, key string, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for resp := range cw.cli.Watch(wctx, key, clientv3.WithRev(rev+1), clientv3.WithFilterPut()) {
		if resp.Err() != nil || len(resp.Events) > 0 {
			return
		}
	}
}

// Stop ends the conflict watches of owner's attachments that no longer list them
// (after its DEL).
func (cw *Watch) Stop(owner string) {
	cw.mu.Lock()
	mine := false
	for ref := range cw.following {
		mine = mine || ref.Owner == owner
	}
	cw.mu.Unlock()
	if mine {
		cw.Follow()
	}
}

// NoteRestoredHolds records, for a re-claim of owner's attachment at after etcd went back in
// time, the held keys of other owners (holds, by address) that the restore brought back on
// addresses the pod held when the agent found etcd gone back: their ModRevisions are of
// etcd's history before the pod had these addresses (restoredHold). A hold written since the
// restore (by another node's re-claim, ADD or DEL over an address this pod lost with it, whose
// pod may run with it on a node cut off since) must be waited for, or two pods have the
// address: a hold is the restore's only if its ModRevision is at most both the lowest
// revision the agent heard of each new history (WentBack's since; 0, an audit's finding: no
// hold is) and etcd's HistoryStart read after each notice. The first alone leaves a window:
// another agent may write before this one hears the new history. The second has none: every
// key written since a restore is above it, whoever wrote it, whatever the writer had heard.
// A notice while it is read (another restore) leaves every hold waited for.
func (cw *Watch) NoteRestoredHolds(owner string, at podbook.Attachment, holds map[netip.Addr]int64) {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	candidate := func(ref podbook.ConflictRef, rev int64) bool {
		return cw.backHeld[ref] && !slices.Contains(at.Conflicts, ref.Addr) && rev <= cw.backSince && cw.backSince > 0
	}
	some := false
	for ip, rev := range holds {
		some = some || candidate(podbook.ConflictRef{Owner: owner, IfName: at.IfName, Pool: at.Pool, Addr: ip}, rev)
	}
	if !some {
		return
	}
	if !cw.started || cw.startGen != cw.backGen {
		cw.rmu.Unlock()
		cw.readHistoryStart()
		cw.rmu.Lock()
		if !cw.started || cw.startGen != cw.backGen {
			return
		}
	}
	for ip, rev := range holds {
		ref := podbook.ConflictRef{Owner: owner, IfName: at.IfName, Pool: at.Pool, Addr: ip}
		if candidate(ref, rev) && rev <= cw.backStart {
			cw.restoredHolds[ref] = rev
		}
	}
}

// readHistoryStart reads etcd's HistoryStart after the last notice and keeps the lowest read
// since the notices (backStart); a failed read keeps nothing, and no hold then counts as one
// a restore brought back.
func (cw *Watch) readHistoryStart() {
	cw.rmu.Lock()
	gen := cw.backGen
	cw.rmu.Unlock()
	ctx, cancel := cw.opCtx(cw.ctx)
	defer cancel()
	start, err := cw.cfg.HistoryStart(ctx)
	if err != nil {
		cw.log.Warn("reading where etcd's history started failed; every held key a re-claim finds is waited for", "err", err)
		return
	}
	cw.log.Info("etcd's history since its restore starts above this revision", "revision", start, "notice", gen)
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	if cw.backHeld == nil {
		return // repaired meanwhile
	}
	if !cw.started || start < cw.backStart {
		cw.backStart = start
	}
	cw.startGen, cw.started = max(cw.startGen, gen), true
}

// restoredHold tells whether held, another owner's held key of ref's address, is one a
// restore brought back that the re-claim found on an address the running pod held when the
// agent found etcd gone back: the pod had the address in etcd's history after that hold was
// written, so the hold had ended or been passed over by then, and it keeps the address from
// the pod no longer than the other owner's allocation does. Its block lease may be of a node
// gone since, or of an identity replaced since, which nobody renews and which stands for
// 1.5 x (TTL + reuse delay): waited for, it would keep the running pod from its address for
// that long. A hold written since (its ModRevision moved) is waited for.
func (cw *Watch) restoredHold(ref podbook.ConflictRef, held *mvccpb.KeyValue) bool {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	rev, ok := cw.restoredHolds[ref]
	return ok && rev == held.ModRevision
}

// WentBack records held, the addresses the pods held when the agent found etcd gone back in
// time, since, the lowest revision the agent knows of etcd's history after it (0: none), and
// that notice's generation (gen, read under rmu). A notice before the repair of an earlier
// one is done (another sign of the same restore, found by the audit a moment later) adds to
// what the pods held at the first: a pod whose lease the restore took in between held its
// addresses then; and of the revisions known of the new history, the lowest stands. It reads
// etcd's HistoryStart in the background, while etcd is in the history it found, not one a
// later restore brought. And it follows every conflicted address anew: a watch waits for
// its key's deletion from the revision it read it at, which a plain restore put back below,
// and would miss the other owner letting the address go for as long as etcd took to write
// that many revisions again.
func (cw *Watch) WentBack(held map[podbook.ConflictRef]bool, since int64, gen func() uint64) {
	cw.rmu.Lock()
	if cw.backHeld == nil || cw.backSince == 0 || since != 0 && since < cw.backSince {
		cw.backSince = since
	}
	cw.heldAlsoLocked(held)
	cw.backGen = gen()
	cw.rmu.Unlock()
	cw.mu.Lock()
	defer cw.mu.Unlock()
	if cw.ctx.Err() == nil {
		cw.wg.Go(cw.readHistoryStart)
		for ref, stop := range cw.following {
			stop() // its goroutine, cancelled, leaves the new one's entry alone
			cw.followLocked(ref)
		}
	}
}

// HeldAlso adds held to what the pods held when the agent last found etcd gone back: what
// they held when the suspicion the audit proved arose.
func (cw *Watch) HeldAlso(held map[podbook.ConflictRef]bool) {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	cw.heldAlsoLocked(held)
}

// heldAlsoLocked is HeldAlso under rmu.
func (cw *Watch) heldAlsoLocked(held map[podbook.ConflictRef]bool) {
	if cw.backHeld == nil {
		cw.backHeld = map[podbook.ConflictRef]bool{}
	}
	maps.Copy(cw.backHeld, held)
}

// Repaired forgets what the pods held when etcd went back once the repair after notice gen
// is done and no later notice came: the pods were re-claimed since, and what they held then
// tells nothing more.
func (cw *Watch) Repaired(gen uint64) {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	if gen >= cw.backGen {
		cw.backHeld, cw.backSince, cw.backStart, cw.startGen, cw.started = nil, 0, 0, 0, false
	}
}
