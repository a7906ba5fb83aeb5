package leases

import (
	"context"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// sweepLeases deletes, from the leases the agent renews for its node and its pods, the pod
// records, owner indexes and allocations of any other owner. Keeper.Recycle makes a deleted
// pod's lease a spare once etcd says no key is left on it; etcd restored from a backup older
// than that DEL puts the pod's keys back on the lease, and whoever took it since (the node
// record, a new pod) would renew them for ever: an address no pod runs with, held. It runs
// once for each time the agent finds etcd gone back, after the repair (reclaimAll), and
// costs one lease listing per pod then.
func (a *Agent) sweepLeases(ctx context.Context) error {
	owners := a.pods.leaseOwners()
	if node := a.nodeLease(); node != 0 && a.keeper.Holds(node) {
		owners[node] = "" // no pod's key belongs on the node's lease
	}
	var swept []string
	for id, owner := range owners {
		octx, cancel := a.opCtx(ctx)
		ttl, err := a.cli.TimeToLive(octx, id, clientv3.WithAttachedKeys())
		cancel()
		if err != nil {
			return a.unavailable("list the keys on lease "+keyspace.LeaseHex(id), err)
		}
		for _, k := range ttl.Keys {
			key := string(k)
			foreign, err := a.foreignKey(ctx, key, owner)
			if err != nil {
				return err
			}
			if !foreign {
				continue
			}
			octx, cancel := a.opCtx(ctx)
			_, err = a.cli.Txn(octx).If(keyspace.OnLease(key, id)).Then(clientv3.OpDelete(key)).Commit()
			cancel()
			if err != nil {
				return a.unavailable("delete "+key, err)
			}
			swept = append(swept, key)
		}
	}
	if len(swept) > 0 {
		a.log.Warn("keys of pods deleted before were back on leases this agent renews (etcd restored from a backup older "+
			"than their DEL); deleted", "keys", swept)
	}
	return nil
}

// foreignKey tells whether key, on the lease of owner ("": the node's), is a pod record, an
// owner index or an allocation of another owner. Any other key is left alone.
func (a *Agent) foreignKey(ctx context.Context, key, owner string) (bool, error) {
	if o, ok := strings.CutPrefix(key, keyspace.PodsPrefix(a.cfg.Cluster, a.cfg.Node)); ok {
		return o != owner, nil
	}
	if cluster, o, _, _, err := keyspace.ParseOwnerKey(key); err == nil {
		return cluster != a.cfg.Cluster || o != owner, nil
	}
	if _, _, _, err := keyspace.ParseIPKey(key); err != nil {
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
	return rec.Cluster != a.cfg.Cluster || rec.Owner != owner, nil
}
