package attach

import (
	"context"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
)

// repeated answers an ADD of an attachment this agent holds on lease: with the addresses its
// owner index names. Without an owner index etcd lost it (deleted by hand, or a restored
// backup): the pod is re-claimed as the audit would have it, and the ADD answered code 11; a
// claim would give the attachment new addresses while its sandbox uses the old ones.
func (x *Attachments) repeated(ctx context.Context, p *poolview.Pool, st *addState, lease clientv3.LeaseID) (allocator.Result, bool, error) {
	key := ownerKeyOf(x, st, p)
	octx, cancel := x.opCtx(ctx)
	resp, err := x.cli.Get(octx, key)
	cancel()
	if err != nil {
		return allocator.Result{}, false, unavailable("read owner index "+key, err)
	}
	if len(resp.Kvs) > 0 {
		return x.existing(ctx, p, st, resp.Kvs[0])
	}
	if err := x.cfg.KeysLost(ctx, podbook.AuditPod{Owner: st.owner, Lease: lease}, []string{key + ": missing"}); err != nil {
		return allocator.Result{}, false, err
	}
	x.cfg.Wake()
	return allocator.Result{}, false, fmt.Errorf("%w: the owner index %s was gone from etcd; the pod's addresses are being "+
		"re-claimed: retry", allocator.ErrUnavailable, key)
}

// existing answers an ADD for an attachment that already has addresses. The same container
// gets them again. A new container of the same pod (a sandbox re-created without a DEL)
// takes the attachment over, keeping the addresses; the old container's late DEL then
// compares its container ID and releases nothing.
func (x *Attachments) existing(ctx context.Context, p *poolview.Pool, st *addState, kv *mvccpb.KeyValue) (allocator.Result, bool, error) {
	rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
	if err != nil {
		return allocator.Result{}, false, err
	}
	if rec.NodeUID != x.cfg.NodeUID {
		return allocator.Result{}, false, x.foreign(st.owner, string(kv.Key), rec.Node, rec.NodeUID, keyspace.LeaseOf(kv))
	}
	lease := keyspace.LeaseOf(kv)
	if !x.keeper.Holds(lease) {
		octx, cancel := x.opCtx(ctx)
		defer cancel()
		if err := x.keeper.Adopt(octx, lease); err != nil {
			return allocator.Result{}, false, unavailable("resume the pod lease", err)
		}
	}
	rev := kv.ModRevision
	if rec.ContainerID != st.req.ContainerID {
		if rev, err = x.rebind(ctx, p, st, kv, rec, lease); err != nil {
			return allocator.Result{}, false, err
		}
	}
	x.loops.ClaimedOn(ctx, st.req, st.own, lease, podbook.AttachmentOf(rec, st.req.IfName, p.Spec.Name, st.req.ContainerID, rev))
	res, err := Result(&p.Spec, rec.IPs)
	return res, true, err
}

// rebind moves an attachment's keys to a new container ID in one transaction that
// compares the owner index's revision and every address's lease. It returns the revision
// it wrote them at.
func (x *Attachments) rebind(ctx context.Context, p *poolview.Pool, st *addState, kv *mvccpb.KeyValue, rec keyspace.OwnerRecord, lease clientv3.LeaseID) (int64, error) {
	now := x.wall()
	withLease := clientv3.WithLease(lease)
	cmps := []clientv3.Cmp{keyspace.Unchanged(string(kv.Key), kv.ModRevision)}
	var puts []clientv3.Op
	for _, addr := range rec.IPs {
		key := keyspace.IPKey(p.Spec.Name, p.Spec.Blocks, addr)
		cmps = append(cmps, keyspace.OnLease(key, lease))
		puts = append(puts, clientv3.OpPut(key, keyspace.Encode(x.Allocation(st.req, st.owner, lease, rec.Created)), withLease))
	}
	newRec := rec
	newRec.ContainerID = st.req.ContainerID
	puts = append(puts,
		clientv3.OpPut(string(kv.Key), keyspace.Encode(newRec), withLease),
		clientv3.OpPut(keyspace.PodKey(x.cfg.Cluster, x.cfg.Node, st.owner), keyspace.Encode(x.PodRecord(st.req, st.owner, lease, now)), withLease))
	octx, cancel := x.opCtx(ctx)
	defer cancel()
	resp, err := x.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil {
		return 0, unavailable("re-bind attachment to the new container", err)
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("%w: attachment %s changed while it was re-bound to container %s; retry",
			allocator.ErrUnavailable, kv.Key, st.req.ContainerID)
	}
	x.log.Info("attachment re-bound to a new container of the same owner",
		"owner", st.owner, "ifname", st.req.IfName, "pool", p.Spec.Name, "old_container", rec.ContainerID, "container", st.req.ContainerID)
	return resp.Header.Revision, nil
}

// ResumePod takes over the lease of a pod record this node identity wrote earlier.
func (x *Attachments) ResumePod(ctx context.Context, own *ownerlock.Owned, podKV *mvccpb.KeyValue) error {
	owner := own.Owner()
	rec, err := keyspace.Decode[keyspace.PodRecord](string(podKV.Key), podKV.Value)
	if err != nil {
		return err
	}
	lease := clientv3.LeaseID(podKV.Lease)
	if rec.NodeUID != x.cfg.NodeUID {
		return x.foreign(owner, string(podKV.Key), x.cfg.Node, rec.NodeUID, lease)
	}
	octx, cancel := x.opCtx(ctx)
	defer cancel()
	if x.hold.Pending() > 0 {
		// Since its start the agent knows every pod of its node: a record it does not know,
		// once etcd went back in time, is one the backup brought back of a pod deleted since.
		// Its keys go (what a restore brings back that is gone stays gone); a lease the agent
		// holds for another pod keeps its own keys, and only the record goes.
		var err error
		if x.keeper.Holds(lease) {
			_, err = x.cli.Txn(octx).If(keyspace.Unchanged(string(podKV.Key), podKV.ModRevision)).
				Then(clientv3.OpDelete(string(podKV.Key))).Commit()
		} else {
			err = x.keeper.Revoke(lease)
		}
		if err != nil {
			return unavailable("remove the record of a pod deleted before etcd went back in time", err)
		}
		x.log.Warn("a record of a pod deleted before etcd went back in time was brought back; removed",
			"owner", owner, "lease", keyspace.LeaseHex(lease))
		return nil
	}
	if err := x.keeper.Adopt(octx, lease); err != nil {
		return unavailable("resume the pod lease", err)
	}
	x.loops.ClaimedOn(ctx, allocator.Request{Pod: rec.Pod, Netns: rec.Netns}, own, lease)
	return nil
}

// foreign is the error for keys of this owner that another node identity holds: they are
// never adopted (the same-name replacement, docs/field-failures.md); they leave with their lease.
func (x *Attachments) foreign(owner, key, node, uid string, lease clientv3.LeaseID) error {
	return fmt.Errorf("%w: owner %s already has %s, written by node %s with identity %s (this agent is %s); "+
		"leasehold never adopts another node identity's allocations: they expire with lease %s within %s; retry after that, "+
		"or release them with leaseholdctl",
		allocator.ErrUnavailable, owner, key, node, uid, x.cfg.NodeUID, keyspace.LeaseHex(lease), x.cfg.LeaseTTL)
}
