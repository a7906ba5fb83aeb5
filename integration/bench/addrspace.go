package main

import (
	"fmt"
	"math/rand/v2"
	"net/netip"

	"github.com/leasehold/leasehold/allocator"
)

// addrSpace is one pool's allocatable addresses in a fixed pseudo-random order, and which
// of them are taken. Pre-filled allocations are spread over the pool the way pods of many
// nodes are, not packed at its start, so every figure pays a realistic candidate scan.
type addrSpace struct {
	spec  allocator.PoolSpec
	order []netip.Addr
	next  int
	taken map[netip.Addr]bool
}

// newAddrSpace canonicalizes a one-range pool over subnet and lists its allocatable
// addresses (network, broadcast and gateway excluded, as both leasehold and host-local do).
func newAddrSpace(name string, subnet netip.Prefix, seed uint64) (*addrSpace, error) {
	spec := allocator.PoolSpec{Name: name, Ranges: []allocator.RangeSet{{{Subnet: subnet}}}}
	if err := spec.Canonicalize(); err != nil {
		return nil, fmt.Errorf("pool %s: %w", name, err)
	}
	r := spec.Ranges[0][0]
	var all []netip.Addr
	for a := r.RangeStart; a.IsValid() && a.Compare(r.RangeEnd) <= 0; a = a.Next() {
		if spec.Allocatable(a) == nil {
			all = append(all, a)
		}
	}
	rng := rand.New(rand.NewPCG(seed, 0x1ea5e))
	rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	return &addrSpace{spec: spec, order: all, taken: make(map[netip.Addr]bool, len(all))}, nil
}

func (s *addrSpace) size() int  { return len(s.order) }
func (s *addrSpace) count() int { return len(s.taken) }

// mark records an address some ADD was given.
func (s *addrSpace) mark(a netip.Addr) { s.taken[a] = true }

// take returns n free addresses in the space's order and marks them taken.
func (s *addrSpace) take(n int) []netip.Addr {
	out := make([]netip.Addr, 0, n)
	for ; len(out) < n && s.next < len(s.order); s.next++ {
		if a := s.order[s.next]; !s.taken[a] {
			s.taken[a] = true
			out = append(out, a)
		}
	}
	return out
}

// fillTo returns the addresses that bring the space to total taken.
func (s *addrSpace) fillTo(total int) []netip.Addr {
	if total <= s.count() {
		return nil
	}
	return s.take(total - s.count())
}
