package leases

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/poolview"
)

// The cut-off part of TestModelRandomHistories (issues 23 and 27). A node is cut off from
// etcd: its agent is killed as by kill -9, its pod and node leases expire (revoked here, as
// etcd does a TTL after the last renewal), its block lease does not, and it comes back a few
// steps later with the same identity and state directory. Meanwhile its pods' addresses are
// held back by their held keys, on that block lease. A third of the cut-offs outlast the
// reuse delay: their block lease expires too, and with it every hold. Back, the node
// re-claims every pod: what nobody took is its pods' again, the rest is a conflict, resolved
// once the owner that took it lets it go. That a DEL answered is final is model_del_test.go's.
// A live migration's source cut off loses its addresses to its target, which its agent
// promotes; a target cut off takes its migration up again once back (model_migration_test.go).
//
//   - the reuse order: an ADD returns an address held back for a cut-off node's pod only when
//     the pool (that range set) had fewer never-held free addresses before the step than the
//     step ran ADDs: no allocation, quarantine or held key, and not an address whose last
//     holder expired without a release (m.expired); the IPv6 set never runs that low;
//   - held keys are sound: every address of a running pod has a held key naming its owner
//     and node, on a block lease its agent renews; while its node is away the key stays, on
//     the node's block lease, with no allocation; once the delay ran out nothing is left;
//   - a node back re-claims every pod, on a lease it renews, with every address nobody took;
//     each address another owner took is a conflict (Conflicts(), the conflict record, CHECK
//     code 104), and no other is; every conflict record stands for a conflict of the model;
//   - a conflict is resolved: once the owner that took the address lets it go (DEL, GC,
//     drain, its node's death, or a cut-off once its reuse delay ran out), the running pod
//     holds it again within modelResolveWait.

const (
	// modelReuseDelay is the model agents' Config.ReuseDelay: longer than any history, so that
	// a hold ends only when the model lets a cut-off node's block lease expire.
	modelReuseDelay = 5 * time.Minute
	// modelReclaimWait bounds how long an agent started after a cut-off or a crash, or one
	// that lost a pod lease, takes to hold every pod of its node again: far above what the
	// slowest run needs, so that running out of it means the pods are not re-claimed.
	modelReclaimWait = etcdtest.Patience
	// modelResolveWait bounds how long a running pod takes to hold again a conflicted address
	// once the owner that took it let it go (the agent watches the key); as generous.
	modelResolveWait = etcdtest.Patience
)

// stored is a key of etcd as the model reads it: its record and lease.
type stored[T any] struct {
	rec   T
	lease clientv3.LeaseID
}

// etcdState is what the cut-off checks read of etcd at once.
type etcdState struct {
	allocs    map[netip.Addr]stored[keyspace.Allocation]
	owners    map[string]stored[keyspace.OwnerRecord]    // by owner key
	held      map[netip.Addr]stored[keyspace.HeldRecord] // held keys
	conflicts map[string]stored[keyspace.ConflictRecord] // by conflict key
}

func (m *model) readState(ctx context.Context) etcdState {
	np := len(m.pools)
	ops := []clientv3.Op{clientv3.OpGet(keyspace.OwnersPrefix(m.cluster), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.ConflictsPrefix(m.cluster), clientv3.WithPrefix())}
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.IPsPrefix(p.Name) })...)
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.HeldPrefix(p.Name) })...)
	resp, err := m.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	st := etcdState{allocs: map[netip.Addr]stored[keyspace.Allocation]{}, owners: map[string]stored[keyspace.OwnerRecord]{},
		held: map[netip.Addr]stored[keyspace.HeldRecord]{}, conflicts: map[string]stored[keyspace.ConflictRecord]{}}
	for ri, r := range resp.Responses {
		// The kinds: 0 allocations, 1 owner indexes, 2 held keys, 3 conflict records.
		i := []int{1, 3}[min(ri, 1)]
		switch {
		case ri >= 2 && ri < 2+np:
			i = 0
		case ri >= 2+np:
			i = 2
		}
		for _, kv := range r.GetResponseRange().Kvs {
			key, lease := string(kv.Key), keyspace.LeaseOf(kv)
			switch i {
			case 0:
				_, _, ip, err := keyspace.ParseIPKey(key)
				rec, derr := keyspace.Decode[keyspace.Allocation](key, kv.Value)
				if err == nil && derr == nil {
					st.allocs[ip] = stored[keyspace.Allocation]{rec, lease}
				}
			case 1:
				if rec, err := keyspace.Decode[keyspace.OwnerRecord](key, kv.Value); err == nil {
					st.owners[key] = stored[keyspace.OwnerRecord]{rec, lease}
				}
			case 2:
				_, _, ip, err := keyspace.ParseHeldKey(key)
				rec, derr := keyspace.Decode[keyspace.HeldRecord](key, kv.Value)
				if err != nil || derr != nil {
					m.t.Errorf("held key %s: %v %v", key, err, derr)
					continue
				}
				st.held[ip] = stored[keyspace.HeldRecord]{rec, lease}
			case 3:
				if rec, err := keyspace.Decode[keyspace.ConflictRecord](key, kv.Value); err == nil {
					st.conflicts[key] = stored[keyspace.ConflictRecord]{rec, lease}
				} else {
					m.t.Errorf("conflict record %s: %v", key, err)
				}
			}
		}
	}
	return st
}

// ownerKey is the owner index of k in the model's pool: a sticky incarnation's
// (model_sticky_test.go). Others may be in other pools: ownerKeyAt, partsOf.
func (m *model) ownerKey(k attKey) string {
	return keyspace.OwnerKey(m.cluster, k.owner, k.ifName, m.pool.Name)
}

// takenIPs lists the addresses a conflict record names as taken, in order.
func takenIPs(rec keyspace.ConflictRecord) []netip.Addr {
	var out []netip.Addr
	for _, t := range rec.Taken {
		out = append(out, t.IP)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

func sortedAddrs(as []netip.Addr) []netip.Addr {
	out := slices.Clone(as)
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// awayLocked reports whether k's node is cut off. m.home is written only between a step's
// operations, so the operations may call it; m.mu is held.
func (m *model) awayLocked(k attKey) bool {
	ni, ok := m.home[k.owner]
	return ok && m.nodes[ni].away > 0
}

// awayOwner reports whether owner's pod runs on a cut-off node: nothing reaches it there.
func (m *model) awayOwner(owner string) bool {
	ni, ok := m.home[owner]
	return ok && m.nodes[ni].away > 0 && m.holds(owner)
}

// holderLocked returns the attachment that holds a in etcd as the model says: one listing
// it, for which it is not a conflict, on a connected node or on a cut-off one whose block
// leases still hold its pods' addresses back (an expiry is not a release: the agent of a
// running pod in conflict waits for the hold to end); else the owner an admin put over a
// running pod's allocation, while it holds it. m.mu is held.
func (m *model) holderLocked(a netip.Addr) (attKey, bool) {
	for k, held := range m.held {
		if slices.Contains(held, a) && !slices.Contains(m.conflict[k], a) && (!m.awayLocked(k) || m.nodes[m.home[k.owner]].holdsBack) {
			return k, true
		}
	}
	if in, ok := m.intruders[a]; ok { // an owner outside the model (model_audit_test.go)
		return attKey{owner: in.owner, ifName: modelIntruderIf}, true
	}
	return attKey{}, false
}

// attachmentsOn lists, in order, the attachments the model gives node ni.
func (m *model) attachmentsOn(ni int) []attKey {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []attKey
	for k := range m.held {
		if m.home[k.owner] == ni {
			out = append(out, k)
		}
	}
	sort.Slice(out, func(a, b int) bool { return out[a].owner+out[a].ifName < out[b].owner+out[b].ifName })
	return out
}

// admitLocked checks the addresses an ADD of k returned against what the model gives other
// attachments, and records those it took from a cut-off node's pods; m.mu is held. except is
// an attachment whose DEL ran at once and let them go (a sticky hand-over).
func (m *model) admitLocked(i int, k attKey, got []netip.Addr, except attKey) {
	for _, a := range got {
		// Its holder before this ADD: the loop below records it taken.
		h, held := m.holderLocked(a)
		if held && h == k || slices.Contains(m.conflict[k], a) {
			continue // a repeated ADD: k holds it, or lists it still while another owner does
		}
		for other, theirs := range m.held {
			if other == k || other == except || !slices.Contains(theirs, a) {
				continue
			}
			n := m.nodes[m.home[other.owner]]
			switch lost := slices.Contains(m.conflict[other], a); {
			case lost && n.away > 0:
				// Taken while its node was away, and let go since: nothing holds it back.
			case lost:
				if held {
					continue // the owner that took it holds it still: its case is its own
				}
				m.t.Errorf("step %d: ADD of %v returned %s, which the running pod %v is to get back (the owner that took it let it go)", i, k, a, other)
			case n.away > 0 && n.holdsBack:
				p := m.poolOf(a)
				if set, _ := p.SetOf(a); m.neverHeld == nil || m.neverHeld[p.Name][set] >= m.stepAdds {
					m.t.Errorf("step %d: ADD of %v returned %s, held back for %v on cut-off node %s, while the pool had %v addresses "+
						"no expired holder had (per range set) for the step's %d ADDs", i, k, a, other, n.name, m.neverHeld, m.stepAdds)
				}
				m.conflict[other] = append(m.conflict[other], a)
				m.awayTaken[other] = append(m.awayTaken[other], a)
				m.count["reuse"]++
			case n.away > 0:
				// The cut-off outlasted the reuse delay: the address is free.
				m.conflict[other] = append(m.conflict[other], a)
				m.awayTaken[other] = append(m.awayTaken[other], a)
				m.count["taken after the delay"]++
			default:
				m.t.Errorf("step %d: ADD of %v returned %s, which %v holds", i, k, a, other)
			}
		}
	}
}

// neverHeldFree counts, per pool and range set, the addresses etcd shows free that no expired holder
// had: no allocation, quarantine or held key, not in m.expired, and not kept by an agent after
// etcd went back in time (keptAfterRestore). It returns nil, reading
// nothing, while no cut-off node holds addresses back.
func (m *model) neverHeldFree(ctx context.Context) map[string][]int {
	if !slices.ContainsFunc(m.nodes, func(n *modelNode) bool { return n.holdsBack }) {
		return nil
	}
	ops := m.poolOps(func(p allocator.PoolSpec) string { return keyspace.IPsPrefix(p.Name) }, clientv3.WithKeysOnly())
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.QuarantinePrefix(p.Name) }, clientv3.WithKeysOnly())...)
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.HeldPrefix(p.Name) }, clientv3.WithKeysOnly())...)
	resp, err := m.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	used := map[netip.Addr]bool{}
	parse := []func(string) (string, netip.Prefix, netip.Addr, error){keyspace.ParseIPKey, keyspace.ParseQuarantineKey, keyspace.ParseHeldKey}
	for i, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			if _, _, ip, err := parse[i/len(m.pools)](string(kv.Key)); err == nil {
				used[ip] = true
			}
		}
	}
	m.mu.Lock()
	for a := range m.expired {
		used[a] = true
	}
	m.mu.Unlock()
	for a := range m.keptAfterRestore() {
		used[a] = true
	}
	free := map[string][]int{}
	for _, p := range m.pools {
		free[p.Name] = make([]int, len(p.Ranges))
		for s := range free[p.Name] {
			free[p.Name][s] = int(p.SetSize(s).Int64())
		}
	}
	for a := range used {
		p, _ := m.poolHolding(a) // a block kept after a restore may reach past the ranges
		if s, ok := p.SetOf(a); ok && p.Allocatable(a) == nil {
			free[p.Name][s]--
		}
	}
	return free
}

// keptAfterRestore is what the live agents' views pass over for the keep time after etcd
// went back in time: the addresses they knew taken that the restored etcd shows free, and the
// blocks the backup gave back to their node. A cut-off node's pod may still run on any of
// them, as on an address held back for it: a reuse of a held-back address while the only
// other room is there is not a reuse with room.
func (m *model) keptAfterRestore() map[netip.Addr]bool {
	kept := map[netip.Addr]bool{}
	for _, n := range m.nodes {
		if n.agent == nil {
			continue
		}
		n.agent.pools.ForEachView(func(v *poolview.View) {
			if !slices.ContainsFunc(m.pools, func(p allocator.PoolSpec) bool { return p.Name == v.Pool() }) {
				return
			}
			addrs, blocks := v.SettleKnowledge()
			for _, a := range addrs {
				kept[a] = true
			}
			for _, b := range blocks {
				for a := b.Masked().Addr(); b.Contains(a); a = a.Next() {
					kept[a] = true
				}
			}
		})
	}
	return kept
}

// crashNode kills node ni's agent as kill -9 would (crash: what its journal has not written
// yet is lost). With expire, every lease it renewed but its block leases and its sticky
// claims' leases then expires (revoked here, as etcd does a TTL after the last renewal): its
// pods' keys and its node record go, its block claims and its pods' held keys stay.
func (m *model) crashNode(ctx context.Context, i, ni int, expire bool) {
	n := m.nodes[ni]
	a := n.agent
	keep := claimLeaseSet(a)
	n.blockLeases = a.blockLeases.all()
	for _, id := range n.blockLeases {
		keep[id] = true
	}
	leases := slices.DeleteFunc(keptAlive(a), func(id clientv3.LeaseID) bool { return keep[id] })
	m.harvest(a)
	crash(a)
	n.agent = nil
	if !expire {
		return
	}
	m.mu.Lock()
	for k, held := range m.held {
		if m.home[k.owner] == ni {
			for _, ad := range held {
				if !slices.Contains(m.conflict[k], ad) {
					m.expired[ad] = true
				}
			}
		}
	}
	m.mu.Unlock()
	for _, id := range leases {
		m.revoke(ctx, i, id)
	}
}

// noteHeldOf marks expired the addresses held for node: its block lease is about to expire,
// taking their held keys, and an agent that read one may hold the address back until the
// time that lease's TTL said.
func (m *model) noteHeldOf(ctx context.Context, node string) {
	st := m.readState(ctx)
	m.mu.Lock()
	defer m.mu.Unlock()
	for a, h := range st.held {
		if h.rec.Node == node && h.rec.Cluster == m.cluster {
			m.expired[a] = true
		}
	}
}

// blockLeasesOf lists the leases of the pool's block claims of node identity (name, uid) and
// of the held keys of node name.
func (m *model) blockLeasesOf(ctx context.Context, name, uid string) []clientv3.LeaseID {
	resp, err := m.cli.Txn(ctx).Then(m.poolOps(func(p allocator.PoolSpec) string { return keyspace.BlocksPrefix(p.Name) })...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	seen := map[clientv3.LeaseID]bool{}
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			if rec, err := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value); err == nil && rec.Node == name && rec.NodeUID == uid {
				seen[keyspace.LeaseOf(kv)] = true
			}
		}
	}
	for _, h := range m.readState(ctx).held {
		if h.rec.Node == name && h.rec.Cluster == m.cluster {
			seen[h.lease] = true
		}
	}
	return slices.Collect(maps.Keys(seen))
}

// cutOff cuts one node off from etcd for a few steps (crashNode, its leases expiring but its
// block lease); its pods' addresses are held back for them meanwhile. A third of the
// cut-offs outlast the reuse delay: their block lease expires at a step before they come
// back (returns). It reports false when no node may be cut off now: one is away already, or
// fewer than two run.
func (m *model) cutOff(ctx context.Context, i int) bool {
	live := m.live()
	if len(live) < 2 || slices.ContainsFunc(m.nodes, func(n *modelNode) bool { return n.away > 0 }) {
		return false
	}
	ni := live[m.rng.IntN(len(live))]
	n := m.nodes[ni]
	n.away = i + 3 + m.rng.IntN(10)
	kind := "shorter"
	if m.rng.IntN(3) == 0 {
		n.expireAt = i + 1 + m.rng.IntN(3)
		n.away = n.expireAt + 3 + m.rng.IntN(8)
		kind = fmt.Sprintf("longer (the delay runs out at step %d)", n.expireAt)
		m.count["cut-off long"]++
	} else {
		m.count["cut-off short"]++
	}
	m.crashNode(ctx, i, ni, true)
	n.holdsBack = true
	m.log("%d %s CUT OFF until step %d, %s than the reuse delay: its pod and node leases expire, its block leases %v hold back %v",
		i, n.name, n.away, kind, leaseNames(n.blockLeases), m.attachmentsOn(ni))
	m.count["cut-off"]++
	m.cutOffMigrations(ctx, i, ni)
	return true
}

// revoke revokes lease as etcd does a TTL after its last renewal. The model remembers it: a
// restored backup may bring it back (model_restore_test.go).
func (m *model) revoke(ctx context.Context, i int, lease clientv3.LeaseID) {
	if _, err := m.cli.Revoke(ctx, lease); err != nil && !keyspace.IsLeaseNotFound(err) {
		m.t.Fatalf("step %d: revoke %s: %v", i, keyspace.LeaseHex(lease), err)
	}
	m.mu.Lock()
	m.revoked[lease] = true
	m.mu.Unlock()
}

func leaseNames(ids []clientv3.LeaseID) []string {
	out := make([]string, 0, len(ids))
	for _, id := range ids {
		out = append(out, keyspace.LeaseHex(id))
	}
	return out
}

// returns lets the block lease of a cut-off node whose reuse delay ran out expire (revoked
// here), and brings back, with their identity and state directory, the cut-off nodes whose
// time has come; with all, every cut-off node (settle).
func (m *model) returns(ctx context.Context, i int, all bool) {
	for ni, n := range m.nodes {
		if n.away == 0 {
			continue
		}
		if n.holdsBack && n.expireAt > 0 && i >= n.expireAt {
			m.noteHeldOf(ctx, n.name)
			for _, id := range append(m.blockLeasesOf(ctx, n.name, n.uid), n.blockLeases...) {
				m.revoke(ctx, i, id)
			}
			n.holdsBack = false
			m.log("%d %s: the reuse delay ran out, its block leases %v expire: its blocks and holds are gone", i, n.name, leaseNames(n.blockLeases))
		}
		if !all && i < n.away {
			continue
		}
		n.agent = m.start(n)
		n.away, n.expireAt, n.holdsBack, n.blockLeases = 0, 0, false, nil
		m.count["back"]++
		seen := m.awaitReclaims(i, ni)
		// The keys are written before the agent has looked back in etcd's history.
		deadline := time.Now().Add(etcdtest.Patience)
		for n.agent.Conflicts() < int64(seen.sure) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		got := n.agent.Conflicts()
		m.log("%d %s BACK (uid %s, same state directory): %d conflicts (the model: %d to %d)", i, n.name, n.uid, got, seen.sure, seen.maybe)
		m.count["conflict"] += seen.sure
		if got < int64(seen.sure) || got > int64(seen.maybe) {
			m.t.Errorf("step %d: %s came back and counted %d conflicts; the model has %d to %d (addresses other owners had meanwhile)",
				i, n.name, got, seen.sure, seen.maybe)
		}
		// A live migration's target on it takes its migration up again (model_migration_test.go).
		m.awaitMigrations(i, n.name+" came back")
	}
	m.endDisplaced(ctx, i)
}

// awaitReclaims waits until node ni's agent holds every pod the model gives the node: the
// owner index on a lease the agent renews, naming the container and every address, each
// allocated on that lease unless another attachment of the model holds it; those are the
// attachment's conflicts, which the conflict record lists, and which the model takes for its
// own. An address another running pod waits for (its conflict) may go either way: the
// re-claim is first, or that pod, which takes it back as soon as the lease expired. It
// returns how many addresses of the node's pods another owner had while it was away, held
// still or let go since: those the model is sure of, and at most.
func (m *model) awaitReclaims(i, ni int) (seen conflictsSeen) {
	n := m.nodes[ni]
	m.mu.Lock()
	var want reclaimWant
	want.ips, want.ctr = map[attKey][]netip.Addr{}, map[attKey]string{}
	want.taken, want.contested = map[attKey][]netip.Addr{}, map[attKey]map[netip.Addr]attKey{}
	want.takerAway = map[netip.Addr]attKey{}
	for k, held := range m.held {
		if m.home[k.owner] != ni {
			continue
		}
		want.ips[k], want.ctr[k] = held, m.ctr[k]
		for _, a := range held {
			if h, ok := m.holderLocked(a); ok && h != k {
				want.taken[k] = append(want.taken[k], a)
				if m.awayLocked(h) {
					want.takerAway[a] = h
				}
			} else if w, ok := m.waiterLocked(a, k); ok {
				if want.contested[k] == nil {
					want.contested[k] = map[netip.Addr]attKey{}
				}
				want.contested[k][a] = w
			}
		}
	}
	m.mu.Unlock()
	deadline := time.Now().Add(modelReclaimWait)
	var lost map[attKey][]netip.Addr
	for {
		var problems []string
		if lost, problems = m.reclaimProblems(n, want); len(problems) == 0 {
			break
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: %s does not hold its pods again after %s:\n  %s", i, n.name, modelReclaimWait, strings.Join(problems, "\n  "))
			return seen
		}
		time.Sleep(50 * time.Millisecond)
	}
	var notes []string
	m.mu.Lock()
	for k := range want.ips {
		for _, a := range lost[k] {
			if w, ok := want.contested[k][a]; ok { // the waiting pod was first
				m.conflict[w] = slices.DeleteFunc(slices.Clone(m.conflict[w]), func(x netip.Addr) bool { return x == a })
				if len(m.conflict[w]) == 0 {
					delete(m.conflict, w)
				}
				m.count["resolved"]++
				notes = append(notes, fmt.Sprintf("%d %v holds %s again: it was first when %v's lease expired", i, w, a, k))
			}
		}
		// The agent counts an address taken meanwhile and let go before the re-claim too:
		// its pod and another ran with it at once. One another attachment listed meanwhile
		// it may count or not: the model does not know whether that one held it. Nor does it
		// know about a conflict from before, whose owner let the address go meanwhile: the
		// agent counts it when the hold ran out and etcd's history shows that owner.
		sure := append(slices.Clone(m.awayTaken[k]), lost[k]...)
		maybe := slices.AppendSeq(slices.Clone(sure), maps.Keys(m.contended[k]))
		for _, a := range m.conflict[k] {
			if !slices.Contains(lost[k], a) {
				maybe = append(maybe, a)
			}
		}
		seen.sure, seen.maybe = seen.sure+countAddrs(sure), seen.maybe+countAddrs(maybe)
		delete(m.awayTaken, k)
		delete(m.contended, k)
		for _, a := range m.conflict[k] {
			if !slices.Contains(lost[k], a) { // the re-claim, or the resolution after it, took it back
				m.gotBackLocked(k, a)
				notes = append(notes, fmt.Sprintf("%d %v holds %s again: the owner that took it let it go", i, k, a))
			}
		}
		if len(lost[k]) > 0 {
			m.conflict[k] = lost[k]
		} else {
			delete(m.conflict, k)
		}
	}
	m.mu.Unlock()
	for _, note := range notes {
		m.log("%s", note)
	}
	return seen
}

// waiterLocked returns a running pod other than k waiting for a (its conflict); m.mu is held.
func (m *model) waiterLocked(a netip.Addr, k attKey) (attKey, bool) {
	for w, taken := range m.conflict {
		if w != k && slices.Contains(taken, a) && !m.awayLocked(w) {
			return w, true
		}
	}
	return attKey{}, false
}

// reclaimWant is what awaitReclaims expects of a node's pods: their addresses and
// containers, the addresses other attachments hold, and those other running pods wait for.
// conflictsSeen is how many addresses of a node's pods another owner had while it was away:
// those the model is sure of, and at most.
type conflictsSeen struct{ sure, maybe int }

func countAddrs(as []netip.Addr) int {
	as = slices.Clone(as)
	slices.SortFunc(as, netip.Addr.Compare)
	return len(slices.Compact(as))
}

// noteContended notes, at the end of a step, the addresses of each cut-off node's attachments
// that another attachment lists: it may have held them meanwhile.
func (m *model) noteContended() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k, held := range m.held {
		if !m.awayLocked(k) {
			continue
		}
		for other, theirs := range m.held {
			for _, a := range held {
				if other != k && slices.Contains(theirs, a) {
					if m.contended[k] == nil {
						m.contended[k] = map[netip.Addr]bool{}
					}
					m.contended[k][a] = true
				}
			}
		}
	}
}

type reclaimWant struct {
	ips, taken map[attKey][]netip.Addr
	ctr        map[attKey]string
	contested  map[attKey]map[netip.Addr]attKey
	// The taken addresses whose taker's node is cut off: its allocation may have expired,
	// and its held key keeps the address from the re-claim.
	takerAway map[netip.Addr]attKey
}

// reclaimProblems says what of want etcd and the agent do not show yet, and which addresses
// each attachment lost (the taken ones and the contested ones its waiter got).
func (m *model) reclaimProblems(n *modelNode, want reclaimWant) (lost map[attKey][]netip.Addr, out []string) {
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	st := m.readState(ctx)
	lost = map[attKey][]netip.Addr{}
	for k, all := range want.ips {
		lease, held := n.agent.pods.Lease(k.owner)
		if !held {
			out = append(out, fmt.Sprintf("%v: the agent holds no lease of its pod", k))
			continue
		}
		// Each pool's part of the attachment: its owner index, addresses and conflict record.
		for _, part := range m.partsOf(k, all) {
			out = append(out, m.reclaimPartProblems(st, k, part, lease, want, lost)...)
		}
	}
	sort.Strings(out)
	return lost, out
}

// reclaimPartProblems is reclaimProblems for part of attachment k, whose pod is on lease; it
// adds to lost[k] the addresses of part k lost.
func (m *model) reclaimPartProblems(st etcdState, k attKey, part modelPart, lease clientv3.LeaseID, want reclaimWant,
	lost map[attKey][]netip.Addr) (out []string) {
	ips := part.ips
	ix, indexed := st.owners[part.ownerKey]
	switch {
	case !indexed:
		return []string{fmt.Sprintf("%v: no owner index in pool %s", k, part.pool)}
	case ix.lease != lease || ix.rec.ContainerID != want.ctr[k] || !slices.Equal(ix.rec.IPs, ips):
		return []string{fmt.Sprintf("%v: owner index on %s names %s %v, want on %s %s %v", k, keyspace.LeaseHex(ix.lease),
			ix.rec.ContainerID, ix.rec.IPs, keyspace.LeaseHex(lease), want.ctr[k], ips)}
	}
	for _, a := range ips {
		al, ok := st.allocs[a]
		mine := ok && al.rec.Owner == k.owner && al.lease == lease
		w, contested := want.contested[k][a]
		switch {
		case slices.Contains(want.taken[k], a):
			if taker, away := want.takerAway[a]; away && !ok {
				if h, held := st.held[a]; !held || h.rec.Owner != taker.owner {
					out = append(out, fmt.Sprintf("%v: %s, which %v on a cut-off node took, is not held back for it (%+v)", k, a, taker, h.rec))
				}
			} else if !ok || al.rec.Owner == k.owner {
				out = append(out, fmt.Sprintf("%v: %s, which another owner took, is not that owner's (%+v)", k, a, al.rec))
			}
			lost[k] = append(lost[k], a)
		case contested && ok && al.rec.Owner == w.owner && al.rec.IfName == w.ifName:
			lost[k] = append(lost[k], a)
		case !mine:
			out = append(out, fmt.Sprintf("%v: %s is not allocated on its lease %s (%+v)", k, a, keyspace.LeaseHex(lease), al.rec))
		}
	}
	rec, recorded := st.conflicts[part.conflict]
	mine := m.inPart(part, lost[k])
	switch {
	case len(mine) == 0 && recorded:
		out = append(out, fmt.Sprintf("%v: a conflict record %v in pool %s, and nothing was taken", k, takenIPs(rec.rec), part.pool))
	case len(mine) > 0 && !slices.Equal(takenIPs(rec.rec), sortedAddrs(mine)):
		out = append(out, fmt.Sprintf("%v: the conflict record names %v taken, the model %v", k, takenIPs(rec.rec), sortedAddrs(mine)))
	}
	return out
}

// gotBackLocked gives a back to k, which had it in conflict; m.mu is held. The owner that
// took it may be a pod of a cut-off node whose hold ran out: the running pod that had it
// first has it again, and that pod, back, has a conflict.
func (m *model) gotBackLocked(k attKey, a netip.Addr) {
	m.conflict[k] = slices.DeleteFunc(slices.Clone(m.conflict[k]), func(x netip.Addr) bool { return x == a })
	if len(m.conflict[k]) == 0 {
		delete(m.conflict, k)
	}
	for other, theirs := range m.held {
		if other != k && slices.Contains(theirs, a) && !slices.Contains(m.conflict[other], a) {
			m.conflict[other] = append(m.conflict[other], a)
			if m.awayLocked(other) {
				m.awayTaken[other] = append(m.awayTaken[other], a)
			}
		}
	}
	// A claim released since its holder took a from this pod gives a up (claimGivesUp).
	if ord := m.claimOfAddrLocked(a); ord != "" && m.stsOf[k.owner] != ord {
		if _, live := m.incarnationLocked(ord, ""); !live {
			m.claimIPs[ord] = slices.DeleteFunc(slices.Clone(m.claimIPs[ord]), func(x netip.Addr) bool { return x == a })
			if len(m.claimIPs[ord]) == 0 {
				delete(m.claimIPs, ord)
				delete(m.claimTakers, ord)
			}
			m.count["claim gave up"]++
		}
	}
	m.count["resolved"]++
}

// resolve waits, after a step, until each running pod whose conflicted address the owner
// that took it let go holds it again, and gives it back to that pod in the model.
func (m *model) resolve(i int) {
	type back struct {
		k attKey
		a netip.Addr
	}
	m.mu.Lock()
	var due []back
	for k, taken := range m.conflict {
		if m.awayLocked(k) {
			continue
		}
		for _, a := range taken {
			if _, held := m.holderLocked(a); !held {
				due = append(due, back{k, a})
			}
		}
	}
	m.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), modelResolveWait+5*time.Second)
	defer cancel()
	deadline := time.Now().Add(modelResolveWait)
	won := map[netip.Addr]bool{} // two running pods may wait for one address: one gets it
	for len(due) > 0 {
		st := m.readState(ctx)
		due = slices.DeleteFunc(due, func(b back) bool {
			al, ok := st.allocs[b.a]
			ix, indexed := st.owners[m.ownerKeyAt(b.k, b.a)]
			if !ok || !indexed || al.rec.Owner != b.k.owner || al.rec.IfName != b.k.ifName || al.lease != ix.lease {
				return false
			}
			won[b.a] = true
			m.mu.Lock()
			m.gotBackLocked(b.k, b.a)
			m.mu.Unlock()
			m.log("%d %v holds %s again: the owner that took it let it go", i, b.k, b.a)
			return true
		})
		due = slices.DeleteFunc(due, func(b back) bool { return won[b.a] }) // the others wait on
		if len(due) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, b := range due {
				m.t.Errorf("step %d: the owner that took %s from the running pod %v let it go, and %s later the pod does not hold it "+
					"again (allocation %+v)", i, b.a, b.k, modelResolveWait, st.allocs[b.a])
			}
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkHolds checks, at a quiet point, the held keys and conflicts against the model: each
// address of a running pod has a held key of its owner and node on a block lease its agent
// renews; each conflicted address is listed by the running pod's owner index and conflict
// record and held by the model's holder; a cut-off node's pods have no key but their held
// keys, while their node holds them back; every conflict record is a conflict of the model.
// The caller holds m.mu.
func (m *model) checkHolds(st etcdState) {
	records, indexes := map[string]bool{}, map[string]bool{}
	for _, tgt := range m.targets {
		indexes[m.ownerKey(tgt.k)] = true // checked with its holder's (checkMigrations)
	}
	for k, held := range m.held {
		n := m.nodes[m.home[k.owner]]
		for _, part := range m.partsOf(k, held) {
			indexes[part.ownerKey] = true
			taken := m.inPart(part, m.conflict[k])
			if c, ok := st.conflicts[part.conflict]; ok {
				records[part.conflict] = true
				if got := takenIPs(c.rec); n.away > 0 || !slices.Equal(got, sortedAddrs(taken)) {
					m.t.Errorf("the conflict record of %v in pool %s names %v taken; the model: %v (node %s away: %v)", k, part.pool, got,
						sortedAddrs(taken), n.name, n.away > 0)
				}
			} else if len(taken) > 0 && n.away == 0 {
				m.t.Errorf("%v lost %v to other owners, and has no conflict record in pool %s", k, taken, part.pool)
			}
			if ix, indexed := st.owners[part.ownerKey]; n.away > 0 && indexed {
				m.t.Errorf("%v is on cut-off node %s, and its owner index is in etcd: %+v", k, n.name, ix.rec)
			}
		}
		taken := m.conflict[k]
		for _, a := range held {
			ix, indexed := st.owners[m.ownerKeyAt(k, a)]
			al, allocated := st.allocs[a]
			h, holdKey := st.held[a]
			if slices.Contains(taken, a) {
				holder, ok := m.holderLocked(a)
				switch {
				case n.away == 0 && (!indexed || !slices.Contains(ix.rec.IPs, a)):
					m.t.Errorf("%v: its owner index does not list %s, which another owner took: %+v", k, a, ix.rec)
				case ok && m.awayLocked(holder) && (allocated || !holdKey || h.rec.Owner != holder.owner):
					m.t.Errorf("%v lost %s to %v, whose node is cut off: etcd should hold it back for it (allocation %v %+v, held key %v %+v)",
						k, a, holder, allocated, al.rec, holdKey, h.rec)
				case ok && !m.awayLocked(holder) && (!allocated || al.rec.Owner != holder.owner):
					m.t.Errorf("%v lost %s to %v, which etcd does not show allocated to it: %+v", k, a, holder, al.rec)
				case !ok && n.away == 0:
					m.t.Errorf("%v lost %s to an owner that let it go, and does not hold it again", k, a)
				}
				continue
			}
			switch {
			case n.away > 0 && allocated:
				m.t.Errorf("%s of %v on cut-off node %s is allocated to %s", a, k, n.name, al.rec.Owner)
			case n.away > 0 && n.holdsBack && (!holdKey || h.rec.Owner != k.owner || h.rec.Node != n.name || !slices.Contains(n.blockLeases, h.lease)):
				m.t.Errorf("%s of %v is not held back while %s is away: held key %v %+v on %s, want on its block leases %v",
					a, k, n.name, holdKey, h.rec, keyspace.LeaseHex(h.lease), leaseNames(n.blockLeases))
			case n.away > 0 && !n.holdsBack && holdKey:
				m.t.Errorf("%s of %v: the block lease of cut-off node %s expired, and a held key is left: %+v", a, k, n.name, h.rec)
			case n.away == 0 && (!holdKey || h.rec.Owner != k.owner || h.rec.Node != n.name):
				m.t.Errorf("%s of %v has no held key of its own: %v %+v", a, k, holdKey, h.rec)
			case n.away == 0 && !(n.agent.blockLeases.mine(h.lease) && n.agent.keeper.Holds(h.lease)):
				m.t.Errorf("the held key of %s of %v is on lease %s, not one of the block leases %s renews (%v): after a cut-off its "+
					"hold would end when that lease does", a, k, keyspace.LeaseHex(h.lease), n.name, leaseNames(n.agent.blockLeases.all()))
			}
		}
	}
	for key, ix := range st.owners {
		if !indexes[key] {
			m.t.Errorf("owner index %s (%s %v on node %s) stands for no attachment the model gives addresses: it was deleted or never added",
				key, ix.rec.ContainerID, ix.rec.IPs, ix.rec.Node)
		}
	}
	for key, c := range st.conflicts {
		if !records[key] {
			m.t.Errorf("conflict record %s (%v taken) stands for no attachment the model gives addresses", key, takenIPs(c.rec))
		}
	}
}
