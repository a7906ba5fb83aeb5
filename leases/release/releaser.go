package release

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
)

// Releaser is the agent's DEL, GC and CHECK, and the releases the recovery makes
// (ReleaseAttachment, DropPodIfEmpty, ReleaseOwner, ReportTakenAtDel). It owns no lock and no
// state: each operation runs under the owner lock it takes (Del, GC, Check) or is handed
// (the rest), and changes the pod book only through that lock's handle. The goroutines it
// starts (ReportTakenAtDel's history reads) are started by Go, which the agent waits for when
// it closes. Every field is set by the agent when it makes the Releaser (leases.Agent.newReleaser).
type Releaser struct {
	Cfg     Config
	Cli     *clientv3.Client // the gate's: every answer reaches the gate
	Log     *slog.Logger
	Keeper  *keeper.Keeper
	Pools   *poolview.Pools
	Pods    *podbook.Book
	Journal *podbook.Writer
	Locks   *ownerlock.Locks
	Metrics Metrics
	// Ctx is the agent's: a background read ends with it. Go runs a function on a goroutine
	// the agent waits for when it closes.
	Ctx context.Context
	Go  func(func())

	// What a request asks of the agent before it releases: Validate canonicalises the request
	// and names its owner; AttachmentOwner finds an imported attachment kept under its
	// container ID; Reachable whether etcd answers; Stopped why the agent stopped (nil while it
	// serves).
	Validate        func(*allocator.Request) (string, error)
	AttachmentOwner func(req allocator.Request, owner string) string
	Reachable       func(context.Context) error
	Stopped         func() error
	// ConflictDeleted records, before a DEL answers, that the container of an import conflict
	// was deleted; StopWatch stops following the owner's conflicted addresses.
	ConflictDeleted func(allocator.Request) error
	StopWatch       func(owner string)
	// Wake wakes the recovery: a release is left to it, or a pod's keys were found gone.
	// OthersSince reads etcd's history of an allocation key (the recovery's): the owners
	// other than owner that held ip between revisions from and to, known false when a
	// compaction took that history.
	Wake        func()
	OthersSince func(ctx context.Context, owner, key string, ip netip.Addr, from, to int64, before time.Time) ([]keyspace.TakenByOther, bool)
	// The sticky claims' part of a release: ReleaseSticky prepares the claim's release,
	// StickyReleased records a claim kept by the release, ClaimReleaseTTL is the TTL of the
	// lease a released claim goes onto.
	ReleaseSticky   func(ctx context.Context, pool, owner string, at podbook.Attachment) (string, keyspace.ClaimRecord, clientv3.LeaseID, error)
	StickyReleased  func(key, pool, claim string, rec keyspace.ClaimRecord, q keyspace.QuarantineRecord, ttl time.Duration)
	ClaimReleaseTTL func(at podbook.Attachment) time.Duration
	// Departed is the DEL of a sticky attachment whose claim is being migrated
	// (sticky.Claims.Departed): T2 for its holder, T3 for its target. Not done: the
	// migration ended without it, and the release goes on as without one; bystander: the
	// attachment is neither, and its release goes on without comparing the migration key.
	Departed func(ctx context.Context, pool string, blocks allocator.Blocks, claim, owner, ownerKey string, ownerRev int64,
		lease clientv3.LeaseID, ips []netip.Addr, network string) (done, bystander bool, rev, left int64, err error)
	// Result is a CHECK's answer: the attachment's addresses as the pool configures them.
	Result func(spec *allocator.PoolSpec, addrs []netip.Addr) (allocator.Result, error)
}

// Config is what the Releaser uses of the agent's configuration (leases.Config).
type Config struct {
	Cluster, Node, NodeUID string
	// OpTimeout bounds each etcd call; Quarantine how long a released address rests
	// (negative: none); GCGrace keeps younger attachments from GC (<=0: none).
	OpTimeout, Quarantine, GCGrace time.Duration
	StateDir                       string // the journal's, named in errors
	WallClock                      func() time.Time
	Started                        time.Time // when the agent started: a GC within the grace after reads records' ages
}

// Metrics are the agent's counters the Releaser adds to.
type Metrics struct {
	// ReleasesDeferred counts DELs recorded while etcd was away; ReclaimsCancelled DELs that
	// stopped a lost pod's re-claim; Unquarantined releases made without quarantine because
	// etcd was out of space; NoSpace every refusal by etcd's NOSPACE alarm.
	ReleasesDeferred, ReclaimsCancelled, Unquarantined, NoSpace prometheus.Counter
	// RTT records a release transaction's round trip; Conflicts adds addresses found taken by
	// another owner while a pod's lease was lost.
	RTT       func(kind string, start time.Time)
	Conflicts func(int64) int64
}

func (r *Releaser) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, r.Cfg.OpTimeout)
}

// unavailable wraps an etcd error so that the runtime retries.
func (r *Releaser) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// durable waits until the journal holds what an operation on owner changed, so that its
// answer survives a crash right after it (podbook.Writer.Sync).
func (r *Releaser) durable(ctx context.Context, op, owner string) error {
	if err := r.Journal.Sync(ctx); err != nil {
		return fmt.Errorf("%w: %s of %s is done in etcd, but the agent's journal in %s cannot record it, and a restart "+
			"could undo it: %w; free the state directory's disk, then retry", allocator.ErrUnavailable, op, owner, r.Cfg.StateDir, err)
	}
	return nil
}

// keysGone is the finding that etcd holds no key of a pod on lease, which the keeper still
// renews: the lease expired before the keeper noticed, or etcd went back to before the keys
// were written. The pod is re-claimed on a new lease, and this one is revoked: alive again
// after a restore, it carries what the backup had on it (a deleted pod's keys, when it was
// that pod's and then a spare), which renewed would stay for ever.
func (r *Releaser) keysGone(lease clientv3.LeaseID) {
	if err := r.Keeper.Revoke(lease); err != nil {
		r.Log.Debug("revoking the lease of a pod whose keys are gone failed; it expires by itself",
			"lease", keyspace.LeaseHex(lease), "err", err)
	}
	r.Pods.Lose(lease)
}
