package leases

import (
	"context"
	"net/netip"
	"slices"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/attach"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/txn"
)

// addState is what the sticky claims (sticky.go) read and write of one ADD naming a claim.
type addState struct {
	req   allocator.Request
	owner string
	// sticky is the claim as read; origRequested the addresses the runtime asked for, before
	// the claim's replaced them.
	sticky        *stickyAdd
	origRequested []netip.Addr
}

// stickyAddOf is the sticky claim an ADD of req names, as the attachments see it
// (attach.Config.Sticky).
func stickyAddOf(sc *stickyClaims) func(req allocator.Request, owner string) attach.Sticky {
	return func(req allocator.Request, owner string) attach.Sticky {
		return &addSticky{sc: sc, st: &addState{req: req, owner: owner, origRequested: req.RequestedIPs}}
	}
}

// addSticky is one ADD's sticky claim (attach.Sticky).
type addSticky struct {
	sc *stickyClaims
	st *addState
}

var _ attach.Sticky = (*addSticky)(nil)

func (s *addSticky) Stale() bool { return s.st.sticky == nil || s.st.sticky.stale }

func (s *addSticky) Read(ctx context.Context, spec allocator.PoolSpec, req *allocator.Request) error {
	s.st.req.RequestedIPs = req.RequestedIPs
	err := s.sc.readSticky(ctx, spec, s.st)
	req.RequestedIPs = s.st.req.RequestedIPs
	return err
}

func (s *addSticky) Returning() bool { return s.st.sticky != nil && s.st.sticky.rev > 0 }

func (s *addSticky) Claim(ctx context.Context, c *txn.Claim, now time.Time) error {
	return s.sc.stickyClaim(ctx, s.st, c, now)
}

func (s *addSticky) Found(out txn.ClaimOutcome) bool {
	k := s.st.sticky
	if !out.ClaimChanged && (k.rev == 0 || !slices.ContainsFunc(out.Addrs, txn.AddrFound.Taken)) {
		return false
	}
	k.stale = true
	return true
}

func (s *addSticky) Bound(at *podbook.Attachment) bool {
	k := s.st.sticky
	at.Claim, at.ClaimLease, at.ClaimHold, k.used = k.name, k.lease, k.hold, true
	return k.handover
}

func (s *addSticky) Drop() { s.sc.dropSticky(s.st) }
