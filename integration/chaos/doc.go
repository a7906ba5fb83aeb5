// Package chaos is leasehold's fault-injection run with a history checker.
//
// Run builds, as root, one Linux bridge (198.18.X.254/24, X picked per run) and a network
// namespace per host with a veth on it: three etcd members (a real cluster, bin/etcd, its
// data in /dev/shm by default) and N agents (bin/leaseholdd, each started with ip netns exec
// in its own namespace, its unix socket on the shared filesystem). A simulated runtime in the
// root namespace plays one kubelet per node: pods are created and deleted on a seeded
// schedule under a shared load (calm, busy, surges that fill a tight pool), each operation
// the real plugin binary (bin/leasehold) with the CNI environment and configuration on stdin;
// an ADD that fails is retried for 20 s and torn down with a DEL, a DEL is retried every 2 s
// until it answers. Meanwhile seeded faults hit one target at a time each (never two on one
// node, one etcd fault at a time so that a quorum stays): a node's link down for less than
// the TTL, between TTL and TTL + reuse delay, or longer; kill -9 and a restart at once or
// after the TTL; SIGSTOP for twice the TTL; node death and a replacement with a new node UID;
// an etcd member killed, the etcd leader cut off; compactions (and defrag); issue 27's
// races: kill -9 within 50 ms of a DEL's answer, DELs sent around a SIGCONT; and issue 32's:
// a backup (etcdctl snapshot save) and, a few TTLs later, every member restored from it
// (etcdutl snapshot restore, plain or --bump-revision --mark-compacted, into fresh data
// directories at the same URLs), and an admin's etcdctl del of a running pod's allocation,
// owner index or pod record, or a put of its own value over it without its lease.
//
// Two to four of the pods at a time are VMs' (vms.go, issue 35): each VM's pods name its
// migratable claim (args.cni's ipam-claim-reference, with allowPersistentIPs or ipam
// migratable), and the runtime migrates it now and then: a target pod's ADD on another node
// while the source runs, then the source's DEL 1-20 s later, or, one in four, the target's
// (a failed migration). The faults fall on their pods as on any.
//
// Everything is recorded in a History: each pod's attempts and answers, the faults with
// their real start and end, the stretches each node was away, a range read of the
// allocations about every second, the final state read at one revision once the faults
// stopped, part of the pods was deleted and the state settled, leaseholdctl doctor's result,
// and the agents' CONFLICT, "conflict resolved" and "reusing an address" log lines. Check
// judges it without I/O (checker_test.go feeds it histories written by hand):
//
//   - overlaps: two pods whose live intervals overlap hold one address only when an agent
//     recorded the conflict, or as a live migration's pair: two pods of one claim on two
//     nodes, no third pod of the claim with them, ended within migrationBound (one owner);
//   - each conflict is justified: when the other pod got the address, the conflicted pod's
//     node had been away without a break for longer than TTL + reuse delay, or the pool had
//     no other room by the history's own account;
//   - the final allocations are exactly the live pods' addresses (leaks, lost keys), and the
//     doctor is clean;
//   - a DEL answered is final (no key of the pod seen later than TTL after the answer);
//   - a running pod's key is there in every sample, its node neither away nor just healed;
//   - after a restore, every running pod holds its address again and every key of a deleted
//     pod the backup brought back is gone, within restoreGrace of etcd's return (or the
//     node's); an edited key is back on a lease within keyGrace (restorecheck.go says what is
//     relaxed meanwhile, and why).
//
// A run is reproducible by its seed as far as the schedule goes: the same seed draws the
// same faults, parameters and pods; real processes' timing differs.
package chaos
