package allocator

import (
	"fmt"
	"net/netip"
	"time"
)

// Next chooses a free address of range set set, round-robin: it walks the set's ranges
// in order starting at from (inclusive), to the end of from's range, through the
// following ranges, wrapping around to the first, and back to just before from: one
// lap, never more. A zero from, or one outside the set, starts at the first range's
// RangeStart. RangeSet.After turns the last address handed out into the next from.
//
// It returns the first address that is allocatable (not a gateway of the pool, not
// excluded), not taken.Allocated, not skip(addr) and not taken.Quarantined. taken may
// be nil (nothing is taken); skip may be nil (the caller passes the addresses it lost a
// race on in this attempt). Any Quarantined answer with ok true blocks the address: the
// Taken implementation decides when a quarantine is over.
//
// Next jumps over excluded prefixes instead of walking them, and it asks taken and skip
// only about candidates, so its work is bounded by the taken, quarantined and skipped
// addresses it meets plus the number of excludes, gateways and ranges: an almost empty
// /64 answers at once, a full /24 after one lap. p must be canonical.
//
// Errors:
//   - ErrInvalidConfig: set is not a range set of p, or p was not canonicalized.
//   - ErrOnlyQuarantined and ErrPoolExhausted together (errors.Is matches both): no
//     address is free, but at least one was blocked only by quarantine; the message says
//     when the first one frees up.
//   - ErrPoolExhausted alone: every allocatable address is allocated or skipped. The
//     message names the pool, the set's ranges and its size.
func (p *PoolSpec) Next(set int, from netip.Addr, taken Taken, skip func(netip.Addr) bool) (netip.Addr, error) {
	if set < 0 || set >= len(p.Ranges) {
		return netip.Addr{}, fmt.Errorf("%w: pool %s has no range set %d (it has %d)",
			ErrInvalidConfig, p.Name, set, len(p.Ranges))
	}
	rs := p.Ranges[set]
	if len(rs) == 0 {
		return netip.Addr{}, fmt.Errorf("%w: pool %s range set %d is empty", ErrInvalidConfig, p.Name, set)
	}
	for _, r := range rs {
		if !r.RangeStart.IsValid() || !r.RangeEnd.IsValid() {
			return netip.Addr{}, fmt.Errorf("%w: pool %s range %s has no start or end; call Canonicalize first",
				ErrInvalidConfig, p.Name, r)
		}
	}

	from = normAddr(from)
	start := rs.index(from)
	if start < 0 {
		start, from = 0, rs[0].RangeStart
	}
	sc := scan{p: p, taken: taken, skip: skip}
	if a, ok := sc.walk(from, rs[start].RangeEnd); ok {
		return a, nil
	}
	for k := 1; k < len(rs); k++ {
		r := rs[(start+k)%len(rs)]
		if a, ok := sc.walk(r.RangeStart, r.RangeEnd); ok {
			return a, nil
		}
	}
	if from != rs[start].RangeStart {
		if a, ok := sc.walk(rs[start].RangeStart, from.Prev()); ok {
			return a, nil
		}
	}
	return netip.Addr{}, sc.exhausted(set)
}

// NextNear returns the first free address of range set set from from on, looking at no more
// than n addresses and not past the end of from's range: for a caller that has a candidate
// and wants others close to it, at a bounded cost. It also returns how many addresses it
// looked at; ok is false when none of them was free (or from is in no range of the set).
func (p *PoolSpec) NextNear(set int, from netip.Addr, n int, taken Taken, skip func(netip.Addr) bool) (_ netip.Addr, looked int, ok bool) {
	if set < 0 || set >= len(p.Ranges) || n <= 0 {
		return netip.Addr{}, 0, false
	}
	rs := p.Ranges[set]
	from = normAddr(from)
	i := rs.index(from)
	if i < 0 {
		return netip.Addr{}, 0, false
	}
	sc := scan{p: p, taken: taken, skip: skip, limit: n}
	a, ok := sc.walk(from, rs[i].RangeEnd)
	return a, sc.looked, ok
}

// scan is one lap of Next over a range set: its inputs and what it met on the way.
type scan struct {
	p     *PoolSpec
	taken Taken
	skip  func(netip.Addr) bool
	// limit, when positive, is how many addresses the walk may look at (NextNear); looked
	// counts them.
	limit, looked int

	allocated   int
	skipped     int
	quarantined int
	freeAt      time.Time // earliest end of a quarantine met
}

// walk returns the first free address in [lo, hi], jumping over excluded prefixes.
func (sc *scan) walk(lo, hi netip.Addr) (netip.Addr, bool) {
	for c := lo; c.IsValid() && c.Compare(hi) <= 0; {
		if sc.limit > 0 {
			if sc.looked == sc.limit {
				return netip.Addr{}, false
			}
			sc.looked++
		}
		if x, ok := sc.p.ExcludedBy(c); ok {
			c = lastAddr(x).Next() // zero at the end of the address space: the loop ends
			continue
		}
		if _, ok := sc.p.GatewayOf(c); ok {
			c = c.Next()
			continue
		}
		if sc.free(c) {
			return c, true
		}
		c = c.Next()
	}
	return netip.Addr{}, false
}

// free reports whether a is neither allocated, skipped nor quarantined, counting why not.
func (sc *scan) free(a netip.Addr) bool {
	if sc.taken != nil && sc.taken.Allocated(a) {
		sc.allocated++
		return false
	}
	if sc.skip != nil && sc.skip(a) {
		sc.skipped++
		return false
	}
	if sc.taken != nil {
		if until, ok := sc.taken.Quarantined(a); ok {
			sc.quarantined++
			if sc.freeAt.IsZero() || until.Before(sc.freeAt) {
				sc.freeAt = until
			}
			return false
		}
	}
	return true
}

// exhausted builds Next's error after a full lap found nothing.
func (sc *scan) exhausted(set int) error {
	p := sc.p
	size := p.SetSize(set)
	where := fmt.Sprintf("pool %s range set %d (%s)", p.Name, set, p.Ranges[set])
	if sc.quarantined > 0 {
		return fmt.Errorf("%w: %w: %s has no free address: %d of its %s allocatable addresses rest in "+
			"quarantine after a release and the first frees up at %s (%d allocated, %d lost to concurrent "+
			"allocations in this attempt); retry after that time or widen the ranges",
			ErrOnlyQuarantined, ErrPoolExhausted, where, sc.quarantined, size,
			sc.freeAt.Format(time.RFC3339), sc.allocated, sc.skipped)
	}
	if size.Sign() == 0 {
		return fmt.Errorf("%w: %s has no allocatable address: every address is a gateway or excluded (%s); "+
			"widen the ranges or shrink the excludes", ErrPoolExhausted, where, joinPrefixes(p.Exclude))
	}
	if sc.skipped > 0 {
		return fmt.Errorf("%w: %s has no free address: all %s allocatable addresses are taken "+
			"(%d allocated, %d lost to concurrent allocations in this attempt); retry, or widen the ranges",
			ErrPoolExhausted, where, size, sc.allocated, sc.skipped)
	}
	return fmt.Errorf("%w: %s has no free address: all %s allocatable addresses are taken; "+
		"release addresses or widen the ranges", ErrPoolExhausted, where, size)
}
