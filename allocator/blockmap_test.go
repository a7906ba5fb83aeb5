package allocator_test

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

func TestSetBlocksAndCapacity(t *testing.T) {
	tests := []struct {
		name   string
		p      allocator.PoolSpec
		set    int
		within string   // SetBlocksIn's prefix, "" for SetBlocks
		blocks []string // SetBlocks as "prefix:capacity"
		count  string   // SetBlockCount, when SetBlocks is too long to list
	}{
		// The default range of a /24: the network address and the gateway (.1) are not handed
		// out, nor is the broadcast, so the first block has 62 of its 64 and the last 63.
		{name: "one /24", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}), allocator.DefaultBlocks),
			blocks: []string{"10.0.0.0/26:62", "10.0.0.64/26:64", "10.0.0.128/26:64", "10.0.0.192/26:63"}},
		// Ranges listed out of order, sharing block 10.0.1.0/26 between them: it is drawn once,
		// in address order, and holds what both ranges hand out there.
		{name: "shared block, unsorted", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{
			rng("10.0.1.0/24", "10.0.1.32", "10.0.1.70", "10.0.1.254"), rng("10.0.1.0/24", "10.0.1.2", "10.0.1.9", "10.0.1.254")}}),
			allocator.DefaultBlocks), blocks: []string{"10.0.1.0/26:40", "10.0.1.64/26:7"}},
		// An excluded /26 stays in the span with nothing to hand out; a partly excluded one
		// loses what the exclude covers.
		{name: "excludes", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("10.0.2.0/24", "", "", "")}}, "10.0.2.64/26", "10.0.2.128/28"),
			allocator.DefaultBlocks), blocks: []string{"10.0.2.0/26:62", "10.0.2.64/26:0", "10.0.2.128/26:48", "10.0.2.192/26:63"}},
		// The gateway of another set's range (.10) inside this one is not handed out either; the
		// sets share block 10.0.3.64/26, each with its own part.
		{name: "foreign gateway", p: withBlocks(t, pool(t, "p", [][]allocator.Range{
			{rng("10.0.3.0/24", "", "10.0.3.100", "")}, {rng("10.0.3.0/24", "10.0.3.101", "10.0.3.200", "10.0.3.10")}}), allocator.DefaultBlocks),
			blocks: []string{"10.0.3.0/26:61", "10.0.3.64/26:37"}},
		// Set 1 of the same pool.
		{name: "second set", p: withBlocks(t, pool(t, "p", [][]allocator.Range{
			{rng("10.0.3.0/24", "", "10.0.3.100", "")}, {rng("10.0.3.0/24", "10.0.3.101", "10.0.3.200", "10.0.3.10")}}), allocator.DefaultBlocks), set: 1,
			blocks: []string{"10.0.3.64/26:27", "10.0.3.128/26:64", "10.0.3.192/26:9"}},
		// IPv6 /120 in /122 blocks: no broadcast, the gateway ::1 in the first.
		{name: "ipv6", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("fd00::/120", "", "", "")}}), allocator.DefaultBlocks),
			blocks: []string{"fd00::/122:62", "fd00::40/122:64", "fd00::80/122:64", "fd00::c0/122:64"}},
		// A /16 of /16 blocks: one block, 65,533 addresses.
		{name: "one /16 block", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("10.1.0.0/16", "", "", "")}}), allocator.Blocks{IPv4: 16, IPv6: 112}),
			blocks: []string{"10.1.0.0/16:65533"}},
		// A /64 has 2^58 blocks of /122: counted, not walked.
		{name: "ipv6 /64", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("fd00::/64", "", "", "")}}), allocator.DefaultBlocks),
			count: "288230376151711744"},
		// A /120 inside a /64: the few blocks a map draws of a set too large to walk.
		{name: "within a /64", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("fd00::/64", "", "", "")}}), allocator.DefaultBlocks),
			within: "fd00::1:0/120", blocks: []string{"fd00::1:0/122:64", "fd00::1:40/122:64", "fd00::1:80/122:64", "fd00::1:c0/122:64"}},
		// within clips the range: its last block still loses the broadcast address.
		{name: "within clips", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}), allocator.DefaultBlocks),
			within: "10.0.0.128/25", blocks: []string{"10.0.0.128/26:64", "10.0.0.192/26:63"}},
		// Nothing of the set inside within, or within of the other family.
		{name: "within elsewhere", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}), allocator.DefaultBlocks),
			within: "10.0.5.0/24", blocks: []string{}},
		{name: "within other family", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}), allocator.DefaultBlocks),
			within: "fd00::/120", blocks: []string{}},
		// A set the pool does not have.
		{name: "no such set", p: withBlocks(t, pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}), allocator.DefaultBlocks), set: 3,
			blocks: []string{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.count != "" {
				if got := tt.p.SetBlockCount(tt.set, tt.p.Blocks).String(); got != tt.count {
					t.Errorf("SetBlockCount %s, want %s", got, tt.count)
				}
				return
			}
			var within netip.Prefix
			if tt.within != "" {
				within = netip.MustParsePrefix(tt.within)
			}
			got := []string{}
			sum := 0
			for b := range tt.p.SetBlocksIn(tt.set, tt.p.Blocks, within) {
				c := tt.p.BlockCapacity(tt.set, b)
				got = append(got, fmt.Sprintf("%s:%d", b, c))
				sum += c
				if want := bruteCapacity(&tt.p, tt.set, b); c != want {
					t.Errorf("BlockCapacity(%s) %d, but %d addresses of the set in it are allocatable", b, c, want)
				}
			}
			if !slices.Equal(got, tt.blocks) {
				t.Errorf("SetBlocks %q, want %q", got, tt.blocks)
			}
			if within.IsValid() {
				return
			}
			if n := tt.p.SetBlockCount(tt.set, tt.p.Blocks); n.Int64() != int64(len(got)) {
				t.Errorf("SetBlockCount %s, SetBlocks yields %d", n, len(got))
			}
			if size := tt.p.SetSize(tt.set); size.Int64() != int64(sum) {
				t.Errorf("capacities add up to %d, SetSize is %s", sum, size)
			}
		})
	}
}

// bruteCapacity counts the addresses of block that range set `set` holds and the pool hands out.
func bruteCapacity(p *allocator.PoolSpec, set int, block netip.Prefix) int {
	n := 0
	for a := block.Masked().Addr(); a.IsValid() && block.Contains(a); a = a.Next() {
		if s, ok := p.SetOf(a); ok && s == set && p.Allocatable(a) == nil {
			n++
		}
	}
	return n
}
