package leases

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/ownerlock"
)

// pods is what the agent knows of the pods whose leases it holds, one podState per owner,
// mirrored to the journal on every change. It is the only place the agent's pod map is read
// or written. A change to a pod takes the owner's lock (an ownerlock.Owned handle, package leases/ownerlock), so
// the changes of one pod never interleave; the map's own lock only keeps it consistent. Three
// changes take none, by design: restore (at start, before any request), lose (a lost lease,
// which no request may delay) and verified (audit revisions, kept only while the lease they
// were read on is the pod's).
type pods struct {
	nodeUID string
	jw      *journalWriter

	mu sync.Mutex
	m  map[string]*podState
	// addrs counts, per pool and address, the attachments of m listing it: the addresses of
	// this node's pods, held, being re-claimed or waiting for their release, which no ADD of
	// this node may offer to another pod (ownsAddr).
	addrs map[poolAddr]int
}

type poolAddr struct {
	pool string
	addr netip.Addr
}

func newPods(nodeUID string, jw *journalWriter) *pods {
	return &pods{nodeUID: nodeUID, jw: jw, m: make(map[string]*podState), addrs: make(map[poolAddr]int)}
}

// index adds (delta 1) or removes (-1) ps's addresses to t.addrs; the caller holds t.mu.
func (t *pods) index(ps *podState, delta int) {
	if ps == nil {
		return
	}
	for _, at := range ps.Attachments {
		for _, a := range at.IPs {
			k := poolAddr{at.Pool, a}
			if t.addrs[k] += delta; t.addrs[k] <= 0 {
				delete(t.addrs, k)
			}
		}
	}
}

// ownsAddr tells whether one of this node's pods lists addr in pool: held, being re-claimed
// after a lost lease (its keys may be gone from etcd, and with them the view's record of it),
// in conflict, or waiting for its release. An ADD never offers such an address to a new pod.
func (t *pods) ownsAddr(pool string, addr netip.Addr) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.addrs[poolAddr{pool, addr}] > 0
}

// addrsByPool lists, per pool, the addresses of this node's pods (ownsAddr).
func (t *pods) addrsByPool() map[string][]netip.Addr {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string][]netip.Addr{}
	for pa := range t.addrs {
		out[pa.pool] = append(out[pa.pool], pa.addr)
	}
	return out
}

// ownerOf is the owner of the pod whose attachment in pool lists addr, if any.
func (t *pods) ownerOf(pool string, addr netip.Addr) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.addrs[poolAddr{pool, addr}] == 0 {
		return "", false
	}
	for owner, ps := range t.m {
		for _, at := range ps.Attachments {
			if at.Pool == pool && slices.Contains(at.IPs, addr) {
				return owner, true
			}
		}
	}
	return "", false
}

// lease returns owner's lease while it is held.
func (t *pods) lease(owner string) (clientv3.LeaseID, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[owner]; ok {
		return ps.lease.held()
	}
	return 0, false
}

// leaseOwners maps each held pod lease to its owner.
func (t *pods) leaseOwners() map[clientv3.LeaseID]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[clientv3.LeaseID]string, len(t.m))
	for owner, ps := range t.m {
		if id, ok := ps.lease.held(); ok {
			out[id] = owner
		}
	}
	return out
}

// attachment is what the agent knows of owner's attachment ifName in pool, with the pod's
// lease; ok is false when it knows none or the lease is not held.
func (t *pods) attachment(owner, ifName, pool string) (at attachment, lease clientv3.LeaseID, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, found := t.m[owner]
	if !found {
		return attachment{}, 0, false
	}
	lease, held := ps.lease.held()
	if !held {
		return attachment{}, 0, false
	}
	for _, at := range ps.Attachments {
		if at.IfName == ifName && at.Pool == pool {
			return at, lease, true
		}
	}
	return attachment{}, 0, false
}

// claimedOn is pods.claimed, and makes sure the keeper renews lease: a spare may have been
// reported lost (its renewals stopped while etcd had no leader, which etcd itself survives by
// extending every lease) after an ADD took it and before its claim applied on it. Then the
// lease is adopted again, or, gone from etcd, its pod re-claimed; never left to expire
// unrenewed under a pod that was told it has its addresses.
func (a *Agent) claimedOn(ctx context.Context, req allocator.Request, o *ownerlock.Owned, lease clientv3.LeaseID, ats ...attachment) {
	owner := o.Owner()
	a.pods.claimed(req, o, lease, ats...)
	if a.keeper.Holds(lease) {
		return
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	if err := a.keeper.Adopt(octx, lease); err != nil {
		a.log.Warn("the lease a claim applied on had stopped being renewed, and cannot be resumed; the pod is re-claimed",
			"owner", owner, "lease", keyspace.LeaseHex(lease), "err", err)
		a.pods.lose(lease)
		a.wake()
		return
	}
	a.log.Warn("the lease a claim applied on had stopped being renewed; resumed", "owner", owner, "lease", keyspace.LeaseHex(lease))
}

// claimed records that owner's keys are on lease, now held (after a claim, an adoption, a
// re-claim or an ambiguous commit), with the attachments given; it creates the pod's state if
// needed and marks an ADD's time.
func (t *pods) claimed(req allocator.Request, o *ownerlock.Owned, lease clientv3.LeaseID, ats ...attachment) {
	owner := o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		ps = &podState{Owner: owner, NodeUID: t.nodeUID}
		t.m[owner] = ps
	}
	ps.hold(lease)
	ps.lastAdd = time.Now()
	if req.Pod != (allocator.PodRef{}) {
		ps.Pod = req.Pod
	}
	if req.Netns != "" {
		ps.Netns = req.Netns
	}
	t.index(ps, -1)
	for _, at := range ats {
		ps.put(at)
	}
	t.index(ps, 1)
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// resumed records that owner's lost lease turned out alive and is held again, without
// marking an ADD.
func (t *pods) resumed(o *ownerlock.Owned, lease clientv3.LeaseID) {
	owner := o.Owner()
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[owner]; ok {
		ps.hold(lease)
	}
}

// restore puts a pod found at start into the map: held when its lease is resumed, lost when
// only the journal knows it. A pod not in the journal is written to it.
func (t *pods) restore(ps podState, held, journaled bool) {
	if held {
		ps.hold(ps.lease.id)
	} else {
		ps.lease.lose()
	}
	t.mu.Lock()
	t.index(t.m[ps.Owner], -1)
	t.m[ps.Owner] = &ps
	t.index(&ps, 1)
	snap := ps.clone()
	t.mu.Unlock()
	if !journaled {
		t.jw.save(snap)
	}
}

// unanswered records that a claim on owner's lease lost its answer (see podLease).
func (t *pods) unanswered(o *ownerlock.Owned) {
	owner := o.Owner()
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[owner]; ok {
		ps.lease.unanswered = true
	}
}

// mayRecycle tells whether owner's lease may become a spare once its keys are gone: no claim
// on it lost its answer.
func (t *pods) mayRecycle(owner string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	return !ok || !ps.lease.unanswered
}

// lose marks every pod on lease id lost and returns their owners.
func (t *pods) lose(id clientv3.LeaseID) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var owners []string
	for owner, ps := range t.m {
		if ps.lease.id == id {
			ps.lease.lose()
			owners = append(owners, owner)
		}
	}
	return owners
}

// lost returns the owners whose re-claim is due.
func (t *pods) lost() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var owners []string
	for owner, ps := range t.m {
		if ps.lease.lost() {
			owners = append(owners, owner)
		}
	}
	return owners
}

// lostPod returns a copy of owner's state if its re-claim is due.
func (t *pods) lostPod(owner string) (podState, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok || !ps.lease.lost() {
		return podState{}, false
	}
	return ps.clone(), true
}

// idle returns, for each pod with a held lease and a network namespace that no ADD touched
// within grace, its owner and namespace: the pods whose sandbox liveness may be checked.
func (t *pods) idle(grace time.Duration) map[string]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]string{}
	for owner, ps := range t.m {
		if ps.Netns != "" && !ps.lease.lost() && time.Since(ps.lastAdd) > grace {
			out[owner] = ps.Netns
		}
	}
	return out
}

// stillIdle returns owner's network namespace if idle would still list it.
func (t *pods) stillIdle(owner string, grace time.Duration) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok || ps.Netns == "" || ps.lease.lost() || time.Since(ps.lastAdd) <= grace {
		return "", false
	}
	return ps.Netns, true
}

// addedWithin tells whether an ADD of owner ran within d.
func (t *pods) addedWithin(owner string, d time.Duration) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	return ok && !ps.lastAdd.IsZero() && time.Since(ps.lastAdd) < d
}

// dropAttachment forgets one attachment of owner.
func (t *pods) dropAttachment(o *ownerlock.Owned, ifName, pool string) {
	owner := o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		t.mu.Unlock()
		return
	}
	t.index(ps, -1)
	ps.drop(ifName, pool)
	t.index(ps, 1)
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// drop forgets owner entirely (its lease was given up, or its keys are gone).
func (t *pods) drop(o *ownerlock.Owned) {
	owner := o.Owner()
	t.mu.Lock()
	t.index(t.m[owner], -1)
	delete(t.m, owner)
	t.mu.Unlock()
	t.jw.remove(owner)
}

// markReleased records that the runtime's DEL of container's attachment ifName in pool was
// answered while etcd could not be reached: the attachment is released once etcd answers and
// never re-claimed (attachment.Released). An attachment the agent does not know is recorded
// without addresses; its release then reads them from etcd.
func (t *pods) markReleased(o *ownerlock.Owned, ifName, pool, container string) {
	owner := o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		ps = &podState{Owner: owner, NodeUID: t.nodeUID}
		t.m[owner] = ps
	}
	i := slices.IndexFunc(ps.Attachments, func(at attachment) bool { return at.IfName == ifName && at.Pool == pool })
	switch {
	case i < 0:
		ps.Attachments = append(ps.Attachments, attachment{IfName: ifName, Pool: pool, ContainerID: container, Released: true,
			ReleasedAt: time.Now()})
	case ps.Attachments[i].ContainerID == container:
		ps.Attachments[i].Released, ps.Attachments[i].ReleasedAt = true, time.Now()
	default:
		// Another sandbox of the pod holds the attachment now: this DEL is not its.
		t.mu.Unlock()
		return
	}
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// releasedAttachments lists owner's attachments whose DEL was answered but not yet released
// in etcd.
func (t *pods) releasedAttachments(owner string) []attachment {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return nil
	}
	var out []attachment
	for _, at := range ps.Attachments {
		if at.Released {
			out = append(out, at)
		}
	}
	return out
}

// pendingReleases lists the owners with an attachment whose release waits for etcd.
func (t *pods) pendingReleases() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for owner, ps := range t.m {
		if slices.ContainsFunc(ps.Attachments, func(at attachment) bool { return at.Released }) {
			out = append(out, owner)
		}
	}
	return out
}

// lists tells whether the agent knows container's attachment ifName in pool of owner.
func (t *pods) lists(owner, ifName, pool, container string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	return ok && slices.ContainsFunc(ps.Attachments, func(at attachment) bool {
		return at.IfName == ifName && at.Pool == pool && at.ContainerID == container
	})
}

// lostAttachment returns container's attachment ifName in pool of owner, whose lease is not
// held.
func (t *pods) lostAttachment(owner, ifName, pool, container string) (attachment, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return attachment{}, false
	}
	if _, held := ps.lease.held(); held {
		return attachment{}, false
	}
	for _, at := range ps.Attachments {
		if at.IfName == ifName && at.Pool == pool && (container == "" || at.ContainerID == container) {
			at.IPs = slices.Clone(at.IPs)
			return at, true
		}
	}
	return attachment{}, false
}

// forgetAttachment drops container's attachment ifName in pool from what the agent knows of
// owner, and owner itself once it has no attachment left; it reports whether it knew it.
// A DEL of a pod whose lease was lost uses it: etcd has nothing of the attachment left to
// release (its keys expired), and nothing must re-claim it.
func (t *pods) forgetAttachment(o *ownerlock.Owned, ifName, pool, container string) bool {
	owner := o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		t.mu.Unlock()
		return false
	}
	i := slices.IndexFunc(ps.Attachments, func(at attachment) bool {
		return at.IfName == ifName && at.Pool == pool && (container == "" || at.ContainerID == container)
	})
	if i < 0 {
		t.mu.Unlock()
		return false
	}
	t.index(ps, -1)
	ps.Attachments = slices.Delete(ps.Attachments, i, i+1)
	t.index(ps, 1)
	if len(ps.Attachments) == 0 {
		delete(t.m, owner)
		t.mu.Unlock()
		t.jw.remove(owner)
		return true
	}
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
	return true
}

// setConflicts records which addresses of owner's attachment ifName in pool another owner
// holds (attachment.Conflicts).
func (t *pods) setConflicts(o *ownerlock.Owned, ifName, pool string, taken []netip.Addr) {
	owner := o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		t.mu.Unlock()
		return
	}
	i := slices.IndexFunc(ps.Attachments, func(at attachment) bool { return at.IfName == ifName && at.Pool == pool })
	if i < 0 {
		t.mu.Unlock()
		return
	}
	ps.Attachments[i].Conflicts = slices.Clone(taken)
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// wanted names, as keyspace.WantedKey in the flat layout, every conflicted address of the
// pods (their wanted keys are theirs to keep).
func (t *pods) wanted(cluster string) map[string]bool {
	out := map[string]bool{}
	for owner, ats := range t.conflicted() {
		for _, at := range ats {
			for _, addr := range at.Conflicts {
				out[keyspace.WantedKey(at.Pool, allocator.Blocks{}, addr, cluster, owner)] = true
			}
		}
	}
	return out
}

// heldAddrs lists the addresses of the pods whose leases the agent holds, or found lost at
// lostSince or after, but those another owner holds (conflicts) and those of attachments
// being released.
func (t *pods) heldAddrs(lostSince time.Time) map[conflictRef]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[conflictRef]bool{}
	for owner, ps := range t.m {
		_, held := ps.lease.held()
		if !held && !(ps.lease.lost() && !ps.lease.lostAt.Before(lostSince)) {
			continue
		}
		for _, at := range ps.Attachments {
			for _, ip := range at.IPs {
				if !at.Released && !slices.Contains(at.Conflicts, ip) {
					out[conflictRef{owner, at.IfName, at.Pool, ip}] = true
				}
			}
		}
	}
	return out
}

// conflicted lists, per owner, the attachments with addresses another owner holds.
func (t *pods) conflicted() map[string][]attachment {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string][]attachment{}
	for owner, ps := range t.m {
		for _, at := range ps.Attachments {
			if len(at.Conflicts) > 0 && !at.Released {
				at.Conflicts = slices.Clone(at.Conflicts)
				out[owner] = append(out[owner], at)
			}
		}
	}
	return out
}

// snapshot returns a copy of owner's state.
func (t *pods) snapshot(owner string) (podState, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return podState{}, false
	}
	return ps.clone(), true
}

// count is how many pods the agent holds or is re-claiming.
func (t *pods) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// keptByContainer tells whether the agent keeps container's attachment ifName in pool with
// the container ID itself as owner (an import from host-local, which knows no pod UID, or an
// ADD without one), held or being re-claimed. A request naming the pod UID is then served
// under the container ID (Agent.attachmentOwner).
func (t *pods) keptByContainer(container, ifName, pool string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[container]
	if !ok {
		return false
	}
	return slices.ContainsFunc(ps.Attachments, func(at attachment) bool {
		return at.IfName == ifName && at.Pool == pool && at.ContainerID == container
	})
}

// holdsAddr tells whether owner's attachment ifName in pool, held or being re-claimed,
// lists addr.
func (t *pods) holdsAddr(owner, ifName, pool string, addr netip.Addr) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return false
	}
	return slices.ContainsFunc(ps.Attachments, func(at attachment) bool {
		return at.IfName == ifName && at.Pool == pool && slices.Contains(at.IPs, addr)
	})
}

// pools lists the pools the node's pods have attachments in.
func (t *pods) pools() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	seen := make(map[string]bool)
	var out []string
	for _, ps := range t.m {
		for _, at := range ps.Attachments {
			if !seen[at.Pool] {
				seen[at.Pool] = true
				out = append(out, at.Pool)
			}
		}
	}
	return out
}

// claimLeases lists the claim leases of the node's attachments that hold a sticky claim.
func (t *pods) claimLeases() []clientv3.LeaseID {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []clientv3.LeaseID
	for _, ps := range t.m {
		for _, at := range ps.Attachments {
			if at.ClaimLease != 0 {
				out = append(out, at.ClaimLease)
			}
		}
	}
	return out
}

// auditable lists what the audit expects of each running pod (audit.go): its pod record, and
// for each attachment its owner index and the allocations of its addresses no other owner
// holds, with the ModRevision each had when last checked. A pod whose lease is not held is
// being re-claimed, and one with a DEL waiting for etcd is going: neither is checked. An
// attachment of a pool missing from layouts (being migrated) has its allocations left out.
func (t *pods) auditable(cluster, node string, layouts map[string]allocator.Blocks) []auditPod {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]auditPod, 0, len(t.m))
	for _, ps := range t.m {
		if p, ok := ps.auditPod(cluster, node, layouts); ok {
			out = append(out, p)
		}
	}
	return out
}

// auditOne is auditable for one pod.
func (t *pods) auditOne(owner, cluster, node string, layouts map[string]allocator.Blocks) (auditPod, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return auditPod{}, false
	}
	return ps.auditPod(cluster, node, layouts)
}

func (ps *podState) auditPod(cluster, node string, layouts map[string]allocator.Blocks) (auditPod, bool) {
	lease, held := ps.lease.held()
	if !held || len(ps.Attachments) == 0 || slices.ContainsFunc(ps.Attachments, func(at attachment) bool { return at.Released }) {
		return auditPod{}, false
	}
	p := auditPod{owner: ps.Owner, lease: lease}
	revOf := func(key string) int64 {
		if ps.checked.lease != lease {
			return 0
		}
		return ps.checked.revs[key]
	}
	add := func(key string, kind auditKind, container string) {
		p.keys = append(p.keys, auditKey{key: key, kind: kind, container: container, rev: revOf(key)})
	}
	add(keyspace.PodKey(cluster, node, ps.Owner), auditPodRecord, "")
	for _, at := range ps.Attachments {
		add(keyspace.OwnerKey(cluster, ps.Owner, at.IfName, at.Pool), auditOwnerIndex, at.ContainerID)
		blocks, ok := layouts[at.Pool]
		if !ok {
			continue
		}
		for _, ip := range at.IPs {
			if !slices.Contains(at.Conflicts, ip) {
				key := keyspace.IPKey(at.Pool, blocks, ip)
				p.keys = append(p.keys, auditKey{key: key, kind: auditAllocation, container: at.ContainerID, rev: revOf(key),
					pool: at.Pool, addr: ip})
			}
		}
	}
	return p, true
}

// verified records the ModRevisions of p's keys as read (kvs, in p.keys' order) and found
// right, if the pod still holds the lease they were read on.
func (t *pods) verified(p auditPod, kvs []*mvccpb.KeyValue) {
	revs := make(map[string]int64, len(p.keys))
	for i, k := range p.keys {
		if kvs[i] != nil {
			revs[k.key] = kvs[i].ModRevision
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[p.owner]; ok && ps.lease.id == p.lease {
		ps.checked = checkedKeys{lease: p.lease, revs: revs}
	}
}
