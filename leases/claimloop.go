package leases

import (
	"context"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/txn"
)

// The claim loop. ADD (tryAdd), import (importAttachment) and re-claim (reclaimAttachment)
// each send claims for one attachment until etcd answers one. What a claim can come to
// besides an answer is handled here, once, for all three:
//
//   - etcd refused it because the node's block lease, which its held keys go on, is gone:
//     the block claims and held keys went with it; the caller builds the claim again on a
//     new block lease (heldLeaseGone).
//   - etcd refused it because the spare lease taken for an owner the agent did not know is
//     gone (expired, or revoked from outside): it is forgotten, and the claim goes again on
//     another spare.
//   - etcd refused it because the owner's own lease is gone, or for any other cause (the
//     NOSPACE alarm, a permission, too many requests): nothing applied; the caller's policy
//     gives the answer.
//   - its answer was lost, so it may have applied: the spare lease is bound to the owner,
//     never handed to another pod (a DEL revokes it), and the pod book marks the owner
//     unanswered; the caller's policy waits and has it sent again, or answers. Sending again
//     is safe: every claim compares the owner index absent, so at most one of them applies,
//     whichever etcd orders first, even if the lost one is applied late by a new leader.
//
// What an answer says (applied, the attachment found, addresses taken, the pod record
// elsewhere) is each caller's: an ADD chooses other addresses, an import reports conflicts, a
// re-claim records them.

// claimLoop is one caller's claims for one attachment of the owner whose lock own is.
type claimLoop struct {
	a      *Agent
	own    *ownerlock.Owned
	req    allocator.Request // the attachment, as the pod book records it when a claim may have applied
	policy claimPolicy
	// fresh is the spare lease taken for an owner the agent does not know yet; 0: none. It is
	// given back by done unless a claim bound keys to it (bound).
	fresh clientv3.LeaseID
}

// claimPolicy is what a refusal and an unanswered claim mean to one caller.
type claimPolicy struct {
	// ownLeaseGone, if not nil, answers a claim refused because the owner's own lease is
	// gone; nil: such a refusal is answered as any other (refused).
	ownLeaseGone func(lease clientv3.LeaseID, err error) error
	// refused answers a claim etcd refused for any other cause.
	refused func(err error) error
	// unanswered, if not nil, is called for a claim whose answer was lost: it waits before
	// the claim is sent again and returns nil, or returns the caller's answer. nil: the
	// caller answers unavailable(what) at once.
	unanswered func(ctx context.Context, err error) error
	// what names the claims in that answer.
	what string
}

// spare returns the spare lease the owner's claims go on while the agent knows no lease of
// the owner: the one taken already, else a new one from the keeper.
func (l *claimLoop) spare(ctx context.Context) (clientv3.LeaseID, error) {
	if l.fresh == 0 {
		id, err := l.a.keeper.Take(ctx)
		if err != nil {
			return 0, err
		}
		l.fresh = id
	}
	return l.fresh, nil
}

// bound records that a claim applied on the spare lease: it is the owner's now.
func (l *claimLoop) bound() { l.fresh = 0 }

// reuse makes lease, which the keeper still renews though the owner's keys are gone from
// it, the spare the next claim goes on, unless one was taken already.
func (l *claimLoop) reuse(lease clientv3.LeaseID) {
	if l.fresh == 0 && l.a.keeper.Holds(lease) {
		l.fresh = lease
	}
}

// done gives back the spare lease no claim bound keys to.
func (l *claimLoop) done() {
	if l.fresh != 0 {
		l.a.keeper.Return(l.fresh)
		l.fresh = 0
	}
}

// commit sends c with send, which bounds the request itself, and sorts what came back:
// etcd's answer (out), a claim the caller builds and sends again (again), or the caller's
// answer (err). ctx bounds what follows: the look at the block lease, the wait before the
// next claim.
func (l *claimLoop) commit(ctx context.Context, c *txn.Claim, send func() (txn.ClaimOutcome, error)) (out txn.ClaimOutcome, again bool, err error) {
	out, err = send()
	switch {
	case err == nil:
		return out, false, nil
	case txn.Refused(err) && txn.LeaseGone(err) && l.a.heldLeaseGone(ctx, c.HeldLease):
		return out, true, nil // claimed again on a new block lease
	case txn.Refused(err) && txn.LeaseGone(err) && l.fresh != 0 && c.Lease == l.fresh:
		l.a.keeper.Forget(l.fresh)
		l.fresh = 0
		l.a.log.Warn("a spare lease was gone from etcd; claiming on another", "owner", l.own.Owner(), "lease", keyspace.LeaseHex(c.Lease))
		return out, true, nil
	case txn.Refused(err) && txn.LeaseGone(err) && l.policy.ownLeaseGone != nil:
		return out, false, l.policy.ownLeaseGone(c.Lease, err)
	case txn.Refused(err):
		return out, false, l.policy.refused(err)
	case l.policy.unanswered == nil:
		return out, false, l.a.unavailable(l.policy.what, err)
	}
	if l.fresh != 0 && c.Lease == l.fresh {
		l.a.claimedOn(ctx, l.req, l.own, l.fresh)
		l.fresh = 0
	}
	l.a.pods.Change(l.own).Unanswered()
	if err := l.policy.unanswered(ctx, err); err != nil {
		return out, false, err
	}
	return out, true, nil
}

// claimedOn is the pod book's Change.Claimed, and makes sure the keeper renews lease: a spare
// may have been reported lost (its renewals stopped while etcd had no leader, which etcd
// itself survives by extending every lease) after an ADD took it and before its claim applied
// on it. Then the
// lease is adopted again, or, gone from etcd, its pod re-claimed; never left to expire
// unrenewed under a pod that was told it has its addresses.
func (a *Agent) claimedOn(ctx context.Context, req allocator.Request, o *ownerlock.Owned, lease clientv3.LeaseID, ats ...attachment) {
	owner := o.Owner()
	a.pods.Change(o).Claimed(req, lease, ats...)
	if a.keeper.Holds(lease) {
		return
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	if err := a.keeper.Adopt(octx, lease); err != nil {
		a.log.Warn("the lease a claim applied on had stopped being renewed, and cannot be resumed; the pod is re-claimed",
			"owner", owner, "lease", keyspace.LeaseHex(lease), "err", err)
		a.pods.Lose(lease)
		a.recovery.wake()
		return
	}
	a.log.Warn("the lease a claim applied on had stopped being renewed; resumed", "owner", owner, "lease", keyspace.LeaseHex(lease))
}
