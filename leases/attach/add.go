package attach

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/claimloop"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/restorehold"
	"github.com/leasehold/leasehold/leases/txn"
)

// maxAddAttempts bounds the transactions one ADD tries before it gives up on a pool whose
// free addresses keep being taken by others between view and commit.
const maxAddAttempts = 16

// addState is what one ADD carries across its attempts.
type addState struct {
	req   allocator.Request
	owner string
	own   *ownerlock.Owned // the owner's lock, held for the whole ADD
	// claims are the ADD's claim loop (leases/claimloop): the spare lease taken for a pod that
	// has none yet, and what a refused or unanswered claim means to an ADD (addPolicy).
	claims *claimloop.Loop
	// lost are addresses this ADD found taken since its view was built.
	lost map[netip.Addr]bool
	// unanswered counts claims whose answer did not come (see tryAdd).
	unanswered int
	// relisted: the pool's view was found stale and listed again once in this ADD.
	relisted bool
	// borrowLost counts the borrowed addresses this ADD found taken: the borrowing snapshot
	// is read again at the first and then at every rereadEvery-th.
	borrowLost int
	// sticky is the claim the ADD names (Config.Sticky); nil: it names none.
	sticky Sticky
	// families are the address families the attachment takes from its pool: its range sets
	// of them (an interface whose other families come from other pools, joint.go); nil: all.
	families []int
}

// rereadEvery is how many borrowed addresses an ADD finds taken before it reads the pool
// again (the first loss reads it at once): at most four reads in an ADD's 16 attempts.
const rereadEvery = 4

// maxUnanswered bounds the claims an ADD sends again after losing their answers; the waits
// between them (50 ms doubling) span an etcd leader election.
const maxUnanswered = 5

func (s *addState) skip(a netip.Addr) bool { return s.lost[a] }

// addIn is an ADD in the one pool req names (Add chose it).
func (x *Attachments) addIn(ctx context.Context, req allocator.Request) (_ allocator.Result, err error) {
	defer func() {
		if errors.Is(err, allocator.ErrPoolExhausted) {
			if v := x.pools.ViewOf(req.Pool.Name); v != nil {
				v.NoteExhausted()
			}
		}
	}()
	st, end, err := x.begin(ctx, req)
	if err != nil {
		return allocator.Result{}, err
	}
	defer end()
	req = st.req
	for attempt := range maxAddAttempts {
		if attempt > 0 {
			x.cfg.Metrics.Retried()
		}
		p, err := x.ready(ctx, req.Pool, st)
		if err != nil {
			return allocator.Result{}, err
		}
		requested, err := p.Spec.MatchRequested(st.req.RequestedIPs)
		if errors.Is(err, allocator.ErrNotInRange) {
			// The address may lie in a range added since the definition was read.
			octx, cancel := x.opCtx(ctx)
			_, changed, _, rerr := x.recheck(octx, ownerKeyOf(x, st, p), p)
			cancel()
			if rerr == nil && changed {
				x.pools.Invalidate(p.Spec.Name)
				continue
			}
		}
		if err != nil {
			return allocator.Result{}, err
		}
		res, done, err := x.tryAdd(ctx, p, st, requested)
		if done && err == nil {
			// Answered once the journal has the pod: a crash right after the answer followed
			// by an outage past the TTL still re-claims it. A journal that cannot be written
			// fails /readyz, not the ADD (the pod record in etcd outlives a restart).
			_ = x.journal.Sync(ctx)
		}
		if done || err != nil {
			return res, err
		}
	}
	return allocator.Result{}, fmt.Errorf("%w: pool %q: gave up after %d transactions because other owners kept taking the chosen addresses first; retry",
		allocator.ErrUnavailable, req.Pool.Name, maxAddAttempts)
}

// begin starts ADD req: it validates req, waits for etcd to answer and for a restore's
// repair, and takes the owner lock. It returns the ADD's state and end, which gives back
// what the ADD did not use (its spare lease, its sticky claim's lease) and the lock. A pod
// whose lease was lost (or whose keys were, to a restore or by hand) is answered code 11
// until its re-claim is done: without its lease the ADD would claim as for a new pod, and
// give a repeated ADD new addresses while its sandbox uses the old ones (invariant 4). The
// hold after a restore opens a TTL after the notice, re-claims or not.
func (x *Attachments) begin(ctx context.Context, req allocator.Request) (_ *addState, end func(), _ error) {
	owner, err := x.cfg.Validate(&req)
	if err != nil {
		return nil, nil, err
	}
	owner = x.cfg.AttachmentOwner(req, owner) // an imported container's ADD, repeated: its addresses
	if err := x.cfg.Reachable(ctx); err != nil {
		return nil, nil, err // a node cut off from etcd says so at once
	}
	if err := x.hold.Wait(ctx, x.cfg.OpTimeout); err != nil {
		return nil, nil, err // etcd went back in time: this node's pods first
	}
	own := x.locks.Lock(owner)
	if _, lost := x.pods.LostPod(owner); lost {
		own.Unlock()
		x.cfg.Wake()
		return nil, nil, fmt.Errorf("%w: the lease of owner %s was lost, or its keys in etcd; its addresses are being "+
			"re-claimed: retry", allocator.ErrUnavailable, owner)
	}
	st := &addState{req: req, owner: owner, own: own, lost: make(map[netip.Addr]bool)}
	st.claims = x.loops.For(own, req, x.addPolicy(st))
	if req.Claim != "" {
		st.sticky = x.cfg.Sticky(req, owner)
	}
	return st, func() {
		st.claims.Done()
		x.keeper.Refill()
		if st.sticky != nil {
			st.sticky.Drop()
		}
		own.Unlock()
	}, nil
}

// ready returns pool spec, read, its view ready to choose from, for the attempt of ADD st: a
// pool being moved to the block layout, or closed to st (closedTo), refuses it; a sticky
// claim not read yet is read.
func (x *Attachments) ready(ctx context.Context, spec allocator.PoolSpec, st *addState) (*poolview.Pool, error) {
	p, err := x.pools.Ensure(ctx, spec)
	if err != nil {
		return nil, err
	}
	if m := p.Migrating; m != nil {
		return nil, fmt.Errorf("%w: pool %q is being moved to the block layout by leaseholdctl pool migrate "+
			"(%s, since %s): ADDs resume when it finishes; if it was interrupted, run leaseholdctl pool migrate %s again",
			allocator.ErrUnavailable, p.Spec.Name, m.By, m.Since.Format(time.RFC3339), p.Spec.Name)
	}
	p.Await(ctx)
	if st.sticky != nil && st.sticky.Stale() {
		if err := st.sticky.Read(ctx, p.Spec, &st.req); err != nil {
			return nil, err
		}
	}
	if err := x.closedTo(p, st); err != nil {
		// Refused by what etcd says now, not by a definition read before the pool
		// was opened.
		x.pools.Invalidate(p.Spec.Name)
		if p, err = x.pools.Ensure(ctx, spec); err != nil {
			return nil, err
		}
		if err := x.closedTo(p, st); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// tryAdd runs one claim transaction. It returns done=false when the caller should try again
// with what the failed transaction taught the view.
func (x *Attachments) tryAdd(ctx context.Context, p *poolview.Pool, st *addState, requested []netip.Addr) (allocator.Result, bool, error) {
	req, owner := st.req, st.owner
	octx, cancel := x.opCtx(ctx)
	defer cancel()
	epoch := x.gate.Epoch() // what the view and the snapshots know is of this history

	lease, known := x.pods.Lease(owner)
	// A sticky claim's holder repeating its ADD is answered so too: its claim transaction
	// would find its own addresses taken (by itself) until it gave up, when etcd lost its
	// owner index. A live migration's target claims through target.
	if at, _, ok := x.pods.Attachment(owner, req.IfName, p.Spec.Name); ok && known && at.ContainerID == req.ContainerID &&
		(st.sticky == nil || !st.sticky.Target()) {
		return x.repeated(ctx, p, st, lease)
	}
	if !known {
		id, err := st.claims.Spare(octx)
		if err != nil {
			return allocator.Result{}, false, unavailable("grant pod lease", err)
		}
		lease = id
	}

	pk, stop, err := x.pick(ctx, octx, p, st, requested)
	if stop {
		return allocator.Result{}, false, err
	}
	if pk.existing != nil {
		return x.existing(ctx, p, st, pk.existing)
	}
	addrs, reserved, notHeld := pk.addrs, pk.reserved, pk.notHeld

	heldLease, held, err := x.HeldFor(octx, owner)
	if err != nil {
		p.View.Settle(reserved, 0)
		return allocator.Result{}, false, err
	}
	now := x.wall()
	c := &txn.Claim{Add: true, Lease: lease, Pool: p.Spec.Name, Blocks: p.Spec.Blocks, PoolRev: p.Rev, Addrs: addrs,
		HeldLease: heldLease, Held: held, NotHeld: notHeld,
		OwnerKey: keyspace.OwnerKey(x.cfg.Cluster, owner, req.IfName, p.Spec.Name),
		PodKey:   keyspace.PodKey(x.cfg.Cluster, x.cfg.Node, owner), NewPod: !known,
		Alloc: x.Allocation(req, owner, lease, now), Index: x.OwnerRecord(req, addrs, lease, now),
		Pod: x.PodRecord(req, owner, lease, now)}
	if st.sticky != nil && st.sticky.Target() {
		return x.target(ctx, octx, p, st, c, now)
	}
	if st.sticky != nil {
		if err := st.sticky.Claim(octx, c, now); err != nil {
			p.View.Settle(reserved, 0)
			return allocator.Result{}, false, err
		}
	}
	out, again, err := st.claims.Commit(ctx, c, func() (txn.ClaimOutcome, error) {
		start := time.Now()
		defer x.cfg.Metrics.RTT("claim", start)
		if c.ClaimKey != "" {
			// A sticky claim goes alone: its quarantine puts and claim compare are not for a batch.
			return c.Commit(octx, x.cli)
		}
		return x.batcher.Commit(octx, c)
	})
	if err != nil || again {
		// An unanswered claim sent again finds the owner index (the lost one applied: its
		// addresses are returned) or claims afresh on the same lease.
		p.View.Settle(reserved, 0)
		return allocator.Result{}, false, err
	}
	if out.Applied && st.sticky == nil && x.gate.Epoch() != epoch {
		p.View.Settle(reserved, 0)
		return allocator.Result{}, false, x.undoClaim(ctx, st, known, lease, p.Spec.Name)
	}
	if out.Applied {
		p.View.Settle(addrs, out.Revision)
		at := podbook.Attachment{IfName: req.IfName, Pool: p.Spec.Name, Network: req.Network,
			ContainerID: req.ContainerID, IPs: addrs, Created: now, OwnerRev: out.Revision}
		if s := st.sticky; s != nil && s.Bound(&at) {
			x.cfg.Metrics.Handover()
			x.log.Info("claim handed over", "claim", at.Claim, "owner", owner, "pool", p.Spec.Name, "ips", addrs)
		}
		x.loops.ClaimedOn(ctx, req, st.own, lease, at)
		st.claims.Bound()
		x.log.Debug("allocated", "owner", owner, "container", req.ContainerID, "ifname", req.IfName, "pool", p.Spec.Name, "ips", addrs)
		res, err := Result(&p.Spec, addrs)
		return res, true, err
	}
	p.View.Settle(reserved, 0)
	return x.learn(ctx, p, st, requested, lease, out)
}

// picked is the addresses an attachment's claim is to take in one pool: addrs, one per range
// set (of the attachment's families), of which reserved were chosen by the view (to be
// settled) and notHeld as free ones. existing is the attachment's owner index, found while no
// address was free: then there is nothing to claim. full is the family of the range set that
// had no free address, when pick stopped for want of one.
type picked struct {
	addrs, reserved []netip.Addr
	notHeld         map[netip.Addr]bool
	existing        *mvccpb.KeyValue
	full            int
}

// pick chooses the addresses of st's attachment in pool p, one per range set (requested ones
// as given). stop says the ADD's attempt ends here, with err, or, err nil, to be tried again
// with what the view has learned; the view's reservations are settled then.
func (x *Attachments) pick(ctx, octx context.Context, p *poolview.Pool, st *addState, requested []netip.Addr) (_ picked, stop bool, _ error) {
	addrs := make([]netip.Addr, len(p.Spec.Ranges))
	var reserved []netip.Addr
	notHeld := map[netip.Addr]bool{}
	for i := range p.Spec.Ranges {
		if st.families != nil && !slices.Contains(st.families, p.Spec.Ranges[i].Family()) {
			continue // another pool gives the interface this family
		}
		if requested[i].IsValid() {
			addrs[i] = requested[i]
			continue
		}
		addr, expired, err := p.View.Choose(ctx, &p.Spec, i, func(ip netip.Addr) bool {
			// Never an address of this node's own pods: one whose lease expired (a freeze, a
			// crash, a cut-off) looks free until its re-claim writes it back.
			return st.skip(ip) || x.pods.OwnsAddr(p.Spec.Name, ip)
		}, st.sticky == nil)
		if errors.Is(err, restorehold.ErrSettling) {
			p.View.Settle(reserved, 0)
			return picked{}, true, err // no retry: the settle time lasts minutes
		}
		if errors.Is(err, allocator.ErrUnavailable) {
			// A block claim or a borrowing read etcd did not answer (a leader election):
			// wait and try again, as for an unanswered claim.
			p.View.Settle(reserved, 0)
			return picked{}, true, x.waitUnanswered(ctx, st, st.owner, err)
		}
		if err != nil {
			p.View.Settle(reserved, 0)
			// No free address in the cached view. A repeated ADD needs none, and the pool may
			// have grown since the definition was read: only on this path does the agent read
			// the owner index and the definition's revision first (the hot path learns both
			// from the claim's else branch).
			kv, changed, stale, rerr := x.recheck(octx, ownerKeyOf(x, st, p), p)
			switch {
			case rerr != nil:
				return picked{}, true, rerr
			case kv != nil:
				return picked{existing: kv}, false, nil
			case changed:
				x.pools.Invalidate(p.Spec.Name)
				return picked{}, true, nil
			case stale && !st.relisted:
				st.relisted = true
				x.log.Info("the pool's view holds addresses etcd does not; listing the pool again before answering", "pool", p.Spec.Name)
				select {
				case <-p.View.Restart():
				case <-ctx.Done():
					return picked{}, true, unavailable("list pool "+p.Spec.Name+" again", ctx.Err())
				}
				return picked{}, true, nil
			}
			return picked{full: p.Spec.Ranges[i].Family()}, true, fmt.Errorf("pool %q: %w", p.Spec.Name, err)
		}
		addrs[i] = addr
		reserved = append(reserved, addr)
		if !expired {
			notHeld[addr] = true
			continue
		}
		// A held-back address goes to another pod only when the pool has nothing else free,
		// and a view whose watches are behind etcd (an agent paused, or starved of CPU) may
		// still hold addresses released since: the recheck before code 102 judges this too.
		if st.relisted {
			continue
		}
		if _, _, stale, err := x.recheck(octx, ownerKeyOf(x, st, p), p); err == nil && stale {
			p.View.Settle(reserved, 0)
			st.relisted = true
			x.log.Info("the pool's view holds addresses etcd does not; listing the pool again before reusing a held-back address",
				"pool", p.Spec.Name, "ip", addr)
			select {
			case <-p.View.Restart():
			case <-ctx.Done():
				return picked{}, true, unavailable("list pool "+p.Spec.Name+" again", ctx.Err())
			}
			return picked{}, true, nil
		}
	}
	if st.families != nil {
		addrs = slices.DeleteFunc(addrs, func(a netip.Addr) bool { return !a.IsValid() })
	}
	return picked{addrs: addrs, reserved: reserved, notHeld: notHeld}, false, nil
}
