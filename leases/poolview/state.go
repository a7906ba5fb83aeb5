package poolview

import (
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// locked is the view's state under its lock: lock returns it, and its methods are the ones
// that assume the lock (they never take it, nor block). It implements allocator.Taken over
// the addresses the view follows.
type locked struct{ *core }

// unlock releases the lock; the handle must not be used after it.
func (lk locked) unlock() { lk.mu.Unlock() }

func (lk locked) Allocated(a netip.Addr) bool {
	_, ok := lk.allocated[a]
	return ok || lk.hostCount[a] > 0
}

func (lk locked) Quarantined(a netip.Addr) (time.Time, bool) {
	t, ok := lk.quarantined[a]
	return t, ok
}

// follows reports whether a lies in a span the view follows.
func (lk locked) follows(a netip.Addr) bool {
	_, ok := lk.spans[lk.blocks.Of(a)]
	return ok
}

// busy is what a search must pass over besides what is taken: addresses chosen by ADDs in
// flight, those skip refuses, and those held back (reuse.go).
func (lk locked) busy(skip func(netip.Addr) bool) func(netip.Addr) bool {
	return func(a netip.Addr) bool {
		if _, ok := lk.pending[a]; ok {
			return true
		}
		return skip != nil && skip(a) || lk.isHeldBack(a) || lk.isKept(a)
	}
}

// isKept tells whether a is one of the addresses kept after etcd went back in time.
func (lk locked) isKept(a netip.Addr) bool {
	if len(lk.kept) == 0 {
		return false
	}
	if !time.Now().Before(lk.keepUntil) {
		clear(lk.kept)
		return false
	}
	_, ok := lk.kept[a]
	return ok
}

// roomAt notes that a may have come free.
func (lk locked) roomAt(a netip.Addr) {
	if s := lk.spans[lk.blocks.Of(a)]; s != nil {
		clear(s.full)
	}
}

// take marks addr pending and moves set's next search past it.
func (lk locked) take(spec *allocator.PoolSpec, set int, addr netip.Addr) netip.Addr {
	lk.pending[addr] = struct{}{}
	lk.next[set] = spec.Ranges[set].After(addr)
	return addr
}

// sorted is the blocks this node holds in address order, kept until the spans change.
func (lk locked) sorted() []netip.Prefix {
	if lk.order == nil {
		lk.order = make([]netip.Prefix, 0, len(lk.spans))
		for b := range lk.spans {
			if b.IsValid() {
				lk.order = append(lk.order, b)
			}
		}
		slices.SortFunc(lk.order, comparePrefix)
	}
	return lk.order
}

func comparePrefix(x, y netip.Prefix) int { return x.Addr().Compare(y.Addr()) }

// from is where the round-robin search of a range set starts: after the address handed out
// last, so a crash-looping container does not get the same address straight back. An
// agent's first search starts at a place of the range derived from its identity, so that
// agents on different nodes begin in different places instead of racing for the same
// first addresses (and, in the block layout, claim blocks far apart).
func (lk locked) from(spec *allocator.PoolSpec, set int) netip.Addr {
	if next, ok := lk.next[set]; ok {
		return next
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%s/%d", lk.seed, lk.pool, set)
	return spec.Ranges[set].Spread(float64(h.Sum64()>>11) / (1 << 53))
}

// endRestKept ends the quarantines the last listing kept without a key in etcd (restKept)
// whose time is up: no watch event will.
func (lk locked) endRestKept(now time.Time) {
	for a := range lk.restKept {
		if until, ok := lk.quarantined[a]; ok && until.After(now) {
			continue
		}
		delete(lk.restKept, a)
		delete(lk.quarantined, a)
		lk.roomAt(a)
	}
}

func (lk locked) addHost(key string, a netip.Addr) {
	if _, ok := lk.hosts[key]; !ok {
		lk.hosts[key] = a
		lk.hostCount[a]++
	}
}

func (lk locked) removeHost(key string) {
	if a, ok := lk.hosts[key]; ok {
		delete(lk.hosts, key)
		if lk.hostCount[a]--; lk.hostCount[a] <= 0 {
			delete(lk.hostCount, a)
		}
	}
}

// roomIn reports whether one of this node's blocks has a free address of set.
func (lk locked) roomIn(spec *allocator.PoolSpec, set int) bool {
	for _, b := range lk.sorted() {
		if lk.spans[b].leaving {
			continue
		}
		if _, err := spec.NextIn(set, b, netip.Addr{}, lk, nil); err == nil {
			return true
		}
	}
	return false
}

// isClaimed reports whether block is claimed, as last read.
func (lk locked) isClaimed(block netip.Prefix) bool {
	_, ok := lk.claims[block]
	return ok || lk.spans[block] != nil
}

// unclaimable tells which blocks a claim should skip: claimed ones, and those the last pool
// snapshot shows at least half used. The function it returns is called with the lock
// held (lk must stay locked while it is used).
func (lk locked) unclaimable() func(netip.Prefix) bool {
	return func(b netip.Prefix) bool {
		if lk.isClaimed(b) {
			return true
		}
		// A block the last pool snapshot shows at least half used is left to borrowing: near
		// exhaustion a claim of a block with one free address would cost an extra transaction
		// per ADD, and borrowing finds that address anyway.
		return lk.borrowed != nil && time.Since(lk.borrowedAt) < snapshotFresh && lk.borrowed.used[b] >= blockSize(b)/2
	}
}

func mapKeys[V any](m map[netip.Addr]V) func(func(netip.Addr) bool) {
	return func(yield func(netip.Addr) bool) {
		for a := range m {
			if !yield(a) {
				return
			}
		}
	}
}
