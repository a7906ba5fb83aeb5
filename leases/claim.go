package leases

import (
	"context"
	"net/netip"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// claim is the transaction that gives one attachment its addresses: every key it writes is
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
// once every attachment is back. An import (import.go) claims the addresses another IPAM
// plugin gave a running container: like a re-claim it compares neither the definition nor
// quarantine and host keys (the container uses the address already), and like an ADD it
// writes the pod record with the attachment. The else branch reads exactly what decides the
// outcome, so a failed claim costs no second read; outcome names what it found.
type claim struct {
	lease  clientv3.LeaseID
	pool   string
	blocks allocator.Blocks // the pool's layout: where each address's keys are
	// alsoFlat compares each address's flat-layout keys absent too (a re-claim while the pool
	// is being migrated to blocks, when an address may still be held under its old key).
	alsoFlat bool
	ownerKey string
	addrs    []netip.Addr
	// Values written: an allocation record per address (the same for all) and the owner index.
	alloc keyspace.Allocation
	index keyspace.OwnerRecord
	// heldLease, when set, carries a held key per address (keyspace.HeldKey) with held: the
	// node's block lease, which outlives the pod lease by the reuse delay.
	heldLease clientv3.LeaseID
	held      keyspace.HeldRecord
	// notHeld are the addresses an ADD chose as free ones: the claim compares their held key
	// absent, so that one whose holder expired without a release goes only to an ADD that
	// chose it as such (poolview.View.reuseExpired), whatever a stale view or snapshot said.
	notHeld map[netip.Addr]bool

	// ADD only.
	add     bool
	poolRev int64 // ModRevision of the pool definition the addresses were chosen by
	// ADD and import: the pod record, created with newPod, else compared on the lease; a
	// re-claim has none (podKey empty).
	podKey string
	newPod bool
	pod    keyspace.PodRecord
	// Re-claim only: addresses of the attachment another owner took, recorded on the lease,
	// each with a wanted key of wantCluster/wantOwner on heldLease; the wanted keys of the
	// addresses claimed are deleted (keyspace.WantedKey).
	conflictKey string
	conflict    *keyspace.ConflictRecord
	wantCluster string
	wantOwner   string
	// ADD naming a sticky claim (sticky.go): the claim record, compared absent (claimRev 0)
	// or unchanged since read, is put with this attachment as holder on claimLease; the
	// addresses resting in quarantine under the claim are compared unchanged and deleted
	// instead of compared absent.
	claimKey   string
	claimRev   int64
	claimRec   keyspace.ClaimRecord
	claimLease clientv3.LeaseID
	claimQ     string // the quarantine record marking an address as the claim's
	resting    map[netip.Addr]int64
}

// Positions of the else branch's reads, shared by txn and outcome so that neither counts.
const (
	elseOwner = iota // every claim
	elsePod          // ADD and import
	elsePool         // ADD only
)

// readsPerAddr is the else branch's reads per address: the allocation, then for an ADD its
// quarantine key, its first host address key, its held key and its first wanted key.
func (c *claim) readsPerAddr() int {
	if c.add {
		return 5
	}
	return 1
}

func (c *claim) addrRead(i, which int) int {
	first := elseOwner + 1
	if c.podKey != "" {
		first++
	}
	if c.add {
		first++
	}
	return first + i*c.readsPerAddr() + which
}

// txn is the claim's compares, writes and else-branch reads.
func (c *claim) txn() (cmps []clientv3.Cmp, puts, gets []clientv3.Op) {
	on := clientv3.WithLease(c.lease)
	cmps = append(cmps, keyspace.Absent(c.ownerKey))
	gets = append(gets, clientv3.OpGet(c.ownerKey))
	if c.podKey != "" {
		if c.newPod {
			cmps = append(cmps, keyspace.Absent(c.podKey))
			puts = append(puts, clientv3.OpPut(c.podKey, keyspace.Encode(c.pod), on))
		} else {
			cmps = append(cmps, keyspace.OnLease(c.podKey, c.lease))
		}
		gets = append(gets, clientv3.OpGet(c.podKey))
	}
	if c.add {
		poolKey := keyspace.PoolKey(c.pool)
		cmps = append(cmps, keyspace.Unchanged(poolKey, c.poolRev))
		gets = append(gets, clientv3.OpGet(poolKey, clientv3.WithKeysOnly()))
	}
	alloc, held := keyspace.Encode(c.alloc), keyspace.Encode(c.held)
	for _, addr := range c.addrs {
		ipKey := keyspace.IPKey(c.pool, c.blocks, addr)
		cmps = append(cmps, keyspace.Absent(ipKey))
		if c.alsoFlat && !c.blocks.Flat() {
			cmps = append(cmps, keyspace.Absent(keyspace.IPKey(c.pool, allocator.Blocks{}, addr)),
				keyspace.Absent(keyspace.QuarantineKey(c.pool, allocator.Blocks{}, addr)))
		}
		puts = append(puts, clientv3.OpPut(ipKey, alloc, on))
		if c.heldLease != 0 {
			// Overwrites the held key of an earlier holder that expired without a release:
			// the address is this owner's now (see poolview.View.reuseExpired).
			puts = append(puts, clientv3.OpPut(keyspace.HeldKey(c.pool, c.blocks, addr), held, clientv3.WithLease(c.heldLease)))
		}
		gets = append(gets, clientv3.OpGet(ipKey))
		if c.add {
			qKey, hosts := keyspace.QuarantineKey(c.pool, c.blocks, addr), keyspace.HostIPPrefix(addr)
			if rev, ok := c.resting[addr]; ok {
				cmps = append(cmps, keyspace.Unchanged(qKey, rev))
			} else {
				cmps = append(cmps, keyspace.Absent(qKey))
			}
			if c.claimKey != "" {
				puts = append(puts, clientv3.OpPut(qKey, c.claimQ, clientv3.WithLease(c.claimLease)))
			}
			// No node publishes the address as its own.
			cmps = append(cmps, keyspace.NoneUnder(hosts))
			heldKey := keyspace.HeldKey(c.pool, c.blocks, addr)
			if c.notHeld[addr] {
				cmps = append(cmps, keyspace.Absent(heldKey))
			}
			// No running pod wants it back (a conflict): it is that pod's to take.
			wanted := keyspace.WantedPrefix(c.pool, c.blocks, addr)
			cmps = append(cmps, keyspace.NoneUnder(wanted))
			gets = append(gets, clientv3.OpGet(qKey),
				clientv3.OpGet(hosts, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(1)),
				clientv3.OpGet(heldKey, clientv3.WithKeysOnly()),
				clientv3.OpGet(wanted, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(1)))
		}
		if c.wantOwner != "" {
			puts = append(puts, clientv3.OpDelete(keyspace.WantedKey(c.pool, c.blocks, addr, c.wantCluster, c.wantOwner)))
		}
	}
	if c.conflict != nil && c.wantOwner != "" && c.heldLease != 0 {
		for _, t := range c.conflict.Taken {
			puts = append(puts, clientv3.OpPut(keyspace.WantedKey(c.pool, c.blocks, t.IP, c.wantCluster, c.wantOwner), held,
				clientv3.WithLease(c.heldLease)))
		}
	}
	puts = append(puts, clientv3.OpPut(c.ownerKey, keyspace.Encode(c.index), on))
	if c.conflict != nil {
		puts = append(puts, clientv3.OpPut(c.conflictKey, keyspace.Encode(*c.conflict), on))
	}
	if c.claimKey != "" {
		if c.claimRev == 0 {
			cmps = append(cmps, keyspace.Absent(c.claimKey))
		} else {
			cmps = append(cmps, keyspace.Unchanged(c.claimKey, c.claimRev))
		}
		puts = append(puts, clientv3.OpPut(c.claimKey, keyspace.Encode(c.claimRec), clientv3.WithLease(c.claimLease)))
		gets = append(gets, clientv3.OpGet(c.claimKey, clientv3.WithKeysOnly()))
	}
	return cmps, puts, gets
}

// commit runs the claim as its own transaction (a re-claim; ADDs go through the batcher).
func (c *claim) commit(ctx context.Context, cli *clientv3.Client) (claimOutcome, error) {
	cmps, puts, gets := c.txn()
	resp, err := cli.Txn(ctx).If(cmps...).Then(puts...).Else(gets...).Commit()
	if err != nil {
		return claimOutcome{}, err
	}
	return c.outcome(resp), nil
}

// claimOutcome is what a claim's response says, named.
type claimOutcome struct {
	// Applied: every key was written, at Revision.
	Applied  bool
	Revision int64
	// Existing is the owner index found: the attachment has addresses already (an ADD
	// repeated, a new container of the same pod, or an earlier re-claim). Whose they are is
	// in its record (existingIndex).
	Existing *mvccpb.KeyValue
	// PoolChanged: the pool definition is not the one the addresses were chosen by (ADD).
	PoolChanged bool
	// Pod says what the claim found of the pod record (ADD, import), and PodKV is that record.
	Pod   podFound
	PodKV *mvccpb.KeyValue
	// Addrs says, per address claimed (in claim order), why it was not free.
	Addrs []addrFound
	// ClaimChanged: the sticky claim record is not as the ADD read it (another holder took
	// it, or it was created or released meanwhile).
	ClaimChanged bool
}

// podFound is what an ADD's or an import's claim found of the pod record.
type podFound int

const (
	podAsExpected podFound = iota // absent for a new pod, on the lease for a known one
	// podExists: the claim was for a new pod, but a record exists, written before this
	// agent's memory (another interface's ADD before a restart without journal).
	podExists
	// podGone: the pod the agent knew has no record: its keys went with its lease.
	podGone
	// podMoved: the pod the agent knew has a record on another lease.
	podMoved
)

// addrFound is what the claim found at one of its addresses; all nil means the address was
// free and failed nothing.
type addrFound struct {
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

// taken tells whether anything stood at the address.
func (f addrFound) taken() bool {
	return f.Holder != nil || f.Quarantine != nil || f.Host != nil || f.Held != nil || f.Wanted != nil
}

// outcome decodes resp, the response to c's transaction.
func (c *claim) outcome(resp *clientv3.TxnResponse) claimOutcome {
	if resp.Succeeded {
		return claimOutcome{Applied: true, Revision: resp.Header.Revision}
	}
	kv := func(i int) *mvccpb.KeyValue {
		if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
			return kvs[0]
		}
		return nil
	}
	out := claimOutcome{Existing: kv(elseOwner), Addrs: make([]addrFound, len(c.addrs))}
	if c.add {
		pool := kv(elsePool)
		out.PoolChanged = pool == nil || pool.ModRevision != c.poolRev
	}
	if c.podKey != "" {
		out.PodKV = kv(elsePod)
		switch {
		case c.newPod && out.PodKV != nil:
			out.Pod = podExists
		case !c.newPod && out.PodKV == nil:
			out.Pod = podGone
		case !c.newPod && !keyspace.HeldOn(out.PodKV, c.lease):
			out.Pod = podMoved
		}
	}
	for i, addr := range c.addrs {
		f := addrFound{Addr: addr, Holder: kv(c.addrRead(i, 0))}
		if c.add {
			f.Quarantine, f.Host = kv(c.addrRead(i, 1)), kv(c.addrRead(i, 2))
			if c.notHeld[addr] {
				f.Held = kv(c.addrRead(i, 3))
			}
			f.Wanted = kv(c.addrRead(i, 4))
			if rev, ok := c.resting[addr]; ok && f.Quarantine != nil && f.Quarantine.ModRevision == rev {
				f.Quarantine = nil // resting under the claim: this ADD's to take
			}
		}
		out.Addrs[i] = f
	}
	if c.claimKey != "" {
		rec := kv(len(resp.Responses) - 1)
		out.ClaimChanged = (c.claimRev == 0) != (rec == nil) || rec != nil && rec.ModRevision != c.claimRev
	}
	return out
}
