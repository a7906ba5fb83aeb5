package admin

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The doctor's checks of the block layout (docs/proposals/blocks.md): pools still flat or
// frozen by a migration, block claims that fit no block of their pool or outlive their node,
// keys in the wrong layout, and allocations in blocks nobody claims.

// poolLayouts reports pools frozen by an unfinished migration, and pools still flat.
func (c *checker) poolLayouts() {
	for _, p := range c.st.Pools {
		switch {
		case !p.Usable():
		case p.Migrating != nil:
			c.note(SeverityWarning, KindPoolMigrating, "", fmt.Sprintf("pool %s is frozen by leaseholdctl pool migrate (by %s, since %s): "+
				"every ADD of the pool has been refused since then. Run it again: it resumes where it stopped, moves the keys still in "+
				"the flat layout to their blocks, and unfreezes the pool", p.Name, dash(p.Migrating.By), p.Migrating.Since.UTC().Format(time.RFC3339)),
				"leaseholdctl pool migrate "+p.Name, p.Key)
		case p.Value.Blocks.Flat():
			c.note(SeverityInfo, KindPoolFlat, "", fmt.Sprintf("pool %s is in the flat layout: every agent serving it is sent every "+
				"allocation and release of the whole pool. Once every agent serves blocks (leaseholdd of the block release; pool "+
				"migrate refuses while an older one runs), move it to blocks", p.Name), "leaseholdctl pool migrate "+p.Name, p.Key)
		}
	}
}

// blockClaims checks each readable block claim against its pool and its node. Unreadable
// claims and claims without lease are leasedRecords' findings.
func (c *checker) blockClaims() {
	nodes := map[string]*NodeEntry{}
	for i := range c.st.Nodes {
		nodes[c.st.Nodes[i].Key] = &c.st.Nodes[i]
	}
	for _, b := range c.st.Blocks {
		if b.Unreadable != "" {
			continue
		}
		v := b.Value
		p, defined := c.pools[b.Pool]
		invalid := ""
		switch {
		case !defined && c.st.Covers(keyspace.PoolKey(b.Pool)):
			invalid = "pool " + b.Pool + " has no definition (" + keyspace.PoolKey(b.Pool) + ")"
		case !defined || !p.Usable():
		case p.Value.Blocks.Flat():
			invalid = "pool " + b.Pool + " is in the flat layout: it has no blocks"
		case b.Block.Bits() != p.Value.Blocks.Bits(b.Block.Addr()):
			invalid = fmt.Sprintf("the pool's blocks are /%d, this one is /%d", p.Value.Blocks.Bits(b.Block.Addr()), b.Block.Bits())
		case keyspace.ValidateNames("cluster", v.Cluster, "node", v.Node) != nil:
			invalid = fmt.Sprintf("it names no valid node (cluster %q, node %q)", v.Cluster, v.Node)
		}
		if invalid != "" {
			c.note(SeverityWarning, KindBlockInvalid, v.Cluster, fmt.Sprintf("block claim of %s (node %s/%s, lease %s) is no block of its pool: %s. No agent "+
				"allocates by it; delete it (an address's own key is what holds it, so no allocation changes)",
				b.Block, dash(v.Cluster), dash(v.Node), keyspace.LeaseHex(b.Lease), invalid), delFix(b.Key), b.Key)
			continue
		}
		nk := keyspace.NodeKey(v.Cluster, v.Node)
		if b.Lease == 0 || !c.st.Covers(nk) {
			continue
		}
		n := nodes[nk]
		why := ""
		switch {
		case n == nil:
			why = "has no node record (" + nk + "): its agent stopped or the node died"
		case n.Unreadable == "" && n.Value.UID != v.NodeUID:
			why = fmt.Sprintf("now runs with node UID %s, not %s: the node was replaced, and the old identity renews nothing", n.Value.UID, dash(v.NodeUID))
		}
		if why == "" {
			continue
		}
		free, fix := "run node forget, which frees the node's held addresses too", forgetFix(v.Cluster, v.Node)
		if n != nil {
			// node forget refuses while the node's name has a live agent; the old identity's block
			// lease carries only its block claims and its pods' held keys.
			free = fmt.Sprintf("revoke the lease (etcdctl lease timetolive %s --keys lists what it carries)", keyspace.LeaseHex(b.Lease))
			fix = "etcdctl lease revoke " + keyspace.LeaseHex(b.Lease)
		}
		c.note(SeverityInfo, KindBlockStale, v.Cluster, fmt.Sprintf("block %s of pool %s is claimed by node %s/%s (node UID %s), which %s: "+
			"an expired block. The claim goes when block lease %s expires, the reuse delay (leaseholdd --reuse-delay, default 15m) "+
			"after the node's pods' leases; its agent back in time adopts it again. Meanwhile other nodes only borrow its free "+
			"addresses (leaseholdctl pool show %s says when it is reusable). To free it at once, once sure the node is gone for good, %s",
			b.Block, b.Pool, v.Cluster, v.Node, dash(v.NodeUID), why, keyspace.LeaseHex(b.Lease), b.Pool, free), fix, b.Key)
	}
}

// layoutKey is one allocation or quarantine key, as keyLayouts checks it.
type layoutKey struct {
	what, key, pool, cluster string
	dir                      string // the pool's allocation or quarantine prefix
	block                    netip.Prefix
	ip                       netip.Addr
	lease                    clientv3.LeaseID
	modRev                   int64
	raw                      []byte
}

// keyLayouts reports allocation and quarantine keys that are not where their pool's stored
// definition puts the address: agents compare only that key, so a key elsewhere protects
// nothing and may give its address a second holder.
func (c *checker) keyLayouts() {
	var keys []layoutKey
	exists := map[string]bool{}
	for _, a := range c.st.Allocations {
		exists[a.Key] = true
		keys = append(keys, layoutKey{"allocation", a.Key, a.Pool, a.Cluster, keyspace.IPsPrefix(a.Pool), a.Block, a.IP, a.BoundLease, a.ModRevision, a.Raw})
	}
	for _, q := range c.st.Quarantine {
		exists[q.Key] = true
		keys = append(keys, layoutKey{"quarantine key", q.Key, q.Pool, "", keyspace.QuarantinePrefix(q.Pool), q.Block, q.IP, q.Lease, q.ModRevision, q.Raw})
	}
	for _, h := range c.st.Held {
		exists[h.Key] = true
		keys = append(keys, layoutKey{"held key", h.Key, h.Pool, h.Value.Cluster, keyspace.HeldPrefix(h.Pool), h.Block, h.IP, h.Lease, h.ModRevision, h.Raw})
	}
	for _, k := range keys {
		p, ok := c.pools[k.pool]
		if !ok || !p.Usable() {
			continue // pool-undefined and pool-invalid say what to do first
		}
		want := p.Value.Blocks.Of(k.ip)
		if k.block == want || (p.Migrating != nil && !k.block.IsValid()) {
			continue // a migration moves flat keys: pool-migrating reports it
		}
		right := spell(k.dir, want, k.ip)
		where := "the flat layout"
		if k.block.IsValid() {
			where = "block " + k.block.String()
		}
		msg := fmt.Sprintf("%s of %s is in %s, but pool %s %s, so its key is %s: agents compare only that key", k.what, k.ip, where,
			k.pool, layoutText(p.Value.Blocks), right)
		var fix string
		risk := ", and may give the address to a second holder"
		if k.what == "held key" {
			risk = ", so it holds the address back for nobody once its pod's lease expires"
		}
		switch {
		case exists[right]:
			msg += "; that key exists too, so this one protects nothing. Delete it (if it was another attachment's, doctor then " +
				"names the pod to recreate)"
			fix = delFix(k.key)
		case !k.block.IsValid():
			msg += risk + ". Move the pool's flat keys to their blocks"
			fix = "leaseholdctl pool migrate " + k.pool
		default:
			msg += risk + ". Move it there, keeping value and lease"
			fix = moveFix(k.key, right, k.raw, k.lease, k.modRev)
		}
		c.add(KindWrongLayout, k.cluster, msg, fix, k.key)
	}
}

// unclaimedBlocks reports allocations, in the right block, of blocks no node claims and whose
// node's agent is gone (no node record, or one of another node UID): normal for a while after
// a node died, since they expire with their pods' leases and the block is then free to claim.
// Info, nothing to do. An allocation of a live node in an unclaimed block is a static address
// the pod asked for, claimed where it lies: not reported.
func (c *checker) unclaimedBlocks() {
	claimed := map[string]bool{}
	for _, b := range c.st.Blocks {
		claimed[b.Key] = true
	}
	nodes := map[string]*NodeEntry{}
	for i := range c.st.Nodes {
		nodes[c.st.Nodes[i].Key] = &c.st.Nodes[i]
	}
	type group struct {
		keys  []string
		nodes map[string]bool
	}
	groups := map[string]*group{}
	for _, a := range c.st.Allocations {
		p, ok := c.pools[a.Pool]
		if !ok || !p.Usable() || !a.Block.IsValid() || a.Block != p.Value.Blocks.Of(a.IP) || a.Unreadable != "" ||
			keyspace.ValidateNames("cluster", a.Cluster, "node", a.Node) != nil {
			continue
		}
		bk, nk := keyspace.BlockKey(a.Pool, a.Block), keyspace.NodeKey(a.Cluster, a.Node)
		if claimed[bk] || !c.st.Covers(bk) || !c.st.Covers(nk) {
			continue
		}
		if n := nodes[nk]; n != nil && (n.Unreadable != "" || n.Value.UID == a.NodeUID) {
			continue // a live agent's static address
		}
		g := groups[bk]
		if g == nil {
			g = &group{nodes: map[string]bool{}}
			groups[bk] = g
		}
		g.keys = append(g.keys, a.Key)
		g.nodes[a.Cluster+"/"+a.Node] = true
	}
	for _, bk := range slices.Sorted(maps.Keys(groups)) {
		g := groups[bk]
		pool, block, _ := keyspace.ParseBlockKey(bk)
		c.note(SeverityInfo, KindUnclaimedBlock, "", fmt.Sprintf("%d allocation(s) in block %s of pool %s, which no node claims (no %s), held "+
			"by node(s) %s, whose agent is gone: normal for a while after a node died. They expire with their pods' leases, and the "+
			"block is then free to claim. Nothing to do", len(g.keys), block, pool, bk, strings.Join(slices.Sorted(maps.Keys(g.nodes)), ", ")),
			"", g.keys...)
	}
}

// layoutText says how a pool lays out its keys, for messages.
func layoutText(b allocator.Blocks) string {
	if b.Flat() {
		return "is in the flat layout"
	}
	return fmt.Sprintf("has blocks of /%d (IPv4) and /%d (IPv6)", b.IPv4, b.IPv6)
}

// blockFlags are the pool create flags that give an undefined pool the block lengths its keys
// have, when they are not the defaults.
func blockFlags(list []*AllocationEntry) string {
	var v4, v6 int
	for _, a := range list {
		switch {
		case !a.Block.IsValid():
		case a.IP.Is4():
			v4 = a.Block.Bits()
		default:
			v6 = a.Block.Bits()
		}
	}
	s := ""
	if v4 != 0 && v4 != allocator.DefaultBlocks.IPv4 {
		s += " --block-v4 " + strconv.Itoa(v4)
	}
	if v6 != 0 && v6 != allocator.DefaultBlocks.IPv6 {
		s += " --block-v6 " + strconv.Itoa(v6)
	}
	return s
}
