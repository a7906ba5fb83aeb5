// Package keeper keeps the agent's etcd leases alive: the pods', the blocks' and the sticky
// claims'. It is one part of the agent (docs/agent.md): it owns its goroutines and its locks,
// and tells its owner of a lost lease and of each renewal etcd answered through the callbacks
// it is given at start.
//
// A Keeper is made of parts that own their state, lock and goroutine, wired by New: the
// Keeper itself holds the leases it renews (one drain goroutine per lease); spares keeps
// pre-granted leases ready (the refill goroutine); fresh starts a granted lease's renewals
// when its first one is due (one goroutine); quarantine hands out the shared quarantine lease.
//
// Lock order: spares.mu before Keeper.mu (spares asks whether the keeper holds a lease under
// its own lock, so that a lease lost meanwhile leaves the spares after it joined them);
// fresh.mu and quarantine.mu are taken alone. No lock is held while calling etcd, OnLost,
// OnHeard, or the keeper from a part (a grant, a revoke, a registration), but quarantine.mu,
// held across its grant so that concurrent releases share one lease.
package keeper

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// MinTTL is etcd's minimum lease TTL; a shorter one is raised by etcd, silently.
const MinTTL = 2 * time.Second

// defaultOpTimeout bounds a grant or revoke when Config.OpTimeout is not set.
const defaultOpTimeout = 10 * time.Second

// Keeper owns the agent's leases: it pre-grants a few so that an ADD for a new pod costs one
// etcd transaction, takes back the lease of a pod that went as one of those spares when no
// key is left on it, keeps every lease it holds alive on the client's single keep-alive
// stream (a lease it granted from its first due renewal on), and says when a lease is lost.
// It never renews a lease it did not grant or adopt.
type Keeper struct {
	cli     *clientv3.Client
	ttl     int64
	timeout time.Duration
	log     *slog.Logger
	onLost  func(clientv3.LeaseID)
	onHeard func(*pb.ResponseHeader)

	ctx    context.Context
	cancel context.CancelFunc

	spares     *spares    // the spare leases, held ones
	fresh      *fresh     // the held leases whose renewals start when due
	quarantine quarantine // the shared lease of quarantine keys, not held

	mu   sync.Mutex // taken after spares.mu, never before
	held map[clientv3.LeaseID]context.CancelFunc
}

// ErrLeaseLost is returned for an operation on a lease etcd no longer has.
var ErrLeaseLost = errors.New("lease lost")

// Config is what a Keeper needs.
type Config struct {
	// TTL of the leases it grants, rounded up to whole seconds; at least etcd's minimum of 2s.
	TTL time.Duration
	// Spares is how many pre-granted leases it keeps ready; 0 keeps none.
	Spares int
	// OpTimeout bounds each grant and revoke it runs on its own; default 10s.
	OpTimeout time.Duration
	// Log receives its diagnostics; nil discards them.
	Log *slog.Logger
	// OnLost, if not nil, is called (from the keeper's own goroutine) when a held lease stops
	// being renewed without Forget or Revoke.
	OnLost func(clientv3.LeaseID)
	// OnHeard, if not nil, is called with the header of each renewal etcd answers: the agent
	// knows from it, at no cost, that etcd answers (Agent.reachable), and whether etcd went
	// back in time (package etcdgate).
	OnHeard func(*pb.ResponseHeader)
}

// New starts a keeper granting leases as cfg says and keeping its spare leases ready.
// It returns an error wrapping allocator.ErrInvalidConfig for a TTL under etcd's minimum.
func New(cli *clientv3.Client, cfg Config) (*Keeper, error) {
	if cfg.TTL < MinTTL {
		return nil, fmt.Errorf("%w: lease TTL %s is shorter than etcd's minimum of %s", allocator.ErrInvalidConfig, cfg.TTL, MinTTL)
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = defaultOpTimeout
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	k := &Keeper{
		cli:     cli,
		ttl:     int64(math.Ceil(cfg.TTL.Seconds())),
		timeout: cfg.OpTimeout,
		log:     cfg.Log,
		onLost:  cfg.OnLost,
		onHeard: cfg.OnHeard,
		ctx:     ctx,
		cancel:  cancel,
		held:    make(map[clientv3.LeaseID]context.CancelFunc),
	}
	k.quarantine.grant = func(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
		return k.cli.Grant(ctx, ttl)
	}
	k.fresh = &fresh{register: k.register, ctx: ctx, kick: make(chan struct{}, 1)}
	k.spares = &spares{
		n: max(cfg.Spares, 0), ttl: k.ttl, timeout: cfg.OpTimeout, log: cfg.Log, ctx: ctx,
		grant: k.grant, holds: k.Holds, revoke: k.Revoke, revokeQuietly: k.RevokeQuietly,
		attached: func(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseTimeToLiveResponse, error) {
			return k.cli.TimeToLive(ctx, id, clientv3.WithAttachedKeys())
		},
		refill:   make(chan struct{}, 1),
		recycled: make(map[clientv3.LeaseID]bool),
	}
	k.spares.start()
	k.fresh.start()
	return k, nil
}

// Adopt resumes keep-alive of a lease this node identity granted earlier (agent restart).
// It returns ErrLeaseLost if etcd no longer has the lease.
func (k *Keeper) Adopt(ctx context.Context, id clientv3.LeaseID) error {
	_, err := k.AdoptTTL(ctx, id)
	return err
}

// AdoptTTL is Adopt, returning the TTL the lease was granted with.
func (k *Keeper) AdoptTTL(ctx context.Context, id clientv3.LeaseID) (time.Duration, error) {
	resp, err := k.cli.TimeToLive(ctx, id)
	if err != nil {
		return 0, fmt.Errorf("adopt lease %s: %w", keyspace.LeaseHex(id), err)
	}
	if resp.TTL <= 0 {
		return 0, fmt.Errorf("adopt lease %s: %w", keyspace.LeaseHex(id), ErrLeaseLost)
	}
	return time.Duration(resp.GrantedTTL) * time.Second, k.keepAlive(id)
}

// GrantKept grants a lease of its own TTL, not a pod lease's, and keeps it alive like every
// lease it holds (the block lease: leases/blocks.go).
func (k *Keeper) GrantKept(ctx context.Context, ttl time.Duration) (clientv3.LeaseID, error) {
	secs := int64(math.Ceil(ttl.Seconds()))
	resp, err := k.cli.Grant(ctx, secs)
	if err != nil {
		return 0, fmt.Errorf("grant lease (ttl %ds): %w", secs, err)
	}
	k.keepAliveLater(resp.ID, time.Duration(resp.TTL)*time.Second)
	return resp.ID, nil
}

// Resume keeps renewing a lease this node identity granted earlier without asking etcd
// first: if the lease is gone, the first keep-alive answer says so and the lease is
// reported lost. An agent restarting with thousands of pods resumes them all at once.
func (k *Keeper) Resume(id clientv3.LeaseID) error { return k.keepAlive(id) }

// RenewNow renews ids at once, pipelined on a keep-alive stream of its own. The client's
// keep-alive loop sends a resumed lease's first renewal on its next 500 ms tick; an agent
// restarting with thousands of pods calls this so that every pod lease is renewed before it
// serves. It returns the leases etcd no longer has (their keep-alives report them lost).
func (k *Keeper) RenewNow(ctx context.Context, ids []clientv3.LeaseID) (gone []clientv3.LeaseID, err error) {
	if len(ids) == 0 {
		return nil, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := pb.NewLeaseClient(k.cli.ActiveConnection()).LeaseKeepAlive(ctx)
	if err != nil {
		return nil, fmt.Errorf("open a keep-alive stream: %w", err)
	}
	sent := make(chan error, 1)
	go func() {
		for _, id := range ids {
			if err := stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
				sent <- err
				return
			}
		}
		sent <- stream.CloseSend()
	}()
	for range ids {
		resp, err := stream.Recv()
		if err != nil {
			return gone, fmt.Errorf("renew %d leases: %w", len(ids), err)
		}
		if k.onHeard != nil {
			k.onHeard(resp.Header)
		}
		if resp.TTL <= 0 {
			gone = append(gone, clientv3.LeaseID(resp.ID))
		}
	}
	return gone, <-sent
}

// Holds reports whether the keeper keeps id alive.
func (k *Keeper) Holds(id clientv3.LeaseID) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, ok := k.held[id]
	return ok
}

// Held is how many leases the keeper keeps alive, spares included.
func (k *Keeper) Held() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.held)
}

// Forget stops renewing id without revoking it: its keys live until the TTL runs out.
func (k *Keeper) Forget(id clientv3.LeaseID) {
	k.mu.Lock()
	if cancel, ok := k.held[id]; ok {
		cancel()
		delete(k.held, id)
	}
	k.mu.Unlock()
	k.spares.forget(id)
}

// Revoke stops renewing id and revokes it, deleting every key written with it. The revoke
// runs on its own bounded context, so a caller's cancelled context cannot leave it half done.
// Revoking a lease etcd no longer has is not an error.
func (k *Keeper) Revoke(id clientv3.LeaseID) error {
	k.Forget(id)
	ctx, cancel := context.WithTimeout(context.Background(), k.timeout)
	defer cancel()
	if _, err := k.cli.Revoke(ctx, id); err != nil && !keyspace.IsLeaseNotFound(err) {
		return fmt.Errorf("revoke lease %s: %w", keyspace.LeaseHex(id), err)
	}
	return nil
}

// QuarantineLease returns a lease for quarantine keys that lives at least d from now and at
// most d plus a small window: one grant serves every release within the window.
func (k *Keeper) QuarantineLease(ctx context.Context, d time.Duration) (clientv3.LeaseID, time.Time, error) {
	return k.quarantine.lease(ctx, d)
}

// Close stops the keeper: spare leases are revoked, every other lease stops being renewed
// and lives out its TTL, so a restarted agent can adopt it.
func (k *Keeper) Close() {
	k.cancel()
	k.spares.wg.Wait()
	k.fresh.wg.Wait()
	for _, id := range k.spares.takeAll() {
		k.RevokeQuietly(id)
	}
	k.mu.Lock()
	for id, cancel := range k.held {
		cancel()
		delete(k.held, id)
	}
	k.mu.Unlock()
}

// HeldLeases lists the leases the keeper renews, its spares included.
func (k *Keeper) HeldLeases() []clientv3.LeaseID {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Collect(maps.Keys(k.held))
}

// MarkLost is what the keeper does when a held lease's renewal stops: id is forgotten and
// OnLost called, for a caller that learned from etcd that id is gone before its keep-alive
// said so.
func (k *Keeper) MarkLost(id clientv3.LeaseID) { k.lost(id) }

// Abandon stops the keeper as the process's death would: its goroutines and every renewal
// end, and nothing is revoked, so that etcd expires each lease a TTL after its last renewal.
// The agent's tests use it for a kill -9.
func (k *Keeper) Abandon() {
	k.cancel()
	k.spares.wg.Wait()
	k.fresh.wg.Wait()
	k.spares.takeAll()
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, stop := range k.held {
		stop()
		delete(k.held, id)
	}
}

// The spare leases (spares.go): granted ahead so that an ADD of a new pod costs one
// transaction (Take, Return, Refill), and a gone pod's keyless lease taken back as one
// (Recycle), checked for keys a restore put back on it (CheckRecycled, DropSpares).

// Take returns a kept-alive lease for a new pod: a spare one if ready, else a fresh grant.
// The caller either binds it to keys or gives it back with Return, and calls Refill once
// its own transaction is done. Taking a spare does not start the refill: a grant proposed
// just before the caller's claim would make the claim wait for a second WAL fsync.
func (k *Keeper) Take(ctx context.Context) (clientv3.LeaseID, error) { return k.spares.take(ctx) }

// Refill tops the spare leases up in the background once half of them or more are taken.
func (k *Keeper) Refill() { k.spares.kick() }

// Return gives back a lease from Take that no key was written with. It is a spare again as
// a recycled one is (Recycle): once etcd lists no key on it. A lease taken before etcd went
// back in time may carry keys the restore put back on it (a deleted pod's, recycled since),
// and one returned after DropSpares would otherwise be handed out again with them.
func (k *Keeper) Return(id clientv3.LeaseID) { k.spares.giveBack(id) }

// Recycle gives up a held lease whose pod is gone. A lease etcd says has no key left on it
// and more than half its TTL to live goes back to the spares, if there is room, for the next
// new pod: that pod then needs no grant, and this one no revoke. Any other lease is revoked,
// deleting every key still on it. Recycle reports whether the lease became a spare; an error
// is the revoke's.
func (k *Keeper) Recycle(ctx context.Context, id clientv3.LeaseID) (bool, error) {
	return k.spares.recycle(ctx, id)
}

// CheckRecycled asks etcd for the keys on each spare that carried a pod's keys before, and
// revokes one that has any: an etcd restored from a backup taken while its pod lived has them
// again, and a new pod on it would keep them alive. Spares granted fresh have no past.
func (k *Keeper) CheckRecycled(ctx context.Context) error { return k.spares.checkRecycled(ctx) }

// DropSpares revokes every spare lease, in the background, and grants new ones: after etcd
// went back in time a spare may carry keys the backup had on it (a pod lease recycled since),
// which a pod taking it would keep alive.
func (k *Keeper) DropSpares() { k.spares.drop() }

// Spares lists the spare leases ready now.
func (k *Keeper) Spares() []clientv3.LeaseID { return k.spares.list() }
