// Package ownerlock serialises the operations of one owner inside the agent (docs/agent.md,
// "The owner lock").
package ownerlock

import "sync"

// Locks serialises the operations of one owner (ADD, DEL, CHECK, GC, a re-claim, an
// import, a conflict resolved, a sticky claim kept) inside the agent, so that an owner's keys
// are never written by two of its own requests at once. Owners never wait for each other.
//
// The lock is a type, not a convention: Lock returns an Owned handle, and the pod book's
// changes to a pod (leases/podbook's Change: Claimed, Drop, ForgetAttachment, ...) are made
// from one, so code that does not hold the owner's lock cannot change its pod: the compiler
// checks it, and no code outside this package can make a handle naming an owner. What changes a pod
// without its lock does so by design, named at each method: the start, before any request is
// served (Restore), and a lost lease, which a request must not be able to delay (Lose).
//
// Lock order, where more than one lock is held: the import's importMu (leases/imports), then
// an owner lock, then a view's claimMu, then that view's mu. No owner lock is taken while
// another is held (TestOwnerLockOrder in package leases reads the agent's code for it). The
// zero value is ready to use.
type Locks struct {
	mu sync.Mutex
	m  map[string]*ownerLock
}

type ownerLock struct {
	mu   sync.Mutex
	refs int
}

// Owned is a held owner lock: the proof that no other operation of its owner runs.
type Owned struct {
	owner string
	l     *Locks
	ol    *ownerLock
}

// Owner is the owner whose lock o holds.
func (o *Owned) Owner() string { return o.owner }

// Lock blocks until owner is free and returns its handle, which Unlock frees.
func (l *Locks) Lock(owner string) *Owned {
	l.mu.Lock()
	if l.m == nil {
		l.m = make(map[string]*ownerLock)
	}
	ol, ok := l.m[owner]
	if !ok {
		ol = &ownerLock{}
		l.m[owner] = ol
	}
	ol.refs++
	l.mu.Unlock()
	ol.mu.Lock()
	return &Owned{owner: owner, l: l, ol: ol}
}

// Unlock frees the owner; o must not be used after.
func (o *Owned) Unlock() {
	o.ol.mu.Unlock()
	o.l.mu.Lock()
	o.ol.refs--
	if o.ol.refs == 0 {
		delete(o.l.m, o.owner)
	}
	o.l.mu.Unlock()
}
