// Package poolview is the agent's view of the pools it serves (docs/agent.md): per pool a
// watch-fed picture of which addresses are taken, resting or held back, from which an ADD
// chooses its candidates without an etcd read, and, in the block layout, this node's block
// claims, kept and given back. It is a hint, never the authority: every claim is a
// create-if-absent transaction, so a stale view costs a retry, never a duplicate.
//
// Pools (pools.go) caches the checked pool definitions, one View each. A View (view.go) is
// the surface the agent calls; its work is done by parts with one job each, sharing the
// view's state under its one lock:
//   - the watch sync (syncer, viewsync.go): the listing, the watches, listing again;
//   - the reuse order (reuseOrder, reuse.go): addresses held back after an expiry, looked up
//     when due, reused last;
//   - borrowing (borrower, borrow.go): free addresses in other nodes' blocks, from a snapshot;
//   - this node's block claims (BlockClaims, blocks.go): claimed one at a time, given back
//     once empty.
//
// Their goroutines (the listing and watches, the look-ups of held keys, the give-back of
// empty blocks) run on the context the View runs on, and end with it.
//
// Locks, in the order they are taken: a view's BlockClaims.claimMu (one block claim at a
// time, held across the claim's transaction and the Owner funcs it calls), then Pools.mu (the
// cache: RestartAll holds it, and a lost block lease reaches every view through it), then a
// view's mu (core.mu, its maps). The view's mu is taken only by core.lock, which returns the
// locked handle: a method that assumes the lock is a method of locked (state.go, and the
// parts' files), so code without the handle cannot call one. With mu held nothing is called
// but the non-blocking Hooks (Put, Deleted, Listed).
//
// What the agent gives a view is handed in at start (Owner: the node's identity, its block
// leases and counters; Hooks: its restore hold and its ear for its pods' keys); the package
// never imports the agent and never calls up but through them.
package poolview

import "time"

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
)
