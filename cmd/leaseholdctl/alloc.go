package main

import (
	"context"
	"fmt"
	"net/netip"
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
		out = append(out, d)
	}
	var resting []string
	for _, q := range st.Quarantine {
		resting = append(resting, fmt.Sprintf("pool %s until %s (released by %s; %s)", q.Pool,
			q.Value.Until.Format(time.RFC3339), q.Value.ReleasedBy, q.Key))
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
	_ = t.flush()
}

// releaseJSON is the -o json output of alloc release.
type releaseJSON struct {
	Pool            string       `json:"pool"`
	Released        []netip.Addr `json:"released"`
	OwnerIndex      string       `json:"ownerIndex,omitempty"`
	KeptOwnerIndex  string       `json:"keptOwnerIndex,omitempty"`
	Forced          bool         `json:"forced"`
	LeaseTTL        int64        `json:"leaseTTL"`
	QuarantineUntil *time.Time   `json:"quarantineUntil,omitempty"`
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
	out := releaseJSON{Pool: e.pool, OwnerIndex: res.OwnerIndex, KeptOwnerIndex: res.KeptOwnerIndex,
		Forced: e.force && res.TTL > 0, LeaseTTL: res.TTL}
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
	if out.QuarantineUntil != nil {
		fmt.Fprintf(e.stdout, "quarantined until %s\n", out.QuarantineUntil.Format(time.RFC3339))
	}
	return nil
}
