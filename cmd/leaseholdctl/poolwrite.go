package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// configNote reminds the admin that CNI configurations that spell out the ranges must follow
// a changed definition: the agent refuses a configuration that disagrees with the stored one.
const configNote = "note: a network whose CNI configuration lists \"ranges\" for this pool must be updated to the new " +
	"definition (or name the pool with \"pool\" and no ranges); until then its ADDs are refused as a pool mismatch"

// poolChangeJSON is the -o json output of pool add-range and remove-range.
type poolChangeJSON struct {
	Pool     string             `json:"pool"`
	Before   allocator.PoolSpec `json:"before"`
	After    allocator.PoolSpec `json:"after"`
	Revision int64              `json:"revision"`
	// Appeared lists allocations found in a removed range after the write (see RemoveRange).
	Appeared []admin.AllocationEntry `json:"appeared,omitempty"`
}

func poolCreate(ctx context.Context, e *env) error {
	name, err := poolArg(e.args[0])
	if err != nil {
		return err
	}
	sets, err := rangeSets(e.ranges, e.set)
	if err != nil {
		return err
	}
	ex, err := parseExcludes(e.excludes)
	if err != nil {
		return err
	}
	blocks, err := blockFlags(e)
	if err != nil {
		return err
	}
	// Blocks stay zero without flags: CreatePool then stores the defaults, and an existing pool
	// of the same ranges in either layout is "unchanged".
	spec := allocator.PoolSpec{Name: name, Ranges: sets, Exclude: ex, Blocks: blocks}
	if err := spec.Canonicalize(); err != nil {
		return usageError{err.Error()}
	}
	created, err := admin.CreatePool(ctx, e.cli, spec)
	if err != nil {
		return err
	}
	stored, err := admin.ReadKeys(ctx, e.cli, keyspace.PoolKey(name))
	if err != nil {
		return err
	}
	p, ok := stored.Pool(name)
	if !ok || !p.Usable() {
		return fmt.Errorf("%w: pool %s was deleted or overwritten right after it was written; see leaseholdctl pool show %s", admin.ErrConcurrentChange, name, name)
	}
	if e.output == "json" {
		return writeJSON(e.stdout, struct {
			Pool    allocator.PoolSpec `json:"pool"`
			Key     string             `json:"key"`
			Created bool               `json:"created"`
			Layout  string             `json:"layout"`
		}{p.Value, keyspace.PoolKey(name), created, layoutName(p)})
	}
	if created {
		fmt.Fprintf(e.stdout, "created %s\n", p.Value)
	} else {
		fmt.Fprintf(e.stdout, "unchanged: %s is already defined exactly so\n", name)
	}
	fmt.Fprintf(e.stdout, "layout: %s\n", layoutText(p))
	return nil
}

// blockFlags reads --block-v4 and --block-v6; zero when neither is given.
func blockFlags(e *env) (allocator.Blocks, error) {
	b := allocator.Blocks{IPv4: e.blockV4, IPv6: e.blockV6}
	if b.IPv4 < 0 || b.IPv6 < 0 {
		return b, usagef("--block-v4 %d / --block-v6 %d: want a prefix length, such as 26 and 122", b.IPv4, b.IPv6)
	}
	return b, nil
}

func poolAddRange(ctx context.Context, e *env) error {
	name, err := poolArg(e.args[0])
	if err != nil {
		return err
	}
	r, set, err := oneRange(e.ranges, e.set)
	if err != nil {
		return err
	}
	ch, err := admin.AddRange(ctx, e.cli, name, set, r)
	if err != nil {
		return err
	}
	if e.output == "json" {
		return writeJSON(e.stdout, poolChangeJSON{Pool: name, Before: ch.Old, After: ch.New, Revision: ch.Revision})
	}
	fmt.Fprintf(e.stdout, "added a range to %s of pool %s; every allocation is kept\n  before: %s\n  after:  %s\n%s\n",
		setText(set), name, ch.Old, ch.New, configNote)
	return nil
}

func poolRemoveRange(ctx context.Context, e *env) error {
	name, err := poolArg(e.args[0])
	if err != nil {
		return err
	}
	if e.subnet == "" {
		return usagef("pool remove-range needs --subnet SUBNET[,start=ADDR] naming the range to remove")
	}
	rf, err := parseRange("subnet", e.subnet, "start", "set")
	if err != nil {
		return err
	}
	set := e.set
	if rf.set >= 0 {
		set = rf.set
	}
	if rf.r.Subnet != rf.r.Subnet.Masked() {
		return usagef("--subnet %s has host bits set; did you mean %s?", rf.r.Subnet, rf.r.Subnet.Masked())
	}
	ch, err := admin.RemoveRange(ctx, e.cli, name, set, rf.r)
	var inUse *admin.RangeInUseError
	if errors.As(err, &inUse) {
		if e.output == "json" {
			if werr := writeJSON(e.stdout, struct {
				Pool    string                  `json:"pool"`
				Range   allocator.Range         `json:"range"`
				Refused bool                    `json:"refused"`
				Holders []admin.AllocationEntry `json:"holders"`
			}{name, inUse.Range, true, inUse.Holders}); werr != nil {
				return werr
			}
			return err
		}
		return holdersError(e, inUse)
	}
	if err != nil {
		return err
	}
	if e.output == "json" {
		if err := writeJSON(e.stdout, poolChangeJSON{Pool: name, Before: ch.Old, After: ch.New, Revision: ch.Revision, Appeared: ch.Appeared}); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(e.stdout, "removed range %s from pool %s\n  before: %s\n  after:  %s\n%s\n",
			rf.r.Subnet, name, ch.Old, ch.New, configNote)
	}
	if len(ch.Appeared) > 0 {
		fmt.Fprintf(e.stderr, "WARNING: %d allocation(s) appeared in the removed range after the check (an agent re-claiming a pod's "+
			"addresses after a lost lease, or after finding its keys lost, does not compare the pool definition); they are now outside the pool:\n", len(ch.Appeared))
		for _, a := range ch.Appeared {
			fmt.Fprintf(e.stderr, "  %s owner %s pod %s cluster %s node %s\n", a.IP, a.Owner, podText(a.Pod), a.Cluster, a.Node)
		}
		return fmt.Errorf("range removed, but %d allocation(s) now lie outside pool %s; put the range back with "+
			"leaseholdctl pool add-range %s --range %s, or see leaseholdctl doctor", len(ch.Appeared), name, name, rangeArg(ch.Old, rf.r))
	}
	return nil
}

// holdersError prints the holders that keep a range from being removed as a table and
// returns the refusal.
func holdersError(e *env, inUse *admin.RangeInUseError) error {
	fmt.Fprintf(e.stdout, "refused: range %s of pool %s still has %d allocation(s); each pod's DEL releases them, "+
		"or leaseholdctl alloc release IP --pool %s once the pod is gone:\n\n", inUse.Range, inUse.Pool, len(inUse.Holders), inUse.Pool)
	t := newTable(e.stdout, "IP", "OWNER", "POD", "CLUSTER", "NODE", "CONTAINER", "LEASE")
	for _, h := range inUse.Holders {
		t.row(h.IP.String(), dash(h.Owner), podText(h.Pod), dash(h.Cluster), dash(h.Node), short(h.ContainerID), h.Lease)
	}
	if err := t.flush(); err != nil {
		return err
	}
	return fmt.Errorf("%w: range %s of pool %s (%d holder(s) listed above)", admin.ErrRangeInUse, inUse.Range, inUse.Pool, len(inUse.Holders))
}

// rangeArg spells the range of old that m names as a --range value, to put it back.
func rangeArg(old allocator.PoolSpec, m allocator.Range) string {
	for i, s := range old.Ranges {
		for _, r := range s {
			if r.Subnet == m.Subnet && (!m.RangeStart.IsValid() || r.RangeStart == m.RangeStart) {
				return fmt.Sprintf("%s,start=%s,end=%s,gw=%s,set=%d", r.Subnet, r.RangeStart, r.RangeEnd, r.Gateway, i)
			}
		}
	}
	return m.Subnet.String()
}
