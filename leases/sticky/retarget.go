package sticky

import (
	"context"
	"fmt"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

// The re-claim of a live migration's target whose pod lease was lost (leases/reclaim): its
// migration key, owner index and pod record went with the lease, and the claim's addresses
// are its source's, on the source's pod lease. Re-claimed as any pod, it would find them
// taken and record a conflict against its own source; instead its migration key and owner
// index are written again on the new lease (T1 again), or, the source gone meanwhile, the
// claim is taken over as T4 does.

// Retargeted is what ReclaimTarget did: the owner index's ModRevision, and whether the
// attachment holds the claim alone now (no longer a target).
type Retargeted struct {
	Rev      int64
	Promoted bool
}

// ReclaimTarget re-claims owner's target attachment at of pod ps on lease, in a pool of
// layout blocks, under owner's lock. ok false: the claim is in no state a target can take up
// again (released, another target's, its addresses on no holder's lease or another node's
// holder gone only in part), and the attachment is re-claimed as any. Its errors wrap
// allocator.ErrUnavailable.
func (sc *Claims) ReclaimTarget(ctx context.Context, ps podbook.PodState, at podbook.Attachment, lease clientv3.LeaseID,
	blocks allocator.Blocks) (_ Retargeted, ok bool, _ error) {
	key := keyspace.ClaimKey(sc.cfg.Cluster, at.Pool, at.Claim)
	mkey := keyspace.LiveMigrationKey(sc.cfg.Cluster, at.Pool, at.Claim)
	ownerKey := keyspace.OwnerKey(sc.cfg.Cluster, ps.Owner, at.IfName, at.Pool)
	ops := []clientv3.Op{clientv3.OpGet(key), clientv3.OpGet(mkey), clientv3.OpGet(ownerKey)}
	for _, ip := range at.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(at.Pool, blocks, ip), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.QuarantineKey(at.Pool, blocks, ip), clientv3.WithKeysOnly()))
	}
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	resp, err := sc.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return Retargeted{}, false, sc.unavailable("read the live migration of claim "+at.Claim, err)
	}
	ckv, mkv, okv := firstKV(resp, 0), firstKV(resp, 1), firstKV(resp, 2)
	if okv != nil {
		if keyspace.HeldOn(okv, lease) && (mkv != nil && keyspace.HeldOn(mkv, lease) || ckv != nil && keyspace.HeldOn(ckv, at.ClaimLease)) {
			// Done by an earlier attempt whose answer was lost: written again, or taken over.
			return Retargeted{Rev: okv.ModRevision, Promoted: mkv == nil}, true, nil
		}
		return Retargeted{}, false, fmt.Errorf("%w: re-claim %s: the owner index is still on lease %s", allocator.ErrUnavailable,
			ownerKey, keyspace.LeaseHex(keyspace.LeaseOf(okv)))
	}
	if ckv == nil || mkv != nil {
		return Retargeted{}, false, nil // released, or another target's
	}
	rec, err := keyspace.Decode[keyspace.ClaimRecord](key, ckv.Value)
	if err != nil || rec.Holder == nil || rec.Holder.Owner == ps.Owner || !slices.Equal(rec.IPs, at.IPs) {
		return Retargeted{}, false, nil
	}
	m, err := sc.targetRecord(ctx, ps, at, lease, *rec.Holder)
	if err != nil {
		return Retargeted{}, false, err
	}
	la, _ := keyspace.ParseLeaseHex(rec.Holder.LeaseID)
	cmps := []clientv3.Cmp{keyspace.Unchanged(key, ckv.ModRevision), keyspace.Absent(mkey), keyspace.Absent(ownerKey)}
	allocated, onSource := 0, 0
	for i, ip := range at.IPs {
		ipKey := keyspace.IPKey(at.Pool, blocks, ip)
		if kv := firstKV(resp, 3+2*i); kv != nil {
			allocated++
			if la != 0 && keyspace.HeldOn(kv, la) {
				onSource++
			}
			cmps = append(cmps, keyspace.OnLease(ipKey, la))
		} else {
			cmps = append(cmps, keyspace.Absent(ipKey))
		}
		var qrev int64
		if q := firstKV(resp, 4+2*i); q != nil {
			qrev = q.ModRevision
		}
		cmps = append(cmps, keyspace.Unchanged(keyspace.QuarantineKey(at.Pool, blocks, ip), qrev))
	}
	onLease := clientv3.WithLease(lease)
	idx := podbook.OwnerIndexOf(at, sc.cfg.Node, sc.cfg.NodeUID, lease)
	puts := []clientv3.Op{clientv3.OpPut(ownerKey, keyspace.Encode(idx), onLease)}
	promoted := allocated == 0
	switch {
	case promoted:
		moved, err := moves(sc.cfg.Cluster, at.Pool, at.Claim, blocks, m, rec, at.Network, sc.wall())
		if err != nil {
			return Retargeted{}, false, err
		}
		puts = append(puts, moved...)
	case onSource == len(at.IPs) && rec.Holder.Node != sc.cfg.Node && rec.Migratable:
		puts = append(puts, clientv3.OpPut(mkey, keyspace.Encode(m), onLease))
	default:
		return Retargeted{}, false, nil
	}
	tresp, err := sc.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil {
		return Retargeted{}, false, sc.unavailable("re-claim the live migration's target of claim "+at.Claim, err)
	}
	if !tresp.Succeeded {
		return Retargeted{}, false, fmt.Errorf("%w: re-claim %s: the live migration of claim %q changed while read", allocator.ErrUnavailable,
			ownerKey, at.Claim)
	}
	if promoted {
		sc.cfg.Live.Completed(SourceExpired)
		sc.log.Warn("a live migration's target re-claimed after its lease was lost takes the claim: its source is gone", "claim", at.Claim,
			"owner", ps.Owner, "source", rec.Holder.Owner, "ips", at.IPs)
	} else {
		sc.started(mkey, m)
		sc.log.Warn("a live migration's target re-claimed after its lease was lost: its migration key is written again",
			"claim", at.Claim, "owner", ps.Owner, "source", rec.Holder.Owner, "lease", keyspace.LeaseHex(lease))
	}
	return Retargeted{Rev: tresp.Header.Revision, Promoted: promoted}, true, nil
}
