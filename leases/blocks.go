package leases

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/poolview"
)

// blockLeases are the leases this node's block claims and its pods' held keys are on: one
// for new claims and held keys, granted at registration with a TTL of the pod leases' plus
// the reuse delay (Config.ReuseDelay) and named in the node record, and those adopted from
// claims found after a restart. The agent revokes them only when it stops with no pod left
// (Close): a restart keeps the node's blocks, and a node cut off from etcd or dead keeps its
// blocks and its pods' addresses held back for the reuse delay after its pods' leases expire.
type blockLeases struct {
	keeper *keeper.Keeper
	ttl    time.Duration
	// granted, if set, hears of each new current lease granted after the first (wired at
	// start): the node record must name it.
	granted func(clientv3.LeaseID)

	mu      sync.Mutex
	current clientv3.LeaseID
	held    map[clientv3.LeaseID]bool
	// adopted are the leases adopted and not yet handed to followAdopted, which wake tells.
	adopted []clientv3.LeaseID
	wake    chan struct{}
}

func newBlockLeases(k *keeper.Keeper, ttl time.Duration) *blockLeases {
	return &blockLeases{keeper: k, ttl: ttl, held: make(map[clientv3.LeaseID]bool), wake: make(chan struct{}, 1)}
}

// blockLeaseTTL is the block lease's TTL: one and a half times the pod lease TTL plus the
// reuse delay. Every lease is renewed at a third of its own TTL, so the block lease was last
// renewed at most a third of its TTL before the pods' leases; expiring two thirds of its TTL
// after that at the earliest, it outlives them by at least the delay.
func blockLeaseTTL(cfg Config) time.Duration { return (cfg.LeaseTTL + cfg.ReuseDelay) * 3 / 2 }

// get returns the lease new block claims and held keys go on, granting it if there is none
// (the one granted at registration was lost: the node was cut off for longer than its TTL).
func (b *blockLeases) get(ctx context.Context) (clientv3.LeaseID, error) {
	b.mu.Lock()
	cur := b.current
	b.mu.Unlock()
	if cur != 0 {
		return cur, nil
	}
	id, err := b.keeper.GrantKept(ctx, b.ttl)
	if err != nil {
		return 0, err
	}
	b.mu.Lock()
	if b.current != 0 {
		cur := b.current
		b.mu.Unlock()
		go b.keeper.RevokeQuietly(id)
		return cur, nil
	}
	b.current, b.held[id] = id, true
	b.mu.Unlock()
	if b.granted != nil {
		b.granted(id)
	}
	return id, nil
}

// peek is the current lease, 0 while there is none; it never grants.
func (b *blockLeases) peek() clientv3.LeaseID {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.current
}

// adopt resumes renewing a block lease this node identity granted earlier. It becomes the
// current one if there is none and it was granted with this agent's TTL: a shorter one (an
// earlier version's, or an earlier --reuse-delay) keeps its claims but takes no new ones.
func (b *blockLeases) adopt(ctx context.Context, id clientv3.LeaseID) error {
	b.mu.Lock()
	held := b.held[id]
	b.mu.Unlock()
	if held {
		return nil
	}
	granted, err := b.keeper.AdoptTTL(ctx, id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.held[id] = true
	if b.current == 0 && granted >= b.ttl {
		b.current = id
	}
	b.adopted = append(b.adopted, id)
	select {
	case b.wake <- struct{}{}:
	default:
	}
	return nil
}

// followAgain hands every block lease held to followAdopted again: etcd went back to a
// backup, which may hold claims on them in pools this agent has not served since (a claim
// given back after the backup was taken comes back on a lease the agent still renews).
func (b *blockLeases) followAgain() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for id := range b.held {
		if !slices.Contains(b.adopted, id) {
			b.adopted = append(b.adopted, id)
		}
	}
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// takeAdopted returns the leases adopted since it was last called.
func (b *blockLeases) takeAdopted() []clientv3.LeaseID {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.adopted
	b.adopted = nil
	return out
}

// mine reports whether id is one of this node's block leases.
func (b *blockLeases) mine(id clientv3.LeaseID) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.held[id]
}

// lost forgets a block lease etcd no longer has; it reports whether id was one.
func (b *blockLeases) lost(id clientv3.LeaseID) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.held[id] {
		return false
	}
	delete(b.held, id)
	if b.current == id {
		b.current = 0
	}
	return true
}

// revokeAll revokes every block lease, deleting the node's claims and held keys with them:
// the agent stops with no pod left, so nothing of its blocks needs holding back.
func (b *blockLeases) revokeAll() error {
	var errs []error
	for _, id := range b.all() {
		if err := b.keeper.Revoke(id); err != nil {
			errs = append(errs, err)
			continue
		}
		b.lost(id)
	}
	return errors.Join(errs...)
}

// resumeBlocks keeps this node's blocks across a restart: it serves at once every pool its
// pods are in, whose listing adopts the block leases of this identity's claims, then serves
// every other pool with a claim on those leases too, so that each claim is followed (and
// given back once empty) instead of renewed unseen. Claims of a node that comes back with no
// pod expire with their lease, which is all an empty block needs. Errors are logged: the
// next ADD of a pool serves it anyway.
func (a *Agent) resumeBlocks(ctx context.Context) {
	served := make(map[string]bool)
	for _, name := range a.pods.Pools() {
		if p := a.serveBlocksOf(ctx, name); p != nil {
			served[name] = true
			p.Await(ctx)
		}
	}
	a.blockLeases.takeAdopted() // all of them are followed here
	for _, id := range a.blockLeases.all() {
		a.serveClaimsOn(ctx, id, served)
	}
}

// serveBlocksOf serves pool name, whose listing follows this node's claims in it; nil if it
// failed (logged).
func (a *Agent) serveBlocksOf(ctx context.Context, name string) *poolview.Pool {
	p, err := a.pools.Ensure(ctx, allocator.PoolSpec{Name: name})
	if err != nil {
		a.log.Warn("serving a pool of this node's blocks failed; its claims are adopted at its next request", "pool", name, "err", err)
		return nil
	}
	return p
}

// serveClaimsOn serves every pool not in served with a claim on block lease id.
func (a *Agent) serveClaimsOn(ctx context.Context, id clientv3.LeaseID, served map[string]bool) {
	octx, cancel := a.opCtx(ctx)
	ttl, err := a.cli.TimeToLive(octx, id, clientv3.WithAttachedKeys())
	cancel()
	if err != nil {
		a.log.Warn("listing a block lease's claims failed", "lease", keyspace.LeaseHex(id), "err", err)
		return
	}
	for _, k := range ttl.Keys {
		if name, _, err := keyspace.ParseBlockKey(string(k)); err == nil && !served[name] {
			if p := a.serveBlocksOf(ctx, name); p != nil {
				served[name] = true
				p.Await(ctx)
			}
		}
	}
}

// followAdopted serves, until ctx ends, every pool with a claim on a block lease adopted
// after the start (resumeBlocks): a pool's listing adopts the lease of this node's claims in
// it (after etcd went back to a backup, say), and the claims on that lease in pools this
// agent does not serve would otherwise be renewed with it unseen, never given back.
func (a *Agent) followAdopted(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.blockLeases.wake:
		}
		for _, id := range a.blockLeases.takeAdopted() {
			served := make(map[string]bool)
			a.pools.ForEachView(func(v *poolview.View) { served[v.Pool()] = true })
			a.serveClaimsOn(ctx, id, served)
		}
	}
}

// all lists the block leases held.
func (b *blockLeases) all() []clientv3.LeaseID {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]clientv3.LeaseID, 0, len(b.held))
	for id := range b.held {
		out = append(out, id)
	}
	return out
}
