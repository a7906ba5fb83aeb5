package poolview

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// View is the agent's watch-fed picture of one pool: which addresses are allocated and
// which rest in quarantine. It is a hint for choosing candidates, never the authority:
// every claim is a create-if-absent transaction, so a stale view costs a retry, never a
// duplicate. Choosing from it costs no etcd read.
//
// In the block layout the view follows only the blocks this node holds (spans), so an
// allocation in one node's block is sent to that node alone; addresses elsewhere are chosen
// from a snapshot read when the node borrows (borrow.go). In the flat layout of a pool stored
// before blocks it follows the whole pool, as one span.
//
// A View is the surface the agent calls; its work is done by parts with one job each, which
// share the view's state (core) under its one lock: the watch sync (syncer, viewsync.go), the
// reuse order (reuseOrder, reuse.go), borrowing (borrower, borrow.go) and this node's block
// claims (BlockClaims, blocks.go).
type View struct {
	*core
	// exhausted counts the ADDs refused because the pool had no free address
	// (leasehold_pool_exhausted_total).
	exhausted atomic.Int64

	sync   *syncer
	reuse  *reuseOrder
	borrow *borrower
	claims *BlockClaims
}

// core is what the parts of a view share: the pool it follows, etcd's client, and the state
// under mu. A field under mu is read and written only with the lock held: code that must hold
// it takes a locked handle (lock), whose methods (state.go and the parts' files) are the only
// ones that assume the lock. The comment on each group says which part writes it.
type core struct {
	pool   string
	blocks allocator.Blocks // the stored layout; a changed layout gets a new view
	cli    *clientv3.Client
	log    *slog.Logger
	hooks  Hooks
	seed   uint64 // spreads different agents over the range
	// mine, when set (Owner.Mine: the node has a reuse delay), tells this node's block leases
	// from others', and the view applies the reuse order (reuse.go); heldKick wakes its loop.
	mine     func(clientv3.LeaseID) bool
	heldKick chan struct{}

	mu          sync.Mutex
	allocated   map[netip.Addr]int64 // address -> revision that created it
	quarantined map[netip.Addr]time.Time
	hosts       map[string]netip.Addr // host address key -> address (several nodes may share one)
	hostCount   map[netip.Addr]int
	pending     map[netip.Addr]struct{} // chosen by an ADD whose transaction is in flight
	next        map[int]netip.Addr      // range set -> where the next search starts

	// spans are the key ranges the view follows: a block this node holds each, or the whole
	// pool (the zero Prefix) in the flat layout. spansAdded counts additions, so that a
	// listing can tell a block was claimed while it ran.
	spans      map[netip.Prefix]*span
	spansAdded int
	order      []netip.Prefix // the spans' blocks in address order; nil when spans changed
	// claims are the pool's block claims as last read: block -> the claiming node (the
	// listing's, and BlockClaims').
	claims     map[netip.Prefix]string
	claimsRead time.Time
	// borrowed is the whole pool as last read for borrowing (borrower), at borrowedAt; nil
	// until a node borrows.
	borrowed   *snapshot
	borrowedAt time.Time

	// The reuse order's (reuse.go): addresses held back because their holder expired without
	// a release (value: when to look again), deleted allocations no release explains yet, and
	// the revisions of releases seen before their deletes.
	heldBack map[netip.Addr]time.Time
	suspect  map[netip.Addr]suspectDel
	relRev   map[netip.Addr]int64

	// After etcd went back in time (the agent's audit): kept are the addresses the view knew
	// allocated or held back before it listed the pool again and the listing lacks, passed
	// over until keepUntil: another node's pod may run with one, its key gone with the
	// backup, until its agent re-claims it.
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
	// settle time it saved (Hooks.Settled): its listings mark them again.
	restoredAt map[netip.Prefix]bool
	listedOnce bool
	// gained are the blocks the last listing found this node's that it did not hold before
	// (at droppedAt), marked restored if the proof comes (restartKeeping).
	gained []netip.Prefix
}

// lock takes the view's lock and returns the handle under it; unlock it when done.
func (c *core) lock() locked {
	c.mu.Lock()
	return locked{c}
}

// holding reports whether the view applies the reuse order; it never changes.
func (c *core) holding() bool { return c.mine != nil }

func (c *core) kickHeld() {
	select {
	case c.heldKick <- struct{}{}:
	default:
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
	c := &core{
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
		spans:       make(map[netip.Prefix]*span),
		claims:      make(map[netip.Prefix]string),
		heldBack:    make(map[netip.Addr]time.Time),
		suspect:     make(map[netip.Addr]suspectDel),
		relRev:      make(map[netip.Addr]int64),
		heldKick:    make(chan struct{}, 1),
	}
	if st := hooks.Settled; st != nil && time.Now().Before(st.Until) {
		c.keepUntil = st.Until
		for _, a := range st.Kept[pool] {
			c.kept[a] = struct{}{}
		}
		for _, b := range st.Restored[pool] {
			c.restoredAt[b] = true
		}
	}
	var blockOwner *Owner
	if blocks.Flat() {
		c.spans[netip.Prefix{}] = &span{}
	} else {
		blockOwner = own
	}
	var metrics *Metrics
	if own != nil && own.HoldBack {
		c.mine, metrics = own.Mine, &own.Metrics
	}
	v := &View{core: c}
	v.sync = &syncer{core: c, owner: blockOwner, synced: make(chan struct{})}
	v.reuse = &reuseOrder{core: c, metrics: metrics}
	v.borrow = &borrower{core: c, owner: blockOwner}
	v.claims = &BlockClaims{core: c, owner: blockOwner, sync: v.sync, borrow: v.borrow}
	return v
}

// run lists the pool, then follows it with watches until ctx ends (syncer.run); the
// give-back of empty blocks and the look-ups of held-back addresses run beside it.
func (v *View) run(ctx context.Context) {
	if o := v.claims.owner; o != nil && o.Idle > 0 {
		go v.claims.giveBackLoop(ctx)
	}
	if v.holding() {
		go v.reuse.heldLoop(ctx)
	}
	v.sync.run(ctx)
}

// FollowsAddr reports whether a lies in a span the view follows.
func (v *View) FollowsAddr(a netip.Addr) bool {
	lk := v.lock()
	defer lk.unlock()
	return lk.follows(a)
}

// reserve picks a free address of range set `set` that no other in-flight ADD of this
// agent holds and skip does not refuse, and marks it pending. In the block layout it looks
// only in this node's blocks, in address order from where the last search ended; its error
// then means "no room in my blocks", and the caller claims a block or borrows (choose).
func (v *View) reserve(spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool) (netip.Addr, error) {
	lk := v.lock()
	defer lk.unlock()
	lk.endRestKept(time.Now())
	busy := lk.busy(skip)
	if v.blocks.Flat() {
		addr, err := spec.Next(set, lk.from(spec, set), lk, busy)
		if err != nil {
			return netip.Addr{}, err
		}
		return lk.take(spec, set, addr), nil
	}
	from := v.next[set]
	order := lk.sorted()
	first, _ := slices.BinarySearchFunc(order, v.blocks.Of(from), comparePrefix)
	for k := range order {
		b := order[(first+k)%len(order)]
		s := v.spans[b]
		if s.leaving || s.full[set] || s.restored && time.Now().Before(v.keepUntil) {
			continue
		}
		if addr, err := spec.NextIn(set, b, from, lk, busy); err == nil {
			return lk.take(spec, set, addr), nil
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

// Scatter moves the next search of a range set to a random place, after this agent lost a
// race there: the winner is likely to take the addresses right after it too. In the block
// layout the race was with a borrower, and the search stays in the node's blocks.
func (v *View) Scatter(spec *allocator.PoolSpec, set int) {
	lk := v.lock()
	defer lk.unlock()
	if v.blocks.Flat() {
		v.next[set] = spec.Ranges[set].Spread(rand.Float64())
	}
}

// Settle ends the pending state of addrs; when rev > 0 the transaction created them at rev.
func (v *View) Settle(addrs []netip.Addr, rev int64) {
	lk := v.lock()
	defer lk.unlock()
	for _, a := range addrs {
		delete(v.pending, a)
		if rev <= 0 {
			lk.roomAt(a)
			continue
		}
		switch {
		case lk.follows(a):
			if v.allocated[a] < rev {
				v.allocated[a] = rev
			}
			lk.allocPut(a)
		case v.borrowed != nil:
			v.borrowed.take(v.blocks, a)
		}
	}
}

// Released records this agent's own release of addrs at rev, with their quarantine until
// until (zero: none), without waiting for the watch to bring it: an ADD right after a DEL
// must see the address resting, not still allocated.
func (v *View) Released(addrs []netip.Addr, rev int64, until time.Time) {
	lk := v.lock()
	defer lk.unlock()
	for _, a := range addrs {
		if !lk.follows(a) {
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
		lk.releaseSeen(a, rev)
		lk.roomAt(a)
	}
}

// MarkAllocated records what a failed transaction learned: addr was created at rev. It
// reports whether addr lies outside the view's spans (a borrowed address).
func (v *View) MarkAllocated(a netip.Addr, rev int64) (borrowed bool) {
	lk := v.lock()
	defer lk.unlock()
	switch {
	case lk.follows(a):
		if v.allocated[a] < rev {
			v.allocated[a] = rev
		}
		lk.allocPut(a)
		return false
	case v.borrowed != nil:
		v.borrowed.take(v.blocks, a)
	}
	return true
}

// StaleSnapshot makes the next borrowing read the pool again.
func (v *View) StaleSnapshot() {
	lk := v.lock()
	defer lk.unlock()
	v.borrowedAt = time.Time{}
}

// MarkQuarantined records what a failed transaction learned about a quarantined address.
func (v *View) MarkQuarantined(a netip.Addr, until time.Time) {
	lk := v.lock()
	defer lk.unlock()
	switch {
	case lk.follows(a):
		v.quarantined[a] = until
		delete(v.restKept, a) // its quarantine key ends it
	case v.borrowed != nil:
		v.borrowed.quarantined[a] = until
	}
}

// MarkHost records what a failed transaction learned: a node publishes addr as its own.
func (v *View) MarkHost(key string, a netip.Addr) {
	lk := v.lock()
	defer lk.unlock()
	lk.addHost(key, a)
}

// Free reports whether an ADD could find an address in every range set now. In the block
// layout, with no room in this node's blocks and no unclaimed block known, it asks the
// borrowing snapshot, read again when older than snapshotFresh: STATUS must not call a pool
// exhausted on stale knowledge, nor read the whole pool at every poll.
func (v *View) Free(ctx context.Context, spec *allocator.PoolSpec) error {
	for set := range spec.Ranges {
		lk := v.lock()
		var err error
		known := true
		switch {
		case v.blocks.Flat():
			_, err = spec.Next(set, lk.from(spec, set), lk, nil)
		case lk.roomIn(spec, set):
		default:
			_, unclaimed := spec.NextBlock(set, v.blocks, netip.Addr{}, lk.isClaimed)
			known = unclaimed || (v.borrowed != nil && time.Since(v.borrowedAt) < snapshotFresh)
			if !unclaimed && known {
				_, err = spec.Next(set, netip.Addr{}, borrowTaken{lk, v.borrowed, false}, nil)
			}
		}
		lk.unlock()
		if err != nil {
			return err
		}
		if !known {
			if _, err := v.borrow.readPool(ctx); err != nil {
				return err
			}
			lk = v.lock()
			_, err = spec.Next(set, netip.Addr{}, borrowTaken{lk, v.borrowed, false}, nil)
			lk.unlock()
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// Counts returns how many addresses the view holds as allocated and quarantined, and the
// key ranges they were listed from (the recheck compares them with etcd's counts there).
func (v *View) Counts() (allocated, quarantined int, ipPrefixes, qPrefixes []string) {
	lk := v.lock()
	defer lk.unlock()
	lk.endRestKept(time.Now())
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

// Restart makes the view drop its watches and list the pool again, for a view that may be
// stale in a way no watch reports: etcd's data was replaced, and a watch resumed at a revision
// the new etcd has not reached delivers nothing and no error. The returned channel is closed
// once the new listing is in.
func (v *View) Restart() <-chan struct{} { return v.sync.restart() }
