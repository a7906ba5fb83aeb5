// Package keeper keeps the agent's etcd leases alive: the pods', the blocks' and the sticky
// claims'. It is one part of the agent (docs/agent.md): it owns its goroutines (the refill of
// spare leases and the start of due renewals) and its lock, and tells its owner of a lost
// lease and of each renewal etcd answered through the callbacks it is given at start.
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

const (
	// defaultOpTimeout bounds a grant or revoke when Config.OpTimeout is not set.
	defaultOpTimeout = 10 * time.Second
	// refillRetryFirst and refillRetryMax bound the wait between refills etcd refused.
	refillRetryFirst = 100 * time.Millisecond
	refillRetryMax   = 5 * time.Second
)

// Keeper owns the agent's leases: it pre-grants a few so that an ADD for a new pod costs one
// etcd transaction, takes back the lease of a pod that went as one of those spares when no
// key is left on it, keeps every lease it holds alive on the client's single keep-alive
// stream (a lease it granted from its first due renewal on), and says when a lease is lost.
// It never renews a lease it did not grant or adopt.
type Keeper struct {
	cli     *clientv3.Client
	ttl     int64
	spareN  int
	timeout time.Duration
	log     *slog.Logger
	onLost  func(clientv3.LeaseID)
	onHeard func(*pb.ResponseHeader)

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	refill chan struct{}

	mu    sync.Mutex
	spare []clientv3.LeaseID
	// recycled are the spares that carried a pod's keys before (Recycle): a backup restored
	// since may have put those keys back (CheckRecycled).
	recycled map[clientv3.LeaseID]bool
	held     map[clientv3.LeaseID]context.CancelFunc
	// fresh are leases this keeper granted whose renewals have not started: a lease is
	// granted with its whole TTL, so the client's keep-alive, which renews at once on
	// registration, is registered only when its first renewal is due (see keepAliveLater).
	// In due order.
	fresh     []freshLease
	freshKick chan struct{}

	qmu      sync.Mutex
	qLease   clientv3.LeaseID
	qExpires time.Time
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
		cli:      cli,
		ttl:      int64(math.Ceil(cfg.TTL.Seconds())),
		spareN:   max(cfg.Spares, 0),
		timeout:  cfg.OpTimeout,
		log:      cfg.Log,
		onLost:   cfg.OnLost,
		onHeard:  cfg.OnHeard,
		ctx:      ctx,
		cancel:   cancel,
		refill:   make(chan struct{}, 1),
		held:     make(map[clientv3.LeaseID]context.CancelFunc),
		recycled: make(map[clientv3.LeaseID]bool),

		freshKick: make(chan struct{}, 1),
	}
	k.wg.Add(2)
	go k.refillLoop()
	go k.freshLoop()
	k.kick()
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
	defer k.mu.Unlock()
	if cancel, ok := k.held[id]; ok {
		cancel()
		delete(k.held, id)
	}
	delete(k.recycled, id)
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
	window := max(d/10, time.Second)
	now := time.Now()
	k.qmu.Lock()
	defer k.qmu.Unlock()
	if k.qLease != 0 && now.Add(d).Before(k.qExpires) {
		return k.qLease, now.Add(d), nil
	}
	ttl := int64(math.Ceil((d + window).Seconds()))
	resp, err := k.cli.Grant(ctx, ttl)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("grant quarantine lease: %w", err)
	}
	k.qLease = resp.ID
	// etcd may have raised a too-short TTL to its minimum; it never lowers it.
	k.qExpires = now.Add(time.Duration(resp.TTL) * time.Second)
	return k.qLease, now.Add(d), nil
}

// Close stops the keeper: spare leases are revoked, every other lease stops being renewed
// and lives out its TTL, so a restarted agent can adopt it.
func (k *Keeper) Close() {
	k.cancel()
	k.wg.Wait()
	k.mu.Lock()
	spare := k.spare
	k.spare = nil
	k.mu.Unlock()
	for _, id := range spare {
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
	k.wg.Wait()
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, stop := range k.held {
		stop()
		delete(k.held, id)
	}
	k.spare = nil
}
