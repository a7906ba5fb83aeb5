package audit

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/poolview"
)

// auditOwn checks the node record and the block claims of the views: each on the lease the
// agent holds it on. One that is not means etcd went back in time (or an admin deleted it):
// the node registers again, every view lists its pool again, and the pods are checked.
func (au *Auditor) auditOwn(ctx context.Context) error {
	type own struct {
		key   string
		lease clientv3.LeaseID
		what  string
		still func() bool // whether the agent still holds it as read
		gone  func()      // what to do once its lease is gone, before the keeper says it, if it ever does
	}
	var owns []own
	if node := au.cfg.NodeLease(); node != 0 && au.cfg.Keeper.Holds(node) {
		owns = append(owns, own{keyspace.NodeKey(au.cfg.Cluster, au.cfg.Node), node, "the node record",
			func() bool { return au.cfg.NodeLease() == node && au.cfg.Keeper.Holds(node) }, nil})
	}
	au.pools.ForEachView(func(v *poolview.View) {
		for b, lease := range v.Claims().Held() {
			owns = append(owns, own{keyspace.BlockKey(v.Pool(), b), lease, fmt.Sprintf("the claim of block %s of pool %s", b, v.Pool()),
				func() bool { return v.Claims().Holds(b, lease) },
				func() {
					// The claim went with its lease. The keeper would say so only at the
					// lease's next renewal, a third of the block lease's TTL away (a TTL that
					// outlives the reuse delay), and never for a lease it does not renew (a
					// claim a restore brought back, on a block lease of this node the agent
					// never took up again); meanwhile the view would hold blocks any node may
					// claim. So the lease is lost now, as the keeper would report it.
					au.cfg.Keeper.Forget(lease)
					if au.cfg.BlockLeaseLost(lease) {
						au.cfg.Log.Warn("this node's block lease is gone from etcd, and its block claims and held keys with it",
							"lease", keyspace.LeaseHex(lease))
						return
					}
					v.Claims().LeaseLost(lease)
				}})
		}
	})
	for len(owns) > 0 {
		n := min(len(owns), keyspace.MaxTxnOps)
		chunk := owns[:n]
		owns = owns[n:]
		cmps := make([]clientv3.Cmp, 0, n)
		gets := make([]clientv3.Op, 0, n)
		for _, o := range chunk {
			cmps = append(cmps, keyspace.OnLease(o.key, o.lease))
			gets = append(gets, clientv3.OpGet(o.key, clientv3.WithKeysOnly()))
		}
		octx, cancel := au.opCtx(ctx)
		resp, err := au.cfg.Client.Txn(octx).If(cmps...).Else(gets...).Commit()
		cancel()
		if err != nil {
			return au.unavailable("check the node record and the block claims", err)
		}
		if resp.Succeeded {
			continue
		}
		for i, o := range chunk {
			kvs := resp.Responses[i].GetResponseRange().Kvs
			if len(kvs) > 0 && keyspace.LeaseOf(kvs[0]) == o.lease || !o.still() {
				continue // as the agent holds it, or let go meanwhile
			}
			if alive, known := au.leaseState(ctx, o.lease); !alive {
				if known && o.gone != nil {
					o.gone()
				}
				continue // gone with its lease (the node lease the keeper reports lost of its own), or unknown
			}
			found := "missing"
			if len(kvs) > 0 {
				found = "on lease " + keyspace.LeaseHex(keyspace.LeaseOf(kvs[0]))
			}
			au.cfg.WentBack(fmt.Sprintf("%s (%s) is %s, not on lease %s as this agent wrote it", o.what, o.key, found, keyspace.LeaseHex(o.lease)), nil)
			return nil
		}
	}
	return nil
}

// LeaseAlive tells whether etcd answers that it still has lease id; without an answer the
// next audit looks again.
func (au *Auditor) LeaseAlive(ctx context.Context, id clientv3.LeaseID) bool {
	alive, _ := au.leaseState(ctx, id)
	return alive
}

// leaseState is LeaseAlive, and whether etcd answered.
func (au *Auditor) leaseState(ctx context.Context, id clientv3.LeaseID) (alive, known bool) {
	octx, cancel := au.opCtx(ctx)
	defer cancel()
	ttl, err := au.cfg.Client.TimeToLive(octx, id)
	return err == nil && ttl.TTL > 0, err == nil
}
