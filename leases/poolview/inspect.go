package poolview

import (
	"fmt"
	"maps"
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

// NoteExhausted counts an ADD refused because the pool had no free address.
func (v *View) NoteExhausted() { v.exhausted.Add(1) }

// Exhausted is how many ADDs were refused because the pool had no free address
// (leasehold_pool_exhausted_total).
func (v *View) Exhausted() int64 { return v.exhausted.Load() }

// PerSet counts the view's allocated and quarantined addresses by range set.
func (v *View) PerSet(spec *allocator.PoolSpec) (allocated, quarantined map[int]int) {
	lk := v.lock()
	defer lk.unlock()
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

// HeldBackCount is how many addresses the view holds back, and when the first hold it knows
// ends (zero: none known).
func (v *View) HeldBackCount() (n int, first time.Time) {
	lk := v.lock()
	defer lk.unlock()
	seen := map[netip.Addr]bool{}
	note := func(a netip.Addr, until time.Time) {
		if seen[a] {
			return
		}
		seen[a] = true
		n++
		if !until.IsZero() && (first.IsZero() || until.Before(first)) {
			first = until
		}
	}
	for a, until := range v.heldBack {
		note(a, until)
	}
	for a := range v.suspect {
		note(a, time.Time{})
	}
	if s := v.borrowed; s != nil && time.Since(v.borrowedAt) < snapshotFresh {
		for a := range s.expired {
			note(a, time.Time{})
		}
	}
	return n, first
}

// Claims is this node's block claims in the view's pool (none in the flat layout).
func (v *View) Claims() *BlockClaims { return v.claims }

// Inspection is what a view knew at one moment, copied out of it: for checks that read the
// view whole (tests, a model's report) without its lock.
type Inspection struct {
	allocated   map[netip.Addr]int64
	quarantined map[netip.Addr]time.Time
	heldBack    map[netip.Addr]time.Time
	suspect     map[netip.Addr]suspectDel
	// Blocks is what the view knows of each span it follows (in the flat layout, one: the
	// zero Prefix).
	Blocks map[netip.Prefix]BlockState
	// KeepUntil is when the view stops passing over what it kept after etcd went back in time.
	KeepUntil time.Time
	// ListedAt is when the view last installed a listing; Listed, whether it has yet.
	ListedAt time.Time
	Listed   bool
}

// Inspect copies out what the view knows now.
func (v *View) Inspect() Inspection {
	lk := v.lock()
	defer lk.unlock()
	in := Inspection{allocated: maps.Clone(lk.allocated), quarantined: maps.Clone(lk.quarantined),
		heldBack: maps.Clone(lk.heldBack), suspect: maps.Clone(lk.suspect),
		Blocks: make(map[netip.Prefix]BlockState, len(lk.spans)), KeepUntil: lk.keepUntil, ListedAt: lk.droppedAt}
	select {
	case <-v.sync.synced:
		in.Listed = true
	default:
	}
	for block, s := range lk.spans {
		st := BlockState{Lease: s.lease, Leaving: s.leaving, Restored: s.restored, EmptySince: s.emptySince}
		for name, keys := range map[string]func(func(netip.Addr) bool){"allocated": mapKeys(lk.allocated),
			"quarantined": mapKeys(lk.quarantined), "pending": mapKeys(lk.pending), "suspect": mapKeys(lk.suspect),
			"restKept": mapKeys(lk.restKept), "kept": mapKeys(lk.kept)} {
			for a := range keys {
				if block.Contains(a) {
					st.Why = append(st.Why, name+" "+a.String())
				}
			}
		}
		for a, until := range lk.heldBack {
			if block.Contains(a) {
				st.Why = append(st.Why, fmt.Sprintf("heldBack %s until %s", a, until.Format(time.TimeOnly)))
			}
		}
		sort.Strings(st.Why)
		in.Blocks[block] = st
	}
	return in
}

// Addr is what the view knew of a.
func (in Inspection) Addr(a netip.Addr) AddrState {
	var st AddrState
	st.Rev, st.Allocated = in.allocated[a]
	st.Until, st.Quarantined = in.quarantined[a]
	st.HeldUntil, st.HeldBack = in.heldBack[a]
	_, st.Suspect = in.suspect[a]
	return st
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

// Passed tells whether an ADD's search passes a over for the reuse order: held back, or
// suspect.
func (st AddrState) Passed() bool { return st.HeldBack || st.Suspect }

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
