package sticky

import (
	"context"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
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

// Retargeted is what ReclaimTarget did: the owner index's ModRevision, whether the
// attachment holds the claim alone now (no longer a target), and the claim lease its keys
// name (at's, or one granted anew when etcd no longer has at's).
type Retargeted struct {
	Rev        int64
	Promoted   bool
	ClaimLease clientv3.LeaseID
}

// ReclaimTarget re-claims owner's target attachment at of pod ps on lease, in a pool of
// layout blocks, under owner's lock. A claim not yet as its source's agent keeps it
// (unsettled: after etcd went back in time) is waited for, a few lease TTLs (awaitSource).
// ok false: the claim is in no state a target can take up again (unreadable, naming this
// pod, other addresses, its holder on this node or not migratable, its addresses on another
// node's holder only in part, or unsettled past the wait), and the attachment is re-claimed
// as any. Its errors wrap allocator.ErrUnavailable.
func (sc *Claims) ReclaimTarget(ctx context.Context, ps podbook.PodState, at podbook.Attachment, lease clientv3.LeaseID,
	blocks allocator.Blocks) (_ Retargeted, ok bool, _ error) {
	ownerKey := keyspace.OwnerKey(sc.cfg.Cluster, ps.Owner, at.IfName, at.Pool)
	given := at // at's claim lease may be replaced by one granted anew
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	r, err := sc.readTarget(octx, at, blocks, clientv3.OpGet(ownerKey))
	if err != nil {
		return Retargeted{}, false, err
	}
	key, mkey, rec := r.key, r.mkey, r.rec
	ckv, mkv, okv := r.ckv, r.mkv, r.extra(0)
	wait := ownerKey + " " + at.ContainerID
	if okv != nil {
		sc.waits.Delete(wait)       // an earlier attempt wrote it: not waiting
		claimLease := at.ClaimLease // the one the index names: granted anew by that attempt, maybe
		if idx, err := keyspace.Decode[keyspace.OwnerRecord](ownerKey, okv.Value); err == nil && idx.ClaimLease != "" {
			claimLease, _ = keyspace.ParseLeaseHex(idx.ClaimLease)
		}
		if keyspace.HeldOn(okv, lease) && (mkv != nil && keyspace.HeldOn(mkv, lease) || ckv != nil && keyspace.HeldOn(ckv, claimLease)) {
			// Done by an earlier attempt whose answer was lost: written again, or taken over.
			return Retargeted{Rev: okv.ModRevision, Promoted: mkv == nil, ClaimLease: claimLease}, true, nil
		}
		return Retargeted{}, false, fmt.Errorf("%w: re-claim %s: the owner index is still on lease %s", allocator.ErrUnavailable,
			ownerKey, keyspace.LeaseHex(keyspace.LeaseOf(okv)))
	}
	acmps, allocated, onSource := r.addrCmps(at, blocks)
	if why := r.unsettled(allocated, onSource, at.Source, ps.Owner); why != "" {
		if err := sc.awaitSource(wait, at, why); err != nil {
			return Retargeted{}, false, err
		}
		return Retargeted{}, false, nil // waited long enough: re-claimed as any
	}
	sc.waits.Delete(wait)
	if r.recErr != nil || rec.Holder == nil || rec.Holder.Owner == ps.Owner || !slices.Equal(rec.IPs, at.IPs) {
		return Retargeted{}, false, nil // not a claim this target can take up
	}
	promoted := allocated == 0
	if !promoted && (onSource < len(at.IPs) || rec.Holder.Node == sc.cfg.Node || !rec.Migratable) {
		return Retargeted{}, false, nil
	}
	m, claimLease, err := sc.targetRecord(ctx, ps, at, lease, *rec.Holder, sc.targetHold(at, rec))
	if err != nil {
		return Retargeted{}, false, err
	}
	// The owner index names the lease the keys are on, or move onto, and the claim migratable:
	// a target's is by construction.
	at.ClaimLease, at.ClaimMigratable = claimLease, true
	cmps := append([]clientv3.Cmp{keyspace.Unchanged(key, ckv.ModRevision), keyspace.Absent(mkey), keyspace.Absent(ownerKey)}, acmps...)
	onLease := clientv3.WithLease(lease)
	idx := podbook.OwnerIndexOf(at, sc.cfg.Node, sc.cfg.NodeUID, lease)
	puts := []clientv3.Op{clientv3.OpPut(ownerKey, keyspace.Encode(idx), onLease)}
	if promoted {
		moved, err := moves(sc.cfg.Cluster, at.Pool, at.Claim, blocks, m, rec, at.Network, sc.wall())
		if err != nil {
			sc.dropLease(given, claimLease)
			return Retargeted{}, false, err
		}
		puts = append(puts, moved...)
	} else {
		puts = append(puts, clientv3.OpPut(mkey, keyspace.Encode(m), onLease))
	}
	tresp, err := sc.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil {
		// Unanswered, it may have applied on claimLease: the next attempt reads the index.
		return Retargeted{}, false, sc.unavailable("re-claim the live migration's target of claim "+at.Claim, err)
	}
	if !tresp.Succeeded {
		sc.dropLease(given, claimLease)
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
	return Retargeted{Rev: tresp.Header.Revision, Promoted: promoted, ClaimLease: claimLease}, true, nil
}

// unsettled tells, for a target being re-claimed, why its claim is not as its source's agent
// keeps it, or "": the record missing or naming no holder, a migration key naming another
// target, a holder other than the target's source (podbook.Attachment.Source: a hand-over
// never happens while a target lives), or an address allocated but not on the pod lease the
// record's holder names. After
// etcd went back in time (a restore of a backup older than the claim, or than the holder's
// lease, or taken during an earlier migration of the VM) that is the claim before its
// source's agent put it back: its re-claim writes the addresses, then the record; a record
// naming a pod deleted since is released (releaseStaleClaims), then taken back by the
// source's repair; a key naming the source as the target it was is deleted
// (deleteStaleMigrations). Re-claimed as any pod's meanwhile, the target would record a
// conflict against its own source, and the two could each take back one of the claim's
// addresses.
func (r targetRead) unsettled(allocated, onSource int, source, owner string) string {
	switch {
	case source != "" && r.recErr == nil && r.rec.Holder != nil && r.rec.Holder.Owner != source && r.rec.Holder.Owner != owner:
		return "the claim record names holder " + r.rec.Holder.Owner + ", not this target's source " + source
	case r.ckv == nil:
		return "the claim record is missing"
	case r.recErr == nil && r.rec.Holder == nil:
		return "the claim record names no holder"
	case r.mkv != nil:
		return "a live migration key names another target"
	case allocated > 0 && onSource < allocated:
		return "an address of the claim is allocated on another lease than its holder's pod lease"
	}
	return ""
}

// awaitSource is ReclaimTarget's wait for the source's agent to put back the claim of target
// attachment at (wait names it: its owner index key and container), found unsettled (why):
// an error, wrapping allocator.ErrUnavailable, until targetWait has passed since the first
// such re-claim, so that the recovery loop re-claims the pod again; then nil, and the
// target is re-claimed as any pod (its source gone for good with etcd's history, say). The
// target takes none of the claim's addresses meanwhile: they are its source's to put back.
func (sc *Claims) awaitSource(wait string, at podbook.Attachment, why string) error {
	now := time.Now()
	first, waiting := sc.waits.LoadOrStore(wait, now)
	since := first.(time.Time)
	if now.Sub(since) >= targetWait*sc.cfg.LeaseTTL {
		sc.waits.Delete(wait)
		sc.log.Error("a live migration's target re-claimed after etcd went back in time waited for its source's agent to put the claim "+
			"back, in vain; it is re-claimed as any pod: an address its source holds is a conflict", "claim", at.Claim, "target", wait,
			"why", why, "waited", now.Sub(since).Round(time.Millisecond))
		return nil
	}
	if !waiting {
		sc.log.Warn("a live migration's target re-claimed after etcd went back in time waits for its source's agent to put the claim back",
			"claim", at.Claim, "target", wait, "why", why, "for_at_most", targetWait*sc.cfg.LeaseTTL)
	}
	return fmt.Errorf("%w: re-claim %s: the live migration's target waits for its source's agent to put claim %q back: %s",
		allocator.ErrUnavailable, wait, at.Claim, why)
}

// targetWait bounds, in pod lease TTLs, how long a target's re-claim waits for its source's
// agent (awaitSource): that agent notices etcd going back in time and re-claims its pods
// within about a TTL, and what the backup brought back of pods deleted since expires within
// one.
const targetWait = 3

// targetRead is what a target's agent read of its claim (keepTarget, ReclaimTarget), in one
// transaction: the record (recErr: unreadable), the migration key, each address's
// allocation and quarantine key (keys only), then the extra reads asked for.
type targetRead struct {
	key, mkey string
	ckv, mkv  *mvccpb.KeyValue
	rec       keyspace.ClaimRecord
	recErr    error
	resp      *clientv3.TxnResponse
	addrs     int
}

// readTarget reads at's claim (targetRead). Its errors wrap allocator.ErrUnavailable.
func (sc *Claims) readTarget(ctx context.Context, at podbook.Attachment, blocks allocator.Blocks, extra ...clientv3.Op) (targetRead, error) {
	r := targetRead{key: keyspace.ClaimKey(sc.cfg.Cluster, at.Pool, at.Claim), mkey: keyspace.LiveMigrationKey(sc.cfg.Cluster, at.Pool, at.Claim),
		addrs: len(at.IPs)}
	ops := []clientv3.Op{clientv3.OpGet(r.key), clientv3.OpGet(r.mkey)}
	for _, ip := range at.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(at.Pool, blocks, ip), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.QuarantineKey(at.Pool, blocks, ip), clientv3.WithKeysOnly()))
	}
	resp, err := sc.cli.Txn(ctx).Then(append(ops, extra...)...).Commit()
	if err != nil {
		return r, sc.unavailable("read the live migration of claim "+at.Claim, err)
	}
	r.resp, r.ckv, r.mkv = resp, firstKV(resp, 0), firstKV(resp, 1)
	if r.ckv != nil {
		r.rec, r.recErr = keyspace.Decode[keyspace.ClaimRecord](r.key, r.ckv.Value)
	}
	return r, nil
}

// resting tells whether every address read has its quarantine key: released, it rests under
// its claim.
func (r targetRead) resting() bool {
	for i := range r.addrs {
		if firstKV(r.resp, 3+2*i) == nil {
			return false
		}
	}
	return true
}

// extra is the first key-value of the i-th extra read.
func (r targetRead) extra(i int) *mvccpb.KeyValue { return firstKV(r.resp, 2+2*r.addrs+i) }

// addrCmps compares each of at's addresses as read: allocated on the pod lease of the
// record's holder, or absent; its quarantine key unchanged. allocated counts the addresses
// read allocated, onSource those on the holder's pod lease.
func (r targetRead) addrCmps(at podbook.Attachment, blocks allocator.Blocks) (cmps []clientv3.Cmp, allocated, onSource int) {
	var la clientv3.LeaseID
	if r.rec.Holder != nil {
		la, _ = keyspace.ParseLeaseHex(r.rec.Holder.LeaseID)
	}
	for i, ip := range at.IPs {
		ipKey := keyspace.IPKey(at.Pool, blocks, ip)
		if kv := firstKV(r.resp, 2+2*i); kv != nil {
			allocated++
			if la != 0 && keyspace.HeldOn(kv, la) {
				onSource++
			}
			cmps = append(cmps, keyspace.OnLease(ipKey, la))
		} else {
			cmps = append(cmps, keyspace.Absent(ipKey))
		}
		var qrev int64
		if q := firstKV(r.resp, 3+2*i); q != nil {
			qrev = q.ModRevision
		}
		cmps = append(cmps, keyspace.Unchanged(keyspace.QuarantineKey(at.Pool, blocks, ip), qrev))
	}
	return cmps, allocated, onSource
}
