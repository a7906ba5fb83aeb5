package allocator

import (
	"iter"
	"math/big"
	"net/netip"
	"slices"
)

// The blocks of a range set as a map draws them (leaseholdctl pool show --blocks): which
// blocks the set has, how many, and how many addresses each can hand out. Pure arithmetic on
// the definition; who claimed what is the admin's read.

// SetBlocks yields the blocks of b that hold at least one address between the start and end of
// a range of set `set`, in address order, each once (two ranges may share a block). A block
// whose addresses are all excluded is yielded too: it is part of the set's span, with
// BlockCapacity 0. b must not be flat and p must be canonical; a set outside p yields nothing.
func (p *PoolSpec) SetBlocks(set int, b Blocks) iter.Seq[netip.Prefix] {
	return p.SetBlocksIn(set, b, netip.Prefix{})
}

// SetBlocksIn is SetBlocks restricted to the blocks inside within (a prefix at least as large
// as a block; the invalid Prefix means everywhere): a few of the blocks of a set too large to
// walk, such as an IPv6 /64.
func (p *PoolSpec) SetBlocksIn(set int, b Blocks, within netip.Prefix) iter.Seq[netip.Prefix] {
	return func(yield func(netip.Prefix) bool) {
		if b.Flat() || set < 0 || set >= len(p.Ranges) {
			return
		}
		var last netip.Prefix
		for _, r := range sortedRanges(p.Ranges[set]) {
			lo, hi := r.RangeStart, r.RangeEnd
			if within.IsValid() {
				if lo.BitLen() != within.Addr().BitLen() {
					continue
				}
				lo, hi = maxAddr(lo, firstAddr(within)), minAddr(hi, lastAddr(within))
			}
			if hi.Less(lo) {
				continue
			}
			for blk := b.Of(lo); blk.IsValid(); {
				if blk != last {
					last = blk
					if !yield(blk) {
						return
					}
				}
				end := lastAddr(blk)
				if !end.Less(hi) {
					break
				}
				blk = b.Of(end.Next())
			}
		}
	}
}

// SetBlockCount is the number of blocks SetBlocks yields, computed without walking them: an
// IPv6 range of a /64 has 2^58 blocks of /122.
func (p *PoolSpec) SetBlockCount(set int, b Blocks) *big.Int {
	n := new(big.Int)
	if b.Flat() || set < 0 || set >= len(p.Ranges) {
		return n
	}
	var last netip.Prefix
	for _, r := range sortedRanges(p.Ranges[set]) {
		first, final := b.Of(r.RangeStart), b.Of(r.RangeEnd)
		host := uint(r.RangeStart.BitLen() - first.Bits())
		k := new(big.Int).Rsh(addrInt(final.Addr()), host)
		k.Sub(k, new(big.Int).Rsh(addrInt(first.Addr()), host))
		n.Add(n, k.Add(k, big.NewInt(1)))
		if first == last {
			n.Sub(n, big.NewInt(1)) // shared with the previous range
		}
		last = final
	}
	return n
}

// BlockCapacity is how many addresses of range set `set` inside block the pool hands out: the
// set's addresses in the block, less excluded ones and every gateway of the pool among them,
// counted as SetSize counts (so the capacities of SetBlocks add up to SetSize). p must be
// canonical; a block is at most 2^16 addresses (MaxBlockIPv4, MinBlockIPv6), so it fits an int.
func (p *PoolSpec) BlockCapacity(set int, block netip.Prefix) int {
	if set < 0 || set >= len(p.Ranges) || !block.IsValid() {
		return 0
	}
	lo, hi := firstAddr(block), lastAddr(block)
	var inside RangeSet
	for _, r := range p.Ranges[set] {
		a, z := maxAddr(lo, r.RangeStart), minAddr(hi, r.RangeEnd)
		if a.BitLen() == z.BitLen() && !z.Less(a) {
			inside = append(inside, Range{Subnet: r.Subnet, RangeStart: a, RangeEnd: z, Gateway: r.Gateway})
		}
	}
	if len(inside) == 0 {
		return 0
	}
	// SetSize of the clipped set, with every range of the pool present for its gateways.
	clipped := PoolSpec{Name: p.Name, Ranges: append([]RangeSet{inside}, p.Ranges...), Exclude: p.Exclude}
	return int(clipped.SetSize(0).Int64())
}

// sortedRanges is s in address order (a set's ranges need not be sorted).
func sortedRanges(s RangeSet) RangeSet {
	out := slices.Clone(s)
	slices.SortFunc(out, func(x, y Range) int { return x.RangeStart.Compare(y.RangeStart) })
	return out
}
