package admin

import (
	"context"
	"errors"
	"fmt"
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
	// ErrMigrating: the pool is frozen by an unfinished leaseholdctl pool migrate.
	ErrMigrating = errors.New("pool is being migrated")
	// ErrMigrateConflicts: pool migrate left flat keys whose key in the block layout exists.
	ErrMigrateConflicts = errors.New("keys of one address in both layouts")
	// ErrAgentsNotUpgraded: a live agent does not serve the block layout; the error is an
	// *AgentsNotUpgradedError naming each.
	ErrAgentsNotUpgraded = errors.New("agents not upgraded to the block layout")
	// ErrNodeAlive: node forget of a node whose node record exists, or whose pod records are
	// on live leases; the error is a *NodeInUseError.
	ErrNodeAlive = errors.New("node may still be alive")
	// ErrAmbiguousNode: node forget without a cluster, of a node name that keys of several
	// clusters name; the error is a *NodeClustersError.
	ErrAmbiguousNode = errors.New("node name in several clusters")
)

// adminAttempts bounds the read-compare-write rounds of one admin operation.
const adminAttempts = 5

// cleanupTimeout bounds the revoke of a quarantine lease a failed release did not use. It
// runs on its own context, as the caller's may be the one that ran out.
const cleanupTimeout = 5 * time.Second

// CreatePool stores spec as the definition of pool spec.Name if there is none, in the block
// layout: a spec with flat (zero) Blocks gets allocator.DefaultBlocks, since every agent that
// writes the pool's keys must derive the same block for an address, and new agents serve
// blocks. It is written with keyspace.EncodePool, whose shape an agent from before blocks
// refuses. An identical stored definition (after both are canonicalized) is not an error:
// created is false. When spec gives no Blocks, the stored layout is not compared, so creating
// an existing flat pool again with its ranges stays a no-op (leaseholdctl pool migrate moves
// it to blocks).
//
// Errors wrap allocator.ErrInvalidConfig or ErrInvalidName (spec does not canonicalize),
// allocator.ErrPoolMismatch (another definition is stored; the message shows both), or the
// etcd error.
func CreatePool(ctx context.Context, cli *clientv3.Client, spec allocator.PoolSpec) (created bool, err error) {
	anyLayout := spec.Blocks.Flat()
	if anyLayout {
		spec.Blocks = allocator.DefaultBlocks
	}
	if err := spec.Canonicalize(); err != nil {
		return false, err
	}
	key := keyspace.PoolKey(spec.Name)
	resp, err := cli.Txn(ctx).If(keyspace.Absent(key)).
		Then(clientv3.OpPut(key, keyspace.EncodePool(spec))).Else(clientv3.OpGet(key)).Commit()
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
	stored, _, derr := keyspace.DecodePool(key, kvs[0].Value)
	if derr == nil {
		same := stored
		if anyLayout {
			same.Blocks = spec.Blocks
		}
		if same.Equal(spec) {
			return false, nil
		}
	}
	shown := stored.String()
	if derr != nil {
		shown = "an unusable value (" + derr.Error() + ")"
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
	// pod that lost its lease, or whose keys its agent found lost, does not compare the pool
	// definition (see RemoveRange).
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
// canonicalize, or overlaps), ErrMigrating (pool migrate has not finished), ErrConcurrentChange,
// or the etcd error.
func AddRange(ctx context.Context, cli *clientv3.Client, pool string, set int, r allocator.Range) (PoolChange, error) {
	for range adminAttempts {
		p, allocs, _, err := readPool(ctx, cli, pool)
		if err != nil {
			return PoolChange{}, err
		}
		if err := notMigrating(p); err != nil {
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
			cmps = append(cmps, keyspace.Absent(keyspace.IPKey(pool, old.Blocks, gw)))
			if !old.Blocks.Flat() { // a key left in the flat layout holds its address too
				cmps = append(cmps, keyspace.Absent(keyspace.IPKey(pool, allocator.Blocks{}, gw)))
			}
		}
		resp, err := cli.Txn(ctx).If(cmps...).Then(clientv3.OpPut(p.Key, keyspace.EncodePoolWith(next, p.Access))).Commit()
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
// the definition: an agent re-claiming a pod's own addresses after its lease was lost (or after
// it revoked that lease on finding the pod's keys lost in etcd). So the
// allocations are listed again after the write; any found in the range are returned in
// Appeared (doctor reports them as out of range).
//
// Errors wrap ErrNotFound (no such pool or range), ErrRangeInUse (a *RangeInUseError listing
// the holders), allocator.ErrInvalidConfig (the set would be empty), ErrMigrating,
// ErrConcurrentChange, or the etcd error.
func RemoveRange(ctx context.Context, cli *clientv3.Client, pool string, set int, match allocator.Range) (PoolChange, error) {
	for range adminAttempts {
		p, allocs, rev, err := readPool(ctx, cli, pool)
		if err != nil {
			return PoolChange{}, err
		}
		if err := notMigrating(p); err != nil {
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
		).Then(clientv3.OpPut(p.Key, keyspace.EncodePoolWith(next, p.Access))).Commit()
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

// setFor returns the range set of spec that r belongs to: set itself when it is >= 0, else the
// only set of r's address family.
func setFor(spec allocator.PoolSpec, set int, r allocator.Range) (int, error) {
	if set >= 0 {
		if set >= len(spec.Ranges) {
			return 0, fmt.Errorf("%w: pool %s has range sets 0-%d, not %d; a new range set would change what every "+
				"attachment gets, so define a new pool for it", allocator.ErrInvalidConfig, spec.Name, len(spec.Ranges)-1, set)
		}
		return set, nil
	}
	fam := allocator.RangeSet{r}.Family()
	found := -1
	for i, s := range spec.Ranges {
		if s.Family() == fam {
			if found >= 0 {
				return 0, fmt.Errorf("%w: pool %s has several IPv%d range sets (%d and %d); say which with --set",
					allocator.ErrInvalidConfig, spec.Name, fam, found, i)
			}
			found = i
		}
	}
	if found < 0 {
		return 0, fmt.Errorf("%w: pool %s has no IPv%d range set", allocator.ErrInvalidConfig, spec.Name, fam)
	}
	return found, nil
}

// findRange locates the range match names in spec.
func findRange(spec allocator.PoolSpec, set int, match allocator.Range) (int, int, error) {
	sub := match.Subnet.Masked()
	var found [][2]int
	for i, s := range spec.Ranges {
		if set >= 0 && i != set {
			continue
		}
		for j, r := range s {
			if r.Subnet == sub && (!match.RangeStart.IsValid() || r.RangeStart == match.RangeStart) {
				found = append(found, [2]int{i, j})
			}
		}
	}
	switch {
	case len(found) == 0:
		return 0, 0, fmt.Errorf("%w: no range with subnet %s in %s", ErrNotFound, sub, spec.String())
	case len(found) > 1:
		var names []string
		for _, f := range found {
			names = append(names, fmt.Sprintf("set %d: %s", f[0], spec.Ranges[f[0]][f[1]]))
		}
		return 0, 0, fmt.Errorf("%w: pool %s has several ranges with subnet %s (%s); name one with --set and start=",
			allocator.ErrInvalidConfig, spec.Name, sub, strings.Join(names, "; "))
	}
	i, j := found[0][0], found[0][1]
	if len(spec.Ranges[i]) == 1 {
		return 0, 0, fmt.Errorf("%w: range %s is the only one of set %d of pool %s; a range set cannot be empty "+
			"(removing the set would change what every attachment gets: define a new pool instead)",
			allocator.ErrInvalidConfig, spec.Ranges[i][j], i, spec.Name)
	}
	return i, j, nil
}

// notMigrating refuses to change a pool that leaseholdctl pool migrate has frozen: a rewrite
// would drop the freeze (and the move compares the definition it froze).
func notMigrating(p PoolEntry) error {
	if m := p.Migrating; m != nil {
		return fmt.Errorf("%w: pool %s is being moved to the block layout (by %s since %s; its ADDs are refused meanwhile); "+
			"finish it first with leaseholdctl pool migrate %s", ErrMigrating, p.Name, m.By, m.Since.UTC().Format(time.RFC3339), p.Name)
	}
	return nil
}
