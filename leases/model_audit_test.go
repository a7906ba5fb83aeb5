package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The part of TestModelRandomHistories that proves a live lease is not proof (issue 32): an
// admin deletes a key of a running pod with etcdctl, or puts a value over it. The agent checks
// the keys it keeps every modelAuditInterval (audit.go) and puts them back on a new lease of
// the pod, as after a lost lease.
//
//   - the pod's keys are back: its agent holds the pod on a new lease, and its pod record,
//     owner index and every address nobody else holds are on it (awaitReclaims);
//   - an allocation overwritten with another owner's is a conflict (Conflicts(), the conflict
//     record, CHECK code 104), and the address is the running pod's again once that owner
//     lets it go (its lease expires, a few steps later): resolve;
//   - no ADD of the node meanwhile gets an address of the pod (admitLocked), and the pod's own
//     ADD, repeated meanwhile, returns its addresses or asks to try again (code 11).

const (
	// modelAuditInterval is the model agents' Config.AuditInterval: short, so that a step
	// waits little for the repair.
	modelAuditInterval = 500 * time.Millisecond
	// modelIntruderIf is the interface of the owners an admin puts over running pods'
	// allocations.
	modelIntruderIf = "eth0"
)

// What tamper does to the key.
const (
	tamperDeleted    = "deleted"
	tamperOwnValue   = "overwritten with its own value without its lease"
	tamperOtherOwner = "overwritten with another owner's value"
)

// modelIntruder is another owner's allocation an admin put over a running pod's: on a lease
// the model revokes at step until, when that owner lets the address go.
type modelIntruder struct {
	owner string
	lease clientv3.LeaseID
	until int
}

// intrudedLocked reports whether an admin put another owner over a; m.mu is held.
func (m *model) intrudedLocked(a netip.Addr) bool {
	_, ok := m.intruders[a]
	return ok
}

// tamper changes one key of a running pod on a connected node as an admin does with etcdctl:
// deletes its pod record, an owner index or an allocation, or puts over one the pod's own
// value without its lease, or, over an allocation of a pod that names no sticky claim,
// another owner's. The pod may be a live migration's source, or its target, whose keys are
// its pod record, owner index and migration key (awaitMigrations). ADDs of new pods on the node run meanwhile, and sometimes the pod's own
// ADD again (a runtime's retry). The step waits until the agent
// holds the pod on a new lease with every key back, the address another owner holds in
// conflict. It reports false when no pod runs on a connected node.
func (m *model) tamper(ctx context.Context, i int) bool {
	var cands []attKey
	targets := map[attKey]string{} // live migrations' targets, with their ordinals
	m.mu.Lock()
	for k := range m.held {
		if n := m.nodes[m.home[k.owner]]; n.agent != nil && n.away == 0 {
			cands = append(cands, k)
		}
	}
	for ord, tgt := range m.targets {
		if n := m.nodes[m.home[tgt.k.owner]]; n.agent != nil && n.away == 0 {
			cands = append(cands, tgt.k)
			targets[tgt.k] = ord
		}
	}
	m.mu.Unlock()
	sort.Slice(cands, func(a, b int) bool { return cands[a].owner+cands[a].ifName < cands[b].owner+cands[b].ifName })
	if len(cands) == 0 {
		return false
	}
	k := cands[m.rng.IntN(len(cands))]
	ni := m.home[k.owner]
	n := m.nodes[ni]
	old, ok := n.agent.pods.Lease(k.owner)
	if !ok {
		m.t.Errorf("step %d: %s holds no lease of running pod %s", i, n.name, k.owner)
		return true
	}
	m.mu.Lock()
	own := slices.DeleteFunc(slices.Clone(m.held[k]), func(a netip.Addr) bool { return slices.Contains(m.conflict[k], a) })
	keys := []string{keyspace.PodKey(m.cluster, n.name, k.owner)}
	for _, part := range m.partsOf(k, m.held[k]) {
		keys = append(keys, part.ownerKey) // one per pool of a net2 attachment
	}
	m.mu.Unlock()
	ord, target := targets[k]
	migKey := ""
	if target {
		// A live migration's target keeps its pod record, owner index and migration key; its
		// addresses' keys are its source's (model_migration_test.go).
		migKey = keyspace.LiveMigrationKey(m.cluster, m.pool.Name, modelClaim(ord))
		keys = append(keys, m.ownerKey(k), migKey)
	}
	var allocs []string
	for _, a := range own {
		p := m.poolOf(a)
		allocs = append(allocs, keyspace.IPKey(p.Name, p.Blocks, a))
	}
	keys = append(keys, allocs...)
	how := []string{tamperDeleted, tamperDeleted, tamperOwnValue, tamperOtherOwner}[m.rng.IntN(4)]
	if how == tamperOtherOwner && (len(allocs) == 0 || m.ordinalOf(k.owner) != "") {
		// Another owner's value is an allocation's; a claim's address stays its holder's
		// (model_sticky_test.go).
		how = tamperOwnValue
	}
	if how == tamperOtherOwner {
		keys = allocs
	}
	key := keys[m.rng.IntN(len(keys))]
	_, _, ip, _ := keyspace.ParseIPKey(key)
	resp, err := m.cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		m.t.Fatalf("step %d: %s of running pod %v: %v %v", i, key, k, resp, err)
	}
	var intruder modelIntruder
	switch how {
	case tamperDeleted:
		_, err = m.cli.Delete(ctx, key)
	case tamperOwnValue:
		_, err = m.cli.Put(ctx, key, string(resp.Kvs[0].Value))
	default:
		var g *clientv3.LeaseGrantResponse
		if g, err = m.cli.Grant(ctx, 3600); err != nil {
			break
		}
		intruder = modelIntruder{owner: fmt.Sprintf("intruder-%d", i), lease: g.ID, until: i + 1 + m.rng.IntN(6)}
		val := keyspace.Encode(keyspace.Allocation{Owner: intruder.owner, Cluster: m.cluster + "-other", Node: "elsewhere",
			NodeUID: "uid-elsewhere", ContainerID: intruder.owner, IfName: modelIntruderIf})
		_, err = m.cli.Put(ctx, key, val, clientv3.WithLease(g.ID))
		// The pod's re-claim finds the address taken: a conflict until that owner lets it go.
		m.mu.Lock()
		m.intruders[ip] = intruder
		m.conflict[k] = append(m.conflict[k], ip)
		m.mu.Unlock()
	}
	if err != nil {
		m.t.Fatalf("step %d: change %s: %v", i, key, err)
	}
	m.log("%d %s of running pod %v on %s (lease %s) %s", i, key, k, n.name, keyspace.LeaseHex(old), how)
	m.count["tamper"]++
	m.count["tamper: "+how]++
	// New pods on the node meanwhile: none may get an address of the pod (admitLocked).
	busy := map[string]bool{k.owner: true}
	var adds []attKey
	for range m.rng.IntN(3) {
		owner := fmt.Sprintf("pod%02d", m.rng.IntN(24))
		if busy[owner] || m.holds(owner) || m.awayOwner(owner) || m.ordinalOf(owner) != "" {
			continue
		}
		busy[owner] = true
		m.home[owner] = ni
		adds = append(adds, attKey{owner: owner, ifName: modelIfNames[m.rng.IntN(len(modelIfNames))]})
	}
	again := m.rng.IntN(3) == 0 && !target // and the pod's own ADD, repeated
	m.expectAdds(m.neverHeldFree(ctx), len(adds))
	var wg sync.WaitGroup
	for _, nk := range adds {
		wg.Go(func() { m.do(ctx, i, n, nk, 0, 0, busy) })
	}
	if again {
		wg.Go(func() { m.addAgain(ctx, i, n, k) })
	}
	wg.Wait()
	// The repair: the pod on a new lease (keysLost revokes the old one), its pod record on it;
	// a target's migration key is put back on its pod lease (awaitMigrations).
	deadline := time.Now().Add(modelReclaimWait)
	for key != migKey {
		lease, held := n.agent.pods.Lease(k.owner)
		if held && lease != old {
			rec, err := m.cli.Get(ctx, keyspace.PodKey(m.cluster, n.name, k.owner))
			if err != nil {
				m.t.Fatal(err)
			}
			if len(rec.Kvs) == 0 || keyspace.LeaseOf(rec.Kvs[0]) != lease {
				m.t.Errorf("step %d: %s re-claimed %v on lease %s after its key %s was %s, without its pod record on it: %v",
					i, n.name, k, keyspace.LeaseHex(lease), key, how, rec.Kvs)
			}
			break
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: %s of running pod %v was %s, and %s later %s still holds the pod on lease %s (held: %v)",
				i, key, k, how, modelReclaimWait, n.name, keyspace.LeaseHex(old), held)
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	m.awaitMigrations(i, fmt.Sprintf("%s of %v was %s", key, k, how))
	m.awaitReclaims(i, ni)
	m.endDisplaced(ctx, i)
	return true
}

// evict lets go the addresses of the owners an admin put over running pods' allocations
// whose time has come (all: every one), as their lease expires; the running pods take them
// back (resolve).
func (m *model) evict(ctx context.Context, i int, all bool) {
	m.mu.Lock()
	var due []netip.Addr
	for a, in := range m.intruders {
		if all || i >= in.until {
			due = append(due, a)
		}
	}
	m.mu.Unlock()
	slices.SortFunc(due, netip.Addr.Compare)
	for _, a := range due {
		m.mu.Lock()
		in := m.intruders[a]
		delete(m.intruders, a)
		m.mu.Unlock()
		m.revoke(ctx, i, in.lease)
		m.log("%d %s lets %s go (its lease %s expires)", i, in.owner, a, keyspace.LeaseHex(in.lease))
	}
}

// addAgain repeats the ADD of running attachment k on node n while the agent repairs its keys:
// it returns k's addresses, or asks to try again.
func (m *model) addAgain(ctx context.Context, i int, n *modelNode, k attKey) {
	m.mu.Lock()
	held, container := m.held[k], m.ctr[k]
	m.mu.Unlock()
	res, err := n.agent.Add(ctx, m.req(k, container))
	m.log("%d %s ADD %v %s again -> %v %v", i, n.name, k, container, addrs(res), err)
	m.inc("add")
	switch {
	case errors.Is(err, allocator.ErrUnavailable):
	case err != nil:
		m.t.Errorf("step %d: repeated ADD of %v while its keys were put back: %v", i, k, err)
	case fmt.Sprint(addrs(res)) != fmt.Sprint(held):
		m.t.Errorf("step %d: ADD of %v repeated while its keys were put back is not idempotent: had %v, got %v", i, k, held, addrs(res))
	}
}
