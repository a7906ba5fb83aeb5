package reclaim

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/claimloop"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/txn"
)

// reclaim restores the keys of one pod whose lease was lost while its sandbox still runs:
// with create-if-absent on a fresh lease, attachment by attachment. An address another owner
// took meanwhile is a conflict: logged at error level, counted, recorded under
// /leasehold/v1/conflicts/, and reported by CHECK. It is never taken back.
func (r *Reclaimer) reclaim(ctx context.Context, owner string) error {
	own := r.cfg.Locks.Lock(owner)
	defer own.Unlock()
	snap, ok := r.cfg.Pods.LostPod(owner)
	if !ok {
		return nil
	}
	if SandboxGone(snap.Netns) {
		r.cfg.Log.Info("sandbox of a lost pod is gone; nothing to re-claim", "owner", owner)
		r.cfg.Pods.Change(own).Drop()
		return nil
	}
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	// The client gives up on a lease after one TTL without an answer; etcd may not have
	// expired it yet. Then the old lease is simply resumed.
	if id := snap.Lease(); id != 0 {
		ttl, err := r.cfg.Client.TimeToLive(octx, id)
		if err != nil {
			return r.unavailable("look up the lost lease", err)
		}
		if ttl.TTL > 0 {
			if err := r.cfg.Keeper.Resume(id); err != nil {
				return err
			}
			r.cfg.Pods.Change(own).Resumed(id)
			r.cfg.Log.Warn("lost pod lease was still alive in etcd; resumed", "owner", owner, "lease", keyspace.LeaseHex(id))
			return nil
		}
	}
	if !slices.ContainsFunc(snap.Attachments, func(at podbook.Attachment) bool { return !at.Released }) {
		// Every attachment's DEL was answered meanwhile: nothing to re-claim, and nothing in
		// etcd to release (the lease is gone). Its held keys are freed by settleHeld.
		r.cfg.Log.Info("every attachment of a lost pod was deleted meanwhile; nothing to re-claim", "owner", owner)
		for _, at := range snap.Attachments {
			r.cfg.ReportTakenAtDel(octx, owner, at) // another pod may have had its addresses meanwhile
		}
		r.cfg.Pods.Change(own).Drop()
		return nil
	}
	defer r.cfg.Keeper.Refill()
	lease, err := r.cfg.Keeper.Take(octx)
	if err != nil {
		return r.unavailable("grant a lease for re-claim", err)
	}
	req := allocator.Request{Pod: snap.Pod, Netns: snap.Netns}
	wrote := false // an attachment's keys may be on lease
	for i, at := range snap.Attachments {
		if at.Released {
			continue // its release is pending (releasePending): never re-claimed
		}
		rev, taken, err := r.reclaimAttachment(octx, own, snap, &snap.Attachments[i], lease)
		if err != nil {
			if !wrote && !errors.Is(err, allocator.ErrUnavailable) {
				r.cfg.Keeper.Return(lease) // etcd answered and nothing is on it
			} else {
				// An earlier attachment is on it, or this one may be (a claim whose answer was
				// lost can still apply): the lease must go, keys and all, and never become
				// another pod's spare. The next attempt re-claims on a new lease, once the
				// keys of this one are gone (reclaimAttachment).
				if rerr := r.cfg.Keeper.Revoke(lease); rerr != nil {
					r.cfg.Log.Warn("revoking the lease of an incomplete re-claim failed; it expires within its TTL",
						"owner", owner, "lease", keyspace.LeaseHex(lease), "err", rerr)
				}
			}
			return err
		}
		snap.Attachments[i].OwnerRev, snap.Attachments[i].Conflicts = rev, taken
		wrote = true
	}
	pr := keyspace.PodRecord{Owner: owner, Pod: snap.Pod, NodeUID: r.cfg.NodeUID, LeaseID: keyspace.LeaseHex(lease), Netns: snap.Netns, Created: r.wall()}
	if len(snap.Attachments) > 0 {
		pr.ContainerID = snap.Attachments[0].ContainerID
	}
	if _, err := r.cfg.Client.Put(octx, keyspace.PodKey(r.cfg.Cluster, r.cfg.Node, owner), keyspace.Encode(pr), clientv3.WithLease(lease)); err != nil {
		// The attachments are on the lease, which no pod of the agent names: held, it would
		// be renewed for good with them (and with whatever a restore put back on a spare).
		// The next attempt re-claims on a new lease once these keys are gone.
		if rerr := r.cfg.Keeper.Revoke(lease); rerr != nil {
			r.cfg.Log.Warn("revoking the lease of an incomplete re-claim failed; it expires within its TTL",
				"owner", owner, "lease", keyspace.LeaseHex(lease), "err", rerr)
		}
		return r.unavailable("write the pod record", err)
	}
	r.cfg.Loops.ClaimedOn(ctx, req, own, lease, snap.Attachments...)
	r.cfg.Reclaims.Inc()
	r.cfg.Log.Warn("pod re-claimed after its lease was lost", "owner", owner, "lease", keyspace.LeaseHex(lease), "attachments", len(snap.Attachments))
	return r.cfg.KeepClaimsOf(ctx, own) // on the claim lease, which a restore may have taken too
}

// reclaimAttachment writes one attachment's keys on lease and returns the owner index's
// ModRevision, so that its DEL needs no read first, and the addresses another owner took
// meanwhile: they are left to that owner, recorded in the attachment's conflict record, and
// taken back when that owner lets them go (Config.WatchConflicts).
//
// A live migration's target (at.Target) takes its migration up again instead
// (Config.ReclaimTarget), or the claim if its source is gone meanwhile (at.Target is then
// cleared): the claim's addresses are its source's, not taken from it.
func (r *Reclaimer) reclaimAttachment(ctx context.Context, own *ownerlock.Owned, ps podbook.PodState, pat *podbook.Attachment, lease clientv3.LeaseID) (int64, []netip.Addr, error) {
	at := *pat
	req := allocator.Request{Pod: ps.Pod, ContainerID: at.ContainerID, IfName: at.IfName, Network: at.Network}
	p, err := r.cfg.Pools.Ensure(ctx, allocator.PoolSpec{Name: at.Pool})
	if err != nil {
		return 0, nil, err
	}
	if at.Target {
		rev, claimLease, promoted, ok, err := r.cfg.ReclaimTarget(ctx, ps, at, lease, p.Spec.Blocks)
		if err != nil {
			return 0, nil, err
		}
		if ok {
			pat.Target, pat.ClaimLease = !promoted, claimLease
			if promoted {
				pat.Source = ""
			}
			return rev, []netip.Addr{}, nil
		}
		pat.Target, pat.Source = false, "" // re-claimed as any pod: the addresses its source holds are conflicts
	}
	heldLease, held, err := r.cfg.HeldFor(ctx, ps.Owner)
	if err != nil {
		return 0, nil, err
	}
	c := &txn.Claim{Lease: lease, Pool: at.Pool, Blocks: p.Spec.Blocks, AlsoFlat: p.Migrating != nil, Addrs: slices.Clone(at.IPs),
		HeldLease: heldLease, Held: held,
		OwnerKey:    keyspace.OwnerKey(r.cfg.Cluster, ps.Owner, at.IfName, at.Pool),
		Alloc:       r.cfg.Allocation(req, ps.Owner, lease, at.Created),
		Index:       podbook.OwnerIndexOf(at, r.cfg.Node, r.cfg.NodeUID, lease),
		ConflictKey: keyspace.ConflictKey(r.cfg.Cluster, ps.Owner, at.IfName, at.Pool),
		WantCluster: r.cfg.Cluster, WantOwner: ps.Owner}
	taken, holds, unheld, err := r.heldByOthers(ctx, c)
	if err != nil {
		return 0, nil, err
	}
	r.cfg.NoteRestoredHolds(ps.Owner, at, holds)
	// The re-claim's lease is the owner's new one, never a spare; any refusal and a lost
	// answer are its answer: reclaimAll tries again.
	claims := r.cfg.Loops.For(own, req, claimloop.Policy{What: "re-claim " + c.OwnerKey,
		Refused: func(err error) error { return r.unavailable("re-claim "+c.OwnerKey, err) }})
	for range 5 {
		if len(taken) > 0 {
			c.Conflict = &keyspace.ConflictRecord{ContainerID: at.ContainerID, Node: r.cfg.Node, NodeUID: r.cfg.NodeUID,
				Taken: taken, Detected: r.wall()}
		}
		out, again, err := claims.Commit(ctx, c, func() (txn.ClaimOutcome, error) { return c.Commit(ctx, r.cfg.Client) })
		if err != nil {
			return 0, nil, err
		}
		if again {
			if c.HeldLease, _, err = r.cfg.HeldFor(ctx, ps.Owner); err != nil {
				return 0, nil, err
			}
			continue
		}
		if out.Applied {
			// What the re-claim found taken is the attachment's conflicts now: none is an
			// empty list, not nil, which the pod book's PodState.put reads as "not known" and so keeps the
			// old ones (a crash right after a resolution leaves them in the journal).
			lost := []netip.Addr{}
			if len(taken) > 0 {
				r.cfg.ConflictsFound(int64(len(taken)))
				r.cfg.Log.Error("CONFLICT: addresses of a running pod were taken by another owner while its lease was lost",
					"owner", ps.Owner, "ifname", at.IfName, "pool", at.Pool, "taken", taken, "record", c.ConflictKey)
				for _, t := range taken {
					lost = append(lost, t.IP)
				}
				r.heldBefore(ps.Owner, at, c, taken, out.Revision)
			}
			r.usedMeanwhile(ctx, ps.Owner, at, c, unheld, out.Revision)
			return out.Revision, lost, nil
		}
		if kv := out.Existing; kv != nil {
			rec, _ := keyspace.Decode[keyspace.OwnerRecord](c.OwnerKey, kv.Value)
			if rec.NodeUID == r.cfg.NodeUID && rec.ContainerID == at.ContainerID {
				if keyspace.HeldOn(kv, lease) {
					return kv.ModRevision, nil, nil // already re-claimed
				}
				// Written by an earlier attempt whose lease is being revoked or expires: the
				// attachment must end up on this attempt's lease, so wait for those keys to go.
				return 0, nil, fmt.Errorf("%w: re-claim %s: the owner index is still on lease %s of an earlier attempt",
					allocator.ErrUnavailable, c.OwnerKey, keyspace.LeaseHex(keyspace.LeaseOf(kv)))
			}
			return 0, nil, fmt.Errorf("%w: re-claim %s: the owner index now belongs to node identity %s container %s",
				allocator.ErrConflict, c.OwnerKey, rec.NodeUID, rec.ContainerID)
		}
		var still []netip.Addr
		var copies []*mvccpb.KeyValue
		for _, f := range out.Addrs {
			if f.Holder == nil {
				still = append(still, f.Addr)
				continue
			}
			holder, _ := keyspace.Decode[keyspace.Allocation](string(f.Holder.Key), f.Holder.Value)
			if holder.Owner == ps.Owner && holder.Cluster == r.cfg.Cluster && holder.NodeUID == r.cfg.NodeUID {
				// The pod's own value on another lease, or none (an etcdctl put of it, or a
				// restore's): the address is this pod's. The copy goes, the claim writes it anew.
				still, copies = append(still, f.Addr), append(copies, f.Holder)
				continue
			}
			taken = append(taken, keyspace.TakenByOther{IP: f.Addr, Holder: holder.Owner, Cluster: holder.Cluster,
				Node: holder.Node, ContainerID: holder.ContainerID})
		}
		if err := r.cfg.DropCopies(ctx, copies); err != nil {
			return 0, nil, err
		}
		c.Addrs = still
	}
	return 0, nil, fmt.Errorf("%w: re-claim %s: its keys kept changing", allocator.ErrUnavailable, c.OwnerKey)
}

// releasePending releases owner's attachments whose DEL was answered while etcd could not be
// reached (deferRelease), and gives the pod's lease up with the last.
func (r *Reclaimer) releasePending(ctx context.Context, owner string) error {
	own := r.cfg.Locks.Lock(owner)
	defer own.Unlock()
	var errs []error
	for _, at := range r.cfg.Pods.ReleasedAttachments(owner) {
		req := allocator.Request{Pool: allocator.PoolSpec{Name: at.Pool}, Network: at.Network, IfName: at.IfName, ContainerID: at.ContainerID}
		left, err := r.cfg.ReleaseAttachment(ctx, req, own)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		// Released, or nothing of it was left in etcd: either way it is done. Nothing left (and
		// not taken by forgetLost, which reports as below): its keys expired while etcd was
		// away, and another pod may have had its addresses meanwhile.
		if r.cfg.Pods.Change(own).ForgetAttachment(at.IfName, at.Pool, at.ContainerID) && left < 0 {
			r.cfg.ReportTakenAtDel(ctx, owner, at)
		}
		r.cfg.Log.Info("release recorded while etcd was away done", "owner", owner, "container", at.ContainerID,
			"ifname", at.IfName, "pool", at.Pool)
		if err := r.cfg.DropPodIfEmpty(ctx, own, left); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
