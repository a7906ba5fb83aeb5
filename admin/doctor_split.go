package admin

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/leasehold/leasehold/keyspace"
)

// An interface whose IPv4 and IPv6 came from two pools (issue 34) has an attachment in each:
// an owner index per pool, on the pod's one lease. Each is checked as any attachment; an
// allocation whose owner index is gone while the interface's other one stands is the
// interface half-attached, told as such (halfAttached).

// otherHalf is a readable owner index, on a's lease, of a's interface in another pool than a's,
// or nil: a's owner index was the interface's part in a's pool.
func (c *checker) otherHalf(a *AllocationEntry) *OwnerEntry {
	if a.BoundLease == 0 {
		return nil
	}
	for i := range c.st.Owners {
		o := &c.st.Owners[i]
		if o.Unreadable == "" && o.Cluster == a.Cluster && o.Owner == a.Owner && o.IfName == a.IfName && o.Pool != a.Pool &&
			o.Lease == a.BoundLease && o.Value.Network == a.Network {
			return o
		}
	}
	return nil
}

// halfAttached reports allocation a, named by no owner index (there is no owner index key
// ok), of an interface whose owner index in another pool, other, stands on the same lease:
// its owner index in a's pool was deleted (by hand), and the pod runs with half of its
// interface unknown to etcd. The fix writes the owner index back from the
// allocations of the interface in a's pool, when they give one address per range set;
// otherwise it revokes the pod's lease, and the agent re-claims the whole pod from its journal.
func (c *checker) halfAttached(a *AllocationEntry, ok string, other *OwnerEntry) {
	lease := keyspace.LeaseHex(a.BoundLease)
	msg := fmt.Sprintf("%s in pool %s is named by no owner index (there is no owner index %s): interface %s of pod %s (owner %s, "+
		"container %s, node %s/%s) has its addresses in two pools, one per family, and only its owner index in pool %s (%s) is "+
		"left, on the pod's lease %s, which its agent renews: the interface is half-attached (its owner index in %s deleted by hand?). "+
		"The pod still runs and uses %s, and a CHECK of the interface fails until the owner index is back. %s",
		a.IP, a.Pool, ok, a.IfName, podName(a.Pod), a.Owner, short(a.ContainerID), a.Cluster, dash(a.Node), other.Pool,
		ipsText(other.Value.IPs), lease, a.Pool, a.IP, AgentPutsBack(a.Node))
	fix := "etcdctl lease revoke " + lease
	if ips := c.halfIPs(a, other); ips != nil {
		rec := keyspace.OwnerRecord{IPs: ips, ContainerID: a.ContainerID, Network: a.Network, Node: a.Node, NodeUID: a.NodeUID,
			LeaseID: lease, Created: a.Created}
		msg += fmt.Sprintf(". To put it back at once, restore the owner index on lease %s (the transaction changes nothing if the "+
			"index was written or the allocation changed meanwhile)", lease)
		fix = putFix(ok, []byte(keyspace.Encode(rec)), a.BoundLease, absentGuard(ok), modGuard(a.Key, a.ModRevision))
	} else {
		msg += fmt.Sprintf(". To put it back at once, revoke the pod's lease %s: its agent re-claims every address of the pod "+
			"from its journal, on a new lease", lease)
	}
	c.add(KindOrphan, a.Cluster, msg, fix, a.Key, other.Key)
}

// halfIPs are the addresses of a's attachment in a's pool, in the order of the pool's range
// sets, as its owner index listed them: one per range set, but for the sets of a family the
// interface's other half (other) gives, which the attachment did not take (a dual-stack pool
// giving an interface one family, issue 34). nil when the allocations of the attachment on
// a's lease do not give exactly that.
func (c *checker) halfIPs(a *AllocationEntry, other *OwnerEntry) []netip.Addr {
	p, defined := c.pools[a.Pool]
	if !defined || !p.Usable() {
		return nil
	}
	ips := make([]netip.Addr, len(p.Value.Ranges))
	n := 0
	for i := range c.st.Allocations {
		b := &c.st.Allocations[i]
		if b.Unreadable != "" || b.Pool != a.Pool || b.Cluster != a.Cluster || b.Owner != a.Owner || b.IfName != a.IfName ||
			b.BoundLease != a.BoundLease {
			continue
		}
		set, ok := p.Value.SetOf(b.IP)
		if !ok || ips[set].IsValid() {
			return nil
		}
		ips[set] = b.IP
		n++
	}
	elsewhere := func(set int) bool {
		return slices.ContainsFunc(other.Value.IPs, func(ip netip.Addr) bool { return p.Value.Ranges[set].Family() == familyOf(ip) })
	}
	out := make([]netip.Addr, 0, n)
	for set, ip := range ips {
		switch {
		case ip.IsValid() && !elsewhere(set):
			out = append(out, ip)
		case ip.IsValid(), !elsewhere(set):
			return nil // a family twice, or one no half gives
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

func familyOf(ip netip.Addr) int {
	if ip.Is4() {
		return 4
	}
	return 6
}
