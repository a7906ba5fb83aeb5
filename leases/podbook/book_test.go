package podbook

import (
	"fmt"
	"maps"
	"net/netip"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases/ownerlock"
)

// TestPodLeaseLifecycle walks one pod through the transitions of podLease (no I/O: the
// journal writer has no directory): held after a claim, lost when the keeper reports its
// lease, held again when the re-claim resumes it, revoked rather than recycled once a claim
// on it went unanswered, and forgotten when given up.
func TestPodLeaseLifecycle(t *testing.T) {
	p := New("uid1", NewWriter("", quietLog()))
	const lease, other = clientv3.LeaseID(11), clientv3.LeaseID(12)
	held := func(step string, want bool) {
		t.Helper()
		if id, ok := p.Lease("o"); ok != want || ok && id != lease {
			t.Fatalf("%s: lease held %v (%d), want held %v", step, ok, id, want)
		}
	}
	held("before any claim", false)
	var locks ownerlock.Locks
	own := locks.Lock("o")
	defer own.Unlock()
	p.Change(own).Claimed(allocator.Request{Netns: "/run/netns/x"}, lease, Attachment{IfName: "eth0", Pool: "p"})
	held("after the claim", true)
	if _, _, ok := p.Attachment("o", "eth0", "p"); !ok {
		t.Fatal("the claimed attachment is not known")
	}
	if got := p.Lose(other); len(got) != 0 {
		t.Fatalf("losing another lease marked %v lost", got)
	}
	if got := p.Lose(lease); len(got) != 1 || got[0] != "o" {
		t.Fatalf("losing the pod's lease: got %v lost, want [o]", got)
	}
	held("after the loss", false)
	if _, _, ok := p.Attachment("o", "eth0", "p"); ok {
		t.Error("an attachment on a lost lease is offered to DEL as if held")
	}
	if got := p.Lost(); len(got) != 1 {
		t.Errorf("re-claims due: %v, want [o]", got)
	}
	if _, ok := p.LostPod("o"); !ok {
		t.Error("the lost pod's state is not offered to the re-claim")
	}
	if len(p.Idle(0)) != 0 {
		t.Error("a lost pod is offered to the sandbox liveness check")
	}
	p.Change(own).Resumed(lease)
	held("after the re-claim resumed it", true)
	if len(p.Lost()) != 0 {
		t.Error("a resumed pod is still due a re-claim")
	}
	if !p.MayRecycle("o") {
		t.Error("a lease with every claim answered may be recycled")
	}
	p.Change(own).Unanswered()
	if p.MayRecycle("o") {
		t.Error("a lease a claim may still land on is recycled as a spare")
	}
	p.Change(own).Drop()
	held("after it was given up", false)
	if p.Count() != 0 {
		t.Errorf("%d pods left after the drop", p.Count())
	}
}

// TestHeldAddrsCountsPodsLostToTheNewHistory: what the pods held when etcd went back counts
// the pods whose lease is held, and those whose lease was found lost on an answer of the new
// history (at the gate's first doubted answer or after), not those lost before it: their
// addresses may have gone to other pods meanwhile.
func TestHeldAddrsCountsPodsLostToTheNewHistory(t *testing.T) {
	p := New("uid1", NewWriter("", quietLog()))
	var locks ownerlock.Locks
	ip := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	for i, owner := range []string{"held", "lostBefore", "lostAfter"} {
		own := locks.Lock(owner)
		p.Change(own).Claimed(allocator.Request{}, clientv3.LeaseID(i+1), Attachment{IfName: "eth0", Pool: "p",
			IPs: []netip.Addr{ip(fmt.Sprintf("10.0.0.%d", i+1))}})
		own.Unlock()
	}
	p.Lose(2)
	from := time.Now()
	for time.Since(from) <= 0 {
		// the next loss is found after from
	}
	p.Lose(3)
	got := p.HeldAddrs(from)
	want := map[ConflictRef]bool{{"held", "eth0", "p", ip("10.0.0.1")}: true, {"lostAfter", "eth0", "p", ip("10.0.0.3")}: true}
	if !maps.Equal(got, want) {
		t.Errorf("heldAddrs: %v, want %v", got, want)
	}
}
