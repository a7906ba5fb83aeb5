package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
)

// migrateJSON is the -o json output of pool migrate: the report, with the duration in seconds
// and, when the run failed, the error (the report then says how far it got).
type migrateJSON struct {
	admin.MigrateReport
	Seconds float64 `json:"seconds"`
	Error   string  `json:"error,omitempty"`
}

func poolMigrate(ctx context.Context, e *env) error {
	name, err := poolArg(e.args[0])
	if err != nil {
		return err
	}
	blocks, err := blockFlags(e)
	if err != nil {
		return err
	}
	var opts []admin.MigrateOption
	if !blocks.Flat() {
		opts = append(opts, admin.MigrateWithBlocks(blocks))
	}
	if e.force {
		opts = append(opts, admin.MigrateForce())
	}
	rep, err := admin.MigratePool(ctx, e.cli, name, migrator(), opts...)
	if e.output == "json" {
		out := migrateJSON{MigrateReport: rep, Seconds: rep.Duration.Seconds()}
		if err != nil {
			out.Error = err.Error()
		}
		if werr := writeJSON(e.stdout, out); werr != nil {
			return werr
		}
		return err
	}
	printMigration(e, rep, err)
	return err
}

func printMigration(e *env, rep admin.MigrateReport, err error) {
	sizes := blocksText(rep.Blocks)
	switch {
	case rep.AlreadyDone:
		fmt.Fprintf(e.stdout, "pool %s is already in the block layout (%s): nothing to do\n", rep.Pool, sizes)
		return
	case err != nil && rep.FrozenRevision == 0 && rep.MovedAllocations+rep.MovedQuarantine+rep.Gone+len(rep.Conflicts) == 0:
		return // refused before anything was written; the error says why
	}
	if rep.Resumed {
		fmt.Fprintf(e.stdout, "resumed the migration of pool %s, frozen at revision %d by an earlier run\n", rep.Pool, rep.FrozenRevision)
	} else if rep.FrozenRevision != 0 {
		fmt.Fprintf(e.stdout, "froze pool %s at revision %d (ADDs refused while its keys move)\n", rep.Pool, rep.FrozenRevision)
	}
	if rep.Forced {
		fmt.Fprintln(e.stdout, "forced: the check that every live agent serves blocks was skipped")
	}
	fmt.Fprintf(e.stdout, "moved %d allocation(s), %d quarantine key(s) and %d held key(s) to blocks of %s in %s\n",
		rep.MovedAllocations, rep.MovedQuarantine, rep.MovedHeld, sizes, rep.Duration.Round(time.Millisecond))
	if rep.Gone > 0 {
		fmt.Fprintf(e.stdout, "%d key(s) expired or were released before they could be moved\n", rep.Gone)
	}
	if len(rep.Conflicts) > 0 {
		fmt.Fprintf(e.stdout, "%d key(s) left in the flat layout because their block key exists:\n", len(rep.Conflicts))
		t := newTable(e.stdout, "IP", "KIND", "FLAT KEY", "BLOCK KEY")
		for _, c := range rep.Conflicts {
			kind := "allocation"
			switch {
			case c.Quarantine:
				kind = "quarantine"
			case c.Held:
				kind = "held"
			}
			t.row(c.IP.String(), kind, c.Old, c.New)
		}
		_ = t.flush()
	}
	switch {
	case err == nil && rep.Revision != 0:
		fmt.Fprintf(e.stdout, "pool %s unfrozen at revision %d: agents allocate in blocks from now on\n", rep.Pool, rep.Revision)
	case err != nil && rep.FrozenRevision != 0:
		fmt.Fprintf(e.stdout, "pool %s stays frozen (its ADDs are refused): run leaseholdctl pool migrate %s again once the error "+
			"below is dealt with\n", rep.Pool, rep.Pool)
	}
}

// migrator names who runs pool migrate, for the frozen definition's Migration.By.
func migrator() string {
	host, _ := os.Hostname()
	user := os.Getenv("USER")
	return "leaseholdctl " + dash(user) + "@" + dash(host)
}

// layoutName is "blocks" or "flat".
func layoutName(p admin.PoolEntry) string {
	if p.Value.Blocks.Flat() {
		return "flat"
	}
	return "blocks"
}

// layoutText describes a pool's layout for pool show and pool create.
func layoutText(p admin.PoolEntry) string {
	if p.Value.Blocks.Flat() {
		return "flat (run leaseholdctl pool migrate " + p.Name + " once every agent is upgraded)"
	}
	s := "blocks of " + blocksText(p.Value.Blocks)
	if m := p.Migrating; m != nil {
		s += fmt.Sprintf("; MIGRATING since %s by %s: ADDs are refused until leaseholdctl pool migrate %s completes",
			m.Since.UTC().Format(time.RFC3339), dash(m.By), p.Name)
	}
	return s
}

// layoutShort is the LAYOUT column of pool list.
func layoutShort(p poolJSON) string {
	switch {
	case p.Blocks.Flat():
		return "flat (run leaseholdctl pool migrate)"
	case p.Migrating != nil:
		return fmt.Sprintf("/%d,/%d MIGRATING", p.Blocks.IPv4, p.Blocks.IPv6)
	}
	return fmt.Sprintf("/%d,/%d", p.Blocks.IPv4, p.Blocks.IPv6)
}

func blocksText(b allocator.Blocks) string {
	if b.Flat() {
		return "none"
	}
	return fmt.Sprintf("/%d (IPv4) and /%d (IPv6)", b.IPv4, b.IPv6)
}
