package poolview

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

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

// BlockClaims claims, keeps and gives back this node's blocks of a view's pool: one block
// claim at a time (claimMu, taken before the view's lock), the give-back of blocks that stay
// empty (giveBackLoop), and what the agent's audit asks of the claims.
type BlockClaims struct {
	*core
	owner  *Owner // nil in the flat layout
	sync   *syncer
	borrow *borrower
	// claimMu makes block claims one at a time (View.chooseFree, Claim).
	claimMu sync.Mutex
}

// claimBlock claims a block of set with no claim, nearest after the blocks this node holds
// (so that routes aggregate), and starts following it. It reports false when no block is
// free as far as a recent read of the claims tells, or when another node claimed the chosen
// block first (the claims are then read again from the failed transaction).
func (bc *BlockClaims) claimBlock(ctx context.Context, spec *allocator.PoolSpec, set int) (_ bool, err error) {
	lk := bc.lock()
	from := lk.from(spec, set)
	var top netip.Prefix
	for b := range bc.spans {
		if b.IsValid() && spec.Serves(set, b) && (!top.IsValid() || top.Addr().Less(b.Addr())) {
			top = b
		}
	}
	if top.IsValid() {
		from = lastAddrOf(top).Next()
	}
	skip := lk.unclaimable()
	block, ok := spec.NextBlock(set, bc.blocks, from, skip)
	fresh := time.Since(bc.claimsRead) < claimsFresh
	lk.unlock()
	if !ok {
		if fresh {
			return false, nil
		}
		if err := bc.readClaims(ctx); err != nil {
			return false, err
		}
		lk = bc.lock()
		block, ok = spec.NextBlock(set, bc.blocks, from, skip)
		lk.unlock()
		if !ok {
			return false, nil
		}
	}
	if _, err := bc.claimAt(ctx, block); err != nil {
		return false, err
	}
	return true, nil // claimed, or another node was first: the caller tries the next block
}

// claimAt claims block, if no node has, and starts following it; it reports false when
// another node claimed it first (the claims are then read again from the failed transaction).
func (bc *BlockClaims) claimAt(ctx context.Context, block netip.Prefix) (_ bool, err error) {
	o := bc.owner
	octx, cancel := context.WithTimeout(ctx, o.OpTimeout)
	defer cancel()
	key := keyspace.BlockKey(bc.pool, block)
	var resp *clientv3.TxnResponse
	var lease clientv3.LeaseID
	for range 2 {
		if lease, err = o.Lease(octx); err != nil {
			return false, fmt.Errorf("%w: grant a block lease: %w", allocator.ErrUnavailable, err)
		}
		rec := keyspace.BlockRecord{Cluster: o.Cluster, Node: o.Node, NodeUID: o.NodeUID, LeaseID: keyspace.LeaseHex(lease), Since: o.Wall().UTC()}
		resp, err = bc.cli.Txn(octx).If(keyspace.Absent(key)).Then(
			append([]clientv3.Op{clientv3.OpPut(key, keyspace.Encode(rec), clientv3.WithLease(lease))}, blockReads(bc.pool, block)...)...,
		).Else(clientv3.OpGet(keyspace.BlocksPrefix(bc.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly())).Commit()
		if !keyspace.IsLeaseNotFound(err) {
			break
		}
		// The block lease expired or was revoked from outside: its claims went with it.
		o.LostLease(lease)
	}
	if err != nil {
		return false, fmt.Errorf("%w: claim block %s of pool %s: %w", allocator.ErrUnavailable, block, bc.pool, err)
	}
	if !resp.Succeeded {
		lk := bc.lock()
		bc.claims, bc.claimsRead = make(map[netip.Prefix]string), time.Now()
		for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
			if _, b, err := keyspace.ParseBlockKey(string(kv.Key)); err == nil {
				bc.claims[b] = "?"
			}
		}
		lk.unlock()
		return false, nil
	}
	o.Metrics.BlockClaims.Inc()
	bc.log.Info("block claimed", "block", block, "lease", keyspace.LeaseHex(lease))
	bc.addSpan(&span{block: block, lease: lease, rev: resp.Header.Revision},
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

// blockSize is the number of addresses in block b (capped: only halves of it are compared).
func blockSize(b netip.Prefix) int {
	return 1 << min(b.Addr().BitLen()-b.Bits(), 30)
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
func (bc *BlockClaims) readClaims(ctx context.Context) error {
	octx, cancel := context.WithTimeout(ctx, bc.owner.OpTimeout)
	defer cancel()
	resp, err := bc.cli.Get(octx, keyspace.BlocksPrefix(bc.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("%w: read the block claims of pool %s: %w", allocator.ErrUnavailable, bc.pool, err)
		}
		bc.log.Warn("reading the block claims failed; ADDs go on with the claims as last known, and borrow",
			"err", err, "again after", claimsFresh)
		lk := bc.lock()
		bc.claimsRead = time.Now()
		lk.unlock()
		return nil
	}
	claims := make(map[netip.Prefix]string, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if _, b, err := keyspace.ParseBlockKey(string(kv.Key)); err == nil {
			claims[b] = "?"
		}
	}
	lk := bc.lock()
	bc.claims, bc.claimsRead = claims, time.Now()
	lk.unlock()
	return nil
}

// addSpan starts following a block this node just claimed, from its listing l on. Its
// watches start after l: a change to this node's pods' keys in the block before it (an
// address this node's pods held while nobody claimed the block, as after a cut-off longer
// than the reuse delay) reached no watch, so the audit is told as after a listing
// (Hooks.Listed), and compares every allocation at its next pass.
func (bc *BlockClaims) addSpan(s *span, l listed) {
	lk := bc.lock()
	bc.spans[s.block] = s
	bc.spansAdded++
	bc.order = nil
	bc.claims[s.block] = bc.owner.Cluster + "/" + bc.owner.Node
	for _, kv := range l.ips.GetKvs() {
		if _, _, ip, err := keyspace.ParseIPKey(string(kv.Key)); err == nil && bc.allocated[ip] < kv.CreateRevision {
			bc.allocated[ip] = kv.CreateRevision
		}
	}
	for _, kv := range l.qs.GetKvs() {
		applyQuarantine(bc.quarantined, kv.Key, kv.Value)
	}
	lk.heldListed(l.held.GetKvs())
	g := bc.sync.gen
	lk.unlock()
	bc.hooks.listed() // once the view follows the block: the audit may leave its keys out from now on
	if g != nil {
		bc.sync.watchSpan(g, span{block: s.block, rev: s.rev})
	}
}

// dropSpan stops following block and forgets what the view knew inside it.
func (bc *BlockClaims) dropSpan(block netip.Prefix) {
	lk := bc.lock()
	defer lk.unlock()
	s, ok := bc.spans[block]
	if !ok {
		return
	}
	if s.stop != nil {
		s.stop()
	}
	delete(bc.spans, block)
	bc.order = nil
	delete(bc.claims, block)
	for a := range bc.allocated {
		if block.Contains(a) {
			delete(bc.allocated, a)
		}
	}
	for a := range bc.quarantined {
		if block.Contains(a) {
			delete(bc.quarantined, a)
			delete(bc.restKept, a)
		}
	}
	for _, m := range []func(func(netip.Addr) bool){mapKeys(bc.heldBack), mapKeys(bc.suspect), mapKeys(bc.relRev)} {
		m(func(a netip.Addr) bool {
			if block.Contains(a) {
				delete(bc.heldBack, a)
				delete(bc.suspect, a)
				delete(bc.relRev, a)
			}
			return true
		})
	}
}

// LeaseLost drops the blocks whose claims were on lease, which etcd no longer has: their
// claims are gone with it. The pods inside keep their addresses on their own leases; the next
// ADD claims a block again.
func (bc *BlockClaims) LeaseLost(lease clientv3.LeaseID) {
	lk := bc.lock()
	var gone []netip.Prefix
	for b, s := range bc.spans {
		if b.IsValid() && s.lease == lease {
			gone = append(gone, b)
		}
	}
	lk.unlock()
	for _, b := range gone {
		bc.log.Warn("block claim lost with its lease", "block", b, "lease", keyspace.LeaseHex(lease))
		bc.dropSpan(b)
	}
}

// giveBackLoop gives back the blocks that stayed empty for the idle time.
func (bc *BlockClaims) giveBackLoop(ctx context.Context) {
	tick := min(max(bc.owner.Idle/4, 50*time.Millisecond), time.Minute)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, s := range bc.idleBlocks(time.Now()) {
			bc.giveBack(ctx, s)
		}
	}
}

// idleBlocks notes which blocks are empty now and returns those empty for the idle time,
// marked leaving so that no ADD chooses from them while they are given back.
func (bc *BlockClaims) idleBlocks(now time.Time) []span {
	lk := bc.lock()
	defer lk.unlock()
	// A quarantine kept across a restore with no key in etcd holds its block until it ends,
	// not for ever.
	lk.endRestKept(now)
	// An address held back for another node's expired pod does not keep its block: the view
	// looks at its held key again only when the hold ends as its lease's TTL said, and the
	// key may go long before (its node back and done with it, `node forget`, its lease
	// revoked) with no event the view follows. The give-back's transaction compares the
	// block's held keys absent: while one stands, the block stays.
	used := make(map[netip.Prefix]bool)
	for _, m := range []func(func(netip.Addr) bool){mapKeys(bc.allocated), mapKeys(bc.quarantined), mapKeys(bc.pending),
		mapKeys(bc.suspect)} {
		m(func(a netip.Addr) bool {
			used[bc.blocks.Of(a)] = true
			return true
		})
	}
	var out []span
	for b, s := range bc.spans {
		switch {
		case !b.IsValid() || s.leaving:
		case used[b]:
			s.emptySince = time.Time{}
		case s.emptySince.IsZero():
			s.emptySince = now
		case now.Sub(s.emptySince) >= bc.owner.Idle:
			s.leaving = true
			out = append(out, *s)
		}
	}
	return out
}

// giveBack deletes the claim of an empty block, if it is still this node's on the same lease
// and etcd holds no allocation, no quarantined address and no held key in it.
func (bc *BlockClaims) giveBack(ctx context.Context, s span) {
	octx, cancel := context.WithTimeout(ctx, bc.owner.OpTimeout)
	defer cancel()
	key := keyspace.BlockKey(bc.pool, s.block)
	resp, err := bc.cli.Txn(octx).If(keyspace.OnLease(key, s.lease),
		keyspace.NoneUnder(keyspace.BlockIPsPrefix(bc.pool, s.block)),
		keyspace.NoneUnder(keyspace.BlockQuarantinePrefix(bc.pool, s.block)),
		// Nor an address held back for a pod that may still run (a lost lease being re-claimed).
		keyspace.NoneUnder(keyspace.BlockHeldPrefix(bc.pool, s.block))).
		Then(clientv3.OpDelete(key)).Commit()
	if err == nil && resp.Succeeded {
		bc.owner.Metrics.BlocksGivenBack.Inc()
		bc.log.Info("empty block given back", "block", s.block)
		bc.dropSpan(s.block)
		return
	}
	lk := bc.lock()
	if cur := bc.spans[s.block]; cur != nil {
		cur.leaving, cur.emptySince = false, time.Time{}
	}
	lk.unlock()
	if err != nil {
		bc.log.Warn("giving back an empty block failed; it stays this node's", "block", s.block, "err", err)
	}
}

// Count is how many blocks this node holds in the view's pool.
func (bc *BlockClaims) Count() int {
	lk := bc.lock()
	defer lk.unlock()
	n := 0
	for b := range bc.spans {
		if b.IsValid() {
			n++
		}
	}
	return n
}

// Held is the blocks this node holds in the pool, with the lease each claim is on, but
// those being given back.
func (bc *BlockClaims) Held() map[netip.Prefix]clientv3.LeaseID {
	lk := bc.lock()
	defer lk.unlock()
	out := make(map[netip.Prefix]clientv3.LeaseID)
	for b, s := range bc.spans {
		if b.IsValid() && !s.leaving && s.lease != 0 {
			out[b] = s.lease
		}
	}
	return out
}

// Holds tells whether claimsHeld would still list block on lease.
func (bc *BlockClaims) Holds(block netip.Prefix, lease clientv3.LeaseID) bool {
	lk := bc.lock()
	defer lk.unlock()
	s, ok := bc.spans[block]
	return ok && !s.leaving && s.lease == lease
}

// Claim claims block for this node if no node has (one block claim at a time), and
// starts following it; it reports false when another node claimed it first.
func (bc *BlockClaims) Claim(ctx context.Context, block netip.Prefix) (bool, error) {
	bc.claimMu.Lock()
	defer bc.claimMu.Unlock()
	return bc.claimAt(ctx, block)
}

// MarkRestored has the view pass over block for the keep time, as over a block the backup
// gave back.
func (bc *BlockClaims) MarkRestored(block netip.Prefix) {
	lk := bc.lock()
	defer lk.unlock()
	if sp := bc.spans[block]; sp != nil && time.Now().Before(bc.keepUntil) {
		sp.restored = true
	}
}

// Stale makes the next ADD that finds no unclaimed block read the claims again.
func (bc *BlockClaims) Stale() {
	lk := bc.lock()
	defer lk.unlock()
	bc.claimsRead = time.Time{}
}
