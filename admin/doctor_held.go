package admin

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The doctor's checks of held keys (issue 23; held.go). A held key is readable, on a lease (its
// node's block lease), and names the holder of its address's allocation when there is one.
// Without an allocation the address is expired, information and not a problem, unless its pod
// still runs: an owner index naming the address (owner-index-without-allocation), or the pod's
// record or another of its owner indexes on a live lease (running-pod-address-missing), say
// that etcd lost a running pod's key. Such an address is reported once, as that error.

// heldKeys checks each held key, and lists the expired addresses grouped by node and lease.
func (c *checker) heldKeys() {
	nodes := c.st.nodeIndex()
	type group struct {
		pool, cluster, node string
		lease               clientv3.LeaseID
		keys                []string
		ips                 []string
	}
	groups := map[string]*group{}
	running := map[string]*runningGroup{}
	for i := range c.st.Held {
		h := &c.st.Held[i]
		v := h.Value
		if h.Unreadable != "" {
			c.add(KindUnreadable, "", fmt.Sprintf("held key is unreadable (%s): no agent can tell which node %s of pool %s is held back "+
				"for. Delete it: an allocation of the address, if any, still holds it", h.Unreadable, h.IP, h.Pool), delFix(h.Key), h.Key)
			continue
		}
		a := c.allocAt(h.Pool, h.IP)
		if h.Lease == 0 {
			c.heldNoLease(h, a, nodes)
		}
		switch {
		case a != nil && a.Unreadable == "" && (a.Cluster != v.Cluster || a.Node != v.Node || a.Owner != v.Owner):
			c.heldOtherHolder(h, a, nodes)
		case a != nil || !c.st.Covers(spell(keyspace.IPsPrefix(h.Pool), h.Block, h.IP)):
		case c.ownerTold(h.Key, ownerAddr{poolAddr{h.Pool, h.IP}, v.Cluster, v.Owner}):
			// owner-index-without-allocation reported the address: its pod runs.
		case c.podRuns(v) != nil:
			k := keyspace.PodKey(v.Cluster, v.Node, v.Owner) + "\x00" + h.Pool
			g := running[k]
			if g == nil {
				g = &runningGroup{podKeys: *c.podRuns(v), pool: h.Pool, held: v}
				running[k] = g
			}
			g.keys = append(g.keys, h.Key)
			g.ips = append(g.ips, h.IP.String())
			g.ipKeys = append(g.ipKeys, spell(keyspace.IPsPrefix(h.Pool), h.Block, h.IP))
		case h.Lease != 0:
			k := fmt.Sprintf("%s\x00%s\x00%s\x00%x", h.Pool, v.Cluster, v.Node, int64(h.Lease))
			g := groups[k]
			if g == nil {
				g = &group{pool: h.Pool, cluster: v.Cluster, node: v.Node, lease: h.Lease}
				groups[k] = g
			}
			g.keys = append(g.keys, h.Key)
			g.ips = append(g.ips, h.IP.String())
		}
	}
	for _, k := range slices.Sorted(maps.Keys(running)) {
		c.runningPodAddrMissing(running[k])
	}
	for _, k := range slices.Sorted(maps.Keys(groups)) {
		g := groups[k]
		lease := keyspace.LeaseHex(g.lease)
		ips := strings.Join(g.ips[:min(len(g.ips), 5)], ", ")
		if len(g.ips) > 5 {
			ips += fmt.Sprintf(" and %d more", len(g.ips)-5)
		}
		msg := fmt.Sprintf("%d address(es) of pool %s (%s) are expired: no allocation holds them and no key of their pods is left "+
			"(their leases ran out without a release, the node cut off from etcd or dead, or all their keys were deleted by hand), but "+
			"the held keys of node %s/%s on block lease %s keep them from other pods while the pool has other room. ",
			len(g.keys), g.pool, ips, dash(g.cluster), dash(g.node), lease)
		until := fmt.Sprintf("block lease %s expires, the reuse delay (leaseholdd --reuse-delay, default 15m) after the pods' leases "+
			"(leaseholdctl alloc show %s says when)", lease, g.ips[0])
		fix := ""
		switch agentOf(c.st, nodes, g.cluster, g.node, "") {
		case AgentLive:
			msg += fmt.Sprintf("Node %s has an agent again (%s). It %s. Nothing to do. It leaves the held keys of an earlier machine "+
				"under the same name (another node UID): they are reusable when %s", g.node, keyspace.NodeKey(g.cluster, g.node), AgentBack(), until)
		case AgentGone:
			msg += fmt.Sprintf("They are held back until %s. Node %s has no agent (no %s): it is cut off from etcd or dead. If it comes "+
				"back before then, its agent re-claims the addresses of its pods still running and frees the others. Nothing to do; "+
				"once sure the node is gone for good, free them and its blocks at once", until, g.node, keyspace.NodeKey(g.cluster, g.node))
			fix = forgetFix(g.cluster, g.node)
		default:
			msg += fmt.Sprintf("They are held back until %s, unless an agent of the node frees them first. Nothing to do", until)
		}
		c.tell(g.keys)
		c.note(SeverityInfo, KindAddressExpired, g.cluster, msg, fix, g.keys...)
	}
}

// ownerTold records that the owner-index-without-allocation finding of the address a tells
// of held key k, and reports whether there is one.
func (c *checker) ownerTold(k string, a ownerAddr) bool {
	i, ok := c.ownerMissing[a]
	if ok {
		c.heldTold[k] = i
	}
	return ok
}

// tell records that the finding added next tells of held keys keys (HeldFindings).
func (c *checker) tell(keys []string) {
	for _, k := range keys {
		c.heldTold[k] = len(c.out)
	}
}

// heldFreedLog is what an agent logs when it frees the held keys of its pods that are gone.
const heldFreedLog = "held keys of addresses no pod of this node holds any more freed"

// AgentBack says what the agent of a node does, once it runs and reaches etcd, with the
// addresses held back for the node whose pods have no key left (expired): doctor's
// address-expired says it, and leaseholdctl alloc show and pool show. It follows "it".
func AgentBack() string {
	return fmt.Sprintf("re-claims the addresses of its pods still running as soon as it finds their leases lost, or within half a "+
		"lease TTL (leaseholdd --lease-ttl, default 90s: 45s) for a pod whose keys were deleted while its lease lived, and frees "+
		"the held keys of its pods that are gone (it logs %q)", heldFreedLog)
}

// podKeys is a key of a running pod on a live lease: its pod record, else one of its owner
// indexes.
type podKeys struct {
	key   string
	lease clientv3.LeaseID
	pod   allocator.PodRef
}

// podRuns returns the pod record of v's owner on v's node when it is on a lease, else an owner
// index of that owner on that node on a lease, else nil. A key on a lease is on a live one (etcd
// deletes the keys of a lease that ends), which an agent renews: the pod runs.
func (c *checker) podRuns(v keyspace.HeldRecord) *podKeys {
	if keyspace.ValidateNames("cluster", v.Cluster, "node", v.Node, "owner", v.Owner) != nil {
		return nil
	}
	pk := keyspace.PodKey(v.Cluster, v.Node, v.Owner)
	if p := c.pods[pk]; p != nil && p.Lease != 0 {
		return &podKeys{key: pk, lease: p.Lease, pod: p.Value.Pod}
	}
	if o := c.leasedOwner(pk); o != nil {
		return &podKeys{key: o.Key, lease: o.Lease, pod: c.podRef(o)}
	}
	return nil
}

// leasedOwner is a readable owner index on a lease of the pod whose pod record key is pk, or nil.
func (c *checker) leasedOwner(pk string) *OwnerEntry {
	if c.leasedOwners == nil {
		c.leasedOwners = map[string]*OwnerEntry{}
		for i := range c.st.Owners {
			o := &c.st.Owners[i]
			k := keyspace.PodKey(o.Cluster, o.Value.Node, o.Owner)
			if o.Unreadable == "" && o.Lease != 0 && c.leasedOwners[k] == nil {
				c.leasedOwners[k] = o
			}
		}
	}
	return c.leasedOwners[pk]
}

// runningGroup is the held keys without allocation or owner index of one running pod in one pool.
type runningGroup struct {
	podKeys
	pool              string
	held              keyspace.HeldRecord
	keys, ips, ipKeys []string
}

// runningPodAddrMissing reports a running pod's addresses of which only the held keys are left:
// their allocations and owner index are gone (deleted by hand?). The owner index, which names the
// interface, cannot be rebuilt from etcd; the agent's journal has it. Revoking the pod's lease
// makes the agent re-claim the pod's addresses from it, as after a lost lease: what it does itself
// on finding the keys gone.
func (c *checker) runningPodAddrMissing(g *runningGroup) {
	v := g.held
	lease := keyspace.LeaseHex(g.lease)
	msg := fmt.Sprintf("pod %s (owner %s) on node %s/%s still runs, %s on lease %s, which its agent renews, and uses %s of pool %s, "+
		"but no allocation (%s) and no owner index names them any more (deleted by hand?): only the held keys keep them from other "+
		"pods, and only while the pool has other room. ",
		podName(g.pod), v.Owner, v.Cluster, v.Node, g.key, lease, strings.Join(g.ips, ", "), g.pool, strings.Join(g.ipKeys, ", "))
	msg += AgentPutsBack(v.Node) + fmt.Sprintf(". The owner index, which names the interface, cannot be rebuilt from etcd (the "+
		"agent's journal has it): to have the keys back at once, revoke the pod's lease %s; the agent finds it lost at its next "+
		"renewal (within a third of the lease TTL) and re-claims every address of the pod on a new lease, as it does itself "+
		"(an agent that does not run would let the lease run out anyway)", lease)
	if o := c.leasedOwner(keyspace.PodKey(v.Cluster, v.Node, v.Owner)); o != nil {
		msg += fmt.Sprintf(". Until then the addresses of its other attachments (%s) are held back only, which in a pool with no "+
			"other free address can give one to another pod: there, wait for the agent", o.Key)
	}
	c.tell(g.keys)
	c.add(KindPodAddrMissing, v.Cluster, msg, "etcdctl lease revoke "+lease, append(slices.Clone(g.keys), g.key)...)
}

// nodeBlockLease is the block lease a live agent of cluster/node with node UID uid (any, when
// "") names in its node record, or 0.
func nodeBlockLease(nodes map[string]*NodeEntry, cluster, node, uid string) clientv3.LeaseID {
	if keyspace.ValidateNames("cluster", cluster, "node", node) != nil {
		return 0
	}
	n := nodes[keyspace.NodeKey(cluster, node)]
	if n == nil || n.Unreadable != "" || n.Value.BlockLease == "" || (uid != "" && n.Value.UID != uid) {
		return 0
	}
	id, err := keyspace.ParseLeaseHex(n.Value.BlockLease)
	if err != nil {
		return 0
	}
	return id
}

// heldNoLease reports a held key without lease: it never expires, so its address stays held
// back for good once its pod is gone. It goes back on its node's block lease when a live agent
// of that node names one, else it is deleted (an allocation still holds the address meanwhile).
func (c *checker) heldNoLease(h *HeldEntry, a *AllocationEntry, nodes map[string]*NodeEntry) {
	v := h.Value
	uid := ""
	if a != nil && a.Unreadable == "" && a.Cluster == v.Cluster && a.Node == v.Node {
		uid = a.NodeUID
	}
	msg := fmt.Sprintf("held key of %s in pool %s (node %s/%s, owner %s) has no lease (written with a plain etcdctl put?), so it never "+
		"expires: once its pod is gone, the address stays held back for good, a leak", h.IP, h.Pool, dash(v.Cluster), dash(v.Node), dash(v.Owner))
	if bl := nodeBlockLease(nodes, v.Cluster, v.Node, uid); bl != 0 {
		c.add(KindNoLease, v.Cluster, msg+fmt.Sprintf(". Put it back on the node's block lease %s (its node record names it)", keyspace.LeaseHex(bl)),
			putFix(h.Key, h.Raw, bl, modGuard(h.Key, h.ModRevision)), h.Key)
		return
	}
	c.add(KindNoLease, v.Cluster, msg+". Delete it: an allocation of the address, if any, still holds it while its pod runs",
		txnFix([]string{modGuard(h.Key, h.ModRevision)}, "del "+h.Key), h.Key)
}

// heldOtherHolder reports a held key naming another node or owner than its address's
// allocation: the claim that took the address should have written it. Once that holder's pod
// lease expires (its node cut off), the address would be held back for the wrong node, and
// could go to another pod while the holder's pod still runs.
func (c *checker) heldOtherHolder(h *HeldEntry, a *AllocationEntry, nodes map[string]*NodeEntry) {
	v := h.Value
	msg := fmt.Sprintf("held key of %s in pool %s names node %s/%s and owner %s, but %s holds the address for owner %s (pod %s, "+
		"node %s/%s): the claim that took it should have written its own held key. If node %s is cut off, its pod's address is "+
		"held back for the wrong node and may go to another pod while that pod still runs",
		h.IP, h.Pool, dash(v.Cluster), dash(v.Node), dash(v.Owner), a.Key, dash(a.Owner), podName(a.Pod), dash(a.Cluster), dash(a.Node), dash(a.Node))
	guards := []string{modGuard(h.Key, h.ModRevision), modGuard(a.Key, a.ModRevision)}
	if bl := nodeBlockLease(nodes, a.Cluster, a.Node, a.NodeUID); bl != 0 {
		rec := keyspace.HeldRecord{Cluster: a.Cluster, Node: a.Node, Owner: a.Owner}
		c.add(KindHeldOtherHolder, a.Cluster, msg+fmt.Sprintf(". Write it for the holder, on its node's block lease %s", keyspace.LeaseHex(bl)),
			putFix(h.Key, []byte(keyspace.Encode(rec)), bl, guards...), h.Key, a.Key)
		return
	}
	c.add(KindHeldOtherHolder, a.Cluster, msg+". The holder's node names no block lease, so delete the held key: the allocation "+
		"still holds the address while its pod runs", txnFix(guards, "del "+h.Key), h.Key, a.Key)
}
