package leases

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/parallel"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/etcdgate"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/txn"
)

// recover runs once when the agent starts, before it serves. For each pod record of this node
// written by this node identity it resumes the pod's lease if the sandbox still exists and
// releases the pod if its network namespace is gone. Pods in the local journal whose lease
// expired while the agent was away are queued for re-claim. Records of other node
// identities (a previous machine under this name) are left alone to expire.
func (a *Agent) recover(ctx context.Context) error {
	type journalRead struct {
		podbook.Loaded
		errs []error
	}
	var journaledAt time.Time // when the journal was last written, by an earlier process
	if a.cfg.StateDir != "" {
		if fi, err := os.Stat(filepath.Join(a.cfg.StateDir, podbook.JournalFile)); err == nil {
			journaledAt = fi.ModTime()
		}
	}
	fromDisk := make(chan journalRead, 1) // read the journal while etcd lists the pod records
	go func() {
		l, errs := podbook.Load(a.cfg.StateDir)
		fromDisk <- journalRead{l, errs}
	}()
	octx, cancel := a.opCtx(ctx)
	resp, err := a.cli.Get(octx, keyspace.PodsPrefix(a.cfg.Cluster, a.cfg.Node), clientv3.WithPrefix())
	cancel()
	disk := <-fromDisk
	if err != nil {
		return a.unavailable("list this node's pod records", err)
	}
	a.jw.Start(disk.Loaded)
	journaled, errs := disk.Pods, disk.errs
	for _, err := range errs {
		a.log.Error("journal", "err", err)
	}
	fromJournal := make(map[string]podState, len(journaled))
	var written int64 // the last revision the journal saw etcd write for this node
	for _, ps := range journaled {
		fromJournal[ps.Owner] = ps
		for _, at := range ps.Attachments {
			written = max(written, at.OwnerRev)
		}
	}
	// Restored from a backup while this agent was away: its gate has seen nothing yet.
	switch since := time.Since(journaledAt); {
	case written > resp.Header.Revision:
		a.etcdWentBack(fmt.Sprintf("this node's journal names revision %d, and etcd is at %d", written, resp.Header.Revision))
	case written > 0 && !journaledAt.IsZero() && etcdgate.Jumped(written, resp.Header.Revision, since):
		a.etcdWentBack(fmt.Sprintf("etcd is at revision %d, %d after this node's journal written %s ago: faster than etcd writes",
			resp.Header.Revision, resp.Header.Revision-written, since.Round(time.Second)))
	}
	var resumed, released, foreign int
	var resumedIDs []clientv3.LeaseID
	type decodedRecord struct {
		rec keyspace.PodRecord
		err error
	}
	records := parallel.Map(len(resp.Kvs), func(i int) (d decodedRecord) {
		d.rec, d.err = keyspace.Decode[keyspace.PodRecord](string(resp.Kvs[i].Key), resp.Kvs[i].Value)
		return d
	})
	for i, kv := range resp.Kvs {
		rec, err := records[i].rec, records[i].err
		if err != nil {
			a.log.Error("pod record unreadable; leaving it to its lease", "err", err)
			continue
		}
		if rec.NodeUID != a.cfg.NodeUID {
			foreign++
			continue
		}
		ps, ok := fromJournal[rec.Owner]
		delete(fromJournal, rec.Owner)
		if !ok {
			// Not in the journal (a wiped state directory): rebuild from etcd, so that a
			// later re-claim knows the pod's attachments.
			ps = podState{Owner: rec.Owner, Pod: rec.Pod, Netns: rec.Netns, NodeUID: rec.NodeUID}
			if ps.Attachments, err = a.attachmentsOf(ctx, rec.Owner); err != nil {
				return err
			}
		}
		lease := keyspace.LeaseOf(kv)
		if ps.Netns == "" {
			ps.Netns = rec.Netns
		}
		a.pods.Restore(ps, lease, true, ok)
		if sandboxGone(ps.Netns) {
			a.log.Info("sandbox gone while the agent was away; releasing", "owner", ps.Owner, "netns", ps.Netns)
			own := a.locks.Lock(ps.Owner)
			err := a.releaseOwner(ctx, own)
			own.Unlock()
			if err != nil {
				return err
			}
			released++
			continue
		}
		if err := a.keeper.Resume(lease); err != nil {
			return a.unavailable("resume pod lease", err)
		}
		resumedIDs = append(resumedIDs, lease)
		resumed++
	}
	// Renew them all now rather than on the keep-alive loop's first tick: a lease that was
	// close to its TTL when the agent stopped is safe before the agent serves.
	octx, cancel = a.opCtx(ctx)
	gone, err := a.keeper.RenewNow(octx, resumedIDs)
	cancel()
	if err != nil {
		a.log.Warn("renewing the resumed pod leases at once failed; their keep-alives renew them", "err", err)
	} else if len(gone) > 0 {
		a.log.Warn("resumed pod leases etcd no longer has; they will be re-claimed", "count", len(gone))
	}
	var lost int
	for _, ps := range fromJournal {
		if ps.NodeUID != a.cfg.NodeUID || sandboxGone(ps.Netns) {
			// A previous boot's pod, or one whose sandbox is gone: nothing to keep.
			a.jw.Remove(ps.Owner)
			continue
		}
		a.pods.Restore(ps, ps.Lease(), false, true)
		lost++
	}
	// The pod records were read, their other keys not yet; then re-claims, the releases
	// recorded while etcd was away, and the held keys no pod holds any more.
	a.checkNow()
	a.log.Info("recovered this node's pods", "resumed", resumed, "released", released, "to_reclaim", lost,
		"other_identities_left_to_expire", foreign)
	return nil
}

// attachmentsOf reads the attachments this node identity holds for owner.
func (a *Agent) attachmentsOf(ctx context.Context, owner string) ([]attachment, error) {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	resp, err := a.cli.Get(octx, keyspace.OwnerPrefix(a.cfg.Cluster, owner), clientv3.WithPrefix())
	if err != nil {
		return nil, a.unavailable("list attachments of "+owner, err)
	}
	var out []attachment
	for _, kv := range resp.Kvs {
		_, _, ifName, pool, err := keyspace.ParseOwnerKey(string(kv.Key))
		if err != nil {
			continue
		}
		rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
		if err != nil || rec.NodeUID != a.cfg.NodeUID {
			continue
		}
		out = append(out, attachmentOf(rec, ifName, pool, rec.ContainerID, kv.ModRevision))
	}
	return out, nil
}

// releaseOwner releases every attachment this node identity made for owner and revokes the
// owner's lease, under own.
func (a *Agent) releaseOwner(ctx context.Context, own *ownerlock.Owned) error {
	return a.releaseWhere(ctx, own, func(string, string, keyspace.OwnerRecord) bool { return true })
}

// livenessLoop releases the pods whose sandbox is gone: the node's own knowledge, never
// another component's. A pod is left alone within LivenessGrace of an ADD.
func (a *Agent) livenessLoop() {
	defer a.wg.Done()
	if a.cfg.LivenessInterval < 0 {
		return
	}
	t := time.NewTicker(a.cfg.LivenessInterval)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
			a.releaseGoneSandboxes(a.ctx)
		}
	}
}

func (a *Agent) releaseGoneSandboxes(ctx context.Context) {
	grace := a.cfg.LivenessGrace
	for owner, netns := range a.pods.Idle(grace) {
		if !sandboxGone(netns) {
			continue
		}
		own := a.locks.Lock(owner)
		if netns, ok := a.pods.StillIdle(owner, grace); ok && sandboxGone(netns) {
			a.log.Info("sandbox gone (network namespace removed); releasing its addresses", "owner", owner, "netns", netns)
			if err := a.releaseOwner(ctx, own); err != nil {
				a.log.Warn("release of a gone sandbox failed; will retry", "owner", owner, "err", err)
			}
		}
		own.Unlock()
	}
}

// checkNow makes the recovery loop check every key the agent keeps (the audit) and then run
// a whole pass: a key was found changed, a lease that carries keys was lost, etcd may have
// gone back in time, or the agent just started.
func (a *Agent) checkNow() {
	a.auditDue.Store(true)
	a.wake()
}

// wake makes the recovery loop run a whole pass (reclaimAll): a pod's lease or keys were
// lost, a DEL was recorded while etcd was away or while its pod was being re-claimed, or a
// held key of this node no pod lists was found.
func (a *Agent) wake() {
	select {
	case a.lost <- struct{}{}:
	default:
	}
}

// reclaimLoop is the agent's recovery: whenever woken (a lease lost, a DEL recorded while
// etcd was away or of a pod being re-claimed, a start, etcd gone back in time) it checks the
// keys it keeps if that is due, re-claims lost leases, finishes recorded releases and frees
// the held keys no pod of this node holds any more, retrying with backoff until etcd answers.
// Every Config.AuditInterval it checks the keys it keeps (audit.go), and does the rest only
// if that found something.
func (a *Agent) reclaimLoop() {
	defer a.wg.Done()
	audits := time.NewTimer(a.auditEvery())
	defer audits.Stop()
	for {
		full, fired := true, false
		select {
		case <-a.ctx.Done():
			return
		case <-a.lost:
		case <-audits.C:
			a.auditDue.Store(true)
			full, fired = false, true
		}
		backoff := reclaimRetryFirst
		for a.ctx.Err() == nil {
			err := a.reclaimAll(a.ctx, full)
			if err == nil {
				break
			}
			if errors.Is(err, ErrAgentRunning) {
				a.fail(err) // another host took this node identity while etcd could not hear us
				return
			}
			full = true // whatever the pass found, do it all again
			a.log.Warn("recovery incomplete; retrying", "err", err, "retry_in", backoff)
			select {
			case <-a.ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, reclaimRetryMax)
		}
		if fired {
			audits.Reset(a.auditEvery()) // from the end of this audit, however long it took
		}
	}
}

// auditEvery is the time to the next audit: Config.AuditInterval, less up to a tenth at
// random, so that agents started together do not check at once.
func (a *Agent) auditEvery() time.Duration {
	d := a.cfg.AuditInterval
	return d - time.Duration(rand.Int64N(int64(d/10)+1))
}

// reclaimAll is one pass of the recovery loop. A pass only for the periodic audit (full
// false) stops after it unless it found lost keys.
func (a *Agent) reclaimAll(ctx context.Context, full bool) error {
	gen := a.hold.pending()
	lost, err := a.auditIfDue(ctx)
	if err != nil {
		return err
	}
	if !full && lost == 0 && a.hold.pending() == gen {
		return nil
	}
	node := a.nodeLease()
	nodeLost := node != 0 && !a.keeper.Holds(node)
	owners := a.pods.Lost()
	if nodeLost {
		if err := a.register(ctx); err != nil {
			return err
		}
	}
	var errs []error
	for _, owner := range owners {
		errs = append(errs, a.reclaim(ctx, owner))
	}
	for _, owner := range a.pods.PendingReleases() {
		errs = append(errs, a.releasePending(ctx, owner))
	}
	a.watchConflicts()
	if a.hold.repairing() {
		errs = append(errs, a.reclaimBlocks(ctx))
	}
	// The held keys of pods still being re-claimed stay: the pods list their addresses.
	errs = append(errs, a.settleHeld(ctx))
	if g := a.hold.generation(); g != a.swept.Load() {
		err := a.sweepLeases(ctx)
		if err == nil {
			a.swept.Store(g)
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if len(a.pods.Lost()) == 0 {
		a.hold.done(gen) // every running pod holds its keys again: ADDs go on
		a.rmu.Lock()
		if gen >= a.backGen {
			a.backHeld = nil // re-claimed since: what they held then tells nothing more
		}
		a.rmu.Unlock()
	}
	return nil
}

// releasePending releases owner's attachments whose DEL was answered while etcd could not be
// reached (deferRelease), and gives the pod's lease up with the last.
func (a *Agent) releasePending(ctx context.Context, owner string) error {
	own := a.locks.Lock(owner)
	defer own.Unlock()
	var errs []error
	for _, at := range a.pods.ReleasedAttachments(owner) {
		req := allocator.Request{Pool: allocator.PoolSpec{Name: at.Pool}, Network: at.Network, IfName: at.IfName, ContainerID: at.ContainerID}
		left, err := a.releaseAttachment(ctx, req, own)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		// Released, or nothing of it was left in etcd: either way it is done. Nothing left (and
		// not taken by forgetLost, which reports as below): its keys expired while etcd was
		// away, and another pod may have had its addresses meanwhile.
		if a.pods.Change(own).ForgetAttachment(at.IfName, at.Pool, at.ContainerID) && left < 0 {
			a.reportTakenAtDel(ctx, owner, at)
		}
		a.log.Info("release recorded while etcd was away done", "owner", owner, "container", at.ContainerID,
			"ifname", at.IfName, "pool", at.Pool)
		if err := a.dropPodIfEmpty(ctx, own, left); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// settleHeld frees the held keys on this node's block leases that no pod of it lists (their
// pods were deleted while their leases were lost, or were not re-claimed because their
// sandbox was gone): only the addresses of pods that may still run are held back. Each is
// deleted only if no allocation stands at its address, so an ADD in flight keeps its own. So
// go the wanted keys no conflict of its pods names any more (its DEL lost with a crash, or an
// admin's release).
func (a *Agent) settleHeld(ctx context.Context) error {
	if a.cfg.ReuseDelay <= 0 {
		return nil
	}
	var errs []error
	for _, id := range a.blockLeases.all() {
		octx, cancel := a.opCtx(ctx)
		ttl, err := a.cli.TimeToLive(octx, id, clientv3.WithAttachedKeys())
		cancel()
		if err != nil {
			errs = append(errs, a.unavailable("list the keys of block lease "+keyspace.LeaseHex(id), err))
			continue
		}
		var ops []clientv3.Op
		var freed []string
		wants := a.pods.Wanted(a.cfg.Cluster)
		for _, k := range ttl.Keys {
			key := string(k)
			if pool, _, ip, cluster, owner, err := keyspace.ParseWantedKey(key); err == nil {
				// A wanted key no conflict of this node's pods names any more.
				if !wants[keyspace.WantedKey(pool, allocator.Blocks{}, ip, cluster, owner)] {
					ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{keyspace.OnLease(key, id)}, []clientv3.Op{clientv3.OpDelete(key)}, nil))
					freed = append(freed, key)
				}
				continue
			}
			pool, _, ip, err := keyspace.ParseHeldKey(key)
			if err != nil || a.pods.OwnsAddr(pool, ip) {
				continue
			}
			ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{keyspace.OnLease(key, id), keyspace.Absent(keyspace.IPKeyOfHeld(key))},
				[]clientv3.Op{clientv3.OpDelete(key)}, nil))
			freed = append(freed, key)
		}
		for len(ops) > 0 {
			n := min(len(ops), keyspace.MaxTxnOps/2)
			octx, cancel := a.opCtx(ctx)
			_, err := a.cli.Txn(octx).Then(ops[:n]...).Commit()
			cancel()
			if err != nil {
				errs = append(errs, a.unavailable("free held keys no pod holds", err))
				break
			}
			a.log.Info("held keys of addresses no pod of this node holds any more freed", "keys", freed[:n])
			ops, freed = ops[n:], freed[n:]
		}
	}
	return errors.Join(errs...)
}

// reclaim restores the keys of one pod whose lease was lost while its sandbox still runs:
// with create-if-absent on a fresh lease, attachment by attachment. An address another owner
// took meanwhile is a conflict: logged at error level, counted, recorded under
// /leasehold/v1/conflicts/, and reported by CHECK. It is never taken back.
func (a *Agent) reclaim(ctx context.Context, owner string) error {
	own := a.locks.Lock(owner)
	defer own.Unlock()
	snap, ok := a.pods.LostPod(owner)
	if !ok {
		return nil
	}
	if sandboxGone(snap.Netns) {
		a.log.Info("sandbox of a lost pod is gone; nothing to re-claim", "owner", owner)
		a.pods.Change(own).Drop()
		return nil
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	// The client gives up on a lease after one TTL without an answer; etcd may not have
	// expired it yet. Then the old lease is simply resumed.
	if id := snap.Lease(); id != 0 {
		ttl, err := a.cli.TimeToLive(octx, id)
		if err != nil {
			return a.unavailable("look up the lost lease", err)
		}
		if ttl.TTL > 0 {
			if err := a.keeper.Resume(id); err != nil {
				return err
			}
			a.pods.Change(own).Resumed(id)
			a.log.Warn("lost pod lease was still alive in etcd; resumed", "owner", owner, "lease", keyspace.LeaseHex(id))
			return nil
		}
	}
	if !slices.ContainsFunc(snap.Attachments, func(at attachment) bool { return !at.Released }) {
		// Every attachment's DEL was answered meanwhile: nothing to re-claim, and nothing in
		// etcd to release (the lease is gone). Its held keys are freed by settleHeld.
		a.log.Info("every attachment of a lost pod was deleted meanwhile; nothing to re-claim", "owner", owner)
		for _, at := range snap.Attachments {
			a.reportTakenAtDel(octx, owner, at) // another pod may have had its addresses meanwhile
		}
		a.pods.Change(own).Drop()
		return nil
	}
	defer a.keeper.Refill()
	lease, err := a.keeper.Take(octx)
	if err != nil {
		return a.unavailable("grant a lease for re-claim", err)
	}
	req := allocator.Request{Pod: snap.Pod, Netns: snap.Netns}
	wrote := false // an attachment's keys may be on lease
	for i, at := range snap.Attachments {
		if at.Released {
			continue // its release is pending (releasePending): never re-claimed
		}
		rev, taken, err := a.reclaimAttachment(octx, own, snap, at, lease)
		if err != nil {
			if !wrote && !errors.Is(err, allocator.ErrUnavailable) {
				a.keeper.Return(lease) // etcd answered and nothing is on it
			} else {
				// An earlier attachment is on it, or this one may be (a claim whose answer was
				// lost can still apply): the lease must go, keys and all, and never become
				// another pod's spare. The next attempt re-claims on a new lease, once the
				// keys of this one are gone (reclaimAttachment).
				if rerr := a.keeper.Revoke(lease); rerr != nil {
					a.log.Warn("revoking the lease of an incomplete re-claim failed; it expires within its TTL",
						"owner", owner, "lease", keyspace.LeaseHex(lease), "err", rerr)
				}
			}
			return err
		}
		snap.Attachments[i].OwnerRev, snap.Attachments[i].Conflicts = rev, taken
		wrote = true
	}
	pr := keyspace.PodRecord{Owner: owner, Pod: snap.Pod, NodeUID: a.cfg.NodeUID, LeaseID: keyspace.LeaseHex(lease), Netns: snap.Netns, Created: a.wall()}
	if len(snap.Attachments) > 0 {
		pr.ContainerID = snap.Attachments[0].ContainerID
	}
	if _, err := a.cli.Put(octx, keyspace.PodKey(a.cfg.Cluster, a.cfg.Node, owner), keyspace.Encode(pr), clientv3.WithLease(lease)); err != nil {
		// The attachments are on the lease, which no pod of the agent names: held, it would
		// be renewed for good with them (and with whatever a restore put back on a spare).
		// The next attempt re-claims on a new lease once these keys are gone.
		if rerr := a.keeper.Revoke(lease); rerr != nil {
			a.log.Warn("revoking the lease of an incomplete re-claim failed; it expires within its TTL",
				"owner", owner, "lease", keyspace.LeaseHex(lease), "err", rerr)
		}
		return a.unavailable("write the pod record", err)
	}
	a.claimedOn(ctx, req, own, lease, snap.Attachments...)
	a.metrics.reclaims.Inc()
	a.log.Warn("pod re-claimed after its lease was lost", "owner", owner, "lease", keyspace.LeaseHex(lease), "attachments", len(snap.Attachments))
	return a.sticky.keepClaimsOf(ctx, own) // on the claim lease, which a restore may have taken too
}

// heldByOthers reads the held keys of c's addresses and takes out of c those held back for
// another node's pod (its lease expired without a release, while it may run): a re-claim no
// more takes such an address than an ADD does; it is a conflict until that holder lets it go.
// It also returns the ModRevisions of those held keys, and the addresses with no held key at
// all: their hold ran out (the node was away longer than the reuse delay), and another pod
// may have had them meanwhile.
func (a *Agent) heldByOthers(ctx context.Context, c *txn.Claim) (taken []keyspace.TakenByOther, holds map[netip.Addr]int64, unheld []netip.Addr, _ error) {
	ops := make([]clientv3.Op, len(c.Addrs))
	for i, ip := range c.Addrs {
		ops[i] = clientv3.OpGet(keyspace.HeldKey(c.Pool, c.Blocks, ip))
	}
	resp, err := a.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, nil, nil, a.unavailable("read the held keys of "+c.OwnerKey, err)
	}
	holds = map[netip.Addr]int64{}
	var still []netip.Addr
	for i, ip := range c.Addrs {
		kvs := resp.Responses[i].GetResponseRange().Kvs
		if len(kvs) == 0 {
			still, unheld = append(still, ip), append(unheld, ip)
			continue
		}
		if a.blockLeases.mine(clientv3.LeaseID(kvs[0].Lease)) {
			still = append(still, ip)
			continue
		}
		rec, _ := keyspace.Decode[keyspace.HeldRecord](string(kvs[0].Key), kvs[0].Value)
		if rec.Owner == c.Alloc.Owner && rec.Cluster == c.Alloc.Cluster && rec.Node == c.Alloc.Node {
			still = append(still, ip) // this pod's own, on a block lease of before a restart
			continue
		}
		taken = append(taken, keyspace.TakenByOther{IP: ip, Holder: rec.Owner, Cluster: rec.Cluster, Node: rec.Node})
		holds[ip] = kvs[0].ModRevision
	}
	c.Addrs = still
	return taken, holds, unheld, nil
}

// usedMeanwhile looks, for the addresses just re-claimed whose hold had run out (unheld),
// in etcd's history of their allocation keys between the attachment's last write and the
// re-claim (at rev): another owner that held one meanwhile, and let it go before the
// re-claim, ran with the same address as this pod. Nothing is to be done; it is logged as
// the conflict it was.
func (a *Agent) usedMeanwhile(ctx context.Context, owner string, at attachment, c *txn.Claim, unheld []netip.Addr, rev int64) {
	var look []netip.Addr
	for _, ip := range unheld {
		if slices.Contains(c.Addrs, ip) {
			look = append(look, ip)
		}
	}
	if taken, had := a.holdersBetween(ctx, owner, at, c, look, nil, rev); had > 0 {
		a.conflicts.Add(int64(had))
		a.logHeldMeanwhile(owner, at, c, taken)
	}
}

// heldBefore is usedMeanwhile for the addresses the re-claim found another owner holding
// (taken), in the background: an owner other than the one holding it now that had it and let
// it go meanwhile ran with this pod's address too (a node away across a restore, its hold
// gone). The record names only the holder now, which the address comes back from, and the
// address is counted once, as that conflict.
func (a *Agent) heldBefore(owner string, at attachment, c *txn.Claim, taken []keyspace.TakenByOther, rev int64) {
	if at.OwnerRev <= 0 || a.ctx.Err() != nil {
		return
	}
	look := make([]netip.Addr, 0, len(taken))
	now := make(map[netip.Addr]keyspace.TakenByOther, len(taken))
	for _, t := range taken {
		look, now[t.IP] = append(look, t.IP), t
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		if before, _ := a.holdersBetween(a.ctx, owner, at, c, look, now, rev); len(before) > 0 {
			a.logHeldMeanwhile(owner, at, c, before)
		}
	}()
}

// holdersBetween reads etcd's history of the allocation key of each of addrs between the
// attachment's last write and rev: the owners other than owner that held it, less the one
// holding it now (now, if named there). had counts the addresses with any such owner. A
// history etcd no longer has is logged.
func (a *Agent) holdersBetween(ctx context.Context, owner string, at attachment, c *txn.Claim, addrs []netip.Addr,
	now map[netip.Addr]keyspace.TakenByOther, rev int64) (taken []keyspace.TakenByOther, had int) {
	if at.OwnerRev <= 0 {
		return nil, 0
	}
	for _, ip := range addrs {
		others, known := a.othersSince(ctx, owner, keyspace.IPKey(c.Pool, c.Blocks, ip), ip, at.OwnerRev, rev, time.Time{})
		if !known {
			a.log.Warn("the hold of an address ran out while this node was away, and etcd's history no longer tells "+
				"whether another pod had it meanwhile", "owner", owner, "ip", ip, "pool", c.Pool)
		}
		n := len(taken)
		for _, o := range others {
			if t, ok := now[ip]; !ok || o.Holder != t.Holder || o.Cluster != t.Cluster {
				taken = append(taken, o)
			}
		}
		if len(taken) > n {
			had++
		}
	}
	return taken, had
}

// logHeldMeanwhile logs owners that held this pod's addresses and let them go before the
// re-claim.
func (a *Agent) logHeldMeanwhile(owner string, at attachment, c *txn.Claim, taken []keyspace.TakenByOther) {
	a.log.Error("CONFLICT: addresses of a running pod were held by another owner while its node was away longer than "+
		"the reuse delay; they were let go before the re-claim", "owner", owner, "ifname", at.IfName, "pool", c.Pool, "taken", taken)
}

// historyIdle is how long othersSince waits, once a watch of a key's history is created,
// for an event after the last: etcd sends a watch's past events at once (its sync loop runs
// every 100 ms), so a quiet second means the history is all there. A miss costs a conflict
// not logged, never an address.
const historyIdle = time.Second

// othersSince reads etcd's history of the allocation key of ip from revision from+1 up to to
// (exclusive; 0: up to now), or up to its last event before a quiet historyIdle: the owners other than owner that held the address, since owner
// last did (an owner writing it again resets the list: who had it before was dealt with
// then). known is false when the history was compacted away or could not be read.
func (a *Agent) othersSince(ctx context.Context, owner, key string, ip netip.Addr, from, to int64, before time.Time) (taken []keyspace.TakenByOther, known bool) {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	// Past the gate: a history compacted away is an answer here, not a sign of a restore.
	wch := a.gate.History(clientv3.WithRequireLeader(octx), key, clientv3.WithRev(from+1), clientv3.WithFilterDelete(),
		clientv3.WithCreatedNotify())
	idle := time.NewTimer(historyIdle)
	defer idle.Stop()
	created := false
	for {
		var resp clientv3.WatchResponse
		var ok bool
		select {
		case resp, ok = <-wch:
		case <-idle.C:
			if created {
				return taken, true
			}
			idle.Reset(historyIdle)
			continue
		}
		if !ok || resp.CompactRevision != 0 || resp.Err() != nil {
			return nil, false
		}
		created = created || resp.Created
		idle.Reset(historyIdle)
		for _, ev := range resp.Events {
			if to > 0 && ev.Kv.ModRevision >= to {
				return taken, true
			}
			holder, err := keyspace.Decode[keyspace.Allocation](key, ev.Kv.Value)
			switch {
			case err != nil:
			case holder.Owner == owner:
				taken = taken[:0]
			case !before.IsZero() && !holder.Created.Before(before):
			default:
				taken = append(taken, keyspace.TakenByOther{IP: ip, Holder: holder.Owner, Cluster: holder.Cluster,
					Node: holder.Node, ContainerID: holder.ContainerID})
			}
		}
	}
}

// reclaimAttachment writes one attachment's keys on lease and returns the owner index's
// ModRevision, so that its DEL needs no read first, and the addresses another owner took
// meanwhile: they are left to that owner, recorded in the attachment's conflict record, and
// taken back when that owner lets them go (conflicts.go).
func (a *Agent) reclaimAttachment(ctx context.Context, own *ownerlock.Owned, ps podState, at attachment, lease clientv3.LeaseID) (int64, []netip.Addr, error) {
	req := allocator.Request{Pod: ps.Pod, ContainerID: at.ContainerID, IfName: at.IfName, Network: at.Network}
	p, err := a.pools.Ensure(ctx, allocator.PoolSpec{Name: at.Pool})
	if err != nil {
		return 0, nil, err
	}
	heldLease, held, err := a.heldFor(ctx, ps.Owner)
	if err != nil {
		return 0, nil, err
	}
	c := &txn.Claim{Lease: lease, Pool: at.Pool, Blocks: p.Spec.Blocks, AlsoFlat: p.Migrating != nil, Addrs: slices.Clone(at.IPs),
		HeldLease: heldLease, Held: held,
		OwnerKey:    keyspace.OwnerKey(a.cfg.Cluster, ps.Owner, at.IfName, at.Pool),
		Alloc:       a.allocation(req, ps.Owner, lease, at.Created),
		Index:       ownerIndexOf(at, a.cfg.Node, a.cfg.NodeUID, lease),
		ConflictKey: keyspace.ConflictKey(a.cfg.Cluster, ps.Owner, at.IfName, at.Pool),
		WantCluster: a.cfg.Cluster, WantOwner: ps.Owner}
	taken, holds, unheld, err := a.heldByOthers(ctx, c)
	if err != nil {
		return 0, nil, err
	}
	a.noteRestoredHolds(ps.Owner, at, holds)
	// The re-claim's lease is the owner's new one, never a spare; any refusal and a lost
	// answer are its answer: reclaimAll tries again.
	claims := claimLoop{a: a, own: own, req: req, policy: claimPolicy{what: "re-claim " + c.OwnerKey,
		refused: func(err error) error { return a.unavailable("re-claim "+c.OwnerKey, err) }}}
	for range 5 {
		if len(taken) > 0 {
			c.Conflict = &keyspace.ConflictRecord{ContainerID: at.ContainerID, Node: a.cfg.Node, NodeUID: a.cfg.NodeUID,
				Taken: taken, Detected: a.wall()}
		}
		out, again, err := claims.commit(ctx, c, func() (txn.ClaimOutcome, error) { return c.Commit(ctx, a.cli) })
		if err != nil {
			return 0, nil, err
		}
		if again {
			if c.HeldLease, _, err = a.heldFor(ctx, ps.Owner); err != nil {
				return 0, nil, err
			}
			continue
		}
		if out.Applied {
			// What the re-claim found taken is the attachment's conflicts now: none is an
			// empty list, not nil, which the pod book's PodState.put reads as "not known" and so keeps the
			// old ones (a crash right after a resolution leaves them in the journal).
			lost := []netip.Addr{}
			if len(taken) > 0 {
				a.conflicts.Add(int64(len(taken)))
				a.log.Error("CONFLICT: addresses of a running pod were taken by another owner while its lease was lost",
					"owner", ps.Owner, "ifname", at.IfName, "pool", at.Pool, "taken", taken, "record", c.ConflictKey)
				for _, t := range taken {
					lost = append(lost, t.IP)
				}
				a.heldBefore(ps.Owner, at, c, taken, out.Revision)
			}
			a.usedMeanwhile(ctx, ps.Owner, at, c, unheld, out.Revision)
			return out.Revision, lost, nil
		}
		if kv := out.Existing; kv != nil {
			rec, _ := keyspace.Decode[keyspace.OwnerRecord](c.OwnerKey, kv.Value)
			if rec.NodeUID == a.cfg.NodeUID && rec.ContainerID == at.ContainerID {
				if keyspace.HeldOn(kv, lease) {
					return kv.ModRevision, nil, nil // already re-claimed
				}
				// Written by an earlier attempt whose lease is being revoked or expires: the
				// attachment must end up on this attempt's lease, so wait for those keys to go.
				return 0, nil, fmt.Errorf("%w: re-claim %s: the owner index is still on lease %s of an earlier attempt",
					allocator.ErrUnavailable, c.OwnerKey, keyspace.LeaseHex(keyspace.LeaseOf(kv)))
			}
			return 0, nil, fmt.Errorf("%w: re-claim %s: the owner index now belongs to node identity %s container %s",
				allocator.ErrConflict, c.OwnerKey, rec.NodeUID, rec.ContainerID)
		}
		var still []netip.Addr
		var copies []*mvccpb.KeyValue
		for _, f := range out.Addrs {
			if f.Holder == nil {
				still = append(still, f.Addr)
				continue
			}
			holder, _ := keyspace.Decode[keyspace.Allocation](string(f.Holder.Key), f.Holder.Value)
			if holder.Owner == ps.Owner && holder.Cluster == a.cfg.Cluster && holder.NodeUID == a.cfg.NodeUID {
				// The pod's own value on another lease, or none (an etcdctl put of it, or a
				// restore's): the address is this pod's. The copy goes, the claim writes it anew.
				still, copies = append(still, f.Addr), append(copies, f.Holder)
				continue
			}
			taken = append(taken, keyspace.TakenByOther{IP: f.Addr, Holder: holder.Owner, Cluster: holder.Cluster,
				Node: holder.Node, ContainerID: holder.ContainerID})
		}
		if err := a.dropCopies(ctx, copies); err != nil {
			return 0, nil, err
		}
		c.Addrs = still
	}
	return 0, nil, fmt.Errorf("%w: re-claim %s: its keys kept changing", allocator.ErrUnavailable, c.OwnerKey)
}

// sandboxGone reports whether the sandbox behind netns certainly no longer exists: its
// network namespace path is gone. Any other answer (no path, a read error) counts as alive,
// so a failed look never releases a running pod's addresses.
func sandboxGone(netns string) bool {
	if netns == "" {
		return false
	}
	_, err := os.Stat(netns)
	return errors.Is(err, fs.ErrNotExist)
}
