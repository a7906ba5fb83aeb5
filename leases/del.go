package leases

import (
	"context"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/release"
)

// Del releases one attachment's addresses (release.Releaser.Del): only keys this attachment
// holds, quarantined, the pod lease given up with its last attachment. Releasing nothing is
// not an error. A DEL answered is final; one that etcd cannot take is recorded, answered, and
// released once etcd answers.
//
// Errors wrap allocator.ErrInvalidName or ErrUnavailable.
func (a *Agent) Del(ctx context.Context, req allocator.Request) (err error) {
	defer a.metrics.observe("del", time.Now(), &err)
	return a.release.Del(ctx, req)
}

// GC releases every attachment of the request's network that this node identity made and
// the runtime no longer lists in ValidAttachments (CNI 1.1 GC), but those younger than the
// GC grace (release.Releaser.GC). It keeps going when one release fails and returns all
// failures joined.
func (a *Agent) GC(ctx context.Context, req allocator.GCRequest) (err error) {
	defer a.metrics.observe("gc", time.Now(), &err)
	return a.release.GC(ctx, req)
}

// newReleaser makes the agent's DEL, GC and CHECK (leases/release), handing in what they use
// of the agent. The parts it calls into are made before: the views, the keeper, the pod book,
// the sticky claims, the conflict watch and the import; the recovery, made after it, is
// reached through closures.
func (a *Agent) newReleaser() *release.Releaser {
	cfg := a.cfg
	return &release.Releaser{Cfg: release.Config{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID,
		OpTimeout: cfg.OpTimeout, Quarantine: cfg.Quarantine, GCGrace: cfg.GCGrace, StateDir: cfg.StateDir,
		WallClock: cfg.WallClock, Started: a.started},
		Cli: a.cli, Log: a.log, Keeper: a.keeper, Pools: a.pools, Pods: a.pods, Journal: a.jw, Locks: &a.locks,
		Metrics: release.Metrics{ReleasesDeferred: a.metrics.releasesDeferred, ReclaimsCancelled: a.metrics.reclaimsCancelled,
			Unquarantined: a.metrics.unquarantined, NoSpace: a.metrics.noSpace, RTT: a.metrics.rtt, Conflicts: a.conflicts.Add},
		Ctx: a.ctx, Go: a.wg.Go,
		Validate: a.validate, AttachmentOwner: a.attachmentOwner, Reachable: a.reachable,
		Stopped: a.Err, ConflictDeleted: a.imports.ConflictDeleted, StopWatch: a.cwatch.Stop,
		Wake: func() { a.recovery.Wake() },
		OthersSince: func(ctx context.Context, owner, key string, ip netip.Addr, from, to int64, before time.Time) ([]keyspace.TakenByOther, bool) {
			return a.recovery.OthersSince(ctx, owner, key, ip, from, to, before)
		},
		ReleaseSticky: a.sticky.Release, StickyReleased: a.sticky.Released, ClaimReleaseTTL: a.sticky.ReleaseTTL,
		Departed: func(ctx context.Context, pool string, blocks allocator.Blocks, claim, owner, ownerKey string, ownerRev int64,
			lease clientv3.LeaseID, ips []netip.Addr, network string) (bool, bool, int64, int64, error) {
			d, err := a.sticky.Departed(ctx, pool, blocks, claim, owner, ownerKey, ownerRev, lease, ips, network)
			return d.Done, d.Bystander, d.Revision, d.Left, err
		},
		Result: result}
}
