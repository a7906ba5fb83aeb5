package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

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
	// sticky is the claim the ADD names, as read (sticky.go); origRequested the addresses
	// the runtime asked for, before the claim's replaced them.
	sticky        *stickyAdd
	origRequested []netip.Addr
}

// rereadEvery is how many borrowed addresses an ADD finds taken before it reads the pool
// again (the first loss reads it at once): at most four reads in an ADD's 16 attempts.
const rereadEvery = 4

// maxUnanswered bounds the claims an ADD sends again after losing their answers; the waits
// between them (50 ms doubling) span an etcd leader election.
const maxUnanswered = 5

func (s *addState) skip(a netip.Addr) bool { return s.lost[a] }

// addIn is an ADD in the one pool req names (Add chose it).
func (a *Agent) addIn(ctx context.Context, req allocator.Request) (_ allocator.Result, err error) {
	defer func() {
		if errors.Is(err, allocator.ErrPoolExhausted) {
			if v := a.pools.ViewOf(req.Pool.Name); v != nil {
				v.NoteExhausted()
			}
		}
	}()
	owner, err := a.validate(&req)
	if err != nil {
		return allocator.Result{}, err
	}
	owner = a.attachmentOwner(req, owner) // an imported container's ADD, repeated: its addresses
	if err := a.reachable(ctx); err != nil {
		return allocator.Result{}, err // a node cut off from etcd says so at once
	}
	if err := a.hold.Wait(ctx, a.cfg.OpTimeout); err != nil {
		return allocator.Result{}, err // etcd went back in time: this node's pods first
	}
	own := a.locks.Lock(owner)
	defer own.Unlock()
	st := &addState{req: req, owner: owner, own: own, lost: make(map[netip.Addr]bool), origRequested: req.RequestedIPs}
	st.claims = a.loops.For(own, req, a.addPolicy(st))
	defer a.sticky.dropSticky(st)
	defer func() {
		st.claims.Done()
		a.keeper.Refill()
	}()
	for attempt := range maxAddAttempts {
		if attempt > 0 {
			a.metrics.casRetries.Inc()
		}
		p, err := a.pools.Ensure(ctx, req.Pool)
		if err != nil {
			return allocator.Result{}, err
		}
		if m := p.Migrating; m != nil {
			return allocator.Result{}, fmt.Errorf("%w: pool %q is being moved to the block layout by leaseholdctl pool migrate "+
				"(%s, since %s): ADDs resume when it finishes; if it was interrupted, run leaseholdctl pool migrate %s again",
				allocator.ErrUnavailable, p.Spec.Name, m.By, m.Since.Format(time.RFC3339), p.Spec.Name)
		}
		p.Await(ctx)
		if req.Claim != "" && (st.sticky == nil || st.sticky.stale) {
			if err := a.sticky.readSticky(ctx, p.Spec, st); err != nil {
				return allocator.Result{}, err
			}
		}
		if err := a.closedTo(p, st); err != nil {
			// Refused by what etcd says now, not by a definition read before the pool
			// was opened.
			a.pools.Invalidate(p.Spec.Name)
			if p, err = a.pools.Ensure(ctx, req.Pool); err != nil {
				return allocator.Result{}, err
			}
			if err := a.closedTo(p, st); err != nil {
				return allocator.Result{}, err
			}
		}
		requested, err := p.Spec.MatchRequested(st.req.RequestedIPs)
		if errors.Is(err, allocator.ErrNotInRange) {
			// The address may lie in a range added since the definition was read.
			octx, cancel := a.opCtx(ctx)
			_, changed, _, rerr := a.recheck(octx, ownerKeyOf(a, st, p), p)
			cancel()
			if rerr == nil && changed {
				a.pools.Invalidate(p.Spec.Name)
				continue
			}
		}
		if err != nil {
			return allocator.Result{}, err
		}
		res, done, err := a.tryAdd(ctx, p, st, requested)
		if done && err == nil {
			// Answered once the journal has the pod: a crash right after the answer followed
			// by an outage past the TTL still re-claims it. A journal that cannot be written
			// fails /readyz, not the ADD (the pod record in etcd outlives a restart).
			_ = a.jw.Sync(ctx)
		}
		if done || err != nil {
			return res, err
		}
	}
	return allocator.Result{}, fmt.Errorf("%w: pool %q: gave up after %d transactions because other owners kept taking the chosen addresses first; retry",
		allocator.ErrUnavailable, req.Pool.Name, maxAddAttempts)
}

// tryAdd runs one claim transaction. It returns done=false when the caller should try again
// with what the failed transaction taught the view.
func (a *Agent) tryAdd(ctx context.Context, p *poolview.Pool, st *addState, requested []netip.Addr) (allocator.Result, bool, error) {
	req, owner := st.req, st.owner
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	epoch := a.gate.Epoch() // what the view and the snapshots know is of this history

	lease, known := a.pods.Lease(owner)
	if at, _, ok := a.pods.Attachment(owner, req.IfName, p.Spec.Name); ok && known && at.ContainerID == req.ContainerID && st.sticky == nil {
		return a.repeated(ctx, p, st, lease)
	}
	if !known {
		id, err := st.claims.Spare(octx)
		if err != nil {
			return allocator.Result{}, false, a.unavailable("grant pod lease", err)
		}
		lease = id
	}

	addrs := make([]netip.Addr, len(p.Spec.Ranges))
	var reserved []netip.Addr
	notHeld := map[netip.Addr]bool{}
	for i := range p.Spec.Ranges {
		if requested[i].IsValid() {
			addrs[i] = requested[i]
			continue
		}
		addr, expired, err := p.View.Choose(ctx, &p.Spec, i, func(x netip.Addr) bool {
			// Never an address of this node's own pods: one whose lease expired (a freeze, a
			// crash, a cut-off) looks free until its re-claim writes it back.
			return st.skip(x) || a.pods.OwnsAddr(p.Spec.Name, x)
		}, st.sticky == nil)
		if errors.Is(err, restorehold.ErrSettling) {
			p.View.Settle(reserved, 0)
			return allocator.Result{}, false, err // no retry: the settle time lasts minutes
		}
		if errors.Is(err, allocator.ErrUnavailable) {
			// A block claim or a borrowing read etcd did not answer (a leader election):
			// wait and try again, as for an unanswered claim.
			p.View.Settle(reserved, 0)
			return allocator.Result{}, false, a.waitUnanswered(ctx, st, owner, err)
		}
		if err != nil {
			p.View.Settle(reserved, 0)
			// No free address in the cached view. A repeated ADD needs none, and the pool may
			// have grown since the definition was read: only on this path does the agent read
			// the owner index and the definition's revision first (the hot path learns both
			// from the claim's else branch).
			kv, changed, stale, rerr := a.recheck(octx, ownerKeyOf(a, st, p), p)
			switch {
			case rerr != nil:
				return allocator.Result{}, false, rerr
			case kv != nil:
				return a.existing(ctx, p, st, kv)
			case changed:
				a.pools.Invalidate(p.Spec.Name)
				return allocator.Result{}, false, nil
			case stale && !st.relisted:
				st.relisted = true
				a.log.Info("the pool's view holds addresses etcd does not; listing the pool again before answering", "pool", p.Spec.Name)
				select {
				case <-p.View.Restart():
				case <-ctx.Done():
					return allocator.Result{}, false, a.unavailable("list pool "+p.Spec.Name+" again", ctx.Err())
				}
				return allocator.Result{}, false, nil
			}
			return allocator.Result{}, false, fmt.Errorf("pool %q: %w", p.Spec.Name, err)
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
		if _, _, stale, err := a.recheck(octx, ownerKeyOf(a, st, p), p); err == nil && stale {
			p.View.Settle(reserved, 0)
			st.relisted = true
			a.log.Info("the pool's view holds addresses etcd does not; listing the pool again before reusing a held-back address",
				"pool", p.Spec.Name, "ip", addr)
			select {
			case <-p.View.Restart():
			case <-ctx.Done():
				return allocator.Result{}, false, a.unavailable("list pool "+p.Spec.Name+" again", ctx.Err())
			}
			return allocator.Result{}, false, nil
		}
	}

	heldLease, held, err := a.heldFor(octx, owner)
	if err != nil {
		p.View.Settle(reserved, 0)
		return allocator.Result{}, false, err
	}
	now := a.wall()
	c := &txn.Claim{Add: true, Lease: lease, Pool: p.Spec.Name, Blocks: p.Spec.Blocks, PoolRev: p.Rev, Addrs: addrs,
		HeldLease: heldLease, Held: held, NotHeld: notHeld,
		OwnerKey: keyspace.OwnerKey(a.cfg.Cluster, owner, req.IfName, p.Spec.Name),
		PodKey:   keyspace.PodKey(a.cfg.Cluster, a.cfg.Node, owner), NewPod: !known,
		Alloc: a.allocation(req, owner, lease, now), Index: a.ownerRecord(req, addrs, lease, now),
		Pod: a.podRecord(req, owner, lease, now)}
	if st.sticky != nil {
		if err := a.sticky.stickyClaim(octx, st, c, now); err != nil {
			p.View.Settle(reserved, 0)
			return allocator.Result{}, false, err
		}
	}
	out, again, err := st.claims.Commit(ctx, c, func() (txn.ClaimOutcome, error) {
		start := time.Now()
		defer a.metrics.rtt("claim", start)
		if c.ClaimKey != "" {
			// A sticky claim goes alone: its quarantine puts and claim compare are not for a batch.
			return c.Commit(octx, a.cli)
		}
		return a.claims.Commit(octx, c)
	})
	if err != nil || again {
		// An unanswered claim sent again finds the owner index (the lost one applied: its
		// addresses are returned) or claims afresh on the same lease.
		p.View.Settle(reserved, 0)
		return allocator.Result{}, false, err
	}
	if out.Applied && st.sticky == nil && a.gate.Epoch() != epoch {
		p.View.Settle(reserved, 0)
		return allocator.Result{}, false, a.undoClaim(ctx, st, known, lease, p.Spec.Name)
	}
	if out.Applied {
		p.View.Settle(addrs, out.Revision)
		at := attachment{IfName: req.IfName, Pool: p.Spec.Name, Network: req.Network,
			ContainerID: req.ContainerID, IPs: addrs, Created: now, OwnerRev: out.Revision}
		if s := st.sticky; s != nil {
			at.Claim, at.ClaimLease, at.ClaimHold, s.used = s.name, s.lease, s.hold, true
			if s.handover {
				a.metrics.claimHandovers.Inc()
				a.log.Info("claim handed over", "claim", s.name, "owner", owner, "pool", p.Spec.Name, "ips", addrs)
			}
		}
		a.loops.ClaimedOn(ctx, req, st.own, lease, at)
		st.claims.Bound()
		a.log.Debug("allocated", "owner", owner, "container", req.ContainerID, "ifname", req.IfName, "pool", p.Spec.Name, "ips", addrs)
		res, err := result(&p.Spec, addrs)
		return res, true, err
	}
	p.View.Settle(reserved, 0)
	return a.learn(ctx, p, st, requested, lease, out)
}

// undoClaim gives back what a claim took when etcd went back in time between the choice of
// its addresses and its answer: they were chosen from what the agent knew of the history the
// restore undid, where a block or an address another node's pod holds (its key gone with the
// backup) looked free. A new pod's lease is revoked with every key on it; an attachment of a
// known pod is released. The ADD fails with code 11, and is tried again once the agent has
// repaired (leases/restorehold).
func (a *Agent) undoClaim(ctx context.Context, st *addState, known bool, lease clientv3.LeaseID, pool string) error {
	var err error
	if known {
		req := st.req
		req.Pool = allocator.PoolSpec{Name: pool}
		_, err = a.release.ReleaseAttachment(ctx, req, st.own)
	} else {
		err = a.keeper.Revoke(lease)
		st.claims.Bound() // revoked: neither the owner's nor a spare
	}
	a.log.Warn("etcd went back in time while an ADD chose its addresses; what it claimed is given back",
		"owner", st.owner, "container", st.req.ContainerID, "pool", pool, "err", err)
	if err != nil {
		return a.unavailable("give back a claim made across etcd going back in time", err)
	}
	return fmt.Errorf("%w: etcd went back in time while this ADD chose its addresses; retry once this node has "+
		"re-claimed its pods", allocator.ErrUnavailable)
}

// waitUnanswered waits before the next attempt of an ADD whose etcd request went unanswered
// (err), 50 ms doubling; after maxUnanswered of them, or when ctx ends, it returns err.
func (a *Agent) waitUnanswered(ctx context.Context, st *addState, owner string, err error) error {
	st.unanswered++
	if st.unanswered > maxUnanswered || ctx.Err() != nil {
		return err
	}
	if a.silentFor() > probeAfter && a.reachable(ctx) != nil {
		return err // not an election but a cut-off: say so now, not after the plugin's timeout
	}
	a.log.Warn("etcd did not answer; trying again", "owner", owner, "attempt", st.unanswered, "err", err)
	select {
	case <-ctx.Done():
		return err
	case <-time.After(50 * time.Millisecond << (st.unanswered - 1)):
	}
	return nil
}

// addPolicy is what a claim etcd refused or did not answer means to the ADD st (the claim
// loop, leases/claimloop). A known pod's lease that is gone takes the pod's keys with it: the pod
// is queued for re-claim, and the runtime's retry finds it re-claimed. Any other refusal (the
// NOSPACE alarm, a missing permission, too many requests) is the ADD's answer, naming the
// cause. An unanswered claim is sent again after a wait (waitUnanswered).
func (a *Agent) addPolicy(st *addState) claimloop.Policy {
	return claimloop.Policy{
		OwnLeaseGone: func(lease clientv3.LeaseID, _ error) error {
			a.keeper.Forget(lease)
			a.leaseLost(lease)
			return fmt.Errorf("%w: the lease %s of owner %s is gone from etcd, and its addresses with it; "+
				"they are being re-claimed: retry", allocator.ErrUnavailable, keyspace.LeaseHex(lease), st.owner)
		},
		Refused: func(err error) error {
			if txn.NoSpace(err) {
				return fmt.Errorf("%w: etcd is out of space (its NOSPACE alarm is raised) and takes no new "+
					"allocation until an operator frees space (etcdctl compact, defrag, alarm disarm): %w", allocator.ErrUnavailable, err)
			}
			return a.unavailable("etcd refused the claim", err)
		},
		Unanswered: func(ctx context.Context, err error) error {
			return a.waitUnanswered(ctx, st, st.owner, a.unavailable("claim addresses", err))
		},
	}
}

// heldFor is what an owner's claim writes as its held keys: the node's block lease and the
// record naming node and owner. With no reuse delay nothing is held back and no held key
// is written (lease 0).
func (a *Agent) heldFor(ctx context.Context, owner string) (clientv3.LeaseID, keyspace.HeldRecord, error) {
	if a.cfg.ReuseDelay <= 0 {
		return 0, keyspace.HeldRecord{}, nil
	}
	id, err := a.blockLeases.get(ctx)
	if err != nil {
		return 0, keyspace.HeldRecord{}, a.unavailable("grant this node's block lease", err)
	}
	return id, keyspace.HeldRecord{Cluster: a.cfg.Cluster, Node: a.cfg.Node, Owner: owner}, nil
}

// heldLeaseGone tells, for a claim etcd refused because a lease was not found, whether it was
// the block lease its held keys were to go on (expired or revoked from outside): then its
// claims are gone with it, and the caller claims again on a new one.
func (a *Agent) heldLeaseGone(ctx context.Context, id clientv3.LeaseID) bool {
	if id == 0 {
		return false
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	ttl, err := a.cli.TimeToLive(octx, id)
	if err != nil || ttl.TTL > 0 {
		return false
	}
	a.log.Warn("this node's block lease is gone from etcd, and its block claims and held keys with it; claiming on a new one",
		"lease", keyspace.LeaseHex(id))
	a.keeper.Forget(id)
	a.blockLeaseLost(id)
	return true
}

// learn acts on what a failed claim found: the attachment may exist already (an idempotent
// ADD), the pool definition may have changed, the pod record may not be where the agent
// thought, or some addresses were taken. It returns done=false for the caller to try again.
func (a *Agent) learn(ctx context.Context, p *poolview.Pool, st *addState, requested []netip.Addr,
	lease clientv3.LeaseID, out txn.ClaimOutcome) (allocator.Result, bool, error) {
	if out.Existing != nil {
		return a.existing(ctx, p, st, out.Existing)
	}
	if out.PoolChanged {
		a.pools.Invalidate(p.Spec.Name)
		return allocator.Result{}, false, nil
	}
	if s := st.sticky; s != nil && (out.ClaimChanged || s.rev != 0 && slices.ContainsFunc(out.Addrs, txn.AddrFound.Taken)) {
		// The claim moved, or its addresses were taken, since the ADD read it: read it again
		// (and wait, if another holder has them). A new claim's addresses are the view's
		// choice: taken ones are learned below as for any ADD, or the view chooses them again.
		s.stale = true
		return allocator.Result{}, false, nil
	}
	switch out.Pod {
	case txn.PodExists:
		// The pod has keys on another interface already, from before this agent's memory.
		if err := a.resumePod(ctx, st.own, out.PodKV); err != nil {
			return allocator.Result{}, false, err
		}
		return allocator.Result{}, false, nil
	case txn.PodGone, txn.PodMoved:
		// The lease this agent holds for the pod no longer carries its pod record: deleted or
		// changed by hand, or lost with a restored backup. The pod's other attachments run:
		// they are re-claimed, as the audit would, before this ADD adds to them.
		p := auditPod{Owner: st.owner, Lease: lease}
		if err := a.audit.KeysLost(ctx, p, []string{keyspace.PodKey(a.cfg.Cluster, a.cfg.Node, st.owner) + ": missing or on another lease"}, nil); err != nil {
			return allocator.Result{}, false, err
		}
		a.recovery.Wake()
		return allocator.Result{}, false, fmt.Errorf("%w: the pod record of %s was gone from etcd; its addresses are being "+
			"re-claimed: retry", allocator.ErrUnavailable, st.owner)
	}
	for i, f := range out.Addrs {
		if !f.Taken() {
			continue
		}
		st.lost[f.Addr] = true
		wanted := requested[i] == f.Addr
		if f.Host != nil {
			p.View.MarkHost(string(f.Host.Key), f.Addr)
			if wanted {
				return allocator.Result{}, false, fmt.Errorf("%w: %s is a host address: %s publishes it as its own, so no pool hands it out",
					allocator.ErrAddressInUse, f.Addr, f.Host.Key)
			}
		}
		if f.Holder != nil {
			if p.View.MarkAllocated(f.Addr, f.Holder.CreateRevision) {
				// Borrowed from a snapshot that others' ADDs have made stale: near
				// exhaustion each of its addresses may be taken, so read the pool again
				// rather than try them one by one; again after rereadEvery more losses,
				// when every node's borrowers compete for the last addresses.
				if st.borrowLost%rereadEvery == 0 {
					p.View.StaleSnapshot()
				}
				st.borrowLost++
			}
			if !wanted {
				p.View.Scatter(&p.Spec, i)
			} else {
				holder, _ := keyspace.Decode[keyspace.Allocation](string(f.Holder.Key), f.Holder.Value)
				return allocator.Result{}, false, fmt.Errorf("%w: %s in pool %q is held by owner %s (pod %s/%s, cluster %s, node %s, container %s)",
					allocator.ErrAddressInUse, f.Addr, p.Spec.Name, holder.Owner, holder.Pod.Namespace, holder.Pod.Name,
					holder.Cluster, holder.Node, holder.ContainerID)
			}
		}
		if f.Held != nil && f.Holder == nil {
			// Held back for a holder that expired without a release, though the view or
			// snapshot took it for free: the search passes it over from now on.
			p.View.MarkHeld(f.Addr, clientv3.LeaseID(f.Held.Lease))
			if a.blockLeases.mine(clientv3.LeaseID(f.Held.Lease)) {
				a.recovery.Wake() // this node's own held key no pod of it lists: settleHeld frees it
			}
		}
		if f.Wanted != nil && f.Holder == nil {
			// A running pod wants it back: in use, as far as this view goes, until an event
			// or a listing says otherwise.
			p.View.MarkAllocated(f.Addr, f.Wanted.CreateRevision)
			if wanted {
				return allocator.Result{}, false, fmt.Errorf("%w: %s in pool %q is wanted back by the running pod %s, whose "+
					"address another owner took while its lease was lost", allocator.ErrAddressInUse, f.Addr, p.Spec.Name, f.Wanted.Key)
			}
		}
		if f.Quarantine != nil {
			rec, _ := keyspace.Decode[keyspace.QuarantineRecord](string(f.Quarantine.Key), f.Quarantine.Value)
			p.View.MarkQuarantined(f.Addr, rec.Until)
			if wanted {
				return allocator.Result{}, false, fmt.Errorf("%w: %s in pool %q rests in quarantine until %s after its release by %s",
					allocator.ErrAddressInUse, f.Addr, p.Spec.Name, rec.Until.Format(time.RFC3339), rec.ReleasedBy)
			}
		}
	}
	return allocator.Result{}, false, nil
}

func ownerKeyOf(a *Agent, st *addState, p *poolview.Pool) string {
	return keyspace.OwnerKey(a.cfg.Cluster, st.owner, st.req.IfName, p.Spec.Name)
}

// recheck reads, in one transaction, an attachment's owner index (nil when there is none),
// whether the pool's stored definition changed since p was read, and whether p's view holds
// more allocated or resting addresses than etcd does: then the view is stale in a way its
// watches did not report (etcd's data replaced), and must be listed again before the ADD may
// say that no address is free.
func (a *Agent) recheck(ctx context.Context, ownerKey string, p *poolview.Pool) (kv *mvccpb.KeyValue, changed, stale bool, err error) {
	allocated, quarantined, ipPrefixes, qPrefixes := p.View.Counts()
	ops := []clientv3.Op{clientv3.OpGet(ownerKey), clientv3.OpGet(keyspace.PoolKey(p.Spec.Name), clientv3.WithKeysOnly())}
	for _, prefix := range append(ipPrefixes, qPrefixes...) {
		ops = append(ops, clientv3.OpGet(prefix, clientv3.WithPrefix(), clientv3.WithCountOnly()))
	}
	resps, _, err := poolview.ReadChunked(ctx, a.cli, ops)
	if err != nil {
		return nil, false, false, a.unavailable("read "+ownerKey, err)
	}
	if kvs := resps[0].GetResponseRange().Kvs; len(kvs) > 0 {
		kv = kvs[0]
	}
	pools := resps[1].GetResponseRange().Kvs
	changed = len(pools) == 0 || pools[0].ModRevision != p.Rev
	var inEtcd [2]int64
	for i := range ipPrefixes {
		inEtcd[0] += resps[2+i].GetResponseRange().Count
		inEtcd[1] += resps[2+len(ipPrefixes)+i].GetResponseRange().Count
	}
	stale = inEtcd[0] < int64(allocated) || inEtcd[1] < int64(quarantined)
	return kv, changed, stale, nil
}

// repeated answers an ADD of an attachment this agent holds on lease: with the addresses its
// owner index names. Without an owner index etcd lost it (deleted by hand, or a restored
// backup): the pod is re-claimed as the audit would have it, and the ADD answered code 11; a
// claim would give the attachment new addresses while its sandbox uses the old ones.
func (a *Agent) repeated(ctx context.Context, p *poolview.Pool, st *addState, lease clientv3.LeaseID) (allocator.Result, bool, error) {
	key := ownerKeyOf(a, st, p)
	octx, cancel := a.opCtx(ctx)
	resp, err := a.cli.Get(octx, key)
	cancel()
	if err != nil {
		return allocator.Result{}, false, a.unavailable("read owner index "+key, err)
	}
	if len(resp.Kvs) > 0 {
		return a.existing(ctx, p, st, resp.Kvs[0])
	}
	if err := a.audit.KeysLost(ctx, auditPod{Owner: st.owner, Lease: lease}, []string{key + ": missing"}, nil); err != nil {
		return allocator.Result{}, false, err
	}
	a.recovery.Wake()
	return allocator.Result{}, false, fmt.Errorf("%w: the owner index %s was gone from etcd; the pod's addresses are being "+
		"re-claimed: retry", allocator.ErrUnavailable, key)
}

// existing answers an ADD for an attachment that already has addresses. The same container
// gets them again. A new container of the same pod (a sandbox re-created without a DEL)
// takes the attachment over, keeping the addresses; the old container's late DEL then
// compares its container ID and releases nothing.
func (a *Agent) existing(ctx context.Context, p *poolview.Pool, st *addState, kv *mvccpb.KeyValue) (allocator.Result, bool, error) {
	rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
	if err != nil {
		return allocator.Result{}, false, err
	}
	if rec.NodeUID != a.cfg.NodeUID {
		return allocator.Result{}, false, a.foreign(st.owner, string(kv.Key), rec.Node, rec.NodeUID, keyspace.LeaseOf(kv))
	}
	lease := keyspace.LeaseOf(kv)
	if !a.keeper.Holds(lease) {
		octx, cancel := a.opCtx(ctx)
		defer cancel()
		if err := a.keeper.Adopt(octx, lease); err != nil {
			return allocator.Result{}, false, a.unavailable("resume the pod lease", err)
		}
	}
	rev := kv.ModRevision
	if rec.ContainerID != st.req.ContainerID {
		if rev, err = a.rebind(ctx, p, st, kv, rec, lease); err != nil {
			return allocator.Result{}, false, err
		}
	}
	a.loops.ClaimedOn(ctx, st.req, st.own, lease, podbook.AttachmentOf(rec, st.req.IfName, p.Spec.Name, st.req.ContainerID, rev))
	res, err := result(&p.Spec, rec.IPs)
	return res, true, err
}

// rebind moves an attachment's keys to a new container ID in one transaction that
// compares the owner index's revision and every address's lease. It returns the revision
// it wrote them at.
func (a *Agent) rebind(ctx context.Context, p *poolview.Pool, st *addState, kv *mvccpb.KeyValue, rec keyspace.OwnerRecord, lease clientv3.LeaseID) (int64, error) {
	now := a.wall()
	withLease := clientv3.WithLease(lease)
	cmps := []clientv3.Cmp{keyspace.Unchanged(string(kv.Key), kv.ModRevision)}
	var puts []clientv3.Op
	for _, addr := range rec.IPs {
		key := keyspace.IPKey(p.Spec.Name, p.Spec.Blocks, addr)
		cmps = append(cmps, keyspace.OnLease(key, lease))
		puts = append(puts, clientv3.OpPut(key, keyspace.Encode(a.allocation(st.req, st.owner, lease, rec.Created)), withLease))
	}
	newRec := rec
	newRec.ContainerID = st.req.ContainerID
	puts = append(puts,
		clientv3.OpPut(string(kv.Key), keyspace.Encode(newRec), withLease),
		clientv3.OpPut(keyspace.PodKey(a.cfg.Cluster, a.cfg.Node, st.owner), keyspace.Encode(a.podRecord(st.req, st.owner, lease, now)), withLease))
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	resp, err := a.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil {
		return 0, a.unavailable("re-bind attachment to the new container", err)
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("%w: attachment %s changed while it was re-bound to container %s; retry",
			allocator.ErrUnavailable, kv.Key, st.req.ContainerID)
	}
	a.log.Info("attachment re-bound to a new container of the same owner",
		"owner", st.owner, "ifname", st.req.IfName, "pool", p.Spec.Name, "old_container", rec.ContainerID, "container", st.req.ContainerID)
	return resp.Header.Revision, nil
}

// resumePod takes over the lease of a pod record this node identity wrote earlier.
func (a *Agent) resumePod(ctx context.Context, own *ownerlock.Owned, podKV *mvccpb.KeyValue) error {
	owner := own.Owner()
	rec, err := keyspace.Decode[keyspace.PodRecord](string(podKV.Key), podKV.Value)
	if err != nil {
		return err
	}
	lease := clientv3.LeaseID(podKV.Lease)
	if rec.NodeUID != a.cfg.NodeUID {
		return a.foreign(owner, string(podKV.Key), a.cfg.Node, rec.NodeUID, lease)
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	if a.hold.Pending() > 0 {
		// Since its start the agent knows every pod of its node: a record it does not know,
		// once etcd went back in time, is one the backup brought back of a pod deleted since.
		// Its keys go (what a restore brings back that is gone stays gone); a lease the agent
		// holds for another pod keeps its own keys, and only the record goes.
		var err error
		if a.keeper.Holds(lease) {
			_, err = a.cli.Txn(octx).If(keyspace.Unchanged(string(podKV.Key), podKV.ModRevision)).
				Then(clientv3.OpDelete(string(podKV.Key))).Commit()
		} else {
			err = a.keeper.Revoke(lease)
		}
		if err != nil {
			return a.unavailable("remove the record of a pod deleted before etcd went back in time", err)
		}
		a.log.Warn("a record of a pod deleted before etcd went back in time was brought back; removed",
			"owner", owner, "lease", keyspace.LeaseHex(lease))
		return nil
	}
	if err := a.keeper.Adopt(octx, lease); err != nil {
		return a.unavailable("resume the pod lease", err)
	}
	a.loops.ClaimedOn(ctx, allocator.Request{Pod: rec.Pod, Netns: rec.Netns}, own, lease)
	return nil
}

// foreign is the error for keys of this owner that another node identity holds: they are
// never adopted (the same-name replacement, docs/field-failures.md); they leave with their lease.
func (a *Agent) foreign(owner, key, node, uid string, lease clientv3.LeaseID) error {
	return fmt.Errorf("%w: owner %s already has %s, written by node %s with identity %s (this agent is %s); "+
		"leasehold never adopts another node identity's allocations: they expire with lease %s within %s; retry after that, "+
		"or release them with leaseholdctl",
		allocator.ErrUnavailable, owner, key, node, uid, a.cfg.NodeUID, keyspace.LeaseHex(lease), a.cfg.LeaseTTL)
}

func result(spec *allocator.PoolSpec, addrs []netip.Addr) (allocator.Result, error) {
	res := allocator.Result{IPs: make([]allocator.IPConfig, 0, len(addrs))}
	for _, addr := range addrs {
		c, err := spec.IPConfig(addr)
		if err != nil {
			return allocator.Result{}, err
		}
		res.IPs = append(res.IPs, c)
	}
	return res, nil
}

func (a *Agent) allocation(req allocator.Request, owner string, lease clientv3.LeaseID, now time.Time) keyspace.Allocation {
	return keyspace.Allocation{Owner: owner, Cluster: a.cfg.Cluster, Node: a.cfg.Node, NodeUID: a.cfg.NodeUID, Pod: req.Pod,
		ContainerID: req.ContainerID, IfName: req.IfName, Network: req.Network, LeaseID: keyspace.LeaseHex(lease), Created: now}
}

func (a *Agent) ownerRecord(req allocator.Request, addrs []netip.Addr, lease clientv3.LeaseID, now time.Time) keyspace.OwnerRecord {
	return keyspace.OwnerRecord{IPs: addrs, ContainerID: req.ContainerID, Network: req.Network, Node: a.cfg.Node,
		NodeUID: a.cfg.NodeUID, LeaseID: keyspace.LeaseHex(lease), Created: now}
}

func (a *Agent) podRecord(req allocator.Request, owner string, lease clientv3.LeaseID, now time.Time) keyspace.PodRecord {
	return keyspace.PodRecord{Owner: owner, Pod: req.Pod, NodeUID: a.cfg.NodeUID, LeaseID: keyspace.LeaseHex(lease), Netns: req.Netns,
		ContainerID: req.ContainerID, Created: now}
}
