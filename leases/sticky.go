package leases

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/txn"
)

// Sticky claims (issue 19; docs/proposals/sticky.md). An attachment that names a claim keeps
// its addresses for the next attachment naming it. The claim record and one quarantine key per
// address, marked with the claim, live on a claim lease: renewed by the holder's agent while
// it holds the claim, moved by its release onto a lease of hold plus quarantine that nobody
// renews. Every other ADD compares those quarantine keys absent, so the addresses stay out of
// others' reach for as long as the claim lives, through a holder's DEL or its node's death;
// only an ADD naming the claim takes them, comparing the keys unchanged. Uniqueness still
// comes from each address's create-if-absent allocation key.

// stickyClaims is the agent's part that holds sticky claims: it reads and takes a claim for an
// ADD naming one, releases it with a hold for a DEL, keeps (audits and puts back) the claims
// of running attachments, and after etcd went back in time releases the stale ones and puts
// back those it released. It owns what the agent knows of the claims it keeps (kept: the
// ModRevisions found right, the conflicts logged, the releases within their hold and their
// file in the state directory). The agent calls it from ADD (readSticky, stickyClaim,
// dropSticky), DEL (releaseSticky, claimReleaseTTL, released), start (resumeReleases,
// resumeClaims), the audit (auditClaims), the re-claim (keepClaimsOf) and the resolution of a
// conflict (keepClaimLocked). What it needs of the agent is handed in when Start makes it.
type stickyClaims struct {
	cfg    stickyConfig
	cli    *clientv3.Client // the gate's
	keeper *keeper.Keeper   // renews the claim leases
	log    *slog.Logger
	pods   stickyBook
	locks  *ownerlock.Locks
	// layout is the stored block layout of a pool, and whether leaseholdctl pool migrate is
	// moving the pool to it (its keys then move under the migration's freeze).
	layout func(ctx context.Context, pool string) (blocks allocator.Blocks, migrating bool, err error)
	// restoreGen is the last notice of etcd going back in time (restorehold.Hold.Pending).
	restoreGen func() uint64
	// auditDue asks the recovery loop for an audit: a repair failed.
	auditDue func()
	// leaseAlive tells whether etcd still has a lease (audit.Auditor.LeaseAlive).
	leaseAlive func(context.Context, clientv3.LeaseID) bool
	// refused counts the ADDs refused because another owner holds a claim's addresses;
	// keysLost the keys found missing or changed in etcd and put back.
	refused, keysLost prometheus.Counter

	kept stickyKept
}

// stickyConfig is what the sticky claims use of the agent's Config.
type stickyConfig struct {
	Cluster, Node, NodeUID string
	// ClaimHold is the hold of a claim whose configuration gives none; LeaseTTL the pods'
	// (a claim's hold must outlive it); Quarantine is added to a released claim's lease.
	ClaimHold, LeaseTTL, Quarantine time.Duration
	OpTimeout                       time.Duration
	WallClock                       func() time.Time
	// StateDir keeps the released claims (releasedFile); "" keeps none.
	StateDir string
}

// stickyBook is what the sticky claims ask of the pod book (podbook.Book): of its audit view
// Sticky, of a change SetClaim.
type stickyBook interface {
	Audit() podbook.Audit
	Snapshot(owner string) (podState, bool)
	Change(o *ownerlock.Owned) podbook.Change
	HoldsClaim(pool, name string) bool
	Lists(owner, ifName, pool, container string) bool
	ClaimLeases() []clientv3.LeaseID
}

// resumeReleases takes up the releases an earlier run of the agent saved in the state
// directory whose hold has not ended.
func (sc *stickyClaims) resumeReleases() {
	sc.kept.dir, sc.kept.log = sc.cfg.StateDir, sc.log
	if rel, err := loadReleased(sc.cfg.StateDir, time.Now()); err != nil {
		sc.log.Warn("the saved sticky claims this node released are unreadable; a restore of etcd from a backup older than "+
			"their release loses them", "err", err)
	} else {
		sc.kept.resume(rel)
	}
}

// released records that the claim at key, of claim name in pool, went without a holder onto
// a lease of ttl (its hold plus quarantine), as rec with its addresses resting as q.
func (sc *stickyClaims) released(key, pool, name string, rec keyspace.ClaimRecord, q keyspace.QuarantineRecord, ttl time.Duration) {
	sc.kept.released(key, pool, name, rec, q, ttl)
}

// opCtx bounds one etcd request by the operation timeout.
func (sc *stickyClaims) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, sc.cfg.OpTimeout)
}

// wall is the time written into records; see Config.WallClock.
func (sc *stickyClaims) wall() time.Time { return sc.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (sc *stickyClaims) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// stickyAdd is what an ADD naming a claim read of it.
type stickyAdd struct {
	name, key string
	hold      time.Duration
	rev       int64                // the claim record's ModRevision; 0: there was none
	resting   map[netip.Addr]int64 // quarantine keys of the claim's addresses: ModRevision
	handover  bool                 // the record named another holder or none
	lease     clientv3.LeaseID     // the claim lease this ADD writes on, granted at first use
	used      bool                 // the lease carries the claim now
	stale     bool                 // a claim transaction found it changed: read it again
}

// claimHold is the hold of req's claim: the configuration's, else the agent's default.
func (sc *stickyClaims) claimHold(req allocator.Request) (time.Duration, error) {
	hold := sc.cfg.ClaimHold
	if req.ClaimHold > 0 {
		hold = req.ClaimHold
	}
	if hold < sc.cfg.LeaseTTL {
		return 0, fmt.Errorf("%w: stickyHold %s is shorter than the agent's lease TTL %s: a dead node's claims must outlive its pods' leases; "+
			"give a longer stickyHold", allocator.ErrInvalidConfig, hold, sc.cfg.LeaseTTL)
	}
	return hold, nil
}

// stickyWaitStep is how often an ADD whose claim's addresses are still held looks again.
const stickyWaitStep = 500 * time.Millisecond

// readSticky reads st's claim and the state of its addresses, and sets st.sticky. A claim
// whose addresses another owner still holds (the previous pod lives, or its node's lease has
// not expired) is waited for, polling, until shortly before ctx ends; then the ADD fails
// naming the holder, also when ctx ends during a later poll (a slow etcd): the holder the last
// answer named is still the reason. The addresses are never taken from a live holder.
func (sc *stickyClaims) readSticky(ctx context.Context, spec allocator.PoolSpec, st *addState) error {
	hold, err := sc.claimHold(st.req)
	if err != nil {
		return err
	}
	key := keyspace.ClaimKey(sc.cfg.Cluster, spec.Name, st.req.Claim)
	held := ""
	for {
		s, holder, err := sc.readClaim(ctx, spec, st, key)
		if err != nil && held != "" && ctx.Err() != nil {
			holder, err = held, nil
		}
		if err != nil {
			return err
		}
		if holder == "" {
			s.hold = hold
			if prev := st.sticky; prev != nil {
				s.lease = prev.lease // granted by an earlier attempt, still unused
			}
			st.sticky = s
			return nil
		}
		held = holder
		deadline, ok := ctx.Deadline()
		if !ok || time.Until(deadline) < 2*stickyWaitStep || ctx.Err() != nil {
			sc.refused.Inc()
			return fmt.Errorf("%w: claim %q of pool %q: its addresses are still held by %s; an attachment naming the claim gets them "+
				"only once that pod is deleted or its lease expires; retry then", allocator.ErrUnavailable, st.req.Claim, spec.Name, holder)
		}
		select {
		case <-ctx.Done():
			return sc.unavailable("wait for claim "+st.req.Claim, ctx.Err())
		case <-time.After(stickyWaitStep):
		}
	}
}

// readClaim reads the claim record and its addresses' allocation and quarantine keys. It
// returns a non-empty holder when another owner holds an address (or one rests in quarantine
// for something else than this claim), else the claim as this ADD will take it; the request's
// addresses become the claim's.
func (sc *stickyClaims) readClaim(ctx context.Context, spec allocator.PoolSpec, st *addState, key string) (*stickyAdd, string, error) {
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	resp, err := sc.cli.Get(octx, key)
	if err != nil {
		return nil, "", sc.unavailable("read claim "+key, err)
	}
	s := &stickyAdd{name: st.req.Claim, key: key, resting: make(map[netip.Addr]int64)}
	if len(resp.Kvs) == 0 {
		return s, "", nil
	}
	rec, err := keyspace.Decode[keyspace.ClaimRecord](key, resp.Kvs[0].Value)
	if err != nil {
		return nil, "", err
	}
	s.rev = resp.Kvs[0].ModRevision
	s.handover = rec.Holder == nil || rec.Holder.Owner != st.owner
	if len(st.origRequested) > 0 && !slices.Equal(st.origRequested, rec.IPs) {
		return nil, "", fmt.Errorf("%w: claim %q holds %v, but the runtime asks for %v; ask for none or for the claim's",
			allocator.ErrInvalidConfig, st.req.Claim, rec.IPs, st.origRequested)
	}
	var ops []clientv3.Op
	for _, ip := range rec.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(spec.Name, spec.Blocks, ip)),
			clientv3.OpGet(keyspace.QuarantineKey(spec.Name, spec.Blocks, ip)))
	}
	resps, _, err := poolview.ReadChunked(octx, sc.cli, ops)
	if err != nil {
		return nil, "", sc.unavailable("read the addresses of claim "+key, err)
	}
	for i, ip := range rec.IPs {
		if kvs := resps[2*i].GetResponseRange().Kvs; len(kvs) > 0 {
			al, _ := keyspace.Decode[keyspace.Allocation](string(kvs[0].Key), kvs[0].Value)
			if al.Owner != st.owner {
				return nil, fmt.Sprintf("owner %s (pod %s/%s, node %s, container %s, lease %s)",
					al.Owner, al.Pod.Namespace, al.Pod.Name, al.Node, al.ContainerID, al.LeaseID), nil
			}
		}
		if kvs := resps[2*i+1].GetResponseRange().Kvs; len(kvs) > 0 {
			q, _ := keyspace.Decode[keyspace.QuarantineRecord](string(kvs[0].Key), kvs[0].Value)
			if q.Claim != st.req.Claim {
				return nil, fmt.Sprintf("a release by %s resting until %s", q.ReleasedBy, q.Until.Format(time.RFC3339)), nil
			}
			s.resting[ip] = kvs[0].ModRevision
		}
	}
	st.req.RequestedIPs = rec.IPs
	return s, "", nil
}

// stickyClaim adds st's claim to the ADD's claim transaction c: the record with this
// attachment as holder, and a quarantine key per address marked with the claim, on the claim
// lease (granted here at first use and renewed by the keeper).
func (sc *stickyClaims) stickyClaim(ctx context.Context, st *addState, c *txn.Claim, now time.Time) error {
	s := st.sticky
	if s.lease == 0 {
		resp, err := sc.cli.Grant(ctx, int64((s.hold+time.Second-1)/time.Second))
		if err != nil {
			return sc.unavailable("grant the claim lease", err)
		}
		if err := sc.keeper.Resume(resp.ID); err != nil {
			return err
		}
		s.lease = resp.ID
	}
	c.ClaimKey, c.ClaimRev, c.ClaimLease, c.Resting = s.key, s.rev, s.lease, s.resting
	c.ClaimQ = keyspace.Encode(keyspace.QuarantineRecord{Claim: s.name})
	c.ClaimRec = keyspace.ClaimRecord{IPs: c.Addrs, HoldSeconds: int64(s.hold / time.Second), Since: now,
		Holder: &keyspace.ClaimHolder{Owner: st.owner, Pod: st.req.Pod, Node: sc.cfg.Node, NodeUID: sc.cfg.NodeUID,
			ContainerID: st.req.ContainerID, IfName: st.req.IfName, LeaseID: keyspace.LeaseHex(c.Lease)}}
	c.Index.Claim, c.Index.ClaimLease, c.Index.ClaimHoldSeconds = s.name, keyspace.LeaseHex(s.lease), int64(s.hold/time.Second)
	return nil
}

// dropSticky gives up the claim lease an ADD granted but did not bind the claim to.
func (sc *stickyClaims) dropSticky(st *addState) {
	if s := st.sticky; s != nil && s.lease != 0 && !s.used {
		if err := sc.keeper.Revoke(s.lease); err != nil {
			sc.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(s.lease), "err", err)
		}
	}
}

// releaseSticky prepares the release of a sticky attachment: the claim record without a
// holder and the claim's quarantine keys go onto a fresh lease of hold plus quarantine that
// nobody renews. It returns the claim key, the released record and that lease.
func (sc *stickyClaims) releaseSticky(ctx context.Context, pool, owner string, at attachment) (string, keyspace.ClaimRecord, clientv3.LeaseID, error) {
	hold := at.ClaimHold
	if hold <= 0 {
		hold = sc.cfg.ClaimHold
	}
	ttl := sc.claimReleaseTTL(at)
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	resp, err := sc.cli.Grant(octx, int64((ttl+time.Second-1)/time.Second))
	if err != nil {
		return "", keyspace.ClaimRecord{}, 0, sc.unavailable("grant the lease of a released claim", err)
	}
	now := sc.wall()
	rec := keyspace.ClaimRecord{IPs: at.IPs, HoldSeconds: int64(hold / time.Second), Since: now, Released: now}
	return keyspace.ClaimKey(sc.cfg.Cluster, pool, at.Claim), rec, resp.ID, nil
}

// claimReleaseTTL is the TTL of the lease at's claim goes onto when released: its hold plus
// quarantine.
func (sc *stickyClaims) claimReleaseTTL(at attachment) time.Duration {
	hold := at.ClaimHold
	if hold <= 0 {
		hold = sc.cfg.ClaimHold
	}
	return hold + max(sc.cfg.Quarantine, 0)
}

// resumeClaims renews again, after a restart, the claim leases of the attachments this node
// holds (from the journal or the owner indexes).
func (sc *stickyClaims) resumeClaims(ctx context.Context) {
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
