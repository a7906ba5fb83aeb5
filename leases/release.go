package leases

import (
	"net/netip"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// release is the transaction that gives one attachment's addresses back (a DEL, a GC, a gone
// sandbox). It deletes only what the attachment still holds, owner-compared:
//
//	If(   owner index unchanged since the agent wrote or read it,
//	      per address: allocation on the attachment's lease)
//	Then( delete the owner index and conflict record, every allocation and its held key,
//	      [quarantine] put each address's quarantine key, on the shared quarantine lease,
//	      Txn(If(no other owner index of the owner, pod record on the lease) Then(delete pod record)),
//	      Txn(If(no other owner index of the owner, pod record on no lease) Then(delete pod record)),
//	      count the owner's owner indexes left)
//	Else( per address: allocation (keys only), owner index )
//
// etcd decides the nested transaction's branch before applying any of the outer one's
// operations, so "no other owner index" is the test for the last attachment: with it goes the
// pod record, leaving the lease without keys to be recycled as a spare. The count lets DEL
// know without a read of its own whether the pod has attachments left.
type release struct {
	pool     string
	blocks   allocator.Blocks
	ownerKey string
	ownerRev int64
	lease    clientv3.LeaseID
	addrs    []netip.Addr
	// ownerPrefix holds the owner's owner indexes; podKey is its pod record on this node;
	// conflictKey is the attachment's conflict record, if a re-claim left one: it goes with it,
	// and so do wanted, the wanted keys of each of its addresses (keyspace.WantedKey).
	ownerPrefix, podKey, conflictKey string
	wanted                           []string
	// qLease and qRecord quarantine the addresses; qLease 0 puts none.
	qLease  clientv3.LeaseID
	qRecord keyspace.QuarantineRecord
	// A sticky attachment's claim (sticky.go): if the record is still on the attachment's
	// claim lease, it goes without a holder onto holdLease (the hold plus quarantine, renewed
	// by nobody) with its addresses' quarantine keys marked with the claim (claimQ); if an
	// admin released the claim meanwhile, the addresses get ordinary quarantine (qLease).
	claimKey   string
	claimLease clientv3.LeaseID
	claimRec   keyspace.ClaimRecord
	holdLease  clientv3.LeaseID
	claimQ     keyspace.QuarantineRecord
}

// txn is the release's compares, writes and else-branch reads.
func (r *release) txn() (cmps []clientv3.Cmp, then, els []clientv3.Op) {
	cmps = append(cmps, keyspace.Unchanged(r.ownerKey, r.ownerRev))
	then = append(then, clientv3.OpDelete(r.ownerKey))
	if r.conflictKey != "" {
		then = append(then, clientv3.OpDelete(r.conflictKey))
	}
	for _, k := range r.wanted {
		then = append(then, clientv3.OpDelete(k))
	}
	for _, addr := range r.addrs {
		key := keyspace.IPKey(r.pool, r.blocks, addr)
		cmps = append(cmps, keyspace.OnLease(key, r.lease))
		then = append(then, clientv3.OpDelete(key), clientv3.OpDelete(keyspace.HeldKey(r.pool, r.blocks, addr)))
		els = append(els, clientv3.OpGet(key, clientv3.WithKeysOnly()))
	}
	var plain []clientv3.Op
	if r.qLease != 0 {
		rec := keyspace.Encode(r.qRecord)
		for _, addr := range r.addrs {
			plain = append(plain, clientv3.OpPut(keyspace.QuarantineKey(r.pool, r.blocks, addr), rec, clientv3.WithLease(r.qLease)))
		}
	}
	if r.claimKey != "" && r.holdLease != 0 {
		kept := []clientv3.Op{clientv3.OpPut(r.claimKey, keyspace.Encode(r.claimRec), clientv3.WithLease(r.holdLease))}
		q := keyspace.Encode(r.claimQ)
		for _, addr := range r.addrs {
			kept = append(kept, clientv3.OpPut(keyspace.QuarantineKey(r.pool, r.blocks, addr), q, clientv3.WithLease(r.holdLease)))
		}
		then = append(then, clientv3.OpTxn([]clientv3.Cmp{keyspace.OnLease(r.claimKey, r.claimLease)}, kept, plain))
	} else {
		then = append(then, plain...)
	}
	// No owner index before this one, and none after it (an empty range compares as absent):
	// the pod record goes with the last. On the pod's lease, or on none: a copy put by hand
	// (etcdctl put) just before the DEL, which the audit would have put back on the lease, and
	// which nothing else ever deletes once the pod is gone.
	last := func(podKey clientv3.Cmp) clientv3.Op {
		return clientv3.OpTxn([]clientv3.Cmp{
			clientv3.Compare(clientv3.CreateRevision(r.ownerPrefix), "=", 0).WithRange(r.ownerKey),
			clientv3.Compare(clientv3.CreateRevision(r.ownerKey+"\x00"), "=", 0).WithRange(clientv3.GetPrefixRangeEnd(r.ownerPrefix)),
			podKey,
		}, []clientv3.Op{clientv3.OpDelete(r.podKey)}, nil)
	}
	then = append(then, last(keyspace.OnLease(r.podKey, r.lease)), last(keyspace.OnLease(r.podKey, 0)))
	then = append(then, clientv3.OpGet(r.ownerPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly()))
	els = append(els, clientv3.OpGet(r.ownerKey))
	return cmps, then, els
}

// releaseOutcome is what a release's response says, named.
type releaseOutcome struct {
	// Applied: the attachment's keys were deleted at Revision; Left is how many owner indexes
	// the owner has after it.
	Applied  bool
	Revision int64
	Left     int64
	// IndexChanged: the owner index is gone or was written since it was read (re-claimed,
	// released by an admin, taken over by a new container): nothing here is the caller's.
	IndexChanged bool
	// OnLease are the addresses still on the attachment's lease; the others were taken or
	// deleted by someone else and must be left alone.
	OnLease []netip.Addr
	// ClaimKept: the sticky claim went onto the hold lease (it was still on the attachment's
	// claim lease).
	ClaimKept bool
}

// outcome decodes resp, the response to r's transaction.
func (r *release) outcome(resp *clientv3.TxnResponse) releaseOutcome {
	if resp.Succeeded {
		out := releaseOutcome{Applied: true, Revision: resp.Header.Revision,
			Left: resp.Responses[len(resp.Responses)-1].GetResponseRange().Count}
		if r.claimKey != "" && r.holdLease != 0 {
			// Before the pod record's two transactions and the count.
			out.ClaimKept = resp.Responses[len(resp.Responses)-4].GetResponseTxn().GetSucceeded()
		}
		return out
	}
	var out releaseOutcome
	index := resp.Responses[len(r.addrs)].GetResponseRange().Kvs
	if len(index) == 0 || index[0].ModRevision != r.ownerRev {
		out.IndexChanged = true
		return out
	}
	for i, addr := range r.addrs {
		if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 && keyspace.HeldOn(kvs[0], r.lease) {
			out.OnLease = append(out.OnLease, addr)
		}
	}
	return out
}
