package sticky

import (
	"context"
	"errors"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
)

// KeepTargets is the target's side of the live migrations this node's pods are the targets
// of, run by every audit (every half pod TTL; a migratable claim's hold is at least two): a
// migration whose source expired (its node died: etcd deleted its allocations, owner index
// and pod record, with no release) is completed by promoting the target (T4) long before
// the claim's record and quarantine keys, on the source's claim lease, run out; one that
// completed by the source's DEL (T2) leaves the target a holder like any, which the pod book
// records; one whose key is missing is written again, or taken over (keepTarget). One that
// cannot be checked now is left to the next audit. Then the migrations this node takes part
// in are read, for the metrics (readMigrations).
func (sc *Claims) KeepTargets(ctx context.Context, layouts map[string]allocator.Blocks) error {
	errs := []error{sc.readMigrations(ctx)}
	for _, h := range sc.pods.Audit().Targets() {
		blocks, ok := layouts[h.At.Pool]
		if !ok {
			continue // a pool being moved to blocks: its keys move under the migration's freeze
		}
		errs = append(errs, sc.keepTarget(ctx, h.Owner, h.At, blocks))
	}
	return errors.Join(errs...)
}

// keepTarget is KeepTargets for owner's target attachment at, under owner's lock. Its
// migration key found missing is the audit's (docs/proposals/live-migration.md, "Audits"):
// while the claim names a live holder on another node, the key is written again as T1 wrote
// it; with the holder's allocations gone, the target takes the claim over as T4 does.
func (sc *Claims) keepTarget(ctx context.Context, owner string, at podbook.Attachment, blocks allocator.Blocks) error {
	own := sc.locks.Lock(owner)
	defer own.Unlock()
	ps, ok := sc.pods.Snapshot(owner)
	podLease, held := ps.Held()
	if !ok || !held || !slices.ContainsFunc(ps.Attachments, func(a podbook.Attachment) bool {
		return a.IfName == at.IfName && a.Pool == at.Pool && a.Target && a.ContainerID == at.ContainerID
	}) {
		return nil // deleted, promoted or being re-claimed meanwhile
	}
	ownerKey := keyspace.OwnerKey(sc.cfg.Cluster, owner, at.IfName, at.Pool)
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	r, err := sc.readTarget(octx, at, blocks)
	if err != nil {
		return err
	}
	if r.recErr != nil {
		return r.recErr
	}
	key, mkey, rec := r.key, r.mkey, r.rec
	if r.mkv == nil && rec.Holder != nil && rec.Holder.Owner == owner && rec.Holder.ContainerID == at.ContainerID {
		sc.pods.Change(own).Promoted(at.IfName, at.Pool) // completed by the source's DEL (T2)
		sc.seen.drop(mkey)
		return nil
	}
	if r.ckv == nil || rec.Holder == nil || !slices.Equal(rec.IPs, at.IPs) {
		sc.log.Warn("a live migration this node's pod is the target of has no claim holder any more; its addresses are not its own",
			"claim", at.Claim, "owner", owner, "pool", at.Pool)
		return nil
	}
	var m keyspace.LiveMigrationRecord
	mcmp := keyspace.Absent(mkey)
	if r.mkv != nil {
		if m, err = keyspace.Decode[keyspace.LiveMigrationRecord](mkey, r.mkv.Value); err != nil || m.Target.Owner != owner {
			return err
		}
		mcmp = keyspace.Unchanged(mkey, r.mkv.ModRevision)
	} else if m, err = sc.targetRecord(ctx, ps, at, podLease, *rec.Holder); err != nil {
		return err
	}
	acmps, allocated, onSource := r.addrCmps(at, blocks)
	cmps := append([]clientv3.Cmp{keyspace.Unchanged(key, r.ckv.ModRevision), mcmp}, acmps...)
	switch {
	case allocated > 0 && r.mkv != nil:
		sc.started(mkey, m)
		return nil // the source still holds them: the migration goes on
	case allocated > 0:
		if onSource < len(at.IPs) || rec.Holder.Node == sc.cfg.Node || !rec.Migratable {
			sc.log.Warn("the live migration key of this node's pod is gone and the claim's addresses are not all its holder's on another "+
				"node; it is not written again", "claim", at.Claim, "owner", owner, "holder", rec.Holder.Owner, "holder_node", rec.Holder.Node)
			return nil
		}
		return sc.remigrate(octx, cmps, own, ownerKey, podLease, mkey, m)
	}
	puts, err := moves(sc.cfg.Cluster, at.Pool, at.Claim, blocks, m, rec, at.Network, sc.wall())
	if err != nil {
		return err
	}
	tresp, err := sc.cli.Txn(octx).If(cmps...).Then(append(puts, clientv3.OpDelete(mkey))...).Commit()
	if err != nil {
		return sc.unavailable("promote the live migration's target of claim "+at.Claim, err)
	}
	if !tresp.Succeeded {
		sc.cfg.AuditDue() // changed since read: the next audit reads it again
		return nil
	}
	sc.pods.Change(own).Promoted(at.IfName, at.Pool)
	sc.seen.drop(mkey)
	sc.cfg.Live.Completed(SourceExpired)
	sc.log.Warn("live migration completed by its source's expiry (its node is gone): this node's pod holds the claim now",
		"claim", at.Claim, "owner", owner, "source", rec.Holder.Owner, "source_node", rec.Holder.Node, "ips", at.IPs)
	return nil
}

// targetRecord is the live migration record T1 wrote for owner's target attachment at, on
// podLease, from source: written again when found missing. Its start is the attachment's.
func (sc *Claims) targetRecord(ctx context.Context, ps podbook.PodState, at podbook.Attachment, podLease clientv3.LeaseID,
	source keyspace.ClaimHolder) (keyspace.LiveMigrationRecord, error) {
	m := keyspace.LiveMigrationRecord{
		Target: keyspace.ClaimHolder{Owner: ps.Owner, Pod: ps.Pod, Node: sc.cfg.Node, NodeUID: sc.cfg.NodeUID,
			ContainerID: at.ContainerID, IfName: at.IfName, LeaseID: keyspace.LeaseHex(podLease)},
		ClaimLease: keyspace.LeaseHex(at.ClaimLease),
		Source:     keyspace.LiveMigrationSource{Owner: source.Owner, Node: source.Node, LeaseID: source.LeaseID},
		Since:      at.Created.UTC(),
	}
	bl, err := sc.cfg.HeldLease(ctx)
	if err != nil {
		return m, err
	}
	if bl != 0 {
		m.BlockLease = keyspace.LeaseHex(bl)
	}
	return m, nil
}

// remigrate writes the live migration key m of own's target attachment again, on its pod
// lease, compared as cmps (the claim, the key absent, each address on the holder's pod lease
// and its quarantine key as read) and the owner index on that lease: T1 again.
func (sc *Claims) remigrate(ctx context.Context, cmps []clientv3.Cmp, own *ownerlock.Owned, ownerKey string, podLease clientv3.LeaseID,
	mkey string, m keyspace.LiveMigrationRecord) error {
	cmps = append(cmps, keyspace.OnLease(ownerKey, podLease))
	resp, err := sc.cli.Txn(ctx).If(cmps...).Then(clientv3.OpPut(mkey, keyspace.Encode(m), clientv3.WithLease(podLease))).Commit()
	if err != nil {
		return sc.unavailable("write again the live migration key "+mkey, err)
	}
	if !resp.Succeeded {
		sc.cfg.AuditDue()
		return nil
	}
	sc.started(mkey, m)
	sc.cfg.KeysLost.Inc()
	sc.log.Error("the live migration key of this node's pod was missing in etcd; written again: the pod still uses its holder's addresses",
		"key", mkey, "owner", own.Owner(), "source", m.Source.Owner, "source_node", m.Source.Node)
	return nil
}
