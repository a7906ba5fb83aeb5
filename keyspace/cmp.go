package keyspace

import (
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The comparisons every leasehold transaction is built from. Ownership is the lease a key is
// bound to: only the holder of a pod's lease wrote keys on it, and only the agent renewing it
// holds it, so "is this key still mine" is "is it still on my lease", asked inside the
// transaction that acts on the answer (as etcd's concurrency.Mutex.IsOwner does).

// Absent compares that key does not exist: the guard of every create-if-absent claim.
func Absent(key string) clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
}

// NoneUnder compares that no key starts with prefix (an empty range compares as absent).
func NoneUnder(prefix string) clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(prefix), "=", 0).WithPrefix()
}

// OnLease compares that key is bound to lease: the key exists and its holder is lease's.
func OnLease(key string, lease clientv3.LeaseID) clientv3.Cmp {
	return clientv3.Compare(clientv3.LeaseValue(key), "=", lease)
}

// Unchanged compares that key was last written at rev: nothing changed it since it was read.
func Unchanged(key string, rev int64) clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(key), "=", rev)
}

// HeldOn tells whether kv, as read, is bound to lease: the same question as OnLease, asked of
// a key already in hand. A nil kv (no key) is held by no lease.
func HeldOn(kv *mvccpb.KeyValue, lease clientv3.LeaseID) bool {
	return kv != nil && clientv3.LeaseID(kv.Lease) == lease
}

// LeaseOf is the lease kv is bound to; 0 for none.
func LeaseOf(kv *mvccpb.KeyValue) clientv3.LeaseID { return clientv3.LeaseID(kv.Lease) }

// MaxTxnOps is etcd's default limit (--max-txn-ops) on a transaction's compares, and apart
// on its success and failure operations: every writer and reader that batches keys into one
// transaction stays within it.
const MaxTxnOps = 128

// TxnChunk is how many of items, taken from the front, one transaction carries: as many as
// fit MaxTxnOps by size, and always the first.
func TxnChunk[T any](items []T, size func(T) int) int {
	n, total := 0, 0
	for n < len(items) && (n == 0 || total+size(items[n]) <= MaxTxnOps) {
		total += size(items[n])
		n++
	}
	return n
}
