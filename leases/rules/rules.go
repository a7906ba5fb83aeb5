// Package rules follows what an ADD needs to choose its pools (package selection): one
// cluster's selection rules, and every pool's definition and access. Each is a listing, then
// a watch from the listing's revision; a watch that breaks (compaction, etcd restarted or
// restored) lists again. An ADD reads what is held without asking etcd, so a rule change, or
// a pool closed or opened, reaches the next ADD on every node within one watch round-trip.
// Both are written rarely: the two watches cost etcd nothing per ADD.
package rules

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/selection"
)

// Retry bounds of a listing that failed.
const (
	retryFirst = 100 * time.Millisecond
	retryMax   = 5 * time.Second
)

// Config is what a Follower is handed when made.
type Config struct {
	Cluster string
	Log     *slog.Logger
	// PoolChanged is called, without a lock held, when a pool's stored definition or access
	// changed or went: the agent reads it again before its next ADD there.
	PoolChanged func(pool string)
}

// Follower holds one cluster's selection rules and the pools. Its goroutines are Run's.
type Follower struct {
	cli *clientv3.Client
	cfg Config

	// listed is closed once both first listings are in.
	listed       chan struct{}
	rulesListed  chan struct{}
	poolsListed  chan struct{}
	listedCloser sync.Once

	mu sync.Mutex
	// rules are the readable rules by key; bad the keys of unreadable rules and pools, with why.
	rules map[string]keyspace.Rule
	pools map[string]selection.Pool
	bad   map[string]string
	// snap is what ADDs choose by, built from rules and pools at the first Choice after a
	// change (nil: none since), so that an ADD neither copies every pool nor reads every rule.
	snap *snapshot
	// gen counts Relist's calls; watches end the running watches (Relist).
	gen     int
	watches map[string]context.CancelFunc
}

// snapshot is the rules and pools at one moment, never changed once built: Choice hands its
// maps to every ADD until the next change.
type snapshot struct {
	pools map[string]selection.Pool
	// rules are the gathered rules by network, filled as networks are asked for; any tells
	// whether the network has a rule.
	rules map[string]gathered
}

type gathered struct {
	rules selection.Rules
	any   bool
}

// New returns a follower through cli (the gate's client); Run follows.
func New(cli *clientv3.Client, cfg Config) *Follower {
	return &Follower{cli: cli, cfg: cfg, listed: make(chan struct{}), rulesListed: make(chan struct{}),
		poolsListed: make(chan struct{}), rules: map[string]keyspace.Rule{}, pools: map[string]selection.Pool{},
		bad: map[string]string{}, watches: map[string]context.CancelFunc{}}
}

// Relist lists the rules and the pools again: etcd went back to a backup, and a watch from
// a revision of the history it left may never say so (a plain restore takes the revision back
// below it: the watch waits on, and what changed since the backup stays as it was).
func (f *Follower) Relist() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gen++
	for _, cancel := range f.watches {
		cancel()
	}
}

// Choice is what an ADD of network chooses by: its rules (any is false when it has none)
// and the stored pools. Before the first listings it waits for them, as long as ctx allows:
// an ADD must not choose by rules it has not read. The answer is shared with other ADDs
// until the next change: the caller must not change it (maps.Clone the pools to).
func (f *Follower) Choice(ctx context.Context, network string) (rules selection.Rules, any bool, pools map[string]selection.Pool, err error) {
	select {
	case <-f.listed:
	case <-ctx.Done():
		return selection.Rules{}, false, nil, ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.snap == nil {
		f.snap = &snapshot{pools: maps.Clone(f.pools), rules: map[string]gathered{}}
	}
	g, ok := f.snap.rules[network]
	if !ok {
		var rs []keyspace.Rule
		for _, r := range f.rules {
			if r.Network == network {
				rs = append(rs, r)
			}
		}
		g = gathered{rules: selection.Gather(rs, f.cfg.Cluster, network), any: len(rs) > 0}
		f.snap.rules[network] = g
	}
	return g.rules, g.any, f.snap.pools, nil
}

// Reread reads the named pools from etcd now, for an ADD that the pools held would refuse,
// or pass some over: a pool opened a moment ago, whose watch event is still on its way, is
// open to it. What the follower holds is left to its watch. A pool gone, or unreadable, is
// not in the answer.
func (f *Follower) Reread(ctx context.Context, names []string) (map[string]selection.Pool, error) {
	out := make(map[string]selection.Pool, len(names))
	for chunk := range slices.Chunk(names, keyspace.MaxTxnOps) {
		ops := make([]clientv3.Op, len(chunk))
		for i, name := range chunk {
			ops[i] = clientv3.OpGet(keyspace.PoolKey(name))
		}
		resp, err := f.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, err
		}
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().Kvs {
				spec, _, err := keyspace.DecodePool(string(kv.Key), kv.Value)
				if err != nil {
					continue
				}
				access, _ := keyspace.DecodePoolAccess(kv.Value)
				out[spec.Name] = selection.PoolOf(spec, access)
			}
		}
	}
	return out, nil
}

// Run lists and follows the rules and the pools until ctx ends.
func (f *Follower) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() {
		f.follow(ctx, "selection rules", keyspace.SelectionPrefix(f.cfg.Cluster, ""), f.rulesListed, f.resetRules, f.rule)
	})
	wg.Go(func() { f.follow(ctx, "pool definitions", keyspace.PoolsPrefix(), f.poolsListed, f.resetPools, f.pool) })
	wg.Go(func() {
		for _, ch := range []chan struct{}{f.rulesListed, f.poolsListed} {
			select {
			case <-ch:
			case <-ctx.Done():
				return
			}
		}
		close(f.listed)
	})
	wg.Wait()
}

// follow lists prefix, then applies its watch's events from the listing's revision on; a
// broken watch lists again. reset starts a listing's state, apply takes one key (a nil
// value: deleted).
func (f *Follower) follow(ctx context.Context, what, prefix string, listed chan struct{}, reset func() []string,
	apply func(key string, value []byte) string) {
	backoff := retryFirst
	for ctx.Err() == nil {
		f.mu.Lock()
		gen := f.gen // a Relist from now on lists again
		f.mu.Unlock()
		resp, err := f.cli.Get(ctx, prefix, clientv3.WithPrefix())
		if err != nil {
			f.cfg.Log.Warn("listing failed; ADDs choose by what was last read", "what", what, "err", err, "retry_in", backoff)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		backoff = retryFirst
		f.mu.Lock()
		changed := reset()
		for _, kv := range resp.Kvs {
			changed = append(changed, apply(string(kv.Key), kv.Value))
		}
		f.mu.Unlock()
		f.changed(changed)
		select {
		case <-listed:
		default:
			close(listed)
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		f.mu.Lock()
		f.watches[prefix] = cancel
		if f.gen != gen {
			cancel() // listed before a Relist: list again
		}
		f.mu.Unlock()
		for wresp := range f.cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1)) {
			if err := wresp.Err(); err != nil {
				if ctx.Err() == nil {
					f.cfg.Log.Info("a watch broke; listing again", "what", what, "err", err)
				}
				break
			}
			changed = changed[:0]
			f.mu.Lock()
			for _, ev := range wresp.Events {
				var value []byte
				if ev.Type == mvccpb.PUT {
					value = ev.Kv.Value
				}
				changed = append(changed, apply(string(ev.Kv.Key), value))
			}
			f.mu.Unlock()
			f.changed(changed)
		}
		cancel()
	}
}

// changed tells the agent of the pools whose record changed ("" entries are not pools).
func (f *Follower) changed(pools []string) {
	if f.cfg.PoolChanged == nil {
		return
	}
	slices.Sort(pools)
	for _, p := range slices.Compact(pools) {
		if p != "" {
			f.cfg.PoolChanged(p)
		}
	}
}

// resetRules forgets the rules before a listing. The caller holds mu.
func (f *Follower) resetRules() []string {
	f.snap = nil
	f.rules = map[string]keyspace.Rule{}
	return nil
}

// resetPools forgets the pools before a listing, returning them: each may have changed. The
// caller holds mu.
func (f *Follower) resetPools() []string {
	f.snap = nil
	var names []string
	for name := range f.pools {
		names = append(names, name)
	}
	f.pools = map[string]selection.Pool{}
	return names
}

// rule records the rule stored at key (deleted when value is nil); an unreadable one is
// passed over, with a warning once per value. The caller holds mu.
func (f *Follower) rule(key string, value []byte) string {
	f.snap = nil
	delete(f.rules, key)
	if value == nil {
		delete(f.bad, key)
		return ""
	}
	r, err := keyspace.DecodeRule(key, value)
	if f.unreadable(key, err) {
		return ""
	}
	f.rules[key] = r
	return ""
}

// pool records the pool stored at key (gone when value is nil), as selection needs it; an
// unreadable definition is passed over. The caller holds mu.
func (f *Follower) pool(key string, value []byte) string {
	name := key[len(keyspace.PoolsPrefix()):]
	f.snap = nil
	delete(f.pools, name)
	if value == nil {
		delete(f.bad, key)
		return name
	}
	spec, _, err := keyspace.DecodePool(key, value)
	if f.unreadable(key, err) {
		return name
	}
	access, _ := keyspace.DecodePoolAccess(value)
	f.pools[name] = selection.PoolOf(spec, access)
	return name
}

// unreadable logs err once per key and value; it tells whether there was one.
func (f *Follower) unreadable(key string, err error) bool {
	if err == nil {
		delete(f.bad, key)
		return false
	}
	if f.bad[key] != err.Error() {
		f.cfg.Log.Warn("a stored record cannot be read; ADDs pass it over", "key", key, "err", err)
	}
	f.bad[key] = err.Error()
	return true
}
