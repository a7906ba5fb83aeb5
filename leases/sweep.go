package leases

import (
	"context"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
)

// sweepLeases deletes, from the leases the agent renews for its node and its pods, the pod
// records, owner indexes and allocations of any other owner, and those of an attachment of
// the lease's own pod that the agent no longer lists. Keeper.Recycle makes a deleted pod's
// lease a spare once etcd says no key is left on it; etcd restored from a backup older than
// that DEL puts the pod's keys back on the lease, and whoever took it since (the node record,
// a new pod) would renew them for ever: an address no pod runs with, held. The same goes for
// an attachment deleted after the backup of a pod that keeps another: its keys come back on
// the pod's lease. It runs once for each time the agent finds etcd gone back, after the
// repair (reclaimAll), and costs one lease listing per pod then; each pod's lease is swept
// under the pod's lock, so that an ADD of a new attachment is not taken for a stale one.
func (a *Agent) sweepLeases(ctx context.Context) error {
	owners := a.pods.LeaseOwners()
	if node := a.nodeLease(); node != 0 && a.keeper.Holds(node) {
		owners[node] = "" // no pod's key belongs on the node's lease
	}
	var swept []string
	for id, owner := range owners {
		var own *ownerlock.Owned
		if owner != "" {
			own = a.locks.Lock(owner)
		}
		keys, err := a.sweepLease(ctx, id, own)
		if own != nil {
			own.Unlock()
		}
		swept = append(swept, keys...)
		if err != nil {
			return err
		}
	}
	if len(swept) > 0 {
		a.log.Warn("keys of pods deleted before were back on leases this agent renews (etcd restored from a backup older "+
			"than their DEL); deleted", "keys", swept)
	}
	return nil
}

// sweepLease deletes the keys on lease id that are not own's (nil: the node's lease, which
// carries none of a pod) and returns them.
func (a *Agent) sweepLease(ctx context.Context, id clientv3.LeaseID, own *ownerlock.Owned) (swept []string, _ error) {
	octx, cancel := a.opCtx(ctx)
	ttl, err := a.cli.TimeToLive(octx, id, clientv3.WithAttachedKeys())
	cancel()
	if err != nil {
		return nil, a.unavailable("list the keys on lease "+keyspace.LeaseHex(id), err)
	}
	owner := ""
	var ps podState
	if own != nil {
		owner = own.Owner()
		ps, _ = a.pods.Snapshot(owner)
	}
	for _, k := range ttl.Keys {
		key := string(k)
		foreign, err := a.foreignKey(ctx, key, owner, ps)
		if err != nil {
			return swept, err
		}
		if !foreign {
			continue
		}
		octx, cancel := a.opCtx(ctx)
		_, err = a.cli.Txn(octx).If(keyspace.OnLease(key, id)).Then(clientv3.OpDelete(key)).Commit()
		cancel()
		if err != nil {
			return swept, a.unavailable("delete "+key, err)
		}
		swept = append(swept, key)
	}
	return swept, nil
}

// foreignKey tells whether key, on the lease of owner ("": the node's), is a pod record, an
// owner index or an allocation of another owner, or an owner index or allocation of an
// attachment of owner that ps, what the agent knows of owner, does not list. Any other key is
// left alone.
func (a *Agent) foreignKey(ctx context.Context, key, owner string, ps podState) (bool, error) {
	listed := func(ifName, pool string) bool {
		return slices.ContainsFunc(ps.Attachments, func(at attachment) bool { return at.IfName == ifName && at.Pool == pool })
	}
	if o, ok := strings.CutPrefix(key, keyspace.PodsPrefix(a.cfg.Cluster, a.cfg.Node)); ok {
		return o != owner, nil
	}
	if cluster, o, ifName, pool, err := keyspace.ParseOwnerKey(key); err == nil {
		return cluster != a.cfg.Cluster || o != owner || !listed(ifName, pool), nil
	}
	pool, _, _, err := keyspace.ParseIPKey(key)
	if err != nil {
		return false, nil
	}
	octx, cancel := a.opCtx(ctx)
	resp, err := a.cli.Get(octx, key)
	cancel()
	if err != nil {
		return false, a.unavailable("read "+key, err)
	}
	if len(resp.Kvs) == 0 {
		return false, nil
	}
	rec, err := keyspace.Decode[keyspace.Allocation](key, resp.Kvs[0].Value)
	if err != nil {
		return false, nil // not leasehold's to judge
	}
	return rec.Cluster != a.cfg.Cluster || rec.Owner != owner || !listed(rec.IfName, pool), nil
}
