// Package sticky holds the agent's sticky claims (issue 19; docs/proposals/sticky.md). An
// attachment that names a claim keeps its addresses for the next attachment naming it. The
// claim record and one quarantine key per address, marked with the claim, live on a claim
// lease: renewed by the holder's agent while it holds the claim, moved by its release onto a
// lease of hold plus quarantine that nobody renews. Every other ADD compares those quarantine
// keys absent, so the addresses stay out of others' reach for as long as the claim lives,
// through a holder's DEL or its node's death; only an ADD naming the claim takes them,
// comparing the keys unchanged. Uniqueness still comes from each address's create-if-absent
// allocation key.
package sticky

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/txn"
)

// Claims is the agent's part that holds sticky claims: it reads and takes a claim for an
// ADD naming one, releases it with a hold for a DEL, keeps (audits and puts back) the claims
// of running attachments, and after etcd went back in time releases the stale ones and puts
// back those it released. It owns what the agent knows of the claims it keeps (kept: the
// ModRevisions found right, the conflicts logged, the releases within their hold and their
// file in the state directory). The agent calls it from ADD (Read, Claim, Drop), DEL
// (Release, ReleaseTTL, Released), start (ResumeReleases, ResumeClaims), the audit (Audit),
// the re-claim (KeepClaimsOf) and the resolution of a conflict (KeepClaimLocked). What it
// needs of the agent is handed in when Start makes it (New).
type Claims struct {
	cfg    Config
	cli    *clientv3.Client // the gate's
	keeper *keeper.Keeper   // renews the claim leases
	log    *slog.Logger
	pods   Book
	locks  *ownerlock.Locks

	kept stickyKept
	// unclaimed are the networks whose migratable configuration came without a claim, logged
	// once each (Unclaimed).
	unclaimed sync.Map
	// seen are the live migrations this node's pods take part in (livecount.go).
	seen liveSeen
	// waits are the targets whose re-claim waits for their source's agent, by owner index
	// key and container, since the first attempt (awaitSource).
	waits sync.Map
}

// Config is what the sticky claims use of the agent's Config, and what they are handed of
// the agent's other parts.
type Config struct {
	Cluster, Node, NodeUID string
	// ClaimHold is the hold of a claim whose configuration gives none; LeaseTTL the pods'
	// (a claim's hold must outlive it); Quarantine is added to a released claim's lease.
	ClaimHold, LeaseTTL, Quarantine time.Duration
	OpTimeout                       time.Duration
	WallClock                       func() time.Time
	// StateDir keeps the released claims (releasedFile); "" keeps none.
	StateDir string
	Log      *slog.Logger
	// Layout is the stored block layout of a pool, and whether leaseholdctl pool migrate is
	// moving the pool to it (its keys then move under the migration's freeze).
	Layout func(ctx context.Context, pool string) (blocks allocator.Blocks, migrating bool, err error)
	// RestoreGen is the last notice of etcd going back in time (restorehold.Hold.Pending).
	RestoreGen func() uint64
	// AuditDue asks the recovery loop for an audit: a repair failed.
	AuditDue func()
	// LeaseAlive tells whether etcd still has a lease (the audit's).
	LeaseAlive func(context.Context, clientv3.LeaseID) bool
	// Refused counts the ADDs refused because another owner holds a claim's addresses;
	// KeysLost the keys found missing or changed in etcd and put back.
	Refused, KeysLost prometheus.Counter
	// Live counts the live migrations this node's pods take part in (livecount.go).
	Live LiveMetrics
	// LiveMigrationBound is the age above which such a migration has hung: each is logged
	// once when the audit finds it older (livecount.go). 0 logs none.
	LiveMigrationBound time.Duration
	// HeldLease is the lease this node's held keys go on (the block lease; 0: none are
	// written), named by a live migration key the target's agent writes again. HeldLeaseGone
	// asks etcd whether block lease id is gone, and if so drops it with its claims (the next
	// HeldLease is another), as a claim refused on it does.
	HeldLease     func(ctx context.Context) (clientv3.LeaseID, error)
	HeldLeaseGone func(ctx context.Context, id clientv3.LeaseID) bool
}

// Book is what the sticky claims ask of the pod book (podbook.Book): of its audit view
// Sticky, of a change SetClaim.
type Book interface {
	Audit() podbook.Audit
	Snapshot(owner string) (podbook.PodState, bool)
	Change(o *ownerlock.Owned) podbook.Change
	HoldsClaim(pool, name string) bool
	MayMigrate() bool
	Lists(owner, ifName, pool, container string) bool
	ClaimLeases() []clientv3.LeaseID
}

// New returns the sticky claims of the agent whose etcd client (the gate's) is cli, whose
// keeper renews the claim leases, whose pod book is pods and whose owner locks are locks.
func New(cli *clientv3.Client, k *keeper.Keeper, pods Book, locks *ownerlock.Locks, cfg Config) *Claims {
	return &Claims{cfg: cfg, cli: cli, keeper: k, log: cfg.Log, pods: pods, locks: locks}
}

// ResumeReleases takes up the releases an earlier run of the agent saved in the state
// directory whose hold has not ended.
func (sc *Claims) ResumeReleases() {
	sc.kept.dir, sc.kept.log = sc.cfg.StateDir, sc.log
	if rel, err := loadReleased(sc.cfg.StateDir, time.Now()); err != nil {
		sc.log.Warn("the saved sticky claims this node released are unreadable; a restore of etcd from a backup older than "+
			"their release loses them", "err", err)
	} else {
		sc.kept.resume(rel)
	}
}

// Released records that the claim at key, of claim name in pool, went without a holder onto
// a lease of ttl (its hold plus quarantine), as rec with its addresses resting as q.
func (sc *Claims) Released(key, pool, name string, rec keyspace.ClaimRecord, q keyspace.QuarantineRecord, ttl time.Duration) {
	sc.kept.released(key, pool, name, rec, q, ttl)
}

// opCtx bounds one etcd request by the operation timeout.
func (sc *Claims) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, sc.cfg.OpTimeout)
}

// wall is the time written into records; see Config.WallClock.
func (sc *Claims) wall() time.Time { return sc.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (sc *Claims) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// Add is what an ADD naming a claim read of it (Read); the ADD keeps it across its attempts.
type Add struct {
	Name, Key string
	Hold      time.Duration
	Rev       int64                // the claim record's ModRevision; 0: there was none
	Resting   map[netip.Addr]int64 // quarantine keys of the claim's addresses: ModRevision
	Handover  bool                 // the record named another holder or none
	Lease     clientv3.LeaseID     // the claim lease this ADD writes on, granted at first use
	Used      bool                 // the lease carries the claim now (set by the ADD)
	Stale     bool                 // a claim transaction found it changed: read it again (set by the ADD)
	// Migration: the ADD is a live migration's target (migration.go); nil: it is not.
	Migration *Migration
}

// claimHold is the hold of req's claim: the configuration's, else the agent's default.
func (sc *Claims) claimHold(req allocator.Request) (time.Duration, error) {
	hold := sc.cfg.ClaimHold
	if req.ClaimHold > 0 {
		hold = req.ClaimHold
	}
	if hold < sc.cfg.LeaseTTL {
		return 0, fmt.Errorf("%w: stickyHold %s is shorter than the agent's lease TTL %s: a dead node's claims must outlive its pods' leases; "+
			"give a longer stickyHold", allocator.ErrInvalidConfig, hold, sc.cfg.LeaseTTL)
	}
	if req.Migratable && hold < 2*sc.cfg.LeaseTTL {
		return 0, fmt.Errorf("%w: stickyHold %s of migratable claim %q is shorter than twice the agent's lease TTL %s: a live migration's "+
			"target must take the claim over after its source's node died, before the claim's hold runs out; give a stickyHold of at least %s",
			allocator.ErrInvalidConfig, hold, req.Claim, sc.cfg.LeaseTTL, 2*sc.cfg.LeaseTTL)
	}
	return hold, nil
}

// stickyWaitStep is how often an ADD whose claim's addresses are still held looks again.
const stickyWaitStep = 500 * time.Millisecond

// Read reads the claim req names, in pool spec, for owner's ADD, and the state of its
// addresses; orig are the addresses the runtime asked for, and req's become the claim's. prev
// is what an earlier attempt of the ADD read, if any: the claim lease it granted, still
// unused, is kept. A claim whose addresses another owner still holds (the previous pod lives,
// or its node's lease has not expired) is waited for, polling, until shortly before ctx ends;
// then the ADD fails naming the holder, also when ctx ends during a later poll (a slow etcd):
// the holder the last answer named is still the reason. The addresses are never taken from a
// live holder. Its errors wrap allocator.ErrUnavailable (held, or etcd did not answer) or
// allocator.ErrInvalidConfig (a hold shorter than the lease TTL, other addresses asked for).
func (sc *Claims) Read(ctx context.Context, spec allocator.PoolSpec, req *allocator.Request, owner string, orig []netip.Addr,
	prev *Add) (*Add, error) {
	hold, err := sc.claimHold(*req)
	if err != nil {
		return nil, err
	}
	key := keyspace.ClaimKey(sc.cfg.Cluster, spec.Name, req.Claim)
	var held *heldBy
	for {
		s, holder, err := sc.readClaim(ctx, spec, req, owner, orig, key)
		if err != nil && held != nil && ctx.Err() != nil {
			holder, err = held, nil
		}
		if err != nil {
			return nil, err
		}
		if holder == nil {
			s.Hold = hold
			if prev != nil {
				s.Lease = prev.Lease // granted by an earlier attempt, still unused
			}
			return s, nil
		}
		held = holder
		deadline, ok := ctx.Deadline()
		if !ok || time.Until(deadline) < 2*stickyWaitStep || ctx.Err() != nil {
			sc.cfg.Refused.Inc()
			if holder.migrating {
				sc.cfg.Live.Refused()
				return nil, fmt.Errorf("%w: claim %q of pool %q: held by %s; a third attachment gets the addresses only once one of them "+
					"is deleted or its lease expires", allocator.ErrUnavailable, req.Claim, spec.Name, holder.who)
			}
			return nil, fmt.Errorf("%w: claim %q of pool %q: its addresses are still held by %s; an attachment naming the claim gets them "+
				"only once that pod is deleted or its lease expires; retry then", allocator.ErrUnavailable, req.Claim, spec.Name, holder.who)
		}
		select {
		case <-ctx.Done():
			return nil, sc.unavailable("wait for claim "+req.Claim, ctx.Err())
		case <-time.After(stickyWaitStep):
		}
	}
}

// readClaim reads the claim record, its addresses' allocation and quarantine keys and its
// live migration key. It returns who holds the addresses when another owner holds one (or one
// rests in quarantine for something else than this claim), or a migration names another
// target; else the claim as this ADD will take it, or migrate it (Add.Migration); the
// request's addresses become the claim's.
func (sc *Claims) readClaim(ctx context.Context, spec allocator.PoolSpec, req *allocator.Request, owner string, orig []netip.Addr,
	key string) (*Add, *heldBy, error) {
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	resp, err := sc.cli.Get(octx, key)
	if err != nil {
		return nil, nil, sc.unavailable("read claim "+key, err)
	}
	s := &Add{Name: req.Claim, Key: key, Resting: make(map[netip.Addr]int64)}
	if len(resp.Kvs) == 0 {
		return s, nil, nil
	}
	rec, err := keyspace.Decode[keyspace.ClaimRecord](key, resp.Kvs[0].Value)
	if err != nil {
		return nil, nil, err
	}
	s.Rev = resp.Kvs[0].ModRevision
	s.Handover = rec.Holder == nil || rec.Holder.Owner != owner
	if len(orig) > 0 && !slices.Equal(orig, rec.IPs) {
		return nil, nil, fmt.Errorf("%w: claim %q holds %v, but the runtime asks for %v; ask for none or for the claim's",
			allocator.ErrInvalidConfig, req.Claim, rec.IPs, orig)
	}
	var ops []clientv3.Op
	for _, ip := range rec.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(spec.Name, spec.Blocks, ip)),
			clientv3.OpGet(keyspace.QuarantineKey(spec.Name, spec.Blocks, ip)))
	}
	ops = append(ops, clientv3.OpGet(keyspace.LiveMigrationKey(sc.cfg.Cluster, spec.Name, req.Claim)))
	resps, _, err := poolview.ReadChunked(octx, sc.cli, ops)
	if err != nil {
		return nil, nil, sc.unavailable("read the addresses of claim "+key, err)
	}
	var foreign *heldBy
	allocs := make([]*mvccpb.KeyValue, len(rec.IPs))
	for i, ip := range rec.IPs {
		if kvs := resps[2*i].GetResponseRange().Kvs; len(kvs) > 0 {
			allocs[i] = kvs[0]
			al, _ := keyspace.Decode[keyspace.Allocation](string(kvs[0].Key), kvs[0].Value)
			if al.Owner != owner && foreign == nil {
				foreign = &heldBy{who: fmt.Sprintf("owner %s (pod %s/%s, node %s, container %s, lease %s)",
					al.Owner, al.Pod.Namespace, al.Pod.Name, al.Node, al.ContainerID, al.LeaseID)}
			}
		}
		if kvs := resps[2*i+1].GetResponseRange().Kvs; len(kvs) > 0 {
			q, _ := keyspace.Decode[keyspace.QuarantineRecord](string(kvs[0].Key), kvs[0].Value)
			if q.Claim != req.Claim && foreign == nil {
				foreign = &heldBy{who: fmt.Sprintf("a release by %s resting until %s", q.ReleasedBy, q.Until.Format(time.RFC3339))}
			}
			s.Resting[ip] = kvs[0].ModRevision
		}
	}
	var mig *mvccpb.KeyValue
	if kvs := resps[len(resps)-1].GetResponseRange().Kvs; len(kvs) > 0 {
		mig = kvs[0]
	}
	if mig != nil || foreign != nil {
		r := *req
		r.Pool = spec
		m, third, err := sc.migrationOf(key, rec, owner, &r, allocs, mig)
		switch {
		case err != nil:
			return nil, nil, err
		case third != nil:
			return nil, third, nil
		case m != nil && (m.Started || foreign != nil):
			s.Migration = m
		case foreign != nil:
			return nil, foreign, nil
		}
	}
	req.RequestedIPs = rec.IPs
	return s, nil, nil
}

// Claim adds s, the claim owner's ADD of req read, to the ADD's claim transaction c: the
// record with this attachment as holder, and a quarantine key per address marked with the
// claim, on the claim lease (granted here at first use and renewed by the keeper). Its error
// wraps allocator.ErrUnavailable when the grant was not answered.
func (sc *Claims) Claim(ctx context.Context, s *Add, owner string, req allocator.Request, c *txn.Claim, now time.Time) error {
	if err := sc.grant(ctx, s); err != nil {
		return err
	}
	c.ClaimKey, c.ClaimRev, c.ClaimLease, c.Resting = s.Key, s.Rev, s.Lease, s.Resting
	c.ClaimQ = keyspace.Encode(keyspace.QuarantineRecord{Claim: s.Name})
	c.ClaimRec = keyspace.ClaimRecord{IPs: c.Addrs, HoldSeconds: int64(s.Hold / time.Second), Since: now,
		Holder: &keyspace.ClaimHolder{Owner: owner, Pod: req.Pod, Node: sc.cfg.Node, NodeUID: sc.cfg.NodeUID,
			ContainerID: req.ContainerID, IfName: req.IfName, LeaseID: keyspace.LeaseHex(c.Lease)}, Migratable: req.Migratable}
	c.Index.Claim, c.Index.ClaimLease, c.Index.ClaimHoldSeconds = s.Name, keyspace.LeaseHex(s.Lease), int64(s.Hold/time.Second)
	c.Index.ClaimMigratable = req.Migratable
	return nil
}

// Drop gives up the claim lease an ADD granted (s, nil if it named no claim) but did not bind
// the claim to.
func (sc *Claims) Drop(s *Add) {
	if s != nil && s.Lease != 0 && !s.Used {
		if err := sc.keeper.Revoke(s.Lease); err != nil {
			sc.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(s.Lease), "err", err)
		}
	}
}

// Release prepares the release of a sticky attachment: the claim record without a
// holder, keeping the claim's migratable mark, and the claim's quarantine keys go onto a
// fresh lease of hold plus quarantine that nobody renews. It returns the claim key, the
// released record and that lease.
func (sc *Claims) Release(ctx context.Context, pool, owner string, at podbook.Attachment) (string, keyspace.ClaimRecord, clientv3.LeaseID, error) {
	hold := at.ClaimHold
	if hold <= 0 {
		hold = sc.cfg.ClaimHold
	}
	ttl := sc.ReleaseTTL(at)
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	resp, err := sc.cli.Grant(octx, int64((ttl+time.Second-1)/time.Second))
	if err != nil {
		return "", keyspace.ClaimRecord{}, 0, sc.unavailable("grant the lease of a released claim", err)
	}
	now := sc.wall()
	rec := keyspace.ClaimRecord{IPs: at.IPs, HoldSeconds: int64(hold / time.Second), Since: now, Released: now, Migratable: at.ClaimMigratable}
	return keyspace.ClaimKey(sc.cfg.Cluster, pool, at.Claim), rec, resp.ID, nil
}

// ReleaseTTL is the TTL of the lease at's claim goes onto when released: its hold plus
// quarantine.
func (sc *Claims) ReleaseTTL(at podbook.Attachment) time.Duration {
	hold := at.ClaimHold
	if hold <= 0 {
		hold = sc.cfg.ClaimHold
	}
	return hold + max(sc.cfg.Quarantine, 0)
}

// ResumeClaims renews again, after a restart, the claim leases of the attachments this node
// holds (from the journal or the owner indexes).
func (sc *Claims) ResumeClaims(ctx context.Context) {
	for _, id := range sc.pods.ClaimLeases() {
		octx, cancel := sc.opCtx(ctx)
		err := sc.keeper.Adopt(octx, id)
		cancel()
		if err != nil {
			sc.log.Warn("a claim lease could not be resumed; the audit puts the claim back on a new one",
				"lease", keyspace.LeaseHex(id), "err", err)
		}
	}
}
