package audit

import (
	"context"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

// readKeys reads the keys of pods in one transaction: per pod, one answer per key (nil: no
// such key).
func (au *Auditor) readKeys(ctx context.Context, pods []podbook.AuditPod) ([][]*mvccpb.KeyValue, error) {
	var ops []clientv3.Op
	for _, p := range pods {
		for _, k := range p.Keys {
			ops = append(ops, clientv3.OpGet(k.Key))
		}
	}
	octx, cancel := au.opCtx(ctx)
	defer cancel()
	resp, err := au.cfg.Client.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return nil, au.unavailable("read the keys of this node's pods", err)
	}
	out := make([][]*mvccpb.KeyValue, len(pods))
	i := 0
	for j, p := range pods {
		out[j] = make([]*mvccpb.KeyValue, len(p.Keys))
		for k := range p.Keys {
			if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
				out[j][k] = kvs[0]
			}
			i++
		}
	}
	return out, nil
}

// judge says what is wrong with the keys read for p (kvs, in p.Keys' order): one line per
// key; and which keys hold a value this agent wrote for p but sit on another lease or none
// (an admin's copy): they must go before the re-claim, which creates each key only if absent.
func (au *Auditor) judge(p podbook.AuditPod, kvs []*mvccpb.KeyValue) (problems []string, copies []*mvccpb.KeyValue) {
	for i, k := range p.Keys {
		kv := kvs[i]
		if kv == nil {
			problems = append(problems, k.Key+": missing")
			continue
		}
		ours := au.writtenFor(p.Owner, k, kv)
		on := keyspace.LeaseOf(kv)
		switch {
		case on != p.Lease && ours:
			problems = append(problems, fmt.Sprintf("%s: on lease %s, not the pod's %s", k.Key, keyspace.LeaseHex(on), keyspace.LeaseHex(p.Lease)))
			copies = append(copies, kv)
		case on != p.Lease:
			problems = append(problems, fmt.Sprintf("%s: overwritten with another owner's value on lease %s", k.Key, keyspace.LeaseHex(on)))
		case !ours:
			problems = append(problems, k.Key+": overwritten with a value this agent did not write")
		}
	}
	return problems, copies
}

// writtenFor tells whether kv's value is one this agent writes for owner at key k.
func (au *Auditor) writtenFor(owner string, k podbook.AuditKey, kv *mvccpb.KeyValue) bool {
	switch k.Kind {
	case podbook.AuditPodRecord:
		rec, err := keyspace.Decode[keyspace.PodRecord](k.Key, kv.Value)
		return err == nil && rec.Owner == owner && rec.NodeUID == au.cfg.NodeUID
	case podbook.AuditOwnerIndex:
		rec, err := keyspace.Decode[keyspace.OwnerRecord](k.Key, kv.Value)
		return err == nil && rec.NodeUID == au.cfg.NodeUID && rec.ContainerID == k.Container
	default:
		rec, err := keyspace.Decode[keyspace.Allocation](k.Key, kv.Value)
		return err == nil && rec.Owner == owner && rec.Cluster == au.cfg.Cluster && rec.NodeUID == au.cfg.NodeUID
	}
}

// recheckPod judges owner's keys again under its lock, from what the agent knows of it now
// (a DEL or ADD may have changed it since the audit's read), and, if they are still wrong,
// gives its lease up for the re-claim. It reports whether it did.
func (au *Auditor) recheckPod(ctx context.Context, owner string, layouts map[string]allocator.Blocks) (bool, error) {
	own := au.cfg.Locks.Lock(owner)
	defer own.Unlock()
	p, ok := au.cfg.Pods.Audit().One(owner, au.cfg.Cluster, au.cfg.Node, layouts)
	if !ok {
		return false, nil
	}
	kvs, err := au.readKeys(ctx, []podbook.AuditPod{p})
	if err != nil {
		return false, err
	}
	problems, copies := au.judge(p, kvs[0])
	if len(problems) == 0 {
		au.cfg.Pods.Audit().Verified(p, kvs[0])
		return false, nil
	}
	return true, au.KeysLost(ctx, p, problems, copies)
}

// KeysLost gives up the lease of a running pod whose keys are not as the agent wrote them,
// so that the re-claim restores them on a new lease as after a lost lease. Its copies on
// other leases go first, each only if unchanged since read; the revoke deletes the rest. Until
// the re-claim, the pod's addresses are held back by their held keys, as after any lost
// lease. The caller holds the owner lock.
func (au *Auditor) KeysLost(ctx context.Context, p podbook.AuditPod, problems []string, copies []*mvccpb.KeyValue) error {
	au.cfg.PodKeysLost.Add(float64(len(problems)))
	au.cfg.Log.Error("keys of a running pod were deleted or changed in etcd; re-claiming its addresses",
		"owner", p.Owner, "lease", keyspace.LeaseHex(p.Lease), "keys", problems)
	if err := au.DropCopies(ctx, copies); err != nil {
		return err
	}
	if err := au.cfg.Keeper.Revoke(p.Lease); err != nil {
		return au.unavailable("revoke the lease of a pod whose keys were lost", err)
	}
	au.cfg.Pods.Lose(p.Lease)
	return nil
}

// DropCopies deletes keys of a running pod that carry its own value on a lease not its own
// (or none), each only if unchanged since read: left, one would outlive the pod.
func (au *Auditor) DropCopies(ctx context.Context, copies []*mvccpb.KeyValue) error {
	if len(copies) == 0 {
		return nil
	}
	ops := make([]clientv3.Op, 0, len(copies))
	for _, kv := range copies {
		ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{keyspace.Unchanged(string(kv.Key), kv.ModRevision)},
			[]clientv3.Op{clientv3.OpDelete(string(kv.Key))}, nil))
	}
	octx, cancel := au.opCtx(ctx)
	_, err := au.cfg.Client.Txn(octx).Then(ops...).Commit()
	cancel()
	if err != nil {
		return au.unavailable("delete the copies of a pod's keys on other leases", err)
	}
	return nil
}
