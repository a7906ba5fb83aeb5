package sticky

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/txn"
)

// The repair of one running attachment's sticky claim, under its owner's lock (keepClaimOnce):
// what the audit, the re-claim or the resolution of a conflict found not as the agent wrote
// it is put back, compared as read (see the top of keep.go).

// keepClaimOnce is one check and repair of at's claim; done is false when a compare failed
// and it should run again.
func (sc *Claims) keepClaimOnce(ctx context.Context, own *ownerlock.Owned, ps podbook.PodState, podLease clientv3.LeaseID, at podbook.Attachment, blocks allocator.Blocks) (done bool, _ error) {
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	owner := ps.Owner
	lease := at.ClaimLease
	if lease != 0 && !sc.keeper.Holds(lease) {
		// The keeper reported it lost: renewals stopped (etcd without a leader), or etcd no
		// longer has it (expired, revoked, or granted after a backup restored since).
		switch err := sc.keeper.Adopt(octx, lease); {
		case errors.Is(err, keeper.ErrLeaseLost):
			lease = 0
		case err != nil:
			return false, sc.unavailable("resume the claim lease "+keyspace.LeaseHex(lease), err)
		default:
			sc.log.Warn("the claim lease of a running pod had stopped being renewed; resumed", "owner", owner, "claim", at.Claim,
				"lease", keyspace.LeaseHex(lease))
		}
	}
	key := keyspace.ClaimKey(sc.cfg.Cluster, at.Pool, at.Claim)
	ownerKey := keyspace.OwnerKey(sc.cfg.Cluster, owner, at.IfName, at.Pool)
	resp, err := sc.cli.Txn(octx).Then(clientv3.OpGet(key), clientv3.OpGet(ownerKey)).Commit()
	if err != nil {
		return false, sc.unavailable("read the claim "+key, err)
	}
	recKV, oiKV := firstKV(resp, 0), firstKV(resp, 1)
	// The owner index: the pod audit and the re-claim keep it; an admin's release of the claim
	// drops the claim from it.
	if oiKV == nil || keyspace.LeaseOf(oiKV) != podLease {
		return true, nil
	}
	oi, err := keyspace.Decode[keyspace.OwnerRecord](ownerKey, oiKV.Value)
	if err != nil || oi.NodeUID != sc.cfg.NodeUID || oi.ContainerID != at.ContainerID {
		return true, nil
	}
	if oi.Claim != at.Claim {
		sc.pods.Change(own).SetClaim(at.IfName, at.Pool, at.ContainerID, "", 0, oiKV.ModRevision)
		if lease != 0 {
			if err := sc.keeper.Revoke(lease); err != nil {
				sc.log.Warn("revoking the lease of a released claim failed; it expires by itself", "lease", keyspace.LeaseHex(lease), "err", err)
			}
		}
		sc.log.Info("the sticky claim of a running pod was released by an admin; the pod keeps its addresses without it",
			"owner", owner, "claim", at.Claim, "pool", at.Pool)
		return true, nil
	}
	var rec keyspace.ClaimRecord
	recRead := recKV != nil
	if recRead {
		if rec, err = keyspace.Decode[keyspace.ClaimRecord](key, recKV.Value); err != nil {
			rec = keyspace.ClaimRecord{} // unreadable: as if it named no holder
		}
	}
	mine := recRead && rec.Holder != nil && rec.Holder.Owner == owner && rec.Holder.IfName == at.IfName
	// The addresses' keys: the attachment's, and those the record lists besides.
	addrs := slices.Clone(at.IPs)
	for _, ip := range rec.IPs {
		if !slices.Contains(addrs, ip) {
			addrs = append(addrs, ip)
		}
	}
	ops := make([]clientv3.Op, 0, 2*len(addrs))
	for _, ip := range addrs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(at.Pool, blocks, ip)), clientv3.OpGet(keyspace.QuarantineKey(at.Pool, blocks, ip)))
	}
	aresp, err := sc.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return false, sc.unavailable("read the addresses of the claim "+key, err)
	}
	var problems []string
	var cmps []clientv3.Cmp
	var puts []clientv3.Op
	type written struct {
		key string
		kv  *mvccpb.KeyValue // as read; nil: absent
	}
	var writes []written
	// Who holds the addresses: a claim naming another holder is taken over only from one
	// that holds none of them.
	var others []string
	othersAt := map[netip.Addr]bool{}
	ownsAll := true
	for i, ip := range addrs {
		kv := firstKV(aresp, 2*i)
		ipKey := keyspace.IPKey(at.Pool, blocks, ip)
		if kv == nil {
			cmps = append(cmps, keyspace.Absent(ipKey))
			if slices.Contains(at.IPs, ip) && !slices.Contains(at.Conflicts, ip) {
				ownsAll = false
			}
			continue
		}
		cmps = append(cmps, keyspace.Unchanged(ipKey, kv.ModRevision))
		al, err := keyspace.Decode[keyspace.Allocation](ipKey, kv.Value)
		if err != nil || al.Owner != owner || al.Cluster != sc.cfg.Cluster {
			others = append(others, fmt.Sprintf("%s held by %s (node %s, container %s)", ip, al.Owner, al.Node, al.ContainerID))
			othersAt[ip] = true
		}
	}
	holder := "none"
	if rec.Holder != nil {
		holder = fmt.Sprintf("%s/%s (node %s, container %s)", rec.Holder.Owner, rec.Holder.IfName, rec.Holder.Node, rec.Holder.ContainerID)
	}
	if recRead && !mine && (len(others) > 0 || !ownsAll) {
		if len(others) > 0 {
			what := fmt.Sprintf("holder %s, %v", holder, others)
			if sc.kept.conflictNew(key, what) {
				sc.log.Error("CONFLICT: the sticky claim of a running pod names another holder, which holds its addresses; "+
					"it is left to that holder", "owner", owner, "claim", at.Claim, "pool", at.Pool, "holder", holder, "held", others)
			}
		}
		// Else this pod's own addresses are being put back (the pod's re-claim or a conflict's
		// resolution): the claim is checked again then.
		return true, nil
	}
	sc.kept.conflictGone(key)
	// The claim's migratable mark: the record's, whoever it named (a VM's stays migratable),
	// or the attachment's (a record a restore took or brought back released lost it). The
	// attachment learns the record's: a live migration may start from it (T1), and its
	// source's audit then reads the migrations (readMigrations).
	migratable := recRead && rec.Migratable || at.ClaimMigratable
	learn := func() {
		if migratable && !at.ClaimMigratable {
			sc.pods.Change(own).ClaimMigratable(at.IfName, at.Pool)
			at.ClaimMigratable = true
		}
	}
	if lease == 0 {
		hold := at.ClaimHold
		if hold <= 0 {
			hold = sc.cfg.ClaimHold
		}
		g, err := sc.cli.Grant(octx, int64((hold+time.Second-1)/time.Second))
		if err != nil {
			return false, sc.unavailable("grant a claim lease", err)
		}
		if err := sc.keeper.Resume(g.ID); err != nil {
			return false, err
		}
		lease = g.ID
		problems = append(problems, fmt.Sprintf("claim lease %s: gone; the claim goes on new lease %s",
			keyspace.LeaseHex(at.ClaimLease), keyspace.LeaseHex(lease)))
	}
	on := clientv3.WithLease(lease)
	// The record.
	if !recRead || !sc.holderIs(rec.Holder, owner, at, podLease) || !slices.Equal(rec.IPs, at.IPs) || keyspace.LeaseOf(recKV) != lease ||
		rec.Migratable != migratable {
		switch {
		case !recRead:
			problems = append(problems, key+": missing")
		case !mine:
			problems = append(problems, fmt.Sprintf("%s: names holder %s, which holds none of its addresses", key, holder))
		case rec.Migratable != migratable:
			problems = append(problems, key+": not migratable, as the claim its holder took is")
		default:
			problems = append(problems, fmt.Sprintf("%s: lists %v on lease %s, want %v on %s", key, rec.IPs,
				keyspace.LeaseHex(keyspace.LeaseOf(recKV)), at.IPs, keyspace.LeaseHex(lease)))
		}
		hold := at.ClaimHold
		if hold <= 0 {
			hold = sc.cfg.ClaimHold
		}
		since := sc.wall()
		if mine && !rec.Since.IsZero() {
			since = rec.Since
		}
		nrec := keyspace.ClaimRecord{IPs: at.IPs, HoldSeconds: int64(hold / time.Second), Since: since,
			Holder: &keyspace.ClaimHolder{Owner: owner, Pod: ps.Pod, Node: sc.cfg.Node, NodeUID: sc.cfg.NodeUID,
				ContainerID: at.ContainerID, IfName: at.IfName, LeaseID: keyspace.LeaseHex(podLease)},
			Migratable: migratable}
		puts = append(puts, clientv3.OpPut(key, keyspace.Encode(nrec), on))
		writes = append(writes, written{key, recKV})
	}
	// The quarantine keys.
	q := keyspace.Encode(keyspace.QuarantineRecord{Claim: at.Claim})
	for i, ip := range addrs {
		kv := firstKV(aresp, 2*i+1)
		qKey := keyspace.QuarantineKey(at.Pool, blocks, ip)
		var qrec keyspace.QuarantineRecord
		if kv != nil {
			if qrec, err = keyspace.Decode[keyspace.QuarantineRecord](qKey, kv.Value); err != nil {
				qrec = keyspace.QuarantineRecord{}
			}
		}
		if !slices.Contains(at.IPs, ip) {
			// Listed by the record only: not this claim's any more.
			if kv != nil && qrec.Claim == at.Claim {
				problems = append(problems, qKey+": rests under the claim, which does not list it")
				cmps = append(cmps, keyspace.Unchanged(qKey, kv.ModRevision))
				puts = append(puts, clientv3.OpDelete(qKey))
			}
			continue
		}
		if slices.Contains(at.Conflicts, ip) || othersAt[ip] {
			continue // another owner holds it
		}
		switch {
		case kv != nil && qrec.Claim == at.Claim && keyspace.LeaseOf(kv) == lease:
			continue
		case kv != nil && qrec.Claim != "" && qrec.Claim != at.Claim:
			if sc.kept.conflictNew(qKey, qrec.Claim) {
				sc.log.Error("CONFLICT: an address of a running pod's sticky claim rests under another claim; it is left to that claim",
					"owner", owner, "claim", at.Claim, "ip", ip, "other_claim", qrec.Claim)
			}
			continue
		case kv == nil:
			problems = append(problems, qKey+": missing")
		default:
			problems = append(problems, fmt.Sprintf("%s: claim %q on lease %s, want %q on %s", qKey, qrec.Claim,
				keyspace.LeaseHex(keyspace.LeaseOf(kv)), at.Claim, keyspace.LeaseHex(lease)))
		}
		puts = append(puts, clientv3.OpPut(qKey, q, on))
		writes = append(writes, written{qKey, kv})
	}
	for _, w := range writes {
		if w.kv == nil {
			cmps = append(cmps, keyspace.Absent(w.key))
		} else {
			cmps = append(cmps, keyspace.Unchanged(w.key, w.kv.ModRevision))
		}
	}
	// The owner index names the claim lease: a DEL moves the claim only from that one.
	cmps = append(cmps, keyspace.Unchanged(ownerKey, oiKV.ModRevision))
	indexed := oi.ClaimLease != keyspace.LeaseHex(lease)
	if indexed {
		problems = append(problems, fmt.Sprintf("%s: names claim lease %s, want %s", ownerKey, oi.ClaimLease, keyspace.LeaseHex(lease)))
		oi.ClaimLease, oi.ClaimMigratable = keyspace.LeaseHex(lease), migratable
		puts = append(puts, clientv3.OpPut(ownerKey, keyspace.Encode(oi), clientv3.WithLease(podLease)))
	}
	drop := func() {
		if lease != at.ClaimLease {
			if err := sc.keeper.Revoke(lease); err != nil {
				sc.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(lease), "err", err)
			}
		}
	}
	if len(puts) == 0 {
		learn()
		keys, _ := stickyKeys(sc.cfg.Cluster, at, blocks)
		sc.recordClaimRight(ctx, owner, at, keys, podLease)
		return true, nil
	}
	tresp, err := sc.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil && txn.Refused(err) && txn.LeaseGone(err) && lease == at.ClaimLease && !sc.cfg.LeaseAlive(ctx, lease) {
		// Revoked or expired before the keeper's next renewal would have said so: the next
		// attempt puts the claim on a new one.
		sc.keeper.Forget(lease)
		return false, nil
	}
	if err != nil {
		drop() // what it may have written goes with it, and is put back again
		return false, sc.unavailable("put back the claim "+key, err)
	}
	if !tresp.Succeeded {
		drop()
		return false, nil
	}
	rev := oiKV.ModRevision
	if indexed {
		rev = tresp.Header.Revision
	}
	if lease != at.ClaimLease || indexed {
		sc.pods.Change(own).SetClaim(at.IfName, at.Pool, at.ContainerID, at.Claim, lease, rev)
	}
	learn()
	sc.cfg.KeysLost.Add(float64(len(problems)))
	sc.log.Error("the sticky claim of a running pod was missing or changed in etcd; put back", "owner", owner, "claim", at.Claim,
		"pool", at.Pool, "lease", keyspace.LeaseHex(lease), "keys", problems)
	return true, nil
}

// recordClaimRight reads owner's claim keys once more and records their ModRevisions if
// they are right (a repair wrote only some of them).
func (sc *Claims) recordClaimRight(ctx context.Context, owner string, at podbook.Attachment, keys []string, podLease clientv3.LeaseID) {
	ops := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		ops[i] = clientv3.OpGet(k)
	}
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	resp, err := sc.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return // the next audit reads them
	}
	kvs := make([]*mvccpb.KeyValue, len(keys))
	for i := range keys {
		kvs[i] = firstKV(resp, i)
	}
	if revs, ok := sc.claimRight(owner, at, kvs, podLease); ok {
		sc.kept.found(stickyCheck{ref: stickyRef{owner, at.IfName, at.Pool}, at: at, keys: keys}, revs)
	}
}

// firstKV is the first key-value of the i-th answer of resp, if any.
func firstKV(resp *clientv3.TxnResponse, i int) *mvccpb.KeyValue {
	if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
		return kvs[0]
	}
	return nil
}
