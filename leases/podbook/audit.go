package podbook

import (
	"net/netip"
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Audit is the book as the agent's audit (leases/audit.go) reads it: which keys each running
// pod must have in etcd, the ModRevision each had when last found right, and the sticky
// claims of running attachments.
type Audit struct{ t *Book }

// Audit returns the book's audit view.
func (t *Book) Audit() Audit { return Audit{t} }

// AuditKind is what a key of a running pod is.
type AuditKind uint8

const (
	AuditPodRecord AuditKind = iota
	AuditOwnerIndex
	AuditAllocation
)

// AuditKey is one key of a running pod, as the audit expects it.
type AuditKey struct {
	Key       string
	Kind      AuditKind
	Container string // an owner index's container
	Rev       int64  // ModRevision when last read and found right; 0: not yet
	// An allocation's pool and address; watched when a view of this node follows its block:
	// the view reports a change to it at once (ownKeys), so the audit's compares leave it out
	// unless the view listed its pool again since the last audit (a watch broke meanwhile).
	Pool    string
	Addr    netip.Addr
	Watched bool
}

// AuditPod is what the audit expects of one running pod: its keys on its lease.
type AuditPod struct {
	Owner string
	Lease clientv3.LeaseID
	Keys  []AuditKey
}

// Verified tells whether every key has a ModRevision to compare.
func (p AuditPod) Verified() bool {
	return !slices.ContainsFunc(p.Keys, func(k AuditKey) bool { return k.Rev == 0 })
}

// Pods lists what the audit expects of each running pod (leases/audit.go): its pod record, and
// for each attachment its owner index and the allocations of its addresses no other owner
// holds, with the ModRevision each had when last checked. A pod whose lease is not held is
// being re-claimed, and one with a DEL waiting for etcd is going: neither is checked. An
// attachment of a pool missing from layouts (being migrated) has its allocations left out.
func (v Audit) Pods(cluster, node string, layouts map[string]allocator.Blocks) []AuditPod {
	t := v.t
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]AuditPod, 0, len(t.m))
	for _, ps := range t.m {
		if p, ok := ps.auditPod(cluster, node, layouts); ok {
			out = append(out, p)
		}
	}
	return out
}

// One is Pods for one pod.
func (v Audit) One(owner, cluster, node string, layouts map[string]allocator.Blocks) (AuditPod, bool) {
	t := v.t
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return AuditPod{}, false
	}
	return ps.auditPod(cluster, node, layouts)
}

// auditPod is what the audit expects of ps (Audit.Pods).
func (ps *PodState) auditPod(cluster, node string, layouts map[string]allocator.Blocks) (AuditPod, bool) {
	lease, held := ps.lease.held()
	if !held || len(ps.Attachments) == 0 || slices.ContainsFunc(ps.Attachments, func(at Attachment) bool { return at.Released }) {
		return AuditPod{}, false
	}
	p := AuditPod{Owner: ps.Owner, Lease: lease}
	revOf := func(key string) int64 {
		if ps.checked.lease != lease {
			return 0
		}
		return ps.checked.revs[key]
	}
	add := func(key string, kind AuditKind, container string) {
		p.Keys = append(p.Keys, AuditKey{Key: key, Kind: kind, Container: container, Rev: revOf(key)})
	}
	add(keyspace.PodKey(cluster, node, ps.Owner), AuditPodRecord, "")
	for _, at := range ps.Attachments {
		add(keyspace.OwnerKey(cluster, ps.Owner, at.IfName, at.Pool), AuditOwnerIndex, at.ContainerID)
		blocks, ok := layouts[at.Pool]
		if !ok || at.Target {
			continue // a migration's target: its addresses' keys are its source's
		}
		for _, ip := range at.IPs {
			if !slices.Contains(at.Conflicts, ip) {
				key := keyspace.IPKey(at.Pool, blocks, ip)
				p.Keys = append(p.Keys, AuditKey{Key: key, Kind: AuditAllocation, Container: at.ContainerID, Rev: revOf(key),
					Pool: at.Pool, Addr: ip})
			}
		}
	}
	return p, true
}

// Verified records the ModRevisions of p's keys as read (kvs, in p.Keys' order) and found
// right, if the pod still holds the lease they were read on. It takes no owner lock, by
// design: the revisions are kept only while the lease they were read on is the pod's.
func (v Audit) Verified(p AuditPod, kvs []*mvccpb.KeyValue) {
	revs := make(map[string]int64, len(p.Keys))
	for i, k := range p.Keys {
		if kvs[i] != nil {
			revs[k.Key] = kvs[i].ModRevision
		}
	}
	t := v.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[p.Owner]; ok && ps.lease.id == p.Lease {
		ps.checked = checkedKeys{lease: p.Lease, revs: revs}
	}
}

// ClaimHolder is an attachment of a running pod that holds a sticky claim (Audit.Sticky).
type ClaimHolder struct {
	Owner string
	At    Attachment // a copy
}

// Targets lists the attachments of running pods (those Pods lists) that are live
// migrations' targets: the migrations the target's agent watches.
func (v Audit) Targets() []ClaimHolder {
	t := v.t
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []ClaimHolder
	for _, ps := range t.m {
		if _, held := ps.lease.held(); !held {
			continue
		}
		for _, at := range ps.Attachments {
			if at.Target && !at.Released {
				at.IPs = slices.Clone(at.IPs)
				out = append(out, ClaimHolder{Owner: ps.Owner, At: at})
			}
		}
	}
	return out
}

// Sticky lists the attachments of running pods (those Pods lists) that hold a sticky claim
// in the pools of layouts: the claims the audit checks.
func (v Audit) Sticky(layouts map[string]allocator.Blocks) []ClaimHolder {
	t := v.t
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []ClaimHolder
	for _, ps := range t.m {
		if _, held := ps.lease.held(); !held || slices.ContainsFunc(ps.Attachments, func(at Attachment) bool { return at.Released }) {
			continue
		}
		for _, at := range ps.Attachments {
			if _, ok := layouts[at.Pool]; at.Claim == "" || !ok || at.Target {
				continue
			}
			at.IPs, at.Conflicts = slices.Clone(at.IPs), slices.Clone(at.Conflicts)
			out = append(out, ClaimHolder{Owner: ps.Owner, At: at})
		}
	}
	return out
}
