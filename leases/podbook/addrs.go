package podbook

import (
	"net/netip"
	"slices"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The book by address: which addresses this node's pods list, so that no ADD of this node
// offers one to another pod, and which of them another owner holds (conflicts).

type poolAddr struct {
	pool string
	addr netip.Addr
}

// ConflictRef names one conflicted address of one attachment: the agent follows each
// (leases/conflicts), and HeldAddrs lists the addresses of running pods by it.
type ConflictRef struct {
	Owner, IfName, Pool string
	Addr                netip.Addr
}

// addrIndex is the book's index by address: per pool and address, how many attachments of
// the book list it. It is guarded by the book's mutex.
type addrIndex map[poolAddr]int

// count adds (delta 1) or removes (-1) ps's addresses; the caller holds the book's mutex.
func (x addrIndex) count(ps *PodState, delta int) {
	if ps == nil {
		return
	}
	for _, at := range ps.Attachments {
		for _, a := range at.IPs {
			k := poolAddr{at.Pool, a}
			if x[k] += delta; x[k] <= 0 {
				delete(x, k)
			}
		}
	}
}

// OwnsAddr tells whether one of this node's pods lists addr in pool: held, being re-claimed
// after a lost lease (its keys may be gone from etcd, and with them the view's record of it),
// in conflict, or waiting for its release. An ADD never offers such an address to a new pod.
func (t *Book) OwnsAddr(pool string, addr netip.Addr) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.addrs[poolAddr{pool, addr}] > 0
}

// AddrsByPool lists, per pool, the addresses of this node's pods (OwnsAddr).
func (t *Book) AddrsByPool() map[string][]netip.Addr {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string][]netip.Addr{}
	for pa := range t.addrs {
		out[pa.pool] = append(out[pa.pool], pa.addr)
	}
	return out
}

// OwnerOf is the owner of the pod whose attachment in pool lists addr, if any.
func (t *Book) OwnerOf(pool string, addr netip.Addr) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.addrs[poolAddr{pool, addr}] == 0 {
		return "", false
	}
	for owner, ps := range t.m {
		for _, at := range ps.Attachments {
			if at.Pool == pool && slices.Contains(at.IPs, addr) {
				return owner, true
			}
		}
	}
	return "", false
}

// Wanted names, as keyspace.WantedKey in the flat layout, every conflicted address of the
// pods (their wanted keys are theirs to keep).
func (t *Book) Wanted(cluster string) map[string]bool {
	out := map[string]bool{}
	for owner, ats := range t.Conflicted() {
		for _, at := range ats {
			for _, addr := range at.Conflicts {
				out[keyspace.WantedKey(at.Pool, allocator.Blocks{}, addr, cluster, owner)] = true
			}
		}
	}
	return out
}

// HeldAddrs lists the addresses of the pods whose leases the agent holds, or found lost at
// lostSince or after, but those another owner holds (conflicts) and those of attachments
// being released.
func (t *Book) HeldAddrs(lostSince time.Time) map[ConflictRef]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[ConflictRef]bool{}
	for owner, ps := range t.m {
		_, held := ps.lease.held()
		if !held && !(ps.lease.lost() && !ps.lease.lostAt.Before(lostSince)) {
			continue
		}
		for _, at := range ps.Attachments {
			for _, ip := range at.IPs {
				if !at.Released && !at.Target && !slices.Contains(at.Conflicts, ip) {
					out[ConflictRef{owner, at.IfName, at.Pool, ip}] = true
				}
			}
		}
	}
	return out
}

// Conflicted lists, per owner, the attachments with addresses another owner holds.
func (t *Book) Conflicted() map[string][]Attachment {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string][]Attachment{}
	for owner, ps := range t.m {
		for _, at := range ps.Attachments {
			if len(at.Conflicts) > 0 && !at.Released {
				at.Conflicts = slices.Clone(at.Conflicts)
				out[owner] = append(out[owner], at)
			}
		}
	}
	return out
}
