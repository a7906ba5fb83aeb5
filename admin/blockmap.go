package admin

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"maps"
	"math/big"
	mathbits "math/bits"
	"net/netip"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The block map of a pool (leaseholdctl pool show --blocks): every block of each range set in
// address order, whether a node claims it and how full it is, from one read at one revision.

// ErrNoBlocks: the pool is in the flat layout (stored before blocks), so it has no block map.
var ErrNoBlocks = errors.New("pool has no blocks")

// Block states of a block map (MapBlock.State).
const (
	// BlockFree: no claim and no allocation, held or wanted key: the next node to need a block
	// may claim it. Quarantined addresses may still rest in it.
	BlockFree = "free"
	// BlockClaimed: claimed by a node whose agent is live (State.AgentOf).
	BlockClaimed = "claimed"
	// BlockExpired: claimed by a node whose agent is gone or was replaced (State.ExpiredBlocks):
	// its node's until the block lease expires, other nodes only borrow in it meanwhile.
	BlockExpired = "expired"
	// BlockUnclaimed: no claim, but allocations, held or wanted keys remain: the claim's lease
	// ended before its pods' (a dead node's pods expiring, a revoked block lease), or an
	// address a pod requested where no node claims.
	BlockUnclaimed = "unclaimed"
)

// DefaultMapLimit is how many blocks of each range set a block map lists when the caller
// does not say: 128 rows of 32, four screens.
const DefaultMapLimit = 4096

// MapRowBlocks is how many blocks make a row of a map: a set with more blocks than the limit
// (an IPv6 /64 has 2^58 blocks of /122) lists only its rows that hold a block in use.
const MapRowBlocks = 32

// mapPage is how many keys one read of ReadBlockMap returns at most: a /16 of /24 blocks may
// hold 65,000 allocations, read in pages rather than as one response of tens of megabytes.
var mapPage int64 = 1000

// nodeBatch is how many node records one transaction reads, within etcd's default limit of
// 128 operations.
const nodeBatch = 100

// BlockMap is a pool's blocks as one read at Revision saw them.
type BlockMap struct {
	Pool     string           `json:"pool"`
	Key      string           `json:"key"`
	Revision int64            `json:"revision"`
	Blocks   allocator.Blocks `json:"blocks"`
	// Limit is how many blocks of each set are listed at most.
	Limit int `json:"limit"`
	// Migrating is set while leaseholdctl pool migrate has the pool frozen; its keys still in the
	// flat layout are drawn in the block of their address, and counted in FlatKeys.
	Migrating *keyspace.Migration `json:"migrating,omitempty"`
	Sets      []MapSet            `json:"sets"`
	FlatKeys  int                 `json:"flatKeys"`
	// OffMap counts allocations of addresses in no block of any range set, StrayClaims block
	// claims of no block of any range set: leaseholdctl doctor says which and what to do.
	OffMap      int `json:"offMap"`
	StrayClaims int `json:"strayClaims"`
}

// MapSet is the map of one range set.
type MapSet struct {
	Set    int    `json:"set"`
	Family int    `json:"family"`
	Ranges string `json:"ranges"`
	// Bits is the block prefix length of the set's family.
	Bits int `json:"bits"`
	// Blocks are the set's blocks (allocator.PoolSpec.SetBlocks) in address order, at most Limit.
	// When the set has more than Limit, Sparse is set and Blocks are only those of each row of
	// MapRowBlocks, aligned on its size, that holds a block in use (a claim or any key).
	Blocks []*MapBlock `json:"blocks"`
	Sparse bool        `json:"sparse"`
	// Totals counts every block of the set; NotDrawn those not in Blocks (nil when there are
	// none): free blocks of a sparse set, and whatever is past Limit.
	Totals   MapTotals  `json:"totals"`
	NotDrawn *MapTotals `json:"notDrawn,omitempty"`
}

// MapBlock is one block and what its keys say.
type MapBlock struct {
	Block netip.Prefix `json:"block"`
	// State is BlockFree, BlockClaimed, BlockExpired or BlockUnclaimed.
	State string `json:"state"`
	// Claim is the block's claim; nil when there is none.
	Claim *MapClaim `json:"claim"`
	// Capacity is how many addresses of the set in the block the pool hands out.
	Capacity  int `json:"capacity"`
	Allocated int `json:"allocated"`
	// Borrowed are the allocations of nodes other than the claim's: addresses borrowed in a
	// block another node holds.
	Borrowed    []BorrowedAddress `json:"borrowed"`
	Quarantined int               `json:"quarantined"`
	// Held counts held keys; Expired those without an allocation: addresses held back for a
	// node cut off or gone (State.Expired).
	Held    int `json:"held"`
	Expired int `json:"expired"`
	// Wanted counts addresses a running pod wants back after a conflict; Hosts addresses nodes
	// use themselves (never handed out while published).
	Wanted int `json:"wanted"`
	Hosts  int `json:"hosts"`
}

// MapClaim is a block claim as the map shows it.
type MapClaim struct {
	Key     string    `json:"key"`
	Cluster string    `json:"cluster"`
	Node    string    `json:"node"`
	NodeUID string    `json:"nodeUID"`
	Lease   string    `json:"lease"`
	Since   time.Time `json:"since"`
	// Agent is AgentLive, AgentGone, AgentReplaced, or AgentUnknown for an unreadable claim.
	Agent      string `json:"agent"`
	Unreadable string `json:"unreadable,omitempty"`
}

// BorrowedAddress is an allocation of a node in a block another node claims.
type BorrowedAddress struct {
	IP      netip.Addr `json:"ip"`
	Cluster string     `json:"cluster"`
	Node    string     `json:"node"`
}

// MapTotals sums blocks up. ClaimedBlocks counts every claim, ExpiredBlocks those of them in
// state BlockExpired (as leaseholdctl pool list counts); FreeBlocks is what no claim and no key
// holds. Counts of blocks and of capacity are decimal strings: IPv6 exceeds 64 bits.
type MapTotals struct {
	Blocks          string `json:"blocks"`
	ClaimedBlocks   int    `json:"claimedBlocks"`
	ExpiredBlocks   int    `json:"expiredBlocks"`
	UnclaimedBlocks int    `json:"unclaimedBlocks"`
	FreeBlocks      string `json:"freeBlocks"`
	Capacity        string `json:"capacity"`
	Allocated       int    `json:"allocated"`
	Borrowed        int    `json:"borrowed"`
	Quarantined     int    `json:"quarantined"`
	Held            int    `json:"held"`
	Expired         int    `json:"expired"`
	Wanted          int    `json:"wanted"`
	Hosts           int    `json:"hosts"`
}

// ReadBlockMap reads the block map of pool at one revision: the definition first, then the
// pool's block claims, allocation, quarantine, held and wanted keys, the host addresses and
// the node records of the claims' nodes, each read in pages of at most 1,000 keys pinned to
// the definition's revision. A set of at most limit blocks (DefaultMapLimit when limit <= 0)
// lists every block; a larger one only its rows with a block in use, at most limit blocks; the
// blocks not listed are summed up in MapSet.NotDrawn.
//
// Errors wrap ErrNotFound (no such pool), ErrNoBlocks (a pool in the flat layout),
// allocator.ErrInvalidName, ErrConcurrentChange (etcd compacted the revision while it was
// read), or the etcd error; an unreadable or invalid definition is an error naming its key.
func ReadBlockMap(ctx context.Context, cli *clientv3.Client, pool string, limit int) (*BlockMap, error) {
	if err := allocator.ValidateName("pool", pool); err != nil {
		return nil, err
	}
	if limit <= 0 {
		limit = DefaultMapLimit
	}
	key := keyspace.PoolKey(pool)
	resp, err := cli.Get(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("read pool %s: %w", pool, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, fmt.Errorf("%w: pool %s has no definition (%s); leaseholdctl pool list shows the pools", ErrNotFound, pool, key)
	}
	p := poolEntry(resp.Kvs[0], pool)
	switch {
	case p.Unreadable != "":
		return nil, fmt.Errorf("pool definition %s is unreadable (%s); inspect it with: etcdctl get %s", key, p.Unreadable, key)
	case p.Invalid != "":
		return nil, fmt.Errorf("pool definition %s is invalid: %s", key, p.Invalid)
	case p.Value.Blocks.Flat():
		return nil, fmt.Errorf("%w: pool %s is in the flat layout (stored before blocks), so there is no block map to draw; "+
			"leaseholdctl pool show %s gives its counts per range, and leaseholdctl pool migrate %s moves it to blocks once every "+
			"agent serves them", ErrNoBlocks, pool, pool, pool)
	}
	st := &State{Revision: resp.Header.Revision, Pools: []PoolEntry{p}}
	var wanted []netip.Addr
	wantedKey := func(kv *mvccpb.KeyValue) { // several owners may want one address back
		if _, _, ip, _, _, err := keyspace.ParseWantedKey(string(kv.Key)); err == nil && !slices.Contains(wanted, ip) {
			wanted = append(wanted, ip)
		}
	}
	for _, r := range []struct {
		prefix string
		fn     func(*mvccpb.KeyValue)
	}{
		{keyspace.BlocksPrefix(pool), st.add}, {keyspace.IPsPrefix(pool), st.add}, {keyspace.QuarantinePrefix(pool), st.add},
		{keyspace.HeldPrefix(pool), st.add}, {keyspace.HostIPPrefix(netip.Addr{}), st.add},
		{keyspace.WantedPrefix(pool, allocator.Blocks{}, netip.Addr{}), wantedKey},
	} {
		if err := readPages(ctx, cli, st.Revision, r.prefix, r.fn); err != nil {
			return nil, err
		}
		st.prefixes = append(st.prefixes, r.prefix)
	}
	if err := readNodes(ctx, cli, st); err != nil {
		return nil, err
	}
	return foldBlockMap(st, p, wanted, limit), nil
}

// readPages calls fn with every key under prefix as of revision rev, read in pages of mapPage.
func readPages(ctx context.Context, cli *clientv3.Client, rev int64, prefix string, fn func(*mvccpb.KeyValue)) error {
	end := clientv3.GetPrefixRangeEnd(prefix)
	for from := prefix; ; {
		resp, err := cli.Get(ctx, from, clientv3.WithRange(end), clientv3.WithRev(rev), clientv3.WithLimit(mapPage))
		if err != nil {
			return readAtErr(prefix, rev, err)
		}
		for _, kv := range resp.Kvs {
			fn(kv)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// readNodes reads, at st's revision, the node record of every node a readable block claim of
// st names, so that State.AgentOf knows whether each claim's agent lives.
func readNodes(ctx context.Context, cli *clientv3.Client, st *State) error {
	var keys []string
	seen := map[string]bool{}
	for _, b := range st.Blocks {
		nk := keyspace.NodeKey(b.Value.Cluster, b.Value.Node)
		if b.Unreadable == "" && keyspace.ValidateNames("cluster", b.Value.Cluster, "node", b.Value.Node) == nil && !seen[nk] {
			seen[nk] = true
			keys = append(keys, nk)
		}
	}
	for batch := range slices.Chunk(keys, nodeBatch) {
		ops := make([]clientv3.Op, len(batch))
		for i, k := range batch {
			ops[i] = clientv3.OpGet(k, clientv3.WithRev(st.Revision))
		}
		resp, err := cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return readAtErr(keyspace.NodesPrefix(""), st.Revision, err)
		}
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().Kvs {
				st.add(kv)
			}
		}
		// A node key read is covered: an absent record means the agent is gone. (A node key is a
		// prefix of longer node names' keys, but every node key asked about is read.)
		st.prefixes = append(st.prefixes, batch...)
	}
	return nil
}

// readAtErr names what a read at rev failed on; a compacted revision is a concurrent change.
func readAtErr(prefix string, rev int64, err error) error {
	if errors.Is(err, rpctypes.ErrCompacted) || errors.Is(err, rpctypes.ErrGRPCCompacted) {
		return fmt.Errorf("%w: etcd compacted revision %d while %s was read at it; run the command again", ErrConcurrentChange, rev, prefix)
	}
	return fmt.Errorf("read %s at revision %d: %w", prefix, rev, err)
}

// cellKey is one block of one range set: two sets of a family may share a block.
type cellKey struct {
	set   int
	block netip.Prefix
}

// mapFold files a state's keys into the blocks of each range set.
type mapFold struct {
	spec  *allocator.PoolSpec
	cells map[cellKey]*MapBlock
	m     *BlockMap
}

// cell returns the block of set, made (free, with its capacity) on first use.
func (f *mapFold) cell(set int, block netip.Prefix) *MapBlock {
	k := cellKey{set, block}
	c := f.cells[k]
	if c == nil {
		c = &MapBlock{Block: block, State: BlockFree, Capacity: f.spec.BlockCapacity(set, block), Borrowed: []BorrowedAddress{}}
		f.cells[k] = c
	}
	return c
}

// setsOf are the range sets whose span of blocks holds block.
func (f *mapFold) setsOf(block netip.Prefix) []int {
	var out []int
	b := f.spec.Blocks
	for i, s := range f.spec.Ranges {
		if slices.ContainsFunc(s, func(r allocator.Range) bool {
			return r.RangeStart.BitLen() == block.Addr().BitLen() &&
				b.Of(r.RangeStart).Addr().Compare(block.Addr()) <= 0 && block.Addr().Compare(b.Of(r.RangeEnd).Addr()) <= 0
		}) {
			out = append(out, i)
		}
	}
	return out
}

// at is the block of ip, in the set whose range holds it, else the first set whose span holds
// its block; nil when no set's does.
func (f *mapFold) at(ip netip.Addr) *MapBlock {
	block := f.spec.Blocks.Of(ip)
	if set, ok := f.spec.SetOf(ip); ok {
		return f.cell(set, block)
	}
	if sets := f.setsOf(block); len(sets) > 0 {
		return f.cell(sets[0], block)
	}
	return nil
}

// foldBlockMap files st, read for pool p by ReadBlockMap, into its block map.
func foldBlockMap(st *State, p PoolEntry, wanted []netip.Addr, limit int) *BlockMap {
	spec := p.Value
	m := &BlockMap{Pool: p.Name, Key: p.Key, Revision: st.Revision, Blocks: spec.Blocks, Limit: limit, Migrating: p.Migrating}
	f := &mapFold{spec: &spec, cells: map[cellKey]*MapBlock{}, m: m}
	f.claims(st)
	f.keys(st, wanted)
	for i, s := range spec.Ranges {
		ms := MapSet{Set: i, Family: s.Family(), Ranges: s.String(), Bits: spec.Blocks.Bits(s[0].RangeStart), Blocks: []*MapBlock{}}
		count := spec.SetBlockCount(i, spec.Blocks)
		blocks := spec.SetBlocks(i, spec.Blocks)
		if ms.Sparse = count.Cmp(big.NewInt(int64(limit))) > 0; ms.Sparse {
			blocks = f.rowsInUse(i, ms.Bits)
		}
		for b := range blocks {
			if len(ms.Blocks) == limit {
				break
			}
			ms.Blocks = append(ms.Blocks, f.cell(i, b))
		}
		ms.Totals = f.totals(i, nil)
		if count.Cmp(big.NewInt(int64(len(ms.Blocks)))) > 0 {
			nd := f.totals(i, ms.Blocks)
			ms.NotDrawn = &nd
		}
		m.Sets = append(m.Sets, ms)
	}
	return m
}

// rowsInUse yields the blocks of set in each row of MapRowBlocks that holds a block some key
// names, in address order. Only such blocks have a cell before the set's blocks are listed.
func (f *mapFold) rowsInUse(set, bits int) iter.Seq[netip.Prefix] {
	rows := map[netip.Prefix]bool{}
	for k := range f.cells {
		if k.set == set {
			row, _ := k.block.Addr().Prefix(bits - mathbits.TrailingZeros(MapRowBlocks))
			rows[row] = true
		}
	}
	sorted := slices.SortedFunc(maps.Keys(rows), func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return func(yield func(netip.Prefix) bool) {
		for _, row := range sorted {
			for b := range f.spec.SetBlocksIn(set, f.spec.Blocks, row) {
				if !yield(b) {
					return
				}
			}
		}
	}
}

// claims files each block claim into its block, with its agent's state.
func (f *mapFold) claims(st *State) {
	expired := map[string]bool{}
	for _, b := range st.ExpiredBlocks() {
		expired[b.Key] = true
	}
	nodes := st.nodeIndex()
	for _, b := range st.Blocks {
		sets := f.setsOf(b.Block)
		if b.Block.Bits() != f.spec.Blocks.Bits(b.Block.Addr()) || len(sets) == 0 {
			f.m.StrayClaims++
			continue
		}
		mc := &MapClaim{Key: b.Key, Cluster: b.Value.Cluster, Node: b.Value.Node, NodeUID: b.Value.NodeUID,
			Lease: keyspace.LeaseHex(b.Lease), Since: b.Value.Since, Agent: AgentUnknown, Unreadable: b.Unreadable}
		state := BlockClaimed
		if b.Unreadable == "" {
			mc.Agent = agentOf(st, nodes, b.Value.Cluster, b.Value.Node, b.Value.NodeUID)
		}
		if expired[b.Key] {
			state = BlockExpired
		}
		for _, set := range sets {
			c := f.cell(set, b.Block)
			c.Claim, c.State = mc, state
		}
	}
}

// keys files allocations, quarantine, held, wanted and host keys into the blocks of their
// addresses (keys still in the flat layout too), and finds borrowed addresses.
func (f *mapFold) keys(st *State, wanted []netip.Addr) {
	allocated := map[netip.Addr]bool{}
	for _, a := range st.Allocations {
		if !a.Block.IsValid() {
			f.m.FlatKeys++
		}
		c := f.at(a.IP)
		if c == nil {
			f.m.OffMap++
			continue
		}
		allocated[a.IP] = true
		c.Allocated++
		if cl := c.Claim; a.Unreadable == "" && cl != nil && cl.Unreadable == "" && !sameNode(a.Allocation, cl) {
			c.Borrowed = append(c.Borrowed, BorrowedAddress{IP: a.IP, Cluster: a.Cluster, Node: a.Node})
		}
	}
	for _, q := range st.Quarantine {
		if !q.Block.IsValid() {
			f.m.FlatKeys++
		}
		if c := f.at(q.IP); c != nil {
			c.Quarantined++
		}
	}
	for _, h := range st.Held {
		if !h.Block.IsValid() {
			f.m.FlatKeys++
		}
		if c := f.at(h.IP); c != nil {
			c.Held++
			if !allocated[h.IP] {
				c.Expired++
			}
		}
	}
	for _, ip := range wanted {
		if c := f.at(ip); c != nil {
			c.Wanted++
		}
	}
	var last netip.Addr // host keys come sorted by address; several nodes may publish one
	for _, h := range st.HostIPs {
		if c := f.at(h.IP); c != nil && h.IP != last {
			c.Hosts++
		}
		last = h.IP
	}
	for _, c := range f.cells {
		if c.Claim == nil && c.Allocated+c.Held+c.Wanted > 0 {
			c.State = BlockUnclaimed
		}
	}
}

// sameNode reports whether allocation a is of the node that made claim c: the same cluster and
// node, and the same node UID when both name one (a replaced node's new identity borrows in
// its old one's blocks).
func sameNode(a keyspace.Allocation, c *MapClaim) bool {
	return a.Cluster == c.Cluster && a.Node == c.Node && (a.NodeUID == "" || c.NodeUID == "" || a.NodeUID == c.NodeUID)
}

// totals sums the blocks of set; with listed given, only those not in it.
func (f *mapFold) totals(set int, listed []*MapBlock) MapTotals {
	blocks := f.spec.SetBlockCount(set, f.spec.Blocks)
	capacity := f.spec.SetSize(set)
	skip := map[netip.Prefix]bool{}
	for _, c := range listed {
		skip[c.Block] = true
		blocks.Sub(blocks, big.NewInt(1))
		capacity.Sub(capacity, big.NewInt(int64(c.Capacity)))
	}
	var t MapTotals
	for k, c := range f.cells {
		if k.set != set || skip[k.block] {
			continue
		}
		switch c.State {
		case BlockClaimed:
			t.ClaimedBlocks++
		case BlockExpired:
			t.ClaimedBlocks++
			t.ExpiredBlocks++
		case BlockUnclaimed:
			t.UnclaimedBlocks++
		}
		t.Allocated += c.Allocated
		t.Borrowed += len(c.Borrowed)
		t.Quarantined += c.Quarantined
		t.Held += c.Held
		t.Expired += c.Expired
		t.Wanted += c.Wanted
		t.Hosts += c.Hosts
	}
	free := new(big.Int).Sub(blocks, big.NewInt(int64(t.ClaimedBlocks+t.UnclaimedBlocks)))
	t.Blocks, t.FreeBlocks, t.Capacity = blocks.String(), free.String(), capacity.String()
	return t
}
