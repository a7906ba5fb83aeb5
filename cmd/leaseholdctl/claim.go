package main

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// stickyJSON is one sticky claim as claim list and claim show print it (-o json: an array of
// these). Holder is null while nobody holds the claim, Released null while somebody does.
type stickyJSON struct {
	Key         string                `json:"key"`
	Cluster     string                `json:"cluster"`
	Pool        string                `json:"pool"`
	Claim       string                `json:"claim"`
	IPs         []netip.Addr          `json:"ips"`
	Holder      *keyspace.ClaimHolder `json:"holder"`
	HoldSeconds int64                 `json:"holdSeconds"`
	Since       time.Time             `json:"since"`
	Released    *time.Time            `json:"released"`
	// LeaseID is the claim lease; TTL is what it has left (-1: none, or expired).
	LeaseID string `json:"leaseID"`
	admin.LeaseTTL
	// Addresses says what each address is now (claim show only).
	Addresses []stickyAddrJSON `json:"addresses,omitempty"`
	// Migration is the claim's live migration in progress, null when none.
	Migration  *migrationJSON `json:"migration"`
	Unreadable string         `json:"unreadable,omitempty"`
}

// migrationJSON is a claim's live migration (issue 35) as claim list and claim show print it:
// its target pod on another node uses the claim's addresses too, until the source's DEL
// (completed) or the target's (failed). AgeSeconds is how long it has run; OverBound is set
// when that is above --live-migration-bound (doctor's live-migration-too-old).
type migrationJSON struct {
	Key        string                       `json:"key"`
	Target     keyspace.ClaimHolder         `json:"target"`
	Source     keyspace.LiveMigrationSource `json:"source"`
	Since      time.Time                    `json:"since"`
	AgeSeconds int64                        `json:"ageSeconds"`
	// BoundSeconds is --live-migration-bound.
	BoundSeconds int64 `json:"boundSeconds"`
	OverBound    bool  `json:"overBound"`
	// LeaseID is the key's lease: the target's pod lease.
	LeaseID    string `json:"leaseID"`
	Unreadable string `json:"unreadable,omitempty"`
}

func migrationRow(e *env, m *admin.LiveMigrationEntry, now time.Time) *migrationJSON {
	if m == nil {
		return nil
	}
	age := m.Age(now)
	return &migrationJSON{Key: m.Key, Target: m.Value.Target, Source: m.Value.Source, Since: m.Value.Since, AgeSeconds: int64(age.Seconds()),
		BoundSeconds: int64(e.liveMigrationBound.Seconds()), OverBound: age > e.liveMigrationBound, LeaseID: keyspace.LeaseHex(m.Lease),
		Unreadable: m.Unreadable}
}

// migrationText is "to <pod> on <node> since <time> (<age>, bound <b>)", or "-" without one.
func migrationText(m *migrationJSON, now time.Time, long bool) string {
	switch {
	case m == nil:
		return "-"
	case m.Unreadable != "":
		return "unreadable (" + m.Unreadable + "); leaseholdctl doctor reports it"
	}
	pod := "owner " + dash(m.Target.Owner)
	if m.Target.Pod.Name != "" {
		pod = podText(m.Target.Pod)
	}
	over := ""
	if m.OverBound {
		over = ", over the bound"
	}
	bound := (time.Duration(m.BoundSeconds) * time.Second).String()
	if !long {
		return fmt.Sprintf("to %s on %s, %s%s", pod, dash(m.Target.Node), ago(now.Sub(m.Since)), over)
	}
	return fmt.Sprintf("migrating to %s on %s since %s (bound %s%s)", pod, dash(m.Target.Node), timeText(m.Since, now), bound, over)
}

// stickyAddrJSON is one address of a claim as claim show prints it. State is allocated,
// resting (in quarantine under this claim), quarantined (not under this claim) or free.
type stickyAddrJSON struct {
	IP    netip.Addr `json:"ip"`
	State string     `json:"state"`
	// Key is the allocation key when allocated, else the quarantine key, if any.
	Key string `json:"key,omitempty"`
	// Owner, Cluster and Node name the allocation's holder when allocated.
	Owner   string `json:"owner,omitempty"`
	Cluster string `json:"cluster,omitempty"`
	Node    string `json:"node,omitempty"`
	// Until and Claim are the quarantine record's, when in quarantine.
	Until *time.Time `json:"until,omitempty"`
	Claim string     `json:"claim,omitempty"`
}

func claimRow(ctx context.Context, e *env, c admin.ClaimEntry, now time.Time) (stickyJSON, error) {
	ttl, err := admin.TimeToLive(ctx, e.cli, c.Lease)
	if err != nil {
		return stickyJSON{}, err
	}
	j := stickyJSON{Key: c.Key, Cluster: c.Cluster, Pool: c.Pool, Claim: c.Name, IPs: c.Value.IPs, Holder: c.Value.Holder,
		HoldSeconds: c.Value.HoldSeconds, Since: c.Value.Since, LeaseID: keyspace.LeaseHex(c.Lease), LeaseTTL: ttl,
		Migration: migrationRow(e, c.Migration, now), Unreadable: c.Unreadable}
	if j.IPs == nil {
		j.IPs = []netip.Addr{}
	}
	if !c.Value.Released.IsZero() {
		r := c.Value.Released
		j.Released = &r
	}
	return j, nil
}

func addrJSON(a admin.ClaimAddress) stickyAddrJSON {
	j := stickyAddrJSON{IP: a.IP, State: a.State}
	if q := a.Quarantine; q != nil {
		j.Key = q.Key
		if q.Unreadable == "" {
			until := q.Value.Until
			j.Until, j.Claim = &until, q.Value.Claim
		}
	}
	if al := a.Allocation; al != nil {
		j.Key, j.Owner, j.Cluster, j.Node = al.Key, al.Owner, al.Cluster, al.Node
	}
	return j
}

// claimArg checks a claim name argument.
func claimArg(name string) (string, error) {
	if err := allocator.ValidateName("claim", name); err != nil {
		return "", usageError{err.Error()}
	}
	return name, nil
}

// findClaims lists the claims of e.cluster (every cluster without --cluster), only those of
// --pool and named name when given.
func findClaims(ctx context.Context, e *env, name string) ([]admin.ClaimEntry, error) {
	if e.pool != "" {
		if _, err := poolArg(e.pool); err != nil {
			return nil, err
		}
	}
	all, err := admin.ListClaims(ctx, e.cli, e.cluster)
	if err != nil {
		return nil, err
	}
	out := []admin.ClaimEntry{}
	for _, c := range all {
		if (e.pool == "" || c.Pool == e.pool) && (name == "" || c.Name == name) {
			out = append(out, c)
		}
	}
	return out, nil
}

// noClaim is the not-found error of claim show and release.
func noClaim(e *env, name string) error {
	where := "any pool"
	if e.pool != "" {
		where = "pool " + e.pool
	}
	if e.cluster != "" {
		where += " of cluster " + e.cluster
	} else {
		where += " of any cluster"
	}
	return fmt.Errorf("%w: no claim %s in %s (leaseholdctl claim list lists the claims)", admin.ErrNotFound, name, where)
}

// boundArg checks --live-migration-bound.
func boundArg(e *env) error {
	if e.liveMigrationBound <= 0 {
		return usagef("--live-migration-bound %s: want more than 0s", e.liveMigrationBound)
	}
	return nil
}

func claimList(ctx context.Context, e *env) error {
	if err := boundArg(e); err != nil {
		return err
	}
	claims, err := findClaims(ctx, e, "")
	if err != nil {
		return err
	}
	now := time.Now()
	rows := []stickyJSON{}
	for _, c := range claims {
		j, err := claimRow(ctx, e, c, now)
		if err != nil {
			return err
		}
		rows = append(rows, j)
	}
	if e.output == "json" {
		return writeJSON(e.stdout, rows)
	}
	t := newTable(e.stdout, "CLUSTER", "POOL", "CLAIM", "IPS", "HOLDER", "HOLD", "TTL LEFT", "MIGRATION")
	for _, c := range rows {
		if c.Unreadable != "" {
			t.row(c.Cluster, c.Pool, c.Claim, "?", "(unreadable: "+c.Unreadable+")", "?", ttlText(c.TTL, c.GrantedTTL), migrationText(c.Migration, now, false))
			continue
		}
		t.row(c.Cluster, c.Pool, c.Claim, addrsText(c.IPs), holderText(c, now), holdText(c.HoldSeconds), ttlText(c.TTL, c.GrantedTTL),
			migrationText(c.Migration, now, false))
	}
	return t.flush()
}

// holderText is "pod ns/name on node", or "released <time>" while nobody holds the claim.
func holderText(c stickyJSON, now time.Time) string {
	h := c.Holder
	switch {
	case h == nil && c.Released != nil:
		return "released " + timeText(*c.Released, now)
	case h == nil:
		return "released"
	case h.Pod.Name != "":
		return podText(h.Pod) + " on " + dash(h.Node)
	}
	return "owner " + dash(h.Owner) + " on " + dash(h.Node)
}

func holdText(seconds int64) string {
	if seconds <= 0 {
		return "-"
	}
	return (time.Duration(seconds) * time.Second).String()
}

func addrsText(ips []netip.Addr) string {
	if len(ips) == 0 {
		return "-"
	}
	s := make([]string, len(ips))
	for i, ip := range ips {
		s[i] = ip.String()
	}
	return strings.Join(s, ",")
}

func claimShow(ctx context.Context, e *env) error {
	name, err := claimArg(e.args[0])
	if err != nil {
		return err
	}
	if err := boundArg(e); err != nil {
		return err
	}
	claims, err := findClaims(ctx, e, name)
	if err != nil {
		return err
	}
	if len(claims) == 0 {
		return noClaim(e, name)
	}
	now := time.Now()
	out := []stickyJSON{}
	for _, c := range claims {
		j, err := claimRow(ctx, e, c, now)
		if err != nil {
			return err
		}
		addrs, err := admin.ClaimAddresses(ctx, e.cli, c)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			j.Addresses = append(j.Addresses, addrJSON(a))
		}
		out = append(out, j)
	}
	if e.output == "json" {
		return writeJSON(e.stdout, out)
	}
	for i, c := range out {
		if i > 0 {
			fmt.Fprintln(e.stdout)
		}
		showClaim(e, c, now)
	}
	return nil
}

func showClaim(e *env, c stickyJSON, now time.Time) {
	t := newTable(e.stdout)
	t.row("claim:", c.Claim)
	t.row("cluster:", c.Cluster)
	t.row("pool:", c.Pool)
	t.row("key:", c.Key)
	t.row("etcdctl:", "etcdctl get "+c.Key+" --print-value-only")
	if c.Unreadable != "" {
		t.row("value:", "unreadable ("+c.Unreadable+"); leaseholdctl doctor reports it")
	} else {
		if h := c.Holder; h != nil {
			pod := podText(h.Pod)
			if h.Pod.UID != "" {
				pod += " (uid " + h.Pod.UID + ")"
			}
			t.row("holder:", "owner "+dash(h.Owner)+", pod "+pod)
			t.row("node:", dash(h.Node)+" (node UID "+dash(h.NodeUID)+")")
			t.row("container:", dash(h.ContainerID))
			t.row("interface:", dash(h.IfName))
			t.row("pod lease:", dash(h.LeaseID))
		} else {
			released := "-"
			if c.Released != nil {
				released = timeText(*c.Released, now)
			}
			t.row("holder:", "none: released "+released+"; the next attachment naming the claim takes its addresses")
		}
		t.row("since:", timeText(c.Since, now))
		t.row("hold:", holdText(c.HoldSeconds)+" (how long the claim outlives its holder's release)")
		if m := c.Migration; m != nil {
			t.row("migration:", migrationText(m, now, true))
			if m.Unreadable == "" {
				t.row("target:", fmt.Sprintf("owner %s, container %s, interface %s, pod lease %s (the migration key's: %s)",
					dash(m.Target.Owner), dash(m.Target.ContainerID), dash(m.Target.IfName), dash(m.Target.LeaseID), m.LeaseID))
			}
			t.row("migration key:", m.Key)
		}
		for _, a := range c.Addresses {
			t.row("address:", addrStateText(a))
		}
	}
	switch {
	case c.LeaseID == "0":
		t.row("lease:", "none: the claim never expires (written without a lease; leaseholdctl doctor reports it)")
	case c.TTL < 0:
		t.row("lease:", c.LeaseID+" (expired; etcd is deleting the claim)")
	default:
		t.row("lease:", fmt.Sprintf("%s (TTL %ds left of %ds; etcdctl lease timetolive %s --keys)", c.LeaseID, c.TTL, c.GrantedTTL, c.LeaseID))
	}
	_ = t.flush()
}

func addrStateText(a stickyAddrJSON) string {
	until := ""
	if a.Until != nil {
		until = " until " + a.Until.UTC().Format(time.RFC3339)
	}
	switch a.State {
	case admin.ClaimAddrAllocated:
		return fmt.Sprintf("%s allocated to owner %s (cluster %s, node %s; %s)", a.IP, dash(a.Owner), dash(a.Cluster), dash(a.Node), a.Key)
	case admin.ClaimAddrResting:
		return fmt.Sprintf("%s resting in quarantine under the claim%s (%s)", a.IP, until, a.Key)
	case admin.ClaimAddrQuarantined:
		under := "in ordinary quarantine"
		if a.Claim != "" {
			under = "in quarantine under another claim, " + a.Claim + ","
		}
		return fmt.Sprintf("%s %s%s (%s)", a.IP, under, until, a.Key)
	}
	return a.IP.String() + " free: no allocation or quarantine key"
}

// stickyReleaseJSON is the -o json output of claim release. Addresses are as they were before
// the release.
type stickyReleaseJSON struct {
	Key             string                `json:"key"`
	Cluster         string                `json:"cluster"`
	Pool            string                `json:"pool"`
	Claim           string                `json:"claim"`
	IPs             []netip.Addr          `json:"ips"`
	Held            bool                  `json:"held"`
	Holder          *keyspace.ClaimHolder `json:"holder"`
	HolderKeeps     string                `json:"holderKeeps,omitempty"`
	Addresses       []stickyAddrJSON      `json:"addresses"`
	Quarantined     []netip.Addr          `json:"quarantined"`
	Freed           []netip.Addr          `json:"freed"`
	QuarantineUntil *time.Time            `json:"quarantineUntil,omitempty"`
	QuarantineLease string                `json:"quarantineLease,omitempty"`
	// MigrationDeleted is the live migration key --force deleted with the claim, if any.
	MigrationDeleted *migrationJSON `json:"migrationDeleted,omitempty"`
	Unreadable       string         `json:"unreadable,omitempty"`
}

func claimRelease(ctx context.Context, e *env) error {
	name, err := claimArg(e.args[0])
	if err != nil {
		return err
	}
	if e.pool == "" {
		return usagef("claim release needs --pool P (leaseholdctl claim show %s lists the pools with such a claim)", name)
	}
	if e.quarantine < 0 {
		return usagef("--quarantine %s: want 0s (none) or more", e.quarantine)
	}
	cluster := e.cluster
	if cluster == "" {
		claims, err := findClaims(ctx, e, name)
		if err != nil {
			return err
		}
		var clusters []string
		for _, c := range claims {
			clusters = append(clusters, c.Cluster)
		}
		switch len(clusters) {
		case 0:
			return noClaim(e, name)
		case 1:
			cluster = clusters[0]
		default:
			slices.Sort(clusters)
			return usagef("claim %s of pool %s exists in clusters %s: give --cluster C", name, e.pool, strings.Join(clusters, ", "))
		}
	}
	if _, err := poolArg(e.pool); err != nil {
		return err
	}
	q := e.quarantine
	if q == 0 {
		q = -1 // --quarantine 0s: none
	}
	res, err := admin.ReleaseClaim(ctx, e.cli, cluster, e.pool, name, admin.ClaimReleaseOptions{Quarantine: q, Force: e.force})
	if err != nil {
		return err
	}
	c := res.Claim
	out := stickyReleaseJSON{Key: c.Key, Cluster: c.Cluster, Pool: c.Pool, Claim: c.Name, IPs: c.Value.IPs, Holder: c.Value.Holder,
		Held: c.Value.Holder != nil, HolderKeeps: res.HolderKeeps, Addresses: []stickyAddrJSON{}, Quarantined: res.Quarantined,
		Freed: res.Freed, MigrationDeleted: migrationRow(e, res.MigrationDeleted, time.Now()), Unreadable: c.Unreadable}
	if out.IPs == nil {
		out.IPs = []netip.Addr{}
	}
	if out.Quarantined == nil {
		out.Quarantined = []netip.Addr{}
	}
	if out.Freed == nil {
		out.Freed = []netip.Addr{}
	}
	for _, a := range res.Addresses {
		out.Addresses = append(out.Addresses, addrJSON(a))
	}
	if res.QuarantineLease != 0 {
		out.QuarantineUntil, out.QuarantineLease = &res.QuarantineUntil, keyspace.LeaseHex(res.QuarantineLease)
	}
	if e.output == "json" {
		return writeJSON(e.stdout, out)
	}
	fmt.Fprintf(e.stdout, "released claim %s of pool %s in cluster %s (deleted %s)\n", c.Name, c.Pool, c.Cluster, c.Key)
	if c.Unreadable != "" {
		fmt.Fprintln(e.stdout, "its record was unreadable, so its addresses are unknown: quarantine keys resting under it "+
			"return them to the pool when their lease runs out")
	}
	if len(res.Quarantined) > 0 {
		fmt.Fprintf(e.stdout, "%s: moved from the claim to ordinary quarantine until %s (lease %s), then back to the pool\n",
			addrsText(res.Quarantined), res.QuarantineUntil.Format(time.RFC3339), out.QuarantineLease)
	}
	if len(res.Freed) > 0 {
		fmt.Fprintf(e.stdout, "%s: quarantine keys deleted (--quarantine 0s): free at once\n", addrsText(res.Freed))
	}
	for _, a := range out.Addresses {
		if a.State != admin.ClaimAddrResting {
			fmt.Fprintf(e.stdout, "left alone: %s\n", addrStateText(a))
		}
	}
	if res.HolderKeeps != "" {
		fmt.Fprintln(e.stdout, res.HolderKeeps)
	}
	if m := out.MigrationDeleted; m != nil {
		fmt.Fprintf(e.stdout, "deleted the live migration key %s (--force): %s; the target keeps using the addresses until its pod "+
			"goes, and no agent hands them over to it any more\n", m.Key, migrationText(m, time.Now(), true))
	}
	return nil
}
