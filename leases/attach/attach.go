// Package attach is the agent's attachments: an ADD, from the pools it may use to the pod book
// that records what it got. It chooses the pools (the selection rules), picks addresses from
// each pool's view, sends the claim through the claim loop (leases/claimloop) and the
// transactions (leases/txn), and acts on what a refused claim found: addresses taken, the
// attachment there already (a repeated ADD, a new container of the same pod), the pool's
// definition or the pod record changed.
//
// It takes the owner lock of the ADD's owner (leases/ownerlock) and holds it for the whole
// ADD; what it calls with the lock held takes none. It starts no goroutine.
package attach

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/claimloop"
	"github.com/leasehold/leasehold/leases/etcdgate"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/restorehold"
	"github.com/leasehold/leasehold/leases/rules"
	"github.com/leasehold/leasehold/leases/txn"
)

// Config is what the attachments are handed at start: the node they serve, the parts below
// them, and the agent's and other parts' functions they call.
type Config struct {
	Cluster, Node, NodeUID string
	// NodeLabels are the node's labels the selection rules match.
	NodeLabels map[string]string
	// OpTimeout bounds one etcd request; LeaseTTL is a pod lease's; ReuseDelay holds a
	// released address back (0: no held keys are written); ProbeAfter is how long etcd may
	// be silent before an unanswered claim asks whether it is reachable at all.
	OpTimeout, LeaseTTL, ReuseDelay, ProbeAfter time.Duration
	// WallClock is the time written into records.
	WallClock func() time.Time
	Log       *slog.Logger

	// Client is the gate's etcd client; Gate says which history the views know (Epoch).
	Client *clientv3.Client
	Gate   *etcdgate.Gate
	Keeper *keeper.Keeper
	Pools  *poolview.Pools
	Rules  *rules.Follower
	// Batcher commits the claims of concurrent ADDs together; Loops makes an ADD's claim loop.
	Batcher *txn.Batcher
	Loops   *claimloop.Claims
	Locks   *ownerlock.Locks
	Pods    *podbook.Book
	Journal *podbook.Writer
	// Hold is what an ADD waits for while the agent repairs what a restore of etcd took.
	Hold *restorehold.Hold

	// Validate canonicalises a request's pool and checks its names; it returns the owner.
	Validate func(req *allocator.Request) (string, error)
	// Reachable says whether etcd answers, at once for a node cut off from it.
	Reachable func(ctx context.Context) error
	// AttachmentOwner is the owner an attachment's keys are under: an imported container's
	// repeated ADD finds its addresses under its container ID.
	AttachmentOwner func(req allocator.Request, owner string) string
	// LeaseLost is told that etcd no longer has a lease the agent renewed.
	LeaseLost func(id clientv3.LeaseID)
	// BlockLeaseLost drops the block claims on id if it is a block lease; it reports whether.
	BlockLeaseLost func(id clientv3.LeaseID) bool
	// BlockLease is the node's block lease, which held keys go on, granted at first use;
	// MineBlockLease tells whether id is one of this node's block leases.
	BlockLease     func(ctx context.Context) (clientv3.LeaseID, error)
	MineBlockLease func(id clientv3.LeaseID) bool
	// ReleaseAttachment releases one attachment of the owner whose lock own is (a DEL's work).
	ReleaseAttachment func(ctx context.Context, req allocator.Request, own *ownerlock.Owned) (int64, error)
	// KeysLost re-claims a pod whose keys etcd lost, as the audit does, naming the problems.
	KeysLost func(ctx context.Context, p podbook.AuditPod, problems []string) error
	// Wake has recovery run a pass soon.
	Wake func()
	// Sticky returns the sticky claim an ADD of req names (req.Claim is not empty).
	Sticky  func(req allocator.Request, owner string) Sticky
	Metrics Metrics
}

// Metrics are the counters an ADD moves.
type Metrics struct {
	// Retried counts an ADD's transactions after its first.
	Retried func()
	// RTT records an etcd round trip of kind that started at start.
	RTT func(kind string, start time.Time)
	// Handover counts a sticky claim handed to a new holder.
	Handover func()
	// Tried records what came of the ADD in pools[i], the i-th pool of its list.
	Tried func(pools []allocator.PoolSpec, i int, err error)
}

// Sticky is what an ADD knows of the sticky claim it names, read and written by the sticky
// claims.
type Sticky interface {
	// Stale tells whether the claim is to be read (again) before the next attempt: not read
	// yet, or a claim transaction found it changed.
	Stale() bool
	// Read reads the claim and the state of its addresses, waiting for a holder that still
	// has them; the request's addresses become the claim's.
	Read(ctx context.Context, spec allocator.PoolSpec, req *allocator.Request) error
	// Returning tells whether the claim existed when read: its addresses are not new.
	Returning() bool
	// Claim adds the claim to the ADD's claim transaction c.
	Claim(ctx context.Context, c *txn.Claim, now time.Time) error
	// Found tells whether what a refused claim found (out) means the claim moved, or its
	// addresses were taken: then it is stale.
	Found(out txn.ClaimOutcome) bool
	// Bound records that the claim applied and names it in at; it reports whether the claim
	// was handed over from another holder or none.
	Bound(at *podbook.Attachment) (handover bool)
	// Drop gives up the claim lease the ADD granted but did not bind the claim to.
	Drop()
	// Target tells whether the claim read makes the ADD a live migration's target.
	Target() bool
	// Migrate sends the target's transaction, of what the ADD's claim c would write (the
	// start of the migration, or a repeated ADD's read of its owner index); applied false:
	// the claim changed since it was read (it is stale). rev is the owner index's revision.
	Migrate(ctx context.Context, c *txn.Claim, now time.Time) (applied bool, rev int64, err error)
}

// Attachments makes the ADDs of one agent.
type Attachments struct {
	cfg     Config
	cli     *clientv3.Client
	gate    *etcdgate.Gate
	log     *slog.Logger
	keeper  *keeper.Keeper
	pools   *poolview.Pools
	rules   *rules.Follower
	batcher *txn.Batcher
	loops   *claimloop.Claims
	locks   *ownerlock.Locks
	pods    *podbook.Book
	journal *podbook.Writer
	hold    *restorehold.Hold
}

// New returns the attachments, handed cfg.
func New(cfg Config) *Attachments {
	return &Attachments{cfg: cfg, cli: cfg.Client, gate: cfg.Gate, log: cfg.Log, keeper: cfg.Keeper, pools: cfg.Pools,
		rules: cfg.Rules, batcher: cfg.Batcher, loops: cfg.Loops, locks: cfg.Locks, pods: cfg.Pods, journal: cfg.Journal,
		hold: cfg.Hold}
}

// opCtx bounds one etcd request by the operation timeout.
func (x *Attachments) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, x.cfg.OpTimeout)
}

// wall is the time written into records.
func (x *Attachments) wall() time.Time { return x.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries.
func unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// Result is the answer giving addrs of the pool spec.
func Result(spec *allocator.PoolSpec, addrs []netip.Addr) (allocator.Result, error) {
	res := allocator.Result{IPs: make([]allocator.IPConfig, 0, len(addrs))}
	for _, addr := range addrs {
		c, err := spec.IPConfig(addr)
		if err != nil {
			return allocator.Result{}, err
		}
		res.IPs = append(res.IPs, c)
	}
	return res, nil
}
