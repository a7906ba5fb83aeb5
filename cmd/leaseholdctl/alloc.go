package main

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/keyspace"
)

func allocList(ctx context.Context, e *env) error {
	if e.pool != "" {
		if _, err := poolArg(e.pool); err != nil {
			return err
		}
	}
	all, err := admin.ListAllocations(ctx, e.cli, e.pool)
	if err != nil {
		return err
	}
	rows := []admin.AllocationEntry{}
	for _, a := range all {
		if (e.cluster != "" && a.Cluster != e.cluster) || (e.node != "" && a.Node != e.node) ||
			(e.owner != "" && a.Owner != e.owner) || (e.ns != "" && a.Pod.Namespace != e.ns) {
			continue
		}
		rows = append(rows, a)
	}
	if e.output == "json" {
		return writeJSON(e.stdout, rows)
	}
	t := newTable(e.stdout, "POOL", "IP", "CLUSTER", "NODE", "OWNER", "POD", "CONTAINER", "IFNAME", "LEASE")
	for _, a := range rows {
		if a.Unreadable != "" {
			t.row(a.Pool, a.IP.String(), "?", "?", "(unreadable: "+a.Unreadable+")", "", "", "", a.Lease)
			continue
		}
		t.row(a.Pool, a.IP.String(), a.Cluster, a.Node, a.Owner, podText(a.Pod), short(a.ContainerID), a.IfName, a.Lease)
	}
	return t.flush()
}

// allocDetail is one allocation as alloc show prints it (-o json: an array of these).
type allocDetail struct {
	admin.AllocationEntry
	admin.LeaseTTL
	// BlockClaim is the claim of the key's block, when a node claims it.
	BlockClaim *keyspace.BlockRecord `json:"blockClaim,omitempty"`
	// WrongLayout says why the key is not where its pool's layout puts the address.
	WrongLayout string `json:"wrongLayout,omitempty"`
	// Expired is set on an entry of an address without allocation but with a held key (issue
	// 23) whose pod has no key left: its lease ran out without a release (or all its keys were
	// deleted by hand), and it is held back for the node Held names until Held's lease
	// expires, unless an agent of that node re-claims or frees it first. Such an entry has no
	// allocation fields (key and lease are "") and TTL -1.
	Expired bool `json:"expired,omitempty"`
	// KeysLost is set instead of Expired on such an entry when the pod still runs (an owner
	// index of it names the address, or its pod record or another owner index is on a live
	// lease): etcd lost the pod's keys (deleted by hand, or with a restore of etcd). It is not
	// expired but an error, which the node's agent repairs by itself (issue 32).
	KeysLost bool `json:"keysLost,omitempty"`
	// Finding is what leaseholdctl doctor finds of such an address (admin.HeldFindings): with
	// KeysLost, owner-index-without-allocation or running-pod-address-missing and its fix;
	// with Expired, address-expired.
	Finding *admin.Finding `json:"finding,omitempty"`
	// Held is the address's held key in the pool, if any.
	Held *heldDetail `json:"held,omitempty"`
}

// heldDetail is a held key as alloc show prints it.
type heldDetail struct {
	Key string `json:"key"`
	keyspace.HeldRecord
	// Lease is the lease the key is on (its node's block lease), in etcdctl's hex form; "0"
	// means none: it never expires.
	Lease string `json:"lease"`
	admin.LeaseTTL
	// ReusableAt is when the lease expires: an expired address is reusable then. Null while the
	// address is allocated, or when the lease is gone or there is none.
	ReusableAt *time.Time `json:"reusableAt,omitempty"`
	// Agent is "live" when a node record of the node exists, "gone" when none does ("unknown"
	// when the held key names no valid node).
	Agent string `json:"agent"`
	// OtherHolder says the held key names another node or owner than the allocation
	// (leaseholdctl doctor: held-names-other-holder).
	OtherHolder bool   `json:"otherHolder,omitempty"`
	Unreadable  string `json:"unreadable,omitempty"`
}

func allocShow(ctx context.Context, e *env) error {
	ip, err := parseIP(e.args[0])
	if err != nil {
		return err
	}
	if e.pool != "" {
		if _, err := poolArg(e.pool); err != nil {
			return err
		}
	}
	st, err := admin.FindAddress(ctx, e.cli, e.pool, ip)
	if err != nil {
		return err
	}
	var out []allocDetail
	allocated := 0
	for _, a := range st.Allocations {
		ttl, err := admin.TimeToLive(ctx, e.cli, a.BoundLease)
		if err != nil {
			return err
		}
		d := allocDetail{AllocationEntry: a, LeaseTTL: ttl}
		if c, ok := st.Claim(a.Pool, a.Block); ok && c.Unreadable == "" {
			d.BlockClaim = &c.Value
		}
		if p, ok := st.Pool(a.Pool); ok && p.Usable() && p.Value.Blocks.Of(a.IP) != a.Block {
			d.WrongLayout = "pool " + a.Pool + " puts it at " + keyspace.IPKey(a.Pool, p.Value.Blocks, a.IP) + " (leaseholdctl doctor says what to do)"
		}
		if d.Held, err = heldOf(ctx, e, st, a.Pool, a.IP, a.Block, &a); err != nil {
			return err
		}
		out = append(out, d)
		allocated++
	}
	var told map[string]admin.Finding // what doctor finds of the addresses without allocation
	if len(st.Expired()) > 0 {
		told = admin.HeldFindings(st)
	}
	for _, h := range st.Expired() {
		if slices.ContainsFunc(out, func(d allocDetail) bool { return d.Pool == h.Pool }) {
			continue // one entry per pool: the allocation in the other layout is the holder
		}
		d := allocDetail{AllocationEntry: admin.AllocationEntry{Pool: h.Pool, IP: h.IP, Block: h.Block}, LeaseTTL: admin.LeaseTTL{TTL: -1}, Expired: true}
		if f, ok := told[h.Key]; ok {
			d.Finding = &f
			d.Expired, d.KeysLost = !f.KeysLost(), f.KeysLost()
		}
		if c, ok := st.Claim(h.Pool, h.Block); ok && c.Unreadable == "" {
			d.BlockClaim = &c.Value
		}
		var err error
		if d.Held, err = heldOf(ctx, e, st, h.Pool, h.IP, h.Block, nil); err != nil {
			return err
		}
		out = append(out, d)
	}
	var resting []string
	for _, q := range st.Quarantine {
		resting = append(resting, fmt.Sprintf("pool %s until %s (released by %s; %s)", q.Pool,
			q.Value.Until.Format(time.RFC3339), q.Value.ReleasedBy, q.Key))
	}
	if allocated == 0 && len(out) > 0 {
		// Held back only: what holds it back goes to stdout, and the exit status still says
		// that nothing holds an allocation of it.
		if e.output == "json" {
			if err := writeJSON(e.stdout, out); err != nil {
				return err
			}
		} else {
			now := time.Now()
			for i, d := range out {
				if i > 0 {
					fmt.Fprintln(e.stdout)
				}
				showExpired(e, d, now)
			}
		}
		var expired, lost []string
		for _, d := range out {
			if d.KeysLost {
				lost = append(lost, d.Pool)
			} else {
				expired = append(expired, d.Pool)
			}
		}
		if len(lost) > 0 {
			return fmt.Errorf("%w: %s has no allocation in pool %s, but its pod still runs: etcd lost its keys, an error (above; "+
				"leaseholdctl doctor reports it)", admin.ErrNotFound, ip, strings.Join(lost, ", "))
		}
		return fmt.Errorf("%w: %s has no allocation; it is expired, held back in pool %s (above)", admin.ErrNotFound, ip, strings.Join(expired, ", "))
	}
	if len(out) == 0 {
		where := "any pool"
		if e.pool != "" {
			where = "pool " + e.pool
			if p, ok := st.Pool(e.pool); ok && p.Usable() {
				where += " (no key " + keyspace.IPKey(e.pool, p.Value.Blocks, ip) + ")"
			}
		}
		if len(resting) > 0 {
			return fmt.Errorf("%w: %s has no allocation in %s; it rests in quarantine in %s", admin.ErrNotFound, ip, where, strings.Join(resting, ", "))
		}
		return fmt.Errorf("%w: %s has no allocation in %s", admin.ErrNotFound, ip, where)
	}
	if e.output == "json" {
		return writeJSON(e.stdout, out)
	}
	now := time.Now()
	for i, d := range out {
		if i > 0 {
			fmt.Fprintln(e.stdout)
		}
		showOne(e, d, now)
	}
	return nil
}

// heldOf is the held key of ip in pool that st holds (in block's layout first), with its
// lease's TTL; a, when given, is the allocation it should name.
func heldOf(ctx context.Context, e *env, st *admin.State, pool string, ip netip.Addr, block netip.Prefix, a *admin.AllocationEntry) (*heldDetail, error) {
	hs := st.HeldAt(pool, ip)
	if len(hs) == 0 {
		return nil, nil
	}
	h := hs[0]
	for _, x := range hs {
		if x.Block == block {
			h = x
		}
	}
	ttl, err := admin.TimeToLive(ctx, e.cli, h.Lease)
	if err != nil {
		return nil, err
	}
	d := &heldDetail{Key: h.Key, HeldRecord: h.Value, Lease: keyspace.LeaseHex(h.Lease), LeaseTTL: ttl, Unreadable: h.Unreadable,
		Agent: st.AgentOf(h.Value.Cluster, h.Value.Node, "")}
	if a != nil && a.Unreadable == "" && h.Unreadable == "" && (a.Cluster != h.Value.Cluster || a.Node != h.Value.Node || a.Owner != h.Value.Owner) {
		d.OtherHolder = true
	}
	if a == nil && ttl.TTL >= 0 {
		at := time.Now().UTC().Truncate(time.Second).Add(time.Duration(ttl.TTL) * time.Second)
		d.ReusableAt = &at
	}
	return d, nil
}

// heldText is the "held key:" line of an allocated address.
func heldText(d allocDetail) string {
	h := d.Held
	switch {
	case h == nil:
		return "none: if the pod's lease expires without a release, the address is free at once"
	case h.Unreadable != "":
		return h.Key + ": unreadable (" + h.Unreadable + "); leaseholdctl doctor reports it"
	case h.OtherHolder:
		return fmt.Sprintf("%s names node %s/%s and owner %s, not this holder: leaseholdctl doctor reports it (held-names-other-holder)",
			h.Key, dash(h.Cluster), dash(h.Node), dash(h.Owner))
	case h.Lease == "0":
		return h.Key + " without a lease: it never expires (leaseholdctl doctor reports it)"
	}
	return fmt.Sprintf("%s on node %s's block lease %s (%s): if the pod's lease expires without a release, the address is held back "+
		"for the node until this lease expires", h.Key, dash(h.Node), h.Lease, leaseTTLText(h.LeaseTTL))
}

func leaseTTLText(t admin.LeaseTTL) string {
	if t.TTL < 0 {
		return "expired"
	}
	return fmt.Sprintf("TTL %ds left of %ds", t.TTL, t.GrantedTTL)
}

// showExpired prints an address without allocation whose held key holds it back: expired, or,
// when its pod still runs (KeysLost), a running pod's address whose keys etcd lost, with what
// doctor finds of it and its fix.
func showExpired(e *env, d allocDetail, now time.Time) {
	h := d.Held
	t := newTable(e.stdout)
	t.row("pool:", d.Pool)
	t.row("ip:", d.IP.String())
	if d.KeysLost {
		t.row("state:", fmt.Sprintf("KEYS LOST: no allocation, but its pod still runs and uses the address: etcd lost the pod's keys "+
			"(deleted by hand, or with a restore of etcd). It is not expired: an error (leaseholdctl doctor: %s)", d.Finding.Kind))
	} else {
		t.row("state:", "EXPIRED: no allocation and no key of its pod left, but a held key: its pod's lease ran out without a release "+
			"(its node cut off from etcd, or dead), or all its keys were deleted by hand")
	}
	t.row("held key:", h.Key+" (etcdctl get "+h.Key+" --print-value-only)")
	switch {
	case !d.Block.IsValid():
	case d.BlockClaim != nil:
		t.row("block:", fmt.Sprintf("%s, claimed by %s/%s since %s", d.Block, dash(d.BlockClaim.Cluster), dash(d.BlockClaim.Node),
			timeText(d.BlockClaim.Since, now)))
	default:
		t.row("block:", d.Block.String()+", claimed by no node")
	}
	if h.Unreadable != "" {
		t.row("held for:", "unreadable ("+h.Unreadable+"); leaseholdctl doctor reports it")
	} else {
		agent := "node " + dash(h.Node) + " has no agent (no " + keyspace.NodeKey(h.Cluster, h.Node) + "): cut off from etcd, or dead"
		if h.Agent == admin.AgentLive {
			agent = "node " + dash(h.Node) + " has an agent (" + keyspace.NodeKey(h.Cluster, h.Node) + ")"
		}
		t.row("held for:", fmt.Sprintf("node %s/%s, owner %s; %s", dash(h.Cluster), dash(h.Node), dash(h.Owner), agent))
	}
	if d.KeysLost {
		// Doctor's own words: what the agent does, how soon, what if it does not, and the fix.
		t.row("doctor:", d.Finding.Message)
		t.row("fix:", d.Finding.Fix)
		_ = t.flush()
		return
	}
	switch {
	case h.Lease == "0":
		t.row("until:", "never: the held key has no lease, so it is a leak (leaseholdctl doctor reports it)")
	case h.ReusableAt == nil:
		t.row("until:", "now: block lease "+h.Lease+" has expired; etcd is deleting the key")
	default:
		t.row("until:", fmt.Sprintf("%s, when block lease %s expires (%s; etcdctl lease timetolive %s --keys)", timeText(*h.ReusableAt, now),
			h.Lease, leaseTTLText(h.LeaseTTL), h.Lease))
	}
	t.row("meanwhile:", "another pod gets it only when the pool has no other free address")
	switch {
	case h.Unreadable != "":
		t.row("to do:", "leaseholdctl doctor")
	case h.Agent == admin.AgentLive:
		t.row("to do:", fmt.Sprintf("nothing: the agent of node %s %s. It leaves held keys on the block lease of an earlier machine "+
			"under the same name (another node UID): those are reusable at the time above", dash(h.Node), admin.AgentBack()))
	default:
		t.row("to do:", fmt.Sprintf("wait: node %s, back before then, re-claims the address if its pod still runs there, or frees it. "+
			"Once the node is gone for good, free its addresses and blocks at once: leaseholdctl node forget %s --cluster %s",
			dash(h.Node), h.Node, h.Cluster))
	}
	_ = t.flush()
}

func showOne(e *env, d allocDetail, now time.Time) {
	t := newTable(e.stdout)
	t.row("pool:", d.Pool)
	t.row("ip:", d.IP.String())
	t.row("key:", d.Key)
	t.row("etcdctl:", "etcdctl get "+d.Key+" --print-value-only")
	switch {
	case !d.Block.IsValid():
		t.row("block:", "none (a key of the flat layout)")
	case d.BlockClaim != nil:
		t.row("block:", fmt.Sprintf("%s, claimed by %s/%s since %s", d.Block, dash(d.BlockClaim.Cluster), dash(d.BlockClaim.Node),
			timeText(d.BlockClaim.Since, now)))
	default:
		t.row("block:", d.Block.String()+", claimed by no node")
	}
	if d.WrongLayout != "" {
		t.row("layout:", "WRONG: "+d.WrongLayout)
	}
	if d.Unreadable != "" {
		t.row("value:", "unreadable ("+d.Unreadable+"); inspect it with: etcdctl get "+d.Key)
	} else {
		pod := podText(d.Pod)
		if d.Pod.UID != "" {
			pod += " (uid " + d.Pod.UID + ")"
		}
		t.row("owner:", dash(d.Owner))
		t.row("pod:", pod)
		t.row("cluster:", dash(d.Cluster))
		t.row("node:", dash(d.Node)+" (node UID "+dash(d.NodeUID)+")")
		t.row("container:", dash(d.ContainerID))
		t.row("interface:", dash(d.IfName))
		t.row("network:", dash(d.Network))
		t.row("created:", timeText(d.Created, now))
	}
	switch {
	case d.BoundLease == 0:
		t.row("lease:", "none: the key never expires (written without a lease; leaseholdctl doctor reports it)")
	case d.TTL < 0:
		t.row("lease:", d.Lease+" (expired; etcd is deleting the key)")
	default:
		t.row("lease:", fmt.Sprintf("%s (TTL %ds left of %ds; etcdctl lease timetolive %s --keys)", d.Lease, d.TTL, d.GrantedTTL, d.Lease))
	}
	t.row("held key:", heldText(d))
	_ = t.flush()
}

// releaseJSON is the -o json output of alloc release.
type releaseJSON struct {
	Pool           string       `json:"pool"`
	Released       []netip.Addr `json:"released"`
	OwnerIndex     string       `json:"ownerIndex,omitempty"`
	KeptOwnerIndex string       `json:"keptOwnerIndex,omitempty"`
	// HeldKeys are the released addresses' held keys, deleted with them (issue 23).
	HeldKeys        []string   `json:"heldKeys"`
	Forced          bool       `json:"forced"`
	LeaseTTL        int64      `json:"leaseTTL"`
	QuarantineUntil *time.Time `json:"quarantineUntil,omitempty"`
}

func allocRelease(ctx context.Context, e *env) error {
	ip, err := parseIP(e.args[0])
	if err != nil {
		return err
	}
	if e.pool == "" {
		return usagef("alloc release needs --pool P (leaseholdctl alloc show %s lists the pools holding it)", ip)
	}
	if _, err := poolArg(e.pool); err != nil {
		return err
	}
	if e.quarantine < 0 {
		return usagef("--quarantine %s: want 0s (none) or more", e.quarantine)
	}
	res, err := admin.Release(ctx, e.cli, e.pool, ip, admin.ReleaseOptions{Force: e.force, Quarantine: e.quarantine})
	if err != nil {
		return err
	}
	out := releaseJSON{Pool: e.pool, OwnerIndex: res.OwnerIndex, KeptOwnerIndex: res.KeptOwnerIndex, HeldKeys: res.HeldKeys,
		Forced: e.force && res.TTL > 0, LeaseTTL: res.TTL}
	if out.HeldKeys == nil {
		out.HeldKeys = []string{}
	}
	for _, a := range res.Addresses {
		out.Released = append(out.Released, a.IP)
	}
	if !res.QuarantineUntil.IsZero() {
		out.QuarantineUntil = &res.QuarantineUntil
	}
	if e.output == "json" {
		return writeJSON(e.stdout, out)
	}
	var ips []string
	for _, a := range out.Released {
		ips = append(ips, a.String())
	}
	fmt.Fprintf(e.stdout, "released %s from pool %s", strings.Join(ips, ", "), e.pool)
	if out.Forced {
		fmt.Fprintf(e.stdout, " (forced: the lease had %ds left)", res.TTL)
	}
	fmt.Fprintln(e.stdout)
	if res.OwnerIndex != "" {
		fmt.Fprintf(e.stdout, "deleted owner index %s\n", res.OwnerIndex)
	} else {
		fmt.Fprintf(e.stdout, "owner index left alone: %s\n", res.KeptOwnerIndex)
	}
	for _, k := range res.HeldKeys {
		fmt.Fprintf(e.stdout, "deleted held key %s\n", k)
	}
	if out.QuarantineUntil != nil {
		fmt.Fprintf(e.stdout, "quarantined until %s\n", out.QuarantineUntil.Format(time.RFC3339))
	}
	return nil
}
