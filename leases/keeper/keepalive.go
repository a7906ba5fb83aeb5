package keeper

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// How the Keeper renews the leases it holds and keeps its spares topped up.

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
// TTL left: a request for etcd per new pod, in the middle of a burst of them. Until then the
// lease is held as any other: Holds, Forget and Revoke work on it. etcd keeps a lease for its TTL (a new leader only extends it); one
// revoked from outside meanwhile is found lost at registration, within a third of the TTL,
// as a renewed lease is found at its next renewal.
func (k *Keeper) keepAliveLater(id clientv3.LeaseID, ttl time.Duration) {
	ctx, cancel := context.WithCancel(k.ctx)
	due := time.Now().Add(ttl/3 - keepAliveTick)
	k.mu.Lock()
	k.held[id] = cancel
	// In due order: pod leases are granted with one TTL, in grant order; a block lease's is
	// longer (GrantKept).
	i, _ := slices.BinarySearchFunc(k.fresh, due, func(f freshLease, t time.Time) int { return f.due.Compare(t) })
	k.fresh = slices.Insert(k.fresh, i, freshLease{id: id, ctx: ctx, due: due})
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
// was forgotten or revoked meanwhile.
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
		k.Forget(id)
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
// the keep-alive was cancelled, and also when an answer is late: the client gives up on a
// lease whose first renewal is not answered within its dial timeout plus a second, and on
// one not answered within the TTL since the last answer. The second is the lease's end
// (etcd expires it then too) and is reported lost at once. The first happens to a live
// lease when etcd is slow (thousands of nodes starting at once), and taking it for lost
// would make the agent re-claim its pods under new leases, adding to etcd's load: so an early
// close asks etcd how long the lease has left, and renews it again if it is alive.
func (k *Keeper) drain(ctx context.Context, id clientv3.LeaseID, ch <-chan *clientv3.LeaseKeepAliveResponse) {
	for {
		var heard time.Time
		var ttl time.Duration
		for resp := range ch {
			heard, ttl = time.Now(), time.Duration(resp.TTL)*time.Second
			if k.onHeard != nil {
				k.onHeard(resp.ResponseHeader)
			}
		}
		if ctx.Err() != nil {
			return
		}
		early := heard.IsZero() || time.Since(heard) < ttl
		if !early || !k.alive(ctx, id) {
			k.lost(id)
			return
		}
		k.log.Info("a lease's renewal was answered late; etcd still has it, so it is renewed again", "lease", keyspace.LeaseHex(id))
		var err error
		if ch, err = k.cli.KeepAlive(ctx, id); err != nil {
			if ctx.Err() == nil {
				k.lost(id)
			}
			return
		}
	}
}

// alive asks etcd whether it still has lease id, within the keeper's operation timeout; no
// answer counts as no.
func (k *Keeper) alive(ctx context.Context, id clientv3.LeaseID) bool {
	c, cancel := context.WithTimeout(ctx, k.timeout)
	defer cancel()
	resp, err := k.cli.TimeToLive(c, id)
	return err == nil && resp.TTL > 0
}

// lost forgets a held lease whose renewals stopped without Forget or Revoke, and reports it.
// Its keep-alive ends with it, as Forget's does: a lease forgotten while its renewals are
// still registered, or not yet (a fresh one), would be renewed with nobody holding it if etcd
// had it again (a backup restored).
func (k *Keeper) lost(id clientv3.LeaseID) {
	k.mu.Lock()
	cancel, ours := k.held[id]
	if ours {
		cancel()
	}
	delete(k.held, id)
	delete(k.recycled, id)
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
	backoff := refillRetryFirst
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
					ctx, cancel := context.WithTimeout(k.ctx, k.timeout)
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
				backoff = min(2*backoff, refillRetryMax)
				continue
			}
			backoff = refillRetryFirst
		}
	}
}

func (k *Keeper) kick() {
	select {
	case k.refill <- struct{}{}:
	default:
	}
}

// RevokeQuietly revokes id, logging a failure at debug level: for a lease that carries
// nothing, which expires by itself anyway.
func (k *Keeper) RevokeQuietly(id clientv3.LeaseID) {
	if err := k.Revoke(id); err != nil {
		k.log.Debug("revoke unused lease", "lease", keyspace.LeaseHex(id), "err", err)
	}
}
