package txn

import (
	"context"
	"net/netip"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Release is the transaction that gives one attachment's addresses back (a DEL, a GC, a gone
// sandbox). It deletes only what the attachment still holds, owner-compared:
//
//	If(   owner index unchanged since the agent wrote or read it,
//	      per address: allocation on the attachment's lease)
//	Then( delete the owner index and conflict record, every allocation and its held key,
//	      per address another owner holds: Txn(If(held key is the attachment's) Then(delete it)),
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
//
// Callers fill the fields in as a struct literal and send it with Commit.
type Release struct {
	Pool   string
	Blocks allocator.Blocks // the pool's layout: where each address's keys are
	// OwnerKey is the attachment's owner index, compared at OwnerRev: the ModRevision the
	// agent wrote or read it at.
	OwnerKey string
	OwnerRev int64
	Lease    clientv3.LeaseID // the attachment's lease: each allocation is compared on it
	Addrs    []netip.Addr     // the attachment's addresses
	// Taken are addresses of the attachment that another owner holds (a conflict, or an
	// allocation an admin put over the pod's): their allocation is left alone, and their held
	// key goes if it is still the attachment's own (Held, as its claim wrote it). Nothing else
	// would free it once the pod is gone: the other owner's release or expiry leaves it, and
	// the block lease it is on is renewed for as long as the node runs.
	Taken []netip.Addr
	Held  keyspace.HeldRecord
	// OwnerPrefix holds the owner's owner indexes; PodKey is its pod record on this node;
	// ConflictKey is the attachment's conflict record, if a re-claim left one: it goes with it,
	// and so do Wanted, the wanted keys of each of its addresses (keyspace.WantedKey).
	OwnerPrefix, PodKey, ConflictKey string
	Wanted                           []string
	// QLease and QRecord quarantine the addresses; QLease 0 puts none.
	QLease  clientv3.LeaseID
	QRecord keyspace.QuarantineRecord
	// A sticky attachment's claim: if the record is still on the attachment's claim lease
	// (ClaimLease), it goes without a holder (ClaimRec) onto HoldLease (the hold plus
	// quarantine, renewed by nobody) with its addresses' quarantine keys marked with the claim
	// (ClaimQ); if an admin released the claim meanwhile, the addresses get ordinary
	// quarantine (QLease).
	ClaimKey   string
	ClaimLease clientv3.LeaseID
	ClaimRec   keyspace.ClaimRecord
	HoldLease  clientv3.LeaseID
	ClaimQ     keyspace.QuarantineRecord
	// MigrationKey is the claim's live migration key, compared absent: a claim being
	// migrated is not released (its holder's DEL completes the migration, its target's ends
	// it; leases/sticky, migration.go), and the else branch says so (Migrating).
	MigrationKey string
}

// ops is the release's compares, writes and else-branch reads.
func (r *Release) ops() (cmps []clientv3.Cmp, then, els []clientv3.Op) {
	cmps = append(cmps, keyspace.Unchanged(r.OwnerKey, r.OwnerRev))
	then = append(then, clientv3.OpDelete(r.OwnerKey))
	if r.ConflictKey != "" {
		then = append(then, clientv3.OpDelete(r.ConflictKey))
	}
	for _, k := range r.Wanted {
		then = append(then, clientv3.OpDelete(k))
	}
	for _, addr := range r.Addrs {
		key := keyspace.IPKey(r.Pool, r.Blocks, addr)
		cmps = append(cmps, keyspace.OnLease(key, r.Lease))
		then = append(then, clientv3.OpDelete(key), clientv3.OpDelete(keyspace.HeldKey(r.Pool, r.Blocks, addr)))
		els = append(els, clientv3.OpGet(key, clientv3.WithKeysOnly()))
	}
	held := keyspace.Encode(r.Held)
	for _, addr := range r.Taken {
		key := keyspace.HeldKey(r.Pool, r.Blocks, addr)
		then = append(then, clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.Value(key), "=", held)},
			[]clientv3.Op{clientv3.OpDelete(key)}, nil))
	}
	var plain []clientv3.Op
	if r.QLease != 0 {
		rec := keyspace.Encode(r.QRecord)
		for _, addr := range r.Addrs {
			plain = append(plain, clientv3.OpPut(keyspace.QuarantineKey(r.Pool, r.Blocks, addr), rec, clientv3.WithLease(r.QLease)))
		}
	}
	if r.ClaimKey != "" && r.HoldLease != 0 {
		kept := []clientv3.Op{clientv3.OpPut(r.ClaimKey, keyspace.Encode(r.ClaimRec), clientv3.WithLease(r.HoldLease))}
		q := keyspace.Encode(r.ClaimQ)
		for _, addr := range r.Addrs {
			kept = append(kept, clientv3.OpPut(keyspace.QuarantineKey(r.Pool, r.Blocks, addr), q, clientv3.WithLease(r.HoldLease)))
		}
		then = append(then, clientv3.OpTxn([]clientv3.Cmp{keyspace.OnLease(r.ClaimKey, r.ClaimLease)}, kept, plain))
	} else {
		then = append(then, plain...)
	}
	// No owner index before this one, and none after it (an empty range compares as absent):
	// the pod record goes with the last. On the pod's lease, or on none: a copy put by hand
	// (etcdctl put) just before the DEL, which the audit would have put back on the lease, and
	// which nothing else ever deletes once the pod is gone.
	last := func(podKey clientv3.Cmp) clientv3.Op {
		return clientv3.OpTxn([]clientv3.Cmp{
			clientv3.Compare(clientv3.CreateRevision(r.OwnerPrefix), "=", 0).WithRange(r.OwnerKey),
			clientv3.Compare(clientv3.CreateRevision(r.OwnerKey+"\x00"), "=", 0).WithRange(clientv3.GetPrefixRangeEnd(r.OwnerPrefix)),
			podKey,
		}, []clientv3.Op{clientv3.OpDelete(r.PodKey)}, nil)
	}
	then = append(then, last(keyspace.OnLease(r.PodKey, r.Lease)), last(keyspace.OnLease(r.PodKey, 0)))
	then = append(then, clientv3.OpGet(r.OwnerPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly()))
	els = append(els, clientv3.OpGet(r.OwnerKey))
	if r.MigrationKey != "" {
		cmps = append(cmps, keyspace.Absent(r.MigrationKey))
		els = append(els, clientv3.OpGet(r.MigrationKey, clientv3.WithKeysOnly()))
	}
	return cmps, then, els
}

// Commit runs the release. An error is etcd's or the client's: a refusal (Refused, NoSpace)
// applied nothing, any other may have applied.
func (r *Release) Commit(ctx context.Context, cli *clientv3.Client) (ReleaseOutcome, error) {
	cmps, then, els := r.ops()
	resp, err := cli.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
	if err != nil {
		return ReleaseOutcome{}, err
	}
	return r.outcome(resp), nil
}

// ReleaseOutcome is what a release's response says, named.
type ReleaseOutcome struct {
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
	// Migrating: the claim's live migration key exists (Release.MigrationKey); nothing was
	// released.
	Migrating bool
}

// outcome decodes resp, the response to r's transaction.
func (r *Release) outcome(resp *clientv3.TxnResponse) ReleaseOutcome {
	if resp.Succeeded {
		out := ReleaseOutcome{Applied: true, Revision: resp.Header.Revision,
			Left: resp.Responses[len(resp.Responses)-1].GetResponseRange().Count}
		if r.ClaimKey != "" && r.HoldLease != 0 {
			// Before the pod record's two transactions and the count.
			out.ClaimKept = resp.Responses[len(resp.Responses)-4].GetResponseTxn().GetSucceeded()
		}
		return out
	}
	var out ReleaseOutcome
	index := resp.Responses[len(r.Addrs)].GetResponseRange().Kvs
	if len(index) == 0 || index[0].ModRevision != r.OwnerRev {
		out.IndexChanged = true
		return out
	}
	if r.MigrationKey != "" && len(resp.Responses[len(r.Addrs)+1].GetResponseRange().Kvs) > 0 {
		out.Migrating = true
		return out
	}
	for i, addr := range r.Addrs {
		if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 && keyspace.HeldOn(kvs[0], r.Lease) {
			out.OnLease = append(out.OnLease, addr)
		}
	}
	return out
}
