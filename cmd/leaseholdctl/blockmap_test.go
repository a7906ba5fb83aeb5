package main

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// TestPoolShowBlocks draws the map of a pool of 16 blocks of /28 that real agents made: node-a's
// block (an allocation, a released address in quarantine, and an address node-b requested
// there: borrowed), node-b's block, node-c's block expired (its agent stopped with a pod left,
// the other pod's lease then revoked: an expired address), node-d's block whose block lease
// was revoked after its agent stopped (an allocation without claim), and 12 free blocks.
func TestPoolShowBlocks(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.ClientAt(t, endpoint)
	cluster, pool := etcdtest.Uniq("c"), etcdtest.Uniq("map")
	if r := ctl("pool", "create", pool, "--range", "10.98.0.0/24", "--block-v4", "28"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	blocks := allocator.Blocks{IPv4: 28, IPv6: allocator.DefaultBlocks.IPv6}
	long := func(c *leases.Config) { c.LeaseTTL = time.Minute } // nothing expires by itself during the test
	first := func(res allocator.Result) netip.Addr { return res.IPs[0].Address.Addr() }
	revoke := func(what, hexID string) {
		id, err := keyspace.ParseLeaseHex(hexID)
		if err == nil {
			_, err = cli.Revoke(ctx, id)
		}
		if err != nil {
			t.Fatalf("revoke %s %s: %v", what, hexID, err)
		}
	}
	leaseOfKey := func(key string) string {
		resp, err := cli.Get(ctx, key)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("get %s: %v, %v", key, resp, err)
		}
		return keyspace.LeaseHex(keyspace.LeaseOf(resp.Kvs[0]))
	}
	a := agent(t, endpoint, cluster, "node-a", long, func(c *leases.Config) { c.Quarantine = time.Minute })
	a1, a2 := first(attach(t, a, pool, "a1")), first(attach(t, a, pool, "a2"))
	if err := a.Del(ctx, allocator.Request{Network: pool, Pool: allocator.PoolSpec{Name: pool}, ContainerID: "a2", IfName: "eth0",
		Pod: allocator.PodRef{UID: "u-a2"}}); err != nil {
		t.Fatal(err)
	}
	b := agent(t, endpoint, cluster, "node-b", long)
	b1 := first(attach(t, b, pool, "b1"))
	blockA := blocks.Of(a1)
	lent := blockA.Addr().Next().Next() // .1 of 10.98.0.0/28 is the gateway
	for lent == a1 || lent == a2 {
		lent = lent.Next()
	}
	attach(t, b, pool, "b2", lent.String())
	c := agent(t, endpoint, cluster, "node-c", long)
	c1, c2 := first(attach(t, c, pool, "c1")), first(attach(t, c, pool, "c2"))
	// node-c stops with pods left and its node lease ends (revoked here, as its expiry would):
	// the pods' leases and the block lease stay, so its block is expired.
	c.Close()
	revoke("node-c's node lease", leaseOfKey(keyspace.NodeKey(cluster, "node-c")))
	allocs, err := admin.ListAllocations(ctx, cli, pool)
	if i := slices.IndexFunc(allocs, func(a admin.AllocationEntry) bool { return a.IP == c2 }); err != nil || i < 0 {
		t.Fatalf("c2's allocation %s: %v", c2, err)
	} else {
		revoke("c2's pod lease", allocs[i].Lease)
	}
	d := agent(t, endpoint, cluster, "node-d", long)
	d1 := first(attach(t, d, pool, "d1"))
	d.Close()
	revoke("node-d's block lease", leaseOfKey(keyspace.BlockKey(pool, blocks.Of(d1)))) // its claim goes, d1 stays

	blockB, blockC, blockD := blocks.Of(b1), blocks.Of(c1), blocks.Of(d1)
	keyA, keyB := "a", "b" // live nodes are lettered in address order of their first block
	if blockB.Addr().Less(blockA.Addr()) {
		keyA, keyB = "b", "a"
	}
	cells := map[netip.Prefix]string{blockA: keyA + "2", blockB: keyB + "1", blockC: "A1", blockD: "?1"}
	row := "10.98.0.0 "
	for i := range 16 {
		row += cmp.Or(cells[netip.MustParsePrefix(fmt.Sprintf("10.98.0.%d/28", 16*i))], " .")
	}
	nodes := []string{keyA + " " + cluster + "/node-a", keyB + " " + cluster + "/node-b"}
	slices.Sort(nodes)
	r := ctl("pool", "show", pool, "--blocks")
	var rev int64
	if _, err := fmt.Sscanf(r.stdout, "pool "+pool+", read at revision %d\n", &rev); err != nil || r.code != 0 {
		t.Fatalf("pool show --blocks: exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
	}
	want := fmt.Sprintf(`pool %s, read at revision %d
set 0: 10.98.0.0/24, 16 blocks of /28, 32 a row
%s
blocks: 3 claimed (1 expired), 1 unclaimed but in use, 12 free
addresses: 5 allocated of 253, 1 borrowed, 1 quarantined, 1 expired (held back)
nodes: %s  %s  A %s/node-c (agent gone)
borrowed: %s/node-b holds 1 in blocks of %s
key: a-z a node named above, A-Z expired: agent gone or replaced, ' ' no claim,
     ? no claim but in use, ! unreadable claim, * more nodes (-o json)
fill: . none allocated, 1-9 up to 10%%-90%%, # full, - nothing to hand out
`, pool, rev, strings.TrimRight(row, " "), nodes[0], nodes[1], cluster, cluster, keyA)
	if r.stdout != want {
		t.Errorf("pool show --blocks:\n%s\nwant:\n%s", r.stdout, want)
	}

	var m blockMapJSON
	jsonOf(t, ctl("pool", "show", pool, "--blocks", "-o", "json"), &m)
	if len(m.Sets) != 1 || len(m.Sets[0].Blocks) != 16 || m.Sets[0].NotDrawn != nil {
		t.Fatalf("-o json: want one set of 16 blocks, all drawn: %+v", m.Sets)
	}
	byBlock := map[netip.Prefix]mapCellJSON{}
	for _, c := range m.Sets[0].Blocks {
		byBlock[c.Block] = c
		if want := cmp.Or(cells[c.Block], " ."); c.Cell != want {
			t.Errorf("block %s: cell %q, want %q", c.Block, c.Cell, want)
		}
	}
	claimOf := func(c mapCellJSON) string {
		if c.Claim == nil {
			return "none"
		}
		return c.Claim.Node + "/" + c.Claim.NodeUID + "/" + c.Claim.Agent
	}
	tests := []struct {
		name     string
		block    netip.Prefix
		state    string
		claim    string
		counts   [5]int // allocated, quarantined, held, expired, capacity
		borrowed []admin.BorrowedAddress
	}{
		// node-a's: its pod, node-b's requested address (borrowed; its held key is node-b's) and
		// the released address resting in quarantine.
		{"a", blockA, admin.BlockClaimed, "node-a/uid-node-a/live", [5]int{2, 1, 2, 0, capacity16(blockA)},
			[]admin.BorrowedAddress{{IP: lent, Cluster: cluster, Node: "node-b"}}},
		{"b", blockB, admin.BlockClaimed, "node-b/uid-node-b/live", [5]int{1, 0, 1, 0, capacity16(blockB)}, nil},
		// node-c's agent is gone: its claim is expired; c2's lease ran out, so its held key is
		// all that is left of it: an expired address.
		{"c", blockC, admin.BlockExpired, "node-c/uid-node-c/gone", [5]int{1, 0, 2, 1, capacity16(blockC)}, nil},
		// node-d's claim went with its block lease, and its held key too; the pod's allocation stays.
		{"d", blockD, admin.BlockUnclaimed, "none", [5]int{1, 0, 0, 0, capacity16(blockD)}, nil},
	}
	for _, tt := range tests {
		c, ok := byBlock[tt.block]
		if !ok {
			t.Errorf("%s: block %s not in the map", tt.name, tt.block)
			continue
		}
		got := [5]int{c.Allocated, c.Quarantined, c.Held, c.Expired, c.Capacity}
		if c.State != tt.state || claimOf(c) != tt.claim || got != tt.counts || !slices.Equal(c.Borrowed, append([]admin.BorrowedAddress{}, tt.borrowed...)) {
			t.Errorf("%s: block %s is %s, claim %s, counts %v, borrowed %v; want %s, %s, %v, %v", tt.name, tt.block, c.State, claimOf(c), got,
				c.Borrowed, tt.state, tt.claim, tt.counts, tt.borrowed)
		}
	}
	wantTotals := admin.MapTotals{Blocks: "16", ClaimedBlocks: 3, ExpiredBlocks: 1, UnclaimedBlocks: 1, FreeBlocks: "12", Capacity: "253",
		Allocated: 5, Borrowed: 1, Quarantined: 1, Held: 5, Expired: 1}
	if m.Sets[0].Totals != wantTotals {
		t.Errorf("totals %+v, want %+v", m.Sets[0].Totals, wantTotals)
	}
	var legend []string
	for _, n := range m.Legend.Nodes {
		legend = append(legend, fmt.Sprintf("%s %s/%s %s %s %d", n.Key, n.Cluster, n.Node, n.NodeUID, n.Agent, n.Blocks))
	}
	wantLegend := []string{keyA + " " + cluster + "/node-a uid-node-a live 1", keyB + " " + cluster + "/node-b uid-node-b live 1",
		"A " + cluster + "/node-c uid-node-c gone 1"}
	slices.Sort(wantLegend[:2])
	if !slices.Equal(legend, wantLegend) || len(m.Legend.Keys) == 0 || len(m.Legend.Fills) == 0 {
		t.Errorf("legend %q (%d keys, %d fills), want nodes %q", legend, len(m.Legend.Keys), len(m.Legend.Fills), wantLegend)
	}
	var raw struct {
		Sets []struct {
			Blocks []map[string]any `json:"blocks"`
		} `json:"sets"`
	}
	jsonOf(t, ctl("pool", "show", pool, "--blocks", "-o", "json"), &raw)
	for _, k := range []string{"block", "state", "claim", "capacity", "allocated", "borrowed", "quarantined", "held", "expired", "wanted", "hosts", "cell"} {
		if _, ok := raw.Sets[0].Blocks[0][k]; !ok {
			t.Errorf("field %q missing in a block of -o json: %v", k, raw.Sets[0].Blocks[0])
		}
	}
}

// TestPoolShowBlocksRefusals: what pool show --blocks cannot draw says why and what to run.
func TestPoolShowBlocksRefusals(t *testing.T) {
	tests := []struct {
		name string
		args []string
		code int
		says string
	}{
		// A pool that does not exist: not found, as pool show says it.
		{"unknown pool", []string{"pool", "show", etcdtest.Uniq("nomap"), "--blocks"}, exitNotFound, "has no definition"},
		// The map is of every cluster's blocks: a cluster filter would hide who holds them.
		{"cluster", []string{"pool", "show", "any", "--blocks", "--cluster", "c1"}, exitUsage, "drop --cluster"},
		// --blocks belongs to pool show.
		{"other command", []string{"pool", "list", "--blocks"}, exitUsage, "does not take --blocks"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(tt.args...)
			if r.code != tt.code || !strings.Contains(r.stderr, tt.says) {
				t.Errorf("exit %d, want %d saying %q\nstdout: %s\nstderr: %s", r.code, tt.code, tt.says, r.stdout, r.stderr)
			}
		})
	}
}

// capacity16 is what a /28 block of 10.98.0.0/24 hands out: the first loses the network
// address and the gateway, the last the broadcast address.
func capacity16(b netip.Prefix) int {
	switch b.Addr() {
	case netip.MustParseAddr("10.98.0.0"):
		return 14
	case netip.MustParseAddr("10.98.0.240"):
		return 15
	}
	return 16
}

// TestPoolShowBlocksScreen: the map of a /16 in default blocks with three nodes' pods is one
// screen: its 1,024 blocks of /26 are 32 rows of 32 cells, 40 lines with the legend. The map of
// a /64, 2^58 blocks of /122, draws only the rows that hold a node's block, 16 cells a row
// beside their long labels. No line is wider than 80 columns.
func TestPoolShowBlocksScreen(t *testing.T) {
	cluster, pool4, pool6 := etcdtest.Uniq("c"), etcdtest.Uniq("screen"), etcdtest.Uniq("screen")
	for _, r := range []result{ctl("pool", "create", pool4, "--range", "10.101.0.0/16"), ctl("pool", "create", pool6, "--range", "fd65::/64")} {
		if r.code != 0 {
			t.Fatalf("pool create: %+v", r)
		}
	}
	for _, node := range []string{"n1", "n2", "n3"} {
		a := agent(t, endpoint, cluster, node)
		for _, pool := range []string{pool4, pool6} {
			attach(t, a, pool, node+"-1")
			attach(t, a, pool, node+"-2")
		}
	}
	lines := func(pool string) []string {
		r := ctl("pool", "show", pool, "--blocks")
		if r.code != 0 {
			t.Fatalf("pool show --blocks: %+v", r)
		}
		out := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
		for i, l := range out {
			if len(l) > mapWidth {
				t.Errorf("%s line %d is %d columns: %q", pool, i, len(l), l)
			}
		}
		return out
	}
	v4 := lines(pool4)
	rows := 0
	for i := range 32 {
		if len(v4) > 2+i && strings.HasPrefix(v4[2+i], fmt.Sprintf("10.101.%d.0 ", 8*i)) {
			rows++
		}
	}
	if len(v4) != 40 || rows != 32 || v4[1] != "set 0: 10.101.0.0/16, 1024 blocks of /26, 32 a row" || v4[34] != "blocks: 3 claimed, 1021 free" ||
		v4[35] != "addresses: 6 allocated of 65533" || !strings.HasPrefix(v4[36], "nodes: a "+cluster+"/") {
		t.Errorf("a /16: %d lines, %d rows labeled 10.101.0.0, 10.101.8.0, ..., 10.101.248.0; want 40 lines, 32 rows:\n%s", len(v4), rows,
			strings.Join(v4, "\n"))
	}
	// The /64: each node's block in a row of 32 blocks, as two rows of 16, and the rows between folded.
	v6 := lines(pool6)
	var drawn, folds int
	for _, l := range v6 {
		switch {
		case strings.HasSuffix(l, " rows, no block in use)"):
			folds++
		case strings.HasPrefix(l, "fd65:"):
			drawn++
		}
	}
	if len(v6) < 2 || v6[1] != "set 0: fd65::/64, 288230376151711744 blocks of /122, 16 a row, only rows in use" ||
		drawn != 6 || folds != 2 || !slices.Contains(v6, "blocks: 3 claimed, 288230376151711741 free") ||
		!slices.Contains(v6, "not drawn: 288230376151711648 more blocks, none in use") {
		t.Errorf("a /64: %d rows drawn, %d folds; want 6 and 2:\n%s", drawn, folds, strings.Join(v6, "\n"))
	}
	// A /15 is 64 rows, more than a screen: its rows without a block in use fold into one line.
	// Two ranges far apart: the rows between them are outside the pool.
	wide, apart := etcdtest.Uniq("screen"), etcdtest.Uniq("screen")
	for _, r := range []result{ctl("pool", "create", wide, "--range", "10.102.0.0/15"),
		ctl("pool", "create", apart, "--range", "10.104.0.0/24", "--range", "10.104.64.0/25")} {
		if r.code != 0 {
			t.Fatalf("pool create: %+v", r)
		}
	}
	if got := lines(wide)[1:5]; !slices.Equal(got, []string{"set 0: 10.102.0.0/15, 2048 blocks of /26, 32 a row",
		"10.102.0.0   (64 rows of free blocks)", "blocks: 0 claimed, 2048 free", "addresses: 0 allocated of 131069"}) {
		t.Errorf("a /15 without a block in use:\n%s", strings.Join(got, "\n"))
	}
	if got := lines(apart)[1:6]; !slices.Equal(got, []string{"set 0: 10.104.0.0/24, 10.104.64.0/25, 6 blocks of /26, 32 a row",
		"10.104.0.0   . . . .", "10.104.8.0  (7 rows, outside the ranges)", "10.104.64.0  . .", "blocks: 0 claimed, 6 free"}) {
		t.Errorf("a set of two ranges far apart:\n%s", strings.Join(got, "\n"))
	}

	var m blockMapJSON
	jsonOf(t, ctl("pool", "show", pool6, "--blocks", "-o", "json"), &m)
	if s := m.Sets[0]; !s.Sparse || len(s.Blocks) != 96 || s.NotDrawn == nil || s.NotDrawn.Blocks != "288230376151711648" ||
		s.NotDrawn.ClaimedBlocks != 0 || s.Totals.ClaimedBlocks != 3 {
		t.Errorf("a /64 -o json: sparse %v, %d blocks listed, not drawn %+v, totals %+v; want the 96 blocks of 3 rows, nothing in use not drawn",
			s.Sparse, len(s.Blocks), s.NotDrawn, s.Totals)
	}
}

// TestMapKeys: 28 live nodes claim blocks, one of them three, so two go without a letter: the
// node with three blocks keeps one and the two of the fewest blocks that come last get '*'. An
// expired claim's node is upper case, an unreadable claim '!', a block without claim but with an
// allocation '?'.
func TestMapKeys(t *testing.T) {
	var blocks []*admin.MapBlock
	claim := func(node, agent string) *admin.MapClaim {
		return &admin.MapClaim{Cluster: "c", Node: node, NodeUID: "uid-" + node, Agent: agent}
	}
	for i := range 27 {
		blocks = append(blocks, &admin.MapBlock{State: admin.BlockClaimed, Claim: claim(fmt.Sprintf("n%02d", i), admin.AgentLive), Capacity: 64})
	}
	for range 3 {
		blocks = append(blocks, &admin.MapBlock{State: admin.BlockClaimed, Claim: claim("big", admin.AgentLive), Capacity: 64, Allocated: 64})
	}
	blocks = append(blocks,
		&admin.MapBlock{State: admin.BlockExpired, Claim: claim("gone", admin.AgentGone), Capacity: 64, Allocated: 7},
		&admin.MapBlock{State: admin.BlockClaimed, Claim: &admin.MapClaim{Unreadable: "bad JSON", Agent: admin.AgentUnknown}, Capacity: 64},
		&admin.MapBlock{State: admin.BlockUnclaimed, Capacity: 62, Allocated: 1},
		&admin.MapBlock{State: admin.BlockFree})
	m := &admin.BlockMap{Sets: []admin.MapSet{{Blocks: blocks}}}
	k := keysOf(m)
	var cells []string
	for _, b := range blocks {
		cells = append(cells, k.cell(b))
	}
	want := strings.Fields("a. b. c. d. e. f. g. h. i. j. k. l. m. n. o. p. q. r. s. t. u. v. w. x. y. *. *. z# z# z# A2 !. ?1")
	if got := cells[:len(cells)-1]; !slices.Equal(got, want) || cells[len(cells)-1] != " -" {
		t.Errorf("cells %q, want %q and \" -\"", cells, want)
	}
	var legend []string
	for _, n := range k.nodes {
		legend = append(legend, n.Key+n.Node)
	}
	if !slices.Equal(legend[24:], []string{"yn24", "zbig", "Agone", "*n25", "*n26"}) || len(legend) != 29 {
		t.Errorf("legend %q: want a-y for n00-n24, z for big, A for gone, * for n25 and n26", legend)
	}
	var out strings.Builder
	drawMap(&out, m, k)
	if !strings.Contains(out.String(), "A c/gone (agent gone)  * 2 more (-o json names them)\n") {
		t.Errorf("the legend does not end with node A and the 2 nodes without a letter:\n%s", out.String())
	}
}

func TestFill(t *testing.T) {
	tests := []struct {
		allocated, capacity int
		want                byte
	}{
		{0, 64, '.'},  // nothing allocated
		{1, 64, '1'},  // the least is 1: in use
		{6, 64, '1'},  // 9.4%: up to 10%
		{7, 64, '2'},  // 10.9%: past 10%
		{57, 64, '9'}, // 89%
		{63, 64, '9'}, // 98%: 9 until the last address goes
		{64, 64, '#'}, // full
		{65, 64, '#'}, // more keys than the block hands out (doctor): still full
		{0, 0, '-'},   // all excluded
		{1, 0, '#'},   // an address where nothing is handed out (doctor): full
	}
	for _, tt := range tests {
		if got := fill(tt.allocated, tt.capacity); got != tt.want {
			t.Errorf("fill(%d, %d) = %c, want %c", tt.allocated, tt.capacity, got, tt.want)
		}
	}
}
