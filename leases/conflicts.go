package leases

import (
	"context"
	"maps"
	"net/netip"
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// A conflict is an address of a running pod that another owner took while the pod's lease was
// lost (a cut-off longer than the reuse delay, or a pool with no other room). The re-claim
// leaves it to that owner and records it (the conflict record, CHECK code 104, the
// attachment's Conflicts). It is resolved when it can be: the agent watches the address's
// allocation key, and as soon as the other owner lets it go (its DEL, or its lease's
// expiry) puts it back on the running pod's lease, before any other ADD can take it (a
// release leaves the address in quarantine, which the resolution, like every re-claim, does
// not compare). A running pod's address so never sits without a key.

// watchConflicts starts following every conflicted address the agent's pods list, and stops
// following those no pod lists any more.
func (a *Agent) watchConflicts() {
	want := map[conflictRef]bool{}
	for owner, ats := range a.pods.Conflicted() {
		for _, at := range ats {
			for _, addr := range at.Conflicts {
				want[conflictRef{Owner: owner, IfName: at.IfName, Pool: at.Pool, Addr: addr}] = true
			}
		}
	}
	a.rmu.Lock()
	maps.DeleteFunc(a.restoredHolds, func(ref conflictRef, _ int64) bool { return !want[ref] })
	a.rmu.Unlock()
	a.cmu.Lock()
	defer a.cmu.Unlock()
	if a.ctx.Err() != nil {
		return
	}
	for ref, stop := range a.cwatch {
		if !want[ref] {
			stop()
			delete(a.cwatch, ref)
		}
	}
	for ref := range want {
		if _, ok := a.cwatch[ref]; ok {
			continue
		}
		ctx, stop := context.WithCancel(a.ctx)
		a.cwatch[ref] = stop
		a.wg.Add(1)
		go a.followConflict(ctx, ref)
	}
	a.metrics.conflictsOpen.Set(float64(len(a.cwatch)))
}

// followConflict tries to resolve ref, and while the address is held by another owner waits
// for that owner's key to go, until the conflict is resolved or no longer the agent's. The
// other owner lets the address go by its release, which deletes its allocation and held key:
// an expiry of its lease leaves its held key, for its pod may still run on a node cut off, and
// the address stays held back until that hold ends too (but for another pod of the running
// pod's own sticky claim, heldForClaim, and for a hold a restore brought back from before the
// running pod had the address, restoredHold).
func (a *Agent) followConflict(ctx context.Context, ref conflictRef) {
	defer a.wg.Done()
	defer func() {
		a.cmu.Lock()
		if a.cwatch[ref] != nil && ctx.Err() == nil {
			delete(a.cwatch, ref)
		}
		a.metrics.conflictsOpen.Set(float64(len(a.cwatch)))
		a.cmu.Unlock()
	}()
	backoff := retryFirst
	for ctx.Err() == nil {
		key, rev, done, err := a.resolveConflict(ctx, ref)
		if done {
			return
		}
		if err != nil || key == "" { // key "": the conflict record moved meanwhile
			if err != nil {
				a.log.Warn("resolving a conflict failed; retrying", "owner", ref.Owner, "ip", ref.Addr, "err", err, "retry_in", backoff)
			}
			if !sleepCtx(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		backoff = retryFirst
		a.awaitDelete(ctx, key, rev)
	}
}

// awaitDelete returns once key is deleted after revision rev, or the watch breaks, or ctx ends.
func (a *Agent) awaitDelete(ctx context.Context, key string, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for resp := range a.cli.Watch(wctx, key, clientv3.WithRev(rev+1), clientv3.WithFilterPut()) {
		if resp.Err() != nil || len(resp.Events) > 0 {
			return
		}
	}
}

// resolveConflict puts ref's address back on its running pod's lease if no allocation holds
// it. It returns done when the conflict is resolved or is no longer the agent's (the pod was
// deleted, re-claimed anew, or its lease is lost: the re-claim takes over); else the key
// another owner holds the address with and the revision it was read at.
func (a *Agent) resolveConflict(ctx context.Context, ref conflictRef) (key string, rev int64, done bool, err error) {
	own := a.locks.Lock(ref.Owner)
	defer own.Unlock()
	ps, ok := a.pods.Snapshot(ref.Owner)
	lease, held := ps.Held()
	i := slices.IndexFunc(ps.Attachments, func(at attachment) bool { return at.IfName == ref.IfName && at.Pool == ref.Pool })
	if !ok || !held || i < 0 || ps.Attachments[i].Released || !slices.Contains(ps.Attachments[i].Conflicts, ref.Addr) {
		return "", 0, true, nil
	}
	at := ps.Attachments[i]
	p, err := a.pools.Ensure(ctx, allocator.PoolSpec{Name: ref.Pool})
	if err != nil {
		return "", 0, false, err
	}
	heldLease, heldRec, err := a.heldFor(ctx, ref.Owner)
	if err != nil {
		return "", 0, false, err
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	ipKey := keyspace.IPKey(ref.Pool, p.Spec.Blocks, ref.Addr)
	heldKey := keyspace.HeldKey(ref.Pool, p.Spec.Blocks, ref.Addr)
	ownerKey := keyspace.OwnerKey(a.cfg.Cluster, ref.Owner, ref.IfName, ref.Pool)
	conflictKey := keyspace.ConflictKey(a.cfg.Cluster, ref.Owner, ref.IfName, ref.Pool)
	qKey := keyspace.QuarantineKey(ref.Pool, p.Spec.Blocks, ref.Addr)
	cur, err := a.cli.Txn(octx).Then(clientv3.OpGet(conflictKey), clientv3.OpGet(heldKey), clientv3.OpGet(qKey)).Commit()
	if err != nil {
		return "", 0, false, a.unavailable("read "+conflictKey, err)
	}
	cmps := []clientv3.Cmp{keyspace.Absent(ipKey), keyspace.OnLease(ownerKey, lease)}
	q := cur.Responses[2].GetResponseRange().Kvs
	ownClaim := false // held back for another pod of the pod's own claim
	if held := cur.Responses[1].GetResponseRange().Kvs; len(held) > 0 {
		if !a.blockLeases.mine(clientv3.LeaseID(held[0].Lease)) {
			ownClaim = heldForClaim(held[0], q, at.Claim, a.cfg.Cluster)
			if !ownClaim && !a.restoredHold(ref, held[0]) {
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
	puts := []clientv3.Op{clientv3.OpPut(ipKey, keyspace.Encode(a.allocation(req, ref.Owner, lease, at.Created)), clientv3.WithLease(lease)),
		clientv3.OpDelete(keyspace.WantedKey(ref.Pool, p.Spec.Blocks, ref.Addr, a.cfg.Cluster, ref.Owner))}
	if heldLease != 0 {
		puts = append(puts, clientv3.OpPut(keyspace.HeldKey(ref.Pool, p.Spec.Blocks, ref.Addr), keyspace.Encode(heldRec), clientv3.WithLease(heldLease)))
	}
	claimCluster := a.cfg.Cluster
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
	if len(q) > 0 && !ownClaim && !restsUnder(q[0], at.Claim, claimCluster == a.cfg.Cluster) {
		c, p, claim, err := a.claimGivesUp(octx, claimCluster, ref, q[0])
		if err != nil {
			return "", 0, false, err
		}
		cmps, puts, gaveUp = append(cmps, c...), append(puts, p...), claim
	}
	resp, err := a.cli.Txn(octx).If(cmps...).Then(puts...).Else(clientv3.OpGet(ipKey, clientv3.WithKeysOnly()),
		clientv3.OpGet(ownerKey, clientv3.WithKeysOnly())).Commit()
	if err != nil {
		return "", 0, false, a.unavailable("take "+ref.Addr.String()+" back for its running pod", err)
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
	a.pods.Change(own).SetConflicts(ref.IfName, ref.Pool, left)
	if v := a.pools.ViewOf(ref.Pool); v != nil {
		v.MarkAllocated(ref.Addr, resp.Header.Revision)
	}
	if gaveUp != "" {
		a.log.Warn("a released sticky claim gives up an address to the running pod that had it first: the claim's next pod "+
			"is given a new one", "claim", gaveUp, "claim_cluster", claimCluster, "pool", ref.Pool, "ip", ref.Addr, "owner", ref.Owner)
	}
	a.metrics.conflictsResolved.Inc()
	a.log.Warn("conflict resolved: the other holder let the address go, and it is the running pod's again",
		"owner", ref.Owner, "ifname", ref.IfName, "pool", ref.Pool, "ip", ref.Addr, "lease", keyspace.LeaseHex(lease),
		"conflicts_left", len(left))
	if at.Claim != "" {
		// The pod's sticky claim, left to the other holder while it held the address.
		if err := a.sticky.keepClaimLocked(ctx, own, stickyRef{ref.Owner, ref.IfName, ref.Pool}); err != nil {
			a.log.Warn("checking the sticky claim of a pod whose conflict was resolved failed; the next audit checks it",
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
// (readClaim), and a running pod of the claim takes them back as well. A restored backup
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

// noteRestoredHolds records, for a re-claim of owner's attachment at after etcd went back in
// time, the held keys of other owners (holds, by address) on addresses the pod held when the
// agent found etcd gone back: keys the restore brought back, for their ModRevisions are of
// etcd's history before the pod had these addresses (restoredHold).
func (a *Agent) noteRestoredHolds(owner string, at attachment, holds map[netip.Addr]int64) {
	a.rmu.Lock()
	defer a.rmu.Unlock()
	for ip, rev := range holds {
		ref := conflictRef{Owner: owner, IfName: at.IfName, Pool: at.Pool, Addr: ip}
		if a.backHeld[ref] && !slices.Contains(at.Conflicts, ip) {
			a.restoredHolds[ref] = rev
		}
	}
}

// restoredHold tells whether held, another owner's held key of ref's address, is one a
// restore brought back that the re-claim found on an address the running pod held when the
// agent found etcd gone back: the pod had the address in etcd's history after that hold was
// written, so the hold had ended or been passed over by then, and it keeps the address from
// the pod no longer than the other owner's allocation does. Its block lease may be of a node
// gone since, or of an identity replaced since, which nobody renews and which stands for
// 1.5 x (TTL + reuse delay): waited for, it would keep the running pod from its address for
// that long. A hold written since (its ModRevision moved) is waited for.
func (a *Agent) restoredHold(ref conflictRef, held *mvccpb.KeyValue) bool {
	a.rmu.Lock()
	defer a.rmu.Unlock()
	rev, ok := a.restoredHolds[ref]
	return ok && rev == held.ModRevision
}

// claimGivesUp handles an address that rests in quarantine under a released sticky claim: its
// holder took it while this pod's node was away past the reuse delay, then was deleted. The
// running pod had it first and takes it back, and the claim gives it up, so that the claim's
// next pod is given a new address for that range set instead of being refused for as long as
// this pod runs. It returns what the resolution compares and writes for it, and the claim's
// name; nothing for an ordinary release's quarantine key (a resolution does not compare it)
// or a claim that names a holder.
func (a *Agent) claimGivesUp(ctx context.Context, cluster string, ref conflictRef, q *mvccpb.KeyValue) ([]clientv3.Cmp, []clientv3.Op, string, error) {
	qKey := string(q.Key)
	rec, err := keyspace.Decode[keyspace.QuarantineRecord](qKey, q.Value)
	if err != nil || rec.Claim == "" {
		return nil, nil, "", nil
	}
	key := keyspace.ClaimKey(cluster, ref.Pool, rec.Claim)
	resp, err := a.cli.Get(ctx, key)
	if err != nil {
		return nil, nil, "", a.unavailable("read claim "+key, err)
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

// stopConflicts ends the conflict watches of owner's attachments that no longer list them
// (after its DEL).
func (a *Agent) stopConflicts(owner string) {
	a.cmu.Lock()
	mine := false
	for ref := range a.cwatch {
		mine = mine || ref.Owner == owner
	}
	a.cmu.Unlock()
	if mine {
		a.watchConflicts()
	}
}
