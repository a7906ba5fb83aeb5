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

// The sticky part of TestModelRandomHistories (issue 19): a few owners are StatefulSet
// ordinals (sts-0, sts-1, and the VMs vm-0, vm-1 of model_migration_test.go) whose
// attachments name the claim "ns.<ordinal>". Each
// incarnation of an ordinal is a new pod UID; when one is deleted, drained, garbage-collected
// or dies with its node, the next incarnation, on any node, must get the claim's addresses,
// and an incarnation created while another one lives must be refused, naming it.
//
//   - a refusal is expected when, and only when, the model gives the claim's addresses to a
//     live incarnation: a sticky ADD refused while none lives, or served while one does, fails;
//   - a sticky ADD served while the claim record exists returns the record's addresses; an
//     ordinal's addresses never change during a history (the hold outlasts any run);
//   - a claim record and its addresses' quarantine keys, marked with the claim, lie on one
//     lease; a holder named by the record has its owner index, listing the claim's addresses,
//     unless its node is dead (the pod lease expired, the claim lease runs out after the hold);
//   - an allocation key and a claim-marked quarantine key of one address imply that the
//     allocation's owner is the claim's holder; no ADD without the claim gets its addresses.
//
// Node deaths revoke the dead node's pod and block leases (as their TTL would), not its claim
// leases, which a real cluster keeps for the hold. settle lets the holds run out (revokes the
// claims' leases) before it waits for every block to be given back.

const (
	modelOrdinals = 4
	// modelClaimHold is the model agents' Config.ClaimHold: longer than any history, so that
	// a claim never expires while the model runs (settle ends them).
	modelClaimHold = 24 * time.Hour
	// modelStickyWait is a new incarnation's ADD deadline: an ADD whose claim a live
	// incarnation holds waits until shortly before it, then fails naming the holder (or, on a
	// machine too busy to read the claim in that time, fails at the deadline).
	modelStickyWait = 1500 * time.Millisecond
	// modelStickyRaceWait is the deadline of a new incarnation's ADD sent together with the
	// DEL of the live one (kubelet's DEL of the old pod late): the DEL ends within it, however
	// busy the machine. The ADD returns once the DEL is done, so it costs nothing to wait.
	modelStickyRaceWait = etcdtest.Patience
)

func modelClaim(ordinal string) string { return "ns." + ordinal }

// ordinalOf is the StatefulSet ordinal an owner is an incarnation of; "" for other owners.
func (m *model) ordinalOf(owner string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.stsOf[owner]
}

// incarnation returns the attachment of ordinal's live incarnation, if the model has one.
func (m *model) incarnation(ordinal string) (attKey, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.incarnationLocked(ordinal, "")
}

func (m *model) incarnationLocked(ordinal, except string) (attKey, bool) {
	for k := range m.held {
		// A migration's source displaced by its target's promotion is not the claim's
		// incarnation, until the model deletes it (model_migration_test.go, endDisplaced).
		if k.owner != except && m.stsOf[k.owner] == ordinal && m.displaced[ordinal] != k {
			return k, true
		}
	}
	return attKey{}, false
}

// planSticky plans operations on a random ordinal: on its live incarnation a repeated ADD,
// a DEL or a CHECK, the ADD of a new incarnation while it lives, or that ADD at once with the
// live one's DEL; without one, the ADD of a new incarnation on a random live node. It plans
// nothing when the ordinal is busy this step.
func (m *model) planSticky(used map[string]bool) []modelOp {
	ord := modelOrdinalName(m.rng.IntN(modelOrdinals))
	if used[ord] {
		return nil
	}
	used[ord] = true
	var del []modelOp
	if cur, live := m.incarnation(ord); live {
		if m.awayOwner(cur.owner) {
			return nil // its node is cut off: nothing reaches the pod, and no replacement is made
		}
		m.mu.Lock()
		away := m.targetAwayLocked(ord)
		m.mu.Unlock()
		if away {
			return nil // its migration's target is cut off: the VM waits for it (model_migration_test.go)
		}
		used[cur.owner] = true
		node := m.homeOf(cur.owner)
		r := m.rng.IntN(10)
		if modelVM(ord) {
			// A VM's incarnation created while one lives is planVM's (model_migration_test.go).
			if ops := m.planVM(ord, cur, used); ops != nil {
				return ops
			}
			r = m.rng.IntN(6)
		}
		switch {
		case r < 2:
			return []modelOp{{node: node, k: cur, op: 0}} // repeated ADD
		case r < 4:
			return []modelOp{{node: node, k: cur, op: 5, roll: m.rng.IntN(4)}} // DEL (sometimes stale)
		case r < 6:
			return []modelOp{{node: node, k: cur, op: 8}} // CHECK
		case r < 8:
			del = []modelOp{{node: node, k: cur, op: 5, roll: 1}} // DEL, racing its replacement's ADD
		}
		// else: its replacement, created while it lives (say its node is partitioned)
	}
	m.stsGen[ord]++
	uid := fmt.Sprintf("%s-g%d", ord, m.stsGen[ord])
	live := m.live()
	ni := live[m.rng.IntN(len(live))]
	m.mu.Lock()
	m.stsOf[uid] = ord
	m.mu.Unlock()
	m.home[uid] = ni
	used[uid] = true
	return append(del, modelOp{node: m.nodes[ni], k: attKey{owner: uid, ifName: "eth0"}, sticky: ord, afterDel: len(del) > 0})
}

// readClaimRec reads ordinal's claim record.
func (m *model) readClaimRec(ctx context.Context, ordinal string) (keyspace.ClaimRecord, bool) {
	key := keyspace.ClaimKey(m.cluster, m.pool.Name, modelClaim(ordinal))
	resp, err := m.cli.Get(ctx, key)
	if err != nil {
		m.t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return keyspace.ClaimRecord{}, false
	}
	rec, err := keyspace.Decode[keyspace.ClaimRecord](key, resp.Kvs[0].Value)
	if err != nil {
		m.t.Errorf("claim record %s: %v", key, err)
	}
	return rec, true
}

// stickyAdd is the ADD of a new incarnation k of ordinal, with a short deadline. With
// afterDel, the live incarnation's DEL runs at the same time: the ADD must wait for it and
// succeed.
func (m *model) stickyAdd(ctx context.Context, i int, node *modelNode, k attKey, ordinal string, afterDel bool) {
	m.mu.Lock()
	holder, live := m.incarnationLocked(ordinal, k.owner)
	want := m.claimIPs[ordinal]
	m.mu.Unlock()
	rec, recOK := m.readClaimRec(ctx, ordinal)
	container := fmt.Sprintf("%s-%s-%d", k.owner, k.ifName, i)
	wait := modelStickyWait
	if afterDel {
		wait, live = modelStickyRaceWait, false
		m.inc("sticky add racing a DEL")
	}
	sctx, cancel := context.WithTimeout(ctx, wait)
	start := time.Now()
	res, err := node.agent.Add(sctx, m.req(k, container))
	took := time.Since(start).Round(time.Millisecond)
	cancel()
	m.log("%d %s STICKY ADD %v %s claim %s (live incarnation %v: %v, DEL at once %v; record %v holder %s) -> %v %v (%s)", i, node.name, k, container,
		modelClaim(ordinal), live, holder, afterDel, recOK, holderName(rec), addrs(res), err, took)
	m.inc("sticky add")
	// A claim that gave an address up to a running pod (claimGivesUp) gets a new one for it:
	// the claim keeps those of its addresses no conflicted pod waits for.
	m.mu.Lock()
	keep := func(ips []netip.Addr) []netip.Addr {
		return slices.DeleteFunc(slices.Clone(ips), func(a netip.Addr) bool {
			for _, c := range m.conflict {
				if slices.Contains(c, a) {
					return true
				}
			}
			return false
		})
	}
	recKept, wantKept := keep(rec.IPs), keep(want)
	m.mu.Unlock()
	gaveUp := len(recKept) < len(rec.IPs) || len(wantKept) < len(want)
	if err != nil && m.refusedForRepair(node.agent, err, start) {
		m.refused(err) // etcd went back in time: model_restore_test.go
		return
	}
	switch {
	case live && err == nil:
		m.t.Errorf("step %d: claim %s was handed to %v (%v) while incarnation %v lives and holds it", i, modelClaim(ordinal), k, addrs(res), holder)
		return
	case live:
		// Only an ADD that ran out of time before it could read the claim may leave the holder
		// unnamed: a busy machine.
		slow := errors.Is(err, context.DeadlineExceeded)
		if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), holder.owner) && !slow {
			m.t.Errorf("step %d: ADD of %v while %v holds claim %s: %v, want ErrUnavailable naming %s", i, k, holder, modelClaim(ordinal), err, holder.owner)
		}
		m.inc("sticky refused")
		return
	case err != nil:
		if (gaveUp || !recOK) && m.refusedClosed(err) {
			return // new addresses from a closed pool (model_access_test.go)
		}
		if (gaveUp || !recOK && want == nil) && errors.Is(err, allocator.ErrPoolExhausted) {
			m.refused(err) // the ordinal's first incarnation, or a new address for one given up, in a full pool
			return
		}
		m.t.Errorf("step %d: ADD of %v naming claim %s refused while no live incarnation holds it (record %v: %+v): %v",
			i, k, modelClaim(ordinal), recOK, rec, err)
		return
	}
	got := addrs(res)
	if !recOK && want == nil && m.closedToNew() {
		m.t.Errorf("step %d: the first incarnation %v of claim %s got %v from pool %s, closed to new addresses", i, k, modelClaim(ordinal), got, m.pool.Name)
	}
	switch {
	case recOK && !containsAll(got, recKept):
		m.t.Errorf("step %d: ADD of %v naming claim %s got %v, the claim record held %v", i, k, modelClaim(ordinal), got, rec.IPs)
	case !recOK && want != nil:
		m.t.Errorf("step %d: the record of claim %s (%v) is gone before its hold ended; %v got %v", i, modelClaim(ordinal), want, k, got)
	case want != nil && !containsAll(got, wantKept):
		m.t.Errorf("step %d: ADD of %v naming claim %s got %v, the claim's addresses are %v", i, k, modelClaim(ordinal), got, want)
	}
	if recOK {
		m.inc("handover")
		if rec.Holder != nil && !afterDel {
			m.inc("handover from a dead node")
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var except attKey
	if afterDel {
		except = holder // released in etcd; the DEL's goroutine updates the model after
	}
	m.admitLocked(i, k, got, except)
	for _, a := range got {
		delete(m.freed, a) // a hand-over inside the quarantine is the point of a claim
	}
	m.held[k], m.ctr[k] = got, container
	m.claimIPs[ordinal] = got
	if m.claimTakers[ordinal] == nil {
		m.claimTakers[ordinal] = map[string]bool{}
	}
	m.claimTakers[ordinal][node.name+"/"+node.uid] = true
}

// claimKeptLocked tells whether a live agent knows ordinal's claim beyond its record, and so
// puts it back when a restore of a backup older than the claim lost the record: the agent of
// a node identity that took it for an incarnation, which keeps it while that incarnation runs
// (the audit) and remembers its release within the hold (released-claims). A claim whose
// takers' nodes all died is known to no agent: such a restore loses it (docs/operations.md,
// "Restoring etcd from a backup"). m.mu is held.
func (m *model) claimKeptLocked(ordinal string) bool {
	for _, n := range m.nodes {
		if n.agent != nil && m.claimTakers[ordinal][n.name+"/"+n.uid] {
			return true
		}
	}
	return false
}

func containsAll(s, sub []netip.Addr) bool {
	for _, a := range sub {
		if !slices.Contains(s, a) {
			return false
		}
	}
	return true
}

func holderName(rec keyspace.ClaimRecord) string {
	if rec.Holder == nil {
		return "none"
	}
	return rec.Holder.Owner + "@" + rec.Holder.Node
}

// claimOfAddrLocked returns the ordinal whose claim has addr; m.mu is held.
func (m *model) claimOfAddrLocked(addr netip.Addr) string {
	for ord, ips := range m.claimIPs {
		if slices.Contains(ips, addr) {
			return ord
		}
	}
	return ""
}

// checkSticky checks the claims at a quiet point against etcd (claims, allocations with their
// owners, owner indexes, quarantine keys with their values) and the model.
func (m *model) checkSticky(claims, allocs, owners, quarantine []*mvccpb.KeyValue) {
	allocOwner := map[netip.Addr]string{}
	for _, kv := range allocs {
		_, _, ip, err := keyspace.ParseIPKey(string(kv.Key))
		if err != nil {
			continue
		}
		a, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
		if err != nil {
			m.t.Errorf("allocation %s: %v", kv.Key, err)
			continue
		}
		allocOwner[ip] = a.Owner
	}
	index := map[string]keyspace.OwnerRecord{}
	for _, kv := range owners {
		rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
		if err == nil {
			index[string(kv.Key)] = rec
		}
	}
	type resting struct {
		claim string
		lease int64
	}
	rest := map[netip.Addr]resting{}
	for _, kv := range quarantine {
		_, _, ip, err := keyspace.ParseQuarantineKey(string(kv.Key))
		if err != nil {
			continue
		}
		q, err := keyspace.Decode[keyspace.QuarantineRecord](string(kv.Key), kv.Value)
		if err != nil {
			m.t.Errorf("quarantine %s: %v", kv.Key, err)
			continue
		}
		rest[ip] = resting{q.Claim, kv.Lease}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	records := map[string]keyspace.ClaimRecord{}
	for _, kv := range claims {
		_, pool, name, err := keyspace.ParseClaimKey(string(kv.Key))
		if err != nil || pool != m.pool.Name {
			m.t.Errorf("claim key %s: not of pool %s (%v)", kv.Key, m.pool.Name, err)
			continue
		}
		rec, err := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
		if err != nil {
			m.t.Errorf("claim %s: %v", kv.Key, err)
			continue
		}
		records[name] = rec
		ord := strings.TrimPrefix(name, "ns.")
		if want, ok := m.claimIPs[ord]; !ok || !slices.Equal(want, rec.IPs) {
			m.t.Errorf("claim %s holds %v, the model's ordinal %s has %v", kv.Key, rec.IPs, ord, want)
		}
		// The record and its addresses' quarantine keys, marked with it, are on one lease.
		for _, ip := range rec.IPs {
			if r, ok := rest[ip]; !ok || r.claim != name || r.lease != kv.Lease {
				m.t.Errorf("claim %s (lease %x) has %s, whose quarantine key is %+v (present %v), want marked with the claim on its lease",
					name, kv.Lease, ip, r, ok)
			}
		}
		cur, live := m.incarnationLocked(ord, "")
		if rec.Holder == nil {
			if live {
				m.t.Errorf("claim %s names no holder, and the model gives its addresses to %v", name, cur)
			}
			for _, ip := range rec.IPs {
				if o, ok := allocOwner[ip]; ok {
					m.t.Errorf("claim %s is released, and its address %s is allocated to %s", name, ip, o)
				}
			}
			continue
		}
		h := rec.Holder
		if live && (cur.owner != h.Owner || cur.ifName != h.IfName) {
			m.t.Errorf("claim %s names holder %s/%s, the model's live incarnation is %v", name, h.Owner, h.IfName, cur)
		}
		ix, ok := index[keyspace.OwnerKey(m.cluster, h.Owner, h.IfName, m.pool.Name)]
		switch {
		case ok && !slices.Equal(ix.IPs, rec.IPs):
			m.t.Errorf("claim %s holds %v, its holder %s's owner index lists %v", name, rec.IPs, h.Owner, ix.IPs)
		case ok && (ix.Claim != name || ix.ClaimLease != keyspace.LeaseHex(clientv3.LeaseID(kv.Lease))):
			// A release reads the claim from the owner index (GC, a DEL after the agent
			// re-read it): one that does not name the claim releases the addresses into
			// ordinary quarantine, after which any pod may take them.
			m.t.Errorf("claim %s (on lease %x) is held by %s, whose owner index names claim %q on lease %q",
				name, kv.Lease, h.Owner, ix.Claim, ix.ClaimLease)
		case !ok && m.isLiveNode(h.Node, h.NodeUID):
			m.t.Errorf("claim %s names holder %s on live node %s (uid %s), which has no owner index (the model: live incarnation %v %v)",
				name, h.Owner, h.Node, h.NodeUID, live, cur)
		case !ok && live && !m.awayLocked(cur):
			m.t.Errorf("claim %s names holder %s of a dead node, and the model gives its addresses to %v", name, h.Owner, cur)
		}
	}
	for ord, ips := range m.claimIPs {
		if _, ok := records[modelClaim(ord)]; !ok {
			m.t.Errorf("the record of claim %s (%v) is gone before its hold ended", modelClaim(ord), ips)
		}
	}
	// An allocation and a claim-marked quarantine key of one address: the claim's holder's.
	for ip, r := range rest {
		if r.claim == "" {
			continue
		}
		rec, ok := records[r.claim]
		if !ok || !slices.Contains(rec.IPs, ip) {
			m.t.Errorf("%s rests under claim %s, whose record does not list it (present %v: %v)", ip, r.claim, ok, rec.IPs)
			continue
		}
		if o, held := allocOwner[ip]; held && (rec.Holder == nil || rec.Holder.Owner != o) {
			m.t.Errorf("%s rests under claim %s (holder %s) and is allocated to %s", ip, r.claim, holderName(rec), o)
		}
	}
	// No owner but an ordinal's incarnation holds a claim's address (a pod of a node cut off
	// longer than the reuse delay may list one, taken since: its conflict).
	for k, held := range m.held {
		for _, a := range held {
			if slices.Contains(m.conflict[k], a) {
				continue
			}
			if ord := m.claimOfAddrLocked(a); ord != "" && m.stsOf[k.owner] != ord {
				m.t.Errorf("model: %v holds %s of claim %s", k, a, modelClaim(ord))
			}
		}
	}
}

// claimLeaseSet lists the claim leases an agent renews: a dead node's run out after the hold,
// not with its pod leases.
func claimLeaseSet(a *Agent) map[clientv3.LeaseID]bool {
	out := map[clientv3.LeaseID]bool{}
	for _, id := range a.pods.ClaimLeases() {
		out[id] = true
	}
	return out
}

// endClaims lets every claim's hold run out at the end of a history: its lease is revoked
// (as etcd would after the hold), taking the record and its quarantine keys. Before that,
// every claim must be released, or name a holder of a dead node.
func (m *model) endClaims(ctx context.Context, i int) {
	resp, err := m.cli.Get(ctx, keyspace.ClaimsPrefix(m.cluster), clientv3.WithPrefix())
	if err != nil {
		m.t.Fatal(err)
	}
	var ended []string
	for _, kv := range resp.Kvs {
		rec, _ := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
		if h := rec.Holder; h != nil && m.isLiveNode(h.Node, h.NodeUID) {
			m.t.Errorf("every attachment was deleted, and claim %s still names holder %s on live node %s", kv.Key, h.Owner, h.Node)
		}
		if kv.Lease == 0 {
			m.t.Errorf("claim %s is on no lease: it would never end", kv.Key)
			continue
		}
		if _, err := m.cli.Revoke(ctx, clientv3.LeaseID(kv.Lease)); err != nil && !keyspace.IsLeaseNotFound(err) {
			m.t.Fatalf("revoke the lease of claim %s: %v", kv.Key, err)
		}
		ended = append(ended, fmt.Sprintf("%s (holder %s)", kv.Key, holderName(rec)))
	}
	m.mu.Lock()
	clear(m.claimIPs)
	clear(m.claimTakers)
	m.mu.Unlock()
	m.log("%d SETTLE: the holds of %d claims run out: %v", i, len(ended), ended)
}

// claimRepairProblemsLocked says what of the claims the agents have not repaired yet after a
// restore (claims and quarantine keys as read, owners the owner indexes): each live
// incarnation's claim names it, on the claim lease its owner index names, with the
// quarantine key of each address it holds marked with the claim on that lease; no claim
// names a holder of a live node that is not the ordinal's live incarnation; and every
// ordinal's claim exists. m.mu is held.
func (m *model) claimRepairProblemsLocked(claims, quarantine []*mvccpb.KeyValue, owners map[string]stored[keyspace.OwnerRecord]) (out []string) {
	rest := map[netip.Addr]*mvccpb.KeyValue{}
	for _, kv := range quarantine {
		if _, _, ip, err := keyspace.ParseQuarantineKey(string(kv.Key)); err == nil {
			rest[ip] = kv
		}
	}
	seen := map[string]bool{}
	for _, kv := range claims {
		_, _, name, err := keyspace.ParseClaimKey(string(kv.Key))
		rec, derr := keyspace.Decode[keyspace.ClaimRecord](string(kv.Key), kv.Value)
		if err != nil || derr != nil {
			continue // checkSticky reports it
		}
		ord := strings.TrimPrefix(name, "ns.")
		seen[ord] = true
		cur, live := m.incarnationLocked(ord, "")
		h := rec.Holder
		switch {
		case live && !m.awayLocked(cur) && (h == nil || h.Owner != cur.owner || h.IfName != cur.ifName):
			out = append(out, fmt.Sprintf("claim %s names holder %s, the model's live incarnation is %v", name, holderName(rec), cur))
			continue
		case !live && h != nil && m.isLiveNode(h.Node, h.NodeUID):
			out = append(out, fmt.Sprintf("claim %s names holder %s of live node %s, which the model has deleted", name, holderName(rec), h.Node))
			continue
		case !live || m.awayLocked(cur):
			continue
		}
		if ix, ok := owners[m.ownerKey(cur)]; !ok || ix.rec.ClaimLease != keyspace.LeaseHex(clientv3.LeaseID(kv.Lease)) {
			out = append(out, fmt.Sprintf("claim %s is on lease %x, the owner index of %v names %q (present %v)", name, kv.Lease, cur,
				ix.rec.ClaimLease, ok))
		}
		for _, ip := range rec.IPs {
			if slices.Contains(m.conflict[cur], ip) {
				continue
			}
			q, ok := rest[ip]
			var qrec keyspace.QuarantineRecord
			if ok {
				qrec, _ = keyspace.Decode[keyspace.QuarantineRecord](string(q.Key), q.Value)
			}
			if !ok || qrec.Claim != name || q.Lease != kv.Lease {
				out = append(out, fmt.Sprintf("claim %s (lease %x): the quarantine key of %s is %+v (present %v), want marked with the claim on its lease",
					name, kv.Lease, ip, qrec, ok))
			}
		}
	}
	for ord, ips := range m.claimIPs {
		switch {
		case seen[ord]:
		case m.claimKeptLocked(ord):
			out = append(out, fmt.Sprintf("the record of claim %s is gone", modelClaim(ord)))
		default:
			// Created after the backup by agents that all died since: no agent knows it, and
			// the restore lost it. The ordinal's next incarnation makes a new claim.
			delete(m.claimIPs, ord)
			delete(m.claimTakers, ord)
			m.history = append(m.history, fmt.Sprintf("  the record of claim %s (%v) is gone with the restore, and no live agent "+
				"took it: lost (docs/operations.md, \"Restoring etcd from a backup\")", modelClaim(ord), ips))
			m.count["claim lost with a restore"]++
		}
	}
	return out
}
