package keeper

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// How the Keeper renews the leases it holds.

func (k *Keeper) grant(ctx context.Context) (clientv3.LeaseID, error) {
	resp, err := k.cli.Grant(ctx, k.ttl)
	if err != nil {
		return 0, fmt.Errorf("grant lease (ttl %ds): %w", k.ttl, err)
	}
	k.keepAliveLater(resp.ID, time.Duration(resp.TTL)*time.Second)
	return resp.ID, nil
}

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
	k.mu.Unlock()
	k.fresh.add(id, ctx, due)
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
	k.mu.Unlock()
	k.spares.lost(id)
	if !ours {
		return
	}
	k.log.Warn("lease stopped being renewed", "lease", keyspace.LeaseHex(id))
	if k.onLost != nil {
		k.onLost(id)
	}
}

// RevokeQuietly revokes id, logging a failure at debug level: for a lease that carries
// nothing, which expires by itself anyway.
func (k *Keeper) RevokeQuietly(id clientv3.LeaseID) {
	if err := k.Revoke(id); err != nil {
		k.log.Debug("revoke unused lease", "lease", keyspace.LeaseHex(id), "err", err)
	}
}
