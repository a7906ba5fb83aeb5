package sticky

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
)

// Keeping the sticky claims of running attachments (issue 32). The claim record and its
// addresses' claim-marked quarantine keys are on the claim lease, not the pod's: a backup
// restored, an admin's etcdctl or a claim lease gone change them without touching the pod's
// keys. So the audit checks them as it checks the pod's (one compare per key, by the
// ModRevision last found right), and so do the re-claim of a pod and the resolution of a
// conflict; what is wrong is put back, compared as read, on the attachment's claim lease, or
// on a new one if that one is gone (the owner index, on the pod lease, then names it).
//
// A record naming another holder is taken over only while this attachment holds every
// address it does not list as a conflict and no other owner holds one of the claim's: a
// holder that is live holds them. Otherwise it is a conflict, logged, never taken. A claim an
// admin released (leaseholdctl claim release drops it from the owner index too) is not put
// back: the attachment keeps its addresses without it. After etcd went back in time, a
// record the backup brought back naming an attachment of this node deleted since is released
// as its DEL did (releaseStaleClaims).

// stickyRef names one attachment.
type stickyRef struct{ owner, ifName, pool string }

// stickyCheck is what the audit expects of one running attachment's claim: the claim record,
// then the claim-marked quarantine key of each address not in conflict, on the claim lease.
type stickyCheck struct {
	ref  stickyRef
	at   podbook.Attachment
	keys []string
	revs []int64 // per key, the ModRevision last found right; nil: not yet
}

// stickyKept is what the agent knows of the claims it keeps.
type stickyKept struct {
	mu     sync.Mutex
	revs   map[stickyRef]stickyRevs
	logged map[string]string // claim key -> the conflict last logged of it
	// swept is the last notice of etcd going back in time (the restore hold's) after which the
	// claims naming attachments of this node deleted since were released.
	swept atomic.Uint64
	// releases are the claims this agent released, by claim key, until their hold ends: a
	// restore of a backup from before the release takes them (releaseStaleClaims). They are
	// kept in the state directory too (releasedFile), for an agent restarted within the hold.
	releases map[string]releasedClaim
	// dir is the state directory; log tells when the releases could not be saved there.
	dir string
	log *slog.Logger
}

// stickyRevs are the ModRevisions of an attachment's claim keys when last found right.
type stickyRevs struct {
	container string
	lease     clientv3.LeaseID
	keys      []string
	revs      []int64
}

// revsOf returns the ModRevisions last found right of c's keys, if they are c's.
func (s *stickyKept) revsOf(c stickyCheck) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.revs[c.ref]
	if !ok || r.container != c.at.ContainerID || r.lease != c.at.ClaimLease || !slices.Equal(r.keys, c.keys) {
		return nil
	}
	return r.revs
}

// found records the ModRevisions of c's keys found right.
func (s *stickyKept) found(c stickyCheck, revs []int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.revs == nil {
		s.revs = map[stickyRef]stickyRevs{}
	}
	s.revs[c.ref] = stickyRevs{container: c.at.ContainerID, lease: c.at.ClaimLease, keys: c.keys, revs: revs}
}

// prune forgets the attachments not in checks.
func (s *stickyKept) prune(checks []stickyCheck) {
	keep := make(map[stickyRef]bool, len(checks))
	for _, c := range checks {
		keep[c.ref] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for ref := range s.revs {
		if !keep[ref] {
			delete(s.revs, ref)
		}
	}
}

// conflictNew tells whether what is the conflict of claim key not logged last.
func (s *stickyKept) conflictNew(key, what string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.logged == nil {
		s.logged = map[string]string{}
	}
	if s.logged[key] == what {
		return false
	}
	s.logged[key] = what
	return true
}

func (s *stickyKept) conflictGone(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.logged, key)
}

// stickyKeys are the keys the audit expects of at's claim in a pool of layout blocks.
func stickyKeys(cluster string, at podbook.Attachment, blocks allocator.Blocks) (keys []string, addrs []netip.Addr) {
	keys = append(keys, keyspace.ClaimKey(cluster, at.Pool, at.Claim))
	for _, ip := range at.IPs {
		if !slices.Contains(at.Conflicts, ip) {
			keys = append(keys, keyspace.QuarantineKey(at.Pool, blocks, ip))
			addrs = append(addrs, ip)
		}
	}
	return keys, addrs
}

// Audit is the audit of the running attachments' claims (see the top of this file): a
// compare per key of those found right before, a read of the others and of those whose
// compare failed, and the repair, under the owner's lock, of what is not right. After etcd
// went back in time it also releases the claims naming this node's deleted attachments.
func (sc *Claims) Audit(ctx context.Context, layouts map[string]allocator.Blocks) error {
	var checks []stickyCheck
	for _, h := range sc.pods.Audit().Sticky(layouts) {
		keys, _ := stickyKeys(sc.cfg.Cluster, h.At, layouts[h.At.Pool])
		checks = append(checks, stickyCheck{ref: stickyRef{h.Owner, h.At.IfName, h.At.Pool}, at: h.At, keys: keys})
	}
	sc.kept.prune(checks)
	var verified, unverified []stickyCheck
	for _, c := range checks {
		if c.revs = sc.kept.revsOf(c); c.revs != nil && sc.keeper.Holds(c.at.ClaimLease) {
			verified = append(verified, c)
		} else {
			unverified = append(unverified, c)
		}
	}
	size := func(c stickyCheck) int { return len(c.keys) }
	for len(verified) > 0 {
		n := keyspace.TxnChunk(verified, size)
		chunk := verified[:n]
		verified = verified[n:]
		var cmps []clientv3.Cmp
		for _, c := range chunk {
			for i, k := range c.keys {
				cmps = append(cmps, keyspace.Unchanged(k, c.revs[i]))
			}
		}
		octx, cancel := sc.opCtx(ctx)
		resp, err := sc.cli.Txn(octx).If(cmps...).Commit()
		cancel()
		if err != nil {
			return sc.unavailable("check the sticky claims of this node's pods", err)
		}
		if !resp.Succeeded {
			unverified = append(unverified, chunk...)
		}
	}
	var errs []error
	for len(unverified) > 0 {
		n := keyspace.TxnChunk(unverified, size)
		chunk := unverified[:n]
		unverified = unverified[n:]
		var ops []clientv3.Op
		for _, c := range chunk {
			for _, k := range c.keys {
				ops = append(ops, clientv3.OpGet(k))
			}
		}
		octx, cancel := sc.opCtx(ctx)
		resp, err := sc.cli.Txn(octx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return sc.unavailable("read the sticky claims of this node's pods", err)
		}
		i := 0
		for _, c := range chunk {
			kvs := make([]*mvccpb.KeyValue, len(c.keys))
			for j := range c.keys {
				if got := resp.Responses[i].GetResponseRange().Kvs; len(got) > 0 {
					kvs[j] = got[0]
				}
				i++
			}
			ps, _ := sc.pods.Snapshot(c.ref.owner)
			podLease, _ := ps.Held()
			if revs, ok := sc.claimRight(c.ref.owner, c.at, kvs, podLease); ok && sc.keeper.Holds(c.at.ClaimLease) {
				sc.kept.found(c, revs)
				continue
			}
			errs = append(errs, sc.keepClaim(ctx, c.ref))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if gen := sc.cfg.RestoreGen(); gen != sc.kept.swept.Load() {
		if err := sc.releaseStaleClaims(ctx); err != nil {
			return err
		}
		if err := sc.deleteStaleMigrations(ctx); err != nil {
			return err
		}
		if err := sc.restoreReleasedClaims(ctx); err != nil {
			return err
		}
		sc.kept.swept.Store(gen)
	}
	return nil
}

// holderIs tells whether h names owner's attachment at on this node identity, on its pod
// lease podLease: a live migration starts from the record's lease (migrationOf), so one left
// from before a re-claim would refuse it.
func (sc *Claims) holderIs(h *keyspace.ClaimHolder, owner string, at podbook.Attachment, podLease clientv3.LeaseID) bool {
	return h != nil && h.Owner == owner && h.IfName == at.IfName && h.ContainerID == at.ContainerID && h.NodeUID == sc.cfg.NodeUID &&
		h.LeaseID == keyspace.LeaseHex(podLease)
}

// claimRight tells whether kvs, read for owner's attachment at at the keys stickyKeys lists,
// are as the agent writes them on at's claim lease, and returns their ModRevisions.
func (sc *Claims) claimRight(owner string, at podbook.Attachment, kvs []*mvccpb.KeyValue, podLease clientv3.LeaseID) ([]int64, bool) {
	revs := make([]int64, len(kvs))
	for i, kv := range kvs {
		if kv == nil || at.ClaimLease == 0 || keyspace.LeaseOf(kv) != at.ClaimLease {
			return nil, false
		}
		if i == 0 {
			rec, err := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
			if err != nil || !sc.holderIs(rec.Holder, owner, at, podLease) || !slices.Equal(rec.IPs, at.IPs) ||
				rec.Migratable != at.ClaimMigratable {
				return nil, false
			}
		} else if q, err := keyspace.Decode[keyspace.QuarantineRecord](string(kv.Key), kv.Value); err != nil || q.Claim != at.Claim {
			return nil, false
		}
		revs[i] = kv.ModRevision
	}
	return revs, true
}

// keepClaim checks and repairs ref's claim under its owner's lock.
func (sc *Claims) keepClaim(ctx context.Context, ref stickyRef) error {
	own := sc.locks.Lock(ref.owner)
	defer own.Unlock()
	return sc.KeepClaimLocked(ctx, own, ref.owner, ref.ifName, ref.pool)
}

// KeepClaimsOf checks and repairs the claims of own's attachments. One that cannot be
// checked now is left to the next audit.
func (sc *Claims) KeepClaimsOf(ctx context.Context, own *ownerlock.Owned) error {
	owner := own.Owner()
	ps, ok := sc.pods.Snapshot(owner)
	if !ok {
		return nil
	}
	var errs []error
	for _, at := range ps.Attachments {
		if at.Claim != "" && !at.Released && !at.Target { // a target's claim is its source's
			errs = append(errs, sc.KeepClaimLocked(ctx, own, owner, at.IfName, at.Pool))
		}
	}
	return errors.Join(errs...)
}

// KeepClaimLocked checks the claim of owner's attachment on ifName in pool and puts back what
// is not as the agent wrote it, under own, owner's lock. A failure makes an audit due, which
// tries again.
func (sc *Claims) KeepClaimLocked(ctx context.Context, own *ownerlock.Owned, owner, ifName, pool string) (err error) {
	ref := stickyRef{owner, ifName, pool}
	defer func() {
		if err != nil {
			sc.cfg.AuditDue()
		}
	}()
	for range 3 {
		ps, ok := sc.pods.Snapshot(ref.owner)
		podLease, held := ps.Held()
		i := slices.IndexFunc(ps.Attachments, func(at podbook.Attachment) bool { return at.IfName == ref.ifName && at.Pool == ref.pool })
		if !ok || !held || i < 0 || ps.Attachments[i].Claim == "" || ps.Attachments[i].Released {
			return nil // released, or being re-claimed: the re-claim checks it
		}
		blocks, migrating, err := sc.cfg.Layout(ctx, ref.pool)
		if err != nil {
			return err
		}
		if migrating {
			return nil // its keys move under the migration's freeze
		}
		done, err := sc.keepClaimOnce(ctx, own, ps, podLease, ps.Attachments[i], blocks)
		if err != nil || done {
			return err
		}
	}
	return fmt.Errorf("%w: the sticky claim of %s/%s in pool %s kept changing while it was put back",
		allocator.ErrUnavailable, ref.owner, ref.ifName, ref.pool)
}
