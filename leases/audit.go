package leases

import (
	"context"
	"errors"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/audit"
	"github.com/leasehold/leasehold/leases/podbook"
)

// newAuditor makes the audit (leases/audit), handing in what it uses of the agent. The views
// are handed in once Start has made them (SetPools): they are made after the audit, with its
// OwnKeys as their hooks. The recovery, the restore notices and the sticky claims it signals
// are reached through the agent's fields, set before the first audit runs.
func (a *Agent) newAuditor() *audit.Auditor {
	cfg := a.cfg
	return audit.New(audit.Config{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID, OpTimeout: cfg.OpTimeout,
		Client: a.cli, Keeper: a.keeper, Log: a.log, Pods: a.pods, Locks: &a.locks,
		NodeLease: a.self.Lease, BlockLeaseLost: a.blockLeaseLost,
		AuditClaims: func(ctx context.Context, layouts map[string]allocator.Blocks) error {
			return errors.Join(a.sticky.Audit(ctx, layouts), a.sticky.KeepTargets(ctx, layouts))
		},
		Wake: func() { a.recovery.Wake() },
		WentBack: func(why string, heldBefore map[podbook.ConflictRef]bool) {
			a.notices.EtcdWentBack(why)
			a.cwatch.HeldAlso(heldBefore)
		},
		CheckNow: func() { a.recovery.CheckNow() },
		Audits:   a.metrics.audits, PodKeysLost: a.metrics.podKeysLost})
}
