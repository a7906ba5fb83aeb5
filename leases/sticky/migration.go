package sticky

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/txn"
)

// Live migrations (issue 35, docs/proposals/live-migration.md). While a VM moves between
// nodes its claim's holder (the source) keeps every key it has, and one target pod on
// another node holds the addresses too, through the claim's migration key on the target's
// pod lease. Each transition is one transaction comparing what it was decided on: T1 (the
// target's ADD) the claim record's revision and the migration key absent; T2 (the source's
// DEL) and T4 (the source's expiry) move the claim's keys onto the target's leases; T3 (the
// target's DEL) deletes only the target's keys.

// Migration is a live migration an ADD naming a claim found itself part of (Read): the
// start of one (T1), or this attachment already its target (a repeated ADD, a restart).
type Migration struct {
	Key string // the claim's live migration key
	// Started: the key names this attachment as the target already, at Rev, as Rec.
	Started bool
	Rev     int64
	Rec     keyspace.LiveMigrationRecord
	// The holder (source) the record named at the claim's revision read, its pod lease, and
	// the record itself (hold and migratable come from it).
	Source      keyspace.ClaimHolder
	SourceLease clientv3.LeaseID
	Claim       keyspace.ClaimRecord
}

// heldBy is why an ADD naming a claim cannot have its addresses now: who holds them and, in
// a live migration, the target too (a third attachment is refused, T6).
type heldBy struct {
	who       string
	migrating bool
}

// holderOf names a claim holder for an error: its pod, node and lease.
func holderOf(h keyspace.ClaimHolder) string {
	return fmt.Sprintf("pod %s/%s on node %s (owner %s, lease %s", h.Pod.Namespace, h.Pod.Name, h.Node, h.Owner, h.LeaseID)
}

// migrationOf decides, from what readClaim read of claim key (rec at its revision, the
// allocation key of each address, and the migration key), whether owner's ADD is a live
// migration's target: it starts one (T1) when the record and the request are migratable,
// every address is allocated to the record's holder on its pod lease (a live holder), the
// holder runs on another node and no migration is in progress. A migration key naming
// another target refuses the ADD naming both (T6), whatever the holder's state: until T4
// moves them, the addresses are the target's. nil, nil: neither; today's rules apply.
func (sc *Claims) migrationOf(key string, rec keyspace.ClaimRecord, owner string, req *allocator.Request,
	allocs []*mvccpb.KeyValue, mig *mvccpb.KeyValue) (*Migration, *heldBy, error) {
	mkey := keyspace.LiveMigrationKey(sc.cfg.Cluster, req.Pool.Name, req.Claim)
	if mig != nil {
		m, err := keyspace.Decode[keyspace.LiveMigrationRecord](mkey, mig.Value)
		if err != nil {
			return nil, nil, err
		}
		if m.Target.Owner == owner {
			return &Migration{Key: mkey, Started: true, Rev: mig.ModRevision, Rec: m, Claim: rec}, nil, nil
		}
		if rec.Holder != nil && rec.Holder.Owner == owner {
			return nil, nil, nil // the source's own ADD, repeated: its attachment as today
		}
		src := "its holder (gone)"
		if rec.Holder != nil {
			src = holderOf(*rec.Holder) + ")"
		}
		return nil, &heldBy{migrating: true, who: fmt.Sprintf("%s and migrating to %s, since %s)", src, holderOf(m.Target),
			m.Since.Format(time.TimeOnly))}, nil
	}
	if !rec.Migratable || !req.Migratable || rec.Holder == nil || rec.Holder.Node == sc.cfg.Node || rec.Holder.Owner == owner {
		return nil, nil, nil
	}
	la, err := keyspace.ParseLeaseHex(rec.Holder.LeaseID)
	if err != nil || la == 0 {
		return nil, nil, nil
	}
	for _, kv := range allocs {
		if kv == nil || !keyspace.HeldOn(kv, la) {
			return nil, nil, nil
		}
		if al, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value); err != nil || al.Owner != rec.Holder.Owner {
			return nil, nil, nil
		}
	}
	return &Migration{Key: mkey, Source: *rec.Holder, SourceLease: la, Claim: rec}, nil, nil
}

// Migrate sends T1 for s, the claim an ADD read as a live migration's start, with what
// the ADD's claim transaction c would write (its pod lease, owner index, pod record and
// block lease): the migration key, the owner index and, for a new pod, the pod record, on
// the pod lease, compared against the claim's revision read, the migration key absent and
// each address still on the holder's pod lease and resting under the claim. The claim's
// addresses are answered at once. A migration this attachment is the target of already (a
// repeated ADD, the agent's restart) reads its owner index and answers it. applied false:
// something changed since the read, which is read again (s.Stale). rev is the owner index's
// ModRevision. Its errors wrap allocator.ErrUnavailable, but for the start's own, which is
// etcd's (the claim loop sorts it: refused, or unanswered).
func (sc *Claims) Migrate(ctx context.Context, s *Add, owner string, req allocator.Request, c *txn.Claim, now time.Time) (
	applied bool, rev int64, err error) {
	m := s.Migration
	if m.Started {
		resp, err := sc.cli.Get(ctx, c.OwnerKey)
		if err != nil {
			return false, 0, sc.unavailable("read owner index "+c.OwnerKey, err)
		}
		if len(resp.Kvs) == 0 || keyspace.LeaseOf(resp.Kvs[0]) != c.Lease {
			s.Stale = true
			return false, 0, nil
		}
		idx, err := keyspace.Decode[keyspace.OwnerRecord](c.OwnerKey, resp.Kvs[0].Value)
		if err != nil {
			return false, 0, err
		}
		if idx.ContainerID != req.ContainerID {
			return false, 0, fmt.Errorf("%w: claim %q is migrating to container %s of this pod, not %s; delete that container first",
				allocator.ErrUnavailable, s.Name, idx.ContainerID, req.ContainerID)
		}
		s.Lease, _ = keyspace.ParseLeaseHex(idx.ClaimLease)
		sc.started(m.Key, m.Rec)
		return true, resp.Kvs[0].ModRevision, nil
	}
	if err := sc.grant(ctx, s); err != nil {
		return false, 0, err
	}
	mrec := keyspace.LiveMigrationRecord{
		Target: keyspace.ClaimHolder{Owner: owner, Pod: req.Pod, Node: sc.cfg.Node, NodeUID: sc.cfg.NodeUID,
			ContainerID: req.ContainerID, IfName: req.IfName, LeaseID: keyspace.LeaseHex(c.Lease)},
		ClaimLease: keyspace.LeaseHex(s.Lease),
		Source:     keyspace.LiveMigrationSource{Owner: m.Source.Owner, Node: m.Source.Node, LeaseID: m.Source.LeaseID},
		Since:      now,
	}
	if c.HeldLease != 0 {
		mrec.BlockLease = keyspace.LeaseHex(c.HeldLease)
	}
	idx := c.Index
	idx.Claim, idx.ClaimLease, idx.ClaimHoldSeconds, idx.ClaimMigratable = s.Name, keyspace.LeaseHex(s.Lease), int64(s.Hold/time.Second), true
	onLb := clientv3.WithLease(c.Lease)
	cmps := []clientv3.Cmp{keyspace.Unchanged(s.Key, s.Rev), keyspace.Absent(m.Key), keyspace.Absent(c.OwnerKey)}
	then := []clientv3.Op{clientv3.OpPut(m.Key, keyspace.Encode(mrec), onLb), clientv3.OpPut(c.OwnerKey, keyspace.Encode(idx), onLb)}
	if c.NewPod {
		cmps = append(cmps, keyspace.Absent(c.PodKey))
		then = append(then, clientv3.OpPut(c.PodKey, keyspace.Encode(c.Pod), onLb))
	} else {
		cmps = append(cmps, keyspace.OnLease(c.PodKey, c.Lease))
	}
	for _, ip := range c.Addrs {
		cmps = append(cmps, keyspace.OnLease(keyspace.IPKey(c.Pool, c.Blocks, ip), m.SourceLease),
			keyspace.Unchanged(keyspace.QuarantineKey(c.Pool, c.Blocks, ip), s.Resting[ip]),
			keyspace.NoneUnder(keyspace.HostIPPrefix(ip)), keyspace.NoneUnder(keyspace.WantedPrefix(c.Pool, c.Blocks, ip)))
	}
	resp, err := sc.cli.Txn(ctx).If(cmps...).Then(then...).Commit()
	if err != nil {
		// Read again before the next attempt; unanswered, it may have applied, on the claim
		// lease granted, which is kept (the migration key would name it).
		s.Stale = s.Stale || !txn.Refused(err)
		return false, 0, err
	}
	if !resp.Succeeded {
		s.Stale = true
		return false, 0, nil
	}
	sc.cfg.Live.Started()
	sc.started(m.Key, mrec)
	sc.log.Info("live migration started: this pod holds the claim's addresses beside its holder", "claim", s.Name,
		"owner", owner, "source", m.Source.Owner, "source_node", m.Source.Node, "ips", c.Addrs)
	return true, resp.Header.Revision, nil
}

// grant grants s's claim lease at its first use (Claim, Migrate), renewed by the keeper.
func (sc *Claims) grant(ctx context.Context, s *Add) error {
	if s.Lease != 0 {
		return nil
	}
	resp, err := sc.cli.Grant(ctx, int64((s.Hold+time.Second-1)/time.Second))
	if err != nil {
		return sc.unavailable("grant the claim lease", err)
	}
	if err := sc.keeper.Resume(resp.ID); err != nil {
		return err
	}
	s.Lease = resp.ID
	return nil
}

// Departure is what a DEL of a sticky attachment whose release found its claim's migration
// key (txn.ReleaseOutcome.Migrating) did: T3 when the attachment was the target, T2 when it
// was the holder.
type Departure struct {
	// Done: the attachment's keys are gone (at Revision), Left owner indexes of its owner
	// remain. Not done: the migration key went with a target that could not take the keys
	// (its leases gone), and the DEL releases as without a migration. Bystander (not done):
	// the attachment is neither the migration's target nor the claim's holder (a pod of the
	// claim whose addresses its holder took, in conflict), so its release, which moves none
	// of the claim's keys, goes on without comparing the migration key absent.
	Done      bool
	Bystander bool
	Revision  int64
	Left      int64
}

// Departed is the DEL of attachment ownerKey (read at ownerRev, on lease, holding ips of
// claim in pool, laid out as blocks) while its claim is migrating. Its errors wrap
// allocator.ErrUnavailable.
func (sc *Claims) Departed(ctx context.Context, pool string, blocks allocator.Blocks, claim, owner, ownerKey string, ownerRev int64,
	lease clientv3.LeaseID, ips []netip.Addr, network string) (Departure, error) {
	key := keyspace.ClaimKey(sc.cfg.Cluster, pool, claim)
	mkey := keyspace.LiveMigrationKey(sc.cfg.Cluster, pool, claim)
	for range 3 {
		octx, cancel := sc.opCtx(ctx)
		resp, err := sc.cli.Txn(octx).Then(clientv3.OpGet(key), clientv3.OpGet(mkey)).Commit()
		cancel()
		if err != nil {
			return Departure{}, sc.unavailable("read the live migration of claim "+claim, err)
		}
		ckvs, mkvs := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
		if len(mkvs) == 0 {
			return Departure{}, nil // ended meanwhile: release as without one
		}
		m, err := keyspace.Decode[keyspace.LiveMigrationRecord](mkey, mkvs[0].Value)
		if err != nil {
			return Departure{}, err
		}
		p := departure{sc: sc, pool: pool, blocks: blocks, claim: claim, owner: owner, ownerKey: ownerKey, ownerRev: ownerRev,
			lease: lease, ips: ips, network: network, mkey: mkey, mrev: mkvs[0].ModRevision, m: m, ckey: key}
		if m.Target.Owner == owner {
			return p.failed(ctx)
		}
		if len(ckvs) == 0 {
			return Departure{}, nil
		}
		rec, err := keyspace.Decode[keyspace.ClaimRecord](key, ckvs[0].Value)
		if err != nil {
			return Departure{}, err
		}
		p.crec, p.crev, p.clease = rec, ckvs[0].ModRevision, keyspace.LeaseOf(ckvs[0])
		d, again, err := p.completed(ctx)
		if !again {
			return d, err
		}
	}
	return Departure{}, fmt.Errorf("%w: the live migration of claim %q kept changing; retry", allocator.ErrUnavailable, claim)
}

// departure is one DEL's view of a migrating claim (Departed).
type departure struct {
	sc                   *Claims
	pool, claim, owner   string
	blocks               allocator.Blocks
	ownerKey, mkey, ckey string
	ownerRev, mrev, crev int64
	lease, clease        clientv3.LeaseID
	ips                  []netip.Addr
	network              string
	m                    keyspace.LiveMigrationRecord
	crec                 keyspace.ClaimRecord
}

// leave are the operations that delete the departing attachment's owner index and conflict
// record, its pod record with its last attachment, and count its owner's indexes left (as
// txn.Release does).
func (p *departure) leave() []clientv3.Op {
	sc := p.sc
	ops := []clientv3.Op{clientv3.OpDelete(p.ownerKey)}
	if _, _, ifName, _, err := keyspace.ParseOwnerKey(p.ownerKey); err == nil {
		ops = append(ops, clientv3.OpDelete(keyspace.ConflictKey(sc.cfg.Cluster, p.owner, ifName, p.pool)))
	}
	prefix := keyspace.OwnerPrefix(sc.cfg.Cluster, p.owner)
	podKey := keyspace.PodKey(sc.cfg.Cluster, sc.cfg.Node, p.owner)
	ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{
		clientv3.Compare(clientv3.CreateRevision(prefix), "=", 0).WithRange(p.ownerKey),
		clientv3.Compare(clientv3.CreateRevision(p.ownerKey+"\x00"), "=", 0).WithRange(clientv3.GetPrefixRangeEnd(prefix)),
		keyspace.OnLease(podKey, p.lease),
	}, []clientv3.Op{clientv3.OpDelete(podKey)}, nil))
	return append(ops, clientv3.OpGet(prefix, clientv3.WithPrefix(), clientv3.WithCountOnly()))
}

// failed is T3, the target's DEL: the migration failed. Only the target's keys go (the
// migration key, its owner index, its pod record with its last attachment); the claim's
// record, allocation, held and quarantine keys are the holder's and stay as they are.
func (p *departure) failed(ctx context.Context) (Departure, error) {
	octx, cancel := p.sc.opCtx(ctx)
	defer cancel()
	ops := append([]clientv3.Op{clientv3.OpDelete(p.mkey)}, p.leave()...)
	resp, err := p.sc.cli.Txn(octx).If(keyspace.Unchanged(p.ownerKey, p.ownerRev), keyspace.Unchanged(p.mkey, p.mrev)).
		Then(ops...).Commit()
	if err != nil {
		return Departure{}, p.sc.unavailable("end the live migration of claim "+p.claim, err)
	}
	if !resp.Succeeded {
		return Departure{}, fmt.Errorf("%w: the live migration of claim %q changed while its target was deleted; retry",
			allocator.ErrUnavailable, p.claim)
	}
	p.sc.cfg.Live.Failed(TargetDeleted)
	p.sc.seen.drop(p.mkey)
	p.sc.log.Info("live migration failed: its target was deleted; the holder keeps the claim", "claim", p.claim, "owner", p.owner)
	return Departure{Done: true, Revision: resp.Header.Revision, Left: resp.Responses[len(resp.Responses)-1].GetResponseRange().Count}, nil
}

// moves are the puts that make the migration's target the claim's sole holder (T2, T4): each
// address's allocation on its pod lease, its held key on its block lease (when it has one),
// its quarantine key and the claim record on its claim lease. The record keeps its hold and
// migratable mark.
func moves(cluster, pool, claim string, blocks allocator.Blocks, m keyspace.LiveMigrationRecord, rec keyspace.ClaimRecord,
	network string, now time.Time) ([]clientv3.Op, error) {
	lb, err := keyspace.ParseLeaseHex(m.Target.LeaseID)
	if err != nil {
		return nil, err
	}
	lbc, err := keyspace.ParseLeaseHex(m.ClaimLease)
	if err != nil {
		return nil, err
	}
	var lbb clientv3.LeaseID
	if m.BlockLease != "" {
		if lbb, err = keyspace.ParseLeaseHex(m.BlockLease); err != nil {
			return nil, err
		}
	}
	t := m.Target
	al := keyspace.Encode(keyspace.Allocation{Owner: t.Owner, Cluster: cluster, Node: t.Node, NodeUID: t.NodeUID, Pod: t.Pod,
		ContainerID: t.ContainerID, IfName: t.IfName, Network: network, LeaseID: t.LeaseID, Created: now})
	held := keyspace.Encode(keyspace.HeldRecord{Cluster: cluster, Node: t.Node, Owner: t.Owner})
	q := keyspace.Encode(keyspace.QuarantineRecord{Claim: claim})
	var ops []clientv3.Op
	for _, ip := range rec.IPs {
		ops = append(ops, clientv3.OpPut(keyspace.IPKey(pool, blocks, ip), al, clientv3.WithLease(lb)),
			clientv3.OpPut(keyspace.QuarantineKey(pool, blocks, ip), q, clientv3.WithLease(lbc)))
		if lbb != 0 {
			ops = append(ops, clientv3.OpPut(keyspace.HeldKey(pool, blocks, ip), held, clientv3.WithLease(lbb)))
		} else {
			ops = append(ops, clientv3.OpDelete(keyspace.HeldKey(pool, blocks, ip)))
		}
	}
	holder := t
	crec := keyspace.ClaimRecord{IPs: rec.IPs, HoldSeconds: rec.HoldSeconds, Holder: &holder, Since: now, Migratable: rec.Migratable}
	return append(ops, clientv3.OpPut(keyspace.ClaimKey(cluster, pool, claim), keyspace.Encode(crec), clientv3.WithLease(lbc))), nil
}

// completed is T2, the holder's DEL: the migration completed. Every key of the claim moves
// onto the target's leases, and the holder's owner index (and pod record with its last
// attachment) goes, in one transaction compared on the holder's keys and the migration key
// read. again: it found them changed, to be read again. A target whose leases are gone
// (lease not found) cannot take them: the migration key is deleted, compared, and the DEL
// releases as without a migration.
func (p *departure) completed(ctx context.Context) (_ Departure, again bool, _ error) {
	sc := p.sc
	if p.crec.Holder == nil || p.crec.Holder.Owner != p.owner {
		return Departure{Bystander: true}, false, nil // not the holder: release as without a migration
	}
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	cmps := []clientv3.Cmp{keyspace.Unchanged(p.ownerKey, p.ownerRev), keyspace.Unchanged(p.mkey, p.mrev),
		keyspace.Unchanged(p.ckey, p.crev)}
	for _, ip := range p.ips {
		cmps = append(cmps, keyspace.OnLease(keyspace.IPKey(p.pool, p.blocks, ip), p.lease))
	}
	rec := p.crec
	if !slices.Equal(rec.IPs, p.ips) {
		return Departure{}, false, nil
	}
	puts, err := moves(sc.cfg.Cluster, p.pool, p.claim, p.blocks, p.m, rec, p.network, sc.wall())
	if err != nil {
		return Departure{}, false, err
	}
	ops := append(puts, clientv3.OpDelete(p.mkey))
	ops = append(ops, p.leave()...)
	resp, err := sc.cli.Txn(octx).If(cmps...).Then(ops...).Commit()
	switch {
	case txn.LeaseGone(err):
		// The target's pod, block or claim lease is gone: it takes nothing.
		if _, derr := sc.cli.Txn(octx).If(keyspace.Unchanged(p.mkey, p.mrev)).Then(clientv3.OpDelete(p.mkey)).Commit(); derr != nil {
			return Departure{}, false, sc.unavailable("end the live migration of claim "+p.claim, derr)
		}
		sc.log.Warn("live migration's target cannot take the claim (its leases are gone); the holder's DEL releases it as usual",
			"claim", p.claim, "target", p.m.Target.Owner, "err", err)
		return Departure{}, false, nil
	case err != nil:
		return Departure{}, false, sc.unavailable("complete the live migration of claim "+p.claim, err)
	case !resp.Succeeded:
		return Departure{}, true, nil
	}
	sc.cfg.Live.Completed(SourceDeleted)
	sc.seen.drop(p.mkey)
	sc.log.Info("live migration completed: its source was deleted; the target holds the claim", "claim", p.claim,
		"source", p.owner, "target", p.m.Target.Owner, "target_node", p.m.Target.Node)
	return Departure{Done: true, Revision: resp.Header.Revision, Left: resp.Responses[len(resp.Responses)-1].GetResponseRange().Count}, false, nil
}

// Unclaimed notes an ADD on network whose configuration makes claims migratable (ipam
// migratable, allowPersistentIPs) but which named no claim: stock Multus drops the
// ipam-claim-reference, so this is what a VM's pod gets until cni-args carries it. The pod
// gets addresses as any other; the first such ADD of each network says why it may not keep
// them through a migration.
func (sc *Claims) Unclaimed(network string) {
	if _, logged := sc.unclaimed.LoadOrStore(network, true); !logged {
		sc.log.Warn("allowPersistentIPs without a claim reference: Multus does not forward ipam-claim-reference; put it in cni-args",
			"network", network)
	}
}
