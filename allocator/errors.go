package allocator

import "errors"

// Sentinel errors. Functions wrap them with %w and a message naming the thing that failed;
// check them with errors.Is.
var (
	// ErrInvalidConfig: a range, range set, exclude entry or pool definition is malformed.
	ErrInvalidConfig = errors.New("invalid ipam configuration")
	// ErrInvalidName: a name that becomes part of an etcd key is empty, too long or has
	// characters that are not allowed.
	ErrInvalidName = errors.New("invalid name")
	// ErrNotInRange: a requested address lies in no range set of the pool, or two requested
	// addresses fall into the same range set.
	ErrNotInRange = errors.New("requested address not in any range")
	// ErrAddressInUse: a requested address is held by another owner, or is resting in quarantine.
	ErrAddressInUse = errors.New("address already allocated")
	// ErrPoolExhausted: a range set has no free address.
	ErrPoolExhausted = errors.New("pool exhausted")
	// ErrOnlyQuarantined: a range set's only free addresses are resting in quarantine.
	// Errors wrapping it also wrap ErrPoolExhausted.
	ErrOnlyQuarantined = errors.New("only quarantined addresses are free")
	// ErrPoolMismatch: a configuration's ranges disagree with the stored definition of the same pool.
	ErrPoolMismatch = errors.New("pool definition mismatch")
	// ErrNotAllocated: CHECK found no allocation for the attachment.
	ErrNotAllocated = errors.New("no allocation")
	// ErrConflict: an address of this owner is held by another owner (after a lease loss).
	ErrConflict = errors.New("address conflict")
	// ErrUnavailable: the agent cannot reach etcd, or is shutting down; try again later.
	ErrUnavailable = errors.New("agent unavailable")
)
