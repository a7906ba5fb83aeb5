package leases

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/parallel"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/etcdgate"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/reclaim"
	"github.com/leasehold/leasehold/leases/restorenotice"
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
		return unavailable("list this node's pod records", err)
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
		a.notices.EtcdWentBack(fmt.Sprintf("this node's journal names revision %d, and etcd is at %d", written, resp.Header.Revision))
	case written > 0 && !journaledAt.IsZero() && etcdgate.Jumped(written, resp.Header.Revision, since):
		a.notices.EtcdWentBack(fmt.Sprintf("etcd is at revision %d, %d after this node's journal written %s ago: faster than etcd writes",
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
		if reclaim.SandboxGone(ps.Netns) {
			a.log.Info("sandbox gone while the agent was away; releasing", "owner", ps.Owner, "netns", ps.Netns)
			own := a.locks.Lock(ps.Owner)
			err := a.release.ReleaseOwner(ctx, own)
			own.Unlock()
			if err != nil {
				return err
			}
			released++
			continue
		}
		if err := a.keeper.Resume(lease); err != nil {
			return unavailable("resume pod lease", err)
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
		if ps.NodeUID != a.cfg.NodeUID || reclaim.SandboxGone(ps.Netns) {
			// A previous boot's pod, or one whose sandbox is gone: nothing to keep.
			a.jw.Remove(ps.Owner)
			continue
		}
		a.pods.Restore(ps, ps.Lease(), false, true)
		lost++
	}
	// The pod records were read, their other keys not yet; then re-claims, the releases
	// recorded while etcd was away, and the held keys no pod holds any more.
	a.recovery.CheckNow()
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
		return nil, unavailable("list attachments of "+owner, err)
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
		out = append(out, podbook.AttachmentOf(rec, ifName, pool, rec.ContainerID, kv.ModRevision))
	}
	return out, nil
}

// newRecovery makes the recovery (leases/reclaim) and the restore notices
// (leases/restorenotice), handing in what they use of the agent. The parts they call into are
// made before: the views, the keeper, the pod book, the sticky claims, the block leases, the
// release.
func (a *Agent) newRecovery() (*reclaim.Reclaimer, *restorenotice.Notices) {
	cfg := a.cfg
	r := reclaim.New(a.ctx, reclaim.Config{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID, OpTimeout: cfg.OpTimeout,
		ReuseDelay: cfg.ReuseDelay, AuditInterval: cfg.AuditInterval, LivenessInterval: cfg.LivenessInterval,
		LivenessGrace: cfg.LivenessGrace, WallClock: cfg.WallClock,
		Client: a.cli, Gate: a.gate, Keeper: a.keeper, Log: a.log, Pods: a.pods, Locks: &a.locks, Pools: a.pools,
		Hold: a.hold, BlockLeases: a.blockLeases.all, MineBlockLease: a.blockLeases.mine,
		AuditIfDue: a.audit.IfDue, AuditDue: a.audit.MarkDue,
		WatchConflicts: a.cwatch.Follow, NoteRestoredHolds: a.cwatch.NoteRestoredHolds, Repaired: a.cwatch.Repaired,
		DropCopies: a.audit.DropCopies, Register: a.self.Register, NodeLease: a.self.Lease,
		ReleaseOwner: a.release.ReleaseOwner, ReleaseAttachment: a.release.ReleaseAttachment,
		DropPodIfEmpty: a.release.DropPodIfEmpty, ReportTakenAtDel: a.release.ReportTakenAtDel,
		HeldFor: a.attach.HeldFor, Allocation: a.attach.Allocation,
		Loops:        a.loops,
		KeepClaimsOf: a.sticky.KeepClaimsOf, Fail: a.fail,
		ReclaimTarget: func(ctx context.Context, ps podbook.PodState, at podbook.Attachment, lease clientv3.LeaseID,
			blocks allocator.Blocks) (int64, clientv3.LeaseID, bool, bool, error) {
			t, ok, err := a.sticky.ReclaimTarget(ctx, ps, at, lease, blocks)
			return t.Rev, t.ClaimLease, t.Promoted, ok, err
		}, ConflictsFound: a.conflicts.Add, Reclaims: a.metrics.reclaims})
	n := restorenotice.New(a.ctx, restorenotice.Config{Cluster: cfg.Cluster, Node: cfg.Node, LeaseTTL: cfg.LeaseTTL,
		OpTimeout: cfg.OpTimeout, RetryFirst: retryFirst, RetryMax: retryMax, StateDir: cfg.StateDir,
		Client: a.cli, Log: a.log, Hold: a.hold, Keeper: a.keeper, Pools: a.pools, Relist: func() { a.rules.Relist(); a.blockLeases.followAgain() }, HeldAddrs: a.pods.HeldAddrs,
		NoteBackHeld: a.cwatch.WentBack, FirstOfHistory: a.gate.FirstOfHistory,
		NodeLease: a.self.Lease, CheckNow: r.CheckNow, Wake: r.Wake, Suspect: a.audit.Suspect,
		WentBackCount: a.metrics.wentBack})
	return r, n
}
