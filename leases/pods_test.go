package leases

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
	p := newPods("uid1", newJournalWriter(journal{}, quietLog()))
	const lease, other = clientv3.LeaseID(11), clientv3.LeaseID(12)
	held := func(step string, want bool) {
		t.Helper()
		if id, ok := p.lease("o"); ok != want || ok && id != lease {
			t.Fatalf("%s: lease held %v (%d), want held %v", step, ok, id, want)
		}
	}
	held("before any claim", false)
	var locks ownerlock.Locks
	own := locks.Lock("o")
	defer own.Unlock()
	p.claimed(allocator.Request{Netns: "/run/netns/x"}, own, lease, attachment{IfName: "eth0", Pool: "p"})
	held("after the claim", true)
	if _, _, ok := p.attachment("o", "eth0", "p"); !ok {
		t.Fatal("the claimed attachment is not known")
	}
	if got := p.lose(other); len(got) != 0 {
		t.Fatalf("losing another lease marked %v lost", got)
	}
	if got := p.lose(lease); len(got) != 1 || got[0] != "o" {
		t.Fatalf("losing the pod's lease: got %v lost, want [o]", got)
	}
	held("after the loss", false)
	if _, _, ok := p.attachment("o", "eth0", "p"); ok {
		t.Error("an attachment on a lost lease is offered to DEL as if held")
	}
	if got := p.lost(); len(got) != 1 {
		t.Errorf("re-claims due: %v, want [o]", got)
	}
	if _, ok := p.lostPod("o"); !ok {
		t.Error("the lost pod's state is not offered to the re-claim")
	}
	if len(p.idle(0)) != 0 {
		t.Error("a lost pod is offered to the sandbox liveness check")
	}
	p.resumed(own, lease)
	held("after the re-claim resumed it", true)
	if len(p.lost()) != 0 {
		t.Error("a resumed pod is still due a re-claim")
	}
	if !p.mayRecycle("o") {
		t.Error("a lease with every claim answered may be recycled")
	}
	p.unanswered(own)
	if p.mayRecycle("o") {
		t.Error("a lease a claim may still land on is recycled as a spare")
	}
	p.drop(own)
	held("after it was given up", false)
	if p.count() != 0 {
		t.Errorf("%d pods left after the drop", p.count())
	}
}

// TestHeldAddrsCountsPodsLostToTheNewHistory: what the pods held when etcd went back counts
// the pods whose lease is held, and those whose lease was found lost on an answer of the new
// history (at the gate's first doubted answer or after), not those lost before it: their
// addresses may have gone to other pods meanwhile.
func TestHeldAddrsCountsPodsLostToTheNewHistory(t *testing.T) {
	p := newPods("uid1", newJournalWriter(journal{}, quietLog()))
	var locks ownerlock.Locks
	ip := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	for i, owner := range []string{"held", "lostBefore", "lostAfter"} {
		own := locks.Lock(owner)
		p.claimed(allocator.Request{}, own, clientv3.LeaseID(i+1), attachment{IfName: "eth0", Pool: "p",
			IPs: []netip.Addr{ip(fmt.Sprintf("10.0.0.%d", i+1))}})
		own.Unlock()
	}
	p.lose(2)
	from := time.Now()
	for time.Since(from) <= 0 {
		// the next loss is found after from
	}
	p.lose(3)
	got := p.heldAddrs(from)
	want := map[conflictRef]bool{{"held", "eth0", "p", ip("10.0.0.1")}: true, {"lostAfter", "eth0", "p", ip("10.0.0.3")}: true}
	if !maps.Equal(got, want) {
		t.Errorf("heldAddrs: %v, want %v", got, want)
	}
}
