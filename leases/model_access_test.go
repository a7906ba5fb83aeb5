package leases

import (
	"context"
	"errors"
	"fmt"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Pool access and selection rules among the model's steps (issue 34). Now and then a step
// first closes the pool, locks it to another namespace than the model's pods' ("ns"), opens
// it again, or writes or deletes selection rules that name it (a namespace rule for "ns" and
// a node rule matching every node). Then the step's operations run as usual, and:
//
//   - while the pool is closed or locked away, no ADD of a new attachment gets an address: it
//     is refused as invalid configuration, naming the pool; nor does the first incarnation of
//     a StatefulSet ordinal, whose claim has no addresses yet;
//   - every other operation goes on as with the pool open: a repeated ADD returns the
//     attachment's addresses, a DEL, CHECK and GC find it, a re-claim (a lease lost, a node
//     back from a cut-off, a key deleted by hand, etcd restored) takes its own addresses
//     back, and a sticky claim's new incarnation gets the claim's addresses: the checks of
//     every other step hold, and DEL all at the end leaves nothing behind, closed or not;
//   - rules naming the pool the ADD would use anyway change nothing an ADD gets.
//
// The same steps change the dual-stack network's (model_dual_test.go): its rule leaves its
// small IPv4 pool out or names it again, or that pool or its IPv6 pool is closed until the
// pool reopens; the step waits until every agent chooses by what was written.
//
// Access and rules are keys in etcd, so a restore takes them back to the backup's (the
// model's backups record them).

// modelAccess is the pool's access and whether the rules are written.
type modelAccess struct {
	closed, locked, rules bool
}

// modelClosedSteps is how many steps the pool stays closed or locked.
const modelClosedSteps = 4

func (a modelAccess) String() string {
	return fmt.Sprintf("closed=%v locked=%v rules=%v", a.closed, a.locked, a.rules)
}

// modelOtherNamespace is the namespace the pool is locked to: not the model's pods'.
const modelOtherNamespace = "other"

// closedToNew tells whether the model's pods may get no new address from the pool.
func (m *model) closedToNew() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.access.closed || m.access.locked
}

// changeAccess changes the pool's access or the rules, chosen by the step number so that the
// history's random draws stay those of a model without this step.
func (m *model) changeAccess(ctx context.Context, i int) {
	if m.changeDual(ctx, i) { // model_dual_test.go
		m.inc("access")
		m.mu.Lock()
		if m.dual.v4aOff || m.dual.v6Off {
			m.reopenAt = i + modelClosedSteps
		}
		m.mu.Unlock()
		m.awaitRulesSeen(i)
	}
	m.mu.Lock()
	was := m.access
	m.mu.Unlock()
	now := was
	var err error
	switch {
	case i%4 >= 2:
		now.rules = !was.rules
		err = m.writeRules(ctx, now.rules)
	case was.closed || was.locked:
		return // reopen opens it
	case i%4 == 0:
		now.closed = true
	default:
		now.locked = true
	}
	if now.closed != was.closed || now.locked != was.locked {
		_, _, _, err = admin.SetPoolAccess(ctx, m.cli, m.pool.Name, func(a *keyspace.PoolAccess) {
			a.Closed = now.closed
			a.Namespaces = nil
			if now.locked {
				a.Namespaces = []string{modelOtherNamespace}
			}
		})
	}
	if errors.Is(err, admin.ErrNotFound) {
		m.log("%d ACCESS unchanged: the pool is not stored yet", i)
		return // no ADD stored the pool yet
	}
	if err != nil {
		m.t.Fatalf("step %d: change the pool's access or rules from %v to %v: %v", i, was, now, err)
	}
	m.mu.Lock()
	m.access = now
	if now.closed || now.locked {
		m.reopenAt = i + modelClosedSteps
	}
	m.mu.Unlock()
	m.inc("access")
	m.log("%d ACCESS %v -> %v", i, was, now)
}

// reopen opens the pool at the start of a step modelClosedSteps after it was closed or
// locked: the history's other steps want room.
func (m *model) reopen(ctx context.Context, i int) {
	m.mu.Lock()
	was := m.access
	due := i >= m.reopenAt
	dual := due && (m.dual.v4aOff || m.dual.v6Off)
	due = due && (was.closed || was.locked)
	m.mu.Unlock()
	if dual {
		m.reopenDual(ctx, i)
		m.awaitRulesSeen(i)
	}
	if !due {
		return
	}
	if _, _, _, err := admin.SetPoolAccess(ctx, m.cli, m.pool.Name, func(a *keyspace.PoolAccess) { *a = keyspace.PoolAccess{} }); err != nil {
		m.t.Fatalf("step %d: open the pool: %v", i, err)
	}
	m.mu.Lock()
	m.access.closed, m.access.locked = false, false
	m.mu.Unlock()
	m.log("%d ACCESS %v -> open", i, was)
}

// writeRules writes the rules naming the pool, or deletes them.
func (m *model) writeRules(ctx context.Context, on bool) error {
	const rule = "model-nodes"
	if !on {
		if _, err := admin.DeleteRule(ctx, m.cli, m.cluster, m.pool.Name, keyspace.RuleNamespace, "ns"); err != nil {
			return err
		}
		_, err := admin.DeleteRule(ctx, m.cli, m.cluster, m.pool.Name, keyspace.RuleNode, rule)
		return err
	}
	if err := admin.SetNamespaceRule(ctx, m.cli, m.cluster, m.pool.Name, "ns", keyspace.NamespaceRule{Pools: []string{m.pool.Name}}); err != nil {
		return err
	}
	return admin.SetNodeRule(ctx, m.cli, m.cluster, m.pool.Name, rule, keyspace.NodeRule{Names: []string{"n*"}, Pools: []string{m.pool.Name}})
}

// refusedClosed tells whether err is the refusal of a new address from the closed or
// locked pool, and counts it.
func (m *model) refusedClosed(err error) bool {
	if !errors.Is(err, allocator.ErrInvalidConfig) || !m.closedToNew() {
		return false
	}
	m.inc("add refused: pool closed")
	return true
}
