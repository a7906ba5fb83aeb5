package leases

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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

// TestRefusedTellsWhatAnEtcdErrorProves: errors etcd answers with when it applied nothing
// are refusals; errors that leave the outcome open (a timeout, a lost leader or connection)
// are not, so that such a claim is treated as possibly applied (no I/O).
func TestRefusedTellsWhatAnEtcdErrorProves(t *testing.T) {
	tests := []struct {
		err     error
		refused bool
	}{
		{rpctypes.ErrLeaseNotFound, true},                    // the claim's lease is gone
		{rpctypes.ErrGRPCLeaseNotFound, true},                // the same, as the server words it
		{rpctypes.ErrNoSpace, true},                          // the NOSPACE alarm
		{rpctypes.ErrTooManyRequests, true},                  // etcd sheds load before applying
		{rpctypes.ErrPermissionDenied, true},                 // the role lacks a prefix
		{rpctypes.ErrTooManyOps, true},                       // more operations than --max-txn-ops
		{rpctypes.ErrDuplicateKey, true},                     // a key put twice in one transaction
		{fmt.Errorf("claim: %w", rpctypes.ErrNoSpace), true}, // wrapped by the caller
		{context.DeadlineExceeded, false},                    // the answer did not come in time
		{rpctypes.ErrTimeout, false},                         // etcd gave up waiting for the proposal
		{rpctypes.ErrLeaderChanged, false},                   // the proposal may commit under the new leader
		{status.Error(codes.Unavailable, "connection refused"), false},
		// The client's own: an answer too large to receive, of a request etcd may have applied.
		{status.Error(codes.ResourceExhausted, "grpc: received message larger than max"), false},
		{status.Error(codes.InvalidArgument, "etcdserver: too many operations in txn request"), true},
	}
	for _, tt := range tests {
		if got := refused(tt.err); got != tt.refused {
			t.Errorf("refused(%v) = %v, want %v", tt.err, got, tt.refused)
		}
	}
	if !noSpace(fmt.Errorf("grant quarantine lease: %w", rpctypes.ErrNoSpace)) || noSpace(rpctypes.ErrTooManyRequests) {
		t.Error("noSpace must recognise the NOSPACE refusal, wrapped, and nothing else")
	}
}
