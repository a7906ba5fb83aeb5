package admin

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Moving a pool from the flat layout to blocks (docs/proposals/blocks.md, "Upgrade from
// today's layout"). An agent claims an address by comparing its key absent; an agent of the
// flat layout and one of blocks would compare two different keys for one address and could
// both win. So the move is enforced, in three steps, each resumable:
//
//  1. Freeze: the definition is rewritten into the block shape (keyspace.PoolRecord) with
//     Migrating set. Agents from before blocks find no "ranges" in it and refuse the pool's
//     ADDs; new agents refuse them while Migrating is set. Refused while a live agent does not
//     serve blocks (its node record says so), unless forced.
//  2. Move: each flat key (allocation, quarantine and held key) goes to its block in a
//     transaction that compares it unchanged and its new key absent, and puts the same value on
//     the same lease: a pod's DEL that runs meanwhile finds its key off its lease and revokes
//     the lease, which takes the moved key.
//  3. Unfreeze: once no flat key is left, the definition is written without Migrating,
//     comparing that no key of the pool appeared since the listing that found none.

// migrateBatch is how many keys one move transaction carries: two compares and two requests
// each, within etcd's default limit of 128 operations per transaction.
const migrateBatch = 50

// migrateRounds bounds the list-and-move rounds of one run; keys released or written while
// the pool is frozen (quarantine keys of DELs) can make an unfreeze retry.
const migrateRounds = 10

// MigrateOption tunes MigratePool.
type MigrateOption func(*migrateConfig)

type migrateConfig struct {
	blocks allocator.Blocks
	force  bool
}

// MigrateWithBlocks sets the block lengths of a pool not yet frozen (a zero family gets
// allocator.DefaultBlocks' length). A frozen or migrated pool keeps the ones it stores.
func MigrateWithBlocks(b allocator.Blocks) MigrateOption {
	return func(c *migrateConfig) { c.blocks = b }
}

// MigrateForce skips the check that every live agent serves the block layout: for node
// records of agents known to be dead. Nothing else is skipped.
func MigrateForce() MigrateOption { return func(c *migrateConfig) { c.force = true } }

// MigrateReport is what MigratePool did.
type MigrateReport struct {
	Pool   string           `json:"pool"`
	Blocks allocator.Blocks `json:"blocks"`
	// AlreadyDone: the pool was in the block layout, not frozen, with no flat key: nothing to do.
	AlreadyDone bool `json:"alreadyDone"`
	// Resumed: an earlier run had frozen the pool; this one went on from there.
	Resumed bool `json:"resumed"`
	// Forced: the agent check was skipped.
	Forced           bool `json:"forced"`
	MovedAllocations int  `json:"movedAllocations"`
	MovedQuarantine  int  `json:"movedQuarantine"`
	// MovedHeld counts held keys moved (issue 23), with their allocation or, for an expired
	// address, alone.
	MovedHeld int `json:"movedHeld"`
	// Gone counts flat keys that expired or were released before they could be moved.
	Gone int `json:"gone"`
	// Conflicts are flat keys whose block key already exists: they were left where they are.
	Conflicts []MigrateConflict `json:"conflicts"`
	// FrozenRevision is the revision of the freezing write; Revision of the unfreezing one (0
	// when the pool stays frozen).
	FrozenRevision int64         `json:"frozenRevision"`
	Revision       int64         `json:"revision"`
	Duration       time.Duration `json:"-"`
}

// MigrateConflict is a flat key left in place because its key in the block layout exists.
type MigrateConflict struct {
	IP         netip.Addr `json:"ip"`
	Quarantine bool       `json:"quarantine"`
	// Held says the key is a held key (issue 23); with neither set it is an allocation.
	Held bool   `json:"held,omitempty"`
	Old  string `json:"old"`
	New  string `json:"new"`
}

// AgentsNotUpgradedError refuses a migration while live agents do not serve blocks.
type AgentsNotUpgradedError struct {
	Pool  string
	Nodes []NodeEntry
}

// Error names each agent: cluster/node, node UID, host and version.
func (e *AgentsNotUpgradedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v: pool %s stays as it is: %d live agent(s) do not serve the block layout, and one that keeps "+
		"allocating in the flat layout beside agents of blocks could give an address to two pods. Upgrade every agent first "+
		"(leaseholdctl node list shows them); if these records are of agents known to be dead, run again with --force:",
		ErrAgentsNotUpgraded, e.Pool, len(e.Nodes))
	for _, n := range e.Nodes {
		v := n.Value
		if n.Unreadable != "" {
			fmt.Fprintf(&b, "\n  %s/%s: unreadable node record %s (%s)", n.Cluster, n.Node, n.Key, n.Unreadable)
			continue
		}
		fmt.Fprintf(&b, "\n  %s/%s uid %s host %s version %s", n.Cluster, n.Node, dash(v.UID), dash(v.Host), dash(v.Version))
	}
	return b.String()
}

// Unwrap makes errors.Is(err, ErrAgentsNotUpgraded) true.
func (e *AgentsNotUpgradedError) Unwrap() error { return ErrAgentsNotUpgraded }

// MigratePool moves pool from the flat layout to blocks (allocator.DefaultBlocks unless
// MigrateWithBlocks says otherwise): freeze, move every flat key, unfreeze (see above). It is
// idempotent and resumable: a frozen pool is resumed, a migrated one is left alone, except
// that flat keys found in it are moved too. by is written into the freeze (Migration.By).
//
// The report is returned with every error, saying what was done. Errors wrap ErrNotFound (no
// such pool), ErrAgentsNotUpgraded (an *AgentsNotUpgradedError), allocator.ErrInvalidConfig
// (block lengths out of bounds, or other than a frozen pool's), ErrConcurrentChange (the
// definition changed, or keys kept appearing; run again), ErrMigrateConflicts (flat keys whose
// block key exists were left, listed in the report), or the etcd error. A pool frozen
// when an error occurs stays frozen: its ADDs are refused until a run completes.
func MigratePool(ctx context.Context, cli *clientv3.Client, pool, by string, opts ...MigrateOption) (rep MigrateReport, err error) {
	start := time.Now()
	defer func() { rep.Duration = time.Since(start) }()
	var cfg migrateConfig
	for _, o := range opts {
		o(&cfg)
	}
	rep = MigrateReport{Pool: pool, Forced: cfg.force, Conflicts: []MigrateConflict{}}
	if err := allocator.ValidateName("pool", pool); err != nil {
		return rep, err
	}
	if by == "" {
		by = "admin.MigratePool"
	}
	for range adminAttempts {
		p, err := readDefinition(ctx, cli, pool)
		if err != nil {
			return rep, err
		}
		spec := p.Value
		m := &mover{cli: cli, pool: pool, access: p.Access, blocks: spec.Blocks, rep: &rep, seen: map[string]bool{}}
		switch {
		case !spec.Blocks.Flat():
			rep.Blocks = spec.Blocks
			if want := cfg.blocks.WithDefaults(); !cfg.blocks.Flat() && want != spec.Blocks {
				return rep, fmt.Errorf("%w: pool %s already has blocks /%d and /%d (fixed once stored: every writer must derive "+
					"the same key for an address); run without --block-v4/--block-v6", allocator.ErrInvalidConfig, pool, spec.Blocks.IPv4, spec.Blocks.IPv6)
			}
			if p.Migrating == nil {
				// Migrated. No agent writes flat keys into a block pool, so leftovers move without a freeze.
				return rep, m.leftovers(ctx)
			}
			rep.Resumed, rep.FrozenRevision = true, p.ModRevision
		default:
			if !cfg.force {
				if err := checkAgents(ctx, cli, pool); err != nil {
					return rep, err
				}
			}
			spec.Blocks = allocator.DefaultBlocks
			if !cfg.blocks.Flat() {
				spec.Blocks = cfg.blocks
			}
			if err := spec.Canonicalize(); err != nil {
				return rep, err
			}
			rec := keyspace.NewPoolRecord(spec)
			rec.PoolAccess = p.Access
			rec.Migrating = &keyspace.Migration{By: by, Since: time.Now().UTC()}
			resp, err := cli.Txn(ctx).If(keyspace.Unchanged(p.Key, p.ModRevision)).Then(clientv3.OpPut(p.Key, keyspace.Encode(rec))).Commit()
			if err != nil {
				return rep, fmt.Errorf("freeze pool %s: %w", pool, err)
			}
			if !resp.Succeeded {
				continue // the definition changed since it was read
			}
			rep.Blocks, rep.FrozenRevision, m.blocks = spec.Blocks, resp.Header.Revision, spec.Blocks
		}
		if rep.Resumed && !cfg.force {
			if err := checkAgents(ctx, cli, pool); err != nil {
				return rep, fmt.Errorf("%w\n(pool %s stays frozen: its ADDs are refused until leaseholdctl pool migrate %s completes)", err, pool, pool)
			}
		}
		if err := m.run(ctx, p.Key, spec); err != nil {
			return rep, fmt.Errorf("%w\n(pool %s stays frozen: its ADDs are refused until leaseholdctl pool migrate %s completes)", err, pool, pool)
		}
		return rep, nil
	}
	return rep, fmt.Errorf("%w: the definition of pool %s kept changing while it was frozen; run again", ErrConcurrentChange, pool)
}

// readDefinition reads pool's definition; it must exist and be usable.
func readDefinition(ctx context.Context, cli *clientv3.Client, pool string) (PoolEntry, error) {
	st, err := ReadKeys(ctx, cli, keyspace.PoolKey(pool))
	if err != nil {
		return PoolEntry{}, err
	}
	p, ok := st.Pool(pool)
	switch {
	case !ok:
		return PoolEntry{}, fmt.Errorf("%w: pool %s has no definition (%s); see leaseholdctl pool list", ErrNotFound, pool, keyspace.PoolKey(pool))
	case p.Unreadable != "":
		return PoolEntry{}, fmt.Errorf("pool definition %s is unreadable (%s); inspect it with: etcdctl get %s", p.Key, p.Unreadable, p.Key)
	case p.Invalid != "":
		return PoolEntry{}, fmt.Errorf("pool definition %s is invalid: %s", p.Key, p.Invalid)
	}
	return p, nil
}

// checkAgents refuses while a live node record (one exists only while its node lease does)
// is of an agent that does not serve blocks, or cannot be read.
func checkAgents(ctx context.Context, cli *clientv3.Client, pool string) error {
	st, err := ReadKeys(ctx, cli, keyspace.NodesPrefix(""))
	if err != nil {
		return err
	}
	var old []NodeEntry
	for _, n := range st.Nodes {
		if n.Unreadable != "" || !n.Value.Blocks {
			old = append(old, n)
		}
	}
	if len(old) > 0 {
		return &AgentsNotUpgradedError{Pool: pool, Nodes: old}
	}
	return nil
}
