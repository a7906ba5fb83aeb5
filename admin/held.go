package admin

import (
	"context"
	"net/netip"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Held keys (issue 23, "expired is not free"). An agent writes held/<pool>/<block>/<ip> in the
// transaction of each allocation, on its node's block lease, and deletes it with the release.
// The block lease outlives the pod leases by the reuse delay (leaseholdd --reuse-delay), so:
//
//   - allocation and held key: normal;
//   - held key without allocation: an expired address. Its pod's lease ran out without a
//     release (its node is cut off from etcd or dead). Agents hand it to another pod only when
//     the pool has no other room, until the held key's lease expires: then it is reusable. The
//     node's agent, back in time, re-claims it if its pod still runs, or frees it (AgentBack).
//     Unless its pod still runs now (its pod record or an owner index on a live lease): then
//     etcd lost the pod's keys (deleted by hand, or with a restore of etcd), an error the
//     agent repairs by itself (AgentPutsBack); HeldFindings tells the two apart, as doctor;
//   - a block claim of a node whose agent is gone lives as long, on the same lease: an expired
//     block, reusable when its lease expires.
//
// leaseholdctl node forget (ForgetNode) frees both at once once a node is really gone.

// Agent states of a node named by a held key or a block claim (State.AgentOf).
const (
	// AgentLive: a node record of the node exists (of the node UID asked for, when one is).
	AgentLive = "live"
	// AgentGone: no node record: the agent stopped, or the node died or is cut off from etcd.
	AgentGone = "gone"
	// AgentReplaced: the node record is of another node UID: the node was replaced, and the old
	// identity renews and re-claims nothing.
	AgentReplaced = "replaced"
	// AgentUnknown: the state did not read the node record.
	AgentUnknown = "unknown"
)

// nodeIndex indexes the node records of st by key.
func (st *State) nodeIndex() map[string]*NodeEntry {
	m := make(map[string]*NodeEntry, len(st.Nodes))
	for i := range st.Nodes {
		m[st.Nodes[i].Key] = &st.Nodes[i]
	}
	return m
}

// AgentOf says whether the agent of node cluster/node runs, from the node records of st: one of
// AgentLive, AgentGone, AgentReplaced (only when uid is given and the record names another) or
// AgentUnknown. An unreadable node record counts as live: something renews it.
func (st *State) AgentOf(cluster, node, uid string) string {
	return agentOf(st, st.nodeIndex(), cluster, node, uid)
}

func agentOf(st *State, nodes map[string]*NodeEntry, cluster, node, uid string) string {
	if keyspace.ValidateNames("cluster", cluster, "node", node) != nil {
		return AgentUnknown
	}
	nk := keyspace.NodeKey(cluster, node)
	n := nodes[nk]
	switch {
	case n == nil && !st.Covers(nk):
		return AgentUnknown
	case n == nil:
		return AgentGone
	case uid != "" && n.Unreadable == "" && n.Value.UID != uid:
		return AgentReplaced
	}
	return AgentLive
}

// Expired returns the held keys of st whose address has no allocation in their pool, in either
// layout: expired addresses, held back for the node the key names until its lease (Record.Lease)
// expires. Only held keys whose allocation key st read are considered, so a narrow read reports
// nothing expired that it did not look for. Unreadable held keys are included.
func (st *State) Expired() []HeldEntry {
	allocated := map[poolAddr]bool{}
	for _, a := range st.Allocations {
		allocated[poolAddr{a.Pool, a.IP}] = true
	}
	var out []HeldEntry
	for _, h := range st.Held {
		if !allocated[poolAddr{h.Pool, h.IP}] && st.Covers(spell(keyspace.IPsPrefix(h.Pool), h.Block, h.IP)) {
			out = append(out, h)
		}
	}
	return out
}

// ExpiredBlocks returns the readable block claims of st whose node's agent is gone or was
// replaced (AgentOf): expired blocks, their node's until their lease expires. Claims without a
// lease are left out (doctor reports them: they never expire).
func (st *State) ExpiredBlocks() []BlockEntry {
	nodes := st.nodeIndex()
	var out []BlockEntry
	for _, b := range st.Blocks {
		if b.Unreadable != "" || b.Lease == 0 {
			continue
		}
		if s := agentOf(st, nodes, b.Value.Cluster, b.Value.Node, b.Value.NodeUID); s == AgentGone || s == AgentReplaced {
			out = append(out, b)
		}
	}
	return out
}

// HeldAt returns the held keys of ip in pool that st holds (in either layout).
func (st *State) HeldAt(pool string, ip netip.Addr) []HeldEntry {
	var out []HeldEntry
	for _, h := range st.Held {
		if h.Pool == pool && h.IP == ip {
			out = append(out, h)
		}
	}
	return out
}

// LeaseTTLs asks etcd for the TTL left of each distinct lease of ids, one request per lease
// (lease 0 and repeats cost none): how long an expired address or block has before it is
// reusable. A lease etcd no longer has is TTL -1.
func LeaseTTLs(ctx context.Context, cli *clientv3.Client, ids ...clientv3.LeaseID) (map[clientv3.LeaseID]LeaseTTL, error) {
	out := map[clientv3.LeaseID]LeaseTTL{}
	for _, id := range ids {
		if _, done := out[id]; done {
			continue
		}
		ttl, err := TimeToLive(ctx, cli, id)
		if err != nil {
			return nil, err
		}
		out[id] = ttl
	}
	return out, nil
}

// heldCandidates are the keys that may hold ip's held key, the layout's own first (as
// candidates does for the allocation key).
func (l layout) heldCandidates(ip netip.Addr) []string {
	flat := keyspace.HeldKey(l.pool, allocator.Blocks{}, ip)
	switch {
	case !l.known:
		return []string{flat, keyspace.HeldKey(l.pool, allocator.DefaultBlocks, ip)}
	case l.blocks.Flat():
		return []string{flat}
	}
	return []string{keyspace.HeldKey(l.pool, l.blocks, ip), flat}
}
