package release

import (
	"context"
	"errors"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
)

// Del releases one attachment's addresses. It deletes only keys this attachment holds: the
// owner index must still name the request's container ID (a DEL replayed after the address
// went to someone else releases nothing), and each address must still be on the owner's
// lease. Released addresses go to quarantine in the same transaction, which also counts the
// owner's attachments left and, with the last one, deletes the pod record; then the pod lease
// is given up (DropPodIfEmpty). Releasing nothing is not an error. A request naming a pod
// UID reaches an attachment this agent keeps under its container ID, as an import from
// host-local does (AttachmentOwner): the container ID is part of that owner key.
//
// A DEL answered is final: it is answered only once the journal no longer lists the
// attachment (or lists it as released), so that neither a restart nor a re-claim brings it
// back; a re-claim of the same pod waits for the DEL (the owner lock) and finds nothing to
// re-claim. When etcd cannot be reached the DEL is recorded as such, answered, and the
// release done once etcd answers (the recovery's releasePending): a runtime's DEL never waits on an etcd
// outage, and is never lost.
//
// Errors wrap allocator.ErrInvalidName or ErrUnavailable.
func (r *Releaser) Del(ctx context.Context, req allocator.Request) error {
	owner, err := r.Validate(&req)
	if err != nil {
		return err
	}
	owner = r.AttachmentOwner(req, owner) // an imported attachment is kept under its container ID
	own := r.Locks.Lock(owner)
	defer own.Unlock()
	deferred := false
	for _, pool := range r.attachedPools(owner, req) {
		req.Pool = pool
		d, err := r.delIn(ctx, req, own)
		if err != nil {
			return err
		}
		deferred = deferred || d
	}
	if deferred {
		return nil
	}
	r.StopWatch(owner)
	return r.durable(ctx, "DEL", owner)
}

// delIn releases the interface's attachment in the pool req names (one of an interface
// with addresses from two pools). deferred: etcd could not be reached, and the release is
// recorded for later (deferRelease).
func (r *Releaser) delIn(ctx context.Context, req allocator.Request, own *ownerlock.Owned) (deferred bool, _ error) {
	if err := r.ConflictDeleted(req); err != nil {
		return false, err
	}
	if err := r.Reachable(ctx); err != nil {
		return true, r.deferRelease(ctx, req, own, err)
	}
	left, err := r.ReleaseAttachment(ctx, req, own)
	if err == nil {
		err = r.DropPodIfEmpty(ctx, own, left)
	}
	if err != nil && errors.Is(err, allocator.ErrUnavailable) && r.Reachable(ctx) != nil {
		return true, r.deferRelease(ctx, req, own, err)
	}
	return false, err
}

// deferRelease answers a DEL that etcd could not take (cause): the attachment is recorded as
// released in the journal, never re-claimed, and released in etcd once etcd answers.
func (r *Releaser) deferRelease(ctx context.Context, req allocator.Request, own *ownerlock.Owned, cause error) error {
	owner := own.Owner()
	r.Pods.Change(own).MarkReleased(req.IfName, req.Pool.Name, req.ContainerID, time.Now())
	if err := r.durable(ctx, "DEL", owner); err != nil {
		return err
	}
	r.Metrics.ReleasesDeferred.Inc()
	r.Log.Warn("etcd cannot be reached: the DEL is recorded and answered; its addresses are released once etcd answers",
		"owner", owner, "container", req.ContainerID, "ifname", req.IfName, "pool", req.Pool.Name, "cause", cause)
	r.Wake()
	return nil
}

// ReleaseAttachment deletes the request's attachment and returns the owner's attachments left, or -1
// when it released nothing and so did not count them.
func (r *Releaser) ReleaseAttachment(ctx context.Context, req allocator.Request, own *ownerlock.Owned) (int64, error) {
	owner := own.Owner()
	ownerKey := keyspace.OwnerKey(r.Cfg.Cluster, owner, req.IfName, req.Pool.Name)
	if at, lease, ok := r.Pods.Attachment(owner, req.IfName, req.Pool.Name); ok && at.OwnerRev > 0 && at.ContainerID == req.ContainerID {
		// The agent wrote this attachment (or read it) at OwnerRev: release it without reading
		// it first. The transaction compares that revision, so an owner index changed since
		// (re-claimed, released by an admin) fails it, and DEL reads what is there instead.
		kv := &mvccpb.KeyValue{Key: []byte(ownerKey), ModRevision: at.OwnerRev, Lease: int64(lease)}
		rec := keyspace.OwnerRecord{IPs: at.IPs, ContainerID: at.ContainerID, Claim: at.Claim,
			ClaimHoldSeconds: int64(at.ClaimHold / time.Second), ClaimMigratable: at.ClaimMigratable}
		if at.ClaimLease != 0 {
			rec.ClaimLease = keyspace.LeaseHex(at.ClaimLease)
		}
		left, err := r.releaseRecord(ctx, req.Pool.Name, own, kv, rec, true)
		if !errors.Is(err, errStale) {
			return left, err
		}
	}
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	resp, err := r.Cli.Get(octx, ownerKey)
	if err != nil {
		return -1, r.unavailable("read owner index "+ownerKey, err)
	}
	if len(resp.Kvs) == 0 {
		if lease, held := r.Pods.Lease(owner); held && r.Pods.Lists(owner, req.IfName, req.Pool.Name, req.ContainerID) {
			// The agent holds the attachment, etcd has no key of it: its lease expired before
			// the keeper noticed, or etcd went back to before the keys were written. The pod's
			// other attachments are re-claimed, this one is not.
			r.keysGone(lease)
		}
		if r.forgetLost(ctx, own, req) {
			return -1, nil
		}
		r.Log.Debug("DEL of an attachment without addresses", "owner", owner, "ifname", req.IfName, "pool", req.Pool.Name)
		return -1, nil
	}
	kv := resp.Kvs[0]
	rec, err := keyspace.Decode[keyspace.OwnerRecord](ownerKey, kv.Value)
	if err != nil {
		return -1, err
	}
	if rec.NodeUID != r.Cfg.NodeUID {
		r.Log.Warn("DEL for an attachment made by another node identity; nothing released, it expires with its lease",
			"owner", owner, "ifname", req.IfName, "pool", req.Pool.Name, "container", req.ContainerID, "holder_node_uid", rec.NodeUID)
		return -1, nil
	}
	if rec.ContainerID != req.ContainerID {
		r.forgetLost(ctx, own, req)
		r.Log.Info("DEL for a container that no longer holds the attachment; nothing released",
			"owner", owner, "ifname", req.IfName, "pool", req.Pool.Name, "container", req.ContainerID, "holder", rec.ContainerID)
		return -1, nil
	}
	return r.releaseRecord(ctx, req.Pool.Name, own, kv, rec, false)
}

// forgetLost drops the request's attachment from a pod whose lease was lost, when etcd holds
// nothing of it to release (its keys expired): it must never be re-claimed now that its DEL
// is answered. Its held keys are freed by the next settleHeld. It reports whether there was
// such an attachment.
func (r *Releaser) forgetLost(ctx context.Context, own *ownerlock.Owned, req allocator.Request) bool {
	owner := own.Owner()
	if _, held := r.Pods.Lease(owner); held {
		return false
	}
	at, ok := r.Pods.LostAttachment(owner, req.IfName, req.Pool.Name, req.ContainerID)
	if !ok || !r.Pods.Change(own).ForgetAttachment(req.IfName, req.Pool.Name, req.ContainerID) {
		return false
	}
	r.Metrics.ReclaimsCancelled.Inc()
	r.Log.Info("DEL of a pod whose lease was lost: its keys are gone, and it is not re-claimed",
		"owner", owner, "container", req.ContainerID, "ifname", req.IfName, "pool", req.Pool.Name)
	r.ReportTakenAtDel(ctx, owner, at)
	r.Wake()
	return true
}

// attachedPools are the pools of the interface's attachments on req's network as the pod book
// has them (read under the owner lock), for a DEL or CHECK: selection may have put them in
// other pools than the configuration names (two, when each family came from its own), and a
// rule changed since never moves them. Unknown to the book: the configuration's pool.
func (r *Releaser) attachedPools(owner string, req allocator.Request) []allocator.PoolSpec {
	ps, ok := r.Pods.Snapshot(owner)
	if !ok {
		return []allocator.PoolSpec{req.Pool}
	}
	var out []allocator.PoolSpec
	for _, at := range ps.Attachments {
		if at.IfName != req.IfName || at.Network != req.Network || slices.ContainsFunc(out, func(p allocator.PoolSpec) bool { return p.Name == at.Pool }) {
			continue
		}
		if at.Pool == req.Pool.Name {
			out = append(out, req.Pool)
		} else {
			out = append(out, allocator.PoolSpec{Name: at.Pool})
		}
	}
	if len(out) == 0 || len(out) == 1 && out[0].Name != req.Pool.Name &&
		slices.ContainsFunc(ps.Attachments, func(o podbook.Attachment) bool { return o.IfName == req.IfName && o.Pool == req.Pool.Name }) {
		return []allocator.PoolSpec{req.Pool} // the configuration's pool has one too
	}
	return out
}
