package leases

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

// A conflict is an address of a running pod that another owner took while the pod's lease was
// lost (a cut-off longer than the reuse delay, or a pool with no other room). The re-claim
// leaves it to that owner and records it (the conflict record, CHECK code 104, the
// attachment's Conflicts). It is resolved when it can be: the agent watches the address's
// allocation key, and as soon as the other owner lets it go (its DEL, or its lease's
// expiry) puts it back on the running pod's lease, before any other ADD can take it (a
// release leaves the address in quarantine, which the resolution, like every re-claim, does
// not compare). A running pod's address so never sits without a key.

// conflictWatch is the agent's part that resolves conflicts: it follows each conflicted
// address of the node's pods with a goroutine of its own, and puts the address back on the
// running pod's lease once its other holder lets it go. It owns those goroutines and what it
// knows of a restore's held keys on the pods' addresses (what the pods held when the agent
// found etcd gone back, and the held keys of other owners the re-claim found on them). The
// agent calls it from the re-claim pass (watch, noteRestoredHolds, repaired), DEL (stop), the
// notices of etcd going back (wentBack, heldAlso) and Close (wait). What it needs of the agent
// is handed in when Start makes it.
type conflictWatch struct {
	cfg   conflictConfig
	ctx   context.Context  // the agent's: the watches end with it
	cli   *clientv3.Client // the gate's
	log   *slog.Logger
	pods  conflictBook
	locks *ownerlock.Locks
	pools *poolview.Pools
	// heldFor is the lease and record of the held keys of owner's addresses (Agent.heldFor);
	// allocation the allocation record of an attachment (Agent.allocation); mine tells a
	// block lease of this node's.
	heldFor    func(ctx context.Context, owner string) (clientv3.LeaseID, keyspace.HeldRecord, error)
	allocation func(req allocator.Request, owner string, lease clientv3.LeaseID, created time.Time) keyspace.Allocation
	mine       func(clientv3.LeaseID) bool
	// keepClaim checks the sticky claim of owner's attachment on ifName in pool, and puts
	// back what is not as written, under the owner lock own (sticky.Claims.KeepClaimLocked).
	keepClaim func(ctx context.Context, own *ownerlock.Owned, owner, ifName, pool string) error
	// open is set to the number of addresses followed; resolved counts the resolutions.
	open     prometheus.Gauge
	resolved prometheus.Counter

	wg sync.WaitGroup // the goroutines following an address
	// mu is over following: the cancel of each address's goroutine.
	mu        sync.Mutex
	following map[conflictRef]context.CancelFunc
	// backHeld are the addresses this node's pods held when the agent last found etcd gone
	// back in time (of notice backGen), until the repair after it is done; restoredHolds the
	// held keys of other owners a restore brought back that the re-claim found on such
	// addresses, by ModRevision.
	rmu           sync.Mutex
	backHeld      map[conflictRef]bool
	backGen       uint64
	restoredHolds map[conflictRef]int64
}

// conflictConfig is what the conflict watch uses of the agent's Config.
type conflictConfig struct {
	Cluster   string
	OpTimeout time.Duration
}

// conflictBook is what the conflict watch asks of the pod book (podbook.Book): the conflicted
// attachments, a pod, and of a change SetConflicts.
type conflictBook interface {
	Conflicted() map[string][]attachment
	Snapshot(owner string) (podState, bool)
	Change(o *ownerlock.Owned) podbook.Change
}

// newConflictWatch returns a conflict watch following nothing yet; Start fills in the rest.
func newConflictWatch() *conflictWatch {
	return &conflictWatch{following: map[conflictRef]context.CancelFunc{}, restoredHolds: map[conflictRef]int64{}}
}

// wait returns once every goroutine following an address has ended; the agent's context is
// cancelled first, so that none starts after.
func (cw *conflictWatch) wait() {
	cw.mu.Lock() // a watch that started goroutines before the cancel is done adding them
	cw.mu.Unlock()
	cw.wg.Wait()
}

// opCtx bounds one etcd request by the operation timeout.
func (cw *conflictWatch) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, cw.cfg.OpTimeout)
}

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (cw *conflictWatch) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// watch starts following every conflicted address the agent's pods list, and stops
// following those no pod lists any more.
func (cw *conflictWatch) watch() {
	want := map[conflictRef]bool{}
	for owner, ats := range cw.pods.Conflicted() {
		for _, at := range ats {
			for _, addr := range at.Conflicts {
				want[conflictRef{Owner: owner, IfName: at.IfName, Pool: at.Pool, Addr: addr}] = true
			}
		}
	}
	cw.rmu.Lock()
	maps.DeleteFunc(cw.restoredHolds, func(ref conflictRef, _ int64) bool { return !want[ref] })
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
		if _, ok := cw.following[ref]; ok {
			continue
		}
		ctx, stop := context.WithCancel(cw.ctx)
		cw.following[ref] = stop
		cw.wg.Add(1)
		go cw.followConflict(ctx, ref)
	}
	cw.open.Set(float64(len(cw.following)))
}

// followConflict tries to resolve ref, and while the address is held by another owner waits
// for that owner's key to go, until the conflict is resolved or no longer the agent's. The
// other owner lets the address go by its release, which deletes its allocation and held key:
// an expiry of its lease leaves its held key, for its pod may still run on a node cut off, and
// the address stays held back until that hold ends too (but for another pod of the running
// pod's own sticky claim, heldForClaim, and for a hold a restore brought back from before the
// running pod had the address, restoredHold).
func (cw *conflictWatch) followConflict(ctx context.Context, ref conflictRef) {
	defer cw.wg.Done()
	defer func() {
		cw.mu.Lock()
		if cw.following[ref] != nil && ctx.Err() == nil {
			delete(cw.following, ref)
		}
		cw.open.Set(float64(len(cw.following)))
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
			if !sleepCtx(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		backoff = retryFirst
		cw.awaitDelete(ctx, key, rev)
	}
}

// awaitDelete returns once key is deleted after revision rev, or the watch breaks, or ctx ends.
func (cw *conflictWatch) awaitDelete(ctx context.Context, key string, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for resp := range cw.cli.Watch(wctx, key, clientv3.WithRev(rev+1), clientv3.WithFilterPut()) {
		if resp.Err() != nil || len(resp.Events) > 0 {
			return
		}
	}
}

// stop ends the conflict watches of owner's attachments that no longer list them
// (after its DEL).
func (cw *conflictWatch) stop(owner string) {
	cw.mu.Lock()
	mine := false
	for ref := range cw.following {
		mine = mine || ref.Owner == owner
	}
	cw.mu.Unlock()
	if mine {
		cw.watch()
	}
}

// noteRestoredHolds records, for a re-claim of owner's attachment at after etcd went back in
// time, the held keys of other owners (holds, by address) on addresses the pod held when the
// agent found etcd gone back: keys the restore brought back, for their ModRevisions are of
// etcd's history before the pod had these addresses (restoredHold).
func (cw *conflictWatch) noteRestoredHolds(owner string, at attachment, holds map[netip.Addr]int64) {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	for ip, rev := range holds {
		ref := conflictRef{Owner: owner, IfName: at.IfName, Pool: at.Pool, Addr: ip}
		if cw.backHeld[ref] && !slices.Contains(at.Conflicts, ip) {
			cw.restoredHolds[ref] = rev
		}
	}
}

// restoredHold tells whether held, another owner's held key of ref's address, is one a
// restore brought back that the re-claim found on an address the running pod held when the
// agent found etcd gone back: the pod had the address in etcd's history after that hold was
// written, so the hold had ended or been passed over by then, and it keeps the address from
// the pod no longer than the other owner's allocation does. Its block lease may be of a node
// gone since, or of an identity replaced since, which nobody renews and which stands for
// 1.5 x (TTL + reuse delay): waited for, it would keep the running pod from its address for
// that long. A hold written since (its ModRevision moved) is waited for.
func (cw *conflictWatch) restoredHold(ref conflictRef, held *mvccpb.KeyValue) bool {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	rev, ok := cw.restoredHolds[ref]
	return ok && rev == held.ModRevision
}

// wentBack records held, the addresses the pods held when the agent found etcd gone back in
// time, and that notice's generation (gen, read under rmu). A notice before the repair of an
// earlier one is done (another sign of the same restore, found by the audit a moment later)
// adds to what the pods held at the first: a pod whose lease the restore took in between
// held its addresses then.
func (cw *conflictWatch) wentBack(held map[conflictRef]bool, gen func() uint64) {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	cw.heldAlsoLocked(held)
	cw.backGen = gen()
}

// heldAlso adds held to what the pods held when the agent last found etcd gone back: what
// they held when the suspicion the audit proved arose.
func (cw *conflictWatch) heldAlso(held map[conflictRef]bool) {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	cw.heldAlsoLocked(held)
}

// heldAlsoLocked is heldAlso under rmu.
func (cw *conflictWatch) heldAlsoLocked(held map[conflictRef]bool) {
	if cw.backHeld == nil {
		cw.backHeld = map[conflictRef]bool{}
	}
	maps.Copy(cw.backHeld, held)
}

// repaired forgets what the pods held when etcd went back once the repair after notice gen
// is done and no later notice came: the pods were re-claimed since, and what they held then
// tells nothing more.
func (cw *conflictWatch) repaired(gen uint64) {
	cw.rmu.Lock()
	defer cw.rmu.Unlock()
	if gen >= cw.backGen {
		cw.backHeld = nil
	}
}
