// Package keyspace is leasehold's contract with etcd, shared by the agent, leaseholdctl, the
// doctor and the tests: the key layout under /leasehold/v1/ (one builder and one parser per
// key family), the record stored at each key and how it is decoded, the comparisons that
// leasehold's transactions are built from (Absent, OnLease, Unchanged), and how a client
// connects (ClientConfig). It holds no state and starts nothing.
package keyspace
