package reclaim

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
)

// SweepLeases deletes, from the leases the agent renews for its node and its pods, the pod
// records, owner indexes, allocations and conflict records of any other owner, and those of
// an attachment of the lease's own pod that the agent no longer lists. Keeper.Recycle makes
// a deleted pod's lease a spare once etcd says no key is left on it; etcd restored from a
// backup older than that DEL puts the pod's keys back on the lease, and whoever took it since
// (the node record, a new pod) would renew them for ever: an address no pod runs with, held.
// The same goes for an attachment deleted after the backup of a pod that keeps another: its
// keys come back on the pod's lease. Its conflict record among them: the audit does not check
// one (no address hangs on it), so nothing else takes it away, and it would report for good
// a conflict of an attachment that no longer exists. It runs once for each time the agent
// finds etcd gone back, after the repair (reclaimAll), and costs one lease listing per pod
// then; each pod's lease is swept under the pod's lock, so that an ADD of a new attachment is
// not taken for a stale one. The recovery loop runs it; the agent's tests call it too.
func (r *Reclaimer) SweepLeases(ctx context.Context) error {
	owners := r.cfg.Pods.LeaseOwners()
	if node := r.cfg.NodeLease(); node != 0 && r.cfg.Keeper.Holds(node) {
		owners[node] = "" // no pod's key belongs on the node's lease
	}
	var swept []string
	for id, owner := range owners {
		var own *ownerlock.Owned
		if owner != "" {
			own = r.cfg.Locks.Lock(owner)
		}
		keys, err := r.sweepLease(ctx, id, own)
		if own != nil {
			own.Unlock()
		}
		swept = append(swept, keys...)
		if err != nil {
			return err
		}
	}
	if len(swept) > 0 {
		r.cfg.Log.Warn("keys of pods deleted before were back on leases this agent renews (etcd restored from a backup older "+
			"than their DEL); deleted", "keys", swept)
	}
	return nil
}

// sweepLease deletes the keys on lease id that are not own's (nil: the node's lease, which
// carries none of a pod) and returns them.
func (r *Reclaimer) sweepLease(ctx context.Context, id clientv3.LeaseID, own *ownerlock.Owned) (swept []string, _ error) {
	octx, cancel := r.opCtx(ctx)
	ttl, err := r.cfg.Client.TimeToLive(octx, id, clientv3.WithAttachedKeys())
	cancel()
	if err != nil {
		return nil, r.unavailable("list the keys on lease "+keyspace.LeaseHex(id), err)
	}
	owner := ""
	var ps podbook.PodState
	if own != nil {
		owner = own.Owner()
		ps, _ = r.cfg.Pods.Snapshot(owner)
	}
	for _, k := range ttl.Keys {
		key := string(k)
		foreign, err := r.foreignKey(ctx, key, owner, ps)
		if err != nil {
			return swept, err
		}
		if !foreign {
			continue
		}
		octx, cancel := r.opCtx(ctx)
		_, err = r.cfg.Client.Txn(octx).If(keyspace.OnLease(key, id)).Then(clientv3.OpDelete(key)).Commit()
		cancel()
		if err != nil {
			return swept, r.unavailable("delete "+key, err)
		}
		swept = append(swept, key)
	}
	return swept, nil
}

// foreignKey tells whether key, on the lease of owner ("": the node's), is a pod record, an
// owner index, a conflict record or an allocation of another owner, or an owner index,
// conflict record or allocation of an attachment of owner that ps, what the agent knows of
// owner, does not list. Any other key is left alone.
func (r *Reclaimer) foreignKey(ctx context.Context, key, owner string, ps podbook.PodState) (bool, error) {
	listed := func(ifName, pool string) bool {
		return slices.ContainsFunc(ps.Attachments, func(at podbook.Attachment) bool { return at.IfName == ifName && at.Pool == pool })
	}
	if o, ok := strings.CutPrefix(key, keyspace.PodsPrefix(r.cfg.Cluster, r.cfg.Node)); ok {
		return o != owner, nil
	}
	if cluster, o, ifName, pool, err := keyspace.ParseOwnerKey(key); err == nil {
		return cluster != r.cfg.Cluster || o != owner || !listed(ifName, pool), nil
	}
	if cluster, o, ifName, pool, err := keyspace.ParseConflictKey(key); err == nil {
		return cluster != r.cfg.Cluster || o != owner || !listed(ifName, pool), nil
	}
	pool, _, _, err := keyspace.ParseIPKey(key)
	if err != nil {
		return false, nil
	}
	octx, cancel := r.opCtx(ctx)
	resp, err := r.cfg.Client.Get(octx, key)
	cancel()
	if err != nil {
		return false, r.unavailable("read "+key, err)
	}
	if len(resp.Kvs) == 0 {
		return false, nil
	}
	rec, err := keyspace.Decode[keyspace.Allocation](key, resp.Kvs[0].Value)
	if err != nil {
		return false, nil // not leasehold's to judge
	}
	return rec.Cluster != r.cfg.Cluster || rec.Owner != owner || !listed(rec.IfName, pool), nil
}

// settleHeld frees the held keys on this node's block leases that no pod of it lists (their
// pods were deleted while their leases were lost, or were not re-claimed because their
// sandbox was gone): only the addresses of pods that may still run are held back. Each is
// deleted only if no allocation stands at its address, so an ADD in flight keeps its own. So
// go the wanted keys no conflict of its pods names any more (its DEL lost with a crash, or an
// admin's release).
func (r *Reclaimer) settleHeld(ctx context.Context) error {
	if r.cfg.ReuseDelay <= 0 {
		return nil
	}
	var errs []error
	for _, id := range r.cfg.BlockLeases() {
		octx, cancel := r.opCtx(ctx)
		ttl, err := r.cfg.Client.TimeToLive(octx, id, clientv3.WithAttachedKeys())
		cancel()
		if err != nil {
			errs = append(errs, r.unavailable("list the keys of block lease "+keyspace.LeaseHex(id), err))
			continue
		}
		var ops []clientv3.Op
		var freed []string
		wants := r.cfg.Pods.Wanted(r.cfg.Cluster)
		for _, k := range ttl.Keys {
			key := string(k)
			if pool, _, ip, cluster, owner, err := keyspace.ParseWantedKey(key); err == nil {
				// A wanted key no conflict of this node's pods names any more.
				if !wants[keyspace.WantedKey(pool, allocator.Blocks{}, ip, cluster, owner)] {
					ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{keyspace.OnLease(key, id)}, []clientv3.Op{clientv3.OpDelete(key)}, nil))
					freed = append(freed, key)
				}
				continue
			}
			pool, _, ip, err := keyspace.ParseHeldKey(key)
			if err != nil || r.cfg.Pods.OwnsAddr(pool, ip) {
				continue
			}
			ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{keyspace.OnLease(key, id), keyspace.Absent(keyspace.IPKeyOfHeld(key))},
				[]clientv3.Op{clientv3.OpDelete(key)}, nil))
			freed = append(freed, key)
		}
		for len(ops) > 0 {
			n := min(len(ops), keyspace.MaxTxnOps/2)
			octx, cancel := r.opCtx(ctx)
			_, err := r.cfg.Client.Txn(octx).Then(ops[:n]...).Commit()
			cancel()
			if err != nil {
				errs = append(errs, r.unavailable("free held keys no pod holds", err))
				break
			}
			r.cfg.Log.Info("held keys of addresses no pod of this node holds any more freed", "keys", freed[:n])
			ops, freed = ops[n:], freed[n:]
		}
	}
	return errors.Join(errs...)
}

// reclaimBlocks claims again, while the agent repairs what etcd going back in time took, the
// blocks its running pods' addresses are in that no node claims: a claim made after the
// backup is gone with it, and another node that claimed the block would follow this node's
// pods' keys (invariant 11) and take their addresses for free once their holds end. A block
// another node claims (a borrowed address) stays that node's.
func (r *Reclaimer) reclaimBlocks(ctx context.Context) error {
	for pool, addrs := range r.cfg.Pods.AddrsByPool() {
		v := r.cfg.Pools.ViewOf(pool)
		if v == nil || v.Blocks().Flat() {
			continue // the flat layout: no blocks
		}
		tried := map[netip.Prefix]bool{}
		for _, addr := range addrs {
			b := v.Blocks().Of(addr)
			if tried[b] || !b.IsValid() || v.FollowsAddr(addr) {
				continue
			}
			tried[b] = true
			claimed, err := v.Claims().Claim(ctx, b)
			if err != nil {
				return err
			}
			if claimed {
				// Another node may have borrowed in it since the backup, its pod's key gone
				// with the restore: no new ADD chooses in it for the keep time.
				v.Claims().MarkRestored(b)
				r.cfg.Log.Warn("a block of this node's running pods had no claim after etcd went back in time; claimed again",
					"pool", pool, "block", b)
			}
		}
	}
	return nil
}
