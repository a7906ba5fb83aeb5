package leases

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The part of TestModelRandomHistories where etcd goes back in time (issue 32). At random
// steps the model backs etcd up as `etcdctl snapshot save` does; at a later one it restores a
// backup of a random earlier step while the agents run, as an operator does: the member stops,
// `etcdutl snapshot restore` (etcd's own code) writes a new data directory, and the member
// starts on it at the same URLs, where the agents' clients find it again by themselves.
// Restores alternate between the two ways etcd's documentation gives: plain (the revision goes
// back to the backup's), and `--bump-revision --mark-compacted` (the revision jumps forward,
// every watch is compacted), recommended under Kubernetes. ADDs run at once on random nodes,
// while the agents notice and repair.
//
//   - no ADD gets an address the model gives another attachment (admitLocked), then or later;
//     an ADD may be refused while its node repairs, naming etcd going back in time, and a
//     repeated ADD returns the pod's addresses;
//   - the repair ends: every agent holds every pod of its node again, on a lease it renews,
//     with its pod record, owner index and allocations, and its sticky claim (record and
//     quarantine keys on the claim lease the owner index names), and answers ADDs again (no
//     lost pod, hold open); a claim the backup brought back naming a holder of a live node
//     deleted since is released, and one it took that the model's ordinal has is back unless
//     every agent that took it died since (claimKeptLocked: then it is lost, as documented); an
//     address that another attachment of the model listed before the restore
//     holds now is a conflict (the conflict record), resolved as any other;
//   - what the restore brought back of pods deleted since goes, with their leases, which
//     nobody renews: no allocation, owner index, pod record or conflict record is left that
//     is not of an attachment of the model;
//   - then every check of the model holds again, and in the steps after.
//
// The leases the model let expire come back with the backup, with their whole TTL: a pod or
// node lease expires again within its TTL unless an agent takes it up again; a block lease
// stands for the reuse delay, which the model shortens to a few steps, and what the restore
// gives it back the model shortens to nothing: it revokes it again at once. A block lease the
// restore brings back that the model never let expire (an agent revoked it itself) goes the
// same way once the agents have repaired, if no agent renews it (expireUnrenewed). A restore
// waits while a node is cut off or an owner outside the model holds a running pod's address,
// and comes at most once per modelRestoreEvery steps.

const (
	// modelRepairWait bounds how long the agents take, after a restore, to hold every pod of
	// their nodes again and let what the backup brought back of deleted pods expire (a lease
	// TTL): far more than both.
	modelRepairWait = 60 * time.Second
	// modelBump is the revision bump of a restore `--bump-revision --mark-compacted`: the
	// figure etcd's documentation gives.
	modelBump = 1_000_000_000
	// modelEtcdBack bounds how long the model's client takes to reach the restored member.
	modelEtcdBack = 30 * time.Second
	// modelRestoreEvery is how many steps a history runs per restore at most: each waits a
	// lease TTL for what it brought back to expire.
	modelRestoreEvery = 75
)

// modelBackup is a backup of etcd the model took at a step.
type modelBackup struct {
	path string
	step int
	// access is the pool's access and rules at the backup (model_access_test.go), dual the
	// dual-stack network's (model_dual_test.go).
	access modelAccess
	dual   modelDual
}

// backup saves etcd as `etcdctl snapshot save` does, at the quiet point at the start of step i.
func (m *model) backup(ctx context.Context, i int) {
	m.mu.Lock()
	b := modelBackup{path: filepath.Join(m.backupDir, fmt.Sprintf("step%d.db", i)), step: i, access: m.access, dual: m.dual}
	m.mu.Unlock()
	if err := m.etcd.Snapshot(ctx, b.path); err != nil {
		m.t.Fatalf("step %d: %v", i, err)
	}
	m.backups = append(m.backups, b)
	m.log("%d BACKUP of etcd (etcdctl snapshot save)", i)
	m.count["backup"]++
}

// restore brings etcd back to a backup of a random earlier step while the agents run, runs
// ADDs at once, and waits for the repair (awaitRepair). It reports false when there is no
// backup yet, a node is cut off, an owner outside the model holds a running pod's address, or
// the history had its share of restores.
func (m *model) restore(ctx context.Context, i int) bool {
	return m.restoreIf(ctx, i, m.count["restore"] <= i/modelRestoreEvery)
}

// restoresAtEnd makes sure a history exercised both ways of restoring: the steps' own
// restores depend on the state (no node away, no intruder), which the timing of a loaded
// machine can change; at the end, with every node back, the missing ones run.
func (m *model) restoresAtEnd(ctx context.Context, i int) {
	for range 2 {
		if m.count["restore plain"] > 0 && m.count["restore bumped"] > 0 {
			return
		}
		if len(m.backups) == 0 {
			m.backup(ctx, i)
		}
		if !m.restoreIf(ctx, i, true) {
			return
		}
	}
}

// restoreIf is restore when ok, with a history's share of restores left aside.
func (m *model) restoreIf(ctx context.Context, i int, ok bool) bool {
	if len(m.backups) == 0 || len(m.intruders) > 0 || !ok ||
		slices.ContainsFunc(m.nodes, func(n *modelNode) bool { return n.away > 0 }) {
		return false
	}
	b := m.backups[m.rng.IntN(len(m.backups))]
	var bump uint64
	how := "plain"
	if m.count["restore"]%2 == 1 {
		bump, how = modelBump, "bumped"
	}
	m.mu.Lock()
	before := maps.Clone(m.held)
	m.mu.Unlock()
	start := time.Now()
	if err := m.etcd.Restore(b.path, bump); err != nil {
		m.t.Fatalf("step %d: %v", i, err)
	}
	m.awaitEtcd(i)
	m.mu.Lock()
	m.access, m.dual = b.access, b.dual // the pool records and the rules are keys: they went back too
	m.mu.Unlock()
	m.log("%d etcd RESTORED from the backup of step %d, %s (revision bump %d), in %s", i, b.step, how, bump, time.Since(start).Round(time.Millisecond))
	m.count["restore"]++
	m.count["restore "+how]++
	m.expireAgain(i)
	// ADDs at once, new and repeated, on random nodes.
	used := map[string]bool{}
	var plan []modelOp
	for range 1 + m.rng.IntN(3) {
		owner := fmt.Sprintf("pod%02d", m.rng.IntN(24))
		if used[owner] || m.ordinalOf(owner) != "" {
			continue
		}
		used[owner] = true
		k := attKey{owner: owner, ifName: modelIfNames[m.rng.IntN(len(modelIfNames))]}
		plan = append(plan, modelOp{node: m.homeOf(owner), k: k})
	}
	m.expectAdds(m.neverHeldFree(ctx), len(plan))
	m.repairing = true
	var wg sync.WaitGroup
	for _, p := range plan {
		wg.Go(func() { m.do(ctx, i, p.node, p.k, 0, 0, used) })
	}
	wg.Wait()
	m.repairing = false
	// Each live migration goes on, or its target was promoted: its source's keys were gone
	// when the target's agent looked (its re-claim dropping what the restore brought back on
	// a lease it left, say). The source finds the addresses its target's: conflicts, as of
	// an attachment that held them before the restore.
	targets := m.targetsOn(-1)
	for _, ord := range m.awaitMigrationsFor(i, "etcd was restored", modelRepairWait) {
		before[targets[ord].k] = targets[ord].ips
	}
	m.awaitRepair(i, start, before)
	m.endDisplaced(ctx, i)
	m.expireUnrenewed(i)
	m.awaitRulesSeen(i)
	return true
}

// awaitEtcd waits until the model's client reaches the restored member.
func (m *model) awaitEtcd(i int) {
	deadline := time.Now().Add(modelEtcdBack)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := m.cli.Get(ctx, "health", clientv3.WithCountOnly())
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			m.t.Fatalf("step %d: the restored etcd does not answer after %s: %v", i, modelEtcdBack, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// expireAgain revokes again the block leases the model let expire that the restore brought
// back (see the top of this file), and counts the others that came back.
func (m *model) expireAgain(i int) {
	ctx, cancel := context.WithTimeout(context.Background(), modelEtcdBack)
	defer cancel()
	m.mu.Lock()
	ids := slices.Sorted(maps.Keys(m.revoked))
	m.mu.Unlock()
	var ttl time.Duration
	for _, n := range m.nodes {
		if n.agent != nil {
			ttl = n.agent.cfg.LeaseTTL
		}
	}
	var again, back []string
	for _, id := range ids {
		resp, err := m.cli.TimeToLive(ctx, id)
		if err != nil {
			m.t.Fatalf("step %d: look up lease %s: %v", i, keyspace.LeaseHex(id), err)
		}
		if resp.TTL <= 0 {
			continue
		}
		if time.Duration(resp.GrantedTTL)*time.Second <= ttl {
			back = append(back, keyspace.LeaseHex(id))
			continue
		}
		if _, err := m.cli.Revoke(ctx, id); err != nil && !keyspace.IsLeaseNotFound(err) {
			m.t.Fatalf("step %d: revoke %s: %v", i, keyspace.LeaseHex(id), err)
		}
		again = append(again, keyspace.LeaseHex(id))
	}
	m.log("%d the restore brought back leases the model let expire: pod and node leases %v (they expire within their TTL unless an agent "+
		"takes them up), block leases %v (revoked again)", i, back, again)
}

// expireUnrenewed revokes, once the agents repaired what a restore changed, the block leases
// it brought back that no agent renews (nor will): leases the model never let expire, which
// expireAgain does not know, such as one an agent revoked itself when it stopped with no pod
// left (Close), or one of a node identity replaced since under a new node UID whose older
// lease was gone before that node died. etcd keeps a restored lease with its whole TTL and
// expires it when that runs out without a renewal, as any other lease: what the backup put
// on it, block claims and held keys, goes with it, a block-lease TTL (1.5 x (TTL + reuse
// delay)) after the restore. The model shortens that wait to nothing, as it does for every
// lease it lets expire, once the agents had their chance to take such a lease up again: an
// agent adopts a block lease of its own identity that the node record names when it
// registers, or that its claims are on when it lists a pool it serves (sortClaims). So no
// lease is revoked that an agent holds, nor one whose claims name a live node that follows
// the pool (that agent must adopt them; checkViews says whether it did), nor one of a
// cut-off node still holding its pods' addresses back (holdsBack): those are renewed, or
// the model lets them expire itself (returns).
func (m *model) expireUnrenewed(i int) {
	ctx, cancel := context.WithTimeout(context.Background(), modelEtcdBack)
	defer cancel()
	// Per pool, its block claims, held keys and wanted keys.
	ops := m.poolOps(func(p allocator.PoolSpec) string { return keyspace.BlocksPrefix(p.Name) })
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.HeldPrefix(p.Name) })...)
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.WantedPrefix(p.Name, p.Blocks, netip.Addr{}) })...)
	resp, err := m.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		m.t.Fatalf("step %d: %v", i, err)
	}
	var ttl time.Duration
	for _, n := range m.nodes {
		if n.agent != nil {
			ttl = n.agent.cfg.LeaseTTL
		}
	}
	keep := map[clientv3.LeaseID]bool{} // renewed, or to be adopted by a live node
	leases := map[clientv3.LeaseID]bool{}
	for _, n := range m.nodes {
		for _, id := range n.blockLeases {
			keep[id] = keep[id] || n.holdsBack
		}
	}
	for ri, rr := range resp.Responses {
		pool := m.pools[ri%len(m.pools)].Name
		for _, kv := range rr.GetResponseRange().Kvs {
			lease := keyspace.LeaseOf(kv)
			if lease == 0 {
				continue
			}
			leases[lease] = true
			switch ri / len(m.pools) {
			case 0:
				rec, err := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value)
				if err != nil || m.holdsBackFor(rec.Node, rec.NodeUID) {
					keep[lease] = true
				}
				for _, n := range m.nodes {
					if n.agent != nil && n.name == rec.Node && n.uid == rec.NodeUID && n.agent.pools.ViewOf(pool) != nil {
						keep[lease] = true
					}
				}
			case 1:
				// A held key names its node by name only.
				rec, err := keyspace.Decode[keyspace.HeldRecord](string(kv.Key), kv.Value)
				if err != nil || slices.ContainsFunc(m.nodes, func(n *modelNode) bool { return n.holdsBack && n.name == rec.Node }) {
					keep[lease] = true
				}
			}
		}
	}
	var gone []string
	for _, id := range slices.Sorted(maps.Keys(leases)) {
		if keep[id] || slices.ContainsFunc(m.nodes, func(n *modelNode) bool { return n.agent != nil && n.agent.keeper.Holds(id) }) {
			continue
		}
		r, err := m.cli.TimeToLive(ctx, id)
		if err != nil {
			m.t.Fatalf("step %d: look up lease %s: %v", i, keyspace.LeaseHex(id), err)
		}
		if r.TTL <= 0 || time.Duration(r.GrantedTTL)*time.Second <= ttl {
			continue // gone, or not a block lease
		}
		m.revoke(ctx, i, id)
		gone = append(gone, keyspace.LeaseHex(id))
	}
	if len(gone) > 0 {
		m.log("%d the restore brought back block leases no agent renews, which etcd expires after their TTL: %v (revoked)", i, gone)
		m.count["unrenewed block lease after a restore"] += len(gone)
	}
}

// awaitRepair waits until the agents hold every pod the model gives their nodes again, and
// the keys the restore brought back of attachments the model no longer has are gone; then it
// takes the conflicts it finds for the model's. An address another attachment of the model
// listed before the restore (before) may be that one's now: a conflict of the other.
func (m *model) awaitRepair(i int, start time.Time, before map[attKey][]netip.Addr) {
	deadline := time.Now().Add(modelRepairWait)
	ghosts := map[netip.Addr]bool{}
	var taken map[attKey][]netip.Addr
	for {
		var problems []string
		taken, problems = m.repairProblems(before, ghosts)
		if len(problems) == 0 {
			break
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: %s after etcd was restored from a backup, the agents have not repaired what it changed:\n  %s",
				i, modelRepairWait, strings.Join(problems, "\n  "))
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	var notes []string
	m.mu.Lock()
	for k := range m.held {
		was, now := m.conflict[k], taken[k]
		for _, a := range was {
			if !slices.Contains(now, a) {
				m.count["resolved"]++
				notes = append(notes, fmt.Sprintf("%d %v holds %s again", i, k, a))
			}
		}
		for _, a := range now {
			if !slices.Contains(was, a) {
				m.count["conflict after a restore"]++
				notes = append(notes, fmt.Sprintf("%d %v: %s is another attachment's since the restore: a conflict", i, k, a))
			}
		}
		if len(now) > 0 {
			m.conflict[k] = now
		} else {
			delete(m.conflict, k)
		}
	}
	for a := range ghosts {
		m.expired[a] = true // held by a pod the restore brought back, expired since
	}
	m.mu.Unlock()
	for _, note := range notes {
		m.log("%s", note)
	}
	m.log("%d every agent holds its pods again, and what the restore brought back of deleted pods is gone, %s after the restore",
		i, time.Since(start).Round(time.Millisecond))
}

// repairProblems says what of the repair etcd and the agents do not show yet, and which
// addresses of each attachment another attachment of the model holds (listed before the
// restore). It adds to ghosts the addresses an owner outside the model holds.
func (m *model) repairProblems(before map[attKey][]netip.Addr, ghosts map[netip.Addr]bool) (taken map[attKey][]netip.Addr, out []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st := m.readState(ctx)
	resp, err := m.cli.Get(ctx, keyspace.NodesPrefix(m.cluster), clientv3.WithPrefix())
	if err != nil {
		m.t.Fatal(err)
	}
	podRecs := map[string]clientv3.LeaseID{}
	for _, kv := range resp.Kvs {
		if strings.Contains(string(kv.Key), "/pods/") {
			podRecs[string(kv.Key)] = keyspace.LeaseOf(kv)
		}
	}
	sticky, err := m.cli.Txn(ctx).Then(clientv3.OpGet(keyspace.ClaimsPrefix(m.cluster), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.QuarantinePrefix(m.pool.Name), clientv3.WithPrefix())).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	for _, n := range m.nodes {
		if n.agent == nil {
			continue
		}
		if lost := n.agent.pods.Lost(); len(lost) > 0 {
			out = append(out, fmt.Sprintf("%s re-claims %v still", n.name, lost))
		}
		if !holdOpen(n.agent) {
			out = append(out, fmt.Sprintf("%s holds its ADDs still", n.name))
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	taken = map[attKey][]netip.Addr{}
	ours := map[string]bool{}     // owner index and conflict record keys of the model's attachments
	owns := map[netip.Addr]bool{} // allocations of them
	pods := map[string]bool{}     // their pod records
	for k, all := range m.held {
		n := m.nodes[m.home[k.owner]]
		pods[keyspace.PodKey(m.cluster, n.name, k.owner)] = true
		parts := m.partsOf(k, all)
		for _, part := range parts {
			ours[part.ownerKey], ours[part.conflict] = true, true
		}
		lease, held := n.agent.pods.Lease(k.owner)
		if !held {
			out = append(out, fmt.Sprintf("%v: %s holds no lease of its pod", k, n.name))
			continue
		}
		if on, ok := podRecs[keyspace.PodKey(m.cluster, n.name, k.owner)]; !ok || on != lease {
			out = append(out, fmt.Sprintf("%v: pod record on lease %s (present %v), want on %s", k, keyspace.LeaseHex(on), ok, keyspace.LeaseHex(lease)))
		}
		for _, part := range parts {
			ips := part.ips
			ix, indexed := st.owners[part.ownerKey]
			switch {
			case !indexed:
				out = append(out, fmt.Sprintf("%v: no owner index in pool %s", k, part.pool))
				continue
			case ix.lease != lease || ix.rec.ContainerID != m.ctr[k] || !slices.Equal(ix.rec.IPs, ips):
				out = append(out, fmt.Sprintf("%v: owner index on %s names %s %v, want on %s %s %v", k, keyspace.LeaseHex(ix.lease),
					ix.rec.ContainerID, ix.rec.IPs, keyspace.LeaseHex(lease), m.ctr[k], ips))
				continue
			}
			var lost []netip.Addr
			for _, a := range ips {
				al, ok := st.allocs[a]
				other := attKey{owner: al.rec.Owner, ifName: al.rec.IfName}
				switch {
				case ok && other == k && al.lease == lease:
					owns[a] = true
				case ok && other != k && slices.Contains(before[other], a) && slices.Contains(m.held[other], a):
					lost = append(lost, a)
				case ok:
					out = append(out, fmt.Sprintf("%v: %s is allocated to %v on lease %s", k, a, other, keyspace.LeaseHex(al.lease)))
				default:
					out = append(out, fmt.Sprintf("%v: %s is not allocated", k, a))
				}
			}
			taken[k] = append(taken[k], lost...)
			rec, recorded := st.conflicts[part.conflict]
			switch {
			case len(lost) == 0 && recorded:
				out = append(out, fmt.Sprintf("%v: a conflict record %v in pool %s, and it holds every address", k, takenIPs(rec.rec), part.pool))
			case len(lost) > 0 && !slices.Equal(takenIPs(rec.rec), sortedAddrs(lost)):
				out = append(out, fmt.Sprintf("%v: the conflict record names %v taken, etcd shows %v", k, takenIPs(rec.rec), sortedAddrs(lost)))
			}
		}
	}
	out = append(out, m.targetRepairProblemsLocked(st, podRecs, pods, ours)...)
	out = append(out, m.claimRepairProblemsLocked(sticky.Responses[0].GetResponseRange().Kvs,
		sticky.Responses[1].GetResponseRange().Kvs, st.owners)...)
	// What the restore brought back of attachments the model does not have.
	for a, al := range st.allocs {
		if !owns[a] && !m.intrudedLocked(a) && !slices.Contains(m.held[attKey{owner: al.rec.Owner, ifName: al.rec.IfName}], a) {
			ghosts[a] = true
			out = append(out, fmt.Sprintf("allocation %s of %s/%s on lease %s (renewed by %v), an attachment the model does not have", a,
				al.rec.Owner, al.rec.IfName, keyspace.LeaseHex(al.lease), m.renewers(al.lease)))
		}
	}
	for key, ix := range st.owners {
		if !ours[key] {
			out = append(out, fmt.Sprintf("owner index %s (%v on lease %s) of an attachment the model does not have", key, ix.rec.IPs, keyspace.LeaseHex(ix.lease)))
		}
	}
	for key, c := range st.conflicts {
		if !ours[key] {
			out = append(out, fmt.Sprintf("conflict record %s (%v) of an attachment the model does not have", key, takenIPs(c.rec)))
		}
	}
	for key, lease := range podRecs {
		if !pods[key] {
			out = append(out, fmt.Sprintf("pod record %s on lease %s of a pod the model does not have", key, keyspace.LeaseHex(lease)))
		}
	}
	sort.Strings(out)
	return taken, out
}

// targetRepairProblemsLocked is repairProblems for the targets of live migrations, m.mu
// held: each re-claimed by its node's agent, its pod record and owner index on the lease the
// agent holds (its migration key, written with the owner index, checkMigrations checks). It
// adds their pod record and owner index keys to pods and ours.
func (m *model) targetRepairProblemsLocked(st etcdState, podRecs map[string]clientv3.LeaseID, pods, ours map[string]bool) (out []string) {
	for _, ord := range sortedKeys(m.targets) {
		tgt := m.targets[ord]
		n := m.nodes[m.home[tgt.k.owner]]
		podKey, ownerKey := keyspace.PodKey(m.cluster, n.name, tgt.k.owner), keyspace.OwnerKey(m.cluster, tgt.k.owner, tgt.k.ifName, m.pool.Name)
		pods[podKey], ours[ownerKey] = true, true
		if n.agent == nil {
			continue
		}
		lease, held := n.agent.pods.Lease(tgt.k.owner)
		if !held {
			out = append(out, fmt.Sprintf("target %v of claim %s: %s holds no lease of its pod", tgt.k, modelClaim(ord), n.name))
			continue
		}
		if on, ok := podRecs[podKey]; !ok || on != lease {
			out = append(out, fmt.Sprintf("target %v: pod record on lease %s (present %v), want on %s", tgt.k, keyspace.LeaseHex(on), ok,
				keyspace.LeaseHex(lease)))
		}
		if ix, ok := st.owners[ownerKey]; !ok || ix.lease != lease || ix.rec.ContainerID != tgt.ctr || !slices.Equal(ix.rec.IPs, tgt.ips) {
			out = append(out, fmt.Sprintf("target %v: owner index on %s names %s %v (present %v), want on %s %s %v", tgt.k,
				keyspace.LeaseHex(ix.lease), ix.rec.ContainerID, ix.rec.IPs, ok, keyspace.LeaseHex(lease), tgt.ctr, tgt.ips))
		}
	}
	return out
}

// holdOpen tells whether a's ADDs go on: no repair after etcd went back in time is pending.
func holdOpen(a *Agent) bool { return !a.hold.Repairing() }

// refusedForRepair tells whether an ADD of a's node, started at start, was refused as it may
// be while the node repairs what etcd going back in time took: while the model's ADDs run
// right after a restore, for any unavailability (the agents' clients find the member again);
// else only naming etcd going back in time, during the node's settle time.
func (m *model) refusedForRepair(a *Agent, err error, start time.Time) bool {
	if !errors.Is(err, allocator.ErrUnavailable) {
		return false
	}
	if m.repairing {
		return true
	}
	if !strings.Contains(err.Error(), "etcd went back in time") {
		return false
	}
	_, until, _ := a.hold.SettleEnds()
	if strings.Contains(err.Error(), "leaves free the addresses it knew taken") {
		// The keep time after the settle time: with no other free address, the node hands out
		// none held back for an expired pod (poolview/blocks.go, choose).
		for _, spec := range m.pools {
			p, err := a.pools.Ensure(context.Background(), allocator.PoolSpec{Name: spec.Name})
			if err != nil {
				return false
			}
			if keep := p.View.Inspect().KeepUntil; keep.After(until) {
				until = keep
			}
		}
	}
	return start.Before(until)
}

// renewers names the agents that renew lease.
func (m *model) renewers(lease clientv3.LeaseID) []string {
	var out []string
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if r, err := m.cli.TimeToLive(ctx, lease); err == nil {
		out = append(out, fmt.Sprintf("ttl %d of %d", r.TTL, r.GrantedTTL))
	}
	for _, n := range m.nodes {
		if n.agent != nil && n.agent.keeper.Holds(lease) {
			out = append(out, n.name)
		}
	}
	return out
}
