package podbook

import (
	"net/netip"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/ownerlock"
)

// Change is the way to change one pod of the book: it is made from the handle of the pod's
// owner lock, which code that does not hold the lock does not have, so the changes of one
// pod never interleave (the ADD, DEL, re-claim, import, conflict resolution or sticky-claim
// repair holding the lock makes them). A Change is used while the lock is held, not kept.
type Change struct {
	t *Book
	o *ownerlock.Owned
}

// Change returns the changes to the pod of o's owner.
func (t *Book) Change(o *ownerlock.Owned) Change { return Change{t, o} }

// Claimed records that owner's keys are on lease, now held (after a claim, an adoption, a
// re-claim or an ambiguous commit), with the attachments given; it creates the pod's state if
// needed and marks an ADD's time.
func (c Change) Claimed(req allocator.Request, lease clientv3.LeaseID, ats ...Attachment) {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		ps = &PodState{Owner: owner, NodeUID: t.nodeUID}
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
	t.addrs.count(ps, -1)
	for _, at := range ats {
		ps.put(at)
	}
	t.addrs.count(ps, 1)
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// Resumed records that owner's lost lease turned out alive and is held again, without
// marking an ADD.
func (c Change) Resumed(lease clientv3.LeaseID) {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[owner]; ok {
		ps.hold(lease)
	}
}

// Unanswered records that a claim on owner's lease lost its answer (see podLease).
func (c Change) Unanswered() {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps, ok := t.m[owner]; ok {
		ps.lease.unanswered = true
	}
}

// DropAttachment forgets one attachment of owner.
func (c Change) DropAttachment(ifName, pool string) {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		t.mu.Unlock()
		return
	}
	t.addrs.count(ps, -1)
	ps.drop(ifName, pool)
	t.addrs.count(ps, 1)
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// Drop forgets owner entirely (its lease was given up, or its keys are gone).
func (c Change) Drop() {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	t.addrs.count(t.m[owner], -1)
	delete(t.m, owner)
	t.mu.Unlock()
	t.jw.Remove(owner)
}

// MarkReleased records that the runtime's DEL of container's attachment ifName in pool was
// answered while etcd could not be reached: the attachment is released once etcd answers and
// never re-claimed (Attachment.Released). An attachment the agent does not know is recorded
// without addresses; its release then reads them from etcd. at is when the DEL was answered
// (Attachment.ReleasedAt).
func (c Change) MarkReleased(ifName, pool, container string, at time.Time) {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		ps = &PodState{Owner: owner, NodeUID: t.nodeUID}
		t.m[owner] = ps
	}
	i := slices.IndexFunc(ps.Attachments, func(at Attachment) bool { return at.IfName == ifName && at.Pool == pool })
	switch {
	case i < 0:
		ps.Attachments = append(ps.Attachments, Attachment{IfName: ifName, Pool: pool, ContainerID: container, Released: true,
			ReleasedAt: at})
	case ps.Attachments[i].ContainerID == container:
		ps.Attachments[i].Released, ps.Attachments[i].ReleasedAt = true, at
	default:
		// Another sandbox of the pod holds the attachment now: this DEL is not its.
		t.mu.Unlock()
		return
	}
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// ForgetAttachment drops container's attachment ifName in pool from what the agent knows of
// owner, and owner itself once it has no attachment left; it reports whether it knew it.
// A DEL of a pod whose lease was lost uses it: etcd has nothing of the attachment left to
// release (its keys expired), and nothing must re-claim it.
func (c Change) ForgetAttachment(ifName, pool, container string) bool {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		t.mu.Unlock()
		return false
	}
	i := slices.IndexFunc(ps.Attachments, func(at Attachment) bool {
		return at.IfName == ifName && at.Pool == pool && (container == "" || at.ContainerID == container)
	})
	if i < 0 {
		t.mu.Unlock()
		return false
	}
	t.addrs.count(ps, -1)
	ps.Attachments = slices.Delete(ps.Attachments, i, i+1)
	t.addrs.count(ps, 1)
	if len(ps.Attachments) == 0 {
		delete(t.m, owner)
		t.mu.Unlock()
		t.jw.Remove(owner)
		return true
	}
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
	return true
}

// SetConflicts records which addresses of owner's attachment ifName in pool another owner
// holds (Attachment.Conflicts).
func (c Change) SetConflicts(ifName, pool string, taken []netip.Addr) {
	c.attachment(ifName, pool, func(at *Attachment) bool {
		at.Conflicts = slices.Clone(taken)
		return true
	})
}

// Promoted records that owner's attachment ifName in pool, a live migration's target, holds
// its claim alone now (Attachment.Target cleared): its addresses' keys are its own. The
// claim is migratable: a target's is by construction.
func (c Change) Promoted(ifName, pool string) {
	c.attachment(ifName, pool, func(at *Attachment) bool {
		was := at.Target || !at.ClaimMigratable || at.Source != ""
		at.Target, at.ClaimMigratable, at.Source = false, true, ""
		return was
	})
}

// ClaimMigratable records that the claim owner's attachment ifName in pool holds is
// migratable (Attachment.ClaimMigratable): its record says so.
func (c Change) ClaimMigratable(ifName, pool string) {
	c.attachment(ifName, pool, func(at *Attachment) bool {
		if at.ClaimMigratable || at.Claim == "" {
			return false
		}
		at.ClaimMigratable = true
		return true
	})
}

// attachment changes owner's attachment ifName in pool, if the book has it, by change, and
// journals the pod if change reports a change.
func (c Change) attachment(ifName, pool string, change func(*Attachment) bool) {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		t.mu.Unlock()
		return
	}
	i := slices.IndexFunc(ps.Attachments, func(at Attachment) bool { return at.IfName == ifName && at.Pool == pool })
	if i < 0 || !change(&ps.Attachments[i]) {
		t.mu.Unlock()
		return
	}
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}

// SetClaim records container's attachment ifName in pool of owner as holding claim on lease
// (none: claim ""), with its owner index written at ownerRev.
func (c Change) SetClaim(ifName, pool, container, claim string, lease clientv3.LeaseID, ownerRev int64) {
	t, owner := c.t, c.o.Owner()
	t.mu.Lock()
	ps, ok := t.m[owner]
	if !ok {
		t.mu.Unlock()
		return
	}
	i := slices.IndexFunc(ps.Attachments, func(at Attachment) bool {
		return at.IfName == ifName && at.Pool == pool && at.ContainerID == container
	})
	if i < 0 {
		t.mu.Unlock()
		return
	}
	at := &ps.Attachments[i]
	at.ClaimLease, at.OwnerRev = lease, ownerRev
	if claim == "" {
		at.Claim, at.ClaimHold, at.ClaimMigratable = "", 0, false
	}
	snap := ps.clone()
	t.mu.Unlock()
	t.jw.save(snap)
}
