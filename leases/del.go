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
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/txn"
)

// Del releases one attachment's addresses. It deletes only keys this attachment holds: the
// owner index must still name the request's container ID (a DEL replayed after the address
// went to someone else releases nothing), and each address must still be on the owner's
// lease. Released addresses go to quarantine in the same transaction, which also counts the
// owner's attachments left and, with the last one, deletes the pod record; then the pod lease
// is given up (dropPodIfEmpty). Releasing nothing is not an error. A request naming a pod
// UID reaches an attachment this agent keeps under its container ID, as an import from
// host-local does (attachmentOwner): the container ID is part of that owner key.
//
// A DEL answered is final: it is answered only once the journal no longer lists the
// attachment (or lists it as released), so that neither a restart nor a re-claim brings it
// back; a re-claim of the same pod waits for the DEL (the owner lock) and finds nothing to
// re-claim. When etcd cannot be reached the DEL is recorded as such, answered, and the
// release done once etcd answers (releasePending): a runtime's DEL never waits on an etcd
// outage, and is never lost.
//
// Errors wrap allocator.ErrInvalidName or ErrUnavailable.
func (a *Agent) Del(ctx context.Context, req allocator.Request) (err error) {
	defer a.metrics.observe("del", time.Now(), &err)
	owner, err := a.validate(&req)
	if err != nil {
		return err
	}
	owner = a.attachmentOwner(req, owner) // an imported attachment is kept under its container ID
	own := a.locks.Lock(owner)
	defer own.Unlock()
	req.Pool = a.attachedPool(owner, req)
	if err := a.imports.conflictDeleted(req); err != nil {
		return err
	}
	if err := a.reachable(ctx); err != nil {
		return a.deferRelease(ctx, req, own, err)
	}
	left, err := a.releaseAttachment(ctx, req, own)
	if err == nil {
		err = a.dropPodIfEmpty(ctx, own, left)
	}
	if err != nil {
		if errors.Is(err, allocator.ErrUnavailable) && a.reachable(ctx) != nil {
			return a.deferRelease(ctx, req, own, err)
		}
		return err
	}
	a.cwatch.stop(owner)
	return a.durable(ctx, "DEL", owner)
}

// durable waits until the journal holds what an operation on owner changed, so that its
// answer survives a crash right after it (podbook.Writer.Sync).
func (a *Agent) durable(ctx context.Context, op, owner string) error {
	if err := a.jw.Sync(ctx); err != nil {
		return fmt.Errorf("%w: %s of %s is done in etcd, but the agent's journal in %s cannot record it, and a restart "+
			"could undo it: %w; free the state directory's disk, then retry", allocator.ErrUnavailable, op, owner, a.cfg.StateDir, err)
	}
	return nil
}

// deferRelease answers a DEL that etcd could not take (cause): the attachment is recorded as
// released in the journal, never re-claimed, and released in etcd once etcd answers.
func (a *Agent) deferRelease(ctx context.Context, req allocator.Request, own *ownerlock.Owned, cause error) error {
	owner := own.Owner()
	a.pods.Change(own).MarkReleased(req.IfName, req.Pool.Name, req.ContainerID, time.Now())
	if err := a.durable(ctx, "DEL", owner); err != nil {
		return err
	}
	a.metrics.releasesDeferred.Inc()
	a.log.Warn("etcd cannot be reached: the DEL is recorded and answered; its addresses are released once etcd answers",
		"owner", owner, "container", req.ContainerID, "ifname", req.IfName, "pool", req.Pool.Name, "cause", cause)
	a.recovery.wake()
	return nil
}

// releaseAttachment deletes the request's attachment and returns the owner's attachments left, or -1
// when it released nothing and so did not count them.
func (a *Agent) releaseAttachment(ctx context.Context, req allocator.Request, own *ownerlock.Owned) (int64, error) {
	owner := own.Owner()
	ownerKey := keyspace.OwnerKey(a.cfg.Cluster, owner, req.IfName, req.Pool.Name)
	if at, lease, ok := a.pods.Attachment(owner, req.IfName, req.Pool.Name); ok && at.OwnerRev > 0 && at.ContainerID == req.ContainerID {
		// The agent wrote this attachment (or read it) at OwnerRev: release it without reading
		// it first. The transaction compares that revision, so an owner index changed since
		// (re-claimed, released by an admin) fails it, and DEL reads what is there instead.
		kv := &mvccpb.KeyValue{Key: []byte(ownerKey), ModRevision: at.OwnerRev, Lease: int64(lease)}
		rec := keyspace.OwnerRecord{IPs: at.IPs, ContainerID: at.ContainerID, Claim: at.Claim,
			ClaimHoldSeconds: int64(at.ClaimHold / time.Second)}
		if at.ClaimLease != 0 {
			rec.ClaimLease = keyspace.LeaseHex(at.ClaimLease)
		}
		left, err := a.releaseRecord(ctx, req.Pool.Name, own, kv, rec, true)
		if !errors.Is(err, errStale) {
			return left, err
		}
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	resp, err := a.cli.Get(octx, ownerKey)
	if err != nil {
		return -1, a.unavailable("read owner index "+ownerKey, err)
	}
	if len(resp.Kvs) == 0 {
		if lease, held := a.pods.Lease(owner); held && a.pods.Lists(owner, req.IfName, req.Pool.Name, req.ContainerID) {
			// The agent holds the attachment, etcd has no key of it: its lease expired before
			// the keeper noticed, or etcd went back to before the keys were written. The pod's
			// other attachments are re-claimed, this one is not.
			a.keysGone(lease)
		}
		if a.forgetLost(ctx, own, req) {
			return -1, nil
		}
		a.log.Debug("DEL of an attachment without addresses", "owner", owner, "ifname", req.IfName, "pool", req.Pool.Name)
		return -1, nil
	}
	kv := resp.Kvs[0]
	rec, err := keyspace.Decode[keyspace.OwnerRecord](ownerKey, kv.Value)
	if err != nil {
		return -1, err
	}
	if rec.NodeUID != a.cfg.NodeUID {
		a.log.Warn("DEL for an attachment made by another node identity; nothing released, it expires with its lease",
			"owner", owner, "ifname", req.IfName, "pool", req.Pool.Name, "container", req.ContainerID, "holder_node_uid", rec.NodeUID)
		return -1, nil
	}
	if rec.ContainerID != req.ContainerID {
		a.forgetLost(ctx, own, req)
		a.log.Info("DEL for a container that no longer holds the attachment; nothing released",
			"owner", owner, "ifname", req.IfName, "pool", req.Pool.Name, "container", req.ContainerID, "holder", rec.ContainerID)
		return -1, nil
	}
	return a.releaseRecord(ctx, req.Pool.Name, own, kv, rec, false)
}

// forgetLost drops the request's attachment from a pod whose lease was lost, when etcd holds
// nothing of it to release (its keys expired): it must never be re-claimed now that its DEL
// is answered. Its held keys are freed by the next settleHeld. It reports whether there was
// such an attachment.
func (a *Agent) forgetLost(ctx context.Context, own *ownerlock.Owned, req allocator.Request) bool {
	owner := own.Owner()
	if _, held := a.pods.Lease(owner); held {
		return false
	}
	at, ok := a.pods.LostAttachment(owner, req.IfName, req.Pool.Name, req.ContainerID)
	if !ok || !a.pods.Change(own).ForgetAttachment(req.IfName, req.Pool.Name, req.ContainerID) {
		return false
	}
	a.metrics.reclaimsCancelled.Inc()
	a.log.Info("DEL of a pod whose lease was lost: its keys are gone, and it is not re-claimed",
		"owner", owner, "container", req.ContainerID, "ifname", req.IfName, "pool", req.Pool.Name)
	a.reportTakenAtDel(ctx, owner, at)
	a.recovery.wake()
	return true
}

// reportTakenAtDel logs, as a conflict, the addresses of a deleted attachment that another
// owner held since the attachment was last written (etcd's history): its lease was lost, and another pod got them while this one still
// ran (the window ARCHITECTURE.md names). The DEL ends the overlap; the record says it
// happened. It runs in the background: reading a history takes a second, which neither the
// DEL nor the recovery of the node's other pods waits for.
// Only owners that had an address before the DEL count: the history is read up to the
// revision of this call (after it, a conflict resolution or this node's next pods may take
// the address), and of those, for a DEL answered while etcd was away, only allocations
// created before its answer.
func (a *Agent) reportTakenAtDel(ctx context.Context, owner string, at attachment) {
	if len(at.IPs) == 0 || at.OwnerRev <= 0 || a.ctx.Err() != nil {
		return
	}
	if at.ReleasedAt.IsZero() {
		at.ReleasedAt = time.Now()
	}
	octx, cancel := a.opCtx(ctx)
	resp, err := a.cli.Get(octx, keyspace.PoolKey(at.Pool), clientv3.WithKeysOnly())
	cancel()
	if err != nil {
		return
	}
	upTo := resp.Header.Revision + 1
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		a.takenAtDel(a.ctx, owner, at, upTo)
	}()
}

func (a *Agent) takenAtDel(ctx context.Context, owner string, at attachment, upTo int64) {
	blocks, err := a.pools.BlocksOf(ctx, at.Pool)
	if err != nil {
		return
	}
	var taken []keyspace.TakenByOther
	for _, ip := range at.IPs {
		key := keyspace.IPKey(at.Pool, blocks, ip)
		others, known := a.recovery.othersSince(ctx, owner, key, ip, at.OwnerRev, upTo, at.ReleasedAt)
		if !known {
			// A compaction (or a restore marked compacted) took the history, not the key: one
			// that holds the address now and got it before the release had it while this pod ran.
			others = a.holderBefore(ctx, owner, key, ip, at.ReleasedAt)
			a.log.Warn("a pod whose lease was lost is deleted, and etcd's history no longer tells whether another pod had "+
				"its address meanwhile", "owner", owner, "ip", ip, "pool", at.Pool, "holder_now", len(others) > 0)
		}
		taken = append(taken, others...)
	}
	if len(taken) == 0 {
		return
	}
	a.conflicts.Add(int64(len(taken)))
	a.log.Error("CONFLICT: addresses of a pod were taken by another owner while its lease was lost; found at its DEL",
		"owner", owner, "ifname", at.IfName, "pool", at.Pool, "taken", taken)
}

// holderBefore reads the allocation key of ip as it is now: another owner holding it that
// got it before the time before (its allocation's Created) held it at that time. A failed
// read reports nobody: a miss costs a conflict not logged, never an address.
func (a *Agent) holderBefore(ctx context.Context, owner, key string, ip netip.Addr, before time.Time) []keyspace.TakenByOther {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	resp, err := a.cli.Get(octx, key)
	if err != nil || len(resp.Kvs) == 0 {
		return nil
	}
	holder, err := keyspace.Decode[keyspace.Allocation](key, resp.Kvs[0].Value)
	if err != nil || holder.Owner == owner || !holder.Created.Before(before) {
		return nil
	}
	return []keyspace.TakenByOther{{IP: ip, Holder: holder.Owner, Cluster: holder.Cluster, Node: holder.Node, ContainerID: holder.ContainerID}}
}

// errStale is releaseRecord's answer when the owner index it was given from the agent's
// memory is no longer the one in etcd.
var errStale = errors.New("owner index changed since the agent last saw it")

// releaseRecord deletes an attachment read at kv, keeping any address that is no longer on
// the attachment's lease (written by hand or by a later owner), and quarantines the rest. It
// returns the owner's attachments left, counted in the same transaction (after its deletes),
// or -1 when it released nothing. kv and rec come from the agent's memory when remembered is
// set; an owner index that changed since is then errStale, not "released by someone else".
func (a *Agent) releaseRecord(ctx context.Context, pool string, own *ownerlock.Owned, kv *mvccpb.KeyValue, rec keyspace.OwnerRecord, remembered bool) (int64, error) {
	owner := own.Owner()
	blocks, err := a.pools.BlocksOf(ctx, pool)
	if err != nil {
		return -1, err
	}
	r := &txn.Release{Pool: pool, Blocks: blocks, OwnerKey: string(kv.Key), OwnerRev: kv.ModRevision, Lease: keyspace.LeaseOf(kv),
		Addrs: rec.IPs, OwnerPrefix: keyspace.OwnerPrefix(a.cfg.Cluster, owner),
		PodKey: keyspace.PodKey(a.cfg.Cluster, a.cfg.Node, owner)}
	if _, _, ifName, _, err := keyspace.ParseOwnerKey(r.OwnerKey); err == nil {
		r.ConflictKey = keyspace.ConflictKey(a.cfg.Cluster, owner, ifName, pool)
		for _, ip := range rec.IPs {
			r.Wanted = append(r.Wanted, keyspace.WantedKey(pool, blocks, ip, a.cfg.Cluster, owner))
		}
	}
	quarantine := a.cfg.Quarantine >= 0
	outOfSpace := false // etcd's NOSPACE alarm: no puts, so no claim kept either
	var claimLease clientv3.LeaseID
	if rec.Claim != "" {
		claimLease, _ = keyspace.ParseLeaseHex(rec.ClaimLease)
		r.ClaimLease = claimLease
	}
	for attempt := 0; attempt < 3; attempt++ {
		octx, cancel := a.opCtx(ctx)
		var until time.Time
		r.QLease, r.HoldLease = 0, 0
		if rec.Claim != "" && !outOfSpace && len(r.Addrs) > 0 {
			// The claim and its addresses' quarantine keys outlive the release by the hold.
			at := attachment{Claim: rec.Claim, IPs: r.Addrs, ClaimHold: time.Duration(rec.ClaimHoldSeconds) * time.Second}
			key, crec, lease, err := a.sticky.releaseSticky(octx, pool, owner, at)
			if err != nil {
				cancel()
				return -1, err
			}
			until = time.Now().Add(time.Duration(crec.HoldSeconds) * time.Second).UTC()
			r.ClaimKey, r.ClaimRec, r.HoldLease = key, crec, lease
			r.ClaimQ = keyspace.QuarantineRecord{ReleasedBy: owner, Until: until, Claim: rec.Claim}
		}
		if quarantine && len(r.Addrs) > 0 {
			lease, u, err := a.keeper.QuarantineLease(octx, a.cfg.Quarantine)
			switch {
			case txn.NoSpace(err):
				quarantine, outOfSpace = false, true
				a.withoutQuarantine(r, owner, err)
			case err != nil:
				cancel()
				return -1, a.unavailable("quarantine released addresses", err)
			default:
				if until.IsZero() {
					until = u.UTC()
				}
				r.QLease, r.QRecord = lease, keyspace.QuarantineRecord{ReleasedBy: owner, Until: u.UTC()}
			}
		}
		start := time.Now()
		out, err := r.Commit(octx, a.cli)
		a.metrics.rtt("release", start)
		cancel()
		if txn.NoSpace(err) && (r.QLease != 0 || r.HoldLease != 0) {
			// The quarantine keys are the release's only puts, and etcd takes no put under
			// its NOSPACE alarm: release without them, or the pod could never be deleted.
			quarantine, outOfSpace = false, true
			a.withoutQuarantine(r, owner, err)
			attempt--
			continue
		}
		if err != nil {
			return -1, a.unavailable("release "+r.OwnerKey, err)
		}
		switch {
		case out.Applied:
			if _, _, ifName, _, err := keyspace.ParseOwnerKey(r.OwnerKey); err == nil {
				a.pods.Change(own).DropAttachment(ifName, pool)
			}
			if v := a.pools.ViewOf(pool); v != nil {
				v.Released(r.Addrs, out.Revision, until)
			}
			if out.ClaimKept {
				a.sticky.released(r.ClaimKey, pool, rec.Claim, r.ClaimRec, r.ClaimQ,
					a.sticky.claimReleaseTTL(attachment{ClaimHold: time.Duration(rec.ClaimHoldSeconds) * time.Second}))
			}
			if claimLease != 0 {
				// The claim moved onto the release's lease: its old one carries nothing now.
				if err := a.keeper.Revoke(claimLease); err != nil {
					a.log.Warn("revoking a released claim's lease failed; it expires by itself", "lease", keyspace.LeaseHex(claimLease), "err", err)
				}
			}
			a.log.Debug("released", "owner", owner, "pool", pool, "ips", r.Addrs)
			return out.Left, nil
		case out.IndexChanged && remembered:
			return -1, errStale
		case out.IndexChanged:
			return -1, nil // the owner index changed or went away meanwhile: not ours to release any more
		}
		for _, addr := range r.Addrs {
			if !slices.Contains(out.OnLease, addr) {
				a.log.Warn("address of the attachment is not on its lease; leaving it alone",
					"owner", owner, "pool", pool, "ip", addr, "lease", keyspace.LeaseHex(r.Lease))
			}
		}
		r.Addrs = out.OnLease
	}
	return -1, fmt.Errorf("%w: release %s: its keys kept changing; retry", allocator.ErrUnavailable, kv.Key)
}

// withoutQuarantine records that r's addresses go back without quarantine: etcd is out of
// space, takes no put and no lease grant, and a DEL that waited for it would block the very
// pod deletions an operator makes to free space.
func (a *Agent) withoutQuarantine(r *txn.Release, owner string, err error) {
	a.metrics.unquarantined.Inc()
	a.metrics.noSpace.Inc()
	a.log.Warn("etcd is out of space (NOSPACE alarm): releasing without quarantine; the addresses may be handed out again at once",
		"owner", owner, "pool", r.Pool, "ips", r.Addrs, "err", err)
}

// dropPodIfEmpty gives up the owner's pod lease once the owner has no attachment left in this
// cluster: the keeper takes it back as a spare if no key is left on it (the release
// transaction deleted the pod record with the last attachment), else revokes it, deleting
// what is left. left is the count of the owner's attachments that the release transaction
// read, or -1 when none did; then they are counted here.
func (a *Agent) dropPodIfEmpty(ctx context.Context, own *ownerlock.Owned, left int64) error {
	owner := own.Owner()
	lease, ok := a.pods.Lease(owner)
	if !ok {
		// A pod whose lease was lost: with its last attachment released it has nothing
		// left to re-claim.
		if ps, known := a.pods.Snapshot(owner); known && len(ps.Attachments) == 0 {
			a.pods.Change(own).Drop()
		}
		return nil
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	if left < 0 {
		resp, err := a.cli.Get(octx, keyspace.OwnerPrefix(a.cfg.Cluster, owner), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return a.unavailable("count the owner's attachments", err)
		}
		left = resp.Count
	}
	if left > 0 {
		return nil
	}
	if ps, _ := a.pods.Snapshot(owner); len(ps.Attachments) > 0 {
		// etcd holds no attachment of the pod, the agent still knows some: their keys went
		// with the lease, which expired before the keeper noticed (or with a restore). They
		// are re-claimed.
		a.keysGone(lease)
		a.recovery.wake()
		return nil
	}
	recycled := false
	var err error
	if !a.pods.MayRecycle(owner) {
		err = a.keeper.Revoke(lease)
	} else {
		recycled, err = a.keeper.Recycle(octx, lease)
	}
	if err != nil {
		return a.unavailable("revoke the pod lease", err)
	}
	a.pods.Change(own).Drop()
	a.log.Debug("pod lease given up", "owner", owner, "lease", keyspace.LeaseHex(lease), "recycled", recycled)
	return nil
}

// keysGone is the finding that etcd holds no key of a pod on lease, which the keeper still
// renews: the lease expired before the keeper noticed, or etcd went back to before the keys
// were written. The pod is re-claimed on a new lease, and this one is revoked: alive again
// after a restore, it carries what the backup had on it (a deleted pod's keys, when it was
// that pod's and then a spare), which renewed would stay for ever.
func (a *Agent) keysGone(lease clientv3.LeaseID) {
	if err := a.keeper.Revoke(lease); err != nil {
		a.log.Debug("revoking the lease of a pod whose keys are gone failed; it expires by itself",
			"lease", keyspace.LeaseHex(lease), "err", err)
	}
	a.pods.Lose(lease)
}

// GC releases every attachment of the request's network that this node identity made and
// the runtime no longer lists in ValidAttachments (CNI 1.1 GC). Attachments younger than the
// GC grace are kept, so an ADD that finished after the runtime built its list is not undone.
// It keeps going when one release fails and returns all failures joined.
func (a *Agent) GC(ctx context.Context, req allocator.GCRequest) (err error) {
	defer a.metrics.observe("gc", time.Now(), &err)
	if err := a.Err(); err != nil {
		return fmt.Errorf("%w: the agent has stopped: %w", allocator.ErrUnavailable, err)
	}
	if req.Pool.Name == "" {
		req.Pool.Name = req.Network
	}
	if err := allocator.ValidateName("pool", req.Pool.Name); err != nil {
		return err
	}
	valid := make(map[allocator.Attachment]bool, len(req.ValidAttachments))
	for _, at := range req.ValidAttachments {
		valid[at] = true
	}
	octx, cancel := a.opCtx(ctx)
	pods, err := a.cli.Get(octx, keyspace.PodsPrefix(a.cfg.Cluster, a.cfg.Node), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return a.unavailable("list this node's pods", err)
	}
	var errs []error
	for _, pkv := range pods.Kvs {
		prec, err := keyspace.Decode[keyspace.PodRecord](string(pkv.Key), pkv.Value)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if prec.NodeUID != a.cfg.NodeUID {
			continue // another identity's pod: it expires with its lease, never collected here
		}
		if err := a.gcOwner(ctx, req, prec.Owner, valid); err != nil {
			errs = append(errs, err)
		}
	}
	// What GC released must stay released across a crash right after its answer.
	errs = append(errs, a.durable(ctx, "GC", req.Network))
	return errors.Join(errs...)
}

func (a *Agent) gcOwner(ctx context.Context, req allocator.GCRequest, owner string, valid map[allocator.Attachment]bool) error {
	own := a.locks.Lock(owner)
	defer own.Unlock()
	young := a.addedWithinGrace(owner)
	return a.releaseWhere(ctx, own, func(ifName, pool string, rec keyspace.OwnerRecord) bool {
		// The network's attachments in any pool: selection may have put one outside the
		// configuration's pool.
		collect := rec.Network == req.Network && !young(rec) &&
			!valid[allocator.Attachment{ContainerID: rec.ContainerID, IfName: ifName}]
		if collect {
			a.log.Info("GC releases an attachment the runtime no longer lists",
				"owner", owner, "container", rec.ContainerID, "ifname", ifName, "pool", pool, "ips", rec.IPs)
		}
		return collect
	})
}

// addedWithinGrace tells whether an attachment of owner may be younger than the GC grace.
// Ages are read on the monotonic clock, from this agent's own ADDs, so a stepped wall clock
// neither collects a fresh attachment nor protects an old one for long. Only in the first
// grace after the agent started can an attachment come from the previous process; for those
// the record's wall-clock creation time is all there is, and a time in the future (a clock
// stepped back) counts as young. The caller holds the owner lock.
func (a *Agent) addedWithinGrace(owner string) func(keyspace.OwnerRecord) bool {
	grace := a.cfg.GCGrace
	if grace <= 0 {
		return func(keyspace.OwnerRecord) bool { return false }
	}
	recent := a.pods.AddedWithin(owner, grace)
	fresh := time.Since(a.started) < grace
	now := a.wall()
	return func(rec keyspace.OwnerRecord) bool {
		return recent || fresh && now.Sub(rec.Created) < grace
	}
}

// releaseWhere releases each attachment of owner made by this node identity for which
// pick says so, then revokes the owner's lease if nothing is left. It keeps going when one
// release fails and joins the errors.
func (a *Agent) releaseWhere(ctx context.Context, own *ownerlock.Owned, pick func(ifName, pool string, rec keyspace.OwnerRecord) bool) error {
	owner := own.Owner()
	octx, cancel := a.opCtx(ctx)
	resp, err := a.cli.Get(octx, keyspace.OwnerPrefix(a.cfg.Cluster, owner), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return a.unavailable("list attachments of "+owner, err)
	}
	var errs []error
	for _, kv := range resp.Kvs {
		_, _, ifName, pool, err := keyspace.ParseOwnerKey(string(kv.Key))
		if err != nil {
			continue
		}
		rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if rec.NodeUID != a.cfg.NodeUID || !pick(ifName, pool, rec) {
			continue
		}
		if _, err := a.releaseRecord(ctx, pool, own, kv, rec, false); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		// Counted anew: an attachment this walk did not release may have changed meanwhile.
		errs = append(errs, a.dropPodIfEmpty(ctx, own, -1))
	}
	return errors.Join(errs...)
}
