// Package reclaim is the agent's recovery: it re-claims, on fresh leases, the addresses of
// the running pods whose lease or keys were lost, and releases the pods whose sandbox is gone
// (docs/agent.md, "Re-claim").
package reclaim
