package main

import (
	"context"
	"fmt"
	"math/big"
	"net/netip"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// counts is how much of a range, or of a range set, is taken. An address counts once: as
// allocated, else as quarantined, else as used by a host; only addresses the pool can hand
// out are counted, so free = size - allocated - quarantined - hosts.
type counts struct {
	size                          *big.Int
	allocated, quarantined, hosts int
}

func (c counts) free() *big.Int {
	n := new(big.Int).Set(c.size)
	return n.Sub(n, big.NewInt(int64(c.allocated+c.quarantined+c.hosts)))
}

func (c *counts) add(o counts) {
	if c.size == nil {
		c.size = new(big.Int)
	}
	c.size.Add(c.size, o.size)
	c.allocated += o.allocated
	c.quarantined += o.quarantined
	c.hosts += o.hosts
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

func usageOf(st *admin.State, p admin.PoolEntry) *poolUsage {
	spec := p.Value
	u := &poolUsage{entry: p, spec: spec, holders: map[string]*holder{}}
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
	Free        string `json:"free"`
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
	// Problem is set for a definition that is unreadable, invalid or missing.
	Problem string `json:"problem,omitempty"`
}

// claimJSON is one block claim as pool show prints it.
type claimJSON struct {
	Block      netip.Prefix `json:"block"`
	Key        string       `json:"key"`
	Cluster    string       `json:"cluster"`
	Node       string       `json:"node"`
	NodeUID    string       `json:"nodeUID"`
	Since      time.Time    `json:"since"`
	Lease      string       `json:"lease"`
	Unreadable string       `json:"unreadable,omitempty"`
}

func toJSON(c counts) countsJSON {
	return countsJSON{Size: bigText(c.size), Allocated: c.allocated, Quarantined: c.quarantined, Hosts: c.hosts, Free: bigText(c.free())}
}

// json is u as pool list (claims false) or pool show (claims true) prints it; with cluster set,
// only that cluster's holders and claims.
func (u *poolUsage) json(cluster string, claims bool) poolJSON {
	p := poolJSON{Name: u.spec.Name, Key: keyspace.PoolKey(u.spec.Name), Sets: []setJSON{}, Exclude: u.spec.Exclude,
		Allocated: u.allocated, OutOfRange: u.outside, Holders: []holderJSON{}, Layout: layoutName(u.entry),
		Blocks: u.spec.Blocks, Migrating: u.entry.Migrating, ClaimedBlocks: len(u.claims)}
	for _, b := range u.claims {
		if claims && (cluster == "" || b.Value.Cluster == cluster) {
			p.Claims = append(p.Claims, claimJSON{Block: b.Block, Key: b.Key, Cluster: b.Value.Cluster, Node: b.Value.Node,
				NodeUID: b.Value.NodeUID, Since: b.Value.Since, Lease: keyspace.LeaseHex(b.Lease), Unreadable: b.Unreadable})
		}
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
			out = append(out, usageOf(st, p).json("", false))
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
	t := newTable(e.stdout, "POOL", "SET", "RANGES", "SIZE", "ALLOCATED", "QUARANTINED", "HOSTS", "FREE", "LAYOUT", "CLAIMED BLOCKS")
	for _, p := range rows {
		if p.Problem != "" {
			t.row(p.Name, "-", "("+p.Problem+")", "-", strconv.Itoa(p.Allocated), "-", "-", "-", "-", "-")
			continue
		}
		for _, s := range p.Sets {
			var rs []string
			for _, r := range s.Ranges {
				rs = append(rs, allocator.Range{Subnet: r.Subnet, RangeStart: r.Start, RangeEnd: r.End, Gateway: r.Gateway}.String())
			}
			t.row(p.Name, strconv.Itoa(s.Set), strings.Join(rs, ", "), s.Size, strconv.Itoa(s.Allocated),
				strconv.Itoa(s.Quarantined), strconv.Itoa(s.Hosts), s.Free, layoutShort(p), strconv.Itoa(p.ClaimedBlocks))
		}
	}
	return t.flush()
}

func poolShow(ctx context.Context, e *env) error {
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
	pj := usageOf(st, p).json(e.cluster, true)
	if e.output == "json" {
		return writeJSON(e.stdout, pj)
	}
	fmt.Fprintf(e.stdout, "pool %s (%s, written at revision %d)\nlayout: %s\n\n", name, p.Key, p.ModRevision, layoutText(p))
	t := newTable(e.stdout, "SET", "SUBNET", "START-END", "GATEWAY", "SIZE", "ALLOCATED", "QUARANTINED", "HOSTS", "FREE")
	for _, s := range pj.Sets {
		for _, r := range s.Ranges {
			t.row(strconv.Itoa(s.Set), r.Subnet.String(), r.Start.String()+"-"+r.End.String(), r.Gateway.String(), r.Size,
				strconv.Itoa(r.Allocated), strconv.Itoa(r.Quarantined), strconv.Itoa(r.Hosts), r.Free)
		}
		if len(s.Ranges) < 2 {
			continue
		}
		t.row("", "total", "", "", s.Size, strconv.Itoa(s.Allocated), strconv.Itoa(s.Quarantined), strconv.Itoa(s.Hosts), s.Free)
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
	if p.Value.Blocks.Flat() {
		return nil
	}
	fmt.Fprintf(e.stdout, "\n%d block(s) claimed\n", pj.ClaimedBlocks)
	if len(pj.Claims) == 0 {
		return nil
	}
	now := time.Now()
	t = newTable(e.stdout, "BLOCK", "CLUSTER/NODE", "NODE UID", "SINCE", "LEASE")
	for _, c := range pj.Claims {
		if c.Unreadable != "" {
			t.row(c.Block.String(), "(unreadable: "+c.Unreadable+")", "", "", c.Lease)
			continue
		}
		t.row(c.Block.String(), dash(c.Cluster)+"/"+dash(c.Node), dash(c.NodeUID), timeText(c.Since, now), c.Lease)
	}
	return t.flush()
}
