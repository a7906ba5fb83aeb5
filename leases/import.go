package leases

import (
	"context"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/imports"
)

// What an import claims and what it did with each address (leases/imports), as the agent's
// callers (leaseholdd) name them.
type (
	Import       = imports.Import
	ImportedAddr = imports.ImportedAddr
	ImportReport = imports.ImportReport
)

// Import claims, for each attachment, the addresses another IPAM plugin gave a container
// that still runs on this node, so that no ADD hands them out again and the container's DEL,
// or GC, releases them. Each attachment is one claim (txn.Claim) on the owner's pod lease,
// which this agent renews: allocations, owner index and pod record in one create-if-absent
// transaction, then the journal. The owner is the pod UID when the attachment has one (a
// whereabouts allocation of a pod in the pods list), else the container ID (host-local);
// requests naming the pod UID then find it by container ID (attachmentOwner). With no netns
// path known, sandbox liveness never releases an imported pod: its DEL or CNI GC does.
//
// An address held by another owner is reported and never taken; one the pool does not hand
// out is reported. Running an import again changes nothing: addresses it holds are reported
// as already imported, and those released since it imported them (the ledger in the state
// directory) as released. The error is for what must stop the agent from serving: the pool
// is not defined, or etcd did not answer.
func (a *Agent) Import(ctx context.Context, imp Import) (ImportReport, error) {
	return a.imports.Run(ctx, imp)
}

// newImporter makes the import (leases/imports), handing in what it uses of the agent.
func (a *Agent) newImporter() *imports.Importer {
	cfg := a.cfg
	return imports.New(imports.Config{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID, OpTimeout: cfg.OpTimeout,
		WallClock: cfg.WallClock, StateDir: cfg.StateDir,
		Client: a.cli, Log: a.log, Pods: a.pods, Locks: &a.locks, Pools: a.pools, Keeper: a.keeper, Loops: a.loops,
		Stopped: a.Err, HeldFor: a.attach.HeldFor, ResumePod: a.attach.ResumePod,
		Allocation: a.attach.Allocation, OwnerRecord: a.attach.OwnerRecord, PodRecord: a.attach.PodRecord,
		Imported: a.metrics.imports})
}

// attachmentOwner is the owner a CNI request's attachment is kept under: the request's own
// (the pod UID when given), or the container ID when this agent keeps that container's
// attachment under it, as an import from host-local does. The container ID is part of the
// owner key and compared with the owner index's, so a request reaches only its own
// container's attachment.
func (a *Agent) attachmentOwner(req allocator.Request, owner string) string {
	if owner != req.ContainerID && a.pods.KeptByContainer(req.ContainerID, req.IfName, req.Pool.Name) {
		return req.ContainerID
	}
	return owner
}
