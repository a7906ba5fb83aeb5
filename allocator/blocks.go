package allocator

import (
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// Blocks divides a pool into fixed-size blocks that nodes claim: a node allocates from its
// own blocks first and watches only them, so an allocation reaches one node instead of all.
// A block is a prefix of the given length, aligned on its size. Blocks say where a node
// looks first, never who may hold an address: that is still the address's own key.
//
// The zero Blocks is the flat layout of pools stored before blocks existed: no blocks,
// every node watches the whole pool. In a network configuration, zero means "what the stored
// definition says" (DefaultBlocks for a new pool).
type Blocks struct {
	// IPv4 and IPv6 are the block prefix lengths of each family.
	IPv4 int `json:"ipv4,omitempty"`
	IPv6 int `json:"ipv6,omitempty"`
}

// DefaultBlocks are 64 addresses per block in both families: a /26 of IPv4, a /122 of IPv6.
var DefaultBlocks = Blocks{IPv4: 26, IPv6: 122}

// Block length bounds: a block of at least 4 addresses (a smaller one is all overhead, one
// claim per pod or two), and of at most 2^16 (a node would take a whole /16 of IPv4).
const (
	MinBlockIPv4, MaxBlockIPv4 = 16, 30
	MinBlockIPv6, MaxBlockIPv6 = 112, 126
)

// Flat reports whether b is the zero Blocks: the pool has no blocks.
func (b Blocks) Flat() bool { return b == Blocks{} }

// Bits is the block prefix length for addresses of a's family; 0 when b is flat.
func (b Blocks) Bits(a netip.Addr) int {
	if b.Flat() {
		return 0
	}
	if normAddr(a).Is4() {
		return b.IPv4
	}
	return b.IPv6
}

// Of returns the block that holds a, or the zero Prefix when b is flat or a is invalid.
func (b Blocks) Of(a netip.Addr) netip.Prefix {
	a = normAddr(a)
	if b.Flat() || !a.IsValid() {
		return netip.Prefix{}
	}
	p, err := a.WithZone("").Prefix(b.Bits(a))
	if err != nil {
		return netip.Prefix{}
	}
	return p
}

// WithDefaults fills a zero family of a non-flat b with DefaultBlocks' length.
func (b Blocks) WithDefaults() Blocks {
	if b.Flat() {
		return b
	}
	if b.IPv4 == 0 {
		b.IPv4 = DefaultBlocks.IPv4
	}
	if b.IPv6 == 0 {
		b.IPv6 = DefaultBlocks.IPv6
	}
	return b
}

// String is "ipv4 /26, ipv6 /122", or "flat".
func (b Blocks) String() string {
	if b.Flat() {
		return "flat (no blocks)"
	}
	return fmt.Sprintf("blocks: ipv4 /%d, ipv6 /%d", b.IPv4, b.IPv6)
}

func (b Blocks) validate(pool string) error {
	if b.Flat() {
		return nil
	}
	if b.IPv4 < MinBlockIPv4 || b.IPv4 > MaxBlockIPv4 {
		return fmt.Errorf("%w: pool %s: an IPv4 block of /%d is out of bounds; give a length from /%d to /%d (default /%d)",
			ErrInvalidConfig, pool, b.IPv4, MinBlockIPv4, MaxBlockIPv4, DefaultBlocks.IPv4)
	}
	if b.IPv6 < MinBlockIPv6 || b.IPv6 > MaxBlockIPv6 {
		return fmt.Errorf("%w: pool %s: an IPv6 block of /%d is out of bounds; give a length from /%d to /%d (default /%d)",
			ErrInvalidConfig, pool, b.IPv6, MinBlockIPv6, MaxBlockIPv6, DefaultBlocks.IPv6)
	}
	return nil
}

// NextIn is Next restricted to the addresses of range set `set` inside block: one lap over
// them in address order, starting at from (or at the block's first address when from is
// outside it). An invalid block means the whole set, as Next. Its error wraps
// ErrPoolExhausted and names the block (only the block is full, not the pool).
func (p *PoolSpec) NextIn(set int, block netip.Prefix, from netip.Addr, taken Taken, skip func(netip.Addr) bool) (netip.Addr, error) {
	if !block.IsValid() {
		return p.Next(set, from, taken, skip)
	}
	if set < 0 || set >= len(p.Ranges) {
		return netip.Addr{}, fmt.Errorf("%w: pool %s has no range set %d (it has %d)", ErrInvalidConfig, p.Name, set, len(p.Ranges))
	}
	a, sc := p.nextIn(set, block, from, taken, skip)
	switch {
	case a.IsValid():
		return a, nil
	case sc.quarantined > 0:
		return netip.Addr{}, fmt.Errorf("%w: %w: pool %s range set %d has no free address in block %s: %d rest in quarantine, "+
			"the first until %s (%d allocated)", ErrOnlyQuarantined, ErrPoolExhausted, p.Name, set, block,
			sc.quarantined, sc.freeAt.Format(time.RFC3339), sc.allocated)
	}
	return netip.Addr{}, fmt.Errorf("%w: pool %s range set %d has no free address in block %s (%d allocated, %d skipped)",
		ErrPoolExhausted, p.Name, set, block, sc.allocated, sc.skipped)
}

// nextIn is NextIn's search, without the error.
func (p *PoolSpec) nextIn(set int, block netip.Prefix, from netip.Addr, taken Taken, skip func(netip.Addr) bool) (netip.Addr, *scan) {
	lo, hi := firstAddr(block), lastAddr(block)
	from = normAddr(from)
	if !block.Contains(from) {
		from = lo
	}
	sc := &scan{p: p, taken: taken, skip: skip}
	for _, seg := range [][2]netip.Addr{{from, hi}, {lo, from.Prev()}} {
		if !seg[1].IsValid() || seg[1].Less(seg[0]) {
			continue
		}
		// The parts of the set's ranges inside the segment, in address order (a set's ranges
		// need not be sorted).
		var parts [][2]netip.Addr
		for _, r := range p.Ranges[set] {
			a, b := maxAddr(seg[0], r.RangeStart), minAddr(seg[1], r.RangeEnd)
			if a.BitLen() == b.BitLen() && !b.Less(a) {
				parts = append(parts, [2]netip.Addr{a, b})
			}
		}
		slices.SortFunc(parts, func(x, y [2]netip.Addr) int { return x[0].Compare(y[0]) })
		for _, part := range parts {
			if addr, ok := sc.walk(part[0], part[1]); ok {
				return addr, sc
			}
		}
	}
	return netip.Addr{}, sc
}

// Serves reports whether block holds at least one allocatable address of range set `set`.
func (p *PoolSpec) Serves(set int, block netip.Prefix) bool {
	if set < 0 || set >= len(p.Ranges) || !block.IsValid() {
		return false
	}
	a, _ := p.nextIn(set, block, netip.Addr{}, nil, nil)
	return a.IsValid()
}

// NextBlock returns the first block of range set `set`, in the set's order from the block
// holding from (wrapping around once), that holds an allocatable address of the set and
// that claimed does not refuse. It walks the blocks of each range, so its work is bounded by
// the blocks it refuses plus the ranges; ok is false when every block is refused. b must not
// be flat and p must be canonical.
func (p *PoolSpec) NextBlock(set int, b Blocks, from netip.Addr, claimed func(netip.Prefix) bool) (netip.Prefix, bool) {
	if b.Flat() || set < 0 || set >= len(p.Ranges) || len(p.Ranges[set]) == 0 {
		return netip.Prefix{}, false
	}
	rs := p.Ranges[set]
	from = normAddr(from)
	start := rs.index(from)
	if start < 0 {
		start, from = 0, rs[0].RangeStart
	}
	// One lap: from's block to the end of its range, the other ranges, then the start of
	// from's range up to from's block.
	type span struct{ lo, hi netip.Addr }
	spans := []span{{from, rs[start].RangeEnd}}
	for k := 1; k < len(rs); k++ {
		r := rs[(start+k)%len(rs)]
		spans = append(spans, span{r.RangeStart, r.RangeEnd})
	}
	if first := b.Of(from); rs[start].RangeStart.Less(firstAddr(first)) {
		spans = append(spans, span{rs[start].RangeStart, firstAddr(first).Prev()})
	}
	seen := make(map[netip.Prefix]bool)
	for _, s := range spans {
		for c := s.lo; c.IsValid() && c.Compare(s.hi) <= 0; {
			if x, ok := p.ExcludedBy(c); ok && x.Bits() <= b.Bits(c) {
				c = lastAddr(x).Next() // a whole excluded prefix is no block's
				continue
			}
			blk := b.Of(c)
			if !seen[blk] {
				seen[blk] = true
				if (claimed == nil || !claimed(blk)) && p.Serves(set, blk) {
					return blk, true
				}
			}
			c = lastAddr(blk).Next()
		}
	}
	return netip.Prefix{}, false
}
