package txn

import (
	"errors"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/keyspace"
)

// What an etcd error proves. A request whose answer was lost (a timeout, a connection or a
// leader lost) may still be applied, and the agent must act as if it were (leases/claimloop). A request
// etcd answered with a refusal was certainly not applied, and retrying it as if its answer
// were lost would only mark a lease as unsure and delay the caller.

// Refused tells whether etcd answered err by refusing the request, so that it applied none of
// it: an invalid request (too many operations, too large, a key put twice), a lease it does
// not have, no space left (the NOSPACE alarm) or too many requests, a missing permission, or
// a failed precondition. Only etcd's own errors prove that, and a status the gRPC client made
// itself proves it only for a request it never sent (invalid): its "resource exhausted" may
// be an answer too large to receive, of a request etcd applied.
func Refused(err error) bool {
	var ee rpctypes.EtcdError
	if !errors.As(err, &ee) {
		// etcd's own error as the server words it, before the client converts it.
		ee, _ = rpctypes.Error(err).(rpctypes.EtcdError)
	}
	if ee != (rpctypes.EtcdError{}) {
		switch ee.Code() {
		case codes.InvalidArgument, codes.NotFound, codes.ResourceExhausted, codes.PermissionDenied,
			codes.Unauthenticated, codes.FailedPrecondition:
			return true
		}
		return false
	}
	return status.Code(err) == codes.InvalidArgument
}

// NoSpace tells whether etcd refused a write because its database is full: the NOSPACE alarm
// is raised, and etcd takes deletes and revokes but no put and no lease grant until an
// operator frees space and disarms it.
func NoSpace(err error) bool {
	return errors.Is(err, rpctypes.ErrNoSpace) || errors.Is(err, rpctypes.ErrGRPCNoSpace)
}

// LeaseGone tells whether etcd refused a request because a lease it names does not exist.
func LeaseGone(err error) bool { return keyspace.IsLeaseNotFound(err) }
