package leases

import (
	"context"
	"net/netip"
	"slices"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/attach"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/sticky"
	"github.com/leasehold/leasehold/leases/txn"
)

// stickyAddOf is the sticky claim an ADD of req names, as the attachments see it
// (attach.Config.Sticky).
func stickyAddOf(sc *sticky.Claims) func(req allocator.Request, owner string) attach.Sticky {
	return func(req allocator.Request, owner string) attach.Sticky {
		return &addSticky{sc: sc, req: req, owner: owner, orig: req.RequestedIPs}
	}
}

// addSticky is one ADD's sticky claim (attach.Sticky), read and written by the sticky claims
// (leases/sticky).
type addSticky struct {
	sc    *sticky.Claims
	req   allocator.Request
	owner string
	// read is the claim as read; orig the addresses the runtime asked for, before the claim's
	// replaced them.
	read *sticky.Add
	orig []netip.Addr
}

var _ attach.Sticky = (*addSticky)(nil)

func (s *addSticky) Stale() bool { return s.read == nil || s.read.Stale }

func (s *addSticky) Read(ctx context.Context, spec allocator.PoolSpec, req *allocator.Request) error {
	s.req.RequestedIPs = req.RequestedIPs
	read, err := s.sc.Read(ctx, spec, &s.req, s.owner, s.orig, s.read)
	req.RequestedIPs = s.req.RequestedIPs
	if err != nil {
		return err
	}
	s.read = read
	return nil
}

func (s *addSticky) Returning() bool { return s.read != nil && s.read.Rev > 0 }

func (s *addSticky) Claim(ctx context.Context, c *txn.Claim, now time.Time) error {
	return s.sc.Claim(ctx, s.read, s.owner, s.req, c, now)
}

func (s *addSticky) Found(out txn.ClaimOutcome) bool {
	k := s.read
	if !out.ClaimChanged && (k.Rev == 0 || !slices.ContainsFunc(out.Addrs, txn.AddrFound.Taken)) {
		return false
	}
	k.Stale = true
	return true
}

func (s *addSticky) Bound(at *podbook.Attachment) bool {
	k := s.read
	at.Claim, at.ClaimLease, at.ClaimHold, at.ClaimMigratable, k.Used = k.Name, k.Lease, k.Hold, s.req.Migratable, true
	if k.Migration != nil {
		at.Source = k.Migration.Source.Owner
	}
	return k.Handover
}

func (s *addSticky) Drop() { s.sc.Drop(s.read) }

func (s *addSticky) Target() bool { return s.read != nil && s.read.Migration != nil }

func (s *addSticky) Migrate(ctx context.Context, c *txn.Claim, now time.Time) (bool, int64, error) {
	return s.sc.Migrate(ctx, s.read, s.owner, s.req, c, now)
}
