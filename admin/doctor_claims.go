package admin

import (
	"fmt"
	"time"

	"github.com/leasehold/leasehold/keyspace"
)

// The doctor's checks of sticky claims (docs/proposals/sticky.md). A healthy claim is held
// (it names a holder whose owner index exists) or released (no holder; its addresses rest in
// quarantine under it), on its claim lease either way.

// claimReleaseFix is the leaseholdctl command that releases cl.
func claimReleaseFix(cl ClaimEntry) string {
	return "leaseholdctl claim release " + ShellQuote(cl.Name) + " --pool " + ShellQuote(cl.Pool) + " --cluster " + ShellQuote(cl.Cluster)
}

// claims checks each claim record: readable, on a lease, of a defined pool, and, while it
// names a holder, that holder's attachment still indexed.
func (c *checker) claims() {
	owners := map[string]bool{}
	for _, o := range c.st.Owners {
		owners[o.Key] = true
	}
	for _, cl := range c.st.Claims {
		if cl.Unreadable != "" {
			c.add(KindUnreadable, cl.Cluster, fmt.Sprintf("claim record is unreadable (%s): no agent can tell which addresses claim %s keeps "+
				"or who holds it. Delete it; addresses resting in quarantine under it return to the pool when their lease runs out",
				cl.Unreadable, cl.Name), delFix(cl.Key), cl.Key)
			continue
		}
		v := cl.Value
		if cl.Lease == 0 {
			c.add(KindNoLease, cl.Cluster, fmt.Sprintf("claim record has no lease (written with a plain etcdctl put?), so it never expires: "+
				"%s stay promised to claim %s for good, however long nobody holds it. Release it (its addresses resting in "+
				"quarantine return to the pool through ordinary quarantine; a pod holding them keeps them)", ipsText(v.IPs), cl.Name),
				claimReleaseFix(cl), cl.Key)
		}
		pk := keyspace.PoolKey(cl.Pool)
		if _, defined := c.pools[cl.Pool]; !defined && c.st.Covers(pk) {
			c.note(SeverityWarning, KindClaimPoolUndefined, cl.Cluster, fmt.Sprintf("claim %s keeps %s in pool %s, which has no definition "+
				"(%s): every ADD of the pool, the claim's next holder's included, is refused until it is defined again. If the pool "+
				"is to come back, define it (leaseholdctl pool create); if it is gone for good, release the claim",
				cl.Name, ipsText(v.IPs), cl.Pool, pk), claimReleaseFix(cl), cl.Key)
		}
		h := v.Holder
		if h == nil {
			continue
		}
		ok := keyspace.OwnerKey(cl.Cluster, h.Owner, h.IfName, cl.Pool)
		if owners[ok] || !c.st.Covers(ok) {
			continue
		}
		until := fmt.Sprintf("until its lease %s runs out (%s after its agent's last renewal)", keyspace.LeaseHex(cl.Lease),
			time.Duration(v.HoldSeconds)*time.Second)
		if cl.Lease == 0 {
			until = "for good: it has no lease (see its no-lease finding)"
		}
		c.note(SeverityInfo, KindClaimHolderGone, cl.Cluster, fmt.Sprintf("claim %s of pool %s names holder owner %s (pod %s, node %s, "+
			"container %s, interface %s), whose owner index %s is gone: its attachment went without releasing the claim (its node "+
			"died, or an admin released the addresses). The claim stays %s; meanwhile the next attachment naming it takes %s once free. Nothing to do",
			cl.Name, cl.Pool, dash(h.Owner), podName(h.Pod), dash(h.Node), short(h.ContainerID), dash(h.IfName), ok,
			until, ipsText(v.IPs)), "", cl.Key)
	}
}
