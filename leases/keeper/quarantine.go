package keeper

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// quarantine is the shared lease of quarantine keys (Keeper.QuarantineLease). It owns its
// mutex, which it holds across its grant so that concurrent releases share one; it takes no
// other lock. The lease is not renewed: it lives out its TTL.
type quarantine struct {
	grant func(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error)

	mu      sync.Mutex
	id      clientv3.LeaseID
	expires time.Time
}

// lease returns a lease that lives at least d from now and at most d plus a small window,
// granting a new one when the current one would not; see Keeper.QuarantineLease.
func (q *quarantine) lease(ctx context.Context, d time.Duration) (clientv3.LeaseID, time.Time, error) {
	window := max(d/10, time.Second)
	now := time.Now()
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.id != 0 && now.Add(d).Before(q.expires) {
		return q.id, now.Add(d), nil
	}
	ttl := int64(math.Ceil((d + window).Seconds()))
	resp, err := q.grant(ctx, ttl)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("grant quarantine lease: %w", err)
	}
	q.id = resp.ID
	// etcd may have raised a too-short TTL to its minimum; it never lowers it.
	q.expires = now.Add(time.Duration(resp.TTL) * time.Second)
	return q.id, now.Add(d), nil
}
