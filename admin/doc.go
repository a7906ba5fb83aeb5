// Package admin is the operator's side of leasehold, importable by any program: pool
// definitions (CreatePool, AddRange, RemoveRange), the move of a pool from the flat layout to
// per-node blocks (MigratePool), the owner-compared Release of an allocation, sticky claims
// (ListClaims, ClaimAddresses, and ReleaseClaim, which returns a claim's addresses to the pool
// through quarantine), a consistent snapshot of every key (ReadState) or of one address in
// either layout (FindAddress), with what nodes cut off from etcd hold back (State.Expired,
// State.ExpiredBlocks, and HeldFindings, which tells those from a running pod's addresses whose
// keys etcd lost) and ForgetNode, which frees it once a node is gone for good, the map of a
// pool's blocks read at one revision (ReadBlockMap), and the doctor's invariant checks with
// the command that fixes each problem (Check). leaseholdctl is a thin command line over it. Nothing here renews a lease: that is only ever the agent's
// (package leases).
package admin
