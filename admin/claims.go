package admin

import (
	"context"
	"fmt"
	"math"
	"net/netip"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Sticky claims (issue 19, docs/proposals/sticky.md): the operator's side. A claim record
// claims/<cluster>/<pool>/<claim> says which attachment may take its addresses next; the
// addresses' own allocation and quarantine keys stay the authority. While nobody holds a
// claim, its addresses rest in quarantine under it (QuarantineRecord.Claim) until the hold
// runs out or the next holder takes them.

// DefaultClaimQuarantine is how long the addresses of a released claim rest in ordinary
// quarantine before they return to the pool, when ClaimReleaseOptions gives no time.
const DefaultClaimQuarantine = 30 * time.Second

// States of a claim's address (ClaimAddress.State).
const (
	ClaimAddrAllocated   = "allocated"   // an allocation key holds it: a pod has it (the holder, or another owner)
	ClaimAddrResting     = "resting"     // its quarantine key rests under this claim: only the claim's next holder may take it
	ClaimAddrQuarantined = "quarantined" // in quarantine, but not under this claim (an ordinary release's, or another claim's)
	ClaimAddrFree        = "free"        // neither: the next ADD of anyone may take it
)

// ClaimAddress is one address of a claim and what its keys say now.
type ClaimAddress struct {
	IP    netip.Addr
	State string
	// Allocation is the key holding the address (in either layout), if any.
	Allocation *AllocationEntry
	// Quarantine is the address's quarantine key in the pool (in either layout), if any.
	Quarantine *QuarantineEntry
}

// ListClaims returns the sticky claims of cluster (of every cluster when cluster is ""),
// sorted by cluster, pool and name, each with its live migration key, if any (read at the
// same revision). Claim keys with a malformed name are left out (doctor
// reports them); a value that does not decode is kept with Unreadable set.
func ListClaims(ctx context.Context, cli *clientv3.Client, cluster string) ([]ClaimEntry, error) {
	if cluster != "" {
		if err := allocator.ValidateName("cluster", cluster); err != nil {
			return nil, err
		}
	}
	st, err := ReadKeys(ctx, cli, keyspace.ClaimsPrefix(cluster), keyspace.LiveMigrationsPrefix(cluster))
	if err != nil {
		return nil, err
	}
	return st.Claims, nil
}

// GetClaim reads the claim name of pool in cluster, and its live migration key, if any, at the
// same revision. Errors wrap ErrNotFound (no such claim), allocator.ErrInvalidName, or the
// etcd error.
func GetClaim(ctx context.Context, cli *clientv3.Client, cluster, pool, name string) (ClaimEntry, error) {
	if err := keyspace.ValidateNames("cluster", cluster, "pool", pool, "claim", name); err != nil {
		return ClaimEntry{}, err
	}
	key, mkey := keyspace.ClaimKey(cluster, pool, name), keyspace.LiveMigrationKey(cluster, pool, name)
	// Exactly the keys: claim "web" is a prefix of claim "web-2".
	resp, err := cli.Txn(ctx).Then(clientv3.OpGet(key), clientv3.OpGet(mkey)).Commit()
	if err != nil {
		return ClaimEntry{}, fmt.Errorf("read %s: %w", key, err)
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return ClaimEntry{}, fmt.Errorf("%w: pool %s of cluster %s has no claim %s (no key %s); leaseholdctl claim list lists the claims",
			ErrNotFound, pool, cluster, name, key)
	}
	c := ClaimEntry{Record: record[keyspace.ClaimRecord](kvs[0]), Cluster: cluster, Pool: pool, Name: name}
	if mkvs := resp.Responses[1].GetResponseRange().Kvs; len(mkvs) > 0 {
		c.Migration = &LiveMigrationEntry{Record: record[keyspace.LiveMigrationRecord](mkvs[0]), Cluster: cluster, Pool: pool, Claim: name}
	}
	return c, nil
}

// ClaimAddresses reads, in one transaction, the allocation and quarantine keys of each of c's
// addresses, in the layout of the pool's stored definition and in the flat one (a pool being
// migrated has both; without a usable definition, the flat and the default block layout). An
// unreadable claim names no addresses: nil.
func ClaimAddresses(ctx context.Context, cli *clientv3.Client, c ClaimEntry) ([]ClaimAddress, error) {
	if c.Unreadable != "" || len(c.Value.IPs) == 0 {
		return nil, nil
	}
	l, err := readLayout(ctx, cli, c.Pool)
	if err != nil {
		return nil, err
	}
	return claimAddresses(ctx, cli, l, c)
}

func claimAddresses(ctx context.Context, cli *clientv3.Client, l layout, c ClaimEntry) ([]ClaimAddress, error) {
	var keys []string
	for _, ip := range c.Value.IPs {
		ip = ip.Unmap()
		keys = append(keys, l.candidates(ip)...)
		keys = append(keys, l.quarantineCandidates(ip)...)
	}
	ops := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		ops[i] = clientv3.OpGet(k)
	}
	resp, err := cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, fmt.Errorf("read the addresses of claim %s: %w", c.Key, err)
	}
	st := &State{}
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			st.add(kv)
		}
	}
	allocs, quars := map[string]*AllocationEntry{}, map[string]*QuarantineEntry{}
	for i := range st.Allocations {
		allocs[st.Allocations[i].Key] = &st.Allocations[i]
	}
	for i := range st.Quarantine {
		quars[st.Quarantine[i].Key] = &st.Quarantine[i]
	}
	out := make([]ClaimAddress, 0, len(c.Value.IPs))
	for _, ip := range c.Value.IPs {
		ip = ip.Unmap()
		a := ClaimAddress{IP: ip, State: ClaimAddrFree}
		for _, k := range l.candidates(ip) {
			if e := allocs[k]; e != nil && a.Allocation == nil {
				a.Allocation = e
			}
		}
		for _, k := range l.quarantineCandidates(ip) {
			if q := quars[k]; q != nil && a.Quarantine == nil {
				a.Quarantine = q
			}
		}
		switch {
		case a.Allocation != nil:
			a.State = ClaimAddrAllocated
		case a.Quarantine != nil && a.restsUnder(c.Name):
			a.State = ClaimAddrResting
		case a.Quarantine != nil:
			a.State = ClaimAddrQuarantined
		}
		out = append(out, a)
	}
	return out, nil
}

// restsUnder reports whether a's quarantine key is readable and rests under claim name.
func (a ClaimAddress) restsUnder(name string) bool {
	return a.Quarantine != nil && a.Quarantine.Unreadable == "" && a.Quarantine.Value.Claim == name
}

// quarantineCandidates are the keys that may hold ip's quarantine key, as candidates are for
// its allocation: the layout's own first.
func (l layout) quarantineCandidates(ip netip.Addr) []string {
	flat := keyspace.QuarantineKey(l.pool, allocator.Blocks{}, ip)
	switch {
	case !l.known:
		return []string{flat, keyspace.QuarantineKey(l.pool, allocator.DefaultBlocks, ip)}
	case l.blocks.Flat():
		return []string{flat}
	}
	return []string{keyspace.QuarantineKey(l.pool, l.blocks, ip), flat}
}

// ClaimReleaseOptions tune ReleaseClaim.
type ClaimReleaseOptions struct {
	// Quarantine is how long the claim's resting addresses stay in ordinary quarantine, on a
	// fresh lease of their own, before they return to the pool: 0 is DefaultClaimQuarantine;
	// negative puts none (their quarantine keys are deleted and the addresses are free at once).
	Quarantine time.Duration
	// Force releases a claim being migrated (its live migration key exists) all the same,
	// deleting the migration key in the same transaction, compared unchanged.
	Force bool
}

// ClaimRelease is what ReleaseClaim did.
type ClaimRelease struct {
	// Claim is the claim record deleted, as read just before.
	Claim ClaimEntry
	// Addresses are the claim's addresses as they were before the release; none when the
	// record was unreadable.
	Addresses []ClaimAddress
	// Quarantined are the addresses that rested under the claim and now rest in ordinary
	// quarantine on QuarantineLease until QuarantineUntil; with no quarantine they are Freed
	// instead (their quarantine keys deleted).
	Quarantined     []netip.Addr
	Freed           []netip.Addr
	QuarantineLease clientv3.LeaseID
	QuarantineUntil time.Time
	// HolderKeeps is set when the claim named a holder: it says that the holder keeps its
	// addresses (they are on its own pod lease) and only the stickiness goes.
	HolderKeeps string
	// MigrationDeleted is the live migration key deleted with the claim (Force), if any.
	MigrationDeleted *LiveMigrationEntry
}

// ReleaseClaim deletes the sticky claim name of pool in cluster, compared unchanged since it
// was read, and in the same transaction turns each quarantine key resting under it (the
// pool's quarantine key of each claim address whose record names the claim) into an ordinary
// quarantine key: same key, the record without Claim, on a fresh lease of opt.Quarantine, so
// the addresses return to the pool through quarantine as any release's do. Each such key is
// compared unchanged too; a transaction that finds a key changed (an ADD taking the claim, the
// holder's agent releasing it) reads again, a few times.
//
// A claim whose holder is set is released all the same: the pod keeps its addresses, which
// are on its own pod lease; only the promise to the next attachment goes (HolderKeeps says
// so). The claim goes from the holder's owner index too, compared unchanged: its agent puts
// back a claim record of a running pod that is gone from etcd, unless the index no longer
// names it. An unreadable record is deleted alone: its addresses are unknown, and quarantine keys
// resting under it expire with their lease.
//
// A claim being migrated (its live migration key exists) is refused with a
// *MigrationInProgressError naming the target, unless opt.Force: then the migration key is
// deleted in the same transaction, compared unchanged. The target keeps using the addresses
// until its pod goes, as the holder does; no agent hands them over to it any more.
//
// Errors wrap ErrNotFound (no such claim), ErrMigrationInProgress, ErrConcurrentChange,
// allocator.ErrInvalidName, or the etcd error.
func ReleaseClaim(ctx context.Context, cli *clientv3.Client, cluster, pool, name string, opt ClaimReleaseOptions) (ClaimRelease, error) {
	if err := keyspace.ValidateNames("cluster", cluster, "pool", pool, "claim", name); err != nil {
		return ClaimRelease{}, err
	}
	if opt.Quarantine == 0 {
		opt.Quarantine = DefaultClaimQuarantine
	}
	for range adminAttempts {
		out, done, err := releaseClaimOnce(ctx, cli, cluster, pool, name, opt)
		if done || err != nil {
			return out, err
		}
	}
	return ClaimRelease{}, fmt.Errorf("%w: claim %s kept changing while it was released; retry",
		ErrConcurrentChange, keyspace.ClaimKey(cluster, pool, name))
}

func releaseClaimOnce(ctx context.Context, cli *clientv3.Client, cluster, pool, name string, opt ClaimReleaseOptions) (ClaimRelease, bool, error) {
	c, err := GetClaim(ctx, cli, cluster, pool, name)
	if err != nil {
		return ClaimRelease{}, false, err
	}
	if c.Migration != nil && !opt.Force {
		return ClaimRelease{}, false, &MigrationInProgressError{Claim: c, Migration: *c.Migration}
	}
	out := ClaimRelease{Claim: c, MigrationDeleted: c.Migration}
	if c.Unreadable == "" && len(c.Value.IPs) > 0 {
		l, err := readLayout(ctx, cli, pool)
		if err != nil {
			return ClaimRelease{}, false, err
		}
		if out.Addresses, err = claimAddresses(ctx, cli, l, c); err != nil {
			return ClaimRelease{}, false, err
		}
	}
	if h := c.Value.Holder; c.Unreadable == "" && h != nil {
		out.HolderKeeps = fmt.Sprintf("the claim was held by owner %s (pod %s, node %s, container %s, interface %s): it keeps %s on its "+
			"own pod lease %s; only the stickiness goes, so no later attachment is promised them",
			dash(h.Owner), podName(h.Pod), dash(h.Node), short(h.ContainerID), dash(h.IfName), ipsText(c.Value.IPs), dash(h.LeaseID))
	}
	cmps := []clientv3.Cmp{keyspace.Unchanged(c.Key, c.ModRevision)}
	ops := []clientv3.Op{clientv3.OpDelete(c.Key)}
	mkey := keyspace.LiveMigrationKey(cluster, pool, name)
	if m := c.Migration; m != nil {
		cmps, ops = append(cmps, keyspace.Unchanged(m.Key, m.ModRevision)), append(ops, clientv3.OpDelete(m.Key))
	} else {
		// Read absent with the claim: a migration started since is refused, not deleted unseen.
		cmps = append(cmps, keyspace.Absent(mkey))
	}
	if h := c.Value.Holder; c.Unreadable == "" && h != nil {
		// The holder's owner index names the claim too: without it there, its agent knows the
		// claim released, and does not put it back as one deleted by mistake.
		cmp, op, err := dropClaimFromIndex(ctx, cli, cluster, pool, name, h)
		if err != nil {
			return ClaimRelease{}, false, err
		}
		if op != nil {
			cmps, ops = append(cmps, cmp), append(ops, *op)
		}
	}
	var resting []*QuarantineEntry
	for _, a := range out.Addresses {
		if a.restsUnder(name) {
			resting = append(resting, a.Quarantine)
			cmps = append(cmps, keyspace.Unchanged(a.Quarantine.Key, a.Quarantine.ModRevision))
		}
	}
	if len(resting) > 0 && opt.Quarantine > 0 {
		g, err := cli.Grant(ctx, int64(math.Ceil(opt.Quarantine.Seconds())))
		if err != nil {
			return ClaimRelease{}, false, fmt.Errorf("grant a quarantine lease: %w", err)
		}
		out.QuarantineLease, out.QuarantineUntil = g.ID, time.Now().Add(opt.Quarantine).UTC()
	}
	for _, q := range resting {
		if out.QuarantineLease == 0 {
			ops = append(ops, clientv3.OpDelete(q.Key))
			out.Freed = append(out.Freed, q.IP)
			continue
		}
		rec := q.Value
		rec.Claim, rec.Until = "", out.QuarantineUntil
		ops = append(ops, clientv3.OpPut(q.Key, keyspace.Encode(rec), clientv3.WithLease(out.QuarantineLease)))
		out.Quarantined = append(out.Quarantined, q.IP)
	}
	tresp, err := cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if (err != nil || !tresp.Succeeded) && out.QuarantineLease != 0 {
		rctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		_, _ = cli.Revoke(rctx, out.QuarantineLease) // unused; it would expire by itself anyway
		cancel()
	}
	if err != nil {
		return ClaimRelease{}, false, fmt.Errorf("release claim %s: %w", c.Key, err)
	}
	return out, tresp.Succeeded, nil // not succeeded: a key changed since it was read; read again
}

// dropClaimFromIndex returns the compare and the put that take claim name out of its holder
// h's owner index, if that index names it; nothing otherwise.
func dropClaimFromIndex(ctx context.Context, cli *clientv3.Client, cluster, pool, name string, h *keyspace.ClaimHolder) (clientv3.Cmp, *clientv3.Op, error) {
	if keyspace.ValidateNames("owner", h.Owner, "interface name", h.IfName) != nil {
		return clientv3.Cmp{}, nil, nil
	}
	key := keyspace.OwnerKey(cluster, h.Owner, h.IfName, pool)
	resp, err := cli.Get(ctx, key)
	if err != nil {
		return clientv3.Cmp{}, nil, fmt.Errorf("read %s: %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return clientv3.Cmp{}, nil, nil
	}
	kv := resp.Kvs[0]
	rec, err := keyspace.Decode[keyspace.OwnerRecord](key, kv.Value)
	if err != nil || rec.Claim != name || rec.NodeUID != h.NodeUID || rec.ContainerID != h.ContainerID {
		return clientv3.Cmp{}, nil, nil
	}
	rec.Claim, rec.ClaimLease, rec.ClaimHoldSeconds, rec.ClaimMigratable = "", "", 0, false
	op := clientv3.OpPut(key, keyspace.Encode(rec), clientv3.WithLease(clientv3.LeaseID(kv.Lease)))
	return keyspace.Unchanged(key, kv.ModRevision), &op, nil
}

// ipsText lists addresses for messages.
func ipsText(ips []netip.Addr) string {
	if len(ips) == 0 {
		return "no address"
	}
	s := make([]string, len(ips))
	for i, ip := range ips {
		s[i] = ip.String()
	}
	return strings.Join(s, ", ")
}
