package leases

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// view is the agent's watch-fed picture of one pool: which addresses are allocated and
// which rest in quarantine. It is a hint for choosing candidates, never the authority:
// every claim is a create-if-absent transaction, so a stale view costs a retry, never a
// duplicate. Choosing from it costs no etcd read.
type view struct {
	pool string
	cli  *clientv3.Client
	log  *slog.Logger

	mu          sync.Mutex
	allocated   map[netip.Addr]int64 // address -> revision that created it
	quarantined map[netip.Addr]time.Time
	hosts       map[string]netip.Addr // host address key -> address (several nodes may share one)
	hostCount   map[netip.Addr]int
	pending     map[netip.Addr]struct{} // chosen by an ADD whose transaction is in flight
	next        map[int]netip.Addr      // range set -> where the next search starts
	seed        uint64                  // spreads different agents over the range
	rev         int64                   // revision the view reflects
	synced      chan struct{}
	// stopFollow ends the watches of the current listing; relisted, when someone waits for a
	// new listing (restart), is closed by the next one.
	stopFollow context.CancelFunc
	relisted   chan struct{}
}

func newView(pool string, cli *clientv3.Client, log *slog.Logger, seed uint64) *view {
	return &view{
		pool:        pool,
		cli:         cli,
		log:         log.With("pool", pool),
		allocated:   make(map[netip.Addr]int64),
		quarantined: make(map[netip.Addr]time.Time),
		hosts:       make(map[string]netip.Addr),
		hostCount:   make(map[netip.Addr]int),
		pending:     make(map[netip.Addr]struct{}),
		next:        make(map[int]netip.Addr),
		seed:        seed,
		synced:      make(chan struct{}),
	}
}

// unlocked implements allocator.Taken over a view whose lock the caller holds.
type unlocked struct{ v *view }

func (u unlocked) Allocated(a netip.Addr) bool {
	_, ok := u.v.allocated[a]
	return ok || u.v.hostCount[a] > 0
}

func (u unlocked) Quarantined(a netip.Addr) (time.Time, bool) {
	t, ok := u.v.quarantined[a]
	return t, ok
}

// reserve picks a free address of range set `set` that no other in-flight ADD of this
// agent holds and skip does not refuse, and marks it pending.
func (v *view) reserve(spec *allocator.PoolSpec, set int, skip func(netip.Addr) bool) (netip.Addr, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	addr, err := spec.Next(set, v.from(spec, set), unlocked{v}, func(a netip.Addr) bool {
		if _, ok := v.pending[a]; ok {
			return true
		}
		return skip != nil && skip(a)
	})
	if err != nil {
		return netip.Addr{}, err
	}
	v.pending[addr] = struct{}{}
	v.next[set] = spec.Ranges[set].After(addr)
	return addr, nil
}

// from is where the round-robin search of a range set starts: after the address handed out
// last, so a crash-looping container does not get the same address straight back. An
// agent's first search starts at a place of the range derived from its identity, so that
// agents on different nodes begin in different places instead of racing for the same
// first addresses.
func (v *view) from(spec *allocator.PoolSpec, set int) netip.Addr {
	if next, ok := v.next[set]; ok {
		return next
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%s/%d", v.seed, v.pool, set)
	return spec.Ranges[set].Spread(float64(h.Sum64()>>11) / (1 << 53))
}

// scatter moves the next search of a range set to a random place, after this agent lost a
// race there: the winner is likely to take the addresses right after it too.
func (v *view) scatter(spec *allocator.PoolSpec, set int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.next[set] = spec.Ranges[set].Spread(rand.Float64())
}

// settle ends the pending state of addrs; when rev > 0 the transaction created them at rev.
func (v *view) settle(addrs []netip.Addr, rev int64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, a := range addrs {
		delete(v.pending, a)
		if rev > 0 && v.allocated[a] < rev {
			v.allocated[a] = rev
		}
	}
}

// released records this agent's own release of addrs at rev, with their quarantine until
// until (zero: none), without waiting for the watch to bring it: an ADD right after a DEL
// must see the address resting, not still allocated.
func (v *view) released(addrs []netip.Addr, rev int64, until time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, a := range addrs {
		if v.allocated[a] <= rev {
			delete(v.allocated, a)
		}
		if !until.IsZero() {
			v.quarantined[a] = until
		}
	}
}

// markAllocated records what a failed transaction learned: addr was created at rev.
func (v *view) markAllocated(a netip.Addr, rev int64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.allocated[a] < rev {
		v.allocated[a] = rev
	}
}

// markQuarantined records what a failed transaction learned about a quarantined address.
func (v *view) markQuarantined(a netip.Addr, until time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.quarantined[a] = until
}

// markHost records what a failed transaction learned: a node publishes addr as its own.
func (v *view) markHost(key string, a netip.Addr) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.addHost(key, a)
}

func (v *view) addHost(key string, a netip.Addr) {
	if _, ok := v.hosts[key]; !ok {
		v.hosts[key] = a
		v.hostCount[a]++
	}
}

func (v *view) removeHost(key string) {
	if a, ok := v.hosts[key]; ok {
		delete(v.hosts, key)
		if v.hostCount[a]--; v.hostCount[a] <= 0 {
			delete(v.hostCount, a)
		}
	}
}

// free reports whether an ADD could find an address in every range set now.
func (v *view) free(spec *allocator.PoolSpec) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	for set := range spec.Ranges {
		if _, err := spec.Next(set, v.from(spec, set), unlocked{v}, nil); err != nil {
			return err
		}
	}
	return nil
}

// counts returns how many addresses the view holds as allocated and quarantined.
func (v *view) counts() (allocated, quarantined int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.allocated), len(v.quarantined)
}

// run lists the pool, then follows it with watches until ctx ends, listing again after a
// broken watch (compaction, etcd restart).
func (v *view) run(ctx context.Context) {
	backoff := retryFirst
	for ctx.Err() == nil {
		rev, err := v.list(ctx)
		if err != nil {
			v.log.Warn("listing pool failed; candidates come from the last known view", "err", err, "retry_in", backoff)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		started := time.Now()
		fctx, stop := context.WithCancel(ctx)
		v.mu.Lock()
		v.stopFollow = stop
		v.mu.Unlock()
		v.follow(fctx, rev)
		restarted := ctx.Err() == nil && fctx.Err() != nil
		stop()
		if restarted {
			continue // list again at once
		}
		// A watch that ends at once (permission denied, an etcd going down) must not turn
		// into a tight loop of lists: back off unless it ran for a while.
		if time.Since(started) < watchHealthy {
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, retryMax)
		} else {
			backoff = retryFirst
		}
	}
}

func (v *view) list(ctx context.Context) (int64, error) {
	lctx, cancel := context.WithTimeout(ctx, viewListTimeout)
	defer cancel()
	resp, err := v.cli.Txn(lctx).Then(
		clientv3.OpGet(keyspace.IPsPrefix(v.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.QuarantinePrefix(v.pool), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.HostIPPrefix(netip.Addr{}), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	).Commit()
	if err != nil {
		return 0, err
	}
	allocated := make(map[netip.Addr]int64, len(resp.Responses[0].GetResponseRange().Kvs))
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		if _, ip, err := keyspace.ParseIPKey(string(kv.Key)); err == nil {
			allocated[ip] = kv.CreateRevision
		}
	}
	quarantined := make(map[netip.Addr]time.Time)
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		v.applyQuarantine(quarantined, kv.Key, kv.Value)
	}
	v.mu.Lock()
	v.allocated, v.quarantined, v.rev = allocated, quarantined, resp.Header.Revision
	v.hosts, v.hostCount = make(map[string]netip.Addr), make(map[netip.Addr]int)
	for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
		if ip, err := keyspace.ParseHostIPKey(string(kv.Key)); err == nil {
			v.addHost(string(kv.Key), ip)
		}
	}
	if v.relisted != nil {
		close(v.relisted)
		v.relisted = nil
	}
	v.mu.Unlock()
	select {
	case <-v.synced:
	default:
		close(v.synced)
	}
	return resp.Header.Revision, nil
}

// restart makes run drop its watches and list the pool again, for a view that may be stale
// in a way no watch reports: etcd's data was replaced, and a watch resumed at a revision the
// new etcd has not reached delivers nothing and no error. The returned channel is closed once
// the new listing is in.
func (v *view) restart() <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.relisted == nil {
		v.relisted = make(chan struct{})
	}
	if v.stopFollow != nil {
		v.stopFollow()
	}
	return v.relisted
}

func (v *view) applyQuarantine(m map[netip.Addr]time.Time, key, value []byte) {
	_, ip, err := keyspace.ParseQuarantineKey(string(key))
	if err != nil {
		return
	}
	var rec keyspace.QuarantineRecord
	if json.Unmarshal(value, &rec) != nil || rec.Until.IsZero() {
		rec.Until = time.Now() // unreadable record: still taken, expiry unknown
	}
	m[ip] = rec.Until
}

func (v *view) follow(ctx context.Context, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	ips := v.cli.Watch(wctx, keyspace.IPsPrefix(v.pool), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	qs := v.cli.Watch(wctx, keyspace.QuarantinePrefix(v.pool), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	hs := v.cli.Watch(wctx, keyspace.HostIPPrefix(netip.Addr{}), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	pcs := v.cli.Watch(wctx, keyspace.PoolConflictsPrefix(v.pool), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	for {
		var resp clientv3.WatchResponse
		var ok bool
		select {
		case resp, ok = <-ips:
		case resp, ok = <-qs:
		case resp, ok = <-hs:
		case resp, ok = <-pcs:
		}
		if !ok || resp.Err() != nil {
			if ctx.Err() == nil {
				v.log.Info("pool watch ended; listing again", "err", resp.Err())
			}
			return
		}
		v.apply(resp)
	}
}

func (v *view) apply(resp clientv3.WatchResponse) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, ev := range resp.Events {
		key := string(ev.Kv.Key)
		if _, ip, err := keyspace.ParseIPKey(key); err == nil {
			switch ev.Type {
			case clientv3.EventTypePut:
				if v.allocated[ip] < ev.Kv.CreateRevision {
					v.allocated[ip] = ev.Kv.CreateRevision
				}
			case clientv3.EventTypeDelete:
				// A delete older than a creation this agent already saw is stale.
				if v.allocated[ip] <= ev.Kv.ModRevision {
					delete(v.allocated, ip)
				}
			}
			continue
		}
		if strings.HasPrefix(key, keyspace.PoolConflictsPrefix(v.pool)) {
			if ev.Type == clientv3.EventTypePut {
				rec, _ := keyspace.Decode[keyspace.PoolConflictRecord](key, ev.Kv.Value)
				v.log.Error("another node defines this pool differently; its ADDs are refused until the definitions agree",
					"other_cluster", rec.Cluster, "other_node", rec.Node, "stored", rec.Stored.String(), "wanted", rec.Wanted.String(), "record", key)
			}
			continue
		}
		if ip, err := keyspace.ParseHostIPKey(key); err == nil {
			if ev.Type == clientv3.EventTypeDelete {
				v.removeHost(key)
			} else {
				v.addHost(key, ip)
			}
			continue
		}
		if _, ip, err := keyspace.ParseQuarantineKey(key); err == nil {
			if ev.Type == clientv3.EventTypeDelete {
				delete(v.quarantined, ip)
			} else {
				v.applyQuarantine(v.quarantined, ev.Kv.Key, ev.Kv.Value)
			}
		}
	}
	v.rev = resp.Header.Revision
}
