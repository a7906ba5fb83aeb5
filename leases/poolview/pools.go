package poolview

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

// Pool is a pool definition this agent has checked against etcd, with its view. A Pool
// value never changes; a re-read definition replaces it in the cache.
type Pool struct {
	Spec allocator.PoolSpec
	// Rev is the ModRevision of the stored definition; every ADD compares it, so a
	// definition changed under the agent makes the ADD re-read it instead of using a stale one.
	// It is -1 once the definition is to be read again (Invalidate).
	Rev  int64
	View *View
	// Migrating is set while leaseholdctl pool migrate moves the pool to the block layout:
	// ADDs are refused until it finishes.
	Migrating *keyspace.Migration
	// Access is who may get new addresses from the pool, as stored with the definition: a
	// closed pool gives none (package selection).
	Access keyspace.PoolAccess
}

// Config is what Pools needs besides etcd's client, handed in by the agent at start.
type Config struct {
	// Seed spreads this agent's candidate search over each range (see View.from).
	Seed uint64
	// OnMismatch, if set, records a refused definition where the pool's other users see it.
	OnMismatch func(ctx context.Context, wanted, stored allocator.PoolSpec)
	// Owner claims this node's blocks in pools of the block layout; nil: no block is claimed
	// (tests).
	Owner *Owner
	// Hooks are handed to every view.
	Hooks Hooks
}

// Pools caches the stored definitions of the pools this agent serves, each with its view.
type Pools struct {
	cli *clientv3.Client
	log *slog.Logger
	ctx context.Context // lives as long as the agent; views run on it
	cfg Config

	mu    sync.Mutex
	m     map[string]*Pool
	stops map[string]context.CancelFunc // ends a view's run
}

// NewPools makes the cache of pools; each view runs on ctx until it ends or the pool's
// layout changes.
func NewPools(ctx context.Context, cli *clientv3.Client, log *slog.Logger, cfg Config) *Pools {
	return &Pools{cli: cli, log: log, ctx: ctx, cfg: cfg, m: make(map[string]*Pool), stops: make(map[string]context.CancelFunc)}
}

// Ensure returns the stored definition of spec.Name, creating it from spec if no definition
// exists. A spec with no ranges refers to a stored definition by name. A spec that disagrees
// with the stored definition is refused with allocator.ErrPoolMismatch showing both.
func (ps *Pools) Ensure(ctx context.Context, spec allocator.PoolSpec) (*Pool, error) {
	ps.mu.Lock()
	p, ok := ps.m[spec.Name]
	ps.mu.Unlock()
	if ok && p.Rev > 0 && p.Migrating == nil && (len(spec.Ranges) == 0 || p.Spec.Equal(configured(spec, p.Spec))) {
		return p, nil
	}
	stored, migrating, access, rev, err := ps.load(ctx, spec)
	if err != nil {
		return nil, err
	}
	if len(spec.Ranges) > 0 && !stored.Equal(configured(spec, stored)) {
		if ps.cfg.OnMismatch != nil {
			ps.cfg.OnMismatch(ctx, spec, stored)
		}
		return nil, fmt.Errorf("%w: pool %q is stored in etcd as %s, but this network's configuration says %s; "+
			"make the ranges match the stored definition, or name another pool with \"pool\" in the ipam configuration",
			allocator.ErrPoolMismatch, spec.Name, stored.String(), spec.String())
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if old, ok := ps.m[spec.Name]; ok && old.View.blocks == stored.Blocks {
		p = &Pool{Spec: stored, Rev: rev, View: old.View, Migrating: migrating, Access: access}
	} else {
		if stop := ps.stops[spec.Name]; stop != nil {
			stop() // the pool's layout changed (pool migrate): follow it anew
		}
		vctx, stop := context.WithCancel(ps.ctx)
		p = &Pool{Spec: stored, Rev: rev, Migrating: migrating, Access: access,
			View: newView(spec.Name, stored.Blocks, ps.cli, ps.log, ps.cfg.Seed, ps.cfg.Owner, ps.cfg.Hooks)}
		ps.stops[spec.Name] = stop
		go p.View.run(vctx)
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

// BlocksOf is the stored layout of pool name, read when this agent does not serve it yet
// (a DEL or re-claim after a restart).
func (ps *Pools) BlocksOf(ctx context.Context, name string) (allocator.Blocks, error) {
	p, err := ps.Ensure(ctx, allocator.PoolSpec{Name: name})
	if err != nil {
		return allocator.Blocks{}, err
	}
	return p.Spec.Blocks, nil
}

// ForEachView calls f with every view.
func (ps *Pools) ForEachView(f func(*View)) {
	ps.mu.Lock()
	views := make([]*View, 0, len(ps.m))
	for _, p := range ps.m {
		views = append(views, p.View)
	}
	ps.mu.Unlock()
	for _, v := range views {
		f(v)
	}
}

// Await blocks until p's view has been listed once, or ctx ends. An ADD may go ahead
// without it (the transaction decides), but candidates are better with it.
func (p *Pool) Await(ctx context.Context) {
	select {
	case <-p.View.sync.synced:
	case <-ctx.Done():
	}
}

// ViewOf is the view of pool name, or nil when this agent does not serve it.
func (ps *Pools) ViewOf(name string) *View {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p, ok := ps.m[name]; ok {
		return p.View
	}
	return nil
}

// RestartAll makes every view list its pool again, keeping until keep the addresses it knew
// allocated as taken (view.restartKeeping), and the next ensure of each pool re-read its
// definition. It returns a channel per view, closed once it has listed.
func (ps *Pools) RestartAll(keep time.Time) (relisted []<-chan struct{}) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for name, p := range ps.m {
		relisted = append(relisted, p.View.restartKeeping(keep))
		ps.m[name] = &Pool{Spec: p.Spec, Rev: -1, View: p.View, Migrating: p.Migrating, Access: p.Access}
	}
	return relisted
}

// Invalidate makes the next ensure re-read the stored definition.
func (ps *Pools) Invalidate(name string) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p, ok := ps.m[name]; ok {
		ps.m[name] = &Pool{Spec: p.Spec, Rev: -1, View: p.View, Migrating: p.Migrating, Access: p.Access}
	}
}

// load reads the stored definition, creating it from spec when absent: in the block layout,
// with allocator.DefaultBlocks unless the configuration names block sizes.
func (ps *Pools) load(ctx context.Context, spec allocator.PoolSpec) (allocator.PoolSpec, *keyspace.Migration, keyspace.PoolAccess, int64, error) {
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
		return allocator.PoolSpec{}, nil, keyspace.PoolAccess{}, 0, fmt.Errorf("%w: read pool %q from etcd: %w", allocator.ErrUnavailable, spec.Name, err)
	}
	if resp.Succeeded && len(spec.Ranges) > 0 {
		ps.log.Info("pool defined", "pool", spec.Name, "spec", spec.String())
		return spec, nil, keyspace.PoolAccess{}, resp.Header.Revision, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return allocator.PoolSpec{}, nil, keyspace.PoolAccess{}, 0, fmt.Errorf("%w: pool %q is not defined in etcd (%s) and the configuration gives no ranges; "+
			"add \"ranges\" to the ipam configuration or create the pool with leaseholdctl pool create",
			allocator.ErrInvalidConfig, spec.Name, key)
	}
	stored, migrating, err := keyspace.DecodePool(key, kvs[0].Value)
	if err != nil {
		return allocator.PoolSpec{}, nil, keyspace.PoolAccess{}, 0, err
	}
	access, _ := keyspace.DecodePoolAccess(kvs[0].Value)
	return stored, migrating, access, kvs[0].ModRevision, nil
}

// Served is every pool served, as last ensured.
func (ps *Pools) Served() []*Pool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := make([]*Pool, 0, len(ps.m))
	for _, p := range ps.m {
		out = append(out, p)
	}
	return out
}
