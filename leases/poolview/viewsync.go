package poolview

import (
	"context"
	"encoding/json"
	"net/netip"
	"slices"
	"strings"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/pause"
	"github.com/leasehold/leasehold/keyspace"
)

// How a view is filled and kept current: a listing, then watches from the listing's revision
// on; a watch that breaks (compaction, etcd restart) ends the generation and the view lists
// again. A block claimed during a generation is listed by its claim's transaction and watched
// from there on, in the same generation.

// syncer keeps a view current: it lists the pool, follows it with watches, and lists again
// when a watch breaks or a restart asks it to. Its fields but synced are under the view's
// lock.
type syncer struct {
	*core
	owner *Owner // nil in the flat layout
	// synced is closed once the view has been listed.
	synced chan struct{}

	// gen is the current listing's generation: its watches run on it, and so do those of a
	// block claimed during it. stopFollow ends it; relisted, when someone waits for a new
	// listing (restart), is closed by the next one.
	gen        *generation
	stopFollow context.CancelFunc
	relisted   chan struct{}
	restarting bool
}

// run lists the pool, then follows it with watches until ctx ends, listing again after a
// broken watch.
func (sy *syncer) run(ctx context.Context) {
	backoff := retryFirst
	for ctx.Err() == nil {
		lk := sy.lock()
		added := sy.spansAdded
		lk.unlock()
		listed, err := sy.list(ctx)
		if err != nil {
			sy.log.Warn("listing pool failed; candidates come from the last known view", "err", err, "retry_in", backoff)
			if !pause.For(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		g := &generation{}
		g.ctx, g.stop = context.WithCancel(ctx)
		lk = sy.lock()
		if sy.spansAdded != added {
			// A block was claimed while the listing ran: its watches may have started on the
			// generation that just ended. List again, with it.
			lk.unlock()
			g.stop()
			continue
		}
		sy.gen, sy.stopFollow, sy.restarting = g, g.stop, false
		spans := make([]span, 0, len(sy.spans))
		for _, s := range sy.spans {
			spans = append(spans, span{block: s.block, rev: s.rev})
		}
		lk.unlock()
		started := time.Now()
		sy.follow(g, listed, spans)
		lk = sy.lock()
		requested := sy.restarting
		lk.unlock()
		if ctx.Err() != nil || requested {
			continue // list again at once
		}
		// A watch that ends at once (permission denied, an etcd going down) must not turn
		// into a tight loop of lists: back off unless it ran for a while.
		if time.Since(started) < watchHealthy {
			if !pause.For(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, retryMax)
		} else {
			backoff = retryFirst
		}
	}
}

// follow watches what the listing at rev covered, each span from its own listing, until the
// generation ends, and waits for every watch of it to return.
func (sy *syncer) follow(g *generation, rev int64, spans []span) {
	g.wg.Add(2)
	go sy.watch(g, g.ctx, keyspace.HostIPPrefix(netip.Addr{}), rev)
	go sy.watch(g, g.ctx, keyspace.PoolConflictsPrefix(sy.pool), rev)
	for _, s := range spans {
		sy.watchSpan(g, s)
	}
	<-g.ctx.Done()
	lk := sy.lock()
	g.closed = true // no watch joins it any more (watchSpan)
	lk.unlock()
	g.wg.Wait()
}

// watchSpan starts the watches of one span's allocation and quarantine keys after s.rev, in
// generation g unless it has ended or the span was given back meanwhile.
func (sy *syncer) watchSpan(g *generation, s span) {
	ips, qs := keyspace.IPsPrefix(sy.pool), keyspace.QuarantinePrefix(sy.pool)
	if s.block.IsValid() {
		ips, qs = keyspace.BlockIPsPrefix(sy.pool, s.block), keyspace.BlockQuarantinePrefix(sy.pool, s.block)
	}
	ctx, stop := context.WithCancel(g.ctx)
	lk := sy.lock()
	cur := sy.spans[s.block]
	if cur == nil || g.closed {
		lk.unlock()
		stop()
		return
	}
	if cur.stop != nil {
		cur.stop()
	}
	cur.stop = stop
	g.wg.Add(2)
	lk.unlock()
	go sy.watch(g, ctx, ips, s.rev)
	go sy.watch(g, ctx, qs, s.rev)
}

// watch follows prefix after rev, as a member of generation g (the caller added it to g.wg),
// until ctx ends. A watch that breaks on its own ends the generation, so that the view lists
// again.
func (sy *syncer) watch(g *generation, ctx context.Context, prefix string, rev int64) {
	defer g.wg.Done()
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	var err error
	for resp := range sy.cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1)) {
		if err = resp.Err(); err != nil {
			break
		}
		sy.apply(resp)
	}
	if ctx.Err() == nil {
		sy.log.Info("pool watch ended; listing again", "prefix", prefix, "err", err)
		g.stop()
	}
}

// list reads what the view follows and replaces the view with it. In the block layout it
// reads the pool's block claims first: this node's claims (by node identity) are its blocks,
// on block leases the agent adopts again after a restart; a claim of a lease that cannot be
// adopted is gone with it. It returns the revision the pool-wide part was read at.
func (sy *syncer) list(ctx context.Context) (int64, error) {
	lctx, cancel := context.WithTimeout(ctx, viewListTimeout)
	defer cancel()
	if sy.blocks.Flat() {
		resp, err := sy.cli.Txn(lctx).Then(
			clientv3.OpGet(keyspace.HostIPPrefix(netip.Addr{}), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.IPsPrefix(sy.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.QuarantinePrefix(sy.pool), clientv3.WithPrefix()),
			clientv3.OpGet(keyspace.HeldPrefix(sy.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		).Commit()
		if err != nil {
			return 0, err
		}
		rev := resp.Header.Revision
		sy.replace(resp.Responses[0].GetResponseRange(), map[netip.Prefix]*span{{}: {rev: rev}}, nil,
			[]listed{{rev: rev, ips: resp.Responses[1].GetResponseRange(), qs: resp.Responses[2].GetResponseRange(),
				held: resp.Responses[3].GetResponseRange()}})
		return rev, nil
	}
	resp, err := sy.cli.Txn(lctx).Then(
		clientv3.OpGet(keyspace.HostIPPrefix(netip.Addr{}), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.BlocksPrefix(sy.pool), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return 0, err
	}
	claims, mine := sy.owner.sortClaims(lctx, sy.log, resp.Responses[1].GetResponseRange().Kvs)
	spans := make(map[netip.Prefix]*span, len(mine))
	for b, lease := range mine {
		spans[b] = &span{block: b, lease: lease}
	}
	var ops []clientv3.Op
	for _, b := range sortedBlocks(spans) {
		// A block's three reads in one transaction (readChunked splits between blocks).
		ops = append(ops, blockReads(sy.pool, b)...)
	}
	var blocks []listed
	resps, hdrs, err := ReadChunked(lctx, sy.cli, ops)
	if err != nil {
		return 0, err
	}
	i := 0
	for _, b := range sortedBlocks(spans) {
		rev := hdrs[i].Revision
		spans[b].rev = rev
		blocks = append(blocks, listed{rev: rev, ips: resps[i].GetResponseRange(), qs: resps[i+1].GetResponseRange(),
			held: resps[i+2].GetResponseRange()})
		i += 3
	}
	sy.replace(resp.Responses[0].GetResponseRange(), spans, claims, blocks)
	return resp.Header.Revision, nil
}

// sortedBlocks is the blocks of spans in address order.
func sortedBlocks(spans map[netip.Prefix]*span) []netip.Prefix {
	out := make([]netip.Prefix, 0, len(spans))
	for b := range spans {
		out = append(out, b)
	}
	slices.SortFunc(out, comparePrefix)
	return out
}

// listed is what a listing read of one span: its allocation, quarantine and held keys.
type listed struct {
	rev           int64
	ips, qs, held *pb.RangeResponse
}

// replace installs a listing: host addresses, the spans followed (with their state kept
// where a span was followed already), the block claims (nil in the flat layout) and the
// spans' keys.
func (sy *syncer) replace(hosts *pb.RangeResponse, spans map[netip.Prefix]*span,
	claims map[netip.Prefix]string, lists []listed) {
	allocated := make(map[netip.Addr]int64)
	quarantined := make(map[netip.Addr]time.Time)
	held := make(map[netip.Addr]struct{})
	for _, l := range lists {
		for _, kv := range l.ips.GetKvs() {
			if _, _, ip, err := keyspace.ParseIPKey(string(kv.Key)); err == nil {
				allocated[ip] = kv.CreateRevision
			}
		}
		for _, kv := range l.qs.GetKvs() {
			applyQuarantine(quarantined, kv.Key, kv.Value)
		}
		for _, kv := range l.held.GetKvs() {
			if _, _, ip, err := keyspace.ParseHeldKey(string(kv.Key)); err == nil {
				held[ip] = struct{}{}
			}
		}
	}
	restKept := make(map[netip.Addr]struct{})
	lk := sy.lock()
	sy.dropped, sy.gained, sy.droppedAt = sy.dropped[:0], sy.gained[:0], time.Now()
	// Dropped: what the view knew taken that the listing finds free, or allocated by another
	// key (a restored one of a pod deleted since, which goes soon: the pod the view knew may
	// still run with the address). An address held back for an expired holder, or whose
	// allocation went with no release seen (suspect), counts as taken: the holder's node, cut
	// off, may come back for it, and a restore that lost the held key must not hand the
	// address out meanwhile.
	for a, rev := range sy.allocated {
		if now, ok := allocated[a]; !ok || now != rev {
			sy.dropped = append(sy.dropped, a)
		}
	}
	for _, m := range []func(func(netip.Addr) bool){mapKeys(sy.heldBack), mapKeys(sy.suspect)} {
		for a := range m {
			_, was := sy.allocated[a]
			_, alloc := allocated[a]
			_, h := held[a]
			if !was && !alloc && !h {
				sy.dropped = append(sy.dropped, a)
				held[a] = struct{}{} // once, when both maps have it
			}
		}
	}
	for b, s := range spans {
		old, ok := sy.spans[b]
		s.restored = ok && old.restored || sy.restoredAt[b]
		if b.IsValid() && !ok && sy.listedOnce { // a first listing gains every block: it knew none before
			sy.gained = append(sy.gained, b)
		}
	}
	if now := time.Now(); now.Before(sy.keepUntil) {
		for _, a := range sy.dropped {
			sy.kept[a] = struct{}{}
		}
		for _, b := range sy.gained {
			spans[b].restored = true
		}
		// A restore of a backup older than a release loses the address's quarantine key: it
		// rests until the end the view knew all the same, ended by the view (restKept) unless
		// etcd has a key of it whose delete ends it.
		for a, until := range sy.quarantined {
			if _, alloc := allocated[a]; !alloc && until.After(now) && until.After(quarantined[a]) {
				if _, key := quarantined[a]; !key {
					restKept[a] = struct{}{}
				}
				quarantined[a] = until
			}
		}
	}
	sy.listedOnce = true
	for b, old := range sy.spans {
		if s, ok := spans[b]; ok {
			s.emptySince = old.emptySince
		} else if old.stop != nil {
			old.stop()
		}
	}
	sy.spans, sy.allocated, sy.quarantined, sy.restKept, sy.order = spans, allocated, quarantined, restKept, nil
	clear(sy.heldBack)
	clear(sy.suspect)
	clear(sy.relRev)
	for _, l := range lists {
		lk.heldListed(l.held.GetKvs())
	}
	if claims != nil {
		sy.claims, sy.claimsRead = claims, time.Now()
	}
	sy.hosts, sy.hostCount = make(map[string]netip.Addr), make(map[netip.Addr]int)
	for _, kv := range hosts.GetKvs() {
		if ip, err := keyspace.ParseHostIPKey(string(kv.Key)); err == nil {
			lk.addHost(string(kv.Key), ip)
		}
	}
	if sy.relisted != nil {
		close(sy.relisted)
		sy.relisted = nil
	}
	lk.unlock()
	sy.hooks.listed()
	select {
	case <-sy.synced:
	default:
		close(sy.synced)
	}
}

func applyQuarantine(m map[netip.Addr]time.Time, key, value []byte) {
	_, _, ip, err := keyspace.ParseQuarantineKey(string(key))
	if err != nil {
		return
	}
	var rec keyspace.QuarantineRecord
	if json.Unmarshal(value, &rec) != nil || rec.Until.IsZero() {
		rec.Until = time.Now() // unreadable record: still taken, expiry unknown
	}
	m[ip] = rec.Until
}

func (sy *syncer) apply(resp clientv3.WatchResponse) {
	lk := sy.lock()
	defer lk.unlock()
	for _, ev := range resp.Events {
		key := string(ev.Kv.Key)
		if _, _, ip, err := keyspace.ParseIPKey(key); err == nil {
			if !lk.follows(ip) {
				continue // a late event of a block given back
			}
			switch ev.Type {
			case clientv3.EventTypePut:
				if sy.allocated[ip] < ev.Kv.CreateRevision {
					sy.allocated[ip] = ev.Kv.CreateRevision
				}
				lk.allocPut(ip)
				sy.hooks.put(sy.pool, ip, ev.Kv)
			case clientv3.EventTypeDelete:
				// A delete older than a creation this agent already saw is stale.
				if sy.allocated[ip] <= ev.Kv.ModRevision {
					delete(sy.allocated, ip)
					lk.allocDeleted(ip, ev.Kv.ModRevision)
					lk.roomAt(ip)
				}
			}
			continue
		}
		if strings.HasPrefix(key, keyspace.PoolConflictsPrefix(sy.pool)) {
			if ev.Type == clientv3.EventTypePut {
				rec, _ := keyspace.Decode[keyspace.PoolConflictRecord](key, ev.Kv.Value)
				sy.log.Error("another node defines this pool differently; its ADDs are refused until the definitions agree",
					"other_cluster", rec.Cluster, "other_node", rec.Node, "stored", rec.Stored.String(), "wanted", rec.Wanted.String(), "record", key)
			}
			continue
		}
		if ip, err := keyspace.ParseHostIPKey(key); err == nil {
			if ev.Type == clientv3.EventTypeDelete {
				lk.removeHost(key)
				lk.roomAt(ip)
			} else {
				lk.addHost(key, ip)
			}
			continue
		}
		if _, _, ip, err := keyspace.ParseQuarantineKey(key); err == nil && lk.follows(ip) {
			delete(sy.restKept, ip) // a key of it: its events end its quarantine
			if ev.Type == clientv3.EventTypeDelete {
				delete(sy.quarantined, ip)
				lk.roomAt(ip)
			} else {
				applyQuarantine(sy.quarantined, ev.Kv.Key, ev.Kv.Value)
				lk.releaseSeen(ip, ev.Kv.ModRevision)
			}
		}
	}
}

// restart makes run drop its watches and list the pool again, for a view that may be stale
// in a way no watch reports: etcd's data was replaced, and a watch resumed at a revision the
// new etcd has not reached delivers nothing and no error. The returned channel is closed once
// the new listing is in.
func (sy *syncer) restart() <-chan struct{} {
	lk := sy.lock()
	defer lk.unlock()
	if sy.relisted == nil {
		sy.relisted = make(chan struct{})
	}
	sy.restarting = true
	if sy.stopFollow != nil {
		sy.stopFollow()
	}
	return sy.relisted
}
