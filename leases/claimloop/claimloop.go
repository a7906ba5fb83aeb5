// Package claimloop is the one claim loop. ADD, import and re-claim each send claims for one
// attachment until etcd answers one. What a claim can come to besides an answer is handled
// here, once, for all three:
//
//   - etcd refused it because the node's block lease, which its held keys go on, is gone:
//     the block claims and held keys went with it; the caller builds the claim again on a
//     new block lease (Config.HeldLeaseGone).
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
//
// The loop takes no lock: its caller holds the owner lock, whose handle it is given.
package claimloop

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/txn"
)

// Config is what the claim loops are handed at start.
type Config struct {
	Keeper    *keeper.Keeper
	Pods      *podbook.Book
	Log       *slog.Logger
	OpTimeout time.Duration
	// HeldLeaseGone tells, for a claim etcd refused because a lease was not found, whether it
	// was the node's block lease its held keys were to go on; if so, it has dropped the
	// block claims that went with it.
	HeldLeaseGone func(ctx context.Context, lease clientv3.LeaseID) bool
	// Lost is told that a lease a claim applied on could not be renewed again: the pod book
	// has dropped it, and the pod is to be re-claimed (the recovery's wake).
	Lost func()
}

// Claims makes the claim loops of one agent.
type Claims struct{ cfg Config }

// New returns the claim loops' maker.
func New(cfg Config) *Claims { return &Claims{cfg: cfg} }

// For returns a loop for one caller's claims for one attachment of the owner whose lock own
// is. req is the attachment as the pod book records it when a claim may have applied.
func (c *Claims) For(own *ownerlock.Owned, req allocator.Request, p Policy) *Loop {
	return &Loop{c: c, own: own, req: req, policy: p}
}

// Policy is what a refusal and an unanswered claim mean to one caller.
type Policy struct {
	// OwnLeaseGone, if not nil, answers a claim refused because the owner's own lease is
	// gone; nil: such a refusal is answered as any other (Refused).
	OwnLeaseGone func(lease clientv3.LeaseID, err error) error
	// Refused answers a claim etcd refused for any other cause.
	Refused func(err error) error
	// Unanswered, if not nil, is called for a claim whose answer was lost: it waits before
	// the claim is sent again and returns nil, or returns the caller's answer. nil: the
	// caller answers allocator.ErrUnavailable naming What at once.
	Unanswered func(ctx context.Context, err error) error
	// What names the claims in that answer.
	What string
}

// Loop is one caller's claims for one attachment.
type Loop struct {
	c      *Claims
	own    *ownerlock.Owned
	req    allocator.Request
	policy Policy
	// fresh is the spare lease taken for an owner the agent does not know yet; 0: none. It is
	// given back by Done unless a claim bound keys to it (Bound).
	fresh clientv3.LeaseID
}

// Spare returns the spare lease the owner's claims go on while the agent knows no lease of
// the owner: the one taken already, else a new one from the keeper.
func (l *Loop) Spare(ctx context.Context) (clientv3.LeaseID, error) {
	if l.fresh == 0 {
		id, err := l.c.cfg.Keeper.Take(ctx)
		if err != nil {
			return 0, err
		}
		l.fresh = id
	}
	return l.fresh, nil
}

// Bound records that a claim applied on the spare lease: it is the owner's now.
func (l *Loop) Bound() { l.fresh = 0 }

// Reuse makes lease, which the keeper still renews though the owner's keys are gone from
// it, the spare the next claim goes on, unless one was taken already.
func (l *Loop) Reuse(lease clientv3.LeaseID) {
	if l.fresh == 0 && l.c.cfg.Keeper.Holds(lease) {
		l.fresh = lease
	}
}

// Done gives back the spare lease no claim bound keys to.
func (l *Loop) Done() {
	if l.fresh != 0 {
		l.c.cfg.Keeper.Return(l.fresh)
		l.fresh = 0
	}
}

// Commit sends c with send, which bounds the request itself, and sorts what came back:
// etcd's answer (out), a claim the caller builds and sends again (again), or the caller's
// answer (err). ctx bounds what follows: the look at the block lease, the wait before the
// next claim.
func (l *Loop) Commit(ctx context.Context, c *txn.Claim, send func() (txn.ClaimOutcome, error)) (out txn.ClaimOutcome, again bool, err error) {
	cfg := l.c.cfg
	out, err = send()
	switch {
	case err == nil:
		return out, false, nil
	case txn.Refused(err) && txn.LeaseGone(err) && cfg.HeldLeaseGone(ctx, c.HeldLease):
		return out, true, nil // claimed again on a new block lease
	case txn.Refused(err) && txn.LeaseGone(err) && l.fresh != 0 && c.Lease == l.fresh:
		cfg.Keeper.Forget(l.fresh)
		l.fresh = 0
		cfg.Log.Warn("a spare lease was gone from etcd; claiming on another", "owner", l.own.Owner(), "lease", keyspace.LeaseHex(c.Lease))
		return out, true, nil
	case txn.Refused(err) && txn.LeaseGone(err) && l.policy.OwnLeaseGone != nil:
		return out, false, l.policy.OwnLeaseGone(c.Lease, err)
	case txn.Refused(err):
		return out, false, l.policy.Refused(err)
	case l.policy.Unanswered == nil:
		return out, false, fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, l.policy.What, err)
	}
	if l.fresh != 0 && c.Lease == l.fresh {
		l.c.ClaimedOn(ctx, l.req, l.own, l.fresh)
		l.fresh = 0
	}
	cfg.Pods.Change(l.own).Unanswered()
	if err := l.policy.Unanswered(ctx, err); err != nil {
		return out, false, err
	}
	return out, true, nil
}

// ClaimedOn is the pod book's Change.Claimed, and makes sure the keeper renews lease: a spare
// may have been reported lost (its renewals stopped while etcd had no leader, which etcd
// itself survives by extending every lease) after an ADD took it and before its claim applied
// on it. Then the lease is adopted again, or, gone from etcd, its pod re-claimed; never left
// to expire unrenewed under a pod that was told it has its addresses.
func (c *Claims) ClaimedOn(ctx context.Context, req allocator.Request, o *ownerlock.Owned, lease clientv3.LeaseID, ats ...podbook.Attachment) {
	cfg := c.cfg
	owner := o.Owner()
	cfg.Pods.Change(o).Claimed(req, lease, ats...)
	if cfg.Keeper.Holds(lease) {
		return
	}
	octx, cancel := context.WithTimeout(ctx, cfg.OpTimeout)
	defer cancel()
	if err := cfg.Keeper.Adopt(octx, lease); err != nil {
		cfg.Log.Warn("the lease a claim applied on had stopped being renewed, and cannot be resumed; the pod is re-claimed",
			"owner", owner, "lease", keyspace.LeaseHex(lease), "err", err)
		cfg.Pods.Lose(lease)
		cfg.Lost()
		return
	}
	cfg.Log.Warn("the lease a claim applied on had stopped being renewed; resumed", "owner", owner, "lease", keyspace.LeaseHex(lease))
}
