package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/big"
	"math/bits"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/leasehold/leasehold/admin"
)

// pool show NAME --blocks: the pool's blocks as a map of two-character cells, one per block in
// address order, the claiming node's key then how full the block is. 32 cells per row fit 80
// columns beside an IPv4 label, so a /16 of /26 blocks (1,024) is 32 rows: one screen with its
// legend. Longer maps wrap into more rows, up to admin.DefaultMapLimit blocks per range set;
// a map of more than mapRows rows folds each run of rows with only free blocks into one line.

const (
	mapWidth = 80                 // columns the map fits
	mapRows  = 32                 // rows of a one-screen map: beyond, runs of free rows fold
	mapCells = admin.MapRowBlocks // cells per row, halved while the labels are too wide for 80 columns
)

// claimant is who a cell's key stands for: one node identity, expired or not.
type claimant struct {
	cluster, node, uid string
	expired            bool
}

// mapKeys are the keys of the nodes a map draws: a-z for live claims, A-Z for expired ones,
// '*' for nodes past the 26 letters.
type mapKeys struct {
	key   map[claimant]byte
	nodes []legendNode
}

// legendNode is one node key of the legend.
type legendNode struct {
	Key     string `json:"key"`
	Cluster string `json:"cluster"`
	Node    string `json:"node"`
	NodeUID string `json:"nodeUID"`
	// Agent is the agent's state (admin.AgentLive, AgentGone, AgentReplaced); the blocks of a
	// node whose agent is gone or replaced are expired.
	Agent string `json:"agent"`
	// Blocks counts its blocks drawn.
	Blocks int `json:"blocks"`
	first  int
}

// legendGlyph is one glyph of the legend.
type legendGlyph struct {
	Glyph   string `json:"glyph"`
	Meaning string `json:"meaning"`
}

// The glyphs of a cell: first its key, then its fill.
var (
	keyGlyphs = []legendGlyph{
		{"a-z", "a node named above"},
		{"A-Z", "expired: agent gone or replaced"},
		{" ", "no claim"},
		{"?", "no claim but in use"},
		{"!", "unreadable claim"},
		{"*", "more nodes (-o json)"},
	}
	fillGlyphs = []legendGlyph{
		{".", "none allocated"},
		{"1-9", "up to 10%-90%"},
		{"#", "full"},
		{"-", "nothing to hand out"},
	}
)

// blockMapJSON is pool show --blocks -o json: the block map with each block's cell, and the legend.
type blockMapJSON struct {
	*admin.BlockMap
	Sets   []mapSetJSON `json:"sets"`
	Legend mapLegend    `json:"legend"`
}

type mapSetJSON struct {
	admin.MapSet
	Blocks []mapCellJSON `json:"blocks"`
}

type mapCellJSON struct {
	*admin.MapBlock
	// Cell is the block's two characters in the map.
	Cell string `json:"cell"`
}

type mapLegend struct {
	Nodes []legendNode  `json:"nodes"`
	Keys  []legendGlyph `json:"keys"`
	Fills []legendGlyph `json:"fills"`
}

func poolBlocks(ctx context.Context, e *env) error {
	if e.cluster != "" {
		return usagef("pool show --blocks draws every cluster's blocks; drop --cluster")
	}
	name, err := poolArg(e.args[0])
	if err != nil {
		return err
	}
	m, err := admin.ReadBlockMap(ctx, e.cli, name, 0)
	if err != nil {
		return err
	}
	keys := keysOf(m)
	if e.output == "json" {
		out := blockMapJSON{BlockMap: m, Legend: mapLegend{Nodes: keys.nodes, Keys: keyGlyphs, Fills: fillGlyphs}}
		for _, s := range m.Sets {
			sj := mapSetJSON{MapSet: s, Blocks: make([]mapCellJSON, len(s.Blocks))}
			for i, b := range s.Blocks {
				sj.Blocks[i] = mapCellJSON{MapBlock: b, Cell: keys.cell(b)}
			}
			out.Sets = append(out.Sets, sj)
		}
		return writeJSON(e.stdout, out)
	}
	drawMap(e.stdout, m, keys)
	return nil
}

// keysOf gives a key to each node identity that claims a drawn block, in address order of its
// first block; with more than 26 of a kind, the 26 with the most blocks get the letters.
func keysOf(m *admin.BlockMap) *mapKeys {
	k := &mapKeys{key: map[claimant]byte{}, nodes: []legendNode{}}
	found := map[claimant]*legendNode{}
	var order []claimant
	n := 0
	for _, s := range m.Sets {
		for _, b := range s.Blocks {
			n++
			c, ok := claimantOf(b)
			if !ok {
				continue
			}
			if found[c] == nil {
				found[c] = &legendNode{Cluster: c.cluster, Node: c.node, NodeUID: c.uid, Agent: b.Claim.Agent, first: n}
				order = append(order, c)
			}
			found[c].Blocks++
		}
	}
	for _, expired := range []bool{false, true} {
		var kind []*legendNode
		for _, c := range order {
			if c.expired == expired {
				kind = append(kind, found[c])
			}
		}
		if len(kind) > 26 {
			slices.SortStableFunc(kind, func(a, b *legendNode) int { return b.Blocks - a.Blocks })
			kind = kind[:26]
			slices.SortFunc(kind, func(a, b *legendNode) int { return a.first - b.first })
		}
		letter := byte('a')
		if expired {
			letter = 'A'
		}
		for i, l := range kind {
			l.Key = string(letter + byte(i))
		}
	}
	for _, c := range order {
		l := found[c]
		if l.Key == "" {
			l.Key = "*"
		}
		k.key[c] = l.Key[0]
		k.nodes = append(k.nodes, *l)
	}
	// Live nodes first, then expired ones, then the rest.
	rank := func(l legendNode) int {
		return strings.IndexByte("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ*", l.Key[0])
	}
	slices.SortStableFunc(k.nodes, func(a, b legendNode) int { return rank(a) - rank(b) })
	return k
}

// claimantOf is the node identity of b's readable claim.
func claimantOf(b *admin.MapBlock) (claimant, bool) {
	if b.Claim == nil || b.Claim.Unreadable != "" {
		return claimant{}, false
	}
	return claimant{b.Claim.Cluster, b.Claim.Node, b.Claim.NodeUID, b.State == admin.BlockExpired}, true
}

// cell is b's two characters: its key, then its fill.
func (k *mapKeys) cell(b *admin.MapBlock) string {
	key := byte(' ')
	if c, ok := claimantOf(b); ok {
		key = k.key[c]
	} else if b.Claim != nil {
		key = '!'
	} else if b.State == admin.BlockUnclaimed {
		key = '?'
	}
	return string([]byte{key, fill(b.Allocated, b.Capacity)})
}

// fill is how full a block is: '.' none allocated, '1'-'9' up to 10%-90%, '#' full, '-' a
// block with nothing to hand out (all excluded).
func fill(allocated, capacity int) byte {
	switch {
	case allocated == 0 && capacity == 0:
		return '-'
	case allocated == 0:
		return '.'
	case allocated >= capacity:
		return '#'
	}
	return byte('0' + min(max((allocated*10+capacity-1)/capacity, 1), 9))
}

// mapRow is one row of cells.
type mapRow struct {
	start netip.Addr
	cells []string
	quiet bool // every block in it is free
}

// rowsOf lays the blocks of s out in rows of cells aligned on the row's size, each labeled
// with its first address: 32 cells, or 16 when a label is too wide for 80 columns.
func rowsOf(s admin.MapSet, k *mapKeys) (rows []mapRow, cells int) {
	for cells = mapCells; ; cells /= 2 {
		rows = nil
		width := 0
		for _, b := range s.Blocks {
			start, err := b.Block.Addr().Prefix(s.Bits - bits.TrailingZeros(uint(cells)))
			if err != nil {
				continue
			}
			if len(rows) == 0 || rows[len(rows)-1].start != start.Addr() {
				rows = append(rows, mapRow{start: start.Addr(), cells: slices.Repeat([]string{"  "}, cells), quiet: true})
				width = max(width, len(start.Addr().String()))
			}
			r := &rows[len(rows)-1]
			r.cells[cellIndex(b, s.Bits, cells)] = k.cell(b)
			r.quiet = r.quiet && b.State == admin.BlockFree
		}
		if width+1+2*cells <= mapWidth || cells == 1 {
			return rows, cells
		}
	}
}

// rowGap is how many rows of cells lie between the rows starting at prev and next (blocks of
// /blockBits), and where the first of them starts: a sparse map leaves rows without a block in use out.
func rowGap(prev, next netip.Addr, blockBits, cells int) (*big.Int, netip.Addr) {
	shift := uint(prev.BitLen() - blockBits + bits.TrailingZeros(uint(cells)))
	p, n := new(big.Int).SetBytes(prev.AsSlice()), new(big.Int).SetBytes(next.AsSlice())
	p.Add(p, new(big.Int).Lsh(big.NewInt(1), shift)) // the row after prev
	gap := new(big.Int).Sub(n, p)
	if gap.Sign() <= 0 {
		return new(big.Int), netip.Addr{}
	}
	from, _ := netip.AddrFromSlice(p.FillBytes(make([]byte, prev.BitLen()/8)))
	return gap.Rsh(gap, shift), from
}

// cellIndex is the place of block b (of prefix length blockBits) in its row of cells: the low
// bits of its block number. Blocks are at least /16 of IPv4 and /112 of IPv6, so the block
// number's low bits are in the address's last 64 bits.
func cellIndex(b *admin.MapBlock, blockBits, cells int) int {
	a := b.Block.Addr()
	a16 := a.As16()
	return int(binary.BigEndian.Uint64(a16[8:]) >> (a.BitLen() - blockBits) & uint64(cells-1))
}

// drawMap prints m with its legend.
func drawMap(w io.Writer, m *admin.BlockMap, k *mapKeys) {
	fmt.Fprintf(w, "pool %s, read at revision %d\n", m.Pool, m.Revision)
	switch mg := m.Migrating; {
	case mg != nil:
		fmt.Fprintf(w, "frozen by pool migrate (by %s): its %d key(s) still in the flat layout are drawn in their blocks\n", dash(mg.By), m.FlatKeys)
	case m.FlatKeys > 0:
		fmt.Fprintf(w, "%d key(s) in the flat layout are drawn in their blocks (leaseholdctl doctor)\n", m.FlatKeys)
	}
	for i, s := range m.Sets {
		if i > 0 {
			fmt.Fprintln(w)
		}
		rows, cells := rowsOf(s, k)
		head := subnetsOf(s.Ranges)
		head = append(head, s.Totals.Blocks+" blocks of /"+strconv.Itoa(s.Bits), strconv.Itoa(cells)+" a row")
		if s.Sparse {
			head = append(head, "only rows in use")
		}
		wrapItems(w, fmt.Sprintf("set %d: ", s.Set), head, ", ")
		width := 0
		for _, r := range rows {
			width = max(width, len(r.start.String()))
		}
		for j := 0; j < len(rows); j++ {
			r := rows[j]
			if j > 0 {
				if gap, from := rowGap(rows[j-1].start, r.start, s.Bits, cells); gap.Sign() > 0 {
					what := "outside the ranges"
					if s.Sparse {
						what = "no block in use"
					}
					fmt.Fprintf(w, "%-*s (%s rows, %s)\n", width, from, gap, what)
				}
			}
			run := 1
			for len(rows) > mapRows && r.quiet && j+run < len(rows) && rows[j+run].quiet {
				run++
			}
			if run > 1 {
				fmt.Fprintf(w, "%-*s (%d rows of free blocks)\n", width, r.start, run)
				j += run - 1
				continue
			}
			fmt.Fprintln(w, strings.TrimRight(fmt.Sprintf("%-*s %s", width, r.start, strings.Join(r.cells, "")), " "))
		}
		blocks, addrs := totalsText(s.Totals)
		wrapItems(w, "blocks: ", blocks, ", ")
		wrapItems(w, "addresses: ", addrs, ", ")
		switch nd := s.NotDrawn; {
		case nd == nil:
		case nd.ClaimedBlocks+nd.UnclaimedBlocks+nd.Allocated+nd.Quarantined+nd.Held+nd.Wanted+nd.Hosts == 0:
			fmt.Fprintf(w, "not drawn: %s more blocks, none in use\n", nd.Blocks)
		default:
			fmt.Fprintf(w, "not drawn: %s blocks past the first %d listed (%d claimed, %d expired, %d without claim; %d allocated); "+
				"-o json sums them under notDrawn\n", nd.Blocks, m.Limit, nd.ClaimedBlocks, nd.ExpiredBlocks, nd.UnclaimedBlocks, nd.Allocated)
		}
	}
	if m.OffMap+m.StrayClaims > 0 {
		fmt.Fprintf(w, "off the map: %d allocation(s) and %d block claim(s) in no block of the pool's ranges (leaseholdctl doctor)\n",
			m.OffMap, m.StrayClaims)
	}
	var nodes []string
	others := 0
	for _, l := range k.nodes {
		if l.Key == "*" {
			others++
			continue
		}
		s := l.Key + " " + l.Cluster + "/" + l.Node
		if l.Agent != admin.AgentLive {
			s += " (agent " + l.Agent + ")"
		}
		nodes = append(nodes, s)
	}
	if others > 0 {
		nodes = append(nodes, fmt.Sprintf("* %d more (-o json names them)", others))
	}
	if len(nodes) > 0 {
		wrapItems(w, "nodes: ", nodes, "  ")
	}
	if b := borrowedText(m, k); len(b) > 0 {
		wrapItems(w, "borrowed: ", b, "; ")
	}
	wrapItems(w, "key: ", glyphItems(keyGlyphs), ", ")
	wrapItems(w, "fill: ", glyphItems(fillGlyphs), ", ")
}

// subnetsOf lists the subnets of a range set's text (allocator.RangeSet.String), each once.
func subnetsOf(ranges string) []string {
	var out []string
	for _, r := range strings.Split(ranges, ", ") {
		if sub, _, _ := strings.Cut(r, " "); !slices.Contains(out, sub) {
			out = append(out, sub)
		}
	}
	return out
}

// totalsText sums a set up: its blocks claimed, expired, without claim and free, then its
// addresses allocated of its capacity; other counts only when not zero.
func totalsText(t admin.MapTotals) (blocks, addrs []string) {
	nonZero := func(out []string, n int, what string) []string {
		if n > 0 {
			out = append(out, strconv.Itoa(n)+" "+what)
		}
		return out
	}
	blocks = []string{strconv.Itoa(t.ClaimedBlocks) + " claimed"}
	if t.ExpiredBlocks > 0 {
		blocks[0] += " (" + strconv.Itoa(t.ExpiredBlocks) + " expired)"
	}
	blocks = nonZero(blocks, t.UnclaimedBlocks, "unclaimed but in use")
	blocks = append(blocks, t.FreeBlocks+" free")
	addrs = []string{strconv.Itoa(t.Allocated) + " allocated of " + t.Capacity}
	addrs = nonZero(addrs, t.Borrowed, "borrowed")
	addrs = nonZero(addrs, t.Quarantined, "quarantined")
	addrs = nonZero(addrs, t.Expired, "expired (held back)")
	addrs = nonZero(addrs, t.Wanted, "wanted back")
	addrs = nonZero(addrs, t.Hosts, "used by hosts")
	return blocks, addrs
}

// borrowedText says, per borrowing node, how many addresses it holds in which node's blocks.
func borrowedText(m *admin.BlockMap, k *mapKeys) []string {
	counts := map[string]map[string]int{}
	for _, s := range m.Sets {
		for _, b := range s.Blocks {
			owner := string(k.cell(b)[0])
			for _, a := range b.Borrowed {
				who := a.Cluster + "/" + a.Node
				if counts[who] == nil {
					counts[who] = map[string]int{}
				}
				counts[who][owner]++
			}
		}
	}
	var out []string
	for _, who := range sortedKeys(counts) {
		var in []string
		for _, owner := range sortedKeys(counts[who]) {
			in = append(in, strconv.Itoa(counts[who][owner])+" in blocks of "+owner)
		}
		out = append(out, who+" holds "+strings.Join(in, ", "))
	}
	return out
}

// glyphItems renders glyphs for the legend; a blank glyph is shown quoted.
func glyphItems(gs []legendGlyph) []string {
	out := make([]string, len(gs))
	for i, g := range gs {
		glyph := g.Glyph
		if glyph == " " {
			glyph = "' '"
		}
		out[i] = glyph + " " + g.Meaning
	}
	return out
}

// wrapItems prints items after prefix, separated by sep, wrapped at mapWidth with continuation
// lines indented under the first item.
func wrapItems(w io.Writer, prefix string, items []string, sep string) {
	line := prefix
	for i, it := range items {
		switch {
		case i == 0:
			line += it
		case len(line)+len(sep)+len(it) > mapWidth:
			fmt.Fprintln(w, strings.TrimRight(line+sep, " "))
			line = strings.Repeat(" ", len(prefix)) + it
		default:
			line += sep + it
		}
	}
	fmt.Fprintln(w, line)
}
