package leases

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// pool is a pool definition this agent has checked against etcd, with its view. A pool
// value never changes; a re-read definition replaces it in the cache.
type pool struct {
	spec allocator.PoolSpec
	// rev is the ModRevision of the stored definition; every ADD compares it, so a
	// definition changed under the agent makes the ADD re-read it instead of using a stale one.
	rev  int64
	view *view
	// migrating is set while leaseholdctl pool migrate moves the pool to the block layout:
	// ADDs are refused until it finishes.
	migrating *keyspace.Migration
}

// pools caches the stored definitions of the pools this agent serves.
type pools struct {
	cli *clientv3.Client
	log *slog.Logger
	ctx context.Context // lives as long as the agent; views run on it
	// seed spreads this agent's candidate search over each range (see view.from).
	seed uint64

	// onMismatch, if set, records a refused definition where the pool's other users see it.
	onMismatch func(ctx context.Context, wanted, stored allocator.PoolSpec)
	// own claims this node's blocks in pools of the block layout.
	own *blockOwner
	// hooks are handed to every view (viewHooks).
	hooks viewHooks

	mu    sync.Mutex
	m     map[string]*pool
	stops map[string]context.CancelFunc // ends a view's run
}

func newPools(ctx context.Context, cli *clientv3.Client, log *slog.Logger, hooks viewHooks) *pools {
	return &pools{cli: cli, log: log, ctx: ctx, hooks: hooks, m: make(map[string]*pool), stops: make(map[string]context.CancelFunc)}
}

// ensure returns the stored definition of spec.Name, creating it from spec if no definition
// exists. A spec with no ranges refers to a stored definition by name. A spec that disagrees
// with the stored definition is refused with allocator.ErrPoolMismatch showing both.
func (ps *pools) ensure(ctx context.Context, spec allocator.PoolSpec) (*pool, error) {
	ps.mu.Lock()
	p, ok := ps.m[spec.Name]
	ps.mu.Unlock()
	if ok && p.rev > 0 && p.migrating == nil && (len(spec.Ranges) == 0 || p.spec.Equal(configured(spec, p.spec))) {
		return p, nil
	}
	stored, migrating, rev, err := ps.load(ctx, spec)
	if err != nil {
		return nil, err
	}
	if len(spec.Ranges) > 0 && !stored.Equal(configured(spec, stored)) {
		if ps.onMismatch != nil {
			ps.onMismatch(ctx, spec, stored)
		}
		return nil, fmt.Errorf("%w: pool %q is stored in etcd as %s, but this network's configuration says %s; "+
			"make the ranges match the stored definition, or name another pool with \"pool\" in the ipam configuration",
			allocator.ErrPoolMismatch, spec.Name, stored.String(), spec.String())
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if old, ok := ps.m[spec.Name]; ok && old.view.blocks == stored.Blocks {
		p = &pool{spec: stored, rev: rev, view: old.view, migrating: migrating}
	} else {
		if stop := ps.stops[spec.Name]; stop != nil {
			stop() // the pool's layout changed (pool migrate): follow it anew
		}
		vctx, stop := context.WithCancel(ps.ctx)
		p = &pool{spec: stored, rev: rev, migrating: migrating,
			view: newView(spec.Name, stored.Blocks, ps.cli, ps.log, ps.seed, ps.own, ps.hooks)}
		ps.stops[spec.Name] = stop
		go p.view.run(vctx)
	}
	ps.m[spec.Name] = p
	return p, nil
}

// configured is the definition a network configuration asks for, compared with stored: a
// configuration that says nothing of blocks takes the stored layout.
func configured(spec, stored allocator.PoolSpec) allocator.PoolSpec {
	if spec.Blocks.Flat() {
		spec.Blocks = stored.Blocks
	}
	return spec
}

// blocksOf is the stored layout of pool name, read when this agent does not serve it yet
// (a DEL or re-claim after a restart).
func (ps *pools) blocksOf(ctx context.Context, name string) (allocator.Blocks, error) {
	p, err := ps.ensure(ctx, allocator.PoolSpec{Name: name})
	if err != nil {
		return allocator.Blocks{}, err
	}
	return p.spec.Blocks, nil
}

// forEachView calls f with every view.
func (ps *pools) forEachView(f func(*view)) {
	ps.mu.Lock()
	views := make([]*view, 0, len(ps.m))
	for _, p := range ps.m {
		views = append(views, p.view)
	}
	ps.mu.Unlock()
	for _, v := range views {
		f(v)
	}
}

// await blocks until p's view has been listed once, or ctx ends. An ADD may go ahead
// without it (the transaction decides), but candidates are better with it.
func (p *pool) await(ctx context.Context) {
	select {
	case <-p.view.synced:
	case <-ctx.Done():
	}
}

// viewOf is the view of pool name, or nil when this agent does not serve it.
func (ps *pools) viewOf(name string) *view {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p, ok := ps.m[name]; ok {
		return p.view
	}
	return nil
}

// restartAll makes every view list its pool again, keeping until keep the addresses it knew
// allocated as taken (view.restartKeeping), and the next ensure of each pool re-read its
// definition. It returns a channel per view, closed once it has listed.
func (ps *pools) restartAll(keep time.Time) (relisted []<-chan struct{}) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for name, p := range ps.m {
		relisted = append(relisted, p.view.restartKeeping(keep))
		ps.m[name] = &pool{spec: p.spec, rev: -1, view: p.view, migrating: p.migrating}
	}
	return relisted
}

// invalidate makes the next ensure re-read the stored definition.
func (ps *pools) invalidate(name string) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p, ok := ps.m[name]; ok {
		ps.m[name] = &pool{spec: p.spec, rev: -1, view: p.view, migrating: p.migrating}
	}
}

// load reads the stored definition, creating it from spec when absent: in the block layout,
// with allocator.DefaultBlocks unless the configuration names block sizes.
func (ps *pools) load(ctx context.Context, spec allocator.PoolSpec) (allocator.PoolSpec, *keyspace.Migration, int64, error) {
	key := keyspace.PoolKey(spec.Name)
	var txn clientv3.Txn
	if len(spec.Ranges) > 0 {
		if spec.Blocks.Flat() {
			spec.Blocks = allocator.DefaultBlocks
		}
		txn = ps.cli.Txn(ctx).If(keyspace.Absent(key)).
			Then(clientv3.OpPut(key, keyspace.EncodePool(spec))).
			Else(clientv3.OpGet(key))
	} else {
		txn = ps.cli.Txn(ctx).Then(clientv3.OpGet(key))
	}
	resp, err := txn.Commit()
	if err != nil {
		return allocator.PoolSpec{}, nil, 0, fmt.Errorf("%w: read pool %q from etcd: %w", allocator.ErrUnavailable, spec.Name, err)
	}
	if resp.Succeeded && len(spec.Ranges) > 0 {
		ps.log.Info("pool defined", "pool", spec.Name, "spec", spec.String())
		return spec, nil, resp.Header.Revision, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return allocator.PoolSpec{}, nil, 0, fmt.Errorf("%w: pool %q is not defined in etcd (%s) and the configuration gives no ranges; "+
			"add \"ranges\" to the ipam configuration or create the pool with leaseholdctl pool create",
			allocator.ErrInvalidConfig, spec.Name, key)
	}
	stored, migrating, err := keyspace.DecodePool(key, kvs[0].Value)
	if err != nil {
		return allocator.PoolSpec{}, nil, 0, err
	}
	return stored, migrating, kvs[0].ModRevision, nil
}
