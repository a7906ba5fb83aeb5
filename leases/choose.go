package leases

import (
	"context"
	"net/netip"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/attach"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
)

// Add allocates one address from every range set of a pool for the attachment (container ID
// + interface), or returns the addresses it already has. The pool is the one the selection
// rules, the pod's request or the network configuration give (leases/attach); a full one
// passes the ADD to the next of the list. All addresses, the owner index and the pod record
// are created in one transaction on the pod's lease, guarded by create-if-absent on every
// address, its quarantine key and the owner index.
//
// Errors wrap allocator.ErrInvalidConfig or ErrInvalidName (bad request, or no pool the pod
// may use), ErrPoolMismatch, ErrNotInRange or ErrAddressInUse (requested addresses),
// ErrPoolExhausted (no free address in any pool of the list; also ErrOnlyQuarantined when
// only resting addresses are free), or ErrUnavailable (etcd unreachable, or the owner's keys
// are held by another node identity until they expire).
func (a *Agent) Add(ctx context.Context, req allocator.Request) (_ allocator.Result, err error) {
	defer a.metrics.observe("add", time.Now(), &err)
	if req.Migratable && req.Claim == "" {
		a.sticky.Unclaimed(req.Network)
	}
	return a.attach.Add(ctx, req)
}

// result is the answer giving addrs of the pool spec (attach.Result).
func result(spec *allocator.PoolSpec, addrs []netip.Addr) (allocator.Result, error) {
	return attach.Result(spec, addrs)
}

// newAttachments makes the agent's ADDs (leases/attach), handing in what they use of the
// agent. The parts they call into are made before: the views, the rules, the keeper, the
// claim loops, the pod book, the audit, the sticky claims, the block leases; the release and
// the recovery, made after them, are reached through closures.
func (a *Agent) newAttachments() *attach.Attachments {
	cfg := a.cfg
	return attach.New(attach.Config{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID, NodeLabels: cfg.NodeLabels,
		OpTimeout: cfg.OpTimeout, LeaseTTL: cfg.LeaseTTL, ReuseDelay: cfg.ReuseDelay, ProbeAfter: probeAfter, WallClock: cfg.WallClock,
		Log: a.log, Client: a.cli, Gate: a.gate, Keeper: a.keeper, Pools: a.pools, Rules: a.rules, Batcher: a.claims,
		Loops: a.loops, Locks: &a.locks, Pods: a.pods, Journal: a.jw, Hold: a.hold,
		Validate: a.validate, Reachable: a.reachable, AttachmentOwner: a.attachmentOwner, LeaseLost: a.leaseLost,
		BlockLeaseLost: a.blockLeaseLost, BlockLease: a.blockLeases.get, MineBlockLease: a.blockLeases.mine,
		Wake: func() { a.recovery.Wake() },
		ReleaseAttachment: func(ctx context.Context, req allocator.Request, own *ownerlock.Owned) (int64, error) {
			return a.release.ReleaseAttachment(ctx, req, own)
		},
		KeysLost: func(ctx context.Context, p podbook.AuditPod, problems []string) error {
			return a.audit.KeysLost(ctx, p, problems, nil)
		},
		Sticky: stickyAddOf(a.sticky),
		Metrics: attach.Metrics{Retried: a.metrics.casRetries.Inc, RTT: a.metrics.rtt, Handover: a.metrics.claimHandovers.Inc,
			Tried: a.metrics.tried}})
}
