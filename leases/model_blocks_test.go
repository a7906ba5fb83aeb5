package leases

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// The block part of TestModelRandomHistories (issue 16): the model's pool has small blocks,
// so that histories claim blocks, fill them, borrow in other nodes' blocks and give empty
// blocks back; nodes die (their leases expire, their pods are gone) and come back replaced.

const (
	// modelBlockIdle is the model agents' Config.BlockIdle: short, so that histories give
	// blocks back.
	modelBlockIdle = 300 * time.Millisecond
	// modelViewSettle bounds how long check waits for the agents' views of their blocks to
	// agree with etcd (a give-back deletes the claim, then drops the span), and a settling
	// history for what it waits for: far above what the slowest run needs.
	modelViewSettle = etcdtest.Patience
)

// modelBlockMetrics are the counters the model sums over every agent it ran.
var modelBlockMetrics = []string{
	"leasehold_block_claims_total",
	"leasehold_blocks_given_back_total",
	"leasehold_borrowed_addresses_total",
	"leasehold_claim_handovers_total",
	"leasehold_claim_handovers_refused_total",
	"leasehold_expired_addresses_reused_total",
	"leasehold_conflicts_total",
	"leasehold_conflicts_resolved_total",
	"leasehold_pod_keys_lost_total",
	"leasehold_etcd_went_back_total",
	"leasehold_reclaims_total",
}

// modelPool is the model's pool: 29 IPv4 addresses in four /29 blocks for 24 owners x 2
// interfaces (blocks run out, nodes borrow, the pool is exhausted), and 126 IPv6 addresses
// in 32 /126 blocks (blocks are claimed and given back, seldom all of them).
func modelPool() allocator.PoolSpec {
	return allocator.PoolSpec{Name: etcdtest.Uniq("mp"), Ranges: []allocator.RangeSet{
		{{Subnet: netip.MustParsePrefix("10.77.0.0/27")}},
		{{Subnet: netip.MustParsePrefix("fd77::/121")}},
	}, Blocks: allocator.Blocks{IPv4: 29, IPv6: 126}}
}

// harvest adds the block counters of an agent about to go to the model's totals.
func (m *model) harvest(a *Agent) {
	for _, name := range modelBlockMetrics {
		m.stats[name] += metricValue(m.t, a, name)
	}
}

// totals are the block counters of every agent the model ran, live ones included.
func (m *model) totals() map[string]float64 {
	out := map[string]float64{}
	for name, v := range m.stats {
		out[name] = v
	}
	for _, n := range m.nodes {
		if n.agent != nil {
			for _, name := range modelBlockMetrics {
				out[name] += metricValue(m.t, n.agent, name)
			}
		}
	}
	return out
}

// live returns the indexes of the nodes whose agent runs.
func (m *model) live() []int {
	var out []int
	for i, n := range m.nodes {
		if n.agent != nil {
			out = append(out, i)
		}
	}
	return out
}

// homeOf returns the node that serves owner: its home while that node is alive, else a live
// node chosen now (a pod of a dead node is rescheduled as a new pod). An owner that holds
// nothing is sometimes scheduled anew, so that owners drained off a node come back to it.
func (m *model) homeOf(owner string) *modelNode {
	if ni, ok := m.home[owner]; ok && m.nodes[ni].agent != nil && (m.holds(owner) || m.rng.IntN(8) > 0) {
		return m.nodes[ni]
	}
	live := m.live()
	ni := live[m.rng.IntN(len(live))]
	m.home[owner] = ni
	return m.nodes[ni]
}

// holds reports whether the model gives owner any address.
func (m *model) holds(owner string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k := range m.held {
		if k.owner == owner {
			return true
		}
	}
	return false
}

// keptAlive lists the leases an agent renews: what expires when its node dies.
func keptAlive(a *Agent) []clientv3.LeaseID { return a.keeper.HeldLeases() }

// die kills one node: its agent stops, and every lease it renewed expires (revoked here, as
// etcd does a TTL after the last renewal), taking its pods' addresses and its block claims,
// and so do the block leases of its identity it no longer renewed (a crashed agent's that
// came back with no pod): a death outlasts the reuse delay. Its sticky claims' leases run
// out only after the hold (model_sticky_test.go), so they stay.
// The model forgets the node's pods; the node comes back later with a new identity (revive).
// It reports false when too few nodes are alive to lose one.
func (m *model) die(ctx context.Context, i int) bool {
	live := m.live()
	if len(live) < 3 {
		return false
	}
	ni := live[m.rng.IntN(len(live))]
	if slices.ContainsFunc(m.attachmentsOn(ni), func(k attKey) bool { return m.sourceOfAwayTarget(k.owner) }) {
		return false // a source whose target is cut off stays until it is back (model_migration_test.go)
	}
	n := m.nodes[ni]
	claims := claimLeaseSet(n.agent)
	leases := slices.DeleteFunc(keptAlive(n.agent), func(id clientv3.LeaseID) bool { return claims[id] })
	m.noteHeldOf(ctx, n.name) // its block lease goes now, before the delay: others may hold them back still
	m.harvest(n.agent)
	n.agent.Close()
	n.agent = nil
	n.back = i + 3 + m.rng.IntN(15)
	for _, id := range append(leases, m.blockLeasesOf(ctx, n.name, n.uid)...) {
		m.revoke(ctx, i, id)
	}
	m.dieMigrations(ctx, i, ni)
	m.mu.Lock()
	var gone []string
	for k, held := range m.held {
		if m.home[k.owner] == ni {
			gone = append(gone, fmt.Sprint(k))
			for _, a := range held {
				if !slices.Contains(m.conflict[k], a) {
					m.expired[a] = true
				}
			}
			delete(m.held, k)
			delete(m.ctr, k)
			delete(m.conflict, k)
		}
	}
	m.mu.Unlock()
	sort.Strings(gone)
	m.log("%d %s DIES (uid %s, %d leases expire, %d claim leases stay for the hold, its attachments %v are gone)",
		i, n.name, n.uid, len(leases), len(claims), gone)
	m.count["death"]++
	// Every key the dead node wrote for its pods and blocks must go with its leases: a key on
	// a lease it did not renew expires on its own within the TTL, one on no lease never does.
	deadline := time.Now().Add(etcdtest.Patience)
	for {
		left := m.keysOfNode(ctx, n.name, n.uid)
		if len(left) == 0 {
			return true
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: keys of dead node %s (uid %s) outlive its leases by %s: %v", i, n.name, n.uid, etcdtest.Patience, left)
			return true
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// drain deletes every attachment of one node at once, as when its pods are evicted, and
// schedules its owners on other nodes: its blocks empty, and are given back once their
// quarantine and BlockIdle are over, unless another node borrows in them first.
func (m *model) drain(ctx context.Context, i int) {
	live := m.live()
	ni := live[m.rng.IntN(len(live))]
	n := m.nodes[ni]
	var others []int
	for _, o := range live {
		if o != ni {
			others = append(others, o)
		}
	}
	if slices.ContainsFunc(m.attachmentsOn(ni), func(k attKey) bool { return m.sourceOfAwayTarget(k.owner) }) {
		return // a source whose target is cut off stays until it is back (model_migration_test.go)
	}
	m.mu.Lock()
	var keys []attKey
	busy := map[string]bool{}
	for k := range m.held {
		if m.home[k.owner] == ni {
			keys = append(keys, k)
			busy[k.owner] = true
		}
	}
	m.mu.Unlock()
	defer func() {
		owners := slices.Sorted(maps.Keys(m.home)) // in order: a replay draws the same homes
		for _, owner := range owners {
			if m.home[owner] == ni && len(others) > 0 {
				m.home[owner] = others[m.rng.IntN(len(others))]
			}
		}
	}()
	sort.Slice(keys, func(a, b int) bool { return keys[a].owner+keys[a].ifName < keys[b].owner+keys[b].ifName })
	m.log("%d %s DRAIN %v", i, n.name, keys)
	m.failAll(ctx, i, ni) // its migrations' targets first: a source's DEL would complete one
	m.count["drain"]++
	var wg sync.WaitGroup
	for _, k := range keys {
		wg.Go(func() { m.do(ctx, i, n, k, 5, 1, busy) })
	}
	wg.Wait()
}

// settle ends a history: every cut-off node comes back, every attachment the model holds is
// deleted, after which the pool must hold no allocation and no held key, and every block must
// be given back once its quarantine and BlockIdle are over. A block claim left then is a
// leaked block, unless its node restarted and has not served the pool since (a crashed node
// that came back with no pod knows its old block lease no more): nothing renews such a
// claim, and it goes with its lease, after the reuse delay; the model revokes that lease
// (counted as "orphaned").
func (m *model) settle(i int) {
	ctx, cancel := context.WithTimeout(context.Background(), modelStepTimeout)
	defer cancel()
	m.revive(i)
	m.returns(ctx, i, true)
	m.evict(ctx, i, true)
	m.resolve(i)
	m.check()
	m.restoresAtEnd(ctx, i)
	m.check()
	m.failAll(ctx, i, -1)
	m.mu.Lock()
	var keys []attKey
	busy := map[string]bool{}
	for k := range m.held {
		keys = append(keys, k)
		busy[k.owner] = true
	}
	m.mu.Unlock()
	sort.Slice(keys, func(a, b int) bool { return keys[a].owner+keys[a].ifName < keys[b].owner+keys[b].ifName })
	m.log("%d SETTLE: DEL %v", i, keys)
	var wg sync.WaitGroup
	for _, k := range keys {
		n := m.nodes[m.home[k.owner]]
		wg.Go(func() { m.do(ctx, i, n, k, 5, 1, busy) })
	}
	wg.Wait()
	m.awaitCompletions(i)
	m.check()
	m.endClaims(ctx, i)
	resp, err := m.cli.Txn(ctx).Then(m.poolOps(func(p allocator.PoolSpec) string { return keyspace.IPsPrefix(p.Name) },
		clientv3.WithKeysOnly())...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			m.t.Errorf("every attachment was deleted, and allocation %s is left", kv.Key)
		}
	}
	// Nothing is held back for a pod that runs no more (a release deletes its held and wanted
	// keys; the agent frees those of pods deleted while their lease was lost).
	heldDeadline := time.Now().Add(modelViewSettle)
	for {
		resp, err := m.cli.Txn(ctx).Then(append(m.poolOps(func(p allocator.PoolSpec) string { return keyspace.HeldPrefix(p.Name) }),
			m.poolOps(func(p allocator.PoolSpec) string { return keyspace.WantedPrefix(p.Name, p.Blocks, netip.Addr{}) })...)...).Commit()
		if err != nil {
			m.t.Fatal(err)
		}
		var left []*mvccpb.KeyValue
		for _, r := range resp.Responses {
			left = append(left, r.GetResponseRange().Kvs...)
		}
		if len(left) == 0 {
			break
		}
		if time.Now().After(heldDeadline) {
			for _, kv := range left {
				m.t.Errorf("every attachment was deleted %s ago, and held or wanted key %s is left on lease %s: %s", modelViewSettle,
					kv.Key, keyspace.LeaseHex(keyspace.LeaseOf(kv)), kv.Value)
			}
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	// A quarantine key lives on a lease of up to the quarantine plus a window (the keeper's
	// QuarantineLease), which etcd revokes within about a second of its TTL.
	start := time.Now()
	deadline := start.Add(modelQuarantine + 2*time.Second + modelBlockIdle + modelViewSettle)
	for {
		left, orphans := m.claimsLeft(ctx)
		if len(left) == 0 && len(orphans) == 0 {
			break
		}
		if len(left) > 0 && time.Now().After(deadline) {
			m.t.Errorf("every attachment was deleted %s ago, and these blocks are still claimed: %v\nblocks:%s",
				time.Since(start).Round(time.Millisecond),
				left, m.blocksDump())
			return
		}
		for lease, claims := range orphans {
			for _, n := range m.nodes {
				if n.agent != nil && n.agent.keeper.Holds(lease) {
					m.t.Errorf("block claims %v are on lease %s, which %s renews without following the pool: never given back",
						claims, keyspace.LeaseHex(lease), n.name)
					return
				}
			}
			m.revoke(ctx, i, lease)
			m.count["orphaned"] += len(claims)
			m.log("%d SETTLE: claims no agent follows (restarted, pool not served since) go with their lease %s: %v",
				i, keyspace.LeaseHex(lease), claims)
		}
		time.Sleep(100 * time.Millisecond)
	}
	m.log("%d SETTLE: every block given back", i)
	m.check()
}

// claimsLeft lists the pool's block claims: those of agents that follow the pool (left), and,
// by lease, those of agents that do not, having restarted since they last served it
// (orphans).
func (m *model) claimsLeft(ctx context.Context) (left []string, orphans map[clientv3.LeaseID][]string) {
	orphans = map[clientv3.LeaseID][]string{}
	resp, err := m.cli.Txn(ctx).Then(m.poolOps(func(p allocator.PoolSpec) string { return keyspace.BlocksPrefix(p.Name) })...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	for pi, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			rec, _ := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value)
			claim := fmt.Sprintf("%s by %s", kv.Key, rec.Node)
			orphan := false
			for _, n := range m.nodes {
				if n.agent != nil && n.name == rec.Node && n.uid == rec.NodeUID && n.agent.pools.ViewOf(m.pools[pi].Name) == nil {
					orphan = true
				}
			}
			if orphan {
				orphans[keyspace.LeaseOf(kv)] = append(orphans[keyspace.LeaseOf(kv)], claim)
			} else {
				left = append(left, claim)
			}
		}
	}
	return left, orphans
}

// revive brings back, with a new node UID and an empty state directory, the dead nodes whose
// time has come: the same-name replacement of a machine.
func (m *model) revive(i int) {
	for ni, n := range m.nodes {
		if n.agent != nil || n.away > 0 || i < n.back {
			continue
		}
		n.gen++
		n.uid, n.state = fmt.Sprintf("uid%d-r%d", ni, n.gen), m.t.TempDir()
		n.agent = m.start(n)
		m.log("%d %s REPLACED (uid %s)", i, n.name, n.uid)
		m.count["replace"]++
	}
}

// keysOfNode lists the keys that name node identity (name, uid): allocations, owner indexes,
// pod records and block claims.
func (m *model) keysOfNode(ctx context.Context, name, uid string) []string {
	np := len(m.pools)
	ops := []clientv3.Op{clientv3.OpGet(keyspace.OwnersPrefix(m.cluster), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.PodsPrefix(m.cluster, name), clientv3.WithPrefix())}
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.IPsPrefix(p.Name) })...)
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.BlocksPrefix(p.Name) })...)
	resp, err := m.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	var out []string
	for ri, r := range resp.Responses {
		// The kinds in keysOf's order: allocations, owner indexes, pod records, block claims.
		i := []int{1, 2}[min(ri, 1)]
		switch {
		case ri >= 2 && ri < 2+np:
			i = 0
		case ri >= 2+np:
			i = 3
		}
		for _, kv := range r.GetResponseRange().Kvs {
			var of string
			switch i {
			case 0:
				rec, _ := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
				of = rec.NodeUID
			case 1:
				rec, _ := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
				of = rec.NodeUID
			case 2:
				rec, _ := keyspace.Decode[keyspace.PodRecord](string(kv.Key), kv.Value)
				of = rec.NodeUID
			case 3:
				rec, _ := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value)
				of = rec.NodeUID
			}
			if of == uid {
				out = append(out, fmt.Sprintf("%s (lease %s)", kv.Key, keyspace.LeaseHex(keyspace.LeaseOf(kv))))
			}
		}
	}
	return out
}

// checkKeyBlocks checks that an allocation or quarantine key lies in the block its key names,
// and that this block is the pool's block of the address.
func (m *model) checkKeyBlocks(p allocator.PoolSpec, key string, block netip.Prefix, ip netip.Addr, want string) {
	if b := p.Blocks.Of(ip); block != b {
		m.t.Errorf("key %s names block %s, the pool's block of %s is %s", key, block, ip, b)
	}
	if key != want {
		m.t.Errorf("key %s is not the pool's key of %s (%s)", key, ip, want)
	}
}

// checkClaims checks pool p's block claims as read at a quiet point: each lies on a live
// lease, names a live node of the model with its current identity, and spells a block of the
// pool's size.
func (m *model) checkClaims(ctx context.Context, p allocator.PoolSpec, kvs []*mvccpb.KeyValue) {
	alive := map[clientv3.LeaseID]bool{}
	for _, kv := range kvs {
		pool, block, err := keyspace.ParseBlockKey(string(kv.Key))
		if err != nil {
			m.t.Errorf("block claim key: %v", err)
			continue
		}
		if pool != p.Name || !block.IsValid() || p.Blocks.Of(block.Addr()) != block {
			m.t.Errorf("block claim %s is not a block of pool %s (%s)", kv.Key, p.Name, p.Blocks)
		}
		rec, err := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value)
		if err != nil {
			m.t.Errorf("block claim: %v", err)
			continue
		}
		if !m.isLiveNode(rec.Node, rec.NodeUID) && !m.holdsBackFor(rec.Node, rec.NodeUID) || rec.Cluster != m.cluster {
			m.t.Errorf("block claim %s names %s/%s (uid %s), not a live node of the model, nor a cut-off one within its reuse delay",
				kv.Key, rec.Cluster, rec.Node, rec.NodeUID)
		}
		lease := keyspace.LeaseOf(kv)
		if lease == 0 {
			m.t.Errorf("block claim %s is on no lease", kv.Key)
			continue
		}
		if rec.LeaseID != keyspace.LeaseHex(lease) {
			m.t.Errorf("block claim %s says lease %s, is on %s", kv.Key, rec.LeaseID, keyspace.LeaseHex(lease))
		}
		ok, seen := alive[lease]
		if !seen {
			resp, err := m.cli.TimeToLive(ctx, lease)
			ok = err == nil && resp.TTL > 0
			alive[lease] = ok
		}
		if !ok {
			m.t.Errorf("block claim %s is on lease %s, which is not alive", kv.Key, keyspace.LeaseHex(lease))
		}
	}
}

// holdsBackFor reports whether node identity (name, uid) is cut off and its block leases
// still live: its blocks are its own.
func (m *model) holdsBackFor(name, uid string) bool {
	for _, n := range m.nodes {
		if n.holdsBack && n.name == name && n.uid == uid {
			return true
		}
	}
	return false
}

func (m *model) isLiveNode(name, uid string) bool {
	for _, n := range m.nodes {
		if n.agent != nil && n.name == name && n.uid == uid {
			return true
		}
	}
	return false
}

// checkViews checks that no two agents consider one block theirs, and that every agent whose
// view of the pool is listed holds exactly its claims in etcd, on leases it renews. A
// give-back deletes a claim before the view drops the block, so a disagreement must last
// modelViewSettle to count.
func (m *model) checkViews() {
	deadline := time.Now().Add(modelViewSettle)
	for {
		var problems []string
		for _, p := range m.pools {
			problems = append(problems, m.viewProblems(p.Name)...)
		}
		if len(problems) == 0 {
			return
		}
		if time.Now().After(deadline) {
			m.t.Errorf("block views disagree with etcd for %s:\n  %s\nclaims: %s", modelViewSettle,
				strings.Join(problems, "\n  "), m.blocksDump())
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (m *model) viewProblems(pool string) []string {
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	resp, err := m.cli.Get(ctx, keyspace.BlocksPrefix(pool), clientv3.WithPrefix())
	if err != nil {
		m.t.Fatal(err)
	}
	type claim struct {
		node, uid string
		lease     clientv3.LeaseID
	}
	claims := map[netip.Prefix]claim{}
	for _, kv := range resp.Kvs {
		_, block, err := keyspace.ParseBlockKey(string(kv.Key))
		rec, derr := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value)
		if err == nil && derr == nil {
			claims[block] = claim{rec.Node, rec.NodeUID, keyspace.LeaseOf(kv)}
		}
	}
	var problems []string
	holder := map[netip.Prefix]string{}
	for _, n := range m.nodes {
		if n.agent == nil {
			continue
		}
		v := n.agent.pools.ViewOf(pool)
		if v == nil {
			continue
		}
		in := v.Inspect()
		if !in.Listed {
			continue // not listed yet: it knows no block
		}
		spans := map[netip.Prefix]clientv3.LeaseID{}
		for b, s := range in.Blocks {
			if b.IsValid() {
				spans[b] = s.Lease
			}
		}
		for b, lease := range spans {
			if other, dup := holder[b]; dup {
				problems = append(problems, fmt.Sprintf("block %s is held by both %s and %s", b, other, n.name))
			}
			holder[b] = n.name
			c, ok := claims[b]
			switch {
			case !ok:
				problems = append(problems, fmt.Sprintf("%s holds block %s, which has no claim", n.name, b))
			case c.node != n.name || c.uid != n.uid:
				problems = append(problems, fmt.Sprintf("%s (uid %s) holds block %s, claimed by %s (uid %s)", n.name, n.uid, b, c.node, c.uid))
			case c.lease != lease:
				problems = append(problems, fmt.Sprintf("%s holds block %s on lease %s, its claim is on %s", n.name, b,
					keyspace.LeaseHex(lease), keyspace.LeaseHex(c.lease)))
			case !n.agent.keeper.Holds(lease):
				problems = append(problems, fmt.Sprintf("%s holds block %s on lease %s, which it does not renew", n.name, b, keyspace.LeaseHex(lease)))
			}
		}
		for b, c := range claims {
			if c.node == n.name && c.uid == n.uid {
				if _, ok := spans[b]; !ok {
					problems = append(problems, fmt.Sprintf("%s's claim of block %s is not in its view", n.name, b))
				}
			}
		}
	}
	sort.Strings(problems)
	return problems
}

// blocksDump is the pool's claims and each live agent's blocks, for a failure report.
func (m *model) blocksDump() string {
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	var b strings.Builder
	resp, err := m.cli.Txn(ctx).Then(m.poolOps(func(p allocator.PoolSpec) string { return keyspace.BlocksPrefix(p.Name) })...).Commit()
	if err != nil {
		return err.Error()
	}
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			fmt.Fprintf(&b, "\n  %s on %s: %s", kv.Key, keyspace.LeaseHex(keyspace.LeaseOf(kv)), kv.Value)
		}
	}
	for _, n := range m.nodes {
		if n.agent == nil {
			fmt.Fprintf(&b, "\n  %s: dead", n.name)
			continue
		}
		var held []string
		for _, p := range m.pools {
			if v := n.agent.pools.ViewOf(p.Name); v != nil {
				for blk, s := range v.Inspect().Blocks {
					// What keeps the block this node's in the view (idleBlocks), and what it passes over.
					held = append(held, fmt.Sprintf("%s@%s leaving=%v emptySince=%s restored=%v %v", blk, keyspace.LeaseHex(s.Lease),
						s.Leaving, s.EmptySince.Format(time.TimeOnly), s.Restored, s.Why))
				}
			}
		}
		sort.Strings(held)
		fmt.Fprintf(&b, "\n  %s (uid %s) holds %v", n.name, n.uid, held)
	}
	return b.String()
}
