package admin

import (
	"fmt"
	"net/netip"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// owner checks one owner index against the allocations it names and its pod record.
func (c *checker) owner(o *OwnerEntry) {
	if o.Unreadable != "" {
		c.add(KindUnreadable, o.Cluster, "owner index is unreadable ("+o.Unreadable+"): the pod's DEL and CHECK fail on it. Delete it; "+
			"doctor then lists the addresses it held as allocations without owner index", delFix(o.Key), o.Key)
		return
	}
	if o.Lease == 0 {
		c.ownerNoLease(o)
	}
	for _, ip := range o.Value.IPs {
		key := c.ipKey(o.Pool, ip)
		a := c.allocAt(o.Pool, ip)
		switch {
		case c.migrationUses(o, ip, a):
			// A live migration's target: the claim's holder owns the address's key, or none
			// does until the target's promotion (live-migration-orphan).
		case a == nil && o.Lease != 0 && c.st.Covers(key):
			c.ownerNoAlloc(o, ip, key)
		case a != nil && !sameAttachment(a, o):
			c.otherHolder(o, ip, a)
		}
	}
	c.podOf(o)
}

// ownerNoAlloc reports an owner index on a live lease naming ip, whose allocation key is
// gone: the pod runs (its agent renews the lease) and uses the address, which etcd no longer
// holds for it. Its agent puts the key back by itself; the fix restores it at once. The held key
// of the address, if any, is not reported as expired besides (heldKeys).
func (c *checker) ownerNoAlloc(o *OwnerEntry, ip netip.Addr, key string) {
	c.ownerMissing[ownerAddr{poolAddr{o.Pool, ip}, o.Cluster, o.Owner}] = len(c.out) // the finding added below
	lease := keyspace.LeaseHex(o.Lease)
	cf := c.conflicts[keyspace.ConflictKey(o.Cluster, o.Owner, o.IfName, o.Pool)]
	conflict := cf != nil && slices.ContainsFunc(cf.Value.Taken, func(t keyspace.TakenByOther) bool { return t.IP == ip })
	msg := fmt.Sprintf("owner index names %s but no key %s holds it", ip, key)
	if !conflict {
		msg += " (deleted by hand?)"
	}
	msg += fmt.Sprintf(": pod %s (owner %s, container %s) on node %s/%s still runs, its owner index on lease %s, which its agent "+
		"renews, and uses the address", podName(c.podRef(o)), o.Owner, short(o.Value.ContainerID), o.Cluster, dash(o.Value.Node), lease)
	switch h := c.heldFor(o.Pool, ip, o.Cluster, o.Owner); {
	case h == nil && c.st.Covers(keyspace.HeldKey(o.Pool, c.blocksOf(o.Pool), ip)):
		msg += "; no held key keeps it back either: the next ADD may give it to another pod"
	case h == nil:
		msg += "; the next ADD may give it to another pod"
	case h.Value.Owner == o.Owner && h.Value.Cluster == o.Cluster:
		msg += fmt.Sprintf("; only its held key %s keeps it from other pods, and only while the pool has other room", h.Key)
	default:
		msg += fmt.Sprintf("; held key %s holds it back for owner %s of node %s/%s", h.Key, dash(h.Value.Owner), dash(h.Value.Cluster), dash(h.Value.Node))
	}
	if conflict {
		msg += fmt.Sprintf(". It is recorded as a conflict at %s: another owner took the address while the pod's lease was lost, "+
			"and the pod's agent puts the allocation back once no other allocation, nor another node's held key, holds it", cf.Key)
	} else {
		msg += ". " + AgentPutsBack(o.Value.Node)
	}
	msg += fmt.Sprintf(". To put it back at once, restore the allocation on the pod's lease %s (the transaction changes nothing if "+
		"the address was taken or the owner index changed meanwhile)", lease)
	rec := keyspace.Allocation{Owner: o.Owner, Cluster: o.Cluster, Node: o.Value.Node, NodeUID: o.Value.NodeUID, Pod: c.podRef(o),
		ContainerID: o.Value.ContainerID, IfName: o.IfName, Network: o.Value.Network, LeaseID: lease, Created: o.Value.Created}
	c.add(KindOwnerNoAlloc, o.Cluster, msg, putFix(key, []byte(keyspace.Encode(rec)), o.Lease, absentGuard(key), modGuard(o.Key, o.ModRevision)), o.Key, key)
}

// heldFor is the readable held key of ip in pool (in either layout) the state read, the one
// naming cluster/owner first, or nil.
func (c *checker) heldFor(pool string, ip netip.Addr, cluster, owner string) *HeldEntry {
	if c.heldAt == nil {
		c.heldAt = map[poolAddr][]*HeldEntry{}
		for i := range c.st.Held {
			if h := &c.st.Held[i]; h.Unreadable == "" {
				c.heldAt[poolAddr{h.Pool, h.IP}] = append(c.heldAt[poolAddr{h.Pool, h.IP}], h)
			}
		}
	}
	hs := c.heldAt[poolAddr{pool, ip}]
	for _, h := range hs {
		if h.Value.Cluster == cluster && h.Value.Owner == owner {
			return h
		}
	}
	if len(hs) > 0 {
		return hs[0]
	}
	return nil
}

// ownerNoLease reports an owner index without lease, putting it back on its addresses' lease
// when they all share one.
func (c *checker) ownerNoLease(o *OwnerEntry) {
	var lease clientv3.LeaseID
	ok := len(o.Value.IPs) > 0
	for _, ip := range o.Value.IPs {
		a := c.allocAt(o.Pool, ip)
		if a == nil || !sameAttachment(a, o) || a.BoundLease == 0 || (lease != 0 && a.BoundLease != lease) {
			ok = false
			break
		}
		lease = a.BoundLease
	}
	if ok {
		c.add(KindNoLease, o.Cluster, fmt.Sprintf("owner index has no lease (written with a plain etcdctl put?), so it never expires; "+
			"its addresses are on lease %s: put it back on that lease", keyspace.LeaseHex(lease)),
			putFix(o.Key, o.Raw, lease, modGuard(o.Key, o.ModRevision)), o.Key)
		return
	}
	c.add(KindNoLease, o.Cluster, fmt.Sprintf("owner index has no lease (written with a plain etcdctl put?) and no allocation on a lease "+
		"backs it: it never expires, and an ADD for the attachment returns %v without holding them. Delete it", o.Value.IPs), delFix(o.Key), o.Key)
}

// otherHolder reports an owner index naming an address another attachment holds: after a lost
// lease (a recorded conflict) or a hand edit, two pods may use one address.
func (c *checker) otherHolder(o *OwnerEntry, ip netip.Addr, a *AllocationEntry) {
	msg := fmt.Sprintf("owner index names %s, but %s holds it for owner %s (cluster %s, node %s, container %s)",
		ip, a.Key, dash(a.Owner), dash(a.Cluster), dash(a.Node), short(a.ContainerID))
	if cf := c.conflicts[keyspace.ConflictKey(o.Cluster, o.Owner, o.IfName, o.Pool)]; cf != nil &&
		slices.ContainsFunc(cf.Value.Taken, func(t keyspace.TakenByOther) bool { return t.IP == ip }) {
		msg += fmt.Sprintf("; recorded as a conflict at %s: the pod lost it while its lease was lost", cf.Key)
	}
	msg += ". Both pods may use the address: recreate this one (its DEL releases only what it still holds)"
	pod := c.podRef(o)
	fix := delFix(o.Key)
	if pod.Name != "" {
		fix = "kubectl delete pod -n " + ShellQuote(pod.Namespace) + " " + ShellQuote(pod.Name)
	} else {
		for _, own := range o.Value.IPs {
			if oa := c.allocAt(o.Pool, own); oa != nil && sameAttachment(oa, o) && oa.BoundLease == o.Lease {
				fix = releaseFix(own, o.Pool, o.Lease)
				msg += fmt.Sprintf("; no pod is named, so stop container %s on node %s, then release what it holds", short(o.Value.ContainerID), o.Value.Node)
				break
			}
		}
	}
	c.add(KindOwnerOtherAlloc, o.Cluster, msg, fix, o.Key, a.Key)
}

// podOf checks that a leased attachment has its pod record, on the same lease.
func (c *checker) podOf(o *OwnerEntry) {
	if o.Lease == 0 || allocator.ValidateName("node", o.Value.Node) != nil {
		return
	}
	pk := keyspace.PodKey(o.Cluster, o.Value.Node, o.Owner)
	if c.podSeen[pk] {
		return
	}
	c.podSeen[pk] = true
	p := c.pods[pk]
	switch {
	case p == nil:
		rec := keyspace.PodRecord{Owner: o.Owner, Pod: c.podRef(o), NodeUID: o.Value.NodeUID, LeaseID: keyspace.LeaseHex(o.Lease),
			ContainerID: o.Value.ContainerID, Created: o.Value.Created}
		c.add(KindPodMissing, o.Cluster, fmt.Sprintf("owner %s has attachments on node %s but no pod record: after an agent restart nothing "+
			"resumes lease %s, and the pod's addresses expire while it runs. Restore the record on that lease (without a netns path, "+
			"the agent's liveness check leaves it alone)", o.Owner, o.Value.Node, keyspace.LeaseHex(o.Lease)),
			putFix(pk, []byte(keyspace.Encode(rec)), o.Lease, absentGuard(pk)), o.Key, pk)
	case p.Lease != 0 && p.Lease != o.Lease:
		c.add(KindLeaseMismatch, o.Cluster, fmt.Sprintf("pod record is on lease %s but the attachment on lease %s: after a restart the agent "+
			"resumes %s and the addresses expire with %s. Put the pod record on the attachment's lease",
			keyspace.LeaseHex(p.Lease), keyspace.LeaseHex(o.Lease), keyspace.LeaseHex(p.Lease), keyspace.LeaseHex(o.Lease)),
			putFix(pk, p.Raw, o.Lease, modGuard(pk, p.ModRevision)), pk, o.Key)
	}
}

func (c *checker) podRecords() {
	for _, p := range c.st.Pods {
		if p.Unreadable != "" {
			c.add(KindUnreadable, p.Cluster, "pod record is unreadable ("+p.Unreadable+"): the agent skips it when it restarts, so the pod's "+
				"lease runs out. Delete it; doctor then offers to restore it", delFix(p.Key), p.Key)
			continue
		}
		if p.Lease != 0 {
			continue
		}
		var lease clientv3.LeaseID
		for _, o := range c.st.Owners {
			if o.Cluster == p.Cluster && o.Owner == p.Owner && o.Unreadable == "" && o.Value.Node == p.Node && o.Lease != 0 {
				lease = o.Lease
				break
			}
		}
		if lease != 0 {
			c.add(KindNoLease, p.Cluster, fmt.Sprintf("pod record has no lease (written with a plain etcdctl put?), so it never expires; the "+
				"owner's attachments are on lease %s: put it back on that lease", keyspace.LeaseHex(lease)),
				putFix(p.Key, p.Raw, lease, modGuard(p.Key, p.ModRevision)), p.Key)
			continue
		}
		c.add(KindNoLease, p.Cluster, "pod record has no lease (written with a plain etcdctl put?) and the owner has no attachment on a "+
			"lease: it never expires, and the node's agent would resume a lease that does not exist. Delete it", delFix(p.Key), p.Key)
	}
}

// leasedRecords checks the records that only need to be readable and on a lease.
func (c *checker) leasedRecords() {
	type rec struct {
		key, cluster, what, unreadable string
		lease                          clientv3.LeaseID
	}
	var recs []rec
	for _, n := range c.st.Nodes {
		recs = append(recs, rec{n.Key, n.Cluster, "node record: it outlives its agent, so node list shows a dead agent as present; " +
			"the agent writes it again when it starts", n.Unreadable, n.Lease})
	}
	for _, q := range c.st.Quarantine {
		recs = append(recs, rec{q.Key, "", "quarantine key: the address never leaves quarantine", q.Unreadable, q.Lease})
	}
	for _, cf := range c.st.Conflicts {
		recs = append(recs, rec{cf.Key, cf.Cluster, "conflict record: it outlives the pod it describes", cf.Unreadable, cf.Lease})
	}
	for _, h := range c.st.HostIPs {
		recs = append(recs, rec{h.Key, h.Cluster, "host address: no pool ever hands out " + h.IP.String() + " again; " +
			"the node's agent publishes it again if the node still uses it", "", h.Lease})
	}
	for _, b := range c.st.Blocks {
		recs = append(recs, rec{b.Key, b.Value.Cluster, "block claim: no other node claims block " + b.Block.String() +
			" while it stands; the agent that needs the block claims it again", b.Unreadable, b.Lease})
	}
	for _, r := range recs {
		switch {
		case r.unreadable != "":
			c.add(KindUnreadable, r.cluster, "unreadable value ("+r.unreadable+") of a "+r.what, delFix(r.key), r.key)
		case r.lease == 0:
			c.add(KindNoLease, r.cluster, "no lease (written with a plain etcdctl put?) on a "+r.what, delFix(r.key), r.key)
		}
	}
}

// duplicates reports addresses held in two pools whose ranges overlap.
func (c *checker) duplicates() {
	var valid []PoolEntry
	for _, p := range c.st.Pools {
		if p.Unreadable == "" && p.Invalid == "" {
			valid = append(valid, p)
		}
	}
	byPool := map[string]map[netip.Addr]*AllocationEntry{}
	for i := range c.st.Allocations {
		a := &c.st.Allocations[i]
		if byPool[a.Pool] == nil {
			byPool[a.Pool] = map[netip.Addr]*AllocationEntry{}
		}
		byPool[a.Pool][a.IP] = a
	}
	for i, p := range valid {
		for _, q := range valid[i+1:] {
			if !p.Value.Overlaps(q.Value) {
				continue
			}
			for ip, a := range byPool[p.Name] {
				b := byPool[q.Name][ip]
				if b == nil {
					continue
				}
				newer := b
				if a.CreateRevision > b.CreateRevision {
					newer = a
				}
				c.add(KindDuplicate, "", fmt.Sprintf("%s is held in pool %s (owner %s, cluster %s, node %s) and in pool %s (owner %s, cluster %s, node %s), "+
					"whose ranges overlap: if both pools serve one network, two pods have one address. Release the newer allocation "+
					"(in pool %s) and recreate its pod; pools of separate networks should not overlap either",
					ip, a.Pool, dash(a.Owner), dash(a.Cluster), dash(a.Node), b.Pool, dash(b.Owner), dash(b.Cluster), dash(b.Node), newer.Pool),
					releaseFix(ip, newer.Pool, newer.BoundLease), a.Key, b.Key)
			}
		}
	}
}
