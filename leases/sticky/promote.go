package sticky

import (
	"context"
	"errors"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
)

// KeepTargets is the target's side of the live migrations this node's pods are the targets
// of, run by every audit (every half pod TTL; a migratable claim's hold is at least two): a
// migration whose source expired (its node died: etcd deleted its allocations, owner index
// and pod record, with no release) is completed by promoting the target (T4) long before
// the claim's record and quarantine keys, on the source's claim lease, run out; one that
// completed by the source's DEL (T2) leaves the target a holder like any, which the pod book
// records; one whose key is missing is written again, or taken over (keepTarget). One that
// cannot be checked now is left to the next audit. Then the migrations this node takes part
// in are read, for the metrics (readMigrations).
func (sc *Claims) KeepTargets(ctx context.Context, layouts map[string]allocator.Blocks) error {
	errs := []error{sc.readMigrations(ctx)}
	for _, h := range sc.pods.Audit().Targets() {
		blocks, ok := layouts[h.At.Pool]
		if !ok {
			continue // a pool being moved to blocks: its keys move under the migration's freeze
		}
		errs = append(errs, sc.keepTarget(ctx, h.Owner, h.At, blocks))
	}
	return errors.Join(errs...)
}

// keepTarget is KeepTargets for owner's target attachment at, under owner's lock. Its
// migration key found missing is the audit's (docs/proposals/live-migration.md, "Audits"):
// while the claim names a live holder on another node, the key is written again as T1 wrote
// it; with the holder's allocations gone, the target takes the claim over as T4 does. A claim
// left with no holder, its addresses resting under it and none allocated (the source's DEL
// released it, unable to move it onto the target's leases), is taken by the target too, as a
// hand-over: the running pod of the claim uses those addresses. Whatever it writes is on a
// claim lease etcd has (targetRecord). A key naming a claim or block lease this agent does
// not renew (renews: revoked by hand, taken by a restore) is written again naming its own,
// compared on its revision, with the owner index naming the claim lease: the source's DEL
// (T2) then moves the claim onto them at its first attempt, and a promotion (T4) can too. A
// key naming the target on another lease than its pod's (an etcdctl put of its value) is put
// back on the pod lease, as one missing is: else it would outlive the target.
func (sc *Claims) keepTarget(ctx context.Context, owner string, at podbook.Attachment, blocks allocator.Blocks) error {
	own := sc.locks.Lock(owner)
	defer own.Unlock()
	ps, ok := sc.pods.Snapshot(owner)
	podLease, held := ps.Held()
	if !ok || !held || !slices.ContainsFunc(ps.Attachments, func(a podbook.Attachment) bool {
		return a.IfName == at.IfName && a.Pool == at.Pool && a.Target && a.ContainerID == at.ContainerID
	}) {
		return nil // deleted, promoted or being re-claimed meanwhile
	}
	ownerKey := keyspace.OwnerKey(sc.cfg.Cluster, owner, at.IfName, at.Pool)
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	r, err := sc.readTarget(octx, at, blocks)
	if err != nil {
		return err
	}
	if r.recErr != nil {
		return r.recErr
	}
	key, mkey, rec := r.key, r.mkey, r.rec
	if rec.Holder != nil && rec.Holder.Owner == owner && rec.Holder.ContainerID == at.ContainerID {
		// Completed by the source's DEL (T2). A migration key naming another target is this
		// pod's own migration as a source, started before this audit: the pod is the holder
		// all the same, whose keys the audit keeps.
		sc.pods.Change(own).Promoted(at.IfName, at.Pool)
		if r.mkv == nil {
			sc.seen.drop(mkey)
		}
		return nil
	}
	if at.Source != "" && rec.Holder != nil && rec.Holder.Owner != at.Source {
		// A holder older than the source, brought back by a restore: the source's agent
		// puts the claim back (its repair); promoted now, the target would take its source's
		// addresses.
		sc.log.Warn("the claim of a live migration this node's pod is the target of names a holder other than its source; "+
			"left for the source's agent to put back", "claim", at.Claim, "owner", owner, "source", at.Source, "holder", holderName(rec.Holder))
		return nil
	}
	if r.ckv == nil || !slices.Equal(rec.IPs, at.IPs) || rec.Holder == nil && !r.resting() {
		sc.log.Warn("a live migration this node's pod is the target of has no claim holder any more; its addresses are not its own",
			"claim", at.Claim, "owner", owner, "pool", at.Pool)
		return nil
	}
	var m keyspace.LiveMigrationRecord
	mcmp := keyspace.Absent(mkey)
	if r.mkv != nil {
		if m, err = keyspace.Decode[keyspace.LiveMigrationRecord](mkey, r.mkv.Value); err != nil || m.Target.Owner != owner {
			return err
		}
		mcmp = keyspace.Unchanged(mkey, r.mkv.ModRevision)
	}
	acmps, allocated, onSource := r.addrCmps(at, blocks)
	// asT1: the claim is as T1 found it, every address on its holder's pod lease on another node.
	asT1 := rec.Holder != nil && onSource == len(at.IPs) && rec.Holder.Node != sc.cfg.Node && rec.Migratable
	// relet: the key names a claim or block lease this agent does not renew (revoked, a
	// restore): the source's DEL (T2) or the promotion (T4) would fail to move the claim onto it.
	relet := r.mkv != nil && rec.Holder != nil && (allocated == 0 || asT1) && !sc.renews(at, m)
	switch {
	case allocated > 0 && r.mkv != nil && rec.Holder != nil && !relet && keyspace.HeldOn(r.mkv, podLease):
		sc.started(mkey, m)
		return nil // the source still holds them: the migration goes on
	case allocated > 0 && !asT1:
		sc.log.Warn("the live migration key of this node's pod is gone and the claim's addresses are not all its holder's on another "+
			"node; it is not written again", "claim", at.Claim, "owner", owner, "holder", holderName(rec.Holder))
		return nil
	}
	claimLease, was := at.ClaimLease, m
	if r.mkv == nil || rec.Holder == nil || relet {
		var source keyspace.ClaimHolder
		if rec.Holder != nil {
			source = *rec.Holder
		}
		var nm keyspace.LiveMigrationRecord
		if nm, claimLease, err = sc.targetRecord(ctx, ps, at, podLease, source, sc.targetHold(at, rec)); err != nil {
			return err
		}
		switch {
		case !relet:
			m = nm
		case nm.ClaimLease == m.ClaimLease && nm.BlockLease == m.BlockLease && allocated > 0:
			sc.started(mkey, m) // its leases taken up again as they were (a restart): nothing to write
			return nil
		default:
			m.ClaimLease, m.BlockLease = nm.ClaimLease, nm.BlockLease
		}
	}
	cmps := append([]clientv3.Cmp{keyspace.Unchanged(key, r.ckv.ModRevision), mcmp}, acmps...)
	var index []clientv3.Op
	if claimLease != at.ClaimLease || relet {
		// The owner index names the claim lease the keys move onto.
		nat := at
		nat.ClaimLease, nat.ClaimMigratable = claimLease, true // a target's claim is migratable
		cmps = append(cmps, keyspace.OnLease(ownerKey, podLease))
		index = []clientv3.Op{clientv3.OpPut(ownerKey, keyspace.Encode(podbook.OwnerIndexOf(nat, sc.cfg.Node, sc.cfg.NodeUID, podLease)),
			clientv3.WithLease(podLease))}
	}
	if allocated > 0 {
		var lost *keyspace.LiveMigrationRecord
		if relet {
			lost = &was
		}
		return sc.remigrate(octx, cmps, own, at, ownerKey, podLease, claimLease, mkey, m, index, lost)
	}
	if rec.Holder == nil {
		// Taken as a hand-over, which writes the mark of the new holder's request: the
		// target's was migratable (T1 needed it). The release kept the source's mark, but a
		// source whose pod book predates the mark released the claim without it.
		rec.Migratable = true
	}
	puts, err := moves(sc.cfg.Cluster, at.Pool, at.Claim, blocks, m, rec, at.Network, sc.wall())
	if err != nil {
		sc.dropLease(at, claimLease)
		return err
	}
	tresp, err := sc.cli.Txn(octx).If(cmps...).Then(append(append(puts, clientv3.OpDelete(mkey)), index...)...).Commit()
	if err != nil {
		return sc.unavailable("promote the live migration's target of claim "+at.Claim, err)
	}
	if !tresp.Succeeded {
		sc.dropLease(at, claimLease)
		sc.cfg.AuditDue() // changed since read: the next audit reads it again
		return nil
	}
	change := sc.pods.Change(own)
	change.Promoted(at.IfName, at.Pool)
	if claimLease != at.ClaimLease {
		change.SetClaim(at.IfName, at.Pool, at.ContainerID, at.Claim, claimLease, tresp.Header.Revision)
	}
	sc.seen.drop(mkey)
	if rec.Holder == nil {
		// The source's DEL released the claim rather than complete the migration (T2 could
		// not move it onto the target's leases): its addresses rest under the claim, used by
		// this running pod of the claim, which takes it as a hand-over does.
		sc.cfg.Live.Completed(SourceDeleted)
		sc.log.Warn("live migration completed by its target: its source released the claim, which this node's pod holds now",
			"claim", at.Claim, "owner", owner, "ips", at.IPs)
		return nil
	}
	sc.cfg.Live.Completed(SourceExpired)
	sc.log.Warn("live migration completed by its source's expiry (its node is gone): this node's pod holds the claim now",
		"claim", at.Claim, "owner", owner, "source", rec.Holder.Owner, "source_node", rec.Holder.Node, "ips", at.IPs)
	return nil
}

// holderName names a claim's holder for a log: its owner and node, or none.
func holderName(h *keyspace.ClaimHolder) string {
	if h == nil {
		return "none"
	}
	return h.Owner + " on node " + h.Node
}

// targetRecord is the live migration record T1 wrote for owner's target attachment at, on
// podLease, from source: written again when found missing. Its start is the attachment's.
// Its claim lease is at's while etcd has it, else one granted now (claimLease, not at's): a
// record naming a lease a restore took away would have the source's DEL (T2) fail to move
// the claim onto it, and release the claim from under the running target.
func (sc *Claims) targetRecord(ctx context.Context, ps podbook.PodState, at podbook.Attachment, podLease clientv3.LeaseID,
	source keyspace.ClaimHolder, hold time.Duration) (_ keyspace.LiveMigrationRecord, claimLease clientv3.LeaseID, _ error) {
	claimLease, err := sc.targetLease(ctx, at, hold)
	if err != nil {
		return keyspace.LiveMigrationRecord{}, 0, err
	}
	m := keyspace.LiveMigrationRecord{
		Target: keyspace.ClaimHolder{Owner: ps.Owner, Pod: ps.Pod, Node: sc.cfg.Node, NodeUID: sc.cfg.NodeUID,
			ContainerID: at.ContainerID, IfName: at.IfName, LeaseID: keyspace.LeaseHex(podLease)},
		ClaimLease: keyspace.LeaseHex(claimLease),
		Source:     keyspace.LiveMigrationSource{Owner: source.Owner, Node: source.Node, LeaseID: source.LeaseID},
		Since:      at.Created.UTC(),
	}
	bl, err := sc.heldLease(ctx)
	if err == nil && bl != 0 {
		m.BlockLease = keyspace.LeaseHex(bl)
	}
	if err != nil {
		sc.dropLease(at, claimLease)
	}
	return m, claimLease, err
}

// heldLease is the node's block lease, the one held keys go on, asked of etcd: one lost
// unseen (revoked by hand, taken by a restore; with no block claim on it the audit does not
// find it gone, and the keeper renews it next a third of its TTL away) is dropped, with its
// claims, and the next one taken. Else a key written again would name it (T2 refused, the
// claim released) and a claim taken (a hand-over, T4) be refused on it until the keeper
// finds it gone. Only what writes a target's keys asks (targetRecord), not a fine migration.
func (sc *Claims) heldLease(ctx context.Context) (clientv3.LeaseID, error) {
	bl, err := sc.cfg.HeldLease(ctx)
	if err == nil && bl != 0 && sc.cfg.HeldLeaseGone(ctx, bl) {
		bl, err = sc.cfg.HeldLease(ctx)
	}
	return bl, err
}

// targetLease is the claim lease of target attachment at: its own while etcd has it (renewed
// from now on), else one granted now for hold, renewed by the keeper.
func (sc *Claims) targetLease(ctx context.Context, at podbook.Attachment, hold time.Duration) (clientv3.LeaseID, error) {
	if at.ClaimLease != 0 {
		err := sc.keeper.Adopt(ctx, at.ClaimLease)
		if err == nil {
			return at.ClaimLease, nil
		}
		if !errors.Is(err, keeper.ErrLeaseLost) {
			return 0, sc.unavailable("read the claim lease "+keyspace.LeaseHex(at.ClaimLease), err)
		}
		sc.keeper.Forget(at.ClaimLease) // gone (a restore, its expiry): renewing it is of no use
	}
	s := Add{Hold: hold}
	if err := sc.grant(ctx, &s); err != nil {
		return 0, err
	}
	return s.Lease, nil
}

// dropLease revokes claimLease if targetLease granted it for at and nothing was written on it.
func (sc *Claims) dropLease(at podbook.Attachment, claimLease clientv3.LeaseID) {
	if claimLease != 0 && claimLease != at.ClaimLease {
		if err := sc.keeper.Revoke(claimLease); err != nil {
			sc.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(claimLease), "err", err)
		}
	}
}

// targetHold is the hold of at's claim read as rec: its record's, else the attachment's,
// else the agent's default.
func (sc *Claims) targetHold(at podbook.Attachment, rec keyspace.ClaimRecord) time.Duration {
	switch {
	case rec.HoldSeconds > 0:
		return time.Duration(rec.HoldSeconds) * time.Second
	case at.ClaimHold > 0:
		return at.ClaimHold
	}
	return sc.cfg.ClaimHold
}

// remigrate writes the live migration key m of own's target attachment at again, on its
// pod lease, compared as cmps (the claim, the key absent or unchanged as read, each address
// on the holder's pod lease and its quarantine key as read) and the owner index on that
// lease: T1 again. A claim lease granted anew (claimLease, not at's) comes with index, the
// owner index naming it. was is the key found naming leases this agent does not renew.
func (sc *Claims) remigrate(ctx context.Context, cmps []clientv3.Cmp, own *ownerlock.Owned, at podbook.Attachment, ownerKey string,
	podLease, claimLease clientv3.LeaseID, mkey string, m keyspace.LiveMigrationRecord, index []clientv3.Op,
	was *keyspace.LiveMigrationRecord) error {
	cmps = append(cmps, keyspace.OnLease(ownerKey, podLease))
	ops := append([]clientv3.Op{clientv3.OpPut(mkey, keyspace.Encode(m), clientv3.WithLease(podLease))}, index...)
	resp, err := sc.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return sc.unavailable("write again the live migration key "+mkey, err)
	}
	if !resp.Succeeded {
		sc.dropLease(at, claimLease)
		sc.cfg.AuditDue()
		return nil
	}
	if claimLease != at.ClaimLease {
		sc.pods.Change(own).SetClaim(at.IfName, at.Pool, at.ContainerID, at.Claim, claimLease, resp.Header.Revision)
	}
	sc.started(mkey, m)
	sc.cfg.KeysLost.Inc()
	if was != nil {
		sc.log.Error("the live migration key of this node's pod named a claim or block lease this agent does not renew (gone from etcd); "+
			"written again naming its own, so that the source's DEL moves the claim onto them", "key", mkey, "owner", own.Owner(),
			"claim_lease", was.ClaimLease, "new_claim_lease", m.ClaimLease, "block_lease", was.BlockLease, "new_block_lease", m.BlockLease)
		return nil
	}
	sc.log.Error("the live migration key of this node's pod was missing in etcd, or on another lease; written again: the pod still uses its holder's addresses",
		"key", mkey, "owner", own.Owner(), "source", m.Source.Owner, "source_node", m.Source.Node)
	return nil
}

// renews tells whether the claim and block leases migration key m names are ones this agent
// renews for its target attachment at: at's claim lease, which the keeper holds, and a block
// lease the keeper holds. The keeper forgets a lease etcd no longer has at its next renewal
// (and the audit a block lease whose claims went): asking nothing of etcd, the check costs a
// migration that is fine nothing.
func (sc *Claims) renews(at podbook.Attachment, m keyspace.LiveMigrationRecord) bool {
	if at.ClaimLease == 0 || m.ClaimLease != keyspace.LeaseHex(at.ClaimLease) || !sc.keeper.Holds(at.ClaimLease) {
		return false
	}
	if m.BlockLease == "" {
		return true
	}
	bl, err := keyspace.ParseLeaseHex(m.BlockLease)
	return err == nil && sc.keeper.Holds(bl)
}
