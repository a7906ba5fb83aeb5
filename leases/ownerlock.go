package leases

import "sync"

// ownerLocks serialises the operations of one owner (ADD, DEL, CHECK, GC) inside the agent,
// so that an owner's keys are never written by two of its own requests at once. Owners
// never wait for each other.
type ownerLocks struct {
	mu sync.Mutex
	m  map[string]*ownerLock
}

type ownerLock struct {
	mu   sync.Mutex
	refs int
}

// lock blocks until owner is free and returns the function that frees it.
func (l *ownerLocks) lock(owner string) (unlock func()) {
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
	return func() {
		ol.mu.Unlock()
		l.mu.Lock()
		ol.refs--
		if ol.refs == 0 {
			delete(l.m, owner)
		}
		l.mu.Unlock()
	}
}
