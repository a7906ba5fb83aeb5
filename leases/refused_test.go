package leases

import (
	"slices"
	"testing"

	"github.com/leasehold/leasehold/internal/etcdtest"
)

// TestRefusedClaimIsNotAnUnansweredOne: a claim etcd refuses (here: its spare lease was
// revoked from outside, "requested lease not found") applied nothing. The ADD goes on with
// another lease at once instead of resending the refused claim as if its answer were lost,
// the pod is not marked unsure (its lease may be recycled when it goes), and the keeper
// forgets the revoked lease.
func TestRefusedClaimIsNotAnUnansweredOne(t *testing.T) {
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1", func(c *Config) { c.SpareLeases = 4 })
	// 4, or 3 when the node's registration took one after the first refill: the keeper tops
	// its spares up only once half are gone.
	waitSpares(t, a.keeper, 3)
	ctx, cli := ctxT(t), etcdtest.Client(t)
	revoked := spares(a.keeper)
	for _, id := range revoked {
		if _, err := cli.Revoke(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	pool := dualStack(etcdtest.Uniq("p"), "10.61.0.0/24", "fd61::/64")
	if _, err := a.Add(ctx, addReq(pool, "c1", "eth0", "uid-r")); err != nil {
		t.Fatalf("ADD whose spare lease was revoked from outside: %v", err)
	}
	lease, ok := a.pods.Lease("uid-r")
	if !ok || slices.Contains(revoked, lease) {
		t.Errorf("pod holds lease %x (held %v); want a lease that is not one of the revoked %x", lease, ok, revoked)
	}
	if !a.pods.MayRecycle("uid-r") {
		t.Error("the pod is marked as having an unanswered claim, but etcd answered by refusing it")
	}
	for _, id := range revoked {
		if a.keeper.Holds(id) && !slices.Contains(spares(a.keeper), id) {
			t.Errorf("the keeper still holds revoked lease %x outside its spares", id)
		}
	}
}
