// Package release is the agent's DEL, GC and CHECK (docs/agent.md, "Release"): it releases an
// attachment's addresses (one release transaction of leases/txn, quarantined), gives up a pod
// lease with its last attachment, records a DEL that etcd could not take, collects what the
// runtime no longer lists, and checks that an attachment's addresses are held where the pod
// book says. It is handed what it uses when the agent makes it; it never imports package leases.
package release
