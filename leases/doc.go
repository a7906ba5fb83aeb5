// Package leases is the node agent. Agent serves the CNI operations of one node's sandboxes:
// an ADD is one claim transaction (leases/txn) on the pod's lease, a DEL one release
// transaction (leases/txn). The pod lease's lifecycle (leases/podbook) says when a lease is
// held, lost and re-claimed; the Keeper keeps every lease alive on one stream; each pool's
// view (leases/poolview) is a watch-fed hint of which addresses are free. The key layout and
// records are package keyspace's.
package leases
