// Package txn is the agent's transactions on its pods' addresses: the claim that gives an
// attachment its addresses, the release that gives them back, the batcher that sends
// concurrent claims to etcd as one transaction, and what an etcd error proves of a request
// (was it applied?). It is one part of the agent (docs/agent.md): it builds each transaction
// from the keys and records its caller hands it and names what etcd's answer says; what to do
// about that answer is the caller's. It holds no state but the batcher's queue.
package txn
