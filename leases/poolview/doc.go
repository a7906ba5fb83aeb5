// Package poolview is the agent's view of the pools it serves (docs/agent.md): per pool a
// watch-fed picture of which addresses are taken, resting or held back, from which an ADD
// chooses its candidates without an etcd read, and, in the block layout, this node's block
// claims, kept and given back. It is a hint, never the authority: every claim is a
// create-if-absent transaction, so a stale view costs a retry, never a duplicate.
//
// Pools (pools.go) caches the checked pool definitions, one View each. A View owns its
// goroutines (the listing and watches, viewsync.go; the look-ups of held-back addresses,
// reuse.go; the give-back of empty blocks, blocks.go), all ended with the context the
// View runs on.
//
// Lock order, for every View: claimMu (block claims one at a time, blocks.go) is taken
// before mu (the view's maps); neither is held across a call into the agent but the
// non-blocking Hooks. What the agent needs to give (its block leases, its restore hold, its
// ear for its pods' keys) is handed in at start (Owner, Hooks); the package never calls up.
package poolview

import (
	"context"
	"time"
)

// Bounds of the view's own work. Every other wait is Owner.OpTimeout.
const (
	// viewListTimeout bounds the listing of one pool's view, one range read of every
	// allocation of the pool: far larger than any other read the agent makes.
	viewListTimeout = 30 * time.Second
	// watchHealthy is how long a watch must have run for the view to list again at once when
	// it ends; one that ends sooner (permission denied, etcd going down) backs off first.
	watchHealthy = 5 * time.Second
	// maxBlockTries bounds the block claims one ADD tries (each lost to another node's claim
	// of the same block) before it borrows instead.
	maxBlockTries = 4
	// claimsFresh is how long a read of a pool's block claims serves as the answer to "is any
	// block unclaimed" before an ADD that found none reads them again: a burst of borrowing
	// ADDs then costs one read, not one each.
	claimsFresh = 10 * time.Second
	// snapshotFresh is how long a read of the whole pool (borrow.go) is reused: for borrowing,
	// and to leave blocks it shows half used to borrowing instead of claiming them. Others'
	// releases outside this node's blocks reach it only by a new read.
	snapshotFresh = time.Minute
	// retryFirst and retryMax bound the backoff of the view's listings, as of the agent's
	// other background retries.
	retryFirst = 100 * time.Millisecond
	retryMax   = 5 * time.Second
	// probeTimeout bounds a read of held keys' leases and holders (reuse.go), as the agent's
	// probe of etcd for STATUS.
	probeTimeout = 2 * time.Second
	// maxTxnOps is etcd's default limit (--max-txn-ops) on a transaction's operations.
	maxTxnOps = 128
)

func sleepCtx(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
