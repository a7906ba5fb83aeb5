package poolview

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// view is the agent's watch-fed picture of one pool: which addresses are allocated and
// which rest in quarantine. It is a hint for choosing candidates, never the authority:
// every claim is a create-if-absent transaction, so a stale view costs a retry, never a
// duplicate. Choosing from it costs no etcd read.
//
// In the block layout the view follows only the blocks this node holds (spans), so an
// allocation in one node's block is sent to that node alone; addresses elsewhere are chosen
// from a snapshot read when the node borrows (borrow.go). In the flat layout of a pool stored
// before blocks it follows the whole pool, as one span.
type View struct {
	pool   string
	blocks allocator.Blocks // the stored layout; a changed layout gets a new view
	cli    *clientv3.Client
	log    *slog.Logger
	own    *Owner // claims, keeps and gives back this node's blocks; nil in the flat layout
	// claimMu makes block claims one at a time (choose).
	claimMu sync.Mutex
	// exhausted counts the ADDs refused because the pool had no free address
	// (leasehold_pool_exhausted_total).
	exhausted atomic.Int64

	mu          sync.Mutex
	allocated   map[netip.Addr]int64 // address -> revision that created it
	quarantined map[netip.Addr]time.Time
	hosts       map[string]netip.Addr // host address key -> address (several nodes may share one)
	hostCount   map[netip.Addr]int
	pending     map[netip.Addr]struct{} // chosen by an ADD whose transaction is in flight
	next        map[int]netip.Addr      // range set -> where the next search starts
	seed        uint64                  // spreads different agents over the range
	synced      chan struct{}

	// spans are the key ranges the view follows: a block this node holds each, or the whole
	// pool (the zero Prefix) in the flat layout. spansAdded counts additions, so that a
	// listing can tell a block was claimed while it ran.
	spans      map[netip.Prefix]*span
	spansAdded int
	order      []netip.Prefix // the spans' blocks in address order; nil when spans changed
	// claims are the pool's block claims as last read: block -> the claiming node.
	claims     map[netip.Prefix]string
	claimsRead time.Time
	// borrowed is the whole pool as last read for borrowing, at borrowedAt; nil until a node
	// borrows.
	borrowed   *snapshot
	borrowedAt time.Time

	// The reuse order (reuse.go), when mine is set (Owner.Mine): addresses held back because
	// their holder expired without a release (value: when to look again), deleted allocations
	// no release explains yet, and the revisions of releases seen before their deletes.
	mine     func(clientv3.LeaseID) bool
	metrics  *Metrics
	heldBack map[netip.Addr]time.Time
	suspect  map[netip.Addr]suspectDel
	relRev   map[netip.Addr]int64
	heldKick chan struct{}

	// gen is the current listing's generation: its watches run on it, and so do those of a
	// block claimed during it. stopFollow ends it; relisted, when someone waits for a new
	// listing (restart), is closed by the next one.
	gen        *generation
	stopFollow context.CancelFunc
	relisted   chan struct{}
	restarting bool

	// After etcd went back in time (audit.go): hold refuses new blocks and borrowing for the
	// settle time, and kept are the addresses the view knew allocated or held back before it
	// listed the pool again and the listing lacks, passed over until keepUntil: another
	// node's pod may run with one, its key gone with the backup, until its agent re-claims it.
	hooks     Hooks
	kept      map[netip.Addr]struct{}
	keepUntil time.Time
	// restKept are the addresses whose quarantine end the last listing kept though etcd had no
	// quarantine key for them (a restore of a backup older than their release): no watch event
	// ends such a quarantine, so the view ends it itself at that time (endRestKept).
	restKept map[netip.Addr]struct{}
	// dropped are the addresses the last listing found free that the view knew taken, at
	// droppedAt: a watch broken by a restore's compaction lists the pool again before the
	// agent has proof that etcd went back, and restartKeeping keeps them too.
	dropped   []netip.Addr
	droppedAt time.Time
	// restoredAt are the blocks an earlier process of the agent had marked restored, for the
	// settle time it saved (settleFile): its listings mark them again.
	restoredAt map[netip.Prefix]bool
	listedOnce bool
	// gained are the blocks the last listing found this node's that it did not hold before
	// (at droppedAt), marked restored if the proof comes (restartKeeping).
	gained []netip.Prefix
}

// Hooks are what the agent hands each view at start: its restore hold (Settling,
// Generation), its ear for this node's pods' keys (Put, Deleted, Listed: changes to the
// allocations of this node's pods the agent did not make), and what an earlier process of the
// agent kept for the settle time (Settled). Any may be nil (tests, benchmarks). Put, Deleted
// and Listed are called under the view's lock: they must not block.
type Hooks struct {
	// Settling returns, during the settle time after etcd went back in time, why a new
	// block or a borrowed address is refused; nil after it.
	Settling func() error
	// Generation counts the times etcd was found gone back: a read answered in an earlier
	// generation is of a history since replaced.
	Generation func() uint64
	Put        func(pool string, a netip.Addr, kv *mvccpb.KeyValue)
	Deleted    func(pool string, a netip.Addr)
	Listed     func()
	Settled    *Settled
}

// Settled is what an earlier process of the agent kept for the settle time after etcd went
// back in time: its end, and per pool the addresses kept and the blocks marked restored.
type Settled struct {
	Until    time.Time
	Kept     map[string][]netip.Addr
	Restored map[string][]netip.Prefix
}

func (h Hooks) settling() error {
	if h.Settling == nil {
		return nil
	}
	return h.Settling()
}

func (h Hooks) generation() uint64 {
	if h.Generation == nil {
		return 0
	}
	return h.Generation()
}

func (h Hooks) put(pool string, a netip.Addr, kv *mvccpb.KeyValue) {
	if h.Put != nil {
		h.Put(pool, a, kv)
	}
}

func (h Hooks) deleted(pool string, a netip.Addr) {
	if h.Deleted != nil {
		h.Deleted(pool, a)
	}
}

func (h Hooks) listed() {
	if h.Listed != nil {
		h.Listed()
	}
}

// span is one key range the view follows.
type span struct {
	block netip.Prefix     // zero: the whole pool (flat layout)
	lease clientv3.LeaseID // the block lease the claim is on (block layout)
	rev   int64            // the revision it was listed at; its watches start after it
	stop  context.CancelFunc
	// emptySince is when the view last found the block empty (zero: it holds something);
	// restored is set on a block the view did not hold before etcd went back in time and a
	// listing since shows as this node's: a claim the backup brought back, of a block given
	// back since, which another node's pod may use with its key gone too. No ADD chooses
	// from it until the settle time ends (keepUntil).
	restored bool
	// leaving is set while the block is being given back, so no ADD chooses from it.
	emptySince time.Time
	leaving    bool
	// full marks range sets the block had no free address of at the last search.
	full map[int]bool
}

// generation is one listing and the watches that follow it.
type generation struct {
	ctx  context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup
	// closed is set, under the view's lock, once the generation waits for its watches.
	closed bool
}

func newView(pool string, blocks allocator.Blocks, cli *clientv3.Client, log *slog.Logger, seed uint64, own *Owner, hooks Hooks) *View {
	v := &View{
		hooks:       hooks,
		restoredAt:  make(map[netip.Prefix]bool),
		kept:        make(map[netip.Addr]struct{}),
		restKept:    make(map[netip.Addr]struct{}),
		pool:        pool,
		blocks:      blocks,
		cli:         cli,
		log:         log.With("pool", pool),
		allocated:   make(map[netip.Addr]int64),
		quarantined: make(map[netip.Addr]time.Time),
		hosts:       make(map[string]netip.Addr),
		hostCount:   make(map[netip.Addr]int),
		pending:     make(map[netip.Addr]struct{}),
		next:        make(map[int]netip.Addr),
		seed:        seed,
		synced:      make(chan struct{}),
		spans:       make(map[netip.Prefix]*span),
		claims:      make(map[netip.Prefix]string),
		heldBack:    make(map[netip.Addr]time.Time),
		suspect:     make(map[netip.Addr]suspectDel),
		relRev:      make(map[netip.Addr]int64),
		heldKick:    make(chan struct{}, 1),
	}
	if st := hooks.Settled; st != nil && time.Now().Before(st.Until) {
		v.keepUntil = st.Until
		for _, a := range st.Kept[pool] {
			v.kept[a] = struct{}{}
		}
		for _, b := range st.Restored[pool] {
			v.restoredAt[b] = true
		}
	}
	if blocks.Flat() {
		v.spans[netip.Prefix{}] = &span{}
	} else {
		v.own = own
	}
	if own != nil && own.HoldBack {
		v.mine, v.metrics = own.Mine, &own.Metrics
	}
	return v
}

// unlocked implements allocator.Taken over a view whose lock the caller holds.
type unlocked struct{ v *View }

func (u unlocked) Allocated(a netip.Addr) bool {
	_, ok := u.v.allocated[a]
	return ok || u.v.hostCount[a] > 0
}

func (u unlocked) Quarantined(a netip.Addr) (time.Time, bool) {
	t, ok := u.v.quarantined[a]
	return t, ok
}

// FollowsAddr is follows for a caller without the lock.
func (v *View) FollowsAddr(a netip.Addr) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.follows(a)
}

// follows reports whether a lies in a span the view follows; the caller holds the lock.
func (v *View) follows(a netip.Addr) bool {
	_, ok := v.spans[v.blocks.Of(a)]
	return ok
}

// reserve picks a free address of range set `set` that no other in-flight ADD of this
// agent holds and skip does not refuse, and marks it pending. In the block layout it looks
// only in this node's blocks, in address order from where the last search ended; its error
// then means "no room in my blocks", and the caller claims a block or borrows (choose).
func (v *View) reserve(spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool) (netip.Addr, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.endRestKept(time.Now())
	busy := v.busy(skip)
	if v.blocks.Flat() {
		addr, err := spec.Next(set, v.from(spec, set), unlocked{v}, busy)
		if err != nil {
			return netip.Addr{}, err
		}
		return v.take(spec, set, addr), nil
	}
	from := v.next[set]
	order := v.sorted()
	first, _ := slices.BinarySearchFunc(order, v.blocks.Of(from), comparePrefix)
	for k := range order {
		b := order[(first+k)%len(order)]
		s := v.spans[b]
		if s.leaving || s.full[set] || s.restored && time.Now().Before(v.keepUntil) {
			continue
		}
		if addr, err := spec.NextIn(set, b, from, unlocked{v}, busy); err == nil {
			return v.take(spec, set, addr), nil
		}
		// Full for now: skipped until an address in it comes free (roomAt), so that a node
		// holding many blocks does not walk every full one on each ADD.
		if s.full == nil {
			s.full = make(map[int]bool)
		}
		s.full[set] = true
	}
	return netip.Addr{}, errNoBlock
}

// busy is what a search must pass over besides what is taken: addresses chosen by ADDs in
// flight, those skip refuses, and those held back (reuse.go). The caller holds the lock.
func (v *View) busy(skip func(netip.Addr) bool) func(netip.Addr) bool {
	return func(a netip.Addr) bool {
		if _, ok := v.pending[a]; ok {
			return true
		}
		return skip != nil && skip(a) || v.heldBackLocked(a) || v.keptLocked(a)
	}
}

// keptLocked tells whether a is one of the addresses kept after etcd went back in time; the
// caller holds the lock.
func (v *View) keptLocked(a netip.Addr) bool {
	if len(v.kept) == 0 {
		return false
	}
	if !time.Now().Before(v.keepUntil) {
		clear(v.kept)
		return false
	}
	_, ok := v.kept[a]
	return ok
}

// roomAt notes that a may have come free; the caller holds the lock.
func (v *View) roomAt(a netip.Addr) {
	if s := v.spans[v.blocks.Of(a)]; s != nil {
		clear(s.full)
	}
}

// take marks addr pending and moves set's next search past it; the caller holds the lock.
func (v *View) take(spec *allocator.PoolSpec, set int, addr netip.Addr) netip.Addr {
	v.pending[addr] = struct{}{}
	v.next[set] = spec.Ranges[set].After(addr)
	return addr
}

// sorted is the blocks this node holds in address order, kept until the spans change; the
// caller holds the lock.
func (v *View) sorted() []netip.Prefix {
	if v.order == nil {
		v.order = make([]netip.Prefix, 0, len(v.spans))
		for b := range v.spans {
			if b.IsValid() {
				v.order = append(v.order, b)
			}
		}
		slices.SortFunc(v.order, comparePrefix)
	}
	return v.order
}

func comparePrefix(x, y netip.Prefix) int { return x.Addr().Compare(y.Addr()) }

// from is where the round-robin search of a range set starts: after the address handed out
// last, so a crash-looping container does not get the same address straight back. An
// agent's first search starts at a place of the range derived from its identity, so that
// agents on different nodes begin in different places instead of racing for the same
// first addresses (and, in the block layout, claim blocks far apart).
func (v *View) from(spec *allocator.PoolSpec, set int) netip.Addr {
	if next, ok := v.next[set]; ok {
		return next
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%s/%d", v.seed, v.pool, set)
	return spec.Ranges[set].Spread(float64(h.Sum64()>>11) / (1 << 53))
}

// Scatter moves the next search of a range set to a random place, after this agent lost a
// race there: the winner is likely to take the addresses right after it too. In the block
// layout the race was with a borrower, and the search stays in the node's blocks.
func (v *View) Scatter(spec *allocator.PoolSpec, set int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.blocks.Flat() {
		v.next[set] = spec.Ranges[set].Spread(rand.Float64())
	}
}

// Settle ends the pending state of addrs; when rev > 0 the transaction created them at rev.
func (v *View) Settle(addrs []netip.Addr, rev int64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, a := range addrs {
		delete(v.pending, a)
		if rev <= 0 {
			v.roomAt(a)
			continue
		}
		switch {
		case v.follows(a):
			if v.allocated[a] < rev {
				v.allocated[a] = rev
			}
			v.allocPut(a)
		case v.borrowed != nil:
			v.borrowed.take(v.blocks, a)
		}
	}
}

// Released records this agent's own release of addrs at rev, with their quarantine until
// until (zero: none), without waiting for the watch to bring it: an ADD right after a DEL
// must see the address resting, not still allocated.
func (v *View) Released(addrs []netip.Addr, rev int64, until time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, a := range addrs {
		if !v.follows(a) {
			if v.borrowed != nil {
				v.borrowed.free(v.blocks, a, until)
			}
			continue
		}
		if v.allocated[a] <= rev {
			delete(v.allocated, a)
		}
		if !until.IsZero() {
			v.quarantined[a] = until
			delete(v.restKept, a) // its quarantine key ends it
		}
		v.releaseSeen(a, rev)
		v.roomAt(a)
	}
}

// MarkAllocated records what a failed transaction learned: addr was created at rev. It
// reports whether addr lies outside the view's spans (a borrowed address).
func (v *View) MarkAllocated(a netip.Addr, rev int64) (borrowed bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	switch {
	case v.follows(a):
		if v.allocated[a] < rev {
			v.allocated[a] = rev
		}
		v.allocPut(a)
		return false
	case v.borrowed != nil:
		v.borrowed.take(v.blocks, a)
	}
	return true
}

// StaleSnapshot makes the next borrowing read the pool again.
func (v *View) StaleSnapshot() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.borrowedAt = time.Time{}
}

// MarkQuarantined records what a failed transaction learned about a quarantined address.
func (v *View) MarkQuarantined(a netip.Addr, until time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	switch {
	case v.follows(a):
		v.quarantined[a] = until
		delete(v.restKept, a) // its quarantine key ends it
	case v.borrowed != nil:
		v.borrowed.quarantined[a] = until
	}
}

// endRestKept ends the quarantines the last listing kept without a key in etcd (restKept)
// whose time is up: no watch event will. The caller holds the lock.
func (v *View) endRestKept(now time.Time) {
	for a := range v.restKept {
		if until, ok := v.quarantined[a]; ok && until.After(now) {
			continue
		}
		delete(v.restKept, a)
		delete(v.quarantined, a)
		v.roomAt(a)
	}
}

// MarkHost records what a failed transaction learned: a node publishes addr as its own.
func (v *View) MarkHost(key string, a netip.Addr) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.addHost(key, a)
}

func (v *View) addHost(key string, a netip.Addr) {
	if _, ok := v.hosts[key]; !ok {
		v.hosts[key] = a
		v.hostCount[a]++
	}
}

func (v *View) removeHost(key string) {
	if a, ok := v.hosts[key]; ok {
		delete(v.hosts, key)
		if v.hostCount[a]--; v.hostCount[a] <= 0 {
			delete(v.hostCount, a)
		}
	}
}

// Free reports whether an ADD could find an address in every range set now. In the block
// layout, with no room in this node's blocks and no unclaimed block known, it asks the
// borrowing snapshot, read again when older than snapshotFresh: STATUS must not call a pool
// exhausted on stale knowledge, nor read the whole pool at every poll.
func (v *View) Free(ctx context.Context, spec *allocator.PoolSpec) error {
	for set := range spec.Ranges {
		v.mu.Lock()
		var err error
		known := true
		switch {
		case v.blocks.Flat():
			_, err = spec.Next(set, v.from(spec, set), unlocked{v}, nil)
		case v.roomIn(spec, set):
		default:
			_, unclaimed := spec.NextBlock(set, v.blocks, netip.Addr{}, v.isClaimed)
			known = unclaimed || (v.borrowed != nil && time.Since(v.borrowedAt) < snapshotFresh)
			if !unclaimed && known {
				_, err = spec.Next(set, netip.Addr{}, borrowTaken{v, v.borrowed, false}, nil)
			}
		}
		v.mu.Unlock()
		if err != nil {
			return err
		}
		if !known {
			if _, err := v.readPool(ctx); err != nil {
				return err
			}
			v.mu.Lock()
			_, err = spec.Next(set, netip.Addr{}, borrowTaken{v, v.borrowed, false}, nil)
			v.mu.Unlock()
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// roomIn reports whether one of this node's blocks has a free address of set; the caller
// holds the lock.
func (v *View) roomIn(spec *allocator.PoolSpec, set int) bool {
	for _, b := range v.sorted() {
		if v.spans[b].leaving {
			continue
		}
		if _, err := spec.NextIn(set, b, netip.Addr{}, unlocked{v}, nil); err == nil {
			return true
		}
	}
	return false
}

// isClaimed reports whether block is claimed, as last read; the caller holds the lock.
func (v *View) isClaimed(block netip.Prefix) bool {
	_, ok := v.claims[block]
	return ok || v.spans[block] != nil
}

// Counts returns how many addresses the view holds as allocated and quarantined, and the
// key ranges they were listed from (the recheck compares them with etcd's counts there).
func (v *View) Counts() (allocated, quarantined int, ipPrefixes, qPrefixes []string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.endRestKept(time.Now())
	for b := range v.spans {
		if !b.IsValid() {
			ipPrefixes = append(ipPrefixes, keyspace.IPsPrefix(v.pool))
			qPrefixes = append(qPrefixes, keyspace.QuarantinePrefix(v.pool))
			continue
		}
		ipPrefixes = append(ipPrefixes, keyspace.BlockIPsPrefix(v.pool, b))
		qPrefixes = append(qPrefixes, keyspace.BlockQuarantinePrefix(v.pool, b))
	}
	return len(v.allocated), len(v.quarantined), ipPrefixes, qPrefixes
}

// restartKeeping is restart after etcd went back in time: until keep, the new listing does
// not free the addresses the view knew allocated (view.kept).
func (v *View) restartKeeping(keep time.Time) <-chan struct{} {
	v.mu.Lock()
	if keep.After(v.keepUntil) {
		v.keepUntil = keep
	}
	if time.Since(v.droppedAt) < droppedRecall {
		for _, a := range v.dropped {
			v.kept[a] = struct{}{}
		}
		for _, b := range v.gained {
			if sp := v.spans[b]; sp != nil {
				sp.restored = true
			}
		}
	}
	v.mu.Unlock()
	return v.Restart()
}

// MarkRestored has the view pass over block for the keep time, as over a block the backup
// gave back.
func (v *View) MarkRestored(block netip.Prefix) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if sp := v.spans[block]; sp != nil && time.Now().Before(v.keepUntil) {
		sp.restored = true
	}
}

// droppedRecall is how long before the proof that etcd went back a listing's dropped
// addresses are kept: the proof comes with the first answers after etcd's return, the
// listing of a compacted watch a little before.
const droppedRecall = time.Minute

// SettleKnowledge is what the view passes over for the settle time: the addresses it keeps,
// and the blocks a restore gave back to this node.
func (v *View) SettleKnowledge() (kept []netip.Addr, restored []netip.Prefix) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if !time.Now().Before(v.keepUntil) {
		return nil, nil
	}
	for a := range v.kept {
		kept = append(kept, a)
	}
	for b, s := range v.spans {
		if s.restored {
			restored = append(restored, b)
		}
	}
	return kept, restored
}

// ClaimsHeld is the blocks this node holds in the pool, with the lease each claim is on, but
// those being given back.
func (v *View) ClaimsHeld() map[netip.Prefix]clientv3.LeaseID {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make(map[netip.Prefix]clientv3.LeaseID)
	for b, s := range v.spans {
		if b.IsValid() && !s.leaving && s.lease != 0 {
			out[b] = s.lease
		}
	}
	return out
}

// HoldsClaim tells whether claimsHeld would still list block on lease.
func (v *View) HoldsClaim(block netip.Prefix, lease clientv3.LeaseID) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	s, ok := v.spans[block]
	return ok && !s.leaving && s.lease == lease
}

// Restart makes run drop its watches and list the pool again, for a view that may be stale
// in a way no watch reports: etcd's data was replaced, and a watch resumed at a revision the
// new etcd has not reached delivers nothing and no error. The returned channel is closed once
// the new listing is in.
func (v *View) Restart() <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.relisted == nil {
		v.relisted = make(chan struct{})
	}
	v.restarting = true
	if v.stopFollow != nil {
		v.stopFollow()
	}
	return v.relisted
}
