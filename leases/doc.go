// Package leases is the node agent's world: the etcd key schema, the compare-and-swap
// transactions that claim and release addresses, the lease keeper that keeps every pod's
// lease alive on one stream, the watch-fed view of each pool, node identity, and the
// agent service that ties them together.
package leases
