package leases

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
)

// The part of TestModelRandomHistories that proves a DEL answered is final (issue 27): an
// agent killed right after a DEL's answer and started again, with or without its pod leases
// expiring meanwhile; and a DEL racing the re-claim of its pod's lost lease, sometimes a
// stale one (an older sandbox's), which must release nothing.
//
//   - the deleted attachment has no owner index, allocation or conflict record, and its
//     agent does not know it, right after the step and again modelGoneRecheck later;
//   - the held keys of an attachment deleted while its lease was lost are freed;
//   - the node's other pods, and the pod's other attachment, are kept: resumed, or re-claimed
//     (awaitReclaims), with no conflict but those the model knows; a stale DEL racing the
//     re-claim releases nothing, and the attachment is re-claimed.

// modelGoneRecheck is how long after a DEL the model looks again that nothing came back.
const modelGoneRecheck = 300 * time.Millisecond

// crashAfterDel DELs one attachment and kills its agent right after the answer (crash: what
// the journal has not written yet is lost), then starts it again; half the time the agent
// stays away past the pod lease TTL meanwhile (its pod and node leases expire: its pods are
// re-claimed from the journal). The deleted attachment never comes back; the node's other
// pods are kept. It reports false when the chosen node has no attachment.
func (m *model) crashAfterDel(ctx context.Context, i int) bool {
	live := m.live()
	ni := live[m.rng.IntN(len(live))]
	n := m.nodes[ni]
	keys := slices.DeleteFunc(m.attachmentsOn(ni), func(k attKey) bool { return m.sourceOfAwayTarget(k.owner) })
	if len(keys) == 0 {
		return false
	}
	k := keys[m.rng.IntN(len(keys))]
	expire := m.rng.IntN(2) == 0
	m.mu.Lock()
	held, container := m.held[k], m.ctr[k]
	m.mu.Unlock()
	sent := time.Now()
	err := n.agent.Del(ctx, m.req(k, container))
	m.release(k, held, sent)
	m.crashNode(ctx, i, ni, expire)
	m.log("%d %s DEL %v %s -> %v, then CRASH (its pod leases expire: %v)", i, n.name, k, container, err, expire)
	m.count["crash after DEL"]++
	if err != nil {
		m.t.Errorf("step %d: DEL %v: %v", i, k, err)
	}
	n.agent = m.start(n)
	// A live migration's source or target on the node: its expired keys are taken up again,
	// or the target was promoted (awaitMigrations).
	m.awaitMigrations(i, fmt.Sprintf("%s crashed (its pod leases expire: %v)", n.name, expire))
	seen := m.awaitReclaims(i, ni)
	if got, want := n.agent.Conflicts(), int64(seen.sure); !expire && got != 0 || expire && got != want {
		m.t.Errorf("step %d: %s restarted (pod leases expired: %v) and counted %d conflicts; the model has %d in conflict", i, n.name, expire, got, seen.sure)
	}
	m.checkGone(ctx, i, n, k, held, "its agent crashed right after the answer")
	m.endDisplaced(ctx, i)
	return true
}

// delDuringReclaim revokes one pod's lease behind its agent's back, as lose does, and DELs
// one of its attachments while the agent finds the lease lost and re-claims the pod: either
// once both wait for the owner lock, which the test holds until then; or once the agent found
// the lease lost, racing the re-claim; or at once, before the agent knows (its next
// keep-alive, up to a third of the TTL later; a DEL retried when etcd is back comes then).
// The deleted attachment has no key afterwards, nor a little later, and its held keys are
// freed; the pod's other attachment is re-claimed. A quarter of the DELs are stale (an older
// sandbox's, replayed): they release nothing, and the attachment is re-claimed. Sticky
// incarnations are left out. It reports false when the chosen node has no attachment.
func (m *model) delDuringReclaim(ctx context.Context, i int) bool {
	live := m.live()
	ni := live[m.rng.IntN(len(live))]
	n := m.nodes[ni]
	keys := slices.DeleteFunc(m.attachmentsOn(ni), func(k attKey) bool { return m.ordinalOf(k.owner) != "" })
	if len(keys) == 0 {
		return false
	}
	k := keys[m.rng.IntN(len(keys))]
	how, stale := m.rng.IntN(3), m.rng.IntN(4) == 0
	pause := time.Duration(m.rng.IntN(4)) * 5 * time.Millisecond
	a := n.agent
	lease, ok := a.pods.Lease(k.owner)
	if !ok {
		m.t.Errorf("step %d: %s holds no lease of %v", i, n.name, k)
		return true
	}
	m.mu.Lock()
	held, container := m.held[k], m.ctr[k]
	m.mu.Unlock()
	if stale {
		container += "-old"
	}
	var own *ownerlock.Owned
	if how == 0 {
		own = a.locks.Lock(k.owner)
	}
	m.revoke(ctx, i, lease)
	if how < 2 {
		a.keeper.MarkLost(lease) // found at once, not at its next keep-alive
		deadline := time.Now().Add(modelReclaimWait)
		for {
			if _, lost := a.pods.LostPod(k.owner); lost {
				break
			}
			if l, ok := a.pods.Lease(k.owner); ok && l != lease {
				break // re-claimed already
			}
			if time.Now().After(deadline) {
				m.t.Errorf("step %d: %s never found the lease of %s lost", i, n.name, k.owner)
				if own != nil {
					own.Unlock()
				}
				return true
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	done := make(chan error, 1)
	go func() { done <- a.Del(ctx, m.req(k, container)) }()
	if own != nil {
		time.Sleep(pause) // the DEL and the re-claim queue for the owner
		own.Unlock()
	}
	err := <-done
	a.keeper.MarkLost(lease) // found by now in any case (a no-op if it was)
	m.log("%d %s LOSE lease %s of %s and DEL %v %s stale=%v (%s) -> %v", i, n.name, keyspace.LeaseHex(lease), k.owner, k, container, stale,
		[]string{"both waiting for the owner lock", "once the agent found the lease lost", "before the agent knew"}[how], err)
	m.count["del during re-claim"]++
	if err != nil {
		m.t.Errorf("step %d: DEL %v: %v", i, k, err)
	}
	if stale {
		m.awaitReclaims(i, ni) // k too
		return true
	}
	// Released, or found expired: no quarantine then, but its last holder expired.
	m.mu.Lock()
	delete(m.held, k)
	delete(m.ctr, k)
	delete(m.conflict, k)
	for _, ad := range held {
		m.expired[ad] = true
	}
	m.mu.Unlock()
	m.awaitReclaims(i, ni)
	m.checkGone(ctx, i, n, k, held, "its pod's lease was lost and being re-claimed")
	// Its held keys are freed: nothing holds the addresses back for a pod that runs.
	deadline := time.Now().Add(modelViewSettle)
	for {
		st := m.readState(ctx)
		var left []string
		for _, ad := range held {
			if h, ok := st.held[ad]; ok && h.rec.Owner == k.owner {
				left = append(left, fmt.Sprintf("%s on %s", ad, keyspace.LeaseHex(h.lease)))
			}
		}
		if len(left) == 0 {
			return true
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: %v was deleted while its pod's lease was lost, and %s later the held keys of %v are left",
				i, k, modelViewSettle, left)
			return true
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkGone checks that the deleted attachment k left nothing: no owner index, conflict
// record or allocation, and its agent does not know it; then again a little later, when a
// re-claim or a replayed journal would have brought it back.
func (m *model) checkGone(ctx context.Context, i int, n *modelNode, k attKey, held []netip.Addr, why string) {
	for round := range 2 {
		if round > 0 {
			time.Sleep(modelGoneRecheck)
		}
		st := m.readState(ctx)
		for _, pool := range m.poolNamesOf(k) {
			if ix, ok := st.owners[keyspace.OwnerKey(m.cluster, k.owner, k.ifName, pool)]; ok {
				m.t.Errorf("step %d: %v was deleted (%s), and its owner index in pool %s is there: %+v", i, k, why, pool, ix.rec)
			}
			if c, ok := st.conflicts[keyspace.ConflictKey(m.cluster, k.owner, k.ifName, pool)]; ok {
				m.t.Errorf("step %d: %v was deleted (%s), and its conflict record in pool %s is there: %+v", i, k, why, pool, c.rec)
			}
		}
		for _, a := range held {
			if al, ok := st.allocs[a]; ok && al.rec.Owner == k.owner && al.rec.IfName == k.ifName {
				m.t.Errorf("step %d: %v was deleted (%s), and it holds %s again", i, k, why, a)
			}
		}
		if ps, ok := n.agent.pods.Snapshot(k.owner); ok && slices.ContainsFunc(ps.Attachments, func(at attachment) bool {
			return at.IfName == k.ifName && slices.Contains(m.poolNamesOf(k), at.Pool)
		}) {
			m.t.Errorf("step %d: %v was deleted (%s), and agent %s still knows it: %+v", i, k, why, n.name, ps.Attachments)
		}
		if m.t.Failed() {
			return
		}
	}
}
