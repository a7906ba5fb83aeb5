package poolview

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The reuse order (issue 23). An address whose pod lease expired without a release may belong
// to a pod that still runs on a node cut off from etcd: its held key (keyspace.HeldKey), on
// that node's block lease, outlives the allocation by the reuse delay. An ADD takes such an
// address only when the pool has no other: not in this node's blocks, not in an unclaimed
// block, not by borrowing. Then it takes the one whose hold ends first (the longest expired),
// so an ADD never fails while an address is really free. An address asked for explicitly is
// claimed as before. Nothing here is a rule etcd enforces: every claim is still
// create-if-absent on the allocation key, and a stale hint costs a retry or an early reuse,
// never a duplicate.
//
// How the view knows which addresses are held back, without a watch of held keys (which would
// cost every ADD a second watch event): a listing reads the held keys of the spans it
// follows; a deleted allocation that no release explains (a release puts the address's
// quarantine key at the same revision, and the agent's own releases tell the view) is looked
// up once: an expiry leaves its held key behind. A held-back address is looked up again when
// its hold ends. The borrowing snapshot reads the pool's held keys with its allocations.

// SuspectGrace is how long a deleted allocation waits for the quarantine put of a release at
// the same revision (a separate watch) before the view reads its held key.
const SuspectGrace = time.Second

// suspectDel is a deleted allocation no release explained yet: the revision it went at, and
// when to read its held key.
type suspectDel struct {
	rev int64
	at  time.Time
}

// holding reports whether the view applies the reuse order; the caller holds the lock or
// reads it before the view runs.
func (v *View) holding() bool { return v.mine != nil }

// heldBackLocked reports whether a is held back from ADDs while the pool has other room: its
// holder expired without a release, or its allocation went and no release explains it yet.
// The caller holds the lock.
func (v *View) heldBackLocked(a netip.Addr) bool {
	if _, ok := v.heldBack[a]; ok {
		return true
	}
	_, ok := v.suspect[a]
	return ok
}

// allocDeleted notes that a's allocation key was deleted at rev (a watch event); the caller
// holds the lock.
func (v *View) allocDeleted(a netip.Addr, rev int64) {
	if r, ok := v.relRev[a]; ok && r == rev {
		delete(v.relRev, a) // a release
		return
	}
	v.hooks.deleted(v.pool, a)
	if !v.holding() {
		return
	}
	v.suspect[a] = suspectDel{rev: rev, at: time.Now().Add(SuspectGrace)}
	v.kickHeld()
}

// releaseSeen notes a release of a at rev: a quarantine put (a watch event) or this agent's own
// release. The caller holds the lock.
func (v *View) releaseSeen(a netip.Addr, rev int64) {
	if s, ok := v.suspect[a]; ok && s.rev == rev {
		delete(v.suspect, a)
		return
	}
	v.relRev[a] = rev
}

// allocPut notes that a is allocated again: nothing of its past holder matters. The caller
// holds the lock.
func (v *View) allocPut(a netip.Addr) {
	delete(v.suspect, a)
	delete(v.heldBack, a)
	delete(v.relRev, a)
}

// MarkHeld records what a failed claim learned: a's held key, on lease, stands with no
// allocation. A held key of this node's own (one no pod of it lists) is freed by settleHeld.
func (v *View) MarkHeld(a netip.Addr, lease clientv3.LeaseID) {
	if !v.holding() || v.mine(lease) {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	switch {
	case v.follows(a):
		if _, ok := v.heldBack[a]; !ok {
			v.heldBack[a] = time.Time{}
			v.kickHeld()
		}
	case v.borrowed != nil:
		if _, ok := v.borrowed.expired[a]; !ok {
			v.borrowed.expired[a] = lease
			v.borrowed.used[v.blocks.Of(a)]++
		}
	}
}

// heldListed installs what a listing found of held keys in its spans: those of another node
// with no allocation at their address are held back, to be looked up (their hold's end) at
// once. The caller holds the lock.
func (v *View) heldListed(kvs []*mvccpb.KeyValue) {
	if !v.holding() {
		return
	}
	for _, kv := range kvs {
		_, _, ip, err := keyspace.ParseHeldKey(string(kv.Key))
		if err != nil {
			continue
		}
		if _, alloc := v.allocated[ip]; alloc || v.mine(clientv3.LeaseID(kv.Lease)) {
			continue
		}
		if _, ok := v.heldBack[ip]; !ok {
			v.heldBack[ip] = time.Time{}
		}
	}
	v.kickHeld()
}

func (v *View) kickHeld() {
	select {
	case v.heldKick <- struct{}{}:
	default:
	}
}

// heldLoop looks up the held keys of suspect and held-back addresses when due, until ctx ends.
func (v *View) heldLoop(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		next := v.checkHeld(ctx)
		wait := time.Hour
		if !next.IsZero() {
			wait = max(time.Until(next), 10*time.Millisecond)
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-v.heldKick:
		case <-t.C:
		}
	}
}

// checkHeld reads the held keys of the addresses due for a look: a suspect deletion is an
// expiry if its held key (of another node) stays, and a held-back address is free once its
// held key is gone. It returns when the next look is due (zero: none).
func (v *View) checkHeld(ctx context.Context) time.Time {
	now := time.Now()
	var due []netip.Addr
	var next time.Time
	soonest := func(t time.Time) {
		if next.IsZero() || t.Before(next) {
			next = t
		}
	}
	v.mu.Lock()
	for a, s := range v.suspect {
		if s.at.After(now) {
			soonest(s.at)
		} else {
			due = append(due, a)
		}
	}
	for a, until := range v.heldBack {
		if until.After(now) {
			soonest(until)
		} else if _, ok := v.suspect[a]; !ok {
			due = append(due, a)
		}
	}
	v.mu.Unlock()
	if len(due) == 0 {
		return next
	}
	ops := make([]clientv3.Op, len(due))
	for i, a := range due {
		ops[i] = clientv3.OpGet(keyspace.HeldKey(v.pool, v.blocks, a), clientv3.WithKeysOnly())
	}
	gen := v.hooks.generation()
	octx, cancel := context.WithTimeout(ctx, viewListTimeout)
	resps, _, err := ReadChunked(octx, v.cli, ops)
	cancel()
	if err == nil && v.hooks.generation() != gen {
		// The answer proved etcd went back in time: a held key it lacks may be one the
		// backup lacked, of a pod still running on a node cut off. The listing that follows
		// keeps these addresses for the keep time (replace).
		soonest(now.Add(retryMax))
		return next
	}
	if err != nil {
		if ctx.Err() == nil {
			v.log.Info("reading held keys failed; the addresses stay held back", "count", len(due), "err", err)
		}
		soonest(now.Add(retryMax))
		return next
	}
	leases := map[clientv3.LeaseID]time.Time{}
	for _, r := range resps {
		if kvs := r.GetResponseRange().Kvs; len(kvs) > 0 && !v.mine(clientv3.LeaseID(kvs[0].Lease)) {
			leases[clientv3.LeaseID(kvs[0].Lease)] = time.Time{}
		}
	}
	v.holdEnds(ctx, leases)
	v.mu.Lock()
	defer v.mu.Unlock()
	for i, a := range due {
		_, suspect := v.suspect[a]
		_, held := v.heldBack[a]
		if !suspect && !held {
			continue // allocated again meanwhile
		}
		delete(v.suspect, a)
		kvs := resps[i].GetResponseRange().Kvs
		_, alloc := v.allocated[a]
		if alloc || len(kvs) == 0 || v.mine(clientv3.LeaseID(kvs[0].Lease)) {
			delete(v.heldBack, a)
			v.roomAt(a)
			continue
		}
		until := leases[clientv3.LeaseID(kvs[0].Lease)]
		if until.IsZero() {
			until = now.Add(retryMax) // its TTL could not be read: look again soon
		}
		v.heldBack[a] = until
		soonest(until)
	}
	return next
}

// holdEnds fills in when each lease of ends expires, as etcd says now: now when the lease is
// gone, zero when it could not be read. A hold ends with the block lease of the node that held
// the address: the reuse delay after its pods' leases expired, unless it comes back.
func (v *View) holdEnds(ctx context.Context, ends map[clientv3.LeaseID]time.Time) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	now := time.Now()
	for _, id := range slices.Collect(maps.Keys(ends)) {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			octx, cancel := context.WithTimeout(ctx, probeTimeout)
			defer cancel()
			resp, err := v.cli.TimeToLive(octx, id)
			if err != nil {
				return
			}
			end := now // the lease is gone: the hold has ended
			if resp.TTL > 0 {
				end = now.Add(time.Duration(resp.TTL) * time.Second)
			}
			mu.Lock()
			ends[id] = end
			mu.Unlock()
		})
	}
	wg.Wait()
}

// reuseExpired picks, for an ADD that found no other free address of set in the whole pool
// (this node's blocks, an unclaimed block, borrowing from a snapshot read just now), an
// address whose holder expired without a release: the one whose hold ends first. It marks it
// pending, or returns exhausted, the error the search without them ended with.
func (v *View) reuseExpired(ctx context.Context, spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool, exhausted error) (netip.Addr, error) {
	if !v.holding() || !errors.Is(exhausted, allocator.ErrPoolExhausted) {
		return netip.Addr{}, exhausted
	}
	type cand struct {
		a     netip.Addr
		lease clientv3.LeaseID
		until time.Time
	}
	usable := func(a netip.Addr) bool {
		if s, ok := spec.SetOf(a); !ok || s != set || spec.Allocatable(a) != nil {
			return false
		}
		if _, ok := v.pending[a]; ok || v.hostCount[a] > 0 || skip != nil && skip(a) {
			return false
		}
		if v.follows(a) {
			_, alloc := v.allocated[a]
			_, q := v.quarantined[a]
			return !alloc && !q
		}
		if v.borrowed == nil {
			return false
		}
		_, q := v.borrowed.quarantined[a]
		return !v.borrowed.allocated[a] && !q
	}
	v.mu.Lock()
	var cands []cand
	for a, until := range v.heldBack {
		if usable(a) {
			cands = append(cands, cand{a: a, until: until})
		}
	}
	for a := range v.suspect { // gone just now, not looked up yet: last
		if usable(a) {
			cands = append(cands, cand{a: a})
		}
	}
	leases := map[clientv3.LeaseID]time.Time{}
	if s := v.borrowed; s != nil {
		for a, id := range s.expired {
			if !v.follows(a) && usable(a) {
				cands = append(cands, cand{a: a, lease: id})
				leases[id] = time.Time{}
			}
		}
	}
	v.mu.Unlock()
	if len(cands) == 0 {
		return netip.Addr{}, exhausted
	}
	v.holdEnds(ctx, leases)
	for i := range cands {
		if cands[i].lease != 0 {
			cands[i].until = leases[cands[i].lease]
		}
	}
	// The hold that ends first goes first; one whose end is unknown (gone just now, or its
	// TTL could not be read) goes last.
	slices.SortFunc(cands, func(x, y cand) int {
		switch {
		case x.until.IsZero() != y.until.IsZero():
			if x.until.IsZero() {
				return 1
			}
			return -1
		case !x.until.Equal(y.until):
			return x.until.Compare(y.until)
		}
		return x.a.Compare(y.a)
	})
	look := make([]netip.Addr, 0, min(len(cands), maxRunningLookups))
	for _, c := range cands[:min(len(cands), maxRunningLookups)] {
		look = append(look, c.a)
	}
	running := v.holdersRunning(ctx, look)
	v.mu.Lock()
	defer v.mu.Unlock()
	for i, c := range cands {
		if !usable(c.a) || i >= maxRunningLookups || running[c.a] {
			continue
		}
		v.pending[c.a] = struct{}{}
		v.metrics.ExpiredReused.Inc()
		v.log.Info("reusing an address whose holder expired without a release: the pool has no other room",
			"ip", c.a, "held_until", c.until, "held_on_lease", keyspace.LeaseHex(c.lease))
		return c.a, nil
	}
	if len(running) > 0 {
		exhausted = fmt.Errorf("%w; %d addresses without an allocation are held for pods whose record still stands: "+
			"their keys were deleted or changed, and their nodes put them back (leaseholdctl doctor names them)", exhausted, len(running))
	}
	return netip.Addr{}, exhausted
}

// maxRunningLookups bounds the held-back addresses one reuse looks up (holdersRunning): the
// first to end, one read each. One further back is not taken unlooked: the ADD is refused.
const maxRunningLookups = 32

// holdersRunning reads, for each candidate address, its held key and the pod record of the
// holder the key names, and returns the addresses whose holder's pod record stands: that pod's
// lease did not run out, so its node still has it; only its allocation is gone (deleted by
// hand, or overwritten), and the node's audit puts it back. A lease that runs out takes the
// pod record with the allocation: that is the expired holder the reuse order is for. A failed
// read leaves the answer to the claim, which compares the allocation absent.
func (v *View) holdersRunning(ctx context.Context, addrs []netip.Addr) map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	if len(addrs) == 0 {
		return out
	}
	octx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	ops := make([]clientv3.Op, len(addrs))
	for i, a := range addrs {
		ops[i] = clientv3.OpGet(keyspace.HeldKey(v.pool, v.blocks, a))
	}
	resp, err := v.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return out
	}
	var pods []clientv3.Op
	var of []netip.Addr
	for i, a := range addrs {
		kvs := resp.Responses[i].GetResponseRange().Kvs
		if len(kvs) == 0 {
			continue
		}
		rec, err := keyspace.Decode[keyspace.HeldRecord](string(kvs[0].Key), kvs[0].Value)
		if err != nil || keyspace.ValidateNames("cluster", rec.Cluster, "node", rec.Node, "owner", rec.Owner) != nil {
			continue
		}
		pods = append(pods, clientv3.OpGet(keyspace.PodKey(rec.Cluster, rec.Node, rec.Owner), clientv3.WithCountOnly()))
		of = append(of, a)
	}
	if len(pods) == 0 {
		return out
	}
	if resp, err = v.cli.Txn(octx).Then(pods...).Commit(); err != nil {
		return out
	}
	for i, a := range of {
		if resp.Responses[i].GetResponseRange().Count > 0 {
			out[a] = true
		}
	}
	if len(out) > 0 {
		v.log.Info("held-back addresses whose pod record stands are not reused: their nodes put their allocations back",
			"ips", slices.Collect(maps.Keys(out)))
	}
	return out
}

// HeldBackCount is how many addresses the view holds back, and when the first hold it knows
// ends (zero: none known).
func (v *View) HeldBackCount() (n int, first time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	seen := map[netip.Addr]bool{}
	note := func(a netip.Addr, until time.Time) {
		if seen[a] {
			return
		}
		seen[a] = true
		n++
		if !until.IsZero() && (first.IsZero() || until.Before(first)) {
			first = until
		}
	}
	for a, until := range v.heldBack {
		note(a, until)
	}
	for a := range v.suspect {
		note(a, time.Time{})
	}
	if s := v.borrowed; s != nil && time.Since(v.borrowedAt) < snapshotFresh {
		for a := range s.expired {
			note(a, time.Time{})
		}
	}
	return n, first
}
