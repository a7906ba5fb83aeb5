package keeper

import (
	"context"
	"fmt"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// The spare leases: granted ahead so that an ADD of a new pod costs one transaction (Take,
// Return, Refill), and a gone pod's keyless lease taken back as one (Recycle), checked for
// keys a restore put back on it (CheckRecycled, DropSpares).

// Take returns a kept-alive lease for a new pod: a spare one if ready, else a fresh grant.
// The caller either binds it to keys or gives it back with Return, and calls Refill once
// its own transaction is done. Taking a spare does not start the refill: a grant proposed
// just before the caller's claim would make the claim wait for a second WAL fsync.
func (k *Keeper) Take(ctx context.Context) (clientv3.LeaseID, error) {
	k.mu.Lock()
	if n := len(k.spare); n > 0 {
		id := k.spare[n-1]
		k.spare = k.spare[:n-1]
		delete(k.recycled, id)
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
// an ADD's claim runs in etcd while the plugin process exits, and slows that exit. Grants
// sent together also share etcd's WAL writes.
func (k *Keeper) lowWater() int { return k.spareN / 2 }

// Return gives back a lease from Take that no key was written with. It is a spare again as
// a recycled one is (Recycle): once etcd lists no key on it. A lease taken before etcd went
// back in time may carry keys the restore put back on it (a deleted pod's, recycled since),
// and one returned after DropSpares would otherwise be handed out again with them.
func (k *Keeper) Return(id clientv3.LeaseID) {
	go func() {
		ctx, cancel := context.WithTimeout(k.ctx, k.timeout)
		defer cancel()
		if _, err := k.Recycle(ctx, id); err != nil {
			k.log.Debug("revoke a returned lease", "lease", keyspace.LeaseHex(id), "err", err)
		}
	}()
}

// Recycle gives up a held lease whose pod is gone. A lease etcd says has no key left on it
// and more than half its TTL to live goes back to the spares, if there is room, for the next
// new pod: that pod then needs no grant, and this one no revoke. Any other lease is revoked,
// deleting every key still on it. Recycle reports whether the lease became a spare; an error
// is the revoke's.
func (k *Keeper) Recycle(ctx context.Context, id clientv3.LeaseID) (bool, error) {
	if k.room(id) { // else no need to ask etcd
		if resp, err := k.cli.TimeToLive(ctx, id, clientv3.WithAttachedKeys()); err == nil && len(resp.Keys) == 0 && 2*resp.TTL > k.ttl && k.spareAgain(id) {
			k.mu.Lock()
			k.recycled[id] = true
			k.mu.Unlock()
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

// CheckRecycled asks etcd for the keys on each spare that carried a pod's keys before, and
// revokes one that has any: an etcd restored from a backup taken while its pod lived has them
// again, and a new pod on it would keep them alive. Spares granted fresh have no past.
func (k *Keeper) CheckRecycled(ctx context.Context) error {
	k.mu.Lock()
	ids := make([]clientv3.LeaseID, 0, len(k.recycled))
	for id := range k.recycled {
		ids = append(ids, id)
	}
	k.mu.Unlock()
	for _, id := range ids {
		resp, err := k.cli.TimeToLive(ctx, id, clientv3.WithAttachedKeys())
		if err != nil {
			return fmt.Errorf("list the keys of spare lease %s: %w", keyspace.LeaseHex(id), err)
		}
		if len(resp.Keys) == 0 {
			continue
		}
		k.mu.Lock()
		i := slices.Index(k.spare, id)
		if i >= 0 {
			k.spare = slices.Delete(k.spare, i, i+1)
		}
		delete(k.recycled, id)
		k.mu.Unlock()
		if i >= 0 {
			k.log.Warn("a spare lease carries keys of a pod deleted before (etcd restored from a backup); revoking it",
				"lease", keyspace.LeaseHex(id), "keys", len(resp.Keys))
			k.RevokeQuietly(id)
			k.kick()
		}
	}
	return nil
}

// DropSpares revokes every spare lease, in the background, and grants new ones: after etcd
// went back in time a spare may carry keys the backup had on it (a pod lease recycled since),
// which a pod taking it would keep alive.
func (k *Keeper) DropSpares() {
	k.mu.Lock()
	spare := k.spare
	k.spare = nil
	clear(k.recycled)
	k.mu.Unlock()
	go func() {
		for _, id := range spare {
			k.RevokeQuietly(id)
		}
	}()
	k.kick()
}

// Spares lists the spare leases ready now.
func (k *Keeper) Spares() []clientv3.LeaseID {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.spare)
}
