package txn

import (
	"context"
	"fmt"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

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
		if got := Refused(tt.err); got != tt.refused {
			t.Errorf("Refused(%v) = %v, want %v", tt.err, got, tt.refused)
		}
	}
	if !NoSpace(fmt.Errorf("grant quarantine lease: %w", rpctypes.ErrNoSpace)) || NoSpace(rpctypes.ErrTooManyRequests) {
		t.Error("NoSpace must recognise the NOSPACE refusal, wrapped, and nothing else")
	}
}
