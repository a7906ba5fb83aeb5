package leases

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/keyspace"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Keeper owns the agent's leases: it pre-grants a few so that an ADD for a new pod costs one
// etcd transaction, takes back the lease of a pod that went as one of those spares when no
// key is left on it, keeps every lease it holds alive on the client's single keep-alive
// stream (a lease it granted from its first due renewal on), and says when a lease is lost.
// It never renews a lease it did not grant or adopt.
type Keeper struct {
	cli    *clientv3.Client
	ttl    int64
	spareN int
	log    *slog.Logger
	onLost func(clientv3.LeaseID)

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	refill chan struct{}

	mu    sync.Mutex
	spare []clientv3.LeaseID
	held  map[clientv3.LeaseID]context.CancelFunc
	// fresh are leases this keeper granted whose renewals have not started: a lease is
	// granted with its whole TTL, so the client's keep-alive, which renews at once on
	// registration, is registered only when its first renewal is due (see keepAliveLater).
	// In grant order, which is due order.
	fresh     []freshLease
	freshKick chan struct{}

	qmu      sync.Mutex
	qLease   clientv3.LeaseID
	qExpires time.Time
}

// ErrLeaseLost is returned for an operation on a lease etcd no longer has.
var ErrLeaseLost = errors.New("lease lost")

// NewKeeper starts a keeper granting leases of ttl (rounded up to whole seconds) and keeping
// spare pre-granted leases ready. onLost, if not nil, is called (from the keeper's own
// goroutine) when a held lease stops being renewed without Release or Revoke.
func NewKeeper(cli *clientv3.Client, ttl time.Duration, spare int, log *slog.Logger, onLost func(clientv3.LeaseID)) *Keeper {
	ctx, cancel := context.WithCancel(context.Background())
	k := &Keeper{
		cli:    cli,
		ttl:    int64(math.Ceil(ttl.Seconds())),
		spareN: spare,
		log:    log,
		onLost: onLost,
		ctx:    ctx,
		cancel: cancel,
		refill: make(chan struct{}, 1),
		held:   make(map[clientv3.LeaseID]context.CancelFunc),

		freshKick: make(chan struct{}, 1),
	}
	k.wg.Add(2)
	go k.refillLoop()
	go k.freshLoop()
	k.kick()
	return k
}

// Take returns a kept-alive lease for a new pod: a spare one if ready, else a fresh grant.
// The caller either binds it to keys or gives it back with Return, and calls Refill once
// its own transaction is done. Taking a spare does not start the refill: a grant proposed
// just before the caller's claim would make the claim wait for a second WAL fsync (measured:
// the claim took 2.36 ms inside ADD against 1.22 ms replayed alone).
func (k *Keeper) Take(ctx context.Context) (clientv3.LeaseID, error) {
	k.mu.Lock()
	if n := len(k.spare); n > 0 {
		id := k.spare[n-1]
		k.spare = k.spare[:n-1]
		k.mu.Unlock()
		return id, nil
	}
	k.mu.Unlock()
	k.kick()
	return k.grant(ctx)
}

// Refill tops the spare leases up in the background once half of them or more are taken.
func (k *Keeper) Refill() { k.kick() }

// lowWater is the number of spares at or below which the refill loop tops them up. Refilling
// only then, and then all at once, takes the grant off most ADDs: a grant sent right after
// an ADD's claim runs in etcd while the plugin process exits, and on a 2-core machine it
// lengthened that exit from 0.44-0.60 ms (as after VERSION) to 0.66-1.05 ms. Grants sent
// together also share etcd's WAL writes.
func (k *Keeper) lowWater() int { return k.spareN / 2 }

// Return gives back a lease from Take that no key was written with.
func (k *Keeper) Return(id clientv3.LeaseID) {
	if !k.spareAgain(id) {
		go k.revokeQuietly(id)
	}
}

// Adopt resumes keep-alive of a lease this node identity granted earlier (agent restart).
// It returns ErrLeaseLost if etcd no longer has the lease.
func (k *Keeper) Adopt(ctx context.Context, id clientv3.LeaseID) error {
	resp, err := k.cli.TimeToLive(ctx, id)
	if err != nil {
		return fmt.Errorf("adopt lease %s: %w", keyspace.LeaseHex(id), err)
	}
	if resp.TTL <= 0 {
		return fmt.Errorf("adopt lease %s: %w", keyspace.LeaseHex(id), ErrLeaseLost)
	}
	return k.keepAlive(id)
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

// Release stops renewing id without revoking it: its keys live until the TTL runs out.
func (k *Keeper) Release(id clientv3.LeaseID) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if cancel, ok := k.held[id]; ok {
		cancel()
		delete(k.held, id)
	}
}

// Revoke stops renewing id and revokes it, deleting every key written with it. The revoke
// runs on its own bounded context, so a caller's cancelled context cannot leave it half done.
// Revoking a lease etcd no longer has is not an error.
func (k *Keeper) Revoke(id clientv3.LeaseID) error {
	k.Release(id)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := k.cli.Revoke(ctx, id); err != nil && !keyspace.IsLeaseNotFound(err) {
		return fmt.Errorf("revoke lease %s: %w", keyspace.LeaseHex(id), err)
	}
	return nil
}

// Recycle gives up a held lease whose pod is gone. A lease etcd says has no key left on it
// and more than half its TTL to live goes back to the spares, if there is room, for the next
// new pod: that pod then needs no grant, and this one no revoke. Any other lease is revoked,
// deleting every key still on it. Recycle reports whether the lease became a spare; an error
// is the revoke's.
func (k *Keeper) Recycle(ctx context.Context, id clientv3.LeaseID) (bool, error) {
	if k.room(id) { // else no need to ask etcd
		if resp, err := k.cli.TimeToLive(ctx, id, clientv3.WithAttachedKeys()); err == nil && len(resp.Keys) == 0 && 2*resp.TTL > k.ttl && k.spareAgain(id) {
			return true, nil
		}
	}
	return false, k.Revoke(id)
}

// room tells whether the held lease id could become a spare now.
func (k *Keeper) room(id clientv3.LeaseID) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.roomLocked(id)
}

// spareAgain makes the held lease id a spare if there is room, and tells whether it is one.
func (k *Keeper) spareAgain(id clientv3.LeaseID) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if slices.Contains(k.spare, id) {
		return true
	}
	if !k.roomLocked(id) {
		return false
	}
	k.spare = append(k.spare, id)
	return true
}

// roomLocked tells whether the held lease id, not a spare, could become one. The caller
// holds mu.
func (k *Keeper) roomLocked(id clientv3.LeaseID) bool {
	_, held := k.held[id]
	return held && len(k.spare) < k.spareN && !slices.Contains(k.spare, id)
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
		k.revokeQuietly(id)
	}
	k.mu.Lock()
	for id, cancel := range k.held {
		cancel()
		delete(k.held, id)
	}
	k.mu.Unlock()
}

func (k *Keeper) grant(ctx context.Context) (clientv3.LeaseID, error) {
	resp, err := k.cli.Grant(ctx, k.ttl)
	if err != nil {
		return 0, fmt.Errorf("grant lease (ttl %ds): %w", k.ttl, err)
	}
	k.keepAliveLater(resp.ID, time.Duration(resp.TTL)*time.Second)
	return resp.ID, nil
}

// keepAliveTick is how often the client's keep-alive loop sends due renewals: a lease
// registered with it is renewed within one tick.
const keepAliveTick = 500 * time.Millisecond

// keepAliveLater holds a lease granted just now with ttl and registers its keep-alive when
// its first renewal is due: a third of the TTL from now (the client's own interval), less
// one tick of the client's loop. Registering at once would renew a lease that has its whole
// TTL left: a request for etcd (54 µs of its CPU each, bench "parts" figure) per new pod, in
// the middle of a burst of them. Until then the lease is held as any other: Holds, Release
// and Revoke work on it. etcd keeps a lease for its TTL (a new leader only extends it); one
// revoked from outside meanwhile is found lost at registration, within a third of the TTL,
// as a renewed lease is found at its next renewal.
func (k *Keeper) keepAliveLater(id clientv3.LeaseID, ttl time.Duration) {
	ctx, cancel := context.WithCancel(k.ctx)
	due := time.Now().Add(ttl/3 - keepAliveTick)
	k.mu.Lock()
	k.held[id] = cancel
	k.fresh = append(k.fresh, freshLease{id: id, ctx: ctx, due: due})
	k.mu.Unlock()
	select {
	case k.freshKick <- struct{}{}:
	default:
	}
}

// freshLease is a granted lease whose keep-alive starts at due.
type freshLease struct {
	id  clientv3.LeaseID
	ctx context.Context
	due time.Time
}

// freshLoop registers the keep-alive of each fresh lease when it is due, unless the lease
// was released or revoked meanwhile.
func (k *Keeper) freshLoop() {
	defer k.wg.Done()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := time.Now()
		k.mu.Lock()
		var due []freshLease
		for len(k.fresh) > 0 && !k.fresh[0].due.After(now) {
			due = append(due, k.fresh[0])
			k.fresh = k.fresh[1:]
		}
		wait := time.Hour
		if len(k.fresh) > 0 {
			wait = k.fresh[0].due.Sub(now)
		}
		k.mu.Unlock()
		for _, f := range due {
			if f.ctx.Err() == nil {
				k.register(f.ctx, f.id)
			}
		}
		timer.Reset(wait)
		select {
		case <-k.ctx.Done():
			return
		case <-k.freshKick:
		case <-timer.C:
		}
	}
}

// keepAlive holds id and renews it from now on (a lease adopted or resumed after a restart).
func (k *Keeper) keepAlive(id clientv3.LeaseID) error {
	k.mu.Lock()
	if _, ok := k.held[id]; ok {
		k.mu.Unlock()
		return nil
	}
	ctx, cancel := context.WithCancel(k.ctx)
	k.held[id] = cancel
	k.mu.Unlock()
	ch, err := k.cli.KeepAlive(ctx, id)
	if err != nil {
		k.Release(id)
		return fmt.Errorf("keep lease %s alive: %w", keyspace.LeaseHex(id), err)
	}
	go k.drain(ctx, id, ch)
	return nil
}

// register starts renewing a held fresh lease. If the client cannot (it is closing), the
// lease is lost as if its renewals had stopped.
func (k *Keeper) register(ctx context.Context, id clientv3.LeaseID) {
	ch, err := k.cli.KeepAlive(ctx, id)
	if err != nil {
		if ctx.Err() == nil {
			k.log.Warn("cannot keep lease alive", "lease", keyspace.LeaseHex(id), "err", err)
			k.lost(id)
		}
		return
	}
	go k.drain(ctx, id, ch)
}

// drain consumes keep-alive responses; the channel closes when the lease is gone or
// the keep-alive was cancelled.
func (k *Keeper) drain(ctx context.Context, id clientv3.LeaseID, ch <-chan *clientv3.LeaseKeepAliveResponse) {
	for range ch {
	}
	if ctx.Err() != nil {
		return
	}
	k.lost(id)
}

// lost forgets a held lease whose renewals stopped without Release or Revoke, and reports it.
func (k *Keeper) lost(id clientv3.LeaseID) {
	k.mu.Lock()
	_, ours := k.held[id]
	delete(k.held, id)
	for i, s := range k.spare {
		if s == id {
			k.spare = append(k.spare[:i], k.spare[i+1:]...)
			break
		}
	}
	k.mu.Unlock()
	if !ours {
		return
	}
	k.log.Warn("lease stopped being renewed", "lease", keyspace.LeaseHex(id))
	if k.onLost != nil {
		k.onLost(id)
	}
}

// refillBatch is how many grants the refill loop runs at once: under a burst of new pods
// the spares run out, and one grant at a time would leave every ADD granting inline.
const refillBatch = 8

func (k *Keeper) refillLoop() {
	defer k.wg.Done()
	backoff := 100 * time.Millisecond
	for {
		select {
		case <-k.ctx.Done():
			return
		case <-k.refill:
		}
		k.mu.Lock()
		low := len(k.spare) <= k.lowWater()
		k.mu.Unlock()
		for low {
			k.mu.Lock()
			need := min(k.spareN-len(k.spare), refillBatch)
			k.mu.Unlock()
			if need <= 0 {
				break
			}
			var wg sync.WaitGroup
			var failed atomic.Bool
			for range need {
				wg.Go(func() {
					ctx, cancel := context.WithTimeout(k.ctx, 5*time.Second)
					defer cancel()
					id, err := k.grant(ctx)
					if err != nil {
						failed.Store(true)
						if k.ctx.Err() == nil {
							k.log.Debug("pre-grant lease failed", "err", err, "retry_in", backoff)
						}
						return
					}
					k.mu.Lock()
					k.spare = append(k.spare, id)
					k.mu.Unlock()
				})
			}
			wg.Wait()
			if k.ctx.Err() != nil {
				return
			}
			if failed.Load() {
				select {
				case <-k.ctx.Done():
					return
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, 5*time.Second)
				continue
			}
			backoff = 100 * time.Millisecond
		}
	}
}

func (k *Keeper) kick() {
	select {
	case k.refill <- struct{}{}:
	default:
	}
}

func (k *Keeper) revokeQuietly(id clientv3.LeaseID) {
	if err := k.Revoke(id); err != nil {
		k.log.Debug("revoke unused lease", "lease", keyspace.LeaseHex(id), "err", err)
	}
}
