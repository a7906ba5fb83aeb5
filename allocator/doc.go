// Package allocator is leasehold's pure domain: address ranges in host-local's format,
// pool definitions, the request and result types shared by the CNI plugin and the node
// agent, and the choice of a free address over a view of the taken ones. It does no I/O:
// no etcd, no CNI library, no kernel.
package allocator
