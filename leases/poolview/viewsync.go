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

	"github.com/leasehold/leasehold/keyspace"
)

// How a view is filled and kept current: a listing, then watches from the listing's revision
// on; a watch that breaks (compaction, etcd restart) ends the generation and the view lists
// again. A block claimed during a generation is listed by its claim's transaction and watched
// from there on, in the same generation.

// run lists the pool, then follows it with watches until ctx ends, listing again after a
// broken watch.
func (v *View) run(ctx context.Context) {
	if v.own != nil && v.own.Idle > 0 {
		go v.giveBackLoop(ctx)
	}
	if v.holding() {
		go v.heldLoop(ctx)
	}
	backoff := retryFirst
	for ctx.Err() == nil {
		v.mu.Lock()
		added := v.spansAdded
		v.mu.Unlock()
		listed, err := v.list(ctx)
		if err != nil {
			v.log.Warn("listing pool failed; candidates come from the last known view", "err", err, "retry_in", backoff)
			if !sleepCtx(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		g := &generation{}
		g.ctx, g.stop = context.WithCancel(ctx)
		v.mu.Lock()
		if v.spansAdded != added {
			// A block was claimed while the listing ran: its watches may have started on the
			// generation that just ended. List again, with it.
			v.mu.Unlock()
			g.stop()
			continue
		}
		v.gen, v.stopFollow, v.restarting = g, g.stop, false
		spans := make([]span, 0, len(v.spans))
		for _, s := range v.spans {
			spans = append(spans, span{block: s.block, rev: s.rev})
		}
		v.mu.Unlock()
		started := time.Now()
		v.follow(g, listed, spans)
		v.mu.Lock()
		requested := v.restarting
		v.mu.Unlock()
		if ctx.Err() != nil || requested {
			continue // list again at once
		}
		// A watch that ends at once (permission denied, an etcd going down) must not turn
		// into a tight loop of lists: back off unless it ran for a while.
		if time.Since(started) < watchHealthy {
			if !sleepCtx(ctx, backoff) {
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
func (v *View) follow(g *generation, rev int64, spans []span) {
	g.wg.Add(2)
	go v.watch(g, g.ctx, keyspace.HostIPPrefix(netip.Addr{}), rev)
	go v.watch(g, g.ctx, keyspace.PoolConflictsPrefix(v.pool), rev)
	for _, s := range spans {
		v.watchSpan(g, s)
	}
	<-g.ctx.Done()
	v.mu.Lock()
	g.closed = true // no watch joins it any more (watchSpan)
	v.mu.Unlock()
	g.wg.Wait()
}

// watchSpan starts the watches of one span's allocation and quarantine keys after s.rev, in
// generation g unless it has ended or the span was given back meanwhile.
func (v *View) watchSpan(g *generation, s span) {
	ips, qs := keyspace.IPsPrefix(v.pool), keyspace.QuarantinePrefix(v.pool)
	if s.block.IsValid() {
		ips, qs = keyspace.BlockIPsPrefix(v.pool, s.block), keyspace.BlockQuarantinePrefix(v.pool, s.block)
	}
	ctx, stop := context.WithCancel(g.ctx)
	v.mu.Lock()
	cur := v.spans[s.block]
	if cur == nil || g.closed {
		v.mu.Unlock()
		stop()
		return
	}
	if cur.stop != nil {
		cur.stop()
	}
	cur.stop = stop
	g.wg.Add(2)
	v.mu.Unlock()
	go v.watch(g, ctx, ips, s.rev)
	go v.watch(g, ctx, qs, s.rev)
}

// watch follows prefix after rev, as a member of generation g (the caller added it to g.wg),
// until ctx ends. A watch that breaks on its own ends the generation, so that the view lists
// again.
func (v *View) watch(g *generation, ctx context.Context, prefix string, rev int64) {
	defer g.wg.Done()
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	var err error
	for resp := range v.cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1)) {
		if err = resp.Err(); err != nil {
			break
		}
		v.apply(resp)
	}
	if ctx.Err() == nil {
		v.log.Info("pool watch ended; listing again", "prefix", prefix, "err", err)
		g.stop()
	}
}

// list reads what the view follows and replaces the view with it. In the block layout it
// reads the pool's block claims first: this node's claims (by node identity) are its blocks,
// on block leases the agent adopts again after a restart; a claim of a lease that cannot be
// adopted is gone with it. It returns the revision the pool-wide part was read at.
func (v *View) list(ctx context.Context) (int64, error) {
	lctx, cancel := context.WithTimeout(ctx, viewListTimeout)
	defer cancel()
	if v.blocks.Flat() {
		resp, err := v.cli.Txn(lctx).Then(
			clientv3.OpGet(keyspace.HostIPPrefix(netip.Addr{}), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.IPsPrefix(v.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
			clientv3.OpGet(keyspace.QuarantinePrefix(v.pool), clientv3.WithPrefix()),
			clientv3.OpGet(keyspace.HeldPrefix(v.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		).Commit()
		if err != nil {
			return 0, err
		}
		rev := resp.Header.Revision
		v.replace(resp.Responses[0].GetResponseRange(), map[netip.Prefix]*span{{}: {rev: rev}}, nil,
			[]listed{{rev: rev, ips: resp.Responses[1].GetResponseRange(), qs: resp.Responses[2].GetResponseRange(),
				held: resp.Responses[3].GetResponseRange()}})
		return rev, nil
	}
	resp, err := v.cli.Txn(lctx).Then(
		clientv3.OpGet(keyspace.HostIPPrefix(netip.Addr{}), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.BlocksPrefix(v.pool), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return 0, err
	}
	claims, mine := v.own.sortClaims(lctx, v.log, resp.Responses[1].GetResponseRange().Kvs)
	spans := make(map[netip.Prefix]*span, len(mine))
	for b, lease := range mine {
		spans[b] = &span{block: b, lease: lease}
	}
	var ops []clientv3.Op
	for _, b := range sortedBlocks(spans) {
		// A block's three reads in one transaction (readChunked splits between blocks).
		ops = append(ops, v.blockReads(b)...)
	}
	var blocks []listed
	resps, hdrs, err := ReadChunked(lctx, v.cli, ops)
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
	v.replace(resp.Responses[0].GetResponseRange(), spans, claims, blocks)
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

// blockReads are the reads that list one block this node follows: its allocation keys, its
// quarantine keys and its held keys.
func (v *View) blockReads(b netip.Prefix) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpGet(keyspace.BlockIPsPrefix(v.pool, b), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.BlockQuarantinePrefix(v.pool, b), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.BlockHeldPrefix(v.pool, b), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	}
}

// readChunked runs read-only ops in transactions of at most maxTxnOps each (etcd refuses
// larger ones: a node holding many blocks lists them in several), and returns each op's
// response with the header of the transaction that read it. A chunk holds a multiple of 3
// ops, so that one block's reads (blockReads) are read at one revision.
func ReadChunked(ctx context.Context, cli *clientv3.Client, ops []clientv3.Op) ([]*pb.ResponseOp, []*pb.ResponseHeader, error) {
	resps := make([]*pb.ResponseOp, 0, len(ops))
	hdrs := make([]*pb.ResponseHeader, 0, len(ops))
	for len(ops) > 0 {
		n := min(len(ops), maxTxnOps/3*3)
		resp, err := cli.Txn(ctx).Then(ops[:n]...).Commit()
		if err != nil {
			return nil, nil, err
		}
		for _, r := range resp.Responses {
			resps = append(resps, r)
			hdrs = append(hdrs, resp.Header)
		}
		ops = ops[n:]
	}
	return resps, hdrs, nil
}

// listed is what a listing read of one span: its allocation, quarantine and held keys.
type listed struct {
	rev           int64
	ips, qs, held *pb.RangeResponse
}

// replace installs a listing: host addresses, the spans followed (with their state kept
// where a span was followed already), the block claims (nil in the flat layout) and the
// spans' keys.
func (v *View) replace(hosts *pb.RangeResponse, spans map[netip.Prefix]*span,
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
			v.applyQuarantine(quarantined, kv.Key, kv.Value)
		}
		for _, kv := range l.held.GetKvs() {
			if _, _, ip, err := keyspace.ParseHeldKey(string(kv.Key)); err == nil {
				held[ip] = struct{}{}
			}
		}
	}
	restKept := make(map[netip.Addr]struct{})
	v.mu.Lock()
	v.dropped, v.gained, v.droppedAt = v.dropped[:0], v.gained[:0], time.Now()
	// Dropped: what the view knew taken that the listing finds free, or allocated by another
	// key (a restored one of a pod deleted since, which goes soon: the pod the view knew may
	// still run with the address). An address held back for an expired holder, or whose
	// allocation went with no release seen (suspect), counts as taken: the holder's node, cut
	// off, may come back for it, and a restore that lost the held key must not hand the
	// address out meanwhile.
	for a, rev := range v.allocated {
		if now, ok := allocated[a]; !ok || now != rev {
			v.dropped = append(v.dropped, a)
		}
	}
	for _, m := range []func(func(netip.Addr) bool){mapKeys(v.heldBack), mapKeys(v.suspect)} {
		for a := range m {
			_, was := v.allocated[a]
			_, alloc := allocated[a]
			_, h := held[a]
			if !was && !alloc && !h {
				v.dropped = append(v.dropped, a)
				held[a] = struct{}{} // once, when both maps have it
			}
		}
	}
	for b, s := range spans {
		old, ok := v.spans[b]
		s.restored = ok && old.restored || v.restoredAt[b]
		if b.IsValid() && !ok && v.listedOnce { // a first listing gains every block: it knew none before
			v.gained = append(v.gained, b)
		}
	}
	if now := time.Now(); now.Before(v.keepUntil) {
		for _, a := range v.dropped {
			v.kept[a] = struct{}{}
		}
		for _, b := range v.gained {
			spans[b].restored = true
		}
		// A restore of a backup older than a release loses the address's quarantine key: it
		// rests until the end the view knew all the same, ended by the view (restKept) unless
		// etcd has a key of it whose delete ends it.
		for a, until := range v.quarantined {
			if _, alloc := allocated[a]; !alloc && until.After(now) && until.After(quarantined[a]) {
				if _, key := quarantined[a]; !key {
					restKept[a] = struct{}{}
				}
				quarantined[a] = until
			}
		}
	}
	v.listedOnce = true
	for b, old := range v.spans {
		if s, ok := spans[b]; ok {
			s.emptySince = old.emptySince
		} else if old.stop != nil {
			old.stop()
		}
	}
	v.spans, v.allocated, v.quarantined, v.restKept, v.order = spans, allocated, quarantined, restKept, nil
	clear(v.heldBack)
	clear(v.suspect)
	clear(v.relRev)
	for _, l := range lists {
		v.heldListed(l.held.GetKvs())
	}
	if claims != nil {
		v.claims, v.claimsRead = claims, time.Now()
	}
	v.hosts, v.hostCount = make(map[string]netip.Addr), make(map[netip.Addr]int)
	for _, kv := range hosts.GetKvs() {
		if ip, err := keyspace.ParseHostIPKey(string(kv.Key)); err == nil {
			v.addHost(string(kv.Key), ip)
		}
	}
	if v.relisted != nil {
		close(v.relisted)
		v.relisted = nil
	}
	v.mu.Unlock()
	v.hooks.listed()
	select {
	case <-v.synced:
	default:
		close(v.synced)
	}
}

func (v *View) applyQuarantine(m map[netip.Addr]time.Time, key, value []byte) {
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

func (v *View) apply(resp clientv3.WatchResponse) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, ev := range resp.Events {
		key := string(ev.Kv.Key)
		if _, _, ip, err := keyspace.ParseIPKey(key); err == nil {
			if !v.follows(ip) {
				continue // a late event of a block given back
			}
			switch ev.Type {
			case clientv3.EventTypePut:
				if v.allocated[ip] < ev.Kv.CreateRevision {
					v.allocated[ip] = ev.Kv.CreateRevision
				}
				v.allocPut(ip)
				v.hooks.put(v.pool, ip, ev.Kv)
			case clientv3.EventTypeDelete:
				// A delete older than a creation this agent already saw is stale.
				if v.allocated[ip] <= ev.Kv.ModRevision {
					delete(v.allocated, ip)
					v.allocDeleted(ip, ev.Kv.ModRevision)
					v.roomAt(ip)
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
				v.roomAt(ip)
			} else {
				v.addHost(key, ip)
			}
			continue
		}
		if _, _, ip, err := keyspace.ParseQuarantineKey(key); err == nil && v.follows(ip) {
			delete(v.restKept, ip) // a key of it: its events end its quarantine
			if ev.Type == clientv3.EventTypeDelete {
				delete(v.quarantined, ip)
				v.roomAt(ip)
			} else {
				v.applyQuarantine(v.quarantined, ev.Kv.Key, ev.Kv.Value)
				v.releaseSeen(ip, ev.Kv.ModRevision)
			}
		}
	}
}
