package admin

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/leasehold/leasehold/keyspace"
)

// The doctor's checks of live migrations (issue 35, docs/proposals/live-migration.md). A
// healthy migration key lies on its target's pod lease, beside a migratable claim record whose
// holder (the source) is alive on another node; each of the claim's addresses is allocated to
// the holder, and used by the target too.

// targetOf is the live migration naming o's attachment as its target, or nil.
func (c *checker) targetOf(o *OwnerEntry) *LiveMigrationEntry {
	for i := range c.st.LiveMigrations {
		m := &c.st.LiveMigrations[i]
		t := m.Value.Target
		if m.Unreadable == "" && m.Cluster == o.Cluster && m.Pool == o.Pool && t.Owner == o.Owner && t.IfName == o.IfName {
			return m
		}
	}
	return nil
}

// migrationUses reports whether o is a live migration's target and a, the allocation of ip
// (nil: none), is as the migration leaves it: the claim's holder's, or, between the holder's
// expiry and the target's promotion (live-migration-orphan says so), absent.
func (c *checker) migrationUses(o *OwnerEntry, ip netip.Addr, a *AllocationEntry) bool {
	m := c.targetOf(o)
	if m == nil {
		return false
	}
	cl := c.claimOf(m)
	if cl == nil || cl.Unreadable != "" || !containsAddr(cl.Value.IPs, ip) {
		return false
	}
	if a == nil {
		return true
	}
	h := cl.Value.Holder
	return h != nil && a.Unreadable == "" && a.Cluster == cl.Cluster && a.Owner == h.Owner && a.IfName == h.IfName
}

// claimOf is the claim record m belongs to, if the state read one.
func (c *checker) claimOf(m *LiveMigrationEntry) *ClaimEntry {
	key := keyspace.ClaimKey(m.Cluster, m.Pool, m.Claim)
	for i := range c.st.Claims {
		if c.st.Claims[i].Key == key {
			return &c.st.Claims[i]
		}
	}
	return nil
}

func containsAddr(ips []netip.Addr, ip netip.Addr) bool {
	for _, x := range ips {
		if x.Unmap() == ip {
			return true
		}
	}
	return false
}

// deleteTargetFix deletes m's target pod when the migration key names one (its DEL ends the
// migration as a failed one: the source keeps everything), else the key itself, compared.
func deleteTargetFix(m *LiveMigrationEntry) string {
	if p := m.Value.Target.Pod; m.Unreadable == "" && p.Name != "" {
		return "kubectl delete pod -n " + ShellQuote(p.Namespace) + " " + ShellQuote(p.Name)
	}
	return txnFix([]string{modGuard(m.Key, m.ModRevision)}, "del "+m.Key)
}

// liveMigrations checks each live migration key, and every claim being migrated or held by a
// live holder for allocations of its addresses by a third owner.
func (c *checker) liveMigrations() {
	for i := range c.st.LiveMigrations {
		c.liveMigration(&c.st.LiveMigrations[i])
	}
	for i := range c.st.Claims {
		c.foreignOwners(&c.st.Claims[i])
	}
	c.oldAgents()
}

// oldAgents reports each live agent that predates live migrations (its node record has no
// LiveMigration mark) in a cluster with a migratable claim or a live migration key: such an
// agent compares no migration key, so its DEL of a migrating claim's holder (the source)
// would release the addresses the target uses. Unreadable node records are reported as such.
func (c *checker) oldAgents() {
	type use struct {
		claims, migrations int
		first              string // the first key of either, the finding's second key
		text               string // what the first says, for the message
	}
	uses := map[string]*use{}
	useOf := func(cluster, key, text string) *use {
		u := uses[cluster]
		if u == nil {
			u = &use{first: key, text: text}
			uses[cluster] = u
		}
		return u
	}
	for _, cl := range c.st.Claims {
		if cl.Unreadable == "" && cl.Value.Migratable {
			useOf(cl.Cluster, cl.Key, fmt.Sprintf("claim %s of pool %s", cl.Name, cl.Pool)).claims++
		}
	}
	for _, m := range c.st.LiveMigrations {
		useOf(m.Cluster, m.Key, fmt.Sprintf("the live migration of claim %s of pool %s", m.Claim, m.Pool)).migrations++
	}
	for _, n := range c.st.Nodes {
		u := uses[n.Cluster]
		if u == nil || n.Unreadable != "" || n.Value.LiveMigration {
			continue
		}
		v := n.Value
		c.note(SeverityWarning, KindLiveMigrationOldAgent, n.Cluster, fmt.Sprintf("the agent of node %s (version %s, host %s, started %s) "+
			"predates live migrations (its node record has no liveMigration mark), while cluster %s has %d migratable claim(s) and %d "+
			"live migration(s) (%s). That agent compares no live migration key: a DEL of a migrating VM's source pod on node %s "+
			"would release the claim's addresses while the target pod uses them. Upgrade the agent of node %s before marking "+
			"claims migratable and before migrating VMs to or from it", n.Node, dash(v.Version), dash(v.Host),
			v.Started.UTC().Format(time.RFC3339), n.Cluster, u.claims, u.migrations, u.text, n.Node, n.Node),
			"leaseholdctl node list --cluster "+ShellQuote(n.Cluster), n.Key, u.first)
	}
}

func (c *checker) liveMigration(m *LiveMigrationEntry) {
	switch {
	case m.Unreadable != "":
		c.add(KindUnreadable, m.Cluster, fmt.Sprintf("live migration key is unreadable (%s): nobody can tell which pod migrates claim %s. "+
			"Delete it: the target's agent writes it again while the migration runs", m.Unreadable, m.Claim), delFix(m.Key), m.Key)
		return
	case m.Lease == 0:
		c.add(KindNoLease, m.Cluster, fmt.Sprintf("live migration key has no lease (written with a plain etcdctl put?), so it outlives its "+
			"target %s, and claim %s stays migrating for good. Delete it: the target's agent writes it again on its pod lease while "+
			"the migration runs", m.TargetText(), m.Claim), txnFix([]string{modGuard(m.Key, m.ModRevision)}, "del "+m.Key), m.Key)
		return
	}
	ck := keyspace.ClaimKey(m.Cluster, m.Pool, m.Claim)
	if !c.st.Covers(ck) {
		return
	}
	cl := c.claimOf(m)
	if cl != nil && cl.Unreadable != "" {
		return // the claim's own unreadable finding says it
	}
	t := m.Value.Target
	age := m.Age(c.now).Round(time.Second)
	var h *keyspace.ClaimHolder
	if cl != nil {
		h = cl.Value.Holder
	}
	holderAlive := false
	if h != nil {
		hk := keyspace.OwnerKey(m.Cluster, h.Owner, h.IfName, m.Pool)
		holderAlive = c.ownerKeys[hk] || !c.st.Covers(hk)
	}
	switch {
	case cl == nil || h == nil || !holderAlive:
		why := "there is no claim record " + ck
		if cl != nil && h == nil {
			why = "claim " + m.Claim + " names no holder (it was released)"
		} else if cl != nil {
			why = fmt.Sprintf("the claim's holder, pod %s on node %s, has no owner index any more (its node died, or its lease ran out)",
				podName(h.Pod), dash(h.Node))
		}
		c.note(SeverityWarning, KindLiveMigrationOrphan, m.Cluster, fmt.Sprintf("live migration of claim %s of pool %s to %s, started %s ago, "+
			"has no source: %s. Right after a holder's node dies this is normal: the target's agent takes the claim's addresses over "+
			"within half a lease TTL (leaseholdd --lease-ttl). A finding that stays means the target's agent is not running or cannot "+
			"reach etcd: look at node %s. Deleting the target pod ends it", m.Claim, m.Pool, m.TargetText(), age, why, dash(t.Node)),
			deleteTargetFix(m), m.Key, ck)
	case !cl.Value.Migratable:
		c.add(KindLiveMigrationNotAllowed, m.Cluster, fmt.Sprintf("live migration of claim %s of pool %s to %s, but the claim is not "+
			"migratable: no agent starts such a migration (a hand edit?), and two pods use %s, held by pod %s on node %s. Delete the "+
			"target pod (its DEL ends the migration; the holder keeps the addresses)", m.Claim, m.Pool, m.TargetText(),
			ipsText(cl.Value.IPs), podName(h.Pod), dash(h.Node)), deleteTargetFix(m), m.Key, ck)
	case t.Node == h.Node:
		c.add(KindLiveMigrationSameNode, m.Cluster, fmt.Sprintf("live migration of claim %s of pool %s to %s, on the holder's own node: "+
			"holder pod %s is on node %s too. No agent starts such a migration (a hand edit?), and two pods on one node use %s. "+
			"Delete the target pod (its DEL ends the migration; the holder keeps the addresses)", m.Claim, m.Pool, m.TargetText(),
			podName(h.Pod), dash(h.Node), ipsText(cl.Value.IPs)), deleteTargetFix(m), m.Key, ck)
	case age > c.bound:
		c.note(SeverityWarning, KindLiveMigrationTooOld, m.Cluster, fmt.Sprintf("live migration of claim %s of pool %s from pod %s on node %s "+
			"to %s has run for %s (since %s), longer than the bound %s (--live-migration-bound): KubeVirt has not finished it. Both "+
			"pods use %s meanwhile. Look at the VM's migration; the source pod's DEL completes it, the target pod's DEL fails it",
			m.Claim, m.Pool, podName(h.Pod), dash(h.Node), m.TargetText(), age, sinceText(*m), c.bound, ipsText(cl.Value.IPs)),
			"kubectl get virtualmachineinstancemigrations.kubevirt.io -A", m.Key, ck)
	default:
		c.note(SeverityInfo, KindLiveMigration, m.Cluster, fmt.Sprintf("live migration of claim %s of pool %s from pod %s on node %s to %s, "+
			"for %s (since %s; bound %s): both pods use %s until the source's DEL (completed: the target holds them) or the target's "+
			"(failed: the source keeps them)", m.Claim, m.Pool, podName(h.Pod), dash(h.Node), m.TargetText(), age, sinceText(*m),
			c.bound, ipsText(cl.Value.IPs)), "", m.Key, ck)
	}
}

// foreignOwners reports allocations of cl's addresses owned by neither its holder nor its
// migration's target, while either is alive: a third pod uses an address the claim keeps for
// its own. A claim whose holder is gone and that no migration names is left alone: its
// addresses go to the next attachment once free (claim-holder-gone).
func (c *checker) foreignOwners(cl *ClaimEntry) {
	if cl.Unreadable != "" || cl.Value.Holder == nil {
		return
	}
	h := cl.Value.Holder
	m := cl.Migration
	if m != nil && m.Unreadable != "" {
		m = nil
	}
	hk := keyspace.OwnerKey(cl.Cluster, h.Owner, h.IfName, cl.Pool)
	if m == nil && !c.ownerKeys[hk] {
		return
	}
	for _, ip := range cl.Value.IPs {
		ip = ip.Unmap()
		a := c.allocAt(cl.Pool, ip)
		if a == nil || a.Unreadable != "" || a.Cluster == cl.Cluster && (a.Owner == h.Owner || m != nil && a.Owner == m.Value.Target.Owner) {
			continue
		}
		users := fmt.Sprintf("its holder pod %s on node %s", podName(h.Pod), dash(h.Node))
		if m != nil {
			users += " and its migration target " + m.TargetText()
		}
		fix := releaseFix(ip, a.Pool, a.BoundLease)
		if a.Pod.Name != "" {
			fix = "kubectl delete pod -n " + ShellQuote(a.Pod.Namespace) + " " + ShellQuote(a.Pod.Name)
		}
		c.add(KindClaimForeignOwner, cl.Cluster, fmt.Sprintf("%s of claim %s (pool %s) is allocated to owner %s (cluster %s, pod %s, node %s) by "+
			"%s, while %s use it: two pods have one address. Recreate the other pod (its DEL releases only what it holds); the "+
			"claim's pods get the address back through their agents", ip, cl.Name, cl.Pool, dash(a.Owner), dash(a.Cluster), podName(a.Pod),
			dash(a.Node), a.Key, users), fix, a.Key, cl.Key)
	}
}
