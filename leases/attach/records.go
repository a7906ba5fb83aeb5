package attach

import (
	"context"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// HeldFor is what an owner's claim writes as its held keys: the node's block lease and the
// record naming node and owner. With no reuse delay nothing is held back and no held key
// is written (lease 0).
func (x *Attachments) HeldFor(ctx context.Context, owner string) (clientv3.LeaseID, keyspace.HeldRecord, error) {
	if x.cfg.ReuseDelay <= 0 {
		return 0, keyspace.HeldRecord{}, nil
	}
	id, err := x.cfg.BlockLease(ctx)
	if err != nil {
		return 0, keyspace.HeldRecord{}, unavailable("grant this node's block lease", err)
	}
	return id, keyspace.HeldRecord{Cluster: x.cfg.Cluster, Node: x.cfg.Node, Owner: owner}, nil
}

// HeldLeaseGone tells, for a claim etcd refused because a lease was not found, whether it was
// the block lease its held keys were to go on (expired or revoked from outside): then its
// claims are gone with it, and the caller claims again on a new one.
func (x *Attachments) HeldLeaseGone(ctx context.Context, id clientv3.LeaseID) bool {
	if id == 0 {
		return false
	}
	octx, cancel := x.opCtx(ctx)
	defer cancel()
	ttl, err := x.cli.TimeToLive(octx, id)
	if err != nil || ttl.TTL > 0 {
		return false
	}
	x.log.Warn("this node's block lease is gone from etcd, and its block claims and held keys with it; claiming on a new one",
		"lease", keyspace.LeaseHex(id))
	x.keeper.Forget(id)
	x.cfg.BlockLeaseLost(id)
	return true
}

// Allocation is the allocation key's record of an address of owner's attachment req on lease.
func (x *Attachments) Allocation(req allocator.Request, owner string, lease clientv3.LeaseID, now time.Time) keyspace.Allocation {
	return keyspace.Allocation{Owner: owner, Cluster: x.cfg.Cluster, Node: x.cfg.Node, NodeUID: x.cfg.NodeUID, Pod: req.Pod,
		ContainerID: req.ContainerID, IfName: req.IfName, Network: req.Network, LeaseID: keyspace.LeaseHex(lease), Created: now}
}

// OwnerRecord is the owner index of attachment req holding addrs on lease.
func (x *Attachments) OwnerRecord(req allocator.Request, addrs []netip.Addr, lease clientv3.LeaseID, now time.Time) keyspace.OwnerRecord {
	return keyspace.OwnerRecord{IPs: addrs, ContainerID: req.ContainerID, Network: req.Network, Node: x.cfg.Node,
		NodeUID: x.cfg.NodeUID, LeaseID: keyspace.LeaseHex(lease), Created: now}
}

// PodRecord is the pod record of owner, whose attachment req is, on lease.
func (x *Attachments) PodRecord(req allocator.Request, owner string, lease clientv3.LeaseID, now time.Time) keyspace.PodRecord {
	return keyspace.PodRecord{Owner: owner, Pod: req.Pod, NodeUID: x.cfg.NodeUID, LeaseID: keyspace.LeaseHex(lease), Netns: req.Netns,
		ContainerID: req.ContainerID, Created: now}
}
