package admin

import (
	"context"
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
	// HeldKeys are the released addresses' held keys (issue 23), deleted with them: an address
	// released by an admin is not held back for its node.
	HeldKeys []string
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
// ModRevision of every key it deletes, as read just before. The key is the one the pool's
// stored layout gives ip (its block's) or, in a block pool, a key left in the flat layout;
// released addresses are quarantined in the pool's layout. With the allocation go the
// attachment's owner index (owners/<cluster>/<owner>/<ifname>/<pool>), when that names ip and
// is on the same lease, and the attachment's other addresses that are on that lease and name
// the same owner, so no half attachment is left behind; keys on another lease are never
// touched. Released addresses are quarantined like a DEL's, and their held keys (in either
// layout) are deleted in the same transaction, each compared unchanged since it was read, or
// absent, as it was read: a released address is not held back for its node. The pod record
// and the pod lease stay: the lease belongs to the agent, which revokes it once the pod has no
// attachment left.
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

// layout is where a pool's keys are: the stored definition's blocks when it is usable.
type layout struct {
	pool   string
	blocks allocator.Blocks
	known  bool // the definition was read and is usable
}

// readLayout reads pool's definition for the layout of its keys.
func readLayout(ctx context.Context, cli *clientv3.Client, pool string) (layout, error) {
	key := keyspace.PoolKey(pool)
	resp, err := cli.Get(ctx, key)
	if err != nil {
		return layout{}, fmt.Errorf("read %s: %w", key, err)
	}
	l := layout{pool: pool}
	if len(resp.Kvs) > 0 {
		if spec, _, err := keyspace.DecodePool(key, resp.Kvs[0].Value); err == nil {
			l.blocks, l.known = spec.Blocks, true
		}
	}
	return l, nil
}

// candidates are the keys that may hold ip's allocation, the layout's own first: in a block
// pool also the flat key (a pool being migrated, or a key left behind); without a usable
// definition both the flat and the default block key.
func (l layout) candidates(ip netip.Addr) []string {
	flat := keyspace.IPKey(l.pool, allocator.Blocks{}, ip)
	switch {
	case !l.known:
		return []string{flat, keyspace.IPKey(l.pool, allocator.DefaultBlocks, ip)}
	case l.blocks.Flat():
		return []string{flat}
	}
	return []string{keyspace.IPKey(l.pool, l.blocks, ip), flat}
}

// quarantineKey is where a released allocation a rests: in the pool's layout, or in the layout
// of a's own key when the definition is unusable.
func (l layout) quarantineKey(a AllocationEntry) string {
	block := a.Block
	if l.known {
		block = l.blocks.Of(a.IP)
	}
	return spell(keyspace.QuarantinePrefix(l.pool), block, a.IP)
}

// readAllocation reads the candidate keys of ip and returns the first that exists.
func readAllocation(ctx context.Context, cli *clientv3.Client, l layout, ip netip.Addr) (AllocationEntry, bool, error) {
	keys := l.candidates(ip)
	ops := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		ops[i] = clientv3.OpGet(k)
	}
	resp, err := cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return AllocationEntry{}, false, fmt.Errorf("read %s: %w", strings.Join(keys, ", "), err)
	}
	for _, r := range resp.Responses {
		if kvs := r.GetResponseRange().Kvs; len(kvs) > 0 {
			e, err := allocationEntry(kvs[0])
			return e, err == nil, err
		}
	}
	return AllocationEntry{}, false, nil
}

func releaseOnce(ctx context.Context, cli *clientv3.Client, pool string, ip netip.Addr, opt ReleaseOptions) (Released, bool, error) {
	l, err := readLayout(ctx, cli, pool)
	if err != nil {
		return Released{}, false, err
	}
	e, found, err := readAllocation(ctx, cli, l, ip)
	if err != nil {
		return Released{}, false, err
	}
	if !found {
		return Released{}, false, fmt.Errorf("%w: %s has no allocation in pool %s (no key %s)", ErrNotFound, ip, pool,
			strings.Join(l.candidates(ip), " nor "))
	}
	key := e.Key
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
	if err := withAttachment(ctx, cli, l, e, &out, &cmps, &ops); err != nil {
		return Released{}, false, err
	}
	if err := withHeld(ctx, cli, l, &out, &cmps, &ops); err != nil {
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
			ops = append(ops, clientv3.OpPut(l.quarantineKey(a), rec, clientv3.WithLease(qLease)))
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
func withAttachment(ctx context.Context, cli *clientv3.Client, l layout, e AllocationEntry, out *Released, cmps *[]clientv3.Cmp, ops *[]clientv3.Op) error {
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
			for _, k := range l.candidates(sib) {
				gets = append(gets, clientv3.OpGet(k))
			}
		}
	}
	tresp, err := cli.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return fmt.Errorf("read the other addresses of %s: %w", ownerKey, err)
	}
	for _, r := range tresp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			s, err := allocationEntry(kv)
			if err != nil || s.Unreadable != "" || s.BoundLease != e.BoundLease || s.IP == e.IP ||
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

// withHeld adds the held keys of the released addresses to the release: each that exists is
// compared unchanged and deleted, each that does not is compared absent, so a held key written
// after the read (by an agent's claim) fails the transaction, which then reads again.
func withHeld(ctx context.Context, cli *clientv3.Client, l layout, out *Released, cmps *[]clientv3.Cmp, ops *[]clientv3.Op) error {
	var keys []string
	for _, a := range out.Addresses {
		keys = append(keys, l.heldCandidates(a.IP)...)
	}
	gets := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		gets[i] = clientv3.OpGet(k, clientv3.WithKeysOnly())
	}
	resp, err := cli.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return fmt.Errorf("read the held keys of %s: %w", strings.Join(keys, ", "), err)
	}
	for i, r := range resp.Responses {
		kvs := r.GetResponseRange().Kvs
		if len(kvs) == 0 {
			*cmps = append(*cmps, keyspace.Absent(keys[i]))
			continue
		}
		out.HeldKeys = append(out.HeldKeys, keys[i])
		*cmps = append(*cmps, keyspace.Unchanged(keys[i], kvs[0].ModRevision))
		*ops = append(*ops, clientv3.OpDelete(keys[i]))
	}
	return nil
}
