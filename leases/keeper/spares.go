package keeper

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// spares are the leases granted ahead so that an ADD of a new pod costs one transaction
// (take), and a gone pod's keyless lease taken back as one (recycle), checked for keys a
// restore put back on it (checkRecycled, drop). They own their mutex and the refill
// goroutine; they ask the keeper, through the funcs New wires in, to grant a lease it keeps
// alive, whether it holds a lease, and to revoke one. Every spare is a lease the keeper
// holds: the keeper drops a lost one from them (lost).
type spares struct {
	n       int   // how many to keep ready
	ttl     int64 // of the keeper's leases, in seconds
	timeout time.Duration
	log     *slog.Logger
	ctx     context.Context // the keeper's life: the refill and a return end with it
	wg      sync.WaitGroup

	grant         func(context.Context) (clientv3.LeaseID, error) // a held lease, renewed when due
	holds         func(clientv3.LeaseID) bool                     // called with mu held
	revoke        func(clientv3.LeaseID) error
	revokeQuietly func(clientv3.LeaseID)
	attached      func(context.Context, clientv3.LeaseID) (*clientv3.LeaseTimeToLiveResponse, error) // its keys and TTL
	refill        chan struct{}

	mu  sync.Mutex
	ids []clientv3.LeaseID
	// recycled are the spares that carried a pod's keys before (recycle): a backup restored
	// since may have put those keys back (checkRecycled).
	recycled map[clientv3.LeaseID]bool
}

// start starts the refill goroutine and a first refill.
func (s *spares) start() {
	s.wg.Go(s.refillLoop)
	s.kick()
}

// take pops a spare if one is ready, else grants a lease; see Keeper.Take.
func (s *spares) take(ctx context.Context) (clientv3.LeaseID, error) {
	s.mu.Lock()
	if n := len(s.ids); n > 0 {
		id := s.ids[n-1]
		s.ids = s.ids[:n-1]
		delete(s.recycled, id)
		s.mu.Unlock()
		return id, nil
	}
	s.mu.Unlock()
	s.kick()
	return s.grant(ctx)
}

// lowWater is the number of spares at or below which the refill loop tops them up. Refilling
// only then, and then all at once, takes the grant off most ADDs: a grant sent right after
// an ADD's claim runs in etcd while the plugin process exits, and slows that exit. Grants
// sent together also share etcd's WAL writes.
func (s *spares) lowWater() int { return s.n / 2 }

// giveBack recycles a lease from take in the background; see Keeper.Return.
func (s *spares) giveBack(id clientv3.LeaseID) {
	go func() {
		ctx, cancel := context.WithTimeout(s.ctx, s.timeout)
		defer cancel()
		if _, err := s.recycle(ctx, id); err != nil {
			s.log.Debug("revoke a returned lease", "lease", keyspace.LeaseHex(id), "err", err)
		}
	}()
}

// recycle makes the held lease id a spare if etcd lists no key on it and it has more than
// half its TTL to live, and there is room; else it revokes it. See Keeper.Recycle.
func (s *spares) recycle(ctx context.Context, id clientv3.LeaseID) (bool, error) {
	if s.room(id) { // else no need to ask etcd
		if resp, err := s.attached(ctx, id); err == nil && len(resp.Keys) == 0 && 2*resp.TTL > s.ttl && s.spareAgain(id) {
			s.mu.Lock()
			s.recycled[id] = true
			s.mu.Unlock()
			return true, nil
		}
	}
	return false, s.revoke(id)
}

// room tells whether the held lease id could become a spare now.
func (s *spares) room(id clientv3.LeaseID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.roomLocked(id)
}

// spareAgain makes the held lease id a spare if there is room, and tells whether it is one.
func (s *spares) spareAgain(id clientv3.LeaseID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if slices.Contains(s.ids, id) {
		return true
	}
	if !s.roomLocked(id) {
		return false
	}
	s.ids = append(s.ids, id)
	return true
}

// roomLocked tells whether the held lease id, not a spare, could become one. The caller
// holds mu: the keeper's lock, taken by holds, comes after it, so that a lease the keeper
// loses meanwhile is dropped from the spares (lost) after it became one, never before.
func (s *spares) roomLocked(id clientv3.LeaseID) bool {
	return s.holds(id) && len(s.ids) < s.n && !slices.Contains(s.ids, id)
}

// checkRecycled revokes each recycled spare etcd lists keys on; see Keeper.CheckRecycled.
func (s *spares) checkRecycled(ctx context.Context) error {
	s.mu.Lock()
	ids := make([]clientv3.LeaseID, 0, len(s.recycled))
	for id := range s.recycled {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	for _, id := range ids {
		resp, err := s.attached(ctx, id)
		if err != nil {
			return fmt.Errorf("list the keys of spare lease %s: %w", keyspace.LeaseHex(id), err)
		}
		if len(resp.Keys) == 0 {
			continue
		}
		s.mu.Lock()
		i := slices.Index(s.ids, id)
		if i >= 0 {
			s.ids = slices.Delete(s.ids, i, i+1)
		}
		delete(s.recycled, id)
		s.mu.Unlock()
		if i >= 0 {
			s.log.Warn("a spare lease carries keys of a pod deleted before (etcd restored from a backup); revoking it",
				"lease", keyspace.LeaseHex(id), "keys", len(resp.Keys))
			s.revokeQuietly(id)
			s.kick()
		}
	}
	return nil
}

// drop revokes every spare in the background and grants new ones; see Keeper.DropSpares.
func (s *spares) drop() {
	s.mu.Lock()
	spare := s.ids
	s.ids = nil
	clear(s.recycled)
	s.mu.Unlock()
	go func() {
		for _, id := range spare {
			s.revokeQuietly(id)
		}
	}()
	s.kick()
}

// takeAll empties the spares and returns them (Keeper.Close, Keeper.Abandon).
func (s *spares) takeAll() []clientv3.LeaseID {
	s.mu.Lock()
	defer s.mu.Unlock()
	spare := s.ids
	s.ids = nil
	return spare
}

// list lists the spares ready now.
func (s *spares) list() []clientv3.LeaseID {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.ids)
}

// forget forgets that id was recycled: the keeper no longer holds it (Keeper.Forget).
func (s *spares) forget(id clientv3.LeaseID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.recycled, id)
}

// lost drops id, whose renewals stopped, from the spares (Keeper.lost).
func (s *spares) lost(id clientv3.LeaseID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.recycled, id)
	if i := slices.Index(s.ids, id); i >= 0 {
		s.ids = slices.Delete(s.ids, i, i+1)
	}
}

const (
	// refillRetryFirst and refillRetryMax bound the wait between refills etcd refused.
	refillRetryFirst = 100 * time.Millisecond
	refillRetryMax   = 5 * time.Second
)

// refillBatch is how many grants the refill loop runs at once: under a burst of new pods
// the spares run out, and one grant at a time would leave every ADD granting inline.
const refillBatch = 8

// refillLoop tops the spares up, a batch of grants at a time, whenever kicked with no more
// than lowWater of them left, until the keeper's context ends.
func (s *spares) refillLoop() {
	backoff := refillRetryFirst
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-s.refill:
		}
		s.mu.Lock()
		low := len(s.ids) <= s.lowWater()
		s.mu.Unlock()
		for low {
			s.mu.Lock()
			need := min(s.n-len(s.ids), refillBatch)
			s.mu.Unlock()
			if need <= 0 {
				break
			}
			var wg sync.WaitGroup
			var failed atomic.Bool
			for range need {
				wg.Go(func() {
					ctx, cancel := context.WithTimeout(s.ctx, s.timeout)
					defer cancel()
					id, err := s.grant(ctx)
					if err != nil {
						failed.Store(true)
						if s.ctx.Err() == nil {
							s.log.Debug("pre-grant lease failed", "err", err, "retry_in", backoff)
						}
						return
					}
					s.mu.Lock()
					s.ids = append(s.ids, id)
					s.mu.Unlock()
				})
			}
			wg.Wait()
			if s.ctx.Err() != nil {
				return
			}
			if failed.Load() {
				select {
				case <-s.ctx.Done():
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

// kick asks the refill loop to look at the spares.
func (s *spares) kick() {
	select {
	case s.refill <- struct{}{}:
	default:
	}
}
