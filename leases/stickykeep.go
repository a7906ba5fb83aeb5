package leases

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/txn"
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
	at   attachment
	keys []string
	revs []int64 // per key, the ModRevision last found right; nil: not yet
}

// stickyKept is what the agent knows of the claims it keeps.
type stickyKept struct {
	mu     sync.Mutex
	revs   map[stickyRef]stickyRevs
	logged map[string]string // claim key -> the conflict last logged of it
	// swept is the last notice of etcd going back in time (restoreHold's) after which the
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

// releasedClaim is a claim as this agent released it: the record and the quarantine record
// of its addresses, on a lease nobody renews that ends at ends.
type releasedClaim struct {
	pool, name string
	rec        keyspace.ClaimRecord
	q          keyspace.QuarantineRecord
	ends       time.Time
}

// released records that the claim at key went, without a holder, onto a lease of ttl (its
// hold plus quarantine).
func (s *stickyKept) released(key, pool, name string, rec keyspace.ClaimRecord, q keyspace.QuarantineRecord, ttl time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.releases == nil {
		s.releases = map[string]releasedClaim{}
	}
	now := time.Now()
	for k, r := range s.releases {
		if now.After(r.ends) {
			delete(s.releases, k)
		}
	}
	s.releases[key] = releasedClaim{pool: pool, name: name, rec: rec, q: q, ends: now.Add(ttl)}
	if err := saveReleased(s.dir, s.releases, now); err != nil {
		s.log.Warn("the sticky claims this node released could not be saved; a restart within their hold forgets them, and "+
			"a restore of etcd from a backup older than the release then loses them", "err", err)
	}
}

// resume takes up the releases an earlier run of the agent saved whose hold has not ended.
func (s *stickyKept) resume(from map[string]releasedClaim) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.releases = from
}

// releasedNow lists the claims this agent released whose hold has not ended, by key.
func (s *stickyKept) releasedNow() map[string]releasedClaim {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]releasedClaim{}
	for k, r := range s.releases {
		if time.Until(r.ends) > minLeaseTTL {
			out[k] = r
		}
	}
	return out
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
func stickyKeys(cluster string, at attachment, blocks allocator.Blocks) (keys []string, addrs []netip.Addr) {
	keys = append(keys, keyspace.ClaimKey(cluster, at.Pool, at.Claim))
	for _, ip := range at.IPs {
		if !slices.Contains(at.Conflicts, ip) {
			keys = append(keys, keyspace.QuarantineKey(at.Pool, blocks, ip))
			addrs = append(addrs, ip)
		}
	}
	return keys, addrs
}

// auditClaims is the audit of the running attachments' claims (see the top of this file): a
// compare per key of those found right before, a read of the others and of those whose
// compare failed, and the repair, under the owner's lock, of what is not right. After etcd
// went back in time it also releases the claims naming this node's deleted attachments.
func (a *Agent) auditClaims(ctx context.Context, layouts map[string]allocator.Blocks) error {
	var checks []stickyCheck
	for _, h := range a.pods.Audit().Sticky(layouts) {
		keys, _ := stickyKeys(a.cfg.Cluster, h.At, layouts[h.At.Pool])
		checks = append(checks, stickyCheck{ref: stickyRef{h.Owner, h.At.IfName, h.At.Pool}, at: h.At, keys: keys})
	}
	a.stickyKept.prune(checks)
	var verified, unverified []stickyCheck
	for _, c := range checks {
		if c.revs = a.stickyKept.revsOf(c); c.revs != nil && a.keeper.Holds(c.at.ClaimLease) {
			verified = append(verified, c)
		} else {
			unverified = append(unverified, c)
		}
	}
	size := func(c stickyCheck) int { return len(c.keys) }
	for len(verified) > 0 {
		n := nextChunk(verified, size)
		chunk := verified[:n]
		verified = verified[n:]
		var cmps []clientv3.Cmp
		for _, c := range chunk {
			for i, k := range c.keys {
				cmps = append(cmps, keyspace.Unchanged(k, c.revs[i]))
			}
		}
		octx, cancel := a.opCtx(ctx)
		resp, err := a.cli.Txn(octx).If(cmps...).Commit()
		cancel()
		if err != nil {
			return a.unavailable("check the sticky claims of this node's pods", err)
		}
		if !resp.Succeeded {
			unverified = append(unverified, chunk...)
		}
	}
	var errs []error
	for len(unverified) > 0 {
		n := nextChunk(unverified, size)
		chunk := unverified[:n]
		unverified = unverified[n:]
		var ops []clientv3.Op
		for _, c := range chunk {
			for _, k := range c.keys {
				ops = append(ops, clientv3.OpGet(k))
			}
		}
		octx, cancel := a.opCtx(ctx)
		resp, err := a.cli.Txn(octx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return a.unavailable("read the sticky claims of this node's pods", err)
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
			if revs, ok := a.claimRight(c.ref.owner, c.at, kvs); ok && a.keeper.Holds(c.at.ClaimLease) {
				a.stickyKept.found(c, revs)
				continue
			}
			errs = append(errs, a.keepClaim(ctx, c.ref))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if gen := a.hold.pending(); gen != a.stickyKept.swept.Load() {
		if err := a.releaseStaleClaims(ctx); err != nil {
			return err
		}
		if err := a.restoreReleasedClaims(ctx); err != nil {
			return err
		}
		a.stickyKept.swept.Store(gen)
	}
	return nil
}

// holderIs tells whether h names owner's attachment at on this node identity.
func (a *Agent) holderIs(h *keyspace.ClaimHolder, owner string, at attachment) bool {
	return h != nil && h.Owner == owner && h.IfName == at.IfName && h.ContainerID == at.ContainerID && h.NodeUID == a.cfg.NodeUID
}

// claimRight tells whether kvs, read for owner's attachment at at the keys stickyKeys lists,
// are as the agent writes them on at's claim lease, and returns their ModRevisions.
func (a *Agent) claimRight(owner string, at attachment, kvs []*mvccpb.KeyValue) ([]int64, bool) {
	revs := make([]int64, len(kvs))
	for i, kv := range kvs {
		if kv == nil || at.ClaimLease == 0 || keyspace.LeaseOf(kv) != at.ClaimLease {
			return nil, false
		}
		if i == 0 {
			rec, err := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
			if err != nil || !a.holderIs(rec.Holder, owner, at) || !slices.Equal(rec.IPs, at.IPs) {
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
func (a *Agent) keepClaim(ctx context.Context, ref stickyRef) error {
	own := a.locks.Lock(ref.owner)
	defer own.Unlock()
	return a.keepClaimLocked(ctx, own, ref)
}

// keepClaimsOf checks and repairs the claims of own's attachments. One that cannot be
// checked now is left to the next audit.
func (a *Agent) keepClaimsOf(ctx context.Context, own *ownerlock.Owned) error {
	owner := own.Owner()
	ps, ok := a.pods.Snapshot(owner)
	if !ok {
		return nil
	}
	var errs []error
	for _, at := range ps.Attachments {
		if at.Claim != "" && !at.Released {
			errs = append(errs, a.keepClaimLocked(ctx, own, stickyRef{owner, at.IfName, at.Pool}))
		}
	}
	return errors.Join(errs...)
}

// keepClaimLocked checks ref's claim and puts back what is not as the agent wrote it, under
// own, ref's owner's lock. A failure makes an audit due, which tries again.
func (a *Agent) keepClaimLocked(ctx context.Context, own *ownerlock.Owned, ref stickyRef) (err error) {
	defer func() {
		if err != nil {
			a.auditDue.Store(true)
		}
	}()
	for range 3 {
		ps, ok := a.pods.Snapshot(ref.owner)
		podLease, held := ps.Held()
		i := slices.IndexFunc(ps.Attachments, func(at attachment) bool { return at.IfName == ref.ifName && at.Pool == ref.pool })
		if !ok || !held || i < 0 || ps.Attachments[i].Claim == "" || ps.Attachments[i].Released {
			return nil // released, or being re-claimed: the re-claim checks it
		}
		p, err := a.pools.Ensure(ctx, allocator.PoolSpec{Name: ref.pool})
		if err != nil {
			return err
		}
		if p.Migrating != nil {
			return nil // its keys move under the migration's freeze
		}
		done, err := a.keepClaimOnce(ctx, own, ps, podLease, ps.Attachments[i], p.Spec.Blocks)
		if err != nil || done {
			return err
		}
	}
	return fmt.Errorf("%w: the sticky claim of %s/%s in pool %s kept changing while it was put back",
		allocator.ErrUnavailable, ref.owner, ref.ifName, ref.pool)
}

// keepClaimOnce is one check and repair of at's claim; done is false when a compare failed
// and it should run again.
func (a *Agent) keepClaimOnce(ctx context.Context, own *ownerlock.Owned, ps podState, podLease clientv3.LeaseID, at attachment, blocks allocator.Blocks) (done bool, _ error) {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	owner := ps.Owner
	lease := at.ClaimLease
	if lease != 0 && !a.keeper.Holds(lease) {
		// The keeper reported it lost: renewals stopped (etcd without a leader), or etcd no
		// longer has it (expired, revoked, or granted after a backup restored since).
		switch err := a.keeper.Adopt(octx, lease); {
		case errors.Is(err, keeper.ErrLeaseLost):
			lease = 0
		case err != nil:
			return false, a.unavailable("resume the claim lease "+keyspace.LeaseHex(lease), err)
		default:
			a.log.Warn("the claim lease of a running pod had stopped being renewed; resumed", "owner", owner, "claim", at.Claim,
				"lease", keyspace.LeaseHex(lease))
		}
	}
	key := keyspace.ClaimKey(a.cfg.Cluster, at.Pool, at.Claim)
	ownerKey := keyspace.OwnerKey(a.cfg.Cluster, owner, at.IfName, at.Pool)
	resp, err := a.cli.Txn(octx).Then(clientv3.OpGet(key), clientv3.OpGet(ownerKey)).Commit()
	if err != nil {
		return false, a.unavailable("read the claim "+key, err)
	}
	recKV, oiKV := firstKV(resp, 0), firstKV(resp, 1)
	// The owner index: the pod audit and the re-claim keep it; an admin's release of the claim
	// drops the claim from it.
	if oiKV == nil || keyspace.LeaseOf(oiKV) != podLease {
		return true, nil
	}
	oi, err := keyspace.Decode[keyspace.OwnerRecord](ownerKey, oiKV.Value)
	if err != nil || oi.NodeUID != a.cfg.NodeUID || oi.ContainerID != at.ContainerID {
		return true, nil
	}
	if oi.Claim != at.Claim {
		a.pods.Change(own).SetClaim(at.IfName, at.Pool, at.ContainerID, "", 0, oiKV.ModRevision)
		if lease != 0 {
			if err := a.keeper.Revoke(lease); err != nil {
				a.log.Warn("revoking the lease of a released claim failed; it expires by itself", "lease", keyspace.LeaseHex(lease), "err", err)
			}
		}
		a.log.Info("the sticky claim of a running pod was released by an admin; the pod keeps its addresses without it",
			"owner", owner, "claim", at.Claim, "pool", at.Pool)
		return true, nil
	}
	var rec keyspace.ClaimRecord
	recRead := recKV != nil
	if recRead {
		if rec, err = keyspace.Decode[keyspace.ClaimRecord](key, recKV.Value); err != nil {
			rec = keyspace.ClaimRecord{} // unreadable: as if it named no holder
		}
	}
	mine := recRead && rec.Holder != nil && rec.Holder.Owner == owner && rec.Holder.IfName == at.IfName
	// The addresses' keys: the attachment's, and those the record lists besides.
	addrs := slices.Clone(at.IPs)
	for _, ip := range rec.IPs {
		if !slices.Contains(addrs, ip) {
			addrs = append(addrs, ip)
		}
	}
	ops := make([]clientv3.Op, 0, 2*len(addrs))
	for _, ip := range addrs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(at.Pool, blocks, ip)), clientv3.OpGet(keyspace.QuarantineKey(at.Pool, blocks, ip)))
	}
	aresp, err := a.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return false, a.unavailable("read the addresses of the claim "+key, err)
	}
	var problems []string
	var cmps []clientv3.Cmp
	var puts []clientv3.Op
	type written struct {
		key string
		kv  *mvccpb.KeyValue // as read; nil: absent
	}
	var writes []written
	// Who holds the addresses: a claim naming another holder is taken over only from one
	// that holds none of them.
	var others []string
	othersAt := map[netip.Addr]bool{}
	ownsAll := true
	for i, ip := range addrs {
		kv := firstKV(aresp, 2*i)
		ipKey := keyspace.IPKey(at.Pool, blocks, ip)
		if kv == nil {
			cmps = append(cmps, keyspace.Absent(ipKey))
			if slices.Contains(at.IPs, ip) && !slices.Contains(at.Conflicts, ip) {
				ownsAll = false
			}
			continue
		}
		cmps = append(cmps, keyspace.Unchanged(ipKey, kv.ModRevision))
		al, err := keyspace.Decode[keyspace.Allocation](ipKey, kv.Value)
		if err != nil || al.Owner != owner || al.Cluster != a.cfg.Cluster {
			others = append(others, fmt.Sprintf("%s held by %s (node %s, container %s)", ip, al.Owner, al.Node, al.ContainerID))
			othersAt[ip] = true
		}
	}
	holder := "none"
	if rec.Holder != nil {
		holder = fmt.Sprintf("%s/%s (node %s, container %s)", rec.Holder.Owner, rec.Holder.IfName, rec.Holder.Node, rec.Holder.ContainerID)
	}
	if recRead && !mine && (len(others) > 0 || !ownsAll) {
		if len(others) > 0 {
			what := fmt.Sprintf("holder %s, %v", holder, others)
			if a.stickyKept.conflictNew(key, what) {
				a.log.Error("CONFLICT: the sticky claim of a running pod names another holder, which holds its addresses; "+
					"it is left to that holder", "owner", owner, "claim", at.Claim, "pool", at.Pool, "holder", holder, "held", others)
			}
		}
		// Else this pod's own addresses are being put back (the pod's re-claim or a conflict's
		// resolution): the claim is checked again then.
		return true, nil
	}
	a.stickyKept.conflictGone(key)
	if lease == 0 {
		hold := at.ClaimHold
		if hold <= 0 {
			hold = a.cfg.ClaimHold
		}
		g, err := a.cli.Grant(octx, int64((hold+time.Second-1)/time.Second))
		if err != nil {
			return false, a.unavailable("grant a claim lease", err)
		}
		if err := a.keeper.Resume(g.ID); err != nil {
			return false, err
		}
		lease = g.ID
		problems = append(problems, fmt.Sprintf("claim lease %s: gone; the claim goes on new lease %s",
			keyspace.LeaseHex(at.ClaimLease), keyspace.LeaseHex(lease)))
	}
	on := clientv3.WithLease(lease)
	// The record.
	if !recRead || !a.holderIs(rec.Holder, owner, at) || !slices.Equal(rec.IPs, at.IPs) || keyspace.LeaseOf(recKV) != lease {
		switch {
		case !recRead:
			problems = append(problems, key+": missing")
		case !mine:
			problems = append(problems, fmt.Sprintf("%s: names holder %s, which holds none of its addresses", key, holder))
		default:
			problems = append(problems, fmt.Sprintf("%s: lists %v on lease %s, want %v on %s", key, rec.IPs,
				keyspace.LeaseHex(keyspace.LeaseOf(recKV)), at.IPs, keyspace.LeaseHex(lease)))
		}
		hold := at.ClaimHold
		if hold <= 0 {
			hold = a.cfg.ClaimHold
		}
		since := a.wall()
		if mine && !rec.Since.IsZero() {
			since = rec.Since
		}
		nrec := keyspace.ClaimRecord{IPs: at.IPs, HoldSeconds: int64(hold / time.Second), Since: since,
			Holder: &keyspace.ClaimHolder{Owner: owner, Pod: ps.Pod, Node: a.cfg.Node, NodeUID: a.cfg.NodeUID,
				ContainerID: at.ContainerID, IfName: at.IfName, LeaseID: keyspace.LeaseHex(podLease)}}
		puts = append(puts, clientv3.OpPut(key, keyspace.Encode(nrec), on))
		writes = append(writes, written{key, recKV})
	}
	// The quarantine keys.
	q := keyspace.Encode(keyspace.QuarantineRecord{Claim: at.Claim})
	for i, ip := range addrs {
		kv := firstKV(aresp, 2*i+1)
		qKey := keyspace.QuarantineKey(at.Pool, blocks, ip)
		var qrec keyspace.QuarantineRecord
		if kv != nil {
			if qrec, err = keyspace.Decode[keyspace.QuarantineRecord](qKey, kv.Value); err != nil {
				qrec = keyspace.QuarantineRecord{}
			}
		}
		if !slices.Contains(at.IPs, ip) {
			// Listed by the record only: not this claim's any more.
			if kv != nil && qrec.Claim == at.Claim {
				problems = append(problems, qKey+": rests under the claim, which does not list it")
				cmps = append(cmps, keyspace.Unchanged(qKey, kv.ModRevision))
				puts = append(puts, clientv3.OpDelete(qKey))
			}
			continue
		}
		if slices.Contains(at.Conflicts, ip) || othersAt[ip] {
			continue // another owner holds it
		}
		switch {
		case kv != nil && qrec.Claim == at.Claim && keyspace.LeaseOf(kv) == lease:
			continue
		case kv != nil && qrec.Claim != "" && qrec.Claim != at.Claim:
			if a.stickyKept.conflictNew(qKey, qrec.Claim) {
				a.log.Error("CONFLICT: an address of a running pod's sticky claim rests under another claim; it is left to that claim",
					"owner", owner, "claim", at.Claim, "ip", ip, "other_claim", qrec.Claim)
			}
			continue
		case kv == nil:
			problems = append(problems, qKey+": missing")
		default:
			problems = append(problems, fmt.Sprintf("%s: claim %q on lease %s, want %q on %s", qKey, qrec.Claim,
				keyspace.LeaseHex(keyspace.LeaseOf(kv)), at.Claim, keyspace.LeaseHex(lease)))
		}
		puts = append(puts, clientv3.OpPut(qKey, q, on))
		writes = append(writes, written{qKey, kv})
	}
	for _, w := range writes {
		if w.kv == nil {
			cmps = append(cmps, keyspace.Absent(w.key))
		} else {
			cmps = append(cmps, keyspace.Unchanged(w.key, w.kv.ModRevision))
		}
	}
	// The owner index names the claim lease: a DEL moves the claim only from that one.
	cmps = append(cmps, keyspace.Unchanged(ownerKey, oiKV.ModRevision))
	indexed := oi.ClaimLease != keyspace.LeaseHex(lease)
	if indexed {
		problems = append(problems, fmt.Sprintf("%s: names claim lease %s, want %s", ownerKey, oi.ClaimLease, keyspace.LeaseHex(lease)))
		oi.ClaimLease = keyspace.LeaseHex(lease)
		puts = append(puts, clientv3.OpPut(ownerKey, keyspace.Encode(oi), clientv3.WithLease(podLease)))
	}
	drop := func() {
		if lease != at.ClaimLease {
			if err := a.keeper.Revoke(lease); err != nil {
				a.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(lease), "err", err)
			}
		}
	}
	if len(puts) == 0 {
		keys, _ := stickyKeys(a.cfg.Cluster, at, blocks)
		a.recordClaimRight(ctx, owner, at, keys)
		return true, nil
	}
	tresp, err := a.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil && txn.Refused(err) && txn.LeaseGone(err) && lease == at.ClaimLease && !a.leaseAlive(ctx, lease) {
		// Revoked or expired before the keeper's next renewal would have said so: the next
		// attempt puts the claim on a new one.
		a.keeper.Forget(lease)
		return false, nil
	}
	if err != nil {
		drop() // what it may have written goes with it, and is put back again
		return false, a.unavailable("put back the claim "+key, err)
	}
	if !tresp.Succeeded {
		drop()
		return false, nil
	}
	rev := oiKV.ModRevision
	if indexed {
		rev = tresp.Header.Revision
	}
	if lease != at.ClaimLease || indexed {
		a.pods.Change(own).SetClaim(at.IfName, at.Pool, at.ContainerID, at.Claim, lease, rev)
	}
	a.metrics.podKeysLost.Add(float64(len(problems)))
	a.log.Error("the sticky claim of a running pod was missing or changed in etcd; put back", "owner", owner, "claim", at.Claim,
		"pool", at.Pool, "lease", keyspace.LeaseHex(lease), "keys", problems)
	return true, nil
}

// recordClaimRight reads owner's claim keys once more and records their ModRevisions if
// they are right (a repair wrote only some of them).
func (a *Agent) recordClaimRight(ctx context.Context, owner string, at attachment, keys []string) {
	ops := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		ops[i] = clientv3.OpGet(k)
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	resp, err := a.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return // the next audit reads them
	}
	kvs := make([]*mvccpb.KeyValue, len(keys))
	for i := range keys {
		kvs[i] = firstKV(resp, i)
	}
	if revs, ok := a.claimRight(owner, at, kvs); ok {
		a.stickyKept.found(stickyCheck{ref: stickyRef{owner, at.IfName, at.Pool}, at: at, keys: keys}, revs)
	}
}

// firstKV is the first key-value of the i-th answer of resp, if any.
func firstKV(resp *clientv3.TxnResponse, i int) *mvccpb.KeyValue {
	if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
		return kvs[0]
	}
	return nil
}

// releaseStaleClaims releases, after etcd went back in time, the claims naming as holder an
// attachment of this node identity that it no longer has: the backup brought them back as
// they were before the attachment's DEL. Each goes as the DEL released it (releaseSticky):
// without a holder, with its addresses' claim-marked quarantine keys, onto a lease of the hold
// plus quarantine that nobody renews, compared unchanged since read.
func (a *Agent) releaseStaleClaims(ctx context.Context) error {
	octx, cancel := a.opCtx(ctx)
	resp, err := a.cli.Get(octx, keyspace.ClaimsPrefix(a.cfg.Cluster), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return a.unavailable("list the sticky claims", err)
	}
	var errs []error
	for _, kv := range resp.Kvs {
		_, pool, name, err := keyspace.ParseClaimKey(string(kv.Key))
		if err != nil {
			continue
		}
		rec, err := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
		if err != nil || rec.Holder == nil || rec.Holder.NodeUID != a.cfg.NodeUID || a.pods.HoldsClaim(pool, name) {
			continue
		}
		h := rec.Holder
		own := a.locks.Lock(h.Owner)
		if !a.pods.Lists(h.Owner, h.IfName, pool, h.ContainerID) && !a.pods.HoldsClaim(pool, name) {
			errs = append(errs, a.releaseStaleClaim(ctx, pool, name, kv, rec))
		}
		own.Unlock()
	}
	return errors.Join(errs...)
}

// releaseStaleClaim releases claim name of pool, read at kv as rec (releaseStaleClaims).
func (a *Agent) releaseStaleClaim(ctx context.Context, pool, name string, kv *mvccpb.KeyValue, rec keyspace.ClaimRecord) error {
	blocks, err := a.pools.BlocksOf(ctx, pool)
	if err != nil {
		return err
	}
	owner := rec.Holder.Owner
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	ops := make([]clientv3.Op, 0, 2*len(rec.IPs))
	for _, ip := range rec.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(pool, blocks, ip)), clientv3.OpGet(keyspace.QuarantineKey(pool, blocks, ip)))
	}
	aresp, err := a.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return a.unavailable("read the addresses of claim "+string(kv.Key), err)
	}
	at := attachment{Claim: name, IPs: rec.IPs, ClaimHold: time.Duration(rec.HoldSeconds) * time.Second}
	key, crec, holdLease, err := a.releaseSticky(octx, pool, owner, at)
	if err != nil {
		return err
	}
	until := time.Now().Add(time.Duration(crec.HoldSeconds) * time.Second).UTC()
	q := keyspace.Encode(keyspace.QuarantineRecord{ReleasedBy: owner, Until: until, Claim: name})
	cmps := []clientv3.Cmp{keyspace.Unchanged(key, kv.ModRevision)}
	var puts []clientv3.Op
	crec.IPs = nil
	for i, ip := range rec.IPs {
		al, qkv := firstKV(aresp, 2*i), firstKV(aresp, 2*i+1)
		ipKey, qKey := keyspace.IPKey(pool, blocks, ip), keyspace.QuarantineKey(pool, blocks, ip)
		switch {
		case qkv != nil:
			if qrec, err := keyspace.Decode[keyspace.QuarantineRecord](qKey, qkv.Value); err != nil || qrec.Claim != name {
				continue // resting for another release: not the claim's any more
			}
			cmps = append(cmps, keyspace.Unchanged(qKey, qkv.ModRevision))
		case al != nil:
			if h, err := keyspace.Decode[keyspace.Allocation](ipKey, al.Value); err != nil || h.Owner != owner {
				continue // another owner's now
			}
			cmps = append(cmps, keyspace.Unchanged(ipKey, al.ModRevision), keyspace.Absent(qKey))
		default:
			cmps = append(cmps, keyspace.Absent(ipKey), keyspace.Absent(qKey))
		}
		puts = append(puts, clientv3.OpPut(qKey, q, clientv3.WithLease(holdLease)))
		crec.IPs = append(crec.IPs, ip)
	}
	if len(crec.IPs) > 0 {
		puts = append(puts, clientv3.OpPut(key, keyspace.Encode(crec), clientv3.WithLease(holdLease)))
	} else {
		puts = append(puts, clientv3.OpDelete(key))
	}
	tresp, err := a.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil || !tresp.Succeeded || len(crec.IPs) == 0 {
		if rerr := a.keeper.Revoke(holdLease); rerr != nil {
			a.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(holdLease), "err", rerr)
		}
	}
	if err != nil {
		return a.unavailable("release the claim "+key, err)
	}
	if tresp.Succeeded && len(crec.IPs) > 0 {
		a.stickyKept.released(key, pool, name, crec, keyspace.QuarantineRecord{ReleasedBy: owner, Until: until, Claim: name},
			a.claimReleaseTTL(at))
		a.log.Warn("a sticky claim etcd's restored backup brought back named an attachment of this node deleted since; released "+
			"as its DEL did", "claim", name, "pool", pool, "holder", owner, "ips", crec.IPs, "until", until)
	}
	return nil // changed meanwhile: not this stale record any more
}

// restoreReleasedClaims puts back, after etcd went back in time, the claims this agent
// released whose hold has not ended and that etcd no longer has (the backup is older than
// the claim, or than its release): as released, each address that no allocation or other
// quarantine key stands at resting under it, on a lease of the hold left. A claim etcd has,
// in any state, is left as it is: its holder's agent keeps it, or the release of the stale
// record (releaseStaleClaims) did. The releases are kept in the state directory
// (releasedFile), so an agent restarted since a release puts it back too.
func (a *Agent) restoreReleasedClaims(ctx context.Context) error {
	var errs []error
	for key, r := range a.stickyKept.releasedNow() {
		errs = append(errs, a.restoreReleasedClaim(ctx, key, r))
	}
	return errors.Join(errs...)
}

// restoreReleasedClaim is restoreReleasedClaims for the claim at key, released as r.
func (a *Agent) restoreReleasedClaim(ctx context.Context, key string, r releasedClaim) error {
	blocks, err := a.pools.BlocksOf(ctx, r.pool)
	if err != nil {
		return err
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	ops := []clientv3.Op{clientv3.OpGet(key, clientv3.WithKeysOnly())}
	for _, ip := range r.rec.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(r.pool, blocks, ip), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.QuarantineKey(r.pool, blocks, ip)))
	}
	resp, err := a.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return a.unavailable("read the released claim "+key, err)
	}
	if firstKV(resp, 0) != nil {
		return nil
	}
	rec := r.rec
	rec.IPs = nil
	cmps := []clientv3.Cmp{keyspace.Absent(key)}
	var qKeys []string
	for i, ip := range r.rec.IPs {
		ipKey, qKey := keyspace.IPKey(r.pool, blocks, ip), keyspace.QuarantineKey(r.pool, blocks, ip)
		if firstKV(resp, 1+2*i) != nil {
			continue // allocated: given up, as a released claim gives up an address a running pod had first
		}
		rev := int64(0)
		if q := firstKV(resp, 2+2*i); q != nil {
			if qrec, err := keyspace.Decode[keyspace.QuarantineRecord](qKey, q.Value); err != nil || qrec.Claim != r.name {
				continue // resting for something else
			}
			rev = q.ModRevision
		}
		cmps = append(cmps, keyspace.Absent(ipKey), keyspace.Unchanged(qKey, rev))
		qKeys = append(qKeys, qKey)
		rec.IPs = append(rec.IPs, ip)
	}
	if len(rec.IPs) == 0 {
		return nil
	}
	left := time.Until(r.ends)
	g, err := a.cli.Grant(octx, int64((left+time.Second-1)/time.Second))
	if err != nil {
		return a.unavailable("grant the lease of a released claim", err)
	}
	on := clientv3.WithLease(g.ID)
	puts := []clientv3.Op{clientv3.OpPut(key, keyspace.Encode(rec), on)}
	q := keyspace.Encode(r.q)
	for _, k := range qKeys {
		puts = append(puts, clientv3.OpPut(k, q, on))
	}
	tresp, err := a.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil || !tresp.Succeeded {
		if rerr := a.keeper.Revoke(g.ID); rerr != nil {
			a.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(g.ID), "err", rerr)
		}
	}
	if err != nil {
		return a.unavailable("put back the released claim "+key, err)
	}
	if tresp.Succeeded {
		a.metrics.podKeysLost.Add(float64(1 + len(qKeys)))
		a.log.Warn("a sticky claim this node released was gone after etcd went back in time; put back as released until its hold ends",
			"claim", r.name, "pool", r.pool, "ips", rec.IPs, "lease", keyspace.LeaseHex(g.ID), "ttl", left.Round(time.Second))
	}
	return nil
}
