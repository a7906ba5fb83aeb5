package release

import (
	"context"
	"errors"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
)

// GC releases every attachment of the request's network that this node identity made and
// the runtime no longer lists in ValidAttachments (CNI 1.1 GC). Attachments younger than the
// GC grace are kept, so an ADD that finished after the runtime built its list is not undone.
// It keeps going when one release fails and returns all failures joined.
func (r *Releaser) GC(ctx context.Context, req allocator.GCRequest) error {
	if err := r.Stopped(); err != nil {
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
	octx, cancel := r.opCtx(ctx)
	pods, err := r.Cli.Get(octx, keyspace.PodsPrefix(r.Cfg.Cluster, r.Cfg.Node), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return r.unavailable("list this node's pods", err)
	}
	var errs []error
	for _, pkv := range pods.Kvs {
		prec, err := keyspace.Decode[keyspace.PodRecord](string(pkv.Key), pkv.Value)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if prec.NodeUID != r.Cfg.NodeUID {
			continue // another identity's pod: it expires with its lease, never collected here
		}
		if err := r.gcOwner(ctx, req, prec.Owner, valid); err != nil {
			errs = append(errs, err)
		}
	}
	// What GC released must stay released across a crash right after its answer.
	errs = append(errs, r.durable(ctx, "GC", req.Network))
	return errors.Join(errs...)
}

func (r *Releaser) gcOwner(ctx context.Context, req allocator.GCRequest, owner string, valid map[allocator.Attachment]bool) error {
	own := r.Locks.Lock(owner)
	defer own.Unlock()
	young := r.addedWithinGrace(owner)
	return r.releaseWhere(ctx, own, func(ifName, pool string, rec keyspace.OwnerRecord) bool {
		// The network's attachments in any pool: selection may have put one outside the
		// configuration's pool.
		collect := rec.Network == req.Network && !young(rec) &&
			!valid[allocator.Attachment{ContainerID: rec.ContainerID, IfName: ifName}]
		if collect {
			r.Log.Info("GC releases an attachment the runtime no longer lists",
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
func (r *Releaser) addedWithinGrace(owner string) func(keyspace.OwnerRecord) bool {
	grace := r.Cfg.GCGrace
	if grace <= 0 {
		return func(keyspace.OwnerRecord) bool { return false }
	}
	recent := r.Pods.AddedWithin(owner, grace)
	fresh := time.Since(r.Cfg.Started) < grace
	now := r.Cfg.WallClock().UTC()
	return func(rec keyspace.OwnerRecord) bool {
		return recent || fresh && now.Sub(rec.Created) < grace
	}
}

// releaseWhere releases each attachment of owner made by this node identity for which
// pick says so, then revokes the owner's lease if nothing is left, and stops following the
// conflicts of the attachments released, as DEL does. It keeps going when one release fails
// and joins the errors.
func (r *Releaser) releaseWhere(ctx context.Context, own *ownerlock.Owned, pick func(ifName, pool string, rec keyspace.OwnerRecord) bool) error {
	owner := own.Owner()
	octx, cancel := r.opCtx(ctx)
	resp, err := r.Cli.Get(octx, keyspace.OwnerPrefix(r.Cfg.Cluster, owner), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return r.unavailable("list attachments of "+owner, err)
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
		if rec.NodeUID != r.Cfg.NodeUID || !pick(ifName, pool, rec) {
			continue
		}
		if _, err := r.releaseRecord(ctx, pool, own, kv, rec, false); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		// Counted anew: an attachment this walk did not release may have changed meanwhile.
		errs = append(errs, r.DropPodIfEmpty(ctx, own, -1))
	}
	r.StopWatch(owner)
	return errors.Join(errs...)
}

// ReleaseOwner releases every attachment this node identity made for own's owner and gives
// up the owner's lease: the recovery's release of a pod whose sandbox is gone.
func (r *Releaser) ReleaseOwner(ctx context.Context, own *ownerlock.Owned) error {
	return r.releaseWhere(ctx, own, func(string, string, keyspace.OwnerRecord) bool { return true })
}
