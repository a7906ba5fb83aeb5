package agentapi

import (
	"context"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/thin"
)

// Service is what the node agent offers the plugin's CNI logic, which runs inside the
// agent (package cniplugin) and calls it in-process. The agent's service type (package
// leases) satisfies it without importing this package. Errors should wrap the allocator
// sentinels; the CNI logic turns them into CNI error codes (see CodeOf).
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

// Invocation is one whole run of the plugin binary, forwarded unparsed: its CNI_*
// environment and stdin (see package thin).
type Invocation = thin.Invocation

// Output is what the plugin process prints and exits with for an Invocation.
type Output struct {
	// Exit is the process's exit status: 0, or 1 after printing a CNI error.
	Exit int `json:"exit"`
	// Stdout and Stderr are the process's output, byte for byte (base64 on the wire).
	Stdout []byte `json:"stdout,omitempty"`
	Stderr []byte `json:"stderr,omitempty"`
	// Err is the CNI error behind a non-zero Exit, for the agent's log; not sent.
	Err error `json:"-"`
}

// Invoker runs whole plugin invocations (OpCNI); Serve serves one. Package cniplugin's
// Served makes one from the agent's Service.
type Invoker interface {
	Invoke(ctx context.Context, inv *Invocation) *Output
}
