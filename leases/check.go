package leases

import (
	"context"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Check verifies that the attachment's addresses are held in etcd by this owner and
// container, on a lease that is alive and that this agent keeps renewing, and that no address
// failed duplicate address detection in the sandbox (release.Releaser.Check). It returns the
// addresses.
//
// Errors wrap allocator.ErrNotAllocated (no allocation, another container holds it, or its
// lease is expiring), allocator.ErrConflict (an address is held by another owner), or
// allocator.ErrUnavailable.
func (a *Agent) Check(ctx context.Context, req allocator.Request) (_ allocator.Result, err error) {
	defer a.metrics.observe("check", time.Now(), &err)
	return a.release.Check(ctx, req)
}

// Status reports whether an ADD for the pool could succeed now: etcd answers and every
// range set has a free address in the agent's view. It costs no etcd call while the agent
// has heard from etcd recently.
//
// Errors wrap allocator.ErrUnavailable, ErrPoolExhausted, ErrPoolMismatch or ErrInvalidConfig.
func (a *Agent) Status(ctx context.Context, req allocator.StatusRequest) (err error) {
	defer a.metrics.observe("status", time.Now(), &err)
	if req.Pool.Name == "" {
		req.Pool.Name = req.Network
	}
	if len(req.Pool.Ranges) > 0 {
		if err := req.Pool.Canonicalize(); err != nil {
			return err
		}
	}
	if err := a.gate.Answers(ctx, keyspace.PoolKey(req.Pool.Name), probeAfter); err != nil {
		return fmt.Errorf("%w: %w", allocator.ErrUnavailable, err)
	}
	p, err := a.pools.Ensure(ctx, req.Pool)
	if err != nil {
		return err
	}
	p.Await(ctx)
	if err := p.View.Free(ctx, &p.Spec); err != nil {
		return fmt.Errorf("pool %q: %w", p.Spec.Name, err)
	}
	return nil
}
