package ownerlock

import (
	"testing"
	"time"
)

// TestOneOperationPerOwner: a second Lock of an owner waits for the first's Unlock, another
// owner's does not, and an owner nobody holds or waits for leaves nothing behind.
func TestOneOperationPerOwner(t *testing.T) {
	var l Locks
	a := l.Lock("a")
	if a.Owner() != "a" {
		t.Fatalf("Owner() = %q, want a", a.Owner())
	}
	b := l.Lock("b") // another owner: does not wait for a
	b.Unlock()
	got := make(chan *Owned)
	go func() { got <- l.Lock("a") }()
	select {
	case <-got:
		t.Fatal("a second Lock of a held owner returned before its Unlock")
	case <-time.After(50 * time.Millisecond): // a wait that must not end: any bound proves it
	}
	a.Unlock()
	again := <-got
	again.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.m) != 0 {
		t.Errorf("after every Unlock the locks keep %d owners, want none", len(l.m))
	}
}
