package poolview

import (
	"context"
	"fmt"
	"net/netip"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
)

// What a view holds, as the agent's metrics and checks read it, and as tests read it.

// Pool is the name of the view's pool.
func (v *View) Pool() string { return v.pool }

// Blocks is the pool's stored layout the view follows.
func (v *View) Blocks() allocator.Blocks { return v.blocks }

// Synced is closed once the view has listed its pool.
func (v *View) Synced() <-chan struct{} { return v.synced }

// NoteExhausted counts an ADD refused because the pool had no free address.
func (v *View) NoteExhausted() { v.exhausted.Add(1) }

// Exhausted is how many ADDs were refused because the pool had no free address
// (leasehold_pool_exhausted_total).
func (v *View) Exhausted() int64 { return v.exhausted.Load() }

// ClaimBlock claims block for this node if no node has (one block claim at a time), and
// starts following it; it reports false when another node claimed it first.
func (v *View) ClaimBlock(ctx context.Context, block netip.Prefix) (bool, error) {
	v.claimMu.Lock()
	defer v.claimMu.Unlock()
	return v.claimAt(ctx, block)
}

// PerSet counts the view's allocated and quarantined addresses by range set.
func (v *View) PerSet(spec *allocator.PoolSpec) (allocated, quarantined map[int]int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	allocated, quarantined = map[int]int{}, map[int]int{}
	count := func(m map[int]int, a netip.Addr) {
		if set, ok := spec.SetOf(a); ok && spec.Allocatable(a) == nil {
			m[set]++
		}
	}
	for a := range v.allocated {
		count(allocated, a)
	}
	for a := range v.quarantined {
		if _, alloc := v.allocated[a]; !alloc {
			count(quarantined, a)
		}
	}
	return allocated, quarantined
}

// AddrState is what a view knows of one address.
type AddrState struct {
	// Allocated: an allocation key stands, created at Rev.
	Allocated bool
	Rev       int64
	// Quarantined: the address rests, until Until.
	Quarantined bool
	Until       time.Time
	// HeldBack: its holder expired without a release, the hold ending at HeldUntil (zero:
	// not looked up yet); Suspect: its allocation went with no release seen yet.
	HeldBack  bool
	HeldUntil time.Time
	Suspect   bool
}

// Addr is what the view knows of a.
func (v *View) Addr(a netip.Addr) AddrState {
	v.mu.Lock()
	defer v.mu.Unlock()
	var st AddrState
	st.Rev, st.Allocated = v.allocated[a]
	st.Until, st.Quarantined = v.quarantined[a]
	st.HeldUntil, st.HeldBack = v.heldBack[a]
	_, st.Suspect = v.suspect[a]
	return st
}

// HeldBackNow tells whether an ADD passes over a for the reuse order (reuse.go).
func (v *View) HeldBackNow(a netip.Addr) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.heldBackLocked(a)
}

// BlockState is what a view knows of one span it follows.
type BlockState struct {
	Lease      clientv3.LeaseID // the block lease the claim is on
	Leaving    bool
	Restored   bool
	EmptySince time.Time
	// Why are the addresses that keep the block this node's (idleBlocks) or that an ADD
	// passes over in it, each as "<state> <address>".
	Why []string
}

// Followed is what the view knows of each span it follows (in the flat layout, one: the
// zero Prefix), read at once.
func (v *View) Followed() map[netip.Prefix]BlockState {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make(map[netip.Prefix]BlockState, len(v.spans))
	for block, s := range v.spans {
		st := BlockState{Lease: s.lease, Leaving: s.leaving, Restored: s.restored, EmptySince: s.emptySince}
		for name, keys := range map[string]func(func(netip.Addr) bool){"allocated": mapKeys(v.allocated),
			"quarantined": mapKeys(v.quarantined), "pending": mapKeys(v.pending), "suspect": mapKeys(v.suspect),
			"restKept": mapKeys(v.restKept), "kept": mapKeys(v.kept)} {
			for a := range keys {
				if block.Contains(a) {
					st.Why = append(st.Why, name+" "+a.String())
				}
			}
		}
		for a, until := range v.heldBack {
			if block.Contains(a) {
				st.Why = append(st.Why, fmt.Sprintf("heldBack %s until %s", a, until.Format(time.TimeOnly)))
			}
		}
		sort.Strings(st.Why)
		out[block] = st
	}
	return out
}

// KeepUntil is when the view stops passing over the addresses it kept after etcd went back
// in time.
func (v *View) KeepUntil() time.Time {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.keepUntil
}

// ListedAt is when the view last installed a listing.
func (v *View) ListedAt() time.Time {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.droppedAt
}

// StaleClaims makes the next ADD that finds no unclaimed block read the claims again.
func (v *View) StaleClaims() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.claimsRead = time.Time{}
}
