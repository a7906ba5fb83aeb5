package release

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/txn"
)

// errStale is releaseRecord's answer when the owner index it was given from the agent's
// memory is no longer the one in etcd.
var errStale = errors.New("owner index changed since the agent last saw it")

// releaseRecord deletes an attachment read at kv, keeping any address that is no longer on
// the attachment's lease (written by hand or by a later owner), but for its held key if that
// is still the attachment's (txn.Release.Taken), and quarantines the rest. It returns the
// owner's attachments left, counted in the same transaction (after its deletes), or -1 when
// it released nothing. kv and rec come from the agent's memory when remembered is
// set; an owner index that changed since is then errStale, not "released by someone else".
func (r *Releaser) releaseRecord(ctx context.Context, pool string, own *ownerlock.Owned, kv *mvccpb.KeyValue, rec keyspace.OwnerRecord, remembered bool) (int64, error) {
	owner := own.Owner()
	blocks, err := r.Pools.BlocksOf(ctx, pool)
	if err != nil {
		return -1, err
	}
	rel := &txn.Release{Pool: pool, Blocks: blocks, OwnerKey: string(kv.Key), OwnerRev: kv.ModRevision, Lease: keyspace.LeaseOf(kv),
		Addrs: rec.IPs, OwnerPrefix: keyspace.OwnerPrefix(r.Cfg.Cluster, owner),
		PodKey: keyspace.PodKey(r.Cfg.Cluster, r.Cfg.Node, owner), Held: keyspace.HeldRecord{Cluster: r.Cfg.Cluster, Node: r.Cfg.Node, Owner: owner}}
	if _, _, ifName, _, err := keyspace.ParseOwnerKey(rel.OwnerKey); err == nil {
		rel.ConflictKey = keyspace.ConflictKey(r.Cfg.Cluster, owner, ifName, pool)
		for _, ip := range rec.IPs {
			rel.Wanted = append(rel.Wanted, keyspace.WantedKey(pool, blocks, ip, r.Cfg.Cluster, owner))
		}
	}
	quarantine := r.Cfg.Quarantine >= 0
	outOfSpace := false // etcd's NOSPACE alarm: no puts, so no claim kept either
	var claimLease clientv3.LeaseID
	if rec.Claim != "" {
		claimLease, _ = keyspace.ParseLeaseHex(rec.ClaimLease)
		rel.ClaimLease = claimLease
		rel.MigrationKey = keyspace.LiveMigrationKey(r.Cfg.Cluster, pool, rec.Claim)
	}
	for attempt := 0; attempt < 3; attempt++ {
		octx, cancel := r.opCtx(ctx)
		var until time.Time
		rel.QLease, rel.HoldLease = 0, 0
		if rec.Claim != "" && !outOfSpace && len(rel.Addrs) > 0 {
			// The claim and its addresses' quarantine keys outlive the release by the hold.
			at := podbook.Attachment{Claim: rec.Claim, IPs: rel.Addrs, ClaimHold: time.Duration(rec.ClaimHoldSeconds) * time.Second,
				ClaimMigratable: rec.ClaimMigratable}
			key, crec, lease, err := r.ReleaseSticky(octx, pool, owner, at)
			if err != nil {
				cancel()
				return -1, err
			}
			until = time.Now().Add(time.Duration(crec.HoldSeconds) * time.Second).UTC()
			rel.ClaimKey, rel.ClaimRec, rel.HoldLease = key, crec, lease
			rel.ClaimQ = keyspace.QuarantineRecord{ReleasedBy: owner, Until: until, Claim: rec.Claim}
		}
		if quarantine && len(rel.Addrs) > 0 {
			lease, u, err := r.Keeper.QuarantineLease(octx, r.Cfg.Quarantine)
			switch {
			case txn.NoSpace(err):
				quarantine, outOfSpace = false, true
				r.withoutQuarantine(rel, owner, err)
			case err != nil:
				cancel()
				return -1, r.unavailable("quarantine released addresses", err)
			default:
				if until.IsZero() {
					until = u.UTC()
				}
				rel.QLease, rel.QRecord = lease, keyspace.QuarantineRecord{ReleasedBy: owner, Until: u.UTC()}
			}
		}
		start := time.Now()
		out, err := rel.Commit(octx, r.Cli)
		r.Metrics.RTT("release", start)
		cancel()
		if txn.NoSpace(err) && (rel.QLease != 0 || rel.HoldLease != 0) {
			// The quarantine keys are the release's only puts, and etcd takes no put under
			// its NOSPACE alarm: release without them, or the pod could never be deleted.
			quarantine, outOfSpace = false, true
			r.withoutQuarantine(rel, owner, err)
			attempt--
			continue
		}
		if err != nil {
			return -1, r.unavailable("release "+rel.OwnerKey, err)
		}
		if out.Migrating {
			done, bystander, rev, left, err := r.Departed(ctx, pool, blocks, rec.Claim, owner, rel.OwnerKey, rel.OwnerRev, rel.Lease, rec.IPs, rec.Network)
			if err != nil {
				return -1, err
			}
			if bystander {
				rel.MigrationKey = "" // neither its holder nor its target: the migration is not its to end
			}
			if !done {
				continue // the migration ended without this DEL: release as without one
			}
			// The claim's keys stay (T3) or moved to the target (T2): none was released.
			r.dropClaimed(own, rel, claimLease)
			r.Log.Debug("released a migrating claim's attachment", "owner", owner, "pool", pool, "revision", rev)
			return left, nil
		}
		switch {
		case out.Applied:
			if _, _, ifName, _, err := keyspace.ParseOwnerKey(rel.OwnerKey); err == nil {
				r.Pods.Change(own).DropAttachment(ifName, pool)
			}
			if v := r.Pools.ViewOf(pool); v != nil {
				v.Released(rel.Addrs, out.Revision, until)
			}
			if out.ClaimKept {
				r.StickyReleased(rel.ClaimKey, pool, rec.Claim, rel.ClaimRec, rel.ClaimQ,
					r.ClaimReleaseTTL(podbook.Attachment{ClaimHold: time.Duration(rec.ClaimHoldSeconds) * time.Second}))
			}
			if claimLease != 0 {
				// The claim moved onto the release's lease: its old one carries nothing now.
				if err := r.Keeper.Revoke(claimLease); err != nil {
					r.Log.Warn("revoking a released claim's lease failed; it expires by itself", "lease", keyspace.LeaseHex(claimLease), "err", err)
				}
			}
			r.Log.Debug("released", "owner", owner, "pool", pool, "ips", rel.Addrs)
			return out.Left, nil
		case out.IndexChanged && remembered:
			return -1, errStale
		case out.IndexChanged:
			return -1, nil // the owner index changed or went away meanwhile: not ours to release any more
		}
		for _, addr := range rel.Addrs {
			if !slices.Contains(out.OnLease, addr) {
				r.Log.Warn("address of the attachment is not on its lease; leaving it alone",
					"owner", owner, "pool", pool, "ip", addr, "lease", keyspace.LeaseHex(rel.Lease))
				rel.Taken = append(rel.Taken, addr) // but for its held key, if still the pod's
			}
		}
		rel.Addrs = out.OnLease
	}
	return -1, fmt.Errorf("%w: release %s: its keys kept changing; retry", allocator.ErrUnavailable, kv.Key)
}

// dropClaimed forgets the attachment rel released and revokes its claim lease, which carries
// nothing now.
func (r *Releaser) dropClaimed(own *ownerlock.Owned, rel *txn.Release, claimLease clientv3.LeaseID) {
	if _, _, ifName, _, err := keyspace.ParseOwnerKey(rel.OwnerKey); err == nil {
		r.Pods.Change(own).DropAttachment(ifName, rel.Pool)
	}
	if claimLease != 0 {
		if err := r.Keeper.Revoke(claimLease); err != nil {
			r.Log.Warn("revoking a released claim's lease failed; it expires by itself", "lease", keyspace.LeaseHex(claimLease), "err", err)
		}
	}
}

// withoutQuarantine records that rel's addresses go back without quarantine: etcd is out of
// space, takes no put and no lease grant, and a DEL that waited for it would block the very
// pod deletions an operator makes to free space.
func (r *Releaser) withoutQuarantine(rel *txn.Release, owner string, err error) {
	r.Metrics.Unquarantined.Inc()
	r.Metrics.NoSpace.Inc()
	r.Log.Warn("etcd is out of space (NOSPACE alarm): releasing without quarantine; the addresses may be handed out again at once",
		"owner", owner, "pool", rel.Pool, "ips", rel.Addrs, "err", err)
}

// DropPodIfEmpty gives up the owner's pod lease once the owner has no attachment left in this
// cluster: the keeper takes it back as a spare if no key is left on it (the release
// transaction deleted the pod record with the last attachment), else revokes it, deleting
// what is left. left is the count of the owner's attachments that the release transaction
// read, or -1 when none did; then they are counted here.
func (r *Releaser) DropPodIfEmpty(ctx context.Context, own *ownerlock.Owned, left int64) error {
	owner := own.Owner()
	lease, ok := r.Pods.Lease(owner)
	if !ok {
		// A pod whose lease was lost: with its last attachment released it has nothing
		// left to re-claim.
		if ps, known := r.Pods.Snapshot(owner); known && len(ps.Attachments) == 0 {
			r.Pods.Change(own).Drop()
		}
		return nil
	}
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	if left < 0 {
		resp, err := r.Cli.Get(octx, keyspace.OwnerPrefix(r.Cfg.Cluster, owner), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return r.unavailable("count the owner's attachments", err)
		}
		left = resp.Count
	}
	if left > 0 {
		return nil
	}
	if ps, _ := r.Pods.Snapshot(owner); len(ps.Attachments) > 0 {
		// etcd holds no attachment of the pod, the agent still knows some: their keys went
		// with the lease, which expired before the keeper noticed (or with a restore). They
		// are re-claimed.
		r.keysGone(lease)
		r.Wake()
		return nil
	}
	recycled := false
	var err error
	if !r.Pods.MayRecycle(owner) {
		err = r.Keeper.Revoke(lease)
	} else {
		recycled, err = r.Keeper.Recycle(octx, lease)
	}
	if err != nil {
		return r.unavailable("revoke the pod lease", err)
	}
	r.Pods.Change(own).Drop()
	r.Log.Debug("pod lease given up", "owner", owner, "lease", keyspace.LeaseHex(lease), "recycled", recycled)
	return nil
}
