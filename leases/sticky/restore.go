package sticky

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/node"
	"github.com/leasehold/leasehold/leases/podbook"
)

// Sticky claims after etcd went back in time: the claims this agent released are kept until
// their hold ends (in memory and in the state directory, releasedFile), so that a restore of
// a backup older than a release puts them back (restoreReleasedClaims); the claims a backup
// brought back naming an attachment of this node deleted since are released as its DEL did
// (releaseStaleClaims).

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
		if time.Until(r.ends) > keeper.MinTTL {
			out[k] = r
		}
	}
	return out
}

// releaseStaleClaims releases, after etcd went back in time, the claims naming as holder an
// attachment of this node identity that it no longer has: the backup brought them back as
// they were before the attachment's DEL. Each goes as the DEL released it (Release):
// without a holder, with its addresses' claim-marked quarantine keys, onto a lease of the hold
// plus quarantine that nobody renews, compared unchanged since read.
func (sc *Claims) releaseStaleClaims(ctx context.Context) error {
	octx, cancel := sc.opCtx(ctx)
	resp, err := sc.cli.Get(octx, keyspace.ClaimsPrefix(sc.cfg.Cluster), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return sc.unavailable("list the sticky claims", err)
	}
	var errs []error
	for _, kv := range resp.Kvs {
		_, pool, name, err := keyspace.ParseClaimKey(string(kv.Key))
		if err != nil {
			continue
		}
		rec, err := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
		if err != nil || rec.Holder == nil || rec.Holder.NodeUID != sc.cfg.NodeUID || sc.pods.HoldsClaim(pool, name) {
			continue
		}
		h := rec.Holder
		own := sc.locks.Lock(h.Owner)
		if !sc.pods.Lists(h.Owner, h.IfName, pool, h.ContainerID) && !sc.pods.HoldsClaim(pool, name) {
			errs = append(errs, sc.releaseStaleClaim(ctx, pool, name, kv, rec))
		}
		own.Unlock()
	}
	return errors.Join(errs...)
}

// deleteStaleMigrations deletes, after etcd went back in time, the live migration keys naming
// as target an attachment of this node identity that it no longer has: the backup brought
// them back as they were before the target's DEL (T3), on a lease nobody renews. Until it
// expired, such a key would refuse every other pod naming the claim (T6) and offer the
// claim's keys to a pod that is gone when its source is deleted (T2). So does a key naming as
// target an attachment that holds the claim now (the migration completed since the backup),
// on its pod lease, which lives: it would stand for good, and the target of the attachment's
// own migration, re-claimed, would wait for it to go (ReclaimTarget). Each goes compared
// unchanged since read, under its target's owner lock.
func (sc *Claims) deleteStaleMigrations(ctx context.Context) error {
	octx, cancel := sc.opCtx(ctx)
	resp, err := sc.cli.Get(octx, keyspace.LiveMigrationsPrefix(sc.cfg.Cluster), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return sc.unavailable("list the live migrations", err)
	}
	var errs []error
	for _, kv := range resp.Kvs {
		_, pool, claim, err := keyspace.ParseLiveMigrationKey(string(kv.Key))
		if err != nil {
			continue
		}
		m, err := keyspace.Decode[keyspace.LiveMigrationRecord](string(kv.Key), kv.Value)
		if err != nil || m.Target.NodeUID != sc.cfg.NodeUID {
			continue
		}
		t := m.Target
		own := sc.locks.Lock(t.Owner)
		if !sc.pods.Lists(t.Owner, t.IfName, pool, t.ContainerID) || sc.holdsNow(t.Owner, t.IfName, pool, t.ContainerID) {
			octx, cancel := sc.opCtx(ctx)
			dresp, err := sc.cli.Txn(octx).If(keyspace.Unchanged(string(kv.Key), kv.ModRevision)).Then(clientv3.OpDelete(string(kv.Key))).Commit()
			cancel()
			switch {
			case err != nil:
				errs = append(errs, sc.unavailable("delete the stale live migration key "+string(kv.Key), err))
			case dresp.Succeeded:
				sc.seen.drop(string(kv.Key))
				sc.log.Warn("a live migration key etcd's restored backup brought back named a target of this node deleted since; deleted",
					"claim", claim, "pool", pool, "target", t.Owner, "source", m.Source.Owner)
			}
		}
		own.Unlock()
	}
	return errors.Join(errs...)
}

// holdsNow tells whether owner's attachment (ifName, pool, container) is in the pod book
// and not a live migration's target: the claim's holder, the migration completed.
func (sc *Claims) holdsNow(owner, ifName, pool, container string) bool {
	ps, ok := sc.pods.Snapshot(owner)
	return ok && slices.ContainsFunc(ps.Attachments, func(a podbook.Attachment) bool {
		return a.IfName == ifName && a.Pool == pool && a.ContainerID == container && !a.Target && !a.Released
	})
}

// releaseStaleClaim releases claim name of pool, read at kv as rec (releaseStaleClaims).
func (sc *Claims) releaseStaleClaim(ctx context.Context, pool, name string, kv *mvccpb.KeyValue, rec keyspace.ClaimRecord) error {
	blocks, _, err := sc.cfg.Layout(ctx, pool)
	if err != nil {
		return err
	}
	owner := rec.Holder.Owner
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	ops := make([]clientv3.Op, 0, 2*len(rec.IPs))
	for _, ip := range rec.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(pool, blocks, ip)), clientv3.OpGet(keyspace.QuarantineKey(pool, blocks, ip)))
	}
	aresp, err := sc.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return sc.unavailable("read the addresses of claim "+string(kv.Key), err)
	}
	at := podbook.Attachment{Claim: name, IPs: rec.IPs, ClaimHold: time.Duration(rec.HoldSeconds) * time.Second, ClaimMigratable: rec.Migratable}
	key, crec, holdLease, err := sc.Release(octx, pool, owner, at)
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
	tresp, err := sc.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil || !tresp.Succeeded || len(crec.IPs) == 0 {
		if rerr := sc.keeper.Revoke(holdLease); rerr != nil {
			sc.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(holdLease), "err", rerr)
		}
	}
	if err != nil {
		return sc.unavailable("release the claim "+key, err)
	}
	if tresp.Succeeded && len(crec.IPs) > 0 {
		sc.kept.released(key, pool, name, crec, keyspace.QuarantineRecord{ReleasedBy: owner, Until: until, Claim: name},
			sc.ReleaseTTL(at))
		sc.log.Warn("a sticky claim etcd's restored backup brought back named an attachment of this node deleted since; released "+
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
func (sc *Claims) restoreReleasedClaims(ctx context.Context) error {
	var errs []error
	for key, r := range sc.kept.releasedNow() {
		errs = append(errs, sc.restoreReleasedClaim(ctx, key, r))
	}
	return errors.Join(errs...)
}

// restoreReleasedClaim is restoreReleasedClaims for the claim at key, released as r.
func (sc *Claims) restoreReleasedClaim(ctx context.Context, key string, r releasedClaim) error {
	blocks, _, err := sc.cfg.Layout(ctx, r.pool)
	if err != nil {
		return err
	}
	octx, cancel := sc.opCtx(ctx)
	defer cancel()
	ops := []clientv3.Op{clientv3.OpGet(key, clientv3.WithKeysOnly())}
	for _, ip := range r.rec.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(r.pool, blocks, ip), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.QuarantineKey(r.pool, blocks, ip)))
	}
	resp, err := sc.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return sc.unavailable("read the released claim "+key, err)
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
	g, err := sc.cli.Grant(octx, int64((left+time.Second-1)/time.Second))
	if err != nil {
		return sc.unavailable("grant the lease of a released claim", err)
	}
	on := clientv3.WithLease(g.ID)
	puts := []clientv3.Op{clientv3.OpPut(key, keyspace.Encode(rec), on)}
	q := keyspace.Encode(r.q)
	for _, k := range qKeys {
		puts = append(puts, clientv3.OpPut(k, q, on))
	}
	tresp, err := sc.cli.Txn(octx).If(cmps...).Then(puts...).Commit()
	if err != nil || !tresp.Succeeded {
		if rerr := sc.keeper.Revoke(g.ID); rerr != nil {
			sc.log.Warn("revoking an unused claim lease failed; it expires by itself", "lease", keyspace.LeaseHex(g.ID), "err", rerr)
		}
	}
	if err != nil {
		return sc.unavailable("put back the released claim "+key, err)
	}
	if tresp.Succeeded {
		sc.cfg.KeysLost.Add(float64(1 + len(qKeys)))
		sc.log.Warn("a sticky claim this node released was gone after etcd went back in time; put back as released until its hold ends",
			"claim", r.name, "pool", r.pool, "ips", rec.IPs, "lease", keyspace.LeaseHex(g.ID), "ttl", left.Round(time.Second))
	}
	return nil
}

// releasedFile keeps, in the state directory, the sticky claims this agent released whose hold
// has not ended (stickyKept.releases): etcd restored from a backup older than a release loses
// the released claim, and only the agent that released it can put it back
// (restoreReleasedClaims), also after a restart. Times are the machine's clock.
const releasedFile = "released-claims"

// savedRelease is one released claim in the file.
type savedRelease struct {
	Key   string                    `json:"key"`
	Pool  string                    `json:"pool"`
	Name  string                    `json:"name"`
	Rec   keyspace.ClaimRecord      `json:"record"`
	Q     keyspace.QuarantineRecord `json:"quarantine"`
	Until time.Time                 `json:"until"`
}

// saveReleased writes the releases of m whose hold has not ended at now into dir atomically
// (aside, synced, then renamed); with no directory it does nothing.
func saveReleased(dir string, m map[string]releasedClaim, now time.Time) error {
	if dir == "" {
		return nil
	}
	out := make([]savedRelease, 0, len(m))
	for k, r := range m {
		out = append(out, savedRelease{Key: k, Pool: r.pool, Name: r.name, Rec: r.rec, Q: r.q, Until: now.Add(r.ends.Sub(now))})
	}
	slices.SortFunc(out, func(a, b savedRelease) int { return strings.Compare(a.Key, b.Key) })
	b, err := json.Marshal(out)
	if err != nil {
		return err
	}
	return node.WriteAside(dir, releasedFile, b)
}

// loadReleased reads the releases dir keeps whose hold has not ended at now.
func loadReleased(dir string, now time.Time) (map[string]releasedClaim, error) {
	if dir == "" {
		return nil, nil
	}
	b, err := os.ReadFile(filepath.Join(dir, releasedFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var in []savedRelease
	if err := json.Unmarshal(b, &in); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, releasedFile), err)
	}
	m := map[string]releasedClaim{}
	for _, r := range in {
		if r.Until.After(now) {
			m[r.Key] = releasedClaim{pool: r.Pool, name: r.Name, rec: r.Rec, q: r.Q, ends: time.Now().Add(r.Until.Sub(now))}
		}
	}
	return m, nil
}
