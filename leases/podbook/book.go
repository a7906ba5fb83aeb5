// Package podbook is the agent's book of its pods: what each pod whose lease the agent holds
// has (its attachments, their addresses, its lease and where that lease is in its
// lifecycle), and the journal that mirrors it in the state directory, so that after a lease
// loss, or a restart after one, the agent can re-claim the addresses of the pods that still
// run.
//
// The book changes a pod only through a Change, which is made from the handle of the pod's
// owner lock (leases/ownerlock): code that does not hold the owner's lock cannot change its
// pod. The book's own mutex only keeps its maps consistent; the journal has one writer
// goroutine (Writer). The book knows nothing of etcd: what the agent learns there it records
// here.
package podbook

import (
	"net/netip"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Book is what the agent knows of the pods whose leases it holds, one PodState per owner,
// mirrored to the journal on every change. It is the only place the agent's pod map is read
// or written. A change to a pod takes the owner's lock (a Change, made from the lock's
// ownerlock.Owned handle), so the changes of one pod never interleave; the map's own lock only
// keeps it consistent. Three changes take none, by design: Restore (at start, before any
// request), Lose (a lost lease, which no request may delay) and Audit.Verified (audit
// revisions, kept only while the lease they were read on is the pod's).
type Book struct {
	nodeUID string
	jw      *Writer

	mu sync.Mutex
	m  map[string]*PodState
	// addrs counts, per pool and address, the attachments of m listing it: the addresses of
	// this node's pods, held, being re-claimed or waiting for their release, which no ADD of
	// this node may offer to another pod (OwnsAddr).
	addrs addrIndex
}

// New makes the book of the pods of the node nodeUID, journaled by w.
func New(nodeUID string, w *Writer) *Book {
	return &Book{nodeUID: nodeUID, jw: w, m: make(map[string]*PodState), addrs: make(addrIndex)}
}

// Lease returns owner's lease while it is held.
func (t *Book) Lease(owner string) (clientv3.LeaseID, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[owner]; ok {
		return ps.lease.held()
	}
	return 0, false
}

// LeaseOwners maps each held pod lease to its owner.
func (t *Book) LeaseOwners() map[clientv3.LeaseID]string {
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

// Attachment is what the agent knows of owner's attachment ifName in pool, with the pod's
// lease; ok is false when it knows none or the lease is not held.
func (t *Book) Attachment(owner, ifName, pool string) (at Attachment, lease clientv3.LeaseID, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, found := t.m[owner]
	if !found {
		return Attachment{}, 0, false
	}
	lease, held := ps.lease.held()
	if !held {
		return Attachment{}, 0, false
	}
	for _, at := range ps.Attachments {
		if at.IfName == ifName && at.Pool == pool {
			return at, lease, true
		}
	}
	return Attachment{}, 0, false
}

// Restore puts a pod found at start into the map: held when its lease is resumed, lost when
// only the journal knows it; lease is the one its keys are (or were) on. A pod not in the
// journal is written to it. It takes no owner lock, by design: it runs at start, before any
// request.
func (t *Book) Restore(ps PodState, lease clientv3.LeaseID, held, journaled bool) {
	ps.lease.id = lease
	if held {
		ps.hold(lease)
	} else {
		ps.lease.lose()
	}
	t.mu.Lock()
	t.addrs.count(t.m[ps.Owner], -1)
	t.m[ps.Owner] = &ps
	t.addrs.count(&ps, 1)
	snap := ps.clone()
	t.mu.Unlock()
	if !journaled {
		t.jw.save(snap)
	}
}

// MayRecycle tells whether owner's lease may become a spare once its keys are gone: no claim
// on it lost its answer.
func (t *Book) MayRecycle(owner string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	return !ok || !ps.lease.unanswered
}

// Lose marks every pod on lease id lost and returns their owners. It takes no owner lock, by
// design: no request may delay a lost lease's re-claim.
func (t *Book) Lose(id clientv3.LeaseID) []string {
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

// Lost returns the owners whose re-claim is due.
func (t *Book) Lost() []string {
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

// LostPod returns a copy of owner's state if its re-claim is due.
func (t *Book) LostPod(owner string) (PodState, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok || !ps.lease.lost() {
		return PodState{}, false
	}
	return ps.clone(), true
}

// Idle returns, for each pod with a held lease and a network namespace that no ADD touched
// within grace, its owner and namespace: the pods whose sandbox liveness may be checked.
func (t *Book) Idle(grace time.Duration) map[string]string {
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

// StillIdle returns owner's network namespace if idle would still list it.
func (t *Book) StillIdle(owner string, grace time.Duration) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok || ps.Netns == "" || ps.lease.lost() || time.Since(ps.lastAdd) <= grace {
		return "", false
	}
	return ps.Netns, true
}

// AddedWithin tells whether an ADD of owner ran within d.
func (t *Book) AddedWithin(owner string, d time.Duration) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	return ok && !ps.lastAdd.IsZero() && time.Since(ps.lastAdd) < d
}

// ReleasedAttachments lists owner's attachments whose DEL was answered but not yet released
// in etcd.
func (t *Book) ReleasedAttachments(owner string) []Attachment {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return nil
	}
	var out []Attachment
	for _, at := range ps.Attachments {
		if at.Released {
			out = append(out, at)
		}
	}
	return out
}

// PendingReleases lists the owners with an attachment whose release waits for etcd.
func (t *Book) PendingReleases() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for owner, ps := range t.m {
		if slices.ContainsFunc(ps.Attachments, func(at Attachment) bool { return at.Released }) {
			out = append(out, owner)
		}
	}
	return out
}

// Lists tells whether the agent knows container's attachment ifName in pool of owner.
func (t *Book) Lists(owner, ifName, pool, container string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	return ok && slices.ContainsFunc(ps.Attachments, func(at Attachment) bool {
		return at.IfName == ifName && at.Pool == pool && at.ContainerID == container
	})
}

// LostAttachment returns container's attachment ifName in pool of owner, whose lease is not
// held.
func (t *Book) LostAttachment(owner, ifName, pool, container string) (Attachment, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return Attachment{}, false
	}
	if _, held := ps.lease.held(); held {
		return Attachment{}, false
	}
	for _, at := range ps.Attachments {
		if at.IfName == ifName && at.Pool == pool && (container == "" || at.ContainerID == container) {
			at.IPs = slices.Clone(at.IPs)
			return at, true
		}
	}
	return Attachment{}, false
}

// Snapshot returns a copy of owner's state.
func (t *Book) Snapshot(owner string) (PodState, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return PodState{}, false
	}
	return ps.clone(), true
}

// Count is how many pods the agent holds or is re-claiming.
func (t *Book) Count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// KeptByContainer tells whether the agent keeps container's attachment ifName in pool with
// the container ID itself as owner (an import from host-local, which knows no pod UID, or an
// ADD without one), held or being re-claimed. A request naming the pod UID is then served
// under the container ID (Agent.attachmentOwner).
func (t *Book) KeptByContainer(container, ifName, pool string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[container]
	if !ok {
		return false
	}
	return slices.ContainsFunc(ps.Attachments, func(at Attachment) bool {
		return at.IfName == ifName && at.Pool == pool && at.ContainerID == container
	})
}

// HoldsAddr tells whether owner's attachment ifName in pool, held or being re-claimed,
// lists addr.
func (t *Book) HoldsAddr(owner, ifName, pool string, addr netip.Addr) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps, ok := t.m[owner]
	if !ok {
		return false
	}
	return slices.ContainsFunc(ps.Attachments, func(at Attachment) bool {
		return at.IfName == ifName && at.Pool == pool && slices.Contains(at.IPs, addr)
	})
}

// Pools lists the pools the node's pods have attachments in.
func (t *Book) Pools() []string {
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

// ClaimLeases lists the claim leases of the node's attachments that hold a sticky claim.
func (t *Book) ClaimLeases() []clientv3.LeaseID {
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

// HoldsClaim tells whether an attachment of this node's pods holds claim name of pool.
func (t *Book) HoldsClaim(pool, name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, ps := range t.m {
		if slices.ContainsFunc(ps.Attachments, func(at Attachment) bool { return at.Pool == pool && at.Claim == name && !at.Target }) {
			return true
		}
	}
	return false
}

// MayMigrate tells whether an attachment of this node's pods is a live migration's target or
// holds a migratable claim: only then can a live migration name this node's pods, as its
// target or its source (whose claim T1 found migratable).
func (t *Book) MayMigrate() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, ps := range t.m {
		if slices.ContainsFunc(ps.Attachments, func(at Attachment) bool { return at.Target || at.Claim != "" && at.ClaimMigratable }) {
			return true
		}
	}
	return false
}
