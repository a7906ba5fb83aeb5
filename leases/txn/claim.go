package txn

import (
	"context"
	"net/netip"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Claim is the transaction that gives one attachment its addresses: every key it writes is
// created if absent, on the pod's lease, in one transaction, so two owners never hold one
// address and no attachment is ever half written.
//
//	If(   owner index absent,
//	      [ADD] pool definition unchanged since the agent read it,
//	      [ADD, import; new pod] pod record absent | [known pod] pod record on this lease,
//	      per address: allocation absent, [ADD] quarantine key absent, [ADD] no host address key,
//	      [ADD] no wanted key, [ADD, chosen as free] held key absent)
//	Then( [new pod] put pod record, put every allocation and its held key, put owner index,
//	      [re-claim] put conflict record and a wanted key per address taken, delete the
//	      wanted keys of the addresses claimed )
//	Else( get owner index, [ADD, import] pod record, [ADD] pool definition,
//	      per address: allocation, [ADD] quarantine key, [ADD] first host address key, [ADD] held key,
//	      [ADD] first wanted key )
//
// An ADD claims addresses the view chose; a re-claim restores a running pod's own addresses
// after its lease was lost, so it does not compare the pool definition (the addresses were
// the pod's under whatever definition was current) and writes the pod record separately,
// once every attachment is back. An import (leases/imports) claims the addresses another IPAM
// plugin gave a running container: like a re-claim it compares neither the definition nor
// quarantine and host keys (the container uses the address already), and like an ADD it
// writes the pod record with the attachment. The else branch reads exactly what decides the
// outcome, so a failed claim costs no second read; ClaimOutcome names what it found.
//
// Callers fill the fields in as a struct literal; the comment on each says which claims
// carry it. Commit sends a claim alone; a Batcher sends concurrent ones together.
type Claim struct {
	// Lease is the pod's lease (a spare for a new pod): the allocations, the owner index and
	// the pod and conflict records go on it.
	Lease  clientv3.LeaseID
	Pool   string
	Blocks allocator.Blocks // the pool's layout: where each address's keys are
	// AlsoFlat compares each address's flat-layout keys absent too (a re-claim while the pool
	// is being migrated to blocks, when an address may still be held under its old key).
	AlsoFlat bool
	OwnerKey string       // the attachment's owner index (keyspace.OwnerKey)
	Addrs    []netip.Addr // the addresses claimed, in the order ClaimOutcome.Addrs reports them
	// Values written: an allocation record per address (the same for all) and the owner index.
	Alloc keyspace.Allocation
	Index keyspace.OwnerRecord
	// HeldLease, when set, carries a held key per address (keyspace.HeldKey) with Held: the
	// node's block lease, which outlives the pod lease by the reuse delay.
	HeldLease clientv3.LeaseID
	Held      keyspace.HeldRecord
	// NotHeld are the addresses an ADD chose as free ones: the claim compares their held key
	// absent, so that one whose holder expired without a release goes only to an ADD that
	// chose it as such (poolview.View.reuseExpired), whatever a stale view or snapshot said.
	NotHeld map[netip.Addr]bool

	// ADD only.
	Add     bool
	PoolRev int64 // ModRevision of the pool definition the addresses were chosen by
	// ADD and import: the pod record, created with NewPod, else compared on the lease; a
	// re-claim has none (PodKey empty).
	PodKey string
	NewPod bool
	Pod    keyspace.PodRecord
	// Re-claim only: addresses of the attachment another owner took, recorded on the lease,
	// each with a wanted key of WantCluster/WantOwner on HeldLease; the wanted keys of the
	// addresses claimed are deleted (keyspace.WantedKey).
	ConflictKey string
	Conflict    *keyspace.ConflictRecord
	WantCluster string
	WantOwner   string
	// ADD naming a sticky claim: the claim record, compared absent (ClaimRev 0) or unchanged
	// since read, is put with this attachment as holder on ClaimLease; the addresses resting
	// in quarantine under the claim (Resting: address to the ModRevision of its quarantine
	// key) are compared unchanged and deleted instead of compared absent.
	ClaimKey   string
	ClaimRev   int64
	ClaimRec   keyspace.ClaimRecord
	ClaimLease clientv3.LeaseID
	ClaimQ     string // the quarantine record marking an address as the claim's
	Resting    map[netip.Addr]int64
}

// Positions of the else branch's reads, shared by ops and outcome so that neither counts.
const (
	elseOwner = iota // every claim
	elsePod          // ADD and import
	elsePool         // ADD only (one less without the pod record's read)
)

// readsPerAddr is the else branch's reads per address: the allocation, then for an ADD its
// quarantine key, its first host address key, its held key and its first wanted key.
func (c *Claim) readsPerAddr() int {
	if c.Add {
		return 5
	}
	return 1
}

func (c *Claim) addrRead(i, which int) int {
	first := elseOwner + 1
	if c.PodKey != "" {
		first++
	}
	if c.Add {
		first++
	}
	return first + i*c.readsPerAddr() + which
}

// ops is the claim's compares, writes and else-branch reads.
func (c *Claim) ops() (cmps []clientv3.Cmp, puts, gets []clientv3.Op) {
	on := clientv3.WithLease(c.Lease)
	cmps = append(cmps, keyspace.Absent(c.OwnerKey))
	gets = append(gets, clientv3.OpGet(c.OwnerKey))
	if c.PodKey != "" {
		if c.NewPod {
			cmps = append(cmps, keyspace.Absent(c.PodKey))
			puts = append(puts, clientv3.OpPut(c.PodKey, keyspace.Encode(c.Pod), on))
		} else {
			cmps = append(cmps, keyspace.OnLease(c.PodKey, c.Lease))
		}
		gets = append(gets, clientv3.OpGet(c.PodKey))
	}
	if c.Add {
		poolKey := keyspace.PoolKey(c.Pool)
		cmps = append(cmps, keyspace.Unchanged(poolKey, c.PoolRev))
		gets = append(gets, clientv3.OpGet(poolKey, clientv3.WithKeysOnly()))
	}
	alloc, held := keyspace.Encode(c.Alloc), keyspace.Encode(c.Held)
	for _, addr := range c.Addrs {
		ipKey := keyspace.IPKey(c.Pool, c.Blocks, addr)
		cmps = append(cmps, keyspace.Absent(ipKey))
		if c.AlsoFlat && !c.Blocks.Flat() {
			cmps = append(cmps, keyspace.Absent(keyspace.IPKey(c.Pool, allocator.Blocks{}, addr)),
				keyspace.Absent(keyspace.QuarantineKey(c.Pool, allocator.Blocks{}, addr)))
		}
		puts = append(puts, clientv3.OpPut(ipKey, alloc, on))
		if c.HeldLease != 0 {
			// Overwrites the held key of an earlier holder that expired without a release:
			// the address is this owner's now (see poolview.View.reuseExpired).
			puts = append(puts, clientv3.OpPut(keyspace.HeldKey(c.Pool, c.Blocks, addr), held, clientv3.WithLease(c.HeldLease)))
		}
		gets = append(gets, clientv3.OpGet(ipKey))
		if c.Add {
			qKey, hosts := keyspace.QuarantineKey(c.Pool, c.Blocks, addr), keyspace.HostIPPrefix(addr)
			if rev, ok := c.Resting[addr]; ok {
				cmps = append(cmps, keyspace.Unchanged(qKey, rev))
			} else {
				cmps = append(cmps, keyspace.Absent(qKey))
			}
			if c.ClaimKey != "" {
				puts = append(puts, clientv3.OpPut(qKey, c.ClaimQ, clientv3.WithLease(c.ClaimLease)))
			}
			// No node publishes the address as its own.
			cmps = append(cmps, keyspace.NoneUnder(hosts))
			heldKey := keyspace.HeldKey(c.Pool, c.Blocks, addr)
			if c.NotHeld[addr] {
				cmps = append(cmps, keyspace.Absent(heldKey))
			}
			// No running pod wants it back (a conflict): it is that pod's to take.
			wanted := keyspace.WantedPrefix(c.Pool, c.Blocks, addr)
			cmps = append(cmps, keyspace.NoneUnder(wanted))
			gets = append(gets, clientv3.OpGet(qKey),
				clientv3.OpGet(hosts, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(1)),
				clientv3.OpGet(heldKey, clientv3.WithKeysOnly()),
				clientv3.OpGet(wanted, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(1)))
		}
		if c.WantOwner != "" {
			puts = append(puts, clientv3.OpDelete(keyspace.WantedKey(c.Pool, c.Blocks, addr, c.WantCluster, c.WantOwner)))
		}
	}
	if c.Conflict != nil && c.WantOwner != "" && c.HeldLease != 0 {
		for _, t := range c.Conflict.Taken {
			puts = append(puts, clientv3.OpPut(keyspace.WantedKey(c.Pool, c.Blocks, t.IP, c.WantCluster, c.WantOwner), held,
				clientv3.WithLease(c.HeldLease)))
		}
	}
	puts = append(puts, clientv3.OpPut(c.OwnerKey, keyspace.Encode(c.Index), on))
	if c.Conflict != nil {
		puts = append(puts, clientv3.OpPut(c.ConflictKey, keyspace.Encode(*c.Conflict), on))
	}
	if c.ClaimKey != "" {
		if c.ClaimRev == 0 {
			cmps = append(cmps, keyspace.Absent(c.ClaimKey))
		} else {
			cmps = append(cmps, keyspace.Unchanged(c.ClaimKey, c.ClaimRev))
		}
		puts = append(puts, clientv3.OpPut(c.ClaimKey, keyspace.Encode(c.ClaimRec), clientv3.WithLease(c.ClaimLease)))
		gets = append(gets, clientv3.OpGet(c.ClaimKey, clientv3.WithKeysOnly()))
	}
	return cmps, puts, gets
}

// Commit runs the claim as its own transaction (a re-claim, an import, an ADD naming a
// sticky claim; other ADDs go through the Batcher). An error is etcd's or the client's: a
// refusal (Refused) applied nothing, any other may have applied.
func (c *Claim) Commit(ctx context.Context, cli *clientv3.Client) (ClaimOutcome, error) {
	cmps, puts, gets := c.ops()
	resp, err := cli.Txn(ctx).If(cmps...).Then(puts...).Else(gets...).Commit()
	if err != nil {
		return ClaimOutcome{}, err
	}
	return c.outcome(resp), nil
}

// ClaimOutcome is what a claim's response says, named.
type ClaimOutcome struct {
	// Applied: every key was written, at Revision.
	Applied  bool
	Revision int64
	// Existing is the owner index found: the attachment has addresses already (an ADD
	// repeated, a new container of the same pod, or an earlier re-claim). Whose they are is
	// in its record (keyspace.OwnerRecord).
	Existing *mvccpb.KeyValue
	// PoolChanged: the pool definition is not the one the addresses were chosen by (ADD).
	PoolChanged bool
	// Pod says what the claim found of the pod record (ADD, import), and PodKV is that record.
	Pod   PodFound
	PodKV *mvccpb.KeyValue
	// Addrs says, per address claimed (in claim order), why it was not free.
	Addrs []AddrFound
	// ClaimChanged: the sticky claim record is not as the ADD read it (another holder took
	// it, or it was created or released meanwhile).
	ClaimChanged bool
}

// PodFound is what an ADD's or an import's claim found of the pod record.
type PodFound int

const (
	PodAsExpected PodFound = iota // absent for a new pod, on the lease for a known one
	// PodExists: the claim was for a new pod, but a record exists, written before this
	// agent's memory (another interface's ADD before a restart without journal).
	PodExists
	// PodGone: the pod the agent knew has no record: its keys went with its lease.
	PodGone
	// PodMoved: the pod the agent knew has a record on another lease.
	PodMoved
)

// AddrFound is what the claim found at one of its addresses; all nil means the address was
// free and failed nothing.
type AddrFound struct {
	Addr netip.Addr
	// Holder is the allocation key another attachment holds the address with.
	Holder *mvccpb.KeyValue
	// Quarantine is the quarantine key the address rests under after a release (ADD).
	Quarantine *mvccpb.KeyValue
	// Host is the key of a node that publishes the address as its own (ADD).
	Host *mvccpb.KeyValue
	// Held is the held key of an address the ADD chose as free: its holder expired without
	// a release, and it is held back (poolview/reuse.go).
	Held *mvccpb.KeyValue
	// Wanted is a wanted key of the address: a running pod's, which another owner took
	// while its lease was lost (ADD).
	Wanted *mvccpb.KeyValue
}

// Taken tells whether anything stood at the address.
func (f AddrFound) Taken() bool {
	return f.Holder != nil || f.Quarantine != nil || f.Host != nil || f.Held != nil || f.Wanted != nil
}

// outcome decodes resp, the response to c's transaction.
func (c *Claim) outcome(resp *clientv3.TxnResponse) ClaimOutcome {
	if resp.Succeeded {
		return ClaimOutcome{Applied: true, Revision: resp.Header.Revision}
	}
	kv := func(i int) *mvccpb.KeyValue {
		if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
			return kvs[0]
		}
		return nil
	}
	out := ClaimOutcome{Existing: kv(elseOwner), Addrs: make([]AddrFound, len(c.Addrs))}
	if c.Add {
		at := elsePool
		if c.PodKey == "" {
			at-- // a joint claim's later part: the pod record goes with the first (Batcher.CommitJoint)
		}
		pool := kv(at)
		out.PoolChanged = pool == nil || pool.ModRevision != c.PoolRev
	}
	if c.PodKey != "" {
		out.PodKV = kv(elsePod)
		switch {
		case c.NewPod && out.PodKV != nil:
			out.Pod = PodExists
		case !c.NewPod && out.PodKV == nil:
			out.Pod = PodGone
		case !c.NewPod && !keyspace.HeldOn(out.PodKV, c.Lease):
			out.Pod = PodMoved
		}
	}
	for i, addr := range c.Addrs {
		f := AddrFound{Addr: addr, Holder: kv(c.addrRead(i, 0))}
		if c.Add {
			f.Quarantine, f.Host = kv(c.addrRead(i, 1)), kv(c.addrRead(i, 2))
			if c.NotHeld[addr] {
				f.Held = kv(c.addrRead(i, 3))
			}
			f.Wanted = kv(c.addrRead(i, 4))
			if rev, ok := c.Resting[addr]; ok && f.Quarantine != nil && f.Quarantine.ModRevision == rev {
				f.Quarantine = nil // resting under the claim: this ADD's to take
			}
		}
		out.Addrs[i] = f
	}
	if c.ClaimKey != "" {
		rec := kv(len(resp.Responses) - 1)
		out.ClaimChanged = (c.ClaimRev == 0) != (rec == nil) || rec != nil && rec.ModRevision != c.ClaimRev
	}
	return out
}
