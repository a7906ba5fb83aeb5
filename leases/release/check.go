package release

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/kernel"
)

// Check verifies that the attachment's addresses are held in etcd by this owner and
// container, on a lease that is alive and that this agent keeps renewing. It returns the
// addresses.
//
// Errors wrap allocator.ErrNotAllocated (no allocation, another container holds it, or its
// lease is expiring), allocator.ErrConflict (an address is held by another owner), or
// allocator.ErrUnavailable.
func (r *Releaser) Check(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	owner, err := r.Validate(&req)
	if err != nil {
		return allocator.Result{}, err
	}
	owner = r.AttachmentOwner(req, owner) // an imported attachment is kept under its container ID
	own := r.Locks.Lock(owner)
	defer own.Unlock()
	var res allocator.Result
	for _, pool := range r.attachedPools(owner, req) {
		req.Pool = pool
		one, err := r.checkIn(ctx, req, owner)
		if err != nil {
			return allocator.Result{}, err
		}
		res.IPs = append(res.IPs, one.IPs...)
	}
	return res, nil
}

// checkIn checks the interface's attachment in the pool req names (one of an interface with
// addresses from two pools), for owner, whose lock the caller holds.
func (r *Releaser) checkIn(ctx context.Context, req allocator.Request, owner string) (allocator.Result, error) {
	p, err := r.Pools.Ensure(ctx, req.Pool)
	if err != nil {
		return allocator.Result{}, err
	}
	ownerKey := keyspace.OwnerKey(r.Cfg.Cluster, owner, req.IfName, p.Spec.Name)
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	resp, err := r.Cli.Get(octx, ownerKey)
	if err != nil {
		return allocator.Result{}, r.unavailable("read "+ownerKey, err)
	}
	if len(resp.Kvs) == 0 {
		return allocator.Result{}, fmt.Errorf("%w: container %s interface %s has no addresses in pool %q (no key %s)",
			allocator.ErrNotAllocated, req.ContainerID, req.IfName, p.Spec.Name, ownerKey)
	}
	kv := resp.Kvs[0]
	rec, err := keyspace.Decode[keyspace.OwnerRecord](ownerKey, kv.Value)
	if err != nil {
		return allocator.Result{}, err
	}
	if rec.ContainerID != req.ContainerID {
		return allocator.Result{}, fmt.Errorf("%w: interface %s of owner %s in pool %q belongs to container %s, not %s",
			allocator.ErrNotAllocated, req.IfName, owner, p.Spec.Name, rec.ContainerID, req.ContainerID)
	}
	lease := keyspace.LeaseOf(kv)
	ops := make([]clientv3.Op, 0, len(rec.IPs))
	for _, addr := range rec.IPs {
		ops = append(ops, clientv3.OpGet(keyspace.IPKey(p.Spec.Name, p.Spec.Blocks, addr)))
	}
	if rec.Claim != "" {
		ops = append(ops, clientv3.OpGet(keyspace.LiveMigrationKey(r.Cfg.Cluster, p.Spec.Name, rec.Claim)))
	}
	tresp, err := r.Cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return allocator.Result{}, r.unavailable("read the attachment's addresses", err)
	}
	// A live migration's target (its claim's migration key names it) holds the addresses
	// through that key: their keys are its source's until the migration completes.
	var source string
	if rec.Claim != "" {
		if kvs := tresp.Responses[len(rec.IPs)].GetResponseRange().Kvs; len(kvs) > 0 {
			m, err := keyspace.Decode[keyspace.LiveMigrationRecord](string(kvs[0].Key), kvs[0].Value)
			if err == nil && m.Target.Owner == owner && m.Target.ContainerID == req.ContainerID {
				source = m.Source.Owner
			}
		}
	}
	for i, addr := range rec.IPs {
		kvs := tresp.Responses[i].GetResponseRange().Kvs
		if source != "" {
			if len(kvs) == 0 {
				continue // its source expired: the target's agent moves the keys to it
			}
			if al, err := keyspace.Decode[keyspace.Allocation](string(kvs[0].Key), kvs[0].Value); err == nil && al.Owner == source {
				continue
			}
		}
		if len(kvs) == 0 {
			return allocator.Result{}, fmt.Errorf("%w: owner index %s names %s, but %s does not exist",
				allocator.ErrConflict, ownerKey, addr, keyspace.IPKey(p.Spec.Name, p.Spec.Blocks, addr))
		}
		holder, err := keyspace.Decode[keyspace.Allocation](string(kvs[0].Key), kvs[0].Value)
		if err != nil {
			return allocator.Result{}, err
		}
		if !keyspace.HeldOn(kvs[0], lease) || holder.Owner != owner || holder.ContainerID != req.ContainerID {
			return allocator.Result{}, fmt.Errorf("%w: %s in pool %q is held by owner %s container %s on lease %x, not by this attachment (owner %s container %s lease %s)",
				allocator.ErrConflict, addr, p.Spec.Name, holder.Owner, holder.ContainerID, kvs[0].Lease, owner, req.ContainerID, keyspace.LeaseHex(lease))
		}
	}
	ttl, err := r.Cli.TimeToLive(octx, lease)
	if err != nil {
		return allocator.Result{}, r.unavailable("read the pod lease", err)
	}
	if ttl.TTL <= 0 {
		return allocator.Result{}, fmt.Errorf("%w: pod lease %s of owner %s has expired", allocator.ErrNotAllocated, keyspace.LeaseHex(lease), owner)
	}
	if !r.Keeper.Holds(lease) {
		return allocator.Result{}, fmt.Errorf("%w: pod lease %s of owner %s is not renewed by this agent (node %s, identity %s); it expires in %ds",
			allocator.ErrNotAllocated, keyspace.LeaseHex(lease), owner, r.Cfg.Node, r.Cfg.NodeUID, ttl.TTL)
	}
	if err := checkSandbox(req.Netns, req.IfName, rec.IPs); err != nil {
		return allocator.Result{}, err
	}
	return r.Result(&p.Spec, rec.IPs)
}

// checkSandbox looks at the attachment's interface inside the sandbox: an address whose
// IPv6 duplicate address detection failed is a duplicate on the link. A tentative address
// (DAD still running) counts as present. A missing namespace, interface or address is left
// to the main plugin's CHECK, which owns the interface.
func checkSandbox(netns, ifName string, ips []netip.Addr) error {
	if netns == "" {
		return nil
	}
	addrs, err := kernel.LinkAddrs(netns, ifName)
	if errors.Is(err, kernel.ErrNoNetns) || errors.Is(err, kernel.ErrNoLink) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%w: look inside the sandbox: %w", allocator.ErrUnavailable, err)
	}
	for _, ad := range addrs {
		if ad.DADFailed && slices.Contains(ips, ad.Prefix.Addr()) {
			return fmt.Errorf("%w: duplicate address detected: %s on %s in %s failed IPv6 duplicate address detection, "+
				"so another host on the link uses it; find the other holder (leaseholdctl alloc list, or the link's neighbours) "+
				"and recreate this pod once it is resolved",
				allocator.ErrConflict, ad.Prefix.Addr(), ifName, netns)
		}
	}
	return nil
}
