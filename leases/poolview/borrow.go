package poolview

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Borrowing: with every block of a set claimed and no room in its own, a node takes a free
// address inside another node's block, found in one keys-only read of the whole pool. The
// claim is the same create-if-absent transaction as always, so the block's owner and the
// borrower never both hold an address; the owner hears of it through its block's watch.

// snapshot is the whole pool as read for borrowing: allocated and resting addresses. It is
// kept and reused until it offers nothing; a claim that fails on it marks what it learned.
type snapshot struct {
	allocated   map[netip.Addr]bool
	quarantined map[netip.Addr]time.Time
	// used counts allocated, resting and held-back addresses per block: a block claim skips
	// blocks without room (unclaimable) at no cost per block.
	used map[netip.Prefix]int
	// expired are addresses with another node's held key and no allocation: their holder
	// expired without a release (reuse.go). Value: the held key's lease.
	expired map[netip.Addr]clientv3.LeaseID
}

// take records a as allocated in the snapshot.
func (s *snapshot) take(b allocator.Blocks, a netip.Addr) {
	if !s.allocated[a] {
		s.allocated[a] = true
		if _, ok := s.expired[a]; !ok {
			s.used[b.Of(a)]++
		}
	}
	delete(s.expired, a)
}

// free records a as released, with its quarantine until until (zero: none).
func (s *snapshot) free(b allocator.Blocks, a netip.Addr, until time.Time) {
	if s.allocated[a] {
		delete(s.allocated, a)
		s.used[b.Of(a)]--
	}
	if !until.IsZero() {
		s.quarantined[a] = until
	}
}

func (s *snapshot) Allocated(a netip.Addr) bool { return s.allocated[a] }

func (s *snapshot) Quarantined(a netip.Addr) (time.Time, bool) {
	t, ok := s.quarantined[a]
	return t, ok
}

// borrowTaken is what is taken in the whole pool: this node's blocks as its view follows them,
// the rest as the snapshot read them, and host addresses everywhere; with strict, also the
// addresses held back after an expiry. The view's lock is held.
type borrowTaken struct {
	lk     locked
	s      *snapshot
	strict bool
}

func (t borrowTaken) Allocated(a netip.Addr) bool {
	if t.lk.follows(a) {
		return t.lk.Allocated(a)
	}
	if _, held := t.s.expired[a]; held && t.strict {
		return true
	}
	return t.s.allocated[a] || t.lk.hostCount[a] > 0
}

func (t borrowTaken) Quarantined(a netip.Addr) (time.Time, bool) {
	if t.lk.follows(a) {
		return t.lk.Quarantined(a)
	}
	return t.s.Quarantined(a)
}

// borrower finds free addresses outside this node's blocks, in a snapshot of the whole pool
// (core.borrowed, under the view's lock) read when it has none fresh enough.
type borrower struct {
	*core
	owner *Owner // nil in the flat layout
}

// borrow picks a free address of set anywhere in the pool, outside this node's blocks (full,
// or the caller would not be here), and marks it pending. It reuses the last snapshot while
// younger than snapshotFresh and reads the pool again once when that offers nothing, so
// "exhausted" is said only after a fresh read.
func (bw *borrower) borrow(ctx context.Context, spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool) (netip.Addr, error) {
	for fresh := false; ; fresh = true {
		lk := bw.lock()
		s := bw.borrowed
		stale := time.Since(bw.borrowedAt) >= snapshotFresh
		lk.unlock()
		if s == nil || fresh || stale {
			var err error
			if s, err = bw.readPool(ctx); err != nil {
				return netip.Addr{}, err
			}
			fresh = true
		}
		lk = bw.lock()
		addr, err := pickSpread(spec, set, borrowTaken{lk, s, true}, lk.busy(skip))
		if err == nil {
			bw.pending[addr] = struct{}{}
		}
		lk.unlock()
		if err == nil {
			bw.owner.Metrics.Borrowed.Inc()
			return addr, nil
		}
		if fresh {
			return netip.Addr{}, err
		}
	}
}

// borrowSpread is how many free addresses a borrower chooses among, found within
// borrowWindow addresses of the first.
const (
	borrowSpread = 16
	borrowWindow = 1024
)

// pickSpread picks a free address of set for a borrower: the first free address after a
// random place, or one of up to borrowSpread free addresses in the borrowWindow addresses
// from it, at random. Borrowers of every node compete for the same few free addresses near
// exhaustion, and those often lie together (in the blocks that filled last): a walk from a
// random place then crosses a taken stretch and ends on the same first free address for
// every borrower, whose claims lose to each other. Free addresses spread thin over the pool
// need no more than the random place; the window bounds what looking further costs.
func pickSpread(spec *allocator.PoolSpec, set int, taken allocator.Taken, busy func(netip.Addr) bool) (netip.Addr, error) {
	first, err := spec.Next(set, spec.Ranges[set].Spread(rand.Float64()), taken, busy)
	if err != nil {
		return netip.Addr{}, err
	}
	found := []netip.Addr{first}
	for c, left := first.Next(), borrowWindow; len(found) < borrowSpread && left > 0; {
		a, looked, ok := spec.NextNear(set, c, left, taken, busy)
		if !ok {
			break
		}
		found, c, left = append(found, a), a.Next(), left-looked
	}
	return found[rand.IntN(len(found))], nil
}

// readPool reads every allocation key (keys only) and quarantine key of the pool, and keeps
// the result as the borrowing snapshot.
func (bw *borrower) readPool(ctx context.Context) (*snapshot, error) {
	octx, cancel := context.WithTimeout(ctx, viewListTimeout)
	defer cancel()
	resp, err := bw.cli.Txn(octx).Then(
		clientv3.OpGet(keyspace.IPsPrefix(bw.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.QuarantinePrefix(bw.pool), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.HeldPrefix(bw.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	).Commit()
	if err != nil {
		return nil, fmt.Errorf("%w: read pool %s to borrow an address: %w", allocator.ErrUnavailable, bw.pool, err)
	}
	s := &snapshot{allocated: make(map[netip.Addr]bool), quarantined: make(map[netip.Addr]time.Time),
		used: make(map[netip.Prefix]int), expired: make(map[netip.Addr]clientv3.LeaseID)}
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		if _, _, ip, err := keyspace.ParseIPKey(string(kv.Key)); err == nil {
			s.take(bw.blocks, ip)
		}
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		applyQuarantine(s.quarantined, kv.Key, kv.Value)
	}
	for a := range s.quarantined {
		if !s.allocated[a] {
			s.used[bw.blocks.Of(a)]++
		}
	}
	if bw.holding() {
		for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
			_, _, ip, err := keyspace.ParseHeldKey(string(kv.Key))
			id := clientv3.LeaseID(kv.Lease)
			if err != nil || s.allocated[ip] || bw.mine(id) {
				continue
			}
			if _, q := s.quarantined[ip]; !q {
				s.used[bw.blocks.Of(ip)]++
			}
			s.expired[ip] = id
		}
	}
	lk := bw.lock()
	bw.borrowed, bw.borrowedAt = s, time.Now()
	lk.unlock()
	return s, nil
}

// fresh reports whether the borrowing snapshot was read within snapshotFresh.
func (bw *borrower) fresh() bool {
	lk := bw.lock()
	defer lk.unlock()
	return bw.borrowed != nil && time.Since(bw.borrowedAt) < snapshotFresh
}
