package poolview

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// Choose picks an address of range set `set` for an ADD and marks it pending: from this
// node's blocks; else from a block it claims now; else, with every block claimed, borrowed
// from another node's block (borrow.go). In the flat layout it is reserve.
//
// Addresses whose holder expired without a release are passed over by each of these, and
// taken only when none of them finds another (reuseExpired), and never for a new sticky
// claim (reuse false): a claim would keep for a day an address whose running pod, on a node
// cut off, takes it back when it returns.
// It reports whether the address is one whose holder expired (then the claim overwrites its
// held key); any other the claim compares without a held key, so that a stale view or
// snapshot never hands out a held-back address as a free one.
func (v *View) Choose(ctx context.Context, spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool, reuse bool) (_ netip.Addr, expired bool, _ error) {
	addr, err := v.chooseFree(ctx, spec, set, skip)
	if !errors.Is(err, allocator.ErrPoolExhausted) {
		return addr, false, err
	}
	if !reuse {
		if n, first := v.HeldBackCount(); n > 0 {
			ends := "each hold ends at the latest a reuse delay after its node stopped renewing"
			if !first.IsZero() {
				ends = "the first hold ends at " + first.UTC().Format(time.RFC3339)
			}
			err = fmt.Errorf("%w; %d addresses are held back for pods whose node stopped renewing, and a new "+
				"sticky claim does not take one: it would keep for its hold an address a running pod wants back (%s)",
				err, n, ends)
		}
		return netip.Addr{}, false, err
	}
	addr, err = v.reuse.reuseExpired(ctx, spec, set, skip, err)
	return addr, err == nil, err
}

// chooseFree is choose without the addresses held back after an expiry.
func (v *View) chooseFree(ctx context.Context, spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool) (netip.Addr, error) {
	addr, err := v.reserve(spec, set, skip)
	if errors.Is(err, errNoBlock) || errors.Is(err, allocator.ErrPoolExhausted) && v.keeping() {
		// Right after etcd went back in time, another node's pod may hold any unclaimed block
		// or borrowed address (leases/restorehold).
		if herr := v.hooks.settling(); herr != nil {
			return netip.Addr{}, herr
		}
	}
	if !errors.Is(err, errNoBlock) {
		return addr, err
	}
	for try := range maxBlockTries {
		if try > 0 && !v.borrow.fresh() {
			// The block just claimed had no room (allocations of a dead node's pods, of
			// borrowers, or moved there by a migration): read the pool once, so that the next
			// choice skips blocks without room.
			if _, err := v.borrow.readPool(ctx); err != nil {
				return netip.Addr{}, err
			}
		}
		// One claim at a time: concurrent ADDs that found the node's blocks full would all
		// race for the same next block. Whoever waited looks again first.
		v.claims.claimMu.Lock()
		if addr, err := v.reserve(spec, set, skip); err == nil {
			v.claims.claimMu.Unlock()
			return addr, nil
		}
		claimed, err := v.claims.claimBlock(ctx, spec, set)
		v.claims.claimMu.Unlock()
		if err != nil {
			return netip.Addr{}, err
		}
		if !claimed {
			break
		}
		if addr, err := v.reserve(spec, set, skip); err == nil {
			return addr, nil
		}
	}
	return v.borrow.borrow(ctx, spec, set, skip)
}
