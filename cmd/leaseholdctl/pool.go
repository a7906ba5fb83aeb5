package main

import (
	"context"
	"fmt"
	"math/big"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// counts is how much of a range, or of a range set, is taken. An address counts once: as
// allocated, else as quarantined, else as used by a host, else as expired (a held key without
// allocation: held back for its node, issue 23); only addresses the pool can hand out are
// counted, so free = size - allocated - quarantined - hosts - expired. An expired address still
// goes to an ADD that finds nothing free. The count of expired addresses includes those of
// pods still running whose keys etcd lost (issue 32), held back all the same: pool show tells
// them apart (poolJSON.KeysLost).
type counts struct {
	size                                   *big.Int
	allocated, quarantined, hosts, expired int
}

func (c counts) free() *big.Int {
	n := new(big.Int).Set(c.size)
	return n.Sub(n, big.NewInt(int64(c.allocated+c.quarantined+c.hosts+c.expired)))
}

func (c *counts) add(o counts) {
	if c.size == nil {
		c.size = new(big.Int)
	}
	c.size.Add(c.size, o.size)
	c.allocated += o.allocated
	c.quarantined += o.quarantined
	c.hosts += o.hosts
	c.expired += o.expired
}

// poolUsage is one pool's counts per range, from one state read.
type poolUsage struct {
	entry     admin.PoolEntry
	spec      allocator.PoolSpec
	ranges    [][]counts // [set][range]
	allocated int        // every allocation key of the pool
	outside   int        // allocations no range of the pool hands out (doctor reports them)
	holders   map[string]*holder
	claims    []admin.BlockEntry
	// expired are the pool's held keys without allocation; expiredBlocks its block claims of
	// nodes whose agent is gone or was replaced (issue 23).
	expired       []admin.HeldEntry
	expiredBlocks []admin.BlockEntry
	agents        map[string]string // agent state (admin.Agent*) by block claim key
	// told is what doctor finds of the addresses of expired (admin.HeldFindings), by held key:
	// pool show only, to tell a running pod's address whose keys etcd lost from an expired one.
	told map[string]admin.Finding
}

// expiry is what st holds back for nodes cut off or gone, by pool: computed once for every pool.
type expiry struct {
	st     *admin.State
	held   map[string][]admin.HeldEntry
	blocks map[string][]admin.BlockEntry
}

func expiryOf(st *admin.State) *expiry {
	x := &expiry{st: st, held: map[string][]admin.HeldEntry{}, blocks: map[string][]admin.BlockEntry{}}
	for _, h := range st.Expired() {
		x.held[h.Pool] = append(x.held[h.Pool], h)
	}
	for _, b := range st.ExpiredBlocks() {
		x.blocks[b.Pool] = append(x.blocks[b.Pool], b)
	}
	return x
}

type holder struct {
	nodes     map[string]bool
	allocated int
}

// handedOut returns the set and range of spec that hand out ip.
func handedOut(spec allocator.PoolSpec, ip netip.Addr) (int, int, bool) {
	if spec.Allocatable(ip) != nil {
		return 0, 0, false
	}
	return spec.Locate(ip)
}

func usageOf(st *admin.State, p admin.PoolEntry, x *expiry) *poolUsage {
	spec := p.Value
	u := &poolUsage{entry: p, spec: spec, holders: map[string]*holder{}, expired: x.held[spec.Name], expiredBlocks: x.blocks[spec.Name],
		agents: map[string]string{}}
	for _, b := range u.expiredBlocks {
		u.agents[b.Key] = st.AgentOf(b.Value.Cluster, b.Value.Node, b.Value.NodeUID)
	}
	for _, b := range st.Blocks {
		if b.Pool == spec.Name {
			u.claims = append(u.claims, b)
		}
	}
	sort.Slice(u.claims, func(i, j int) bool { return u.claims[i].Block.Addr().Less(u.claims[j].Block.Addr()) })
	for i, s := range spec.Ranges {
		u.ranges = append(u.ranges, make([]counts, len(s)))
		for j := range s {
			u.ranges[i][j].size = spec.RangeSize(i, j)
		}
	}
	taken := map[netip.Addr]bool{}
	for _, a := range st.Allocations {
		if a.Pool != spec.Name {
			continue
		}
		u.allocated++
		h := u.holders[a.Cluster]
		if h == nil {
			h = &holder{nodes: map[string]bool{}}
			u.holders[a.Cluster] = h
		}
		h.allocated++
		h.nodes[a.Node] = true
		taken[a.IP] = true
		if i, j, ok := handedOut(spec, a.IP); ok {
			u.ranges[i][j].allocated++
		} else {
			u.outside++
		}
	}
	for _, q := range st.Quarantine {
		if i, j, ok := handedOut(spec, q.IP); ok && q.Pool == spec.Name && !taken[q.IP] {
			taken[q.IP] = true
			u.ranges[i][j].quarantined++
		}
	}
	for _, h := range st.HostIPs {
		if i, j, ok := handedOut(spec, h.IP); ok && !taken[h.IP] {
			taken[h.IP] = true
			u.ranges[i][j].hosts++
		}
	}
	for _, h := range u.expired {
		if i, j, ok := handedOut(spec, h.IP); ok && !taken[h.IP] {
			taken[h.IP] = true
			u.ranges[i][j].expired++
		}
	}
	return u
}

func (u *poolUsage) set(i int) counts {
	var c counts
	for _, rc := range u.ranges[i] {
		c.add(rc)
	}
	return c
}

// JSON shapes of pool list and pool show; field names are stable.
type countsJSON struct {
	Size        string `json:"size"` // decimal: IPv6 sizes exceed 64 bits
	Allocated   int    `json:"allocated"`
	Quarantined int    `json:"quarantined"`
	Hosts       int    `json:"hosts"`
	// Expired counts addresses held back for a node cut off or gone (issue 23): not free, but
	// handed out when nothing else is. It includes the addresses of pods still running whose
	// keys etcd lost (pool show's keysLost), held back the same way.
	Expired int    `json:"expired"`
	Free    string `json:"free"`
}

type rangeJSON struct {
	Subnet  netip.Prefix `json:"subnet"`
	Start   netip.Addr   `json:"start"`
	End     netip.Addr   `json:"end"`
	Gateway netip.Addr   `json:"gateway"`
	countsJSON
}

type setJSON struct {
	Set    int         `json:"set"`
	Family int         `json:"family"`
	Ranges []rangeJSON `json:"ranges"`
	countsJSON
}

type holderJSON struct {
	Cluster   string `json:"cluster"`
	Nodes     int    `json:"nodes"`
	Allocated int    `json:"allocated"`
}

type poolJSON struct {
	Name       string         `json:"name"`
	Key        string         `json:"key"`
	Sets       []setJSON      `json:"sets"`
	Exclude    []netip.Prefix `json:"exclude"`
	Allocated  int            `json:"allocated"`
	OutOfRange int            `json:"outOfRange"`
	Holders    []holderJSON   `json:"holders"`
	// Layout is "blocks" or "flat" (a pool stored before blocks: leaseholdctl pool migrate);
	// Blocks the block lengths ({} when flat); Migrating is set while the pool is frozen.
	Layout    string              `json:"layout"`
	Blocks    allocator.Blocks    `json:"blocks"`
	Migrating *keyspace.Migration `json:"migrating,omitempty"`
	// ClaimedBlocks counts the pool's block claims; Claims lists them (pool show only).
	ClaimedBlocks int         `json:"claimedBlocks"`
	Claims        []claimJSON `json:"claims,omitempty"`
	// Expired counts the pool's held keys without allocation, held back for their node until
	// their lease expires (issue 23): expired addresses, and those of pods still running whose
	// keys etcd lost (KeysLost). ExpiredBlocks counts its block claims of nodes whose agent is
	// gone or was replaced, their node's until their lease expires.
	Expired       int `json:"expired"`
	ExpiredBlocks int `json:"expiredBlocks"`
	// HeldBack (pool show only) lists the expired addresses and blocks per node and lease, with
	// when each becomes reusable; FirstReusable is the earliest (null when nothing is held
	// back).
	HeldBack      []heldBackJSON `json:"heldBack,omitzero"`
	FirstReusable *time.Time     `json:"firstReusable,omitempty"`
	// KeysLost (pool show only) lists the addresses among Expired that are not expired: their
	// pod still runs, but etcd lost its keys (issue 32; leaseholdctl doctor reports each).
	// keysLost counts them in every cluster, as Expired does.
	KeysLost []keysLostJSON `json:"keysLost,omitzero"`
	keysLost int
	// Problem is set for a definition that is unreadable, invalid or missing.
	Problem string `json:"problem,omitempty"`
}

// claimJSON is one block claim as pool show prints it.
type claimJSON struct {
	Block   netip.Prefix `json:"block"`
	Key     string       `json:"key"`
	Cluster string       `json:"cluster"`
	Node    string       `json:"node"`
	NodeUID string       `json:"nodeUID"`
	Since   time.Time    `json:"since"`
	Lease   string       `json:"lease"`
	// Agent is "gone" or "replaced" for an expired block (its node's agent is gone, or runs with
	// another node UID), else "live".
	Agent      string `json:"agent"`
	Unreadable string `json:"unreadable,omitempty"`
}

// heldBackJSON is what a pool holds back for one node on one lease (pool show): its expired
// addresses and blocks, reusable when the lease expires.
type heldBackJSON struct {
	Cluster string `json:"cluster"`
	Node    string `json:"node"`
	// Agent is "gone", "replaced" or "live": an agent of the node is back, and re-claims the
	// addresses of its pods still running and frees those of its pods that are gone
	// (admin.AgentBack), unless they are on the block lease of an earlier machine under the
	// node's name.
	Agent     string `json:"agent"`
	Addresses int    `json:"addresses"`
	Blocks    int    `json:"blocks"`
	Lease     string `json:"lease"`
	lease     clientv3.LeaseID
	// LeaseTTL is the lease's TTL left: the seconds until they are reusable (-1: expired now).
	admin.LeaseTTL
	ReusableAt *time.Time `json:"reusableAt"`
}

// keysLostJSON is an address held back only by its held key whose pod still runs (pool show):
// etcd lost the pod's keys. Kind and Fix are leaseholdctl doctor's finding of it.
type keysLostJSON struct {
	IP      netip.Addr `json:"ip"`
	HeldKey string     `json:"heldKey"`
	Cluster string     `json:"cluster"`
	Node    string     `json:"node"`
	Owner   string     `json:"owner"`
	Kind    string     `json:"kind"`
	Fix     string     `json:"fix"`
}

func toJSON(c counts) countsJSON {
	return countsJSON{Size: bigText(c.size), Allocated: c.allocated, Quarantined: c.quarantined, Hosts: c.hosts, Expired: c.expired,
		Free: bigText(c.free())}
}

// json is u as pool list (claims false) or pool show (claims true) prints it; with cluster set,
// only that cluster's holders and claims.
func (u *poolUsage) json(cluster string, claims bool) poolJSON {
	p := poolJSON{Name: u.spec.Name, Key: keyspace.PoolKey(u.spec.Name), Sets: []setJSON{}, Exclude: u.spec.Exclude,
		Allocated: u.allocated, OutOfRange: u.outside, Holders: []holderJSON{}, Layout: layoutName(u.entry),
		Blocks: u.spec.Blocks, Migrating: u.entry.Migrating, ClaimedBlocks: len(u.claims), Expired: len(u.expired), ExpiredBlocks: len(u.expiredBlocks)}
	for _, b := range u.claims {
		if claims && (cluster == "" || b.Value.Cluster == cluster) {
			agent := admin.AgentLive
			if a, ok := u.agents[b.Key]; ok {
				agent = a
			}
			p.Claims = append(p.Claims, claimJSON{Block: b.Block, Key: b.Key, Cluster: b.Value.Cluster, Node: b.Value.Node,
				NodeUID: b.Value.NodeUID, Since: b.Value.Since, Lease: keyspace.LeaseHex(b.Lease), Agent: agent, Unreadable: b.Unreadable})
		}
	}
	if claims {
		p.HeldBack, p.KeysLost, p.keysLost = u.heldBack(cluster)
	}
	if p.Exclude == nil {
		p.Exclude = []netip.Prefix{}
	}
	for i, s := range u.spec.Ranges {
		sj := setJSON{Set: i, Family: s.Family(), countsJSON: toJSON(u.set(i))}
		for j, r := range s {
			sj.Ranges = append(sj.Ranges, rangeJSON{Subnet: r.Subnet, Start: r.RangeStart, End: r.RangeEnd, Gateway: r.Gateway,
				countsJSON: toJSON(u.ranges[i][j])})
		}
		p.Sets = append(p.Sets, sj)
	}
	for _, c := range sortedKeys(u.holders) {
		if cluster == "" || c == cluster {
			h := u.holders[c]
			p.Holders = append(p.Holders, holderJSON{Cluster: c, Nodes: len(h.nodes), Allocated: h.allocated})
		}
	}
	return p
}

// heldBack groups the pool's expired addresses and blocks by node and lease (of cluster only,
// unless it is ""), without TTLs: poolShow asks etcd for them. The addresses of pods still
// running (u.told) it lists apart, and counts in every cluster.
func (u *poolUsage) heldBack(cluster string) (_ []heldBackJSON, lost []keysLostJSON, lostAll int) {
	byKey := map[string]*heldBackJSON{}
	get := func(c, n string, lease clientv3.LeaseID, agent string) *heldBackJSON {
		k := c + "/" + n + "/" + keyspace.LeaseHex(lease)
		h := byKey[k]
		if h == nil {
			h = &heldBackJSON{Cluster: c, Node: n, Agent: agent, Lease: keyspace.LeaseHex(lease), lease: lease, LeaseTTL: admin.LeaseTTL{TTL: -1}}
			byKey[k] = h
		}
		return h
	}
	for _, h := range u.expired {
		f, ok := u.told[h.Key]
		switch {
		case ok && f.KeysLost():
			lostAll++
			if cluster == "" || h.Value.Cluster == cluster {
				lost = append(lost, keysLostJSON{IP: h.IP, HeldKey: h.Key, Cluster: h.Value.Cluster, Node: h.Value.Node, Owner: h.Value.Owner,
					Kind: f.Kind, Fix: f.Fix})
			}
		case h.Unreadable == "" && (cluster == "" || h.Value.Cluster == cluster):
			get(h.Value.Cluster, h.Value.Node, h.Lease, "").Addresses++
		}
	}
	for _, b := range u.expiredBlocks {
		if cluster == "" || b.Value.Cluster == cluster {
			g := get(b.Value.Cluster, b.Value.Node, b.Lease, u.agents[b.Key])
			g.Blocks++
			if g.Agent == "" || g.Agent == admin.AgentLive {
				g.Agent = u.agents[b.Key]
			}
		}
	}
	out := []heldBackJSON{}
	for _, k := range sortedKeys(byKey) {
		out = append(out, *byKey[k])
	}
	return out, lost, lostAll
}

// reusableTimes asks etcd for the TTL left of each held-back lease of p: when its addresses
// and blocks become reusable.
func reusableTimes(ctx context.Context, e *env, st *admin.State, p *poolJSON) error {
	var ids []clientv3.LeaseID
	for _, h := range p.HeldBack {
		ids = append(ids, h.lease)
	}
	ttls, err := admin.LeaseTTLs(ctx, e.cli, ids...)
	if err != nil {
		return err
	}
	now := time.Now().UTC().Truncate(time.Second)
	for i := range p.HeldBack {
		h := &p.HeldBack[i]
		if h.Agent == "" {
			h.Agent = st.AgentOf(h.Cluster, h.Node, "")
		}
		h.LeaseTTL = ttls[h.lease]
		if h.TTL >= 0 {
			at := now.Add(time.Duration(h.TTL) * time.Second)
			h.ReusableAt = &at
			if p.FirstReusable == nil || at.Before(*p.FirstReusable) {
				p.FirstReusable = &at
			}
		}
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// poolRows is every pool of st as pool list shows it, including pools that have
// allocations but no (usable) definition.
func poolRows(st *admin.State) []poolJSON {
	var out []poolJSON
	x := expiryOf(st)
	defined := map[string]bool{}
	for _, p := range st.Pools {
		defined[p.Name] = true
		switch {
		case p.Unreadable != "":
			out = append(out, poolJSON{Name: p.Name, Key: p.Key, Sets: []setJSON{}, Exclude: []netip.Prefix{}, Holders: []holderJSON{},
				Problem: "unreadable definition: " + p.Unreadable})
		case p.Invalid != "":
			out = append(out, poolJSON{Name: p.Name, Key: p.Key, Sets: []setJSON{}, Exclude: []netip.Prefix{}, Holders: []holderJSON{},
				Problem: "invalid definition: " + p.Invalid})
		default:
			out = append(out, usageOf(st, p, x).json("", false))
		}
	}
	undefined := map[string]int{}
	for _, a := range st.Allocations {
		if !defined[a.Pool] {
			undefined[a.Pool]++
		}
	}
	for _, name := range sortedKeys(undefined) {
		out = append(out, poolJSON{Name: name, Key: keyspace.PoolKey(name), Allocated: undefined[name],
			Sets: []setJSON{}, Exclude: []netip.Prefix{}, Holders: []holderJSON{},
			Problem: "no definition, but " + strconv.Itoa(undefined[name]) + " allocation(s); run leaseholdctl doctor"})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func poolList(ctx context.Context, e *env) error {
	st, err := admin.ReadState(ctx, e.cli)
	if err != nil {
		return err
	}
	rows := poolRows(st)
	if e.output == "json" {
		if rows == nil {
			rows = []poolJSON{}
		}
		return writeJSON(e.stdout, rows)
	}
	t := newTable(e.stdout, "POOL", "SET", "RANGES", "SIZE", "ALLOCATED", "QUARANTINED", "HOSTS", "EXPIRED", "FREE", "LAYOUT", "CLAIMED BLOCKS",
		"EXPIRED BLOCKS")
	for _, p := range rows {
		if p.Problem != "" {
			t.row(p.Name, "-", "("+p.Problem+")", "-", strconv.Itoa(p.Allocated), "-", "-", "-", "-", "-", "-", "-")
			continue
		}
		for _, s := range p.Sets {
			var rs []string
			for _, r := range s.Ranges {
				rs = append(rs, allocator.Range{Subnet: r.Subnet, RangeStart: r.Start, RangeEnd: r.End, Gateway: r.Gateway}.String())
			}
			t.row(p.Name, strconv.Itoa(s.Set), strings.Join(rs, ", "), s.Size, strconv.Itoa(s.Allocated),
				strconv.Itoa(s.Quarantined), strconv.Itoa(s.Hosts), strconv.Itoa(s.Expired), s.Free, layoutShort(p), strconv.Itoa(p.ClaimedBlocks),
				strconv.Itoa(p.ExpiredBlocks))
		}
	}
	return t.flush()
}

func poolShow(ctx context.Context, e *env) error {
	if e.blocks {
		return poolBlocks(ctx, e)
	}
	name, err := poolArg(e.args[0])
	if err != nil {
		return err
	}
	st, err := admin.ReadState(ctx, e.cli)
	if err != nil {
		return err
	}
	p, ok := st.Pool(name)
	switch {
	case !ok:
		return fmt.Errorf("%w: pool %s has no definition (%s); leaseholdctl pool list shows the pools", admin.ErrNotFound, name, keyspace.PoolKey(name))
	case p.Unreadable != "":
		return fmt.Errorf("pool definition %s is unreadable (%s); inspect it with: etcdctl get %s", p.Key, p.Unreadable, p.Key)
	case p.Invalid != "":
		return fmt.Errorf("pool definition %s is invalid: %s", p.Key, p.Invalid)
	}
	u := usageOf(st, p, expiryOf(st))
	if len(u.expired) > 0 {
		u.told = admin.HeldFindings(st)
	}
	pj := u.json(e.cluster, true)
	if err := reusableTimes(ctx, e, st, &pj); err != nil {
		return err
	}
	if e.output == "json" {
		return writeJSON(e.stdout, pj)
	}
	fmt.Fprintf(e.stdout, "pool %s (%s, written at revision %d)\nlayout: %s\n\n", name, p.Key, p.ModRevision, layoutText(p))
	t := newTable(e.stdout, "SET", "SUBNET", "START-END", "GATEWAY", "SIZE", "ALLOCATED", "QUARANTINED", "HOSTS", "EXPIRED", "FREE")
	for _, s := range pj.Sets {
		for _, r := range s.Ranges {
			t.row(strconv.Itoa(s.Set), r.Subnet.String(), r.Start.String()+"-"+r.End.String(), r.Gateway.String(), r.Size,
				strconv.Itoa(r.Allocated), strconv.Itoa(r.Quarantined), strconv.Itoa(r.Hosts), strconv.Itoa(r.Expired), r.Free)
		}
		if len(s.Ranges) < 2 {
			continue
		}
		t.row("", "total", "", "", s.Size, strconv.Itoa(s.Allocated), strconv.Itoa(s.Quarantined), strconv.Itoa(s.Hosts), strconv.Itoa(s.Expired), s.Free)
	}
	if err := t.flush(); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "\nexcludes: %s\n", prefixesText(pj.Exclude))
	if pj.OutOfRange > 0 {
		fmt.Fprintf(e.stdout, "out of range: %d allocation(s) no range of the pool hands out (leaseholdctl doctor says which)\n", pj.OutOfRange)
	}
	fmt.Fprintln(e.stdout)
	if len(pj.Holders) == 0 {
		fmt.Fprintln(e.stdout, "no allocations")
	} else {
		t = newTable(e.stdout, "CLUSTER", "NODES", "ALLOCATED")
		for _, h := range pj.Holders {
			t.row(h.Cluster, strconv.Itoa(h.Nodes), strconv.Itoa(h.Allocated))
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	if err := showHeldBack(e, pj); err != nil {
		return err
	}
	if p.Value.Blocks.Flat() {
		return nil
	}
	fmt.Fprintf(e.stdout, "\n%d block(s) claimed\n", pj.ClaimedBlocks)
	if len(pj.Claims) == 0 {
		return nil
	}
	now := time.Now()
	t = newTable(e.stdout, "BLOCK", "CLUSTER/NODE", "NODE UID", "AGENT", "SINCE", "LEASE")
	for _, c := range pj.Claims {
		if c.Unreadable != "" {
			t.row(c.Block.String(), "(unreadable: "+c.Unreadable+")", "", "", "", c.Lease)
			continue
		}
		agent := "yes"
		if c.Agent != admin.AgentLive {
			agent = c.Agent + " (expired block)"
		}
		t.row(c.Block.String(), dash(c.Cluster)+"/"+dash(c.Node), dash(c.NodeUID), agent, timeText(c.Since, now), c.Lease)
	}
	return t.flush()
}

// showHeldBack prints what the pool holds back for nodes cut off or gone (issue 23): its
// expired addresses and blocks, per node and lease, and when they become reusable; and apart,
// the addresses held back whose pods still run, whose keys etcd lost (issue 32).
func showHeldBack(e *env, pj poolJSON) error {
	fmt.Fprintln(e.stdout)
	if len(pj.KeysLost) > 0 {
		if err := showKeysLost(e, pj.KeysLost); err != nil {
			return err
		}
	}
	expired := pj.Expired - pj.keysLost
	if expired+pj.ExpiredBlocks == 0 {
		fmt.Fprintln(e.stdout, "no expired addresses or blocks")
		return nil
	}
	now := time.Now()
	first := "-"
	if pj.FirstReusable != nil {
		first = timeText(*pj.FirstReusable, now)
	}
	fmt.Fprintf(e.stdout, "expired: %d address(es) held back, %d block(s) of nodes whose agent is gone; first reusable %s\n",
		expired, pj.ExpiredBlocks, first)
	if len(pj.HeldBack) > 0 {
		t := newTable(e.stdout, "CLUSTER/NODE", "AGENT", "EXPIRED ADDRESSES", "EXPIRED BLOCKS", "LEASE", "REUSABLE")
		for _, h := range pj.HeldBack {
			agent := h.Agent
			if agent == admin.AgentLive {
				agent = "back"
			}
			reusable := "now (lease expired)"
			switch {
			case h.lease == 0:
				reusable = "never: held keys without a lease (leaseholdctl doctor)"
			case h.ReusableAt != nil:
				reusable = timeText(*h.ReusableAt, now)
			}
			t.row(dash(h.Cluster)+"/"+dash(h.Node), agent, strconv.Itoa(h.Addresses), strconv.Itoa(h.Blocks), h.Lease, reusable)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	fmt.Fprintln(e.stdout, "(another pod gets an expired address only when the pool has no other free address. The agent of a node that "+
		"is back (AGENT back), or comes back before REUSABLE, "+admin.AgentBack()+", and keeps its blocks. Held keys on the block "+
		"lease of an earlier machine under the same name (another node UID) wait for REUSABLE. leaseholdctl alloc show IP tells "+
		"one address; leaseholdctl node forget NODE frees a node's at once once it is gone for good)")
	return nil
}

// showKeysLost prints the addresses held back only by their held keys whose pods still run: not
// expired, an error, which each node's agent repairs by itself (doctor's words).
func showKeysLost(e *env, lost []keysLostJSON) error {
	fmt.Fprintf(e.stdout, "keys lost: %d address(es) held back whose pods still run: not expired, an error (counted in EXPIRED "+
		"above, as only their held keys keep them from other pods, and only while the pool has other room). etcd lost their "+
		"pods' keys: deleted by hand, or with a restore of etcd\n", len(lost))
	t := newTable(e.stdout, "IP", "CLUSTER/NODE", "OWNER", "DOCTOR", "HELD KEY")
	var nodes []string
	for _, l := range lost {
		t.row(l.IP.String(), dash(l.Cluster)+"/"+dash(l.Node), dash(l.Owner), l.Kind, l.HeldKey)
		if !slices.Contains(nodes, l.Node) {
			nodes = append(nodes, l.Node)
		}
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, n := range nodes {
		fmt.Fprintf(e.stdout, "(%s. leaseholdctl doctor gives the fix of each; leaseholdctl alloc show IP tells one)\n", admin.AgentPutsBack(n))
	}
	fmt.Fprintln(e.stdout)
	return nil
}
