package admin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Errors of the admin operations (leaseholdctl). Check them with errors.Is.
var (
	// ErrNotFound: the pool, range or allocation the admin named does not exist.
	ErrNotFound = errors.New("not found")
	// ErrRangeInUse: a range to remove still has allocations; the error is a *RangeInUseError.
	ErrRangeInUse = errors.New("range still has allocations")
	// ErrLeaseAlive: an allocation to release is on a lease its agent still renews; the error
	// is a *LeaseAliveError.
	ErrLeaseAlive = errors.New("allocation is on a live lease")
	// ErrConcurrentChange: the keys an admin operation read kept changing under it; retry.
	ErrConcurrentChange = errors.New("changed concurrently")
)

// adminAttempts bounds the read-compare-write rounds of one admin operation.
const adminAttempts = 5

// cleanupTimeout bounds the revoke of a quarantine lease a failed release did not use. It
// runs on its own context, as the caller's may be the one that ran out.
const cleanupTimeout = 5 * time.Second

// CreatePool stores spec as the definition of pool spec.Name if there is none. An identical
// stored definition (after both are canonicalized) is not an error: created is false.
//
// Errors wrap allocator.ErrInvalidConfig or ErrInvalidName (spec does not canonicalize),
// allocator.ErrPoolMismatch (another definition is stored; the message shows both), or the
// etcd error.
func CreatePool(ctx context.Context, cli *clientv3.Client, spec allocator.PoolSpec) (created bool, err error) {
	if err := spec.Canonicalize(); err != nil {
		return false, err
	}
	key := keyspace.PoolKey(spec.Name)
	resp, err := cli.Txn(ctx).If(keyspace.Absent(key)).
		Then(clientv3.OpPut(key, keyspace.Encode(spec))).Else(clientv3.OpGet(key)).Commit()
	if err != nil {
		return false, fmt.Errorf("create pool %s: %w", spec.Name, err)
	}
	if resp.Succeeded {
		return true, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return false, fmt.Errorf("%w: pool %s was deleted while it was created; retry", ErrConcurrentChange, spec.Name)
	}
	stored := record[allocator.PoolSpec](kvs[0])
	if stored.Unreadable == "" && stored.Value.Canonicalize() == nil && stored.Value.Equal(spec) {
		return false, nil
	}
	shown := stored.Value.String()
	if stored.Unreadable != "" {
		shown = "an unreadable value (" + stored.Unreadable + ")"
	}
	return false, fmt.Errorf("%w: pool %s already exists with another definition\n  stored:    %s\n  requested: %s\n"+
		"change the stored one with leaseholdctl pool add-range / remove-range, or choose another pool name",
		allocator.ErrPoolMismatch, spec.Name, shown, spec.String())
}

// PoolChange is the outcome of AddRange or RemoveRange.
type PoolChange struct {
	Old, New allocator.PoolSpec
	// Revision is the etcd revision of the write.
	Revision int64
	// Appeared lists allocations found in a removed range after the write: a re-claim of a
	// pod that lost its lease does not compare the pool definition (see RemoveRange).
	Appeared []AllocationEntry
}

// AddRange adds r to range set `set` of pool (set < 0: the pool's only set of r's family). It
// keeps every allocation: r must not overlap any range of the pool, and a gateway r brings
// into an existing range must not be allocated. The write compares the definition's
// ModRevision (retrying with a fresh read) and that the new gateway is still unallocated;
// agents' ADDs compare the same ModRevision, so none hands out an address by the old
// definition after the write.
//
// Errors wrap ErrNotFound (no such pool), allocator.ErrInvalidConfig (r or the result does not
// canonicalize, or overlaps), ErrConcurrentChange, or the etcd error.
func AddRange(ctx context.Context, cli *clientv3.Client, pool string, set int, r allocator.Range) (PoolChange, error) {
	for range adminAttempts {
		p, allocs, _, err := readPool(ctx, cli, pool)
		if err != nil {
			return PoolChange{}, err
		}
		old := p.Value
		i, err := setFor(old, set, r)
		if err != nil {
			return PoolChange{}, err
		}
		next := old
		next.Ranges = slices.Clone(old.Ranges)
		next.Ranges[i] = append(slices.Clone(old.Ranges[i]), r)
		if err := next.Canonicalize(); err != nil {
			return PoolChange{}, err
		}
		cmps := []clientv3.Cmp{keyspace.Unchanged(p.Key, p.ModRevision)}
		if gw := next.Ranges[i][len(next.Ranges[i])-1].Gateway; old.Allocatable(gw) == nil {
			for _, a := range allocs {
				if a.IP == gw {
					return PoolChange{}, fmt.Errorf("%w: the new range's gateway %s is allocated to owner %s (pod %s, node %s); "+
						"give the range another gw= or release the address first", allocator.ErrInvalidConfig, gw, a.Owner, podName(a.Pod), a.Node)
				}
			}
			cmps = append(cmps, keyspace.Absent(keyspace.IPKey(pool, gw)))
		}
		resp, err := cli.Txn(ctx).If(cmps...).Then(clientv3.OpPut(p.Key, keyspace.Encode(next))).Commit()
		if err != nil {
			return PoolChange{}, fmt.Errorf("write pool %s: %w", pool, err)
		}
		if resp.Succeeded {
			return PoolChange{Old: old, New: next, Revision: resp.Header.Revision}, nil
		}
	}
	return PoolChange{}, fmt.Errorf("%w: pool %s kept changing while a range was added; retry", ErrConcurrentChange, pool)
}

// RangeInUseError lists the allocations that keep a range from being removed.
type RangeInUseError struct {
	Pool    string
	Range   allocator.Range
	Holders []AllocationEntry
}

// Error names the range and lists every holder: address, owner, pod, cluster and node.
func (e *RangeInUseError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v: range %s of pool %s has %d allocation(s); release them first (each pod's DEL, or leaseholdctl alloc release):",
		ErrRangeInUse, e.Range, e.Pool, len(e.Holders))
	for _, h := range e.Holders {
		fmt.Fprintf(&b, "\n  %s owner %s pod %s cluster %s node %s", h.IP, h.Owner, podName(h.Pod), h.Cluster, h.Node)
	}
	return b.String()
}

// Unwrap makes errors.Is(err, ErrRangeInUse) true.
func (e *RangeInUseError) Unwrap() error { return ErrRangeInUse }

// RemoveRange removes the range of set `set` (set < 0: the set of match's family) whose subnet
// is match.Subnet and, when match.RangeStart is set, whose start is match.RangeStart. It is
// refused while any allocation lies in that range.
//
// The definition and the allocations are read in one transaction at revision R; the write
// compares the definition's ModRevision and that no allocation key of the pool was created
// after R (a compare over the key range), so an ADD racing the check either commits first and
// fails the write (which retries and sees it), or commits later against the changed
// definition's ModRevision, fails, and re-reads the definition. One path does not compare
// the definition: an agent re-claiming a pod's own addresses after its lease was lost. So the
// allocations are listed again after the write; any found in the range are returned in
// Appeared (doctor reports them as out of range).
//
// Errors wrap ErrNotFound (no such pool or range), ErrRangeInUse (a *RangeInUseError listing
// the holders), allocator.ErrInvalidConfig (the set would be empty), ErrConcurrentChange, or
// the etcd error.
func RemoveRange(ctx context.Context, cli *clientv3.Client, pool string, set int, match allocator.Range) (PoolChange, error) {
	for range adminAttempts {
		p, allocs, rev, err := readPool(ctx, cli, pool)
		if err != nil {
			return PoolChange{}, err
		}
		old := p.Value
		i, j, err := findRange(old, set, match)
		if err != nil {
			return PoolChange{}, err
		}
		gone := old.Ranges[i][j]
		var holders []AllocationEntry
		for _, a := range allocs {
			if gone.Contains(a.IP) {
				holders = append(holders, a)
			}
		}
		if len(holders) > 0 {
			return PoolChange{}, &RangeInUseError{Pool: pool, Range: gone, Holders: holders}
		}
		next := old
		next.Ranges = slices.Clone(old.Ranges)
		next.Ranges[i] = slices.Delete(slices.Clone(old.Ranges[i]), j, j+1)
		if err := next.Canonicalize(); err != nil {
			return PoolChange{}, err
		}
		resp, err := cli.Txn(ctx).If(
			keyspace.Unchanged(p.Key, p.ModRevision),
			clientv3.Compare(clientv3.CreateRevision(keyspace.IPsPrefix(pool)), "<", rev+1).WithPrefix(),
		).Then(clientv3.OpPut(p.Key, keyspace.Encode(next))).Commit()
		if err != nil {
			return PoolChange{}, fmt.Errorf("write pool %s: %w", pool, err)
		}
		if !resp.Succeeded {
			continue
		}
		ch := PoolChange{Old: old, New: next, Revision: resp.Header.Revision}
		after, err := ListAllocations(ctx, cli, pool)
		if err != nil {
			return ch, fmt.Errorf("range removed, but the allocations could not be listed again to look for late arrivals: %w", err)
		}
		for _, a := range after {
			if gone.Contains(a.IP) {
				ch.Appeared = append(ch.Appeared, a)
			}
		}
		return ch, nil
	}
	return PoolChange{}, fmt.Errorf("%w: pool %s kept changing (definition or new allocations) while a range was removed; retry",
		ErrConcurrentChange, pool)
}

// ReleaseOptions tune Release.
type ReleaseOptions struct {
	// Force releases an allocation whose lease is still alive.
	Force bool
	// Quarantine is how long released addresses rest before reuse, on a lease of their own
	// (as a DEL's do); 0 puts none.
	Quarantine time.Duration
	// ReleasedBy is written into the quarantine records; default "leaseholdctl".
	ReleasedBy string
}

// Released is what Release deleted.
type Released struct {
	// Addresses are the allocation keys deleted: the one asked for first, then the other
	// addresses of the same attachment.
	Addresses []AllocationEntry
	// OwnerIndex is the owner index key deleted with them; "" when none was, and then
	// KeptOwnerIndex says why.
	OwnerIndex     string
	KeptOwnerIndex string
	// LeaseTTL is what the allocation's lease had left when it was released.
	LeaseTTL
	// QuarantineUntil is when the quarantine keys expire; zero when none were written.
	QuarantineUntil time.Time
}

// LeaseAliveError refuses to release an allocation whose lease an agent still renews.
type LeaseAliveError struct {
	Allocation AllocationEntry
	LeaseTTL
}

// Error names the holder (owner, pod, cluster, node, container), the lease and its TTL left.
func (e *LeaseAliveError) Error() string {
	a := e.Allocation
	return fmt.Sprintf("%v: %s in pool %s is held by owner %s (pod %s, cluster %s, node %s, container %s, interface %s) "+
		"on lease %s with %ds of %ds left: while the pod runs, the agent of node %s keeps renewing it, so the pod most likely still "+
		"uses this address, and releasing it lets the next ADD give it to another pod; if the pod is really gone, run again with --force",
		ErrLeaseAlive, a.IP, a.Pool, a.Owner, podName(a.Pod), a.Cluster, a.Node, a.ContainerID, a.IfName, a.Lease, e.TTL, e.GrantedTTL, a.Node)
}

// Unwrap makes errors.Is(err, ErrLeaseAlive) true.
func (e *LeaseAliveError) Unwrap() error { return ErrLeaseAlive }

// Release deletes the allocation of ip in pool, owner-compared: one transaction compares the
// ModRevision of every key it deletes, as read just before. With the allocation go the
// attachment's owner index (owners/<cluster>/<owner>/<ifname>/<pool>), when that names ip and
// is on the same lease, and the attachment's other addresses that are on that lease and name
// the same owner, so no half attachment is left behind; keys on another lease are never
// touched. Released addresses are quarantined like a DEL's. The pod record and the pod lease
// stay: the lease belongs to the agent, which revokes it once the pod has no attachment left.
//
// An allocation whose lease is alive (TTL > 0) is refused unless opt.Force is set: its agent
// still renews it. A key without a lease (written with a plain etcdctl put) needs no force.
//
// Errors wrap ErrNotFound (no allocation), ErrLeaseAlive (a *LeaseAliveError),
// ErrConcurrentChange, or the etcd error.
func Release(ctx context.Context, cli *clientv3.Client, pool string, ip netip.Addr, opt ReleaseOptions) (Released, error) {
	if err := allocator.ValidateName("pool", pool); err != nil {
		return Released{}, err
	}
	if opt.ReleasedBy == "" {
		opt.ReleasedBy = "leaseholdctl"
	}
	for range adminAttempts {
		out, done, err := releaseOnce(ctx, cli, pool, ip.Unmap(), opt)
		if done || err != nil {
			return out, err
		}
	}
	return Released{}, fmt.Errorf("%w: the allocation of %s in pool %s kept changing while it was released; retry", ErrConcurrentChange, ip, pool)
}

func releaseOnce(ctx context.Context, cli *clientv3.Client, pool string, ip netip.Addr, opt ReleaseOptions) (Released, bool, error) {
	key := keyspace.IPKey(pool, ip)
	resp, err := cli.Get(ctx, key)
	if err != nil {
		return Released{}, false, fmt.Errorf("read %s: %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return Released{}, false, fmt.Errorf("%w: %s has no allocation in pool %s (no key %s)", ErrNotFound, ip, pool, key)
	}
	e, err := allocationEntry(resp.Kvs[0])
	if err != nil {
		return Released{}, false, err
	}
	ttl, err := TimeToLive(ctx, cli, e.BoundLease)
	if err != nil {
		return Released{}, false, err
	}
	if ttl.TTL > 0 && !opt.Force {
		return Released{}, false, &LeaseAliveError{Allocation: e, LeaseTTL: ttl}
	}
	out := Released{LeaseTTL: ttl, Addresses: []AllocationEntry{e}}
	cmps := []clientv3.Cmp{keyspace.Unchanged(key, e.ModRevision)}
	ops := []clientv3.Op{clientv3.OpDelete(key)}
	if err := withAttachment(ctx, cli, e, &out, &cmps, &ops); err != nil {
		return Released{}, false, err
	}
	var qLease clientv3.LeaseID
	if opt.Quarantine > 0 {
		g, err := cli.Grant(ctx, int64(math.Ceil(opt.Quarantine.Seconds())))
		if err != nil {
			return Released{}, false, fmt.Errorf("grant a quarantine lease: %w", err)
		}
		qLease, out.QuarantineUntil = g.ID, time.Now().Add(opt.Quarantine).UTC()
		rec := keyspace.Encode(keyspace.QuarantineRecord{ReleasedBy: opt.ReleasedBy, Until: out.QuarantineUntil})
		for _, a := range out.Addresses {
			ops = append(ops, clientv3.OpPut(keyspace.QuarantineKey(pool, a.IP), rec, clientv3.WithLease(qLease)))
		}
	}
	tresp, err := cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if (err != nil || !tresp.Succeeded) && qLease != 0 {
		rctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		_, _ = cli.Revoke(rctx, qLease) // unused; it would expire by itself anyway
		cancel()
	}
	if err != nil {
		return Released{}, false, fmt.Errorf("release %s: %w", key, err)
	}
	return out, tresp.Succeeded, nil // not succeeded: a key changed since it was read; read again
}

// withAttachment adds the owner index of e's attachment, and its other addresses, to the
// release when they belong together with e (same lease, same owner), or says in out why not.
func withAttachment(ctx context.Context, cli *clientv3.Client, e AllocationEntry, out *Released, cmps *[]clientv3.Cmp, ops *[]clientv3.Op) error {
	if e.Unreadable != "" {
		out.KeptOwnerIndex = "the allocation's value is unreadable, so it names no owner index"
		return nil
	}
	if err := keyspace.ValidateNames("cluster", e.Cluster, "owner", e.Owner, "interface name", e.IfName); err != nil {
		out.KeptOwnerIndex = "the allocation names no valid owner index: " + err.Error()
		return nil
	}
	ownerKey := keyspace.OwnerKey(e.Cluster, e.Owner, e.IfName, e.Pool)
	resp, err := cli.Get(ctx, ownerKey)
	if err != nil {
		return fmt.Errorf("read %s: %w", ownerKey, err)
	}
	if len(resp.Kvs) == 0 {
		out.KeptOwnerIndex = "there is no owner index " + ownerKey
		return nil
	}
	okv := resp.Kvs[0]
	rec := record[keyspace.OwnerRecord](okv)
	switch {
	case rec.Unreadable != "":
		out.KeptOwnerIndex = fmt.Sprintf("owner index %s is unreadable (%s); doctor reports it", ownerKey, rec.Unreadable)
		return nil
	case !slices.Contains(rec.Value.IPs, e.IP):
		out.KeptOwnerIndex = fmt.Sprintf("owner index %s names %v, not %s", ownerKey, rec.Value.IPs, e.IP)
		return nil
	case rec.Lease != e.BoundLease:
		out.KeptOwnerIndex = fmt.Sprintf("owner index %s is on lease %s, the allocation on %s", ownerKey, keyspace.LeaseHex(rec.Lease), e.Lease)
		return nil
	}
	out.OwnerIndex = ownerKey
	*cmps = append(*cmps, keyspace.Unchanged(ownerKey, okv.ModRevision))
	*ops = append(*ops, clientv3.OpDelete(ownerKey))
	var gets []clientv3.Op
	for _, sib := range rec.Value.IPs {
		if sib != e.IP {
			gets = append(gets, clientv3.OpGet(keyspace.IPKey(e.Pool, sib)))
		}
	}
	tresp, err := cli.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return fmt.Errorf("read the other addresses of %s: %w", ownerKey, err)
	}
	for _, r := range tresp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			s, err := allocationEntry(kv)
			if err != nil || s.Unreadable != "" || s.BoundLease != e.BoundLease ||
				s.Owner != e.Owner || s.Cluster != e.Cluster || s.IfName != e.IfName {
				continue // not this attachment's any more: left alone
			}
			out.Addresses = append(out.Addresses, s)
			*cmps = append(*cmps, keyspace.Unchanged(s.Key, s.ModRevision))
			*ops = append(*ops, clientv3.OpDelete(s.Key))
		}
	}
	return nil
}
