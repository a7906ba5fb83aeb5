package sticky

import (
	"context"
	"errors"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

// KeepTargets is the target's side of the live migrations this node's pods are the targets
// of, run by every audit (every half pod TTL; a migratable claim's hold is at least two): a
// migration whose source expired (its node died: etcd deleted its allocations, owner index
// and pod record, with no release) is completed by promoting the target (T4) long before
// the claim's record and quarantine keys, on the source's claim lease, run out; one that
// completed by the source's DEL (T2) leaves the target a holder like any, which the pod book
// records. One that cannot be checked now is left to the next audit.
func (sc *Claims) KeepTargets(ctx context.Context, layouts map[string]allocator.Blocks) error {
	var errs []error
	for _, h := range sc.pods.Audit().Targets() {
		blocks, ok := layouts[h.At.Pool]
		if !ok {
			continue // a pool being moved to blocks: its keys move under the migration's freeze
		}
		errs = append(errs, sc.keepTarget(ctx, h.Owner, h.At, blocks))
	}
	return errors.Join(errs...)
}

// keepTarget is KeepTargets for owner's target attachment at, under owner's lock.
func (sc *Claims) keepTarget(ctx context.Context, owner string, at podbook.Attachment, blocks allocator.Blocks) error {
	own := sc.locks.Lock(owner)
	defer own.Unlock()
	if ps, ok := sc.pods.Snapshot(owner); !ok || !slices.ContainsFunc(ps.Attachments, func(a podbook.Attachment) bool {
		return a.IfName == at.IfName && a.Pool == at.Pool && a.Target && a.ContainerID == at.ContainerID
	}) {
		return nil // deleted or promoted meanwhile
	}
	key := keyspace.ClaimKey(sc.cfg.Cluster, at.Pool, at.Claim)
	mkey := keyspace.LiveMigrationKey(sc.cfg.Cluster, at.Pool, at.Claim)
	ops := []clientv3.Op{clientv3.OpGet(key), clientv3.OpGet(mkey)}
	for _, ip := range at.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(at.Pool, blocks, ip), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.QuarantineKey(at.Pool, blocks, ip), clientv3.WithKeysOnly()))
	}
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	resp, err := sc.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return sc.unavailable("read the live migration of claim "+at.Claim, err)
	}
	ckvs, mkvs := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	var rec keyspace.ClaimRecord
	if len(ckvs) > 0 {
		if rec, err = keyspace.Decode[keyspace.ClaimRecord](key, ckvs[0].Value); err != nil {
			return err
		}
	}
	if len(mkvs) == 0 {
		if rec.Holder != nil && rec.Holder.Owner == owner && rec.Holder.ContainerID == at.ContainerID {
			sc.pods.Change(own).Promoted(at.IfName, at.Pool) // completed by the source's DEL (T2)
			return nil
		}
		sc.log.Warn("a live migration this node's pod was the target of ended without making it the claim's holder; "+
			"its addresses are not its own", "claim", at.Claim, "owner", owner, "pool", at.Pool)
		return nil
	}
	m, err := keyspace.Decode[keyspace.LiveMigrationRecord](mkey, mkvs[0].Value)
	if err != nil || m.Target.Owner != owner || len(ckvs) == 0 {
		return err
	}
	cmps := []clientv3.Cmp{keyspace.Unchanged(key, ckvs[0].ModRevision), keyspace.Unchanged(mkey, mkvs[0].ModRevision)}
	for i, ip := range at.IPs {
		if len(resp.Responses[2+2*i].GetResponseRange().Kvs) > 0 {
			return nil // the source still holds it: the migration goes on
		}
		var qrev int64
		if q := resp.Responses[3+2*i].GetResponseRange().Kvs; len(q) > 0 {
			qrev = q[0].ModRevision
		}
		cmps = append(cmps, keyspace.Absent(keyspace.IPKey(at.Pool, blocks, ip)),
			keyspace.Unchanged(keyspace.QuarantineKey(at.Pool, blocks, ip), qrev))
	}
	if !slices.Equal(rec.IPs, at.IPs) {
		return nil
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
	sc.log.Warn("live migration completed by its source's expiry (its node is gone): this node's pod holds the claim now",
		"claim", at.Claim, "owner", owner, "source", m.Source.Owner, "source_node", m.Source.Node, "ips", at.IPs)
	return nil
}
