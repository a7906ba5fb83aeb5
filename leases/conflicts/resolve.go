package conflicts

import (
	"context"
	"net/netip"
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

// resolveConflict puts ref's address back on its running pod's lease if no allocation holds
// it. It returns done when the conflict is resolved or is no longer the agent's (the pod was
// deleted, re-claimed anew, or its lease is lost: the re-claim takes over); else the key
// another owner holds the address with and the revision it was read at.
func (cw *Watch) resolveConflict(ctx context.Context, ref podbook.ConflictRef) (key string, rev int64, done bool, err error) {
	own := cw.locks.Lock(ref.Owner)
	defer own.Unlock()
	ps, ok := cw.pods.Snapshot(ref.Owner)
	lease, held := ps.Held()
	i := slices.IndexFunc(ps.Attachments, func(at podbook.Attachment) bool { return at.IfName == ref.IfName && at.Pool == ref.Pool })
	if !ok || !held || i < 0 || ps.Attachments[i].Released || !slices.Contains(ps.Attachments[i].Conflicts, ref.Addr) {
		return "", 0, true, nil
	}
	at := ps.Attachments[i]
	p, err := cw.pools.Ensure(ctx, allocator.PoolSpec{Name: ref.Pool})
	if err != nil {
		return "", 0, false, err
	}
	heldLease, heldRec, err := cw.cfg.HeldFor(ctx, ref.Owner)
	if err != nil {
		return "", 0, false, err
	}
	octx, cancel := cw.opCtx(ctx)
	defer cancel()
	ipKey := keyspace.IPKey(ref.Pool, p.Spec.Blocks, ref.Addr)
	heldKey := keyspace.HeldKey(ref.Pool, p.Spec.Blocks, ref.Addr)
	ownerKey := keyspace.OwnerKey(cw.cfg.Cluster, ref.Owner, ref.IfName, ref.Pool)
	conflictKey := keyspace.ConflictKey(cw.cfg.Cluster, ref.Owner, ref.IfName, ref.Pool)
	qKey := keyspace.QuarantineKey(ref.Pool, p.Spec.Blocks, ref.Addr)
	cur, err := cw.cli.Txn(octx).Then(clientv3.OpGet(conflictKey), clientv3.OpGet(heldKey), clientv3.OpGet(qKey)).Commit()
	if err != nil {
		return "", 0, false, cw.unavailable("read "+conflictKey, err)
	}
	cmps := []clientv3.Cmp{keyspace.Absent(ipKey), keyspace.OnLease(ownerKey, lease)}
	q := cur.Responses[2].GetResponseRange().Kvs
	ownClaim := false // held back for another pod of the pod's own claim
	if held := cur.Responses[1].GetResponseRange().Kvs; len(held) > 0 {
		if !cw.cfg.Mine(clientv3.LeaseID(held[0].Lease)) {
			ownClaim = heldForClaim(held[0], q, at.Claim, cw.cfg.Cluster)
			if !ownClaim && !cw.restoredHold(ref, held[0]) {
				// Held back for the other owner, whose lease expired without a release.
				return heldKey, cur.Header.Revision, false, nil
			}
			if ownClaim {
				cmps = append(cmps, keyspace.Unchanged(qKey, q[0].ModRevision))
			}
		}
		cmps = append(cmps, keyspace.Unchanged(heldKey, held[0].ModRevision))
	} else {
		cmps = append(cmps, keyspace.Absent(heldKey))
	}
	conflictKVs := cur.Responses[0].GetResponseRange().Kvs
	req := allocator.Request{Pod: ps.Pod, ContainerID: at.ContainerID, IfName: at.IfName, Network: at.Network}
	puts := []clientv3.Op{clientv3.OpPut(ipKey, keyspace.Encode(cw.cfg.Allocation(req, ref.Owner, lease, at.Created)), clientv3.WithLease(lease)),
		clientv3.OpDelete(keyspace.WantedKey(ref.Pool, p.Spec.Blocks, ref.Addr, cw.cfg.Cluster, ref.Owner))}
	if heldLease != 0 {
		puts = append(puts, clientv3.OpPut(keyspace.HeldKey(ref.Pool, p.Spec.Blocks, ref.Addr), keyspace.Encode(heldRec), clientv3.WithLease(heldLease)))
	}
	claimCluster := cw.cfg.Cluster
	if len(conflictKVs) > 0 {
		// The conflict record lists what is still taken: without this address, or gone.
		cmps = append(cmps, keyspace.Unchanged(conflictKey, conflictKVs[0].ModRevision))
		rec, _ := keyspace.Decode[keyspace.ConflictRecord](conflictKey, conflictKVs[0].Value)
		if i := slices.IndexFunc(rec.Taken, func(t keyspace.TakenByOther) bool { return t.IP == ref.Addr && t.Cluster != "" }); i >= 0 {
			claimCluster = rec.Taken[i].Cluster
		}
		rec.Taken = slices.DeleteFunc(rec.Taken, func(t keyspace.TakenByOther) bool { return t.IP == ref.Addr })
		if len(rec.Taken) == 0 {
			puts = append(puts, clientv3.OpDelete(conflictKey))
		} else {
			puts = append(puts, clientv3.OpPut(conflictKey, keyspace.Encode(rec), clientv3.WithLease(lease)))
		}
	}
	var gaveUp string
	if len(q) > 0 && !ownClaim && !restsUnder(q[0], at.Claim, claimCluster == cw.cfg.Cluster) {
		c, p, claim, err := cw.claimGivesUp(octx, claimCluster, ref, q[0])
		if err != nil {
			return "", 0, false, err
		}
		cmps, puts, gaveUp = append(cmps, c...), append(puts, p...), claim
	}
	resp, err := cw.cli.Txn(octx).If(cmps...).Then(puts...).Else(clientv3.OpGet(ipKey, clientv3.WithKeysOnly()),
		clientv3.OpGet(ownerKey, clientv3.WithKeysOnly())).Commit()
	if err != nil {
		return "", 0, false, cw.unavailable("take "+ref.Addr.String()+" back for its running pod", err)
	}
	if !resp.Succeeded {
		if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) == 0 || !keyspace.HeldOn(kvs[0], lease) {
			return "", 0, true, nil // the attachment is not on this lease any more: the re-claim or DEL has it
		}
		if len(resp.Responses[0].GetResponseRange().Kvs) == 0 {
			return "", 0, false, nil // the address is free: the conflict record or held key moved, read again
		}
		return ipKey, resp.Header.Revision, false, nil
	}
	left := slices.DeleteFunc(slices.Clone(at.Conflicts), func(x netip.Addr) bool { return x == ref.Addr })
	cw.pods.Change(own).SetConflicts(ref.IfName, ref.Pool, left)
	if v := cw.pools.ViewOf(ref.Pool); v != nil {
		v.MarkAllocated(ref.Addr, resp.Header.Revision)
	}
	if gaveUp != "" {
		cw.log.Warn("a released sticky claim gives up an address to the running pod that had it first: the claim's next pod "+
			"is given a new one", "claim", gaveUp, "claim_cluster", claimCluster, "pool", ref.Pool, "ip", ref.Addr, "owner", ref.Owner)
	}
	cw.cfg.Resolved.Inc()
	cw.log.Warn("conflict resolved: the other holder let the address go, and it is the running pod's again",
		"owner", ref.Owner, "ifname", ref.IfName, "pool", ref.Pool, "ip", ref.Addr, "lease", keyspace.LeaseHex(lease),
		"conflicts_left", len(left))
	if at.Claim != "" {
		// The pod's sticky claim, left to the other holder while it held the address.
		if err := cw.cfg.KeepClaim(ctx, own, ref.Owner, ref.IfName, ref.Pool); err != nil {
			cw.log.Warn("checking the sticky claim of a pod whose conflict was resolved failed; the next audit checks it",
				"owner", ref.Owner, "claim", at.Claim, "err", err)
		}
	}
	return "", 0, true, nil
}

// restsUnder tells whether q, a quarantine key, rests under claim of this cluster (same):
// the running pod's own claim, which gives nothing up to it.
func restsUnder(q *mvccpb.KeyValue, claim string, same bool) bool {
	if claim == "" || !same {
		return false
	}
	rec, err := keyspace.Decode[keyspace.QuarantineRecord](string(q.Key), q.Value)
	return err == nil && rec.Claim == claim
}

// heldForClaim tells whether held, the held key of an address held back for a pod of another
// node, holds it back for a pod of claim of cluster, the running pod's own: the address
// rests under that claim (q, its quarantine key) and held names an owner of cluster. Such a
// key does not keep the address from the running pod, as it keeps it from others: an ADD
// naming the claim takes the claim's addresses over it once no allocation stands
// (sticky.Claims.Read), and a running pod of the claim takes them back as well. A restored backup
// brings back the held keys of the claim's earlier holders, on block leases of nodes gone
// since that stand for the reuse delay: waited for, they would keep the running pod from its
// addresses, and its claim's quarantine keys off its claim lease, for that long.
func heldForClaim(held *mvccpb.KeyValue, q []*mvccpb.KeyValue, claim, cluster string) bool {
	if len(q) == 0 || !restsUnder(q[0], claim, true) {
		return false
	}
	rec, err := keyspace.Decode[keyspace.HeldRecord](string(held.Key), held.Value)
	return err == nil && rec.Cluster == cluster
}

// claimGivesUp handles an address that rests in quarantine under a released sticky claim: its
// holder took it while this pod's node was away past the reuse delay, then was deleted. The
// running pod had it first and takes it back, and the claim gives it up, so that the claim's
// next pod is given a new address for that range set instead of being refused for as long as
// this pod runs. It returns what the resolution compares and writes for it, and the claim's
// name; nothing for an ordinary release's quarantine key (a resolution does not compare it)
// or a claim that names a holder.
func (cw *Watch) claimGivesUp(ctx context.Context, cluster string, ref podbook.ConflictRef, q *mvccpb.KeyValue) ([]clientv3.Cmp, []clientv3.Op, string, error) {
	qKey := string(q.Key)
	rec, err := keyspace.Decode[keyspace.QuarantineRecord](qKey, q.Value)
	if err != nil || rec.Claim == "" {
		return nil, nil, "", nil
	}
	key := keyspace.ClaimKey(cluster, ref.Pool, rec.Claim)
	resp, err := cw.cli.Get(ctx, key)
	if err != nil {
		return nil, nil, "", cw.unavailable("read claim "+key, err)
	}
	cmps := []clientv3.Cmp{keyspace.Unchanged(qKey, q.ModRevision)}
	ops := []clientv3.Op{clientv3.OpDelete(qKey)}
	if len(resp.Kvs) == 0 {
		return append(cmps, keyspace.Absent(key)), ops, rec.Claim, nil
	}
	kv := resp.Kvs[0]
	claim, err := keyspace.Decode[keyspace.ClaimRecord](key, kv.Value)
	if err != nil {
		return nil, nil, "", err
	}
	if claim.Holder != nil {
		return nil, nil, "", nil
	}
	claim.IPs = slices.DeleteFunc(claim.IPs, func(x netip.Addr) bool { return x == ref.Addr })
	cmps = append(cmps, keyspace.Unchanged(key, kv.ModRevision))
	if len(claim.IPs) == 0 {
		return cmps, append(ops, clientv3.OpDelete(key)), rec.Claim, nil
	}
	return cmps, append(ops, clientv3.OpPut(key, keyspace.Encode(claim), clientv3.WithLease(clientv3.LeaseID(kv.Lease)))), rec.Claim, nil
}
