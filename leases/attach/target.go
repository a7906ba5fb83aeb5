package attach

import (
	"context"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/txn"
)

// target answers ADD st as a live migration's target (docs/proposals/live-migration.md):
// the sticky claims send its transaction (T1, or a repeated ADD's read), c being what its
// claim would have written; the claim's addresses are answered at once, and the pod book
// marks the attachment a target, whose addresses' keys are its source's. done false: the
// claim changed since it was read, and the next attempt reads it again.
func (x *Attachments) target(ctx, octx context.Context, p *poolview.Pool, st *addState, c *txn.Claim, now time.Time) (
	allocator.Result, bool, error) {
	// Sent through the claim loop: an unanswered start may have applied, so the spare lease
	// it went on is the pod's, and the next attempt reads the claim again (its migration key
	// then names this attachment).
	out, again, err := st.claims.Commit(ctx, c, func() (txn.ClaimOutcome, error) {
		applied, rev, err := st.sticky.Migrate(octx, c, now)
		return txn.ClaimOutcome{Applied: applied, Revision: rev}, err
	})
	if err != nil || again || !out.Applied {
		return allocator.Result{}, false, err
	}
	rev := out.Revision
	req := st.req
	at := podbook.Attachment{IfName: req.IfName, Pool: p.Spec.Name, Network: req.Network, ContainerID: req.ContainerID,
		IPs: c.Addrs, Created: now, OwnerRev: rev, Target: true}
	st.sticky.Bound(&at)
	x.loops.ClaimedOn(ctx, req, st.own, c.Lease, at)
	st.claims.Bound()
	res, err := Result(&p.Spec, c.Addrs)
	return res, true, err
}
