package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// The live migration part of TestModelRandomHistories (issue 35, docs/proposals/live-migration.md,
// "How it is proved"): two of the ordinals are VMs (vm-0, vm-1), whose claims are migratable.
// While a VM's incarnation holds its claim, planVM starts a migration (a new incarnation on
// another live node: the target, which gets the claim's addresses at once), completes it (the
// source's DEL: the target becomes the holder), fails it (the target's DEL: the source keeps
// the claim), and sends a third incarnation's ADD on a third node or an ADD on the holder's
// node, both refused naming the holder (a third pod naming the target too). A node's death
// takes its target (T5) or promotes its source's target (T4); a drain, GC and the settle
// delete targets as they do every pod. A lost pod lease of a source or target, and a key of
// either deleted or put again by hand (a target's are its pod record, owner index and
// migration key), are awaited (awaitMigrations): the migration goes on, or, the source's keys
// gone when the target's agent looked, the target was promoted and the model deletes the
// displaced source. So is a node's crash right after a DEL (its pod leases expiring or not),
// and a DEL racing a re-claim on its node. A node cut off is followed by cutOffMigrations:
// its source's target is promoted, its target takes its migration up again once back.
// Backups and restores fall during migrations too: after a restore each migration goes on,
// its target re-claimed (targetRepairProblemsLocked), or its target was promoted, its source
// displaced (restoreIf). After a step that completed a migration the model waits for the
// target to hold the claim: at once by T2, or by its audit's hand-over when T2 was refused
// (awaitCompletions).
//
// The model keeps a target apart from m.held (which holds one attachment per address, the
// holder's), in m.targets; a completion or promotion moves it there. checkMigrations checks,
// from check's one etcd read:
//
//   - per claim at most one live migration key, on its target's pod lease (the lease of the
//     target's owner index), with a target node other than the holder's, under a migratable
//     record, naming the model's target; and the model's target has it;
//   - every allocation key of a claim address is owned by the record's holder (or absent:
//     the holder's node is dead, a promotion is due);
//   - the owner indexes listing a claim address are the holder's and the target's, no other;
//   - the model's side: at most two live incarnations of a VM, on two nodes; one of any
//     other ordinal.
//
// stickyAdd and migrate check every served ADD returns the claim's addresses, and that an
// ADD is refused exactly when two incarnations live or the holder is on the ADD's node.
// check and checkHolds count the target's owner index, which lists the holder's addresses
// on another lease, as the holder's: a migration pair is one owner.

// modelVM tells whether ordinal is a VM, with a migratable claim.
func modelVM(ordinal string) bool { return strings.HasPrefix(ordinal, "vm-") }

// modelOrdinalName is the i-th ordinal: StatefulSet pods first, then VMs.
func modelOrdinalName(i int) string {
	if i < modelOrdinals-modelVMs {
		return fmt.Sprintf("sts-%d", i)
	}
	return fmt.Sprintf("vm-%d", i-(modelOrdinals-modelVMs))
}

const modelVMs = 2

// modelMigrationWait bounds a migration target's ADD, answered at once: above what it takes
// on a busy machine (a sticky hand-over is answered within modelStickyWait), and short, as a
// start refused waits for all of it (the known bug counted in migrate).
const modelMigrationWait = 2 * modelStickyWait

// modelTarget is a live migration's target as the model has it: its attachment, container
// and the claim's addresses it was given.
type modelTarget struct {
	k   attKey
	ctr string
	ips []netip.Addr
}

// Live migration operations of a step (modelOp.mig).
const (
	migStart = "start" // a new incarnation on another node while the holder runs
	migAgain = "again" // the target's ADD repeated
	migFail  = "fail"  // the target's DEL
	migThird = "third" // a new incarnation on a third node: refused naming both
	migSame  = "same"  // a new incarnation on the holder's node: refused naming the holder
)

// planVM plans an operation of VM ordinal ord, whose incarnation cur lives on a connected
// node: with a migration in progress, the source's DEL (completion), the target's DEL
// (failure), the target's ADD repeated, a third incarnation's ADD on a third node or one on
// the holder's node; without one, a migration's start, or an ADD on the holder's node. nil:
// the ordinal's ordinary sticky operations (planSticky's).
func (m *model) planVM(ord string, cur attKey, used map[string]bool) []modelOp {
	hi := m.home[cur.owner]
	m.mu.Lock()
	tgt, migrating := m.targets[ord]
	m.mu.Unlock()
	var others []int
	for _, ni := range m.live() {
		if ni != hi && (!migrating || ni != m.home[tgt.k.owner]) {
			others = append(others, ni)
		}
	}
	newInc := func(ni int, what string) []modelOp {
		m.stsGen[ord]++
		uid := fmt.Sprintf("%s-g%d", ord, m.stsGen[ord])
		m.mu.Lock()
		m.stsOf[uid] = ord
		m.mu.Unlock()
		m.home[uid] = ni
		used[uid] = true
		return []modelOp{{node: m.nodes[ni], k: attKey{owner: uid, ifName: "eth0"}, op: -1, sticky: ord, mig: what}}
	}
	r := m.rng.IntN(10)
	if migrating {
		used[tgt.k.owner] = true
		tn := m.nodes[m.home[tgt.k.owner]]
		switch {
		case r < 3:
			return []modelOp{{node: m.nodes[hi], k: cur, op: 5, roll: 1}} // completion
		case r < 6:
			return []modelOp{{node: tn, k: tgt.k, op: -1, sticky: ord, mig: migFail}}
		case r < 7:
			return []modelOp{{node: tn, k: tgt.k, op: -1, sticky: ord, mig: migAgain}}
		case r < 9 && len(others) > 0:
			return newInc(others[m.rng.IntN(len(others))], migThird)
		default:
			return newInc(hi, migSame)
		}
	}
	switch {
	case r < 4:
		return nil
	case r < 9 && len(others) > 0:
		return newInc(others[m.rng.IntN(len(others))], migStart)
	case r < 9:
		return nil
	default:
		return newInc(hi, migSame)
	}
}

// migrate runs a live migration operation p of a step.
func (m *model) migrate(ctx context.Context, i int, p modelOp) {
	ord := p.sticky
	m.mu.Lock()
	holder, live := m.incarnationLocked(ord, "")
	tgt, migrating := m.targets[ord]
	want := slices.Clone(m.claimIPs[ord])
	m.mu.Unlock()
	switch p.mig {
	case migFail:
		err := p.node.agent.Del(ctx, m.req(tgt.k, tgt.ctr))
		m.log("%d %s MIGRATION of %s FAILS: DEL of target %v %s -> %v", i, p.node.name, modelClaim(ord), tgt.k, tgt.ctr, err)
		m.inc("del")
		if err != nil {
			m.t.Errorf("step %d: DEL of migration target %v: %v", i, tgt.k, err)
			return
		}
		m.mu.Lock()
		delete(m.targets, ord)
		m.mu.Unlock()
		m.inc("migration failed")
		return
	case migStart, migAgain:
		container := fmt.Sprintf("%s-%s-%d", p.k.owner, p.k.ifName, i)
		if p.mig == migAgain {
			container = tgt.ctr
		}
		// A target is answered at once: an ADD that waits (for the holder, as a sticky ADD
		// does) runs out of modelMigrationWait and fails the history. Also after a restore
		// took the claim record, or brought it back released: its holder's agent puts it back
		// migratable.
		sctx, cancel := context.WithTimeout(ctx, modelMigrationWait)
		res, err := p.node.agent.Add(sctx, m.req(p.k, container))
		cancel()
		got := addrs(res)
		m.log("%d %s MIGRATION %s of %s: ADD %v %s (holder %v on %s, target before %v) -> %v %v", i, p.node.name, p.mig, modelClaim(ord),
			p.k, container, holder, m.nodes[m.home[holder.owner]].name, tgt.k, got, err)
		m.inc("add")
		switch {
		case err != nil:
			m.t.Errorf("step %d: ADD of %v (%s) naming migratable claim %s, held by %v on another node: %v", i, p.k, p.mig, modelClaim(ord), holder, err)
			return
		case !slices.Equal(got, want):
			m.t.Errorf("step %d: migration target %v (%s) got %v, the claim's addresses are %v", i, p.k, p.mig, got, want)
		}
		if p.mig == migAgain {
			return
		}
		m.mu.Lock()
		defer m.mu.Unlock()
		m.admitLocked(i, p.k, got, holder) // the pair is one owner; nobody else has them
		m.targets[ord] = modelTarget{k: p.k, ctr: container, ips: got}
		m.count["migration started"]++
		if m.count["restore"] > 0 {
			m.count["migration started after a restore"]++
		}
		return
	}
	// A third incarnation, or one on the holder's node: refused naming the holder (and the
	// target, on a third node), after the wait of a sticky ADD.
	container := fmt.Sprintf("%s-%s-%d", p.k.owner, p.k.ifName, i)
	sctx, cancel := context.WithTimeout(ctx, modelStickyWait)
	start := time.Now()
	res, err := p.node.agent.Add(sctx, m.req(p.k, container))
	cancel()
	m.log("%d %s MIGRATION %s of %s: ADD %v %s (holder %v on %s, target %v %v) -> %v %v (%s)", i, p.node.name, p.mig, modelClaim(ord),
		p.k, container, holder, m.nodes[m.home[holder.owner]].name, migrating, tgt.k, addrs(res), err, time.Since(start).Round(time.Millisecond))
	m.inc("add")
	if err != nil && m.refusedForRepair(p.node.agent, err, start) {
		m.refused(err)
		return
	}
	names := []string{holder.owner}
	if p.mig == migThird {
		names = append(names, tgt.k.owner)
	}
	slow := errors.Is(err, context.DeadlineExceeded)
	switch {
	case !live:
		m.t.Errorf("step %d: the model planned %s of %s with no live holder", i, p.mig, modelClaim(ord))
	case err == nil:
		m.t.Errorf("step %d: ADD of %v (%s) naming claim %s got %v while %v holds it (target %v %v)", i, p.k, p.mig, modelClaim(ord),
			addrs(res), holder, migrating, tgt.k)
	case !errors.Is(err, allocator.ErrUnavailable) && !slow:
		m.t.Errorf("step %d: ADD of %v (%s) naming claim %s: %v, want ErrUnavailable", i, p.k, p.mig, modelClaim(ord), err)
	case !slow && slices.ContainsFunc(names, func(o string) bool { return !strings.Contains(err.Error(), o) }):
		m.t.Errorf("step %d: ADD of %v (%s) naming claim %s refused without naming %v: %v", i, p.k, p.mig, modelClaim(ord), names, err)
	}
	m.inc("migration refused: " + p.mig)
}

// completeLocked is the model's side of a DEL, GC or drain of k: when k holds a VM's claim
// with a target, the target becomes the holder (T2), and nothing is released. It reports
// whether it did; m.mu is held.
func (m *model) completeLocked(k attKey) bool {
	ord := m.stsOf[k.owner]
	tgt, ok := m.targets[ord]
	if ord == "" || !ok {
		return false
	}
	if h, live := m.incarnationLocked(ord, ""); !live || h != k {
		return false
	}
	m.promoteLocked(ord, tgt)
	m.history = append(m.history, fmt.Sprintf("  migration of %s completed: %v holds it", modelClaim(ord), tgt.k))
	m.count["migration completed"]++
	m.completed = append(m.completed, ord)
	return true
}

// awaitCompletions waits, after a step, until each migration a source's DEL completed in it
// has its target the claim's holder. T2 does that at once; one refused for a lease of the
// target etcd no longer has (a block lease a restore took, say) releases the claim instead,
// and the target's audit then takes it as a hand-over (docs/proposals/live-migration.md, "A
// claim its source's DEL released").
func (m *model) awaitCompletions(i int) {
	ctx, cancel := context.WithTimeout(context.Background(), modelStepTimeout)
	defer cancel()
	m.mu.Lock()
	done := m.completed
	m.completed = nil
	m.mu.Unlock()
	for _, ord := range done {
		m.mu.Lock()
		k, live := m.incarnationLocked(ord, "")
		m.mu.Unlock()
		if live {
			m.awaitPromotion(ctx, i, ord, modelTarget{k: k}, "was deleted")
		}
	}
}

// promoteLocked makes ordinal's target its holder; m.mu is held.
func (m *model) promoteLocked(ord string, tgt modelTarget) {
	delete(m.targets, ord)
	m.held[tgt.k], m.ctr[tgt.k] = tgt.ips, tgt.ctr
	n := m.nodes[m.home[tgt.k.owner]]
	if m.claimTakers[ord] == nil {
		m.claimTakers[ord] = map[string]bool{}
	}
	m.claimTakers[ord][n.name+"/"+n.uid] = true
}

// targetsOn lists the targets on node ni, by ordinal (ni < 0: every target).
func (m *model) targetsOn(ni int) map[string]modelTarget {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]modelTarget{}
	for ord, tgt := range m.targets {
		if ni < 0 || m.home[tgt.k.owner] == ni {
			out[ord] = tgt
		}
	}
	return out
}

// failAll fails the migrations whose targets run on node ni (ni < 0: every one), as a
// drain or the settle deletes their pods.
func (m *model) failAll(ctx context.Context, i, ni int) {
	tg := m.targetsOn(ni)
	for _, ord := range sortedKeys(tg) {
		tgt := tg[ord]
		m.migrate(ctx, i, modelOp{node: m.nodes[m.home[tgt.k.owner]], k: tgt.k, sticky: ord, mig: migFail})
	}
}

func sortedKeys[V any](mp map[string]V) []string {
	out := make([]string, 0, len(mp))
	for k := range mp {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// dieMigrations is the model's side of node ni's death (before its attachments are
// forgotten): its targets are gone with their pod leases (T5); a target of a source on it is
// promoted by its agent's audit (T4), which the step waits for.
func (m *model) dieMigrations(ctx context.Context, i, ni int) {
	due := m.migrationsOn(ni, func(ord string, tgt modelTarget, h attKey) {
		delete(m.targets, ord)
		m.history = append(m.history, fmt.Sprintf("  target %v of claim %s dies with its node: %v keeps it", tgt.k, modelClaim(ord), h))
		m.count["migration target died"]++
	})
	m.awaitPromoted(ctx, i, due, "died with its node", func(ord string, tgt modelTarget) {
		m.promoteLocked(ord, tgt)
		m.history = append(m.history, fmt.Sprintf("  its source died: target %v of claim %s promoted", tgt.k, modelClaim(ord)))
		m.count["migration promoted"]++
	})
}

// migrationsOn calls onTarget, m.mu held, for each migration whose target runs on node ni,
// and returns in order the ordinals of those whose source runs there.
func (m *model) migrationsOn(ni int, onTarget func(ord string, tgt modelTarget, holder attKey)) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var due []string
	for ord, tgt := range m.targets {
		h, _ := m.incarnationLocked(ord, "")
		switch {
		case m.home[tgt.k.owner] == ni:
			onTarget(ord, tgt, h)
		case m.home[h.owner] == ni:
			due = append(due, ord)
		}
	}
	slices.Sort(due)
	return due
}

// awaitPromoted waits until the target of each ordinal of due is promoted, its source gone as
// why says, and then calls promoted, m.mu held.
func (m *model) awaitPromoted(ctx context.Context, i int, due []string, why string, promoted func(ord string, tgt modelTarget)) {
	for _, ord := range due {
		m.mu.Lock()
		tgt := m.targets[ord]
		m.mu.Unlock()
		m.awaitPromotion(ctx, i, ord, tgt, why)
		m.mu.Lock()
		promoted(ord, tgt)
		m.mu.Unlock()
	}
}

// awaitPromotion waits until ordinal's target tgt holds its claim alone (T4), its source
// having gone as why says.
func (m *model) awaitPromotion(ctx context.Context, i int, ord string, tgt modelTarget, why string) {
	deadline := time.Now().Add(etcdtest.Patience)
	for {
		rec, ok := m.readClaimRec(ctx, ord)
		mig, err := m.cli.Get(ctx, keyspace.LiveMigrationKey(m.cluster, m.pool.Name, modelClaim(ord)))
		if err != nil {
			m.t.Fatal(err)
		}
		if ok && rec.Holder != nil && rec.Holder.Owner == tgt.k.owner && len(mig.Kvs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: the source of claim %s %s, and its target %v is not promoted within %s: record %v holder %s, migration key %v",
				i, modelClaim(ord), why, tgt.k, etcdtest.Patience, ok, holderName(rec), len(mig.Kvs) > 0)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// cutOffMigrations is the model's side of node ni's cut-off (its leases but its block and
// claim leases expired): a target on it loses its migration key with its pod lease, and takes
// its migration up again when its node is back (awaitMigrations), the model planning nothing
// of its VM meanwhile (targetAwayLocked); a source on it loses its allocations, so its target's
// agent promotes the target (T4 cannot tell a cut-off from a death), and the source, back,
// finds its addresses taken: displaced, until the model deletes it (endDisplaced).
func (m *model) cutOffMigrations(ctx context.Context, i, ni int) {
	due := m.migrationsOn(ni, func(ord string, tgt modelTarget, h attKey) {
		m.history = append(m.history, fmt.Sprintf("  target %v of claim %s is cut off: %v keeps the claim", tgt.k, modelClaim(ord), h))
	})
	m.awaitPromoted(ctx, i, due, "was cut off", func(ord string, tgt modelTarget) {
		src, _ := m.incarnationLocked(ord, "")
		m.promoteLocked(ord, tgt)
		m.conflict[src] = slices.Clone(m.held[src])
		m.awayTaken[src] = append(m.awayTaken[src], m.held[src]...)
		m.displaced[ord] = src
		m.history = append(m.history, fmt.Sprintf("  its source %v is cut off: target %v of claim %s promoted, the source displaced", src,
			tgt.k, modelClaim(ord)))
		m.count["migration promoted after a fault"]++
	})
}

// targetAwayLocked tells whether ordinal's migration target runs on a cut-off node; m.mu is held.
func (m *model) targetAwayLocked(ord string) bool {
	tgt, ok := m.targets[ord]
	return ok && m.awayLocked(tgt.k)
}

// sourceOfAwayTarget tells whether owner is the source of a migration whose target's
// node is cut off: its source's DEL, or its death, would end the migration in a way the
// model does not follow (the target's re-claim after it), so drains, deaths, GC and crashes
// leave that pod alone until the target's node is back.
func (m *model) sourceOfAwayTarget(owner string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	ord := m.stsOf[owner]
	if ord == "" || !m.targetAwayLocked(ord) {
		return false
	}
	h, _ := m.incarnationLocked(ord, "")
	return h.owner == owner
}

// targetOwnerKeys are the owner index keys of the migrations' targets as etcd has them (the
// live migration keys read), mapped to their claims.
func (m *model) targetOwnerKeys(migs []*mvccpb.KeyValue) map[string]string {
	out := map[string]string{}
	for _, kv := range migs {
		rec, err := keyspace.Decode[keyspace.LiveMigrationRecord](string(kv.Key), kv.Value)
		if err != nil {
			continue // checkMigrations reports it
		}
		_, _, claim, _ := keyspace.ParseLiveMigrationKey(string(kv.Key))
		out[keyspace.OwnerKey(m.cluster, rec.Target.Owner, rec.Target.IfName, m.pool.Name)] = claim
	}
	return out
}

// checkMigrations checks the live migrations at a quiet point against etcd (claims,
// allocations, owner indexes and migration keys, read at once) and the model.
func (m *model) checkMigrations(claims, allocs, owners, migs []*mvccpb.KeyValue) {
	records := map[string]keyspace.ClaimRecord{}
	for _, kv := range claims {
		_, _, name, err := keyspace.ParseClaimKey(string(kv.Key))
		rec, derr := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
		if err == nil && derr == nil {
			records[name] = rec
		}
	}
	allocOwner := map[netip.Addr]string{}
	for _, kv := range allocs {
		_, _, ip, err := keyspace.ParseIPKey(string(kv.Key))
		a, derr := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
		if err == nil && derr == nil {
			allocOwner[ip] = a.Owner
		}
	}
	type index struct {
		rec   keyspace.OwnerRecord
		lease int64
	}
	indexes := map[string]index{}
	listing := map[netip.Addr][]string{}
	for _, kv := range owners {
		rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
		if err != nil {
			continue
		}
		indexes[string(kv.Key)] = index{rec, kv.Lease}
		for _, ip := range rec.IPs {
			listing[ip] = append(listing[ip], string(kv.Key))
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	targetOf := map[string]keyspace.LiveMigrationRecord{}
	for _, kv := range migs {
		_, pool, claim, err := keyspace.ParseLiveMigrationKey(string(kv.Key))
		rec, derr := keyspace.Decode[keyspace.LiveMigrationRecord](string(kv.Key), kv.Value)
		if err != nil || derr != nil || pool != m.pool.Name {
			m.t.Errorf("live migration key %s: %v %v (pool %s)", kv.Key, err, derr, pool)
			continue
		}
		if _, dup := targetOf[claim]; dup {
			m.t.Errorf("claim %s has two live migration keys", claim)
		}
		targetOf[claim] = rec
		cr, ok := records[claim]
		switch {
		case !ok:
			m.t.Errorf("live migration key %s names claim %s, which has no record", kv.Key, claim)
		case !cr.Migratable:
			m.t.Errorf("live migration key %s (target %s) under a claim record not migratable: %+v", kv.Key, rec.Target.Owner, cr)
		case cr.Holder != nil && cr.Holder.Node == rec.Target.Node:
			m.t.Errorf("live migration of claim %s: target %s on node %s, the holder %s's node", claim, rec.Target.Owner, rec.Target.Node, cr.Holder.Owner)
		}
		ix, ok := indexes[keyspace.OwnerKey(m.cluster, rec.Target.Owner, rec.Target.IfName, m.pool.Name)]
		if !ok || ix.lease != kv.Lease {
			m.t.Errorf("live migration key %s (lease %x): its target %s's owner index (its pod lease) present %v on lease %x",
				kv.Key, kv.Lease, rec.Target.Owner, ok, ix.lease)
		}
		ord := strings.TrimPrefix(claim, "ns.")
		if tgt, ok := m.targets[ord]; !ok || tgt.k.owner != rec.Target.Owner || tgt.k.ifName != rec.Target.IfName {
			m.t.Errorf("live migration key %s names target %s/%s; the model's: %v (present %v)", kv.Key, rec.Target.Owner, rec.Target.IfName, tgt.k, ok)
		}
	}
	for ord, tgt := range m.targets {
		if _, ok := targetOf[modelClaim(ord)]; !ok && !m.awayLocked(tgt.k) { // a cut-off target's went with its pod lease
			m.t.Errorf("the model's migration of claim %s to %v has no live migration key", modelClaim(ord), tgt.k)
		}
	}
	for name, rec := range records {
		mig, migrating := targetOf[name]
		want := map[string]bool{}
		if h := rec.Holder; h != nil {
			want[keyspace.OwnerKey(m.cluster, h.Owner, h.IfName, m.pool.Name)] = true
		}
		if migrating {
			want[keyspace.OwnerKey(m.cluster, mig.Target.Owner, mig.Target.IfName, m.pool.Name)] = true
		}
		for _, ip := range rec.IPs {
			if m.conflictedLocked(ip) {
				continue // a running pod of a node cut off past the reuse delay lists it: checkHolds
			}
			o, allocated := allocOwner[ip]
			switch {
			case allocated && (rec.Holder == nil || rec.Holder.Owner != o):
				m.t.Errorf("claim %s (holder %s): its address %s is allocated to %s", name, holderName(rec), ip, o)
			case !allocated && rec.Holder != nil && m.isLiveNode(rec.Holder.Node, rec.Holder.NodeUID) && !m.awayNodeLocked(rec.Holder.Node):
				m.t.Errorf("claim %s names holder %s on live node %s, and its address %s has no allocation key", name, rec.Holder.Owner, rec.Holder.Node, ip)
			}
			for _, key := range listing[ip] {
				if !want[key] {
					m.t.Errorf("claim %s (holder %s, migrating %v): owner index %s lists its address %s", name, holderName(rec), migrating, key, ip)
				}
			}
		}
	}
	// The model's side: at most two live incarnations of a VM, on two nodes; one of another.
	// A source its target displaced holds nothing of the claim (its conflicts) until deleted.
	for ord := range m.claimIPs {
		var nodes []int
		for k := range m.held {
			if m.stsOf[k.owner] == ord && m.displaced[ord] != k {
				nodes = append(nodes, m.home[k.owner])
			}
		}
		if tgt, ok := m.targets[ord]; ok {
			nodes = append(nodes, m.home[tgt.k.owner])
		}
		switch {
		case len(nodes) > 2 || len(nodes) == 2 && !modelVM(ord):
			m.t.Errorf("model: %d live incarnations of %s", len(nodes), ord)
		case len(nodes) == 2 && nodes[0] == nodes[1]:
			m.t.Errorf("model: the two live incarnations of %s are on one node, %s", ord, m.nodes[nodes[0]].name)
		}
	}
}

// conflictedLocked tells whether an attachment lists a as another owner's; m.mu is held.
func (m *model) conflictedLocked(a netip.Addr) bool {
	for _, c := range m.conflict {
		if slices.Contains(c, a) {
			return true
		}
	}
	return false
}

// awayNodeLocked tells whether the node named name is cut off; m.mu is held.
func (m *model) awayNodeLocked(name string) bool {
	return slices.ContainsFunc(m.nodes, func(n *modelNode) bool { return n.name == name && n.away > 0 })
}

// awaitMigrations waits, after a fault that took keys of a migration's source or target (a
// lost pod lease, a key deleted by hand, a crash, a restore), until each of the model's
// migrations whose pods run on connected nodes is in one of the two states the agents
// document (docs/proposals/live-migration.md, "What is built differently"):
//
//   - it goes on: the migration key names the model's target, on the pod lease the target's
//     agent holds, beside the target's owner index; the claim names the model's holder, and
//     each address is allocated to it on the pod lease its agent holds (a target's lost keys
//     are written again, T1 again; a source's lost lease is re-claimed);
//   - it completed by promotion: the source's allocations were gone when the target's
//     agent looked (T4 cannot tell a lost lease from a dead node), so the claim names the
//     target and no migration key is left. The source's re-claim then finds its addresses
//     taken: the window that remains (ARCHITECTURE.md), which the model ends as the runtime
//     does once the VM runs on the target: it deletes the source (endDisplaced).
//
// why says which fault; it returns the ordinals promoted.
func (m *model) awaitMigrations(i int, why string) (promoted []string) {
	return m.awaitMigrationsFor(i, why, modelReclaimWait)
}

// awaitMigrationsFor is awaitMigrations, waiting up to wait.
func (m *model) awaitMigrationsFor(i int, why string, wait time.Duration) (promoted []string) {
	deadline := time.Now().Add(wait)
	for {
		problems, done := m.migrationProblems()
		if len(problems) == 0 {
			for _, ord := range done {
				m.mu.Lock()
				tgt := m.targets[ord]
				src, _ := m.incarnationLocked(ord, "")
				m.promoteLocked(ord, tgt)
				m.conflict[src] = slices.Clone(m.held[src]) // its re-claim finds them the target's
				m.displaced[ord] = src
				m.history = append(m.history, fmt.Sprintf("  after %s, target %v of claim %s was promoted: source %v is displaced", why, tgt.k,
					modelClaim(ord), src))
				m.count["migration promoted after a fault"]++
				m.mu.Unlock()
			}
			return done
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: after %s, %s later the live migrations are neither as they were nor completed:\n  %s", i, why,
				wait, strings.Join(problems, "\n  "))
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// migrationProblems says what of the model's live migrations etcd and the agents do not show
// in either state awaitMigrations accepts; promoted lists those completed by promotion.
func (m *model) migrationProblems() (out, promoted []string) {
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	tg := m.targetsOn(-1)
	for _, ord := range sortedKeys(tg) {
		tgt := tg[ord]
		m.mu.Lock()
		holder, live := m.incarnationLocked(ord, "")
		want := slices.Clone(m.claimIPs[ord])
		m.mu.Unlock()
		tn, hn := m.nodes[m.home[tgt.k.owner]], m.nodes[m.home[holder.owner]]
		if !live || tn.agent == nil || hn.agent == nil {
			continue // a pod of a cut-off node: its node's return is awaited
		}
		ops := []clientv3.Op{clientv3.OpGet(keyspace.LiveMigrationKey(m.cluster, m.pool.Name, modelClaim(ord))),
			clientv3.OpGet(m.ownerKey(tgt.k)), clientv3.OpGet(keyspace.ClaimKey(m.cluster, m.pool.Name, modelClaim(ord)))}
		for _, a := range want {
			p := m.poolOf(a)
			ops = append(ops, clientv3.OpGet(keyspace.IPKey(p.Name, p.Blocks, a)))
		}
		resp, err := m.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			m.t.Fatal(err)
		}
		first := func(r int) *mvccpb.KeyValue {
			if kvs := resp.Responses[r].GetResponseRange().Kvs; len(kvs) > 0 {
				return kvs[0]
			}
			return nil
		}
		mkv, okv, ckv := first(0), first(1), first(2)
		var rec keyspace.ClaimRecord
		if ckv != nil {
			rec, _ = keyspace.Decode[keyspace.ClaimRecord](string(ckv.Key), ckv.Value)
		}
		tlease, theld := tn.agent.pods.Lease(tgt.k.owner)
		hlease, hheld := hn.agent.pods.Lease(holder.owner)
		// Each address allocated to owner on lease.
		allocatedTo := func(owner string, lease clientv3.LeaseID) bool {
			for r := range want {
				kv := first(3 + r)
				if kv == nil || keyspace.LeaseOf(kv) != lease {
					return false
				}
				if al, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value); err != nil || al.Owner != owner {
					return false
				}
			}
			return true
		}
		if mkv == nil && rec.Holder != nil && rec.Holder.Owner == tgt.k.owner && theld && allocatedTo(tgt.k.owner, tlease) {
			promoted = append(promoted, ord)
			continue
		}
		switch {
		case !theld:
			out = append(out, fmt.Sprintf("claim %s: %s holds no lease of target %v", modelClaim(ord), tn.name, tgt.k))
		case mkv == nil || keyspace.LeaseOf(mkv) != tlease:
			out = append(out, fmt.Sprintf("claim %s: no migration key on target %v's lease %s (record holder %s)", modelClaim(ord), tgt.k,
				keyspace.LeaseHex(tlease), holderName(rec)))
		case okv == nil || keyspace.LeaseOf(okv) != tlease:
			out = append(out, fmt.Sprintf("claim %s: target %v's owner index is not on its lease %s", modelClaim(ord), tgt.k, keyspace.LeaseHex(tlease)))
		case rec.Holder == nil || rec.Holder.Owner != holder.owner:
			out = append(out, fmt.Sprintf("claim %s names holder %s, the model's is %v", modelClaim(ord), holderName(rec), holder))
		case !hheld || !allocatedTo(holder.owner, hlease):
			out = append(out, fmt.Sprintf("claim %s: its addresses %v are not all allocated to its holder %v on its lease %s (held %v)",
				modelClaim(ord), want, holder, keyspace.LeaseHex(hlease), hheld))
		}
	}
	return out, promoted
}

// endDisplaced deletes the sources awaitMigrations found displaced by their target's
// promotion, once their node is connected: the runtime's end of a migration whose VM runs on
// the target. The DEL releases nothing the target holds (do checks every other owner's keys).
func (m *model) endDisplaced(ctx context.Context, i int) {
	m.mu.Lock()
	var due []string
	for _, ord := range sortedKeys(m.displaced) {
		src := m.displaced[ord]
		if _, held := m.held[src]; !held {
			delete(m.displaced, ord) // deleted meanwhile (the settle)
		} else if !m.awayLocked(src) {
			due = append(due, ord)
		}
	}
	m.mu.Unlock()
	for _, ord := range due {
		m.mu.Lock()
		src := m.displaced[ord]
		m.mu.Unlock()
		m.log("%d the displaced source %v of a migration its target completed is deleted", i, src)
		// Still displaced while its DEL runs: not the claim's incarnation, so not a completion.
		m.do(ctx, i, m.nodes[m.home[src.owner]], src, 5, 1, map[string]bool{src.owner: true})
		m.mu.Lock()
		delete(m.displaced, ord)
		m.mu.Unlock()
	}
}
