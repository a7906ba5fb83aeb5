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

// reuseOrder looks up the held keys of the addresses the view holds back (heldLoop), and
// picks one of them for an ADD when the pool has no other room (reuseExpired). What it
// knows is the view's (core.heldBack, suspect, relRev), written under the view's lock by
// the locked methods below as watch events and listings come in.
type reuseOrder struct {
	*core
	metrics *Metrics // nil unless holding
}

// MarkHeld records what a failed claim learned: a's held key, on lease, stands with no
// allocation. A held key of this node's own (one no pod of it lists) is freed by settleHeld.
func (v *View) MarkHeld(a netip.Addr, lease clientv3.LeaseID) {
	if !v.holding() || v.mine(lease) {
		return
	}
	lk := v.lock()
	defer lk.unlock()
	switch {
	case lk.follows(a):
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

// isHeldBack reports whether a is held back from ADDs while the pool has other room: its
// holder expired without a release, or its allocation went and no release explains it yet.
func (lk locked) isHeldBack(a netip.Addr) bool {
	if _, ok := lk.heldBack[a]; ok {
		return true
	}
	_, ok := lk.suspect[a]
	return ok
}

// allocDeleted notes that a's allocation key was deleted at rev (a watch event).
func (lk locked) allocDeleted(a netip.Addr, rev int64) {
	if r, ok := lk.relRev[a]; ok && r == rev {
		delete(lk.relRev, a) // a release
		return
	}
	lk.hooks.deleted(lk.pool, a)
	if !lk.holding() {
		return
	}
	lk.suspect[a] = suspectDel{rev: rev, at: time.Now().Add(SuspectGrace)}
	lk.kickHeld()
}

// releaseSeen notes a release of a at rev: a quarantine put (a watch event) or this agent's own
// release.
func (lk locked) releaseSeen(a netip.Addr, rev int64) {
	if s, ok := lk.suspect[a]; ok && s.rev == rev {
		delete(lk.suspect, a)
		return
	}
	lk.relRev[a] = rev
}

// allocPut notes that a is allocated again: nothing of its past holder matters.
func (lk locked) allocPut(a netip.Addr) {
	delete(lk.suspect, a)
	delete(lk.heldBack, a)
	delete(lk.relRev, a)
}

// heldListed installs what a listing found of held keys in its spans: those of another node
// with no allocation at their address are held back, to be looked up (their hold's end) at
// once.
func (lk locked) heldListed(kvs []*mvccpb.KeyValue) {
	if !lk.holding() {
		return
	}
	for _, kv := range kvs {
		_, _, ip, err := keyspace.ParseHeldKey(string(kv.Key))
		if err != nil {
			continue
		}
		if _, alloc := lk.allocated[ip]; alloc || lk.mine(clientv3.LeaseID(kv.Lease)) {
			continue
		}
		if _, ok := lk.heldBack[ip]; !ok {
			lk.heldBack[ip] = time.Time{}
		}
	}
	lk.kickHeld()
}

// heldLoop looks up the held keys of suspect and held-back addresses when due, until ctx ends.
func (ro *reuseOrder) heldLoop(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		next := ro.checkHeld(ctx)
		wait := time.Hour
		if !next.IsZero() {
			wait = max(time.Until(next), 10*time.Millisecond)
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-ro.heldKick:
		case <-t.C:
		}
	}
}

// checkHeld reads the held keys of the addresses due for a look: a suspect deletion is an
// expiry if its held key (of another node) stays, and a held-back address is free once its
// held key is gone. It returns when the next look is due (zero: none).
func (ro *reuseOrder) checkHeld(ctx context.Context) time.Time {
	now := time.Now()
	var due []netip.Addr
	var next time.Time
	soonest := func(t time.Time) {
		if next.IsZero() || t.Before(next) {
			next = t
		}
	}
	lk := ro.lock()
	for a, s := range ro.suspect {
		if s.at.After(now) {
			soonest(s.at)
		} else {
			due = append(due, a)
		}
	}
	for a, until := range ro.heldBack {
		if until.After(now) {
			soonest(until)
		} else if _, ok := ro.suspect[a]; !ok {
			due = append(due, a)
		}
	}
	lk.unlock()
	if len(due) == 0 {
		return next
	}
	ops := make([]clientv3.Op, len(due))
	for i, a := range due {
		ops[i] = clientv3.OpGet(keyspace.HeldKey(ro.pool, ro.blocks, a), clientv3.WithKeysOnly())
	}
	gen := ro.hooks.generation()
	octx, cancel := context.WithTimeout(ctx, viewListTimeout)
	resps, _, err := ReadChunked(octx, ro.cli, ops)
	cancel()
	if err == nil && ro.hooks.generation() != gen {
		// The answer proved etcd went back in time: a held key it lacks may be one the
		// backup lacked, of a pod still running on a node cut off. The listing that follows
		// keeps these addresses for the keep time (replace).
		soonest(now.Add(retryMax))
		return next
	}
	if err != nil {
		if ctx.Err() == nil {
			ro.log.Info("reading held keys failed; the addresses stay held back", "count", len(due), "err", err)
		}
		soonest(now.Add(retryMax))
		return next
	}
	leases := map[clientv3.LeaseID]time.Time{}
	for _, r := range resps {
		if kvs := r.GetResponseRange().Kvs; len(kvs) > 0 && !ro.mine(clientv3.LeaseID(kvs[0].Lease)) {
			leases[clientv3.LeaseID(kvs[0].Lease)] = time.Time{}
		}
	}
	ro.holdEnds(ctx, leases)
	lk = ro.lock()
	defer lk.unlock()
	for i, a := range due {
		_, suspect := ro.suspect[a]
		_, held := ro.heldBack[a]
		if !suspect && !held {
			continue // allocated again meanwhile
		}
		delete(ro.suspect, a)
		kvs := resps[i].GetResponseRange().Kvs
		_, alloc := ro.allocated[a]
		if alloc || len(kvs) == 0 || ro.mine(clientv3.LeaseID(kvs[0].Lease)) {
			delete(ro.heldBack, a)
			lk.roomAt(a)
			continue
		}
		until := leases[clientv3.LeaseID(kvs[0].Lease)]
		if until.IsZero() {
			until = now.Add(retryMax) // its TTL could not be read: look again soon
		}
		ro.heldBack[a] = until
		soonest(until)
	}
	return next
}

// holdEnds fills in when each lease of ends expires, as etcd says now: now when the lease is
// gone, zero when it could not be read. A hold ends with the block lease of the node that held
// the address: the reuse delay after its pods' leases expired, unless it comes back.
func (ro *reuseOrder) holdEnds(ctx context.Context, ends map[clientv3.LeaseID]time.Time) {
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
			resp, err := ro.cli.TimeToLive(octx, id)
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
func (ro *reuseOrder) reuseExpired(ctx context.Context, spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool, exhausted error) (netip.Addr, error) {
	if !ro.holding() || !errors.Is(exhausted, allocator.ErrPoolExhausted) {
		return netip.Addr{}, exhausted
	}
	type cand struct {
		a     netip.Addr
		lease clientv3.LeaseID
		until time.Time
	}
	var lk locked // held while usable is called
	usable := func(a netip.Addr) bool {
		if s, ok := spec.SetOf(a); !ok || s != set || spec.Allocatable(a) != nil {
			return false
		}
		if _, ok := ro.pending[a]; ok || ro.hostCount[a] > 0 || skip != nil && skip(a) {
			return false
		}
		if lk.follows(a) {
			_, alloc := ro.allocated[a]
			_, q := ro.quarantined[a]
			return !alloc && !q
		}
		if ro.borrowed == nil {
			return false
		}
		_, q := ro.borrowed.quarantined[a]
		return !ro.borrowed.allocated[a] && !q
	}
	lk = ro.lock()
	var cands []cand
	for a, until := range ro.heldBack {
		if usable(a) {
			cands = append(cands, cand{a: a, until: until})
		}
	}
	for a := range ro.suspect { // gone just now, not looked up yet: last
		if usable(a) {
			cands = append(cands, cand{a: a})
		}
	}
	leases := map[clientv3.LeaseID]time.Time{}
	if s := ro.borrowed; s != nil {
		for a, id := range s.expired {
			if !lk.follows(a) && usable(a) {
				cands = append(cands, cand{a: a, lease: id})
				leases[id] = time.Time{}
			}
		}
	}
	lk.unlock()
	if len(cands) == 0 {
		return netip.Addr{}, exhausted
	}
	ro.holdEnds(ctx, leases)
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
	running := ro.holdersRunning(ctx, look)
	lk = ro.lock()
	defer lk.unlock()
	for i, c := range cands {
		if !usable(c.a) || i >= maxRunningLookups || running[c.a] {
			continue
		}
		ro.pending[c.a] = struct{}{}
		ro.metrics.ExpiredReused.Inc()
		ro.log.Info("reusing an address whose holder expired without a release: the pool has no other room",
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
func (ro *reuseOrder) holdersRunning(ctx context.Context, addrs []netip.Addr) map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	if len(addrs) == 0 {
		return out
	}
	octx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	ops := make([]clientv3.Op, len(addrs))
	for i, a := range addrs {
		ops[i] = clientv3.OpGet(keyspace.HeldKey(ro.pool, ro.blocks, a))
	}
	resp, err := ro.cli.Txn(octx).Then(ops...).Commit()
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
	if resp, err = ro.cli.Txn(octx).Then(pods...).Commit(); err != nil {
		return out
	}
	for i, a := range of {
		if resp.Responses[i].GetResponseRange().Count > 0 {
			out[a] = true
		}
	}
	if len(out) > 0 {
		ro.log.Info("held-back addresses whose pod record stands are not reused: their nodes put their allocations back",
			"ips", slices.Collect(maps.Keys(out)))
	}
	return out
}
