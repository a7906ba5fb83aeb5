package poolview

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Blocks (allocator.Blocks): a node claims blocks of a pool and allocates from them first,
// following only their keys. A block claim is where a node looks first, never who may hold an
// address: every address is still claimed by create-if-absent on its own key, so a stale or
// lost block claim costs a retry, never a duplicate.

// errNoBlock is reserve's answer in the block layout when this node's blocks have no free
// address of the set: choose then claims a block or borrows.
var errNoBlock = errors.New("no free address in this node's blocks")

// Owner is what a view needs to claim, keep and give back blocks for its node: the node's
// identity, and its block leases, which the agent keeps (they also carry its pods' held keys).
type Owner struct {
	Cluster, Node, NodeUID string
	// Lease returns the lease new block claims go on, granting one if there is none.
	Lease func(ctx context.Context) (clientv3.LeaseID, error)
	// Adopt resumes renewing a block lease this node identity granted earlier (a claim
	// found by a listing after a restart).
	Adopt func(ctx context.Context, id clientv3.LeaseID) error
	// Mine reports whether a lease is one of this node's block leases.
	Mine func(clientv3.LeaseID) bool
	// Idle is how long a block stays empty before it is given back; zero: never.
	Idle      time.Duration
	OpTimeout time.Duration
	// HoldBack: the node has a reuse delay, and its views apply the reuse order (reuse.go).
	HoldBack bool
	Wall     func() time.Time
	Metrics  Metrics
	// LostLease drops the claims on a block lease etcd no longer has, in every pool (a
	// claim's transaction found it gone).
	LostLease func(clientv3.LeaseID)
}

// Metrics are the counters the views add to (nil counters are not allowed).
type Metrics struct {
	// BlockClaims, BlocksGivenBack and Borrowed: blocks claimed, empty blocks given back,
	// addresses borrowed from others' blocks.
	BlockClaims, BlocksGivenBack, Borrowed prometheus.Counter
	// ExpiredReused: addresses reused whose holder expired without a release.
	ExpiredReused prometheus.Counter
}

// sortClaims reads a listing of a pool's block claims into who claimed each block, and the
// blocks that are this node's: claimed by its identity, on a lease it holds or adopts now.
func (o *Owner) sortClaims(ctx context.Context, log *slog.Logger, kvs []*mvccpb.KeyValue) (map[netip.Prefix]string, map[netip.Prefix]clientv3.LeaseID) {
	claims := make(map[netip.Prefix]string, len(kvs))
	mine := make(map[netip.Prefix]clientv3.LeaseID)
	for _, kv := range kvs {
		_, block, err := keyspace.ParseBlockKey(string(kv.Key))
		if err != nil {
			continue
		}
		rec, err := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value)
		claims[block] = rec.Cluster + "/" + rec.Node
		if err != nil || rec.Cluster != o.Cluster || rec.Node != o.Node || rec.NodeUID != o.NodeUID || kv.Lease == 0 {
			continue
		}
		lease := keyspace.LeaseOf(kv)
		if err := o.Adopt(ctx, lease); err != nil {
			log.Warn("a block claim of this node is on a lease that cannot be adopted; it goes with that lease",
				"block", block, "lease", keyspace.LeaseHex(lease), "err", err)
			continue
		}
		mine[block] = lease
	}
	return claims, mine
}

// Choose picks an address of range set `set` for an ADD and marks it pending: from this
// node's blocks; else from a block it claims now; else, with every block claimed, borrowed
// from another node's block (borrow.go). In the flat layout it is reserve.
//
// Addresses whose holder expired without a release are passed over by each of these, and
// taken only when none of them finds another (reuseExpired), and never for a new sticky
// claim (reuse false): a claim would keep for a day an address whose running pod, on a node
// cut off, takes it back when it returns.
// It reports whether the address is one whose holder expired (then the claim overwrites its
// held key); any other the claim compares without a held key, so that a stale view or
// snapshot never hands out a held-back address as a free one.
func (v *View) Choose(ctx context.Context, spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool, reuse bool) (_ netip.Addr, expired bool, _ error) {
	addr, err := v.chooseFree(ctx, spec, set, skip)
	if !errors.Is(err, allocator.ErrPoolExhausted) {
		return addr, false, err
	}
	if !reuse {
		if n, first := v.HeldBackCount(); n > 0 {
			ends := "each hold ends at the latest a reuse delay after its node stopped renewing"
			if !first.IsZero() {
				ends = "the first hold ends at " + first.UTC().Format(time.RFC3339)
			}
			err = fmt.Errorf("%w; %d addresses are held back for pods whose node stopped renewing, and a new "+
				"sticky claim does not take one: it would keep for its hold an address a running pod wants back (%s)",
				err, n, ends)
		}
		return netip.Addr{}, false, err
	}
	addr, err = v.reuseExpired(ctx, spec, set, skip, err)
	return addr, err == nil, err
}

// chooseFree is choose without the addresses held back after an expiry.
func (v *View) chooseFree(ctx context.Context, spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool) (netip.Addr, error) {
	addr, err := v.reserve(spec, set, skip)
	if errors.Is(err, errNoBlock) || errors.Is(err, allocator.ErrPoolExhausted) && v.keeping() {
		// Right after etcd went back in time, another node's pod may hold any unclaimed block
		// or borrowed address (restoreHold).
		if herr := v.hooks.settling(); herr != nil {
			return netip.Addr{}, herr
		}
	}
	if !errors.Is(err, errNoBlock) {
		return addr, err
	}
	for try := range maxBlockTries {
		if try > 0 && !v.freshSnapshot() {
			// The block just claimed had no room (allocations of a dead node's pods, of
			// borrowers, or moved there by a migration): read the pool once, so that the next
			// choice skips blocks without room.
			if _, err := v.readPool(ctx); err != nil {
				return netip.Addr{}, err
			}
		}
		// One claim at a time: concurrent ADDs that found the node's blocks full would all
		// race for the same next block. Whoever waited looks again first.
		v.claimMu.Lock()
		if addr, err := v.reserve(spec, set, skip); err == nil {
			v.claimMu.Unlock()
			return addr, nil
		}
		claimed, err := v.claimBlock(ctx, spec, set)
		v.claimMu.Unlock()
		if err != nil {
			return netip.Addr{}, err
		}
		if !claimed {
			break
		}
		if addr, err := v.reserve(spec, set, skip); err == nil {
			return addr, nil
		}
	}
	return v.borrow(ctx, spec, set, skip)
}

// keeping tells whether the view passes over addresses it kept after etcd went back in time.
func (v *View) keeping() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.kept) > 0 && time.Now().Before(v.keepUntil)
}

// claimBlock claims a block of set with no claim, nearest after the blocks this node holds
// (so that routes aggregate), and starts following it. It reports false when no block is
// Free as far as a recent read of the claims tells, or when another node claimed the chosen
// block first (the claims are then read again from the failed transaction).
func (v *View) claimBlock(ctx context.Context, spec *allocator.PoolSpec, set int) (_ bool, err error) {
	v.mu.Lock()
	from := v.from(spec, set)
	var top netip.Prefix
	for b := range v.spans {
		if b.IsValid() && spec.Serves(set, b) && (!top.IsValid() || top.Addr().Less(b.Addr())) {
			top = b
		}
	}
	if top.IsValid() {
		from = lastAddrOf(top).Next()
	}
	skip := v.unclaimable()
	block, ok := spec.NextBlock(set, v.blocks, from, skip)
	fresh := time.Since(v.claimsRead) < claimsFresh
	v.mu.Unlock()
	if !ok {
		if fresh {
			return false, nil
		}
		if err := v.readClaims(ctx); err != nil {
			return false, err
		}
		v.mu.Lock()
		block, ok = spec.NextBlock(set, v.blocks, from, skip)
		v.mu.Unlock()
		if !ok {
			return false, nil
		}
	}
	if _, err := v.claimAt(ctx, block); err != nil {
		return false, err
	}
	return true, nil // claimed, or another node was first: the caller tries the next block
}

// claimAt claims block, if no node has, and starts following it; it reports false when
// another node claimed it first (the claims are then read again from the failed transaction).
func (v *View) claimAt(ctx context.Context, block netip.Prefix) (_ bool, err error) {
	o := v.own
	octx, cancel := context.WithTimeout(ctx, o.OpTimeout)
	defer cancel()
	key := keyspace.BlockKey(v.pool, block)
	var resp *clientv3.TxnResponse
	var lease clientv3.LeaseID
	for range 2 {
		if lease, err = o.Lease(octx); err != nil {
			return false, fmt.Errorf("%w: grant a block lease: %w", allocator.ErrUnavailable, err)
		}
		rec := keyspace.BlockRecord{Cluster: o.Cluster, Node: o.Node, NodeUID: o.NodeUID, LeaseID: keyspace.LeaseHex(lease), Since: o.Wall().UTC()}
		resp, err = v.cli.Txn(octx).If(keyspace.Absent(key)).Then(
			append([]clientv3.Op{clientv3.OpPut(key, keyspace.Encode(rec), clientv3.WithLease(lease))}, v.blockReads(block)...)...,
		).Else(clientv3.OpGet(keyspace.BlocksPrefix(v.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly())).Commit()
		if !keyspace.IsLeaseNotFound(err) {
			break
		}
		// The block lease expired or was revoked from outside: its claims went with it.
		o.LostLease(lease)
	}
	if err != nil {
		return false, fmt.Errorf("%w: claim block %s of pool %s: %w", allocator.ErrUnavailable, block, v.pool, err)
	}
	if !resp.Succeeded {
		v.mu.Lock()
		v.claims, v.claimsRead = make(map[netip.Prefix]string), time.Now()
		for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
			if _, b, err := keyspace.ParseBlockKey(string(kv.Key)); err == nil {
				v.claims[b] = "?"
			}
		}
		v.mu.Unlock()
		return false, nil
	}
	o.Metrics.BlockClaims.Inc()
	v.log.Info("block claimed", "block", block, "lease", keyspace.LeaseHex(lease))
	v.addSpan(&span{block: block, lease: lease, rev: resp.Header.Revision},
		listed{rev: resp.Header.Revision, ips: resp.Responses[1].GetResponseRange(), qs: resp.Responses[2].GetResponseRange(),
			held: resp.Responses[3].GetResponseRange()})
	return true, nil
}

func lastAddrOf(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr()
	b := a.AsSlice()
	for i := range b {
		bits := p.Bits() - i*8
		switch {
		case bits <= 0:
			b[i] = 0xff
		case bits < 8:
			b[i] |= 0xff >> bits
		}
	}
	out, _ := netip.AddrFromSlice(b)
	return out
}

// unclaimable tells which blocks a claim should skip: claimed ones, and those the last pool
// snapshot shows at least half used. It is called with the lock held.
func (v *View) unclaimable() func(netip.Prefix) bool {
	return func(b netip.Prefix) bool {
		if v.isClaimed(b) {
			return true
		}
		// A block the last pool snapshot shows at least half used is left to borrowing: near
		// exhaustion a claim of a block with one free address would cost an extra transaction
		// per ADD, and borrowing finds that address anyway.
		return v.borrowed != nil && time.Since(v.borrowedAt) < snapshotFresh && v.borrowed.used[b] >= blockSize(b)/2
	}
}

// blockSize is the number of addresses in block b (capped: only halves of it are compared).
func blockSize(b netip.Prefix) int {
	return 1 << min(b.Addr().BitLen()-b.Bits(), 30)
}

// freshSnapshot reports whether the borrowing snapshot was read within snapshotFresh.
func (v *View) freshSnapshot() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.borrowed != nil && time.Since(v.borrowedAt) < snapshotFresh
}

// readClaims reads which blocks of the pool are claimed. It is asked only when the claims as
// last known show no unclaimed block, and what it answers is a hint: the claim's transaction
// decides, and a claim lost to another node reads the claims again in its Else.
//
// A read that fails (etcd slow under a burst, or out of reach) does not fail the ADD: the ADD
// goes on with the last known claims, which show no unclaimed block, and so borrows (borrow.go),
// whose own claim is as safe as any. At worst the node borrows where it could have claimed a
// block given back meanwhile. Failing would refuse an ADD for which the agent knows a correct
// next step, and every ADD waiting behind it for claimMu would then spend its own timeout on
// the same read. So the last known claims serve as if just read, for claimsFresh: the ADDs
// waiting behind borrow at once. Only when ctx itself has ended (the caller gave up) is the
// error returned (allocator.ErrUnavailable).
func (v *View) readClaims(ctx context.Context) error {
	octx, cancel := context.WithTimeout(ctx, v.own.OpTimeout)
	defer cancel()
	resp, err := v.cli.Get(octx, keyspace.BlocksPrefix(v.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("%w: read the block claims of pool %s: %w", allocator.ErrUnavailable, v.pool, err)
		}
		v.log.Warn("reading the block claims failed; ADDs go on with the claims as last known, and borrow",
			"err", err, "again after", claimsFresh)
		v.mu.Lock()
		v.claimsRead = time.Now()
		v.mu.Unlock()
		return nil
	}
	claims := make(map[netip.Prefix]string, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if _, b, err := keyspace.ParseBlockKey(string(kv.Key)); err == nil {
			claims[b] = "?"
		}
	}
	v.mu.Lock()
	v.claims, v.claimsRead = claims, time.Now()
	v.mu.Unlock()
	return nil
}

// addSpan starts following a block this node just claimed, from its listing l on.
func (v *View) addSpan(s *span, l listed) {
	v.mu.Lock()
	v.spans[s.block] = s
	v.spansAdded++
	v.order = nil
	v.claims[s.block] = v.own.Cluster + "/" + v.own.Node
	for _, kv := range l.ips.GetKvs() {
		if _, _, ip, err := keyspace.ParseIPKey(string(kv.Key)); err == nil && v.allocated[ip] < kv.CreateRevision {
			v.allocated[ip] = kv.CreateRevision
		}
	}
	for _, kv := range l.qs.GetKvs() {
		v.applyQuarantine(v.quarantined, kv.Key, kv.Value)
	}
	v.heldListed(l.held.GetKvs())
	g := v.gen
	v.mu.Unlock()
	if g != nil {
		v.watchSpan(g, span{block: s.block, rev: s.rev})
	}
}

// dropSpan stops following block and forgets what the view knew inside it.
func (v *View) dropSpan(block netip.Prefix) {
	v.mu.Lock()
	defer v.mu.Unlock()
	s, ok := v.spans[block]
	if !ok {
		return
	}
	if s.stop != nil {
		s.stop()
	}
	delete(v.spans, block)
	v.order = nil
	delete(v.claims, block)
	for a := range v.allocated {
		if block.Contains(a) {
			delete(v.allocated, a)
		}
	}
	for a := range v.quarantined {
		if block.Contains(a) {
			delete(v.quarantined, a)
			delete(v.restKept, a)
		}
	}
	for _, m := range []func(func(netip.Addr) bool){mapKeys(v.heldBack), mapKeys(v.suspect), mapKeys(v.relRev)} {
		m(func(a netip.Addr) bool {
			if block.Contains(a) {
				delete(v.heldBack, a)
				delete(v.suspect, a)
				delete(v.relRev, a)
			}
			return true
		})
	}
}

// BlockLeaseLost drops the blocks whose claims were on lease, which etcd no longer has: their
// claims are gone with it. The pods inside keep their addresses on their own leases; the next
// ADD claims a block again.
func (v *View) BlockLeaseLost(lease clientv3.LeaseID) {
	v.mu.Lock()
	var gone []netip.Prefix
	for b, s := range v.spans {
		if b.IsValid() && s.lease == lease {
			gone = append(gone, b)
		}
	}
	v.mu.Unlock()
	for _, b := range gone {
		v.log.Warn("block claim lost with its lease", "block", b, "lease", keyspace.LeaseHex(lease))
		v.dropSpan(b)
	}
}

// giveBackLoop gives back the blocks that stayed empty for the idle time.
func (v *View) giveBackLoop(ctx context.Context) {
	tick := min(max(v.own.Idle/4, 50*time.Millisecond), time.Minute)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, s := range v.idleBlocks(time.Now()) {
			v.giveBack(ctx, s)
		}
	}
}

// idleBlocks notes which blocks are empty now and returns those empty for the idle time,
// marked leaving so that no ADD chooses from them while they are given back.
func (v *View) idleBlocks(now time.Time) []span {
	v.mu.Lock()
	defer v.mu.Unlock()
	// A quarantine kept across a restore with no key in etcd holds its block until it ends,
	// not for ever.
	v.endRestKept(now)
	// An address held back for another node's expired pod does not keep its block: the view
	// looks at its held key again only when the hold ends as its lease's TTL said, and the
	// key may go long before (its node back and done with it, `node forget`, its lease
	// revoked) with no event the view follows. The give-back's transaction compares the
	// block's held keys absent: while one stands, the block stays.
	used := make(map[netip.Prefix]bool)
	for _, m := range []func(func(netip.Addr) bool){mapKeys(v.allocated), mapKeys(v.quarantined), mapKeys(v.pending),
		mapKeys(v.suspect)} {
		m(func(a netip.Addr) bool {
			used[v.blocks.Of(a)] = true
			return true
		})
	}
	var out []span
	for b, s := range v.spans {
		switch {
		case !b.IsValid() || s.leaving:
		case used[b]:
			s.emptySince = time.Time{}
		case s.emptySince.IsZero():
			s.emptySince = now
		case now.Sub(s.emptySince) >= v.own.Idle:
			s.leaving = true
			out = append(out, *s)
		}
	}
	return out
}

func mapKeys[V any](m map[netip.Addr]V) func(func(netip.Addr) bool) {
	return func(yield func(netip.Addr) bool) {
		for a := range m {
			if !yield(a) {
				return
			}
		}
	}
}

// giveBack deletes the claim of an empty block, if it is still this node's on the same lease
// and etcd holds no allocation, no quarantined address and no held key in it.
func (v *View) giveBack(ctx context.Context, s span) {
	octx, cancel := context.WithTimeout(ctx, v.own.OpTimeout)
	defer cancel()
	key := keyspace.BlockKey(v.pool, s.block)
	resp, err := v.cli.Txn(octx).If(keyspace.OnLease(key, s.lease),
		keyspace.NoneUnder(keyspace.BlockIPsPrefix(v.pool, s.block)),
		keyspace.NoneUnder(keyspace.BlockQuarantinePrefix(v.pool, s.block)),
		// Nor an address held back for a pod that may still run (a lost lease being re-claimed).
		keyspace.NoneUnder(keyspace.BlockHeldPrefix(v.pool, s.block))).
		Then(clientv3.OpDelete(key)).Commit()
	if err == nil && resp.Succeeded {
		v.own.Metrics.BlocksGivenBack.Inc()
		v.log.Info("empty block given back", "block", s.block)
		v.dropSpan(s.block)
		return
	}
	v.mu.Lock()
	if cur := v.spans[s.block]; cur != nil {
		cur.leaving, cur.emptySince = false, time.Time{}
	}
	v.mu.Unlock()
	if err != nil {
		v.log.Warn("giving back an empty block failed; it stays this node's", "block", s.block, "err", err)
	}
}

// HeldBlocks is how many blocks this node holds in the view's pool.
func (v *View) HeldBlocks() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	n := 0
	for b := range v.spans {
		if b.IsValid() {
			n++
		}
	}
	return n
}
