package keeper

import (
	"context"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// keepAliveTick is how often the client's keep-alive loop sends due renewals: a lease
// registered with it is renewed within one tick.
const keepAliveTick = 500 * time.Millisecond

// fresh are the leases the keeper granted whose renewals have not started: a lease is
// granted with its whole TTL, so the client's keep-alive, which renews at once on
// registration, is registered only when its first renewal is due (Keeper.keepAliveLater).
// They own their mutex and the goroutine that starts renewals when due, which it does
// through the func New wires in (Keeper.register), with no lock held.
type fresh struct {
	register func(context.Context, clientv3.LeaseID) // starts a held lease's renewals
	ctx      context.Context                         // the keeper's life
	wg       sync.WaitGroup
	kick     chan struct{}

	mu     sync.Mutex
	leases []freshLease // in due order
}

// freshLease is a granted lease whose keep-alive starts at due.
type freshLease struct {
	id  clientv3.LeaseID
	ctx context.Context
	due time.Time
}

// start starts the goroutine that registers fresh leases when due.
func (f *fresh) start() { f.wg.Go(f.loop) }

// add registers id's keep-alive, on ctx, at due, unless ctx ends first (the lease was
// forgotten, revoked or lost meanwhile).
func (f *fresh) add(id clientv3.LeaseID, ctx context.Context, due time.Time) {
	f.mu.Lock()
	// In due order: pod leases are granted with one TTL, in grant order; a block lease's is
	// longer (GrantKept).
	i, _ := slices.BinarySearchFunc(f.leases, due, func(l freshLease, t time.Time) int { return l.due.Compare(t) })
	f.leases = slices.Insert(f.leases, i, freshLease{id: id, ctx: ctx, due: due})
	f.mu.Unlock()
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// loop registers the keep-alive of each fresh lease when it is due, unless the lease was
// forgotten or revoked meanwhile, until the keeper's context ends.
func (f *fresh) loop() {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := time.Now()
		f.mu.Lock()
		var due []freshLease
		for len(f.leases) > 0 && !f.leases[0].due.After(now) {
			due = append(due, f.leases[0])
			f.leases = f.leases[1:]
		}
		wait := time.Hour
		if len(f.leases) > 0 {
			wait = f.leases[0].due.Sub(now)
		}
		f.mu.Unlock()
		for _, l := range due {
			if l.ctx.Err() == nil {
				f.register(l.ctx, l.id)
			}
		}
		timer.Reset(wait)
		select {
		case <-f.ctx.Done():
			return
		case <-f.kick:
		case <-timer.C:
		}
	}
}
