package agentapi

import (
	"context"

	"github.com/leasehold/leasehold/allocator"
)

// Service is what the node agent offers the plugin. The agent's service type (package
// leases) satisfies it without importing this package. Errors should wrap the
// allocator sentinels; the server turns them into CNI error codes.
type Service interface {
	// Add allocates (or returns the existing) addresses of one attachment.
	Add(ctx context.Context, req allocator.Request) (allocator.Result, error)
	// Del releases one attachment's addresses; releasing nothing is not an error.
	Del(ctx context.Context, req allocator.Request) error
	// Check verifies the attachment's addresses are held by this owner on a live lease.
	Check(ctx context.Context, req allocator.Request) (allocator.Result, error)
	// GC releases this node's allocations of the network not named in ValidAttachments.
	GC(ctx context.Context, req allocator.GCRequest) error
	// Status reports whether an ADD for the pool could succeed now.
	Status(ctx context.Context, req allocator.StatusRequest) error
}
