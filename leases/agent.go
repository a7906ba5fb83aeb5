package leases

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/pause"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/attach"
	"github.com/leasehold/leasehold/leases/audit"
	"github.com/leasehold/leasehold/leases/claimloop"
	"github.com/leasehold/leasehold/leases/conflicts"
	"github.com/leasehold/leasehold/leases/etcdgate"
	"github.com/leasehold/leasehold/leases/imports"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/node"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/reclaim"
	"github.com/leasehold/leasehold/leases/release"
	"github.com/leasehold/leasehold/leases/restorehold"
	"github.com/leasehold/leasehold/leases/restorenotice"
	"github.com/leasehold/leasehold/leases/rules"
	"github.com/leasehold/leasehold/leases/sticky"
	"github.com/leasehold/leasehold/leases/txn"
)

// Agent is the node agent's service: it allocates, checks and releases addresses for the
// sandboxes of one node, holding their leases. Its methods are the agentapi.Service that the
// CNI logic (package cniplugin) calls in-process for each forwarded plugin invocation.
type Agent struct {
	cfg    Config
	cli    *clientv3.Client
	log    *slog.Logger
	keeper *keeper.Keeper
	pools  *poolview.Pools
	// rules are the selection rules and the pools an ADD chooses by; attach makes the ADDs
	// (leases/attach).
	rules  *rules.Follower
	attach *attach.Attachments
	// blockLeases hold this node's block claims (blocks.go).
	blockLeases *blockLeases
	claims      *txn.Batcher
	// loops makes the claim loops of ADD, import and re-claim (leases/claimloop).
	loops *claimloop.Claims
	locks ownerlock.Locks

	ctx    context.Context
	cancel context.CancelFunc

	jw     *podbook.Writer
	unlock func() // releases the state directory's lock
	wg     sync.WaitGroup
	// recovery re-claims what was lost and releases gone sandboxes (leases/reclaim); notices
	// acts on etcd going back in time (leases/restorenotice).
	recovery *reclaim.Reclaimer
	notices  *restorenotice.Notices

	pods *podbook.Book
	// self is this node: its identity, its record and the record's lease (leases/node).
	self *node.Self
	// cwatch follows each conflicted address of this node's pods (leases/conflicts).
	cwatch *conflicts.Watch
	// imports claims what other IPAM plugins gave running containers (leases/imports).
	imports *imports.Importer
	// release is the agent's DEL, GC and CHECK (leases/release).
	release *release.Releaser

	// gate sees every answer of etcd (cli is its client); hold is what the agent does while
	// it repairs what etcd going back in time took (leases/restorehold); audit checks every
	// key the agent keeps (leases/audit).
	gate  *etcdgate.Gate
	hold  *restorehold.Hold
	audit *audit.Auditor
	// sticky holds the sticky claims (leases/sticky).
	sticky *sticky.Claims

	metrics   *metrics
	started   time.Time    // when the agent started (release.Config.Started)
	conflicts atomic.Int64 // addresses found taken by another owner on re-claim

	stopped   chan struct{} // closed when the agent stops itself (fail)
	stopOnce  sync.Once
	closeOnce sync.Once
	stopErr   error
}

// Start registers the node (its record on the agent's own lease) and returns a serving agent.
// cli stays the caller's; Close does not close it.
func Start(ctx context.Context, cli *clientv3.Client, cfg Config) (*Agent, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	unlock := func() {}
	if cfg.StateDir != "" {
		if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
			return nil, fmt.Errorf("state directory %s: %w (give --state-dir a writable directory)", cfg.StateDir, err)
		}
		var err error
		if unlock, err = node.LockStateDir(cfg.StateDir); err != nil {
			return nil, err
		}
	}
	actx, cancel := context.WithCancel(context.Background())
	var a *Agent // the gate's signals reach it once made, before any request passes the gate
	gate := etcdgate.New(actx, cli, etcdgate.Config{Probe: keyspace.NodeKey(cfg.Cluster, cfg.Node), ProbeTimeout: probeTimeout,
		WentBack:        func(why string, from time.Time) { a.notices.EtcdWentBackFrom(why, from) },
		MayHaveGoneBack: func(why string) { a.notices.EtcdMayHaveGoneBack(why) }})
	a = &Agent{
		unlock:  unlock,
		cfg:     cfg,
		cli:     gate.Client(),
		gate:    gate,
		hold:    restorehold.New(cfg.LeaseTTL, 2*cfg.LeaseTTL, cfg.LeaseTTL+cfg.ReuseDelay),
		log:     cfg.Logger.With("cluster", cfg.Cluster, "node", cfg.Node),
		ctx:     actx,
		cancel:  cancel,
		jw:      podbook.NewWriter(cfg.StateDir, cfg.Logger),
		started: time.Now(),
		stopped: make(chan struct{}),
	}
	a.pods = podbook.New(cfg.NodeUID, a.jw)
	a.metrics = newMetrics(a)
	a.claims = txn.NewBatcher(a.cli, txn.BatcherConfig{Timeout: cfg.OpTimeout, OnBatch: a.metrics.batched})
	k, err := keeper.New(a.cli, keeper.Config{TTL: cfg.LeaseTTL, Spares: cfg.SpareLeases, OpTimeout: cfg.OpTimeout,
		Log: a.log, OnLost: a.leaseLost, OnHeard: gate.Heard})
	if err != nil {
		cancel()
		unlock()
		return nil, err
	}
	a.keeper = k
	a.self = &node.Self{Record: node.Record{KV: a.cli,
		ID:   node.Identity{Cluster: cfg.Cluster, Node: cfg.Node, UID: cfg.NodeUID, Host: cfg.Host, Version: cfg.Version},
		Take: k.Take, Return: k.Return, Refill: k.Refill,
		// The block leases are made below; the node record names the block lease.
		AdoptBlockLease: func(ctx context.Context, id clientv3.LeaseID) error { return a.blockLeases.adopt(ctx, id) },
		BlockLease:      func(ctx context.Context) (clientv3.LeaseID, error) { return a.blockLeases.get(ctx) },
		OpTimeout:       cfg.OpTimeout, Wall: a.wall, Log: a.log}}
	a.loops = claimloop.New(claimloop.Config{Keeper: k, Pods: a.pods, Log: a.log, OpTimeout: cfg.OpTimeout,
		HeldLeaseGone: func(ctx context.Context, id clientv3.LeaseID) bool { return a.attach.HeldLeaseGone(ctx, id) },
		Lost:          func() { a.recovery.Wake() }})
	a.audit = a.newAuditor()
	a.sticky = sticky.New(a.cli, k, a.pods, &a.locks, sticky.Config{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID,
		ClaimHold: cfg.ClaimHold, LeaseTTL: cfg.LeaseTTL, Quarantine: cfg.Quarantine, OpTimeout: cfg.OpTimeout,
		WallClock: cfg.WallClock, StateDir: cfg.StateDir, Log: a.log,
		Layout: func(ctx context.Context, name string) (allocator.Blocks, bool, error) {
			p, err := a.pools.Ensure(ctx, allocator.PoolSpec{Name: name})
			if err != nil {
				return allocator.Blocks{}, false, err
			}
			return p.Spec.Blocks, p.Migrating != nil, nil
		},
		RestoreGen: a.hold.Pending, AuditDue: a.audit.MarkDue, LeaseAlive: a.audit.LeaseAlive,
		Refused: a.metrics.claimsRefused, KeysLost: a.metrics.podKeysLost, Live: a.metrics.live, LiveMigrationBound: cfg.LiveMigrationBound,
		HeldLease: func(ctx context.Context) (clientv3.LeaseID, error) {
			id, _, err := a.attach.HeldFor(ctx, "")
			return id, err
		},
		HeldLeaseGone: func(ctx context.Context, id clientv3.LeaseID) bool { return a.attach.HeldLeaseGone(ctx, id) }})
	a.metrics.live.Watch(a.sticky.MigrationsSince)
	a.sticky.ResumeReleases()
	hooks := poolview.Hooks{Settling: a.hold.Settling, Generation: a.hold.Generation,
		Put: a.audit.Keys().Put, Deleted: a.audit.Keys().Deleted, Listed: a.audit.Keys().Listed}
	if st, ok, err := restorenotice.LoadSettle(cfg.StateDir, time.Now()); err != nil {
		a.log.Warn("the saved settle time after etcd went back in time is unreadable; it is not resumed", "err", err)
	} else if ok {
		a.hold.ResumeSettle(st.Noticed, st.Until, st.Why)
		hooks.Settled = &poolview.Settled{Until: st.Until, Kept: st.Kept, Restored: st.Restored}
		a.log.Warn("resuming the settle time after etcd went back in time: no new block, no borrowing, and the "+
			"addresses kept before the restart stay kept", "until", st.Until.UTC().Format(time.RFC3339), "why", st.Why)
	}
	a.blockLeases = newBlockLeases(k, blockLeaseTTL(cfg))
	a.blockLeases.granted = func(id clientv3.LeaseID) {
		// The node record names the block lease a restart adopts: once the claims and held
		// keys go on a new one (the last was lost: a cut-off longer than its TTL, or a
		// restore of a backup from before its grant), the record is written again.
		if node := a.self.Lease(); node != 0 && a.keeper.Holds(node) {
			a.log.Warn("new block lease; the node record will be written again, naming it", "lease", keyspace.LeaseHex(id))
			a.keeper.Forget(node)
			a.recovery.Wake()
		}
	}
	own := &poolview.Owner{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID,
		Lease: a.blockLeases.get, Adopt: a.blockLeases.adopt, Mine: a.blockLeases.mine,
		Idle: cfg.BlockIdle, OpTimeout: cfg.OpTimeout, HoldBack: cfg.ReuseDelay > 0, Wall: cfg.WallClock,
		Metrics: poolview.Metrics{BlockClaims: a.metrics.blockClaims, BlocksGivenBack: a.metrics.blocksGivenBack,
			Borrowed: a.metrics.borrowed, ExpiredReused: a.metrics.expiredReused},
		LostLease: func(id clientv3.LeaseID) {
			// A claim's transaction found it gone: its claims went with it.
			a.keeper.Forget(id)
			a.blockLeaseLost(id)
		}}
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%s/%s", cfg.Cluster, cfg.Node, cfg.NodeUID)
	a.pools = poolview.NewPools(actx, a.cli, a.log, poolview.Config{Seed: h.Sum64(), OnMismatch: a.recordPoolConflict,
		Owner: own, Hooks: hooks})
	a.audit.SetPools(a.pools) // made after the audit, whose OwnKeys the views are handed
	a.rules = rules.New(a.cli, rules.Config{Cluster: cfg.Cluster, Log: a.log, PoolChanged: a.pools.Invalidate})
	a.attach = a.newAttachments()
	// The conflict watch is made once the pools are: it resolves a conflict in a pool's view.
	a.cwatch = conflicts.New(actx, a.cli, a.pods, &a.locks, a.pools, conflicts.Config{Cluster: cfg.Cluster,
		OpTimeout: cfg.OpTimeout, Log: a.log, HeldFor: a.attach.HeldFor, Allocation: a.attach.Allocation,
		Mine: a.blockLeases.mine, KeepClaim: a.sticky.KeepClaimLocked, Open: a.metrics.conflictsOpen,
		Resolved: a.metrics.conflictsResolved, HistoryStart: a.gate.HistoryStart})
	a.imports = a.newImporter()
	a.release = a.newReleaser()
	a.recovery, a.notices = a.newRecovery()
	a.wg.Go(func() { a.rules.Run(actx) })
	octx, ocancel := a.opCtx(ctx)
	release, err := node.LockIdentity(octx, a.cli, a.self.Record.ID)
	ocancel()
	if err != nil {
		a.Close()
		return nil, err
	}
	a.unlock = func() { release(); unlock() }
	if err := a.self.Register(ctx); err != nil {
		a.Close()
		return nil, err
	}
	if err := a.recover(ctx); err != nil {
		a.Close()
		return nil, err
	}
	// Another agent's word that etcd went back in time is read before the first ADD: an agent
	// started during the settle time (a node replaced, a state directory lost) settles too.
	restoredRev := a.notices.ReadRestored(ctx)
	a.resumeBlocks(ctx)
	a.wg.Go(func() { a.followAdopted(actx) })
	a.sticky.ResumeClaims(ctx)
	a.recovery.Start()
	a.wg.Go(func() { a.audit.GoneLoop(actx) })
	a.notices.Start(restoredRev)
	if cfg.PublishHostAddrs {
		hosts := node.Hosts{KV: a.cli, ID: a.self.Record.ID, Netns: cfg.HostNetns, Resync: cfg.HostResync, OpTimeout: cfg.OpTimeout,
			Lease: a.self.Lease, Wall: a.wall, Log: a.log}
		a.wg.Go(func() { hosts.Publish(actx) })
	}
	return a, nil
}

// fail stops the agent from inside: it stops serving, logs why, and closes Stopped. The
// process is expected to exit with Err.
func (a *Agent) fail(err error) {
	a.stopOnce.Do(func() {
		a.stopErr = err
		a.log.Error("agent stops", "err", err)
		close(a.stopped)
		a.cancel()
	})
}

// Stopped is closed when the agent stopped itself; Err says why.
func (a *Agent) Stopped() <-chan struct{} { return a.stopped }

// Err is why the agent stopped itself, once Stopped is closed.
func (a *Agent) Err() error {
	select {
	case <-a.stopped:
		return a.stopErr
	default:
		return nil
	}
}

// Close stops the agent. Pod leases stop being renewed but are not revoked: a restarted
// agent with the same node identity adopts them, and otherwise they expire after their TTL.
// So does the node record, which names the block lease the restart adopts. An agent that
// stops with no pod left leaves at once: its node lease and block leases are revoked, and
// its blocks are free (the reuse delay is for the addresses of pods that may still run).
// Closing again does nothing.
func (a *Agent) Close() {
	a.closeOnce.Do(func() {
		a.cancel()
		a.wg.Wait()
		a.recovery.Wait()
		a.notices.Wait()
		a.cwatch.Wait()
		if a.pods.Count() == 0 && a.Err() == nil {
			if err := a.blockLeases.revokeAll(); err != nil {
				a.log.Warn("giving this node's blocks back failed; they return to the pool when their lease expires", "err", err)
			}
			if node := a.self.Lease(); node != 0 {
				if err := a.keeper.Revoke(node); err != nil {
					a.log.Warn("revoke node lease", "err", err)
				}
			}
		}
		a.keeper.Close()
		a.jw.Close()
		a.unlock()
	})
}

// LeasesHeld is the number of leases this agent keeps alive (pods, node, spares).
func (a *Agent) LeasesHeld() int { return a.keeper.Held() }

func (a *Agent) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, a.cfg.OpTimeout)
}

// reachable tells whether etcd answers, asking it when it was silent for reachAfter
// (etcdgate.Gate.Answers): an ADD or DEL asks it first.
func (a *Agent) reachable(ctx context.Context) error {
	if err := a.gate.Answers(ctx, keyspace.NodeKey(a.cfg.Cluster, a.cfg.Node), reachAfter); err != nil {
		return fmt.Errorf("%w: %w", allocator.ErrUnavailable, err)
	}
	return nil
}

// wall is the time written into records; see Config.WallClock.
func (a *Agent) wall() time.Time { return a.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries.
func unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// recordPoolConflict leaves a refused pool definition under /leasehold/v1/poolconflicts/
// on the node lease, so that the clusters already using the pool hear of it (their agents
// log it) and leaseholdctl lists it; it leaves with this node.
func (a *Agent) recordPoolConflict(ctx context.Context, wanted, stored allocator.PoolSpec) {
	lease := a.self.Lease()
	rec := keyspace.PoolConflictRecord{Cluster: a.cfg.Cluster, Node: a.cfg.Node, Wanted: wanted, Stored: stored, Detected: a.wall()}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	if _, err := a.cli.Put(octx, keyspace.PoolConflictKey(stored.Name, a.cfg.Cluster, a.cfg.Node), keyspace.Encode(rec), clientv3.WithLease(lease)); err != nil {
		a.log.Warn("could not record the pool definition conflict", "pool", stored.Name, "err", err)
	}
	a.log.Error("pool definition conflict: this node's configuration defines the pool differently from etcd",
		"pool", stored.Name, "stored", stored.String(), "wanted", wanted.String())
}

// Conflicts is how many addresses this agent found held by another owner when it
// re-claimed a lost lease.
func (a *Agent) Conflicts() int64 { return a.conflicts.Load() }

// leaseLost runs when the keeper could not renew a lease in time: etcd has deleted (or
// will delete) every key on it. The pods on it are queued for re-claim.
func (a *Agent) leaseLost(id clientv3.LeaseID) {
	a.metrics.leaseLost.Inc()
	if a.blockLeaseLost(id) {
		return
	}
	if slices.Contains(a.pods.ClaimLeases(), id) {
		// A sticky claim's: the audit puts the claim back, on the lease if etcd still has it.
		a.log.Error("the claim lease of a running pod's sticky claim stopped being renewed; checking the claim",
			"lease", keyspace.LeaseHex(id))
		a.recovery.CheckNow()
		return
	}
	node := a.self.Lease() == id
	owners := a.pods.Lose(id)
	for _, owner := range owners {
		a.log.Error("pod lease lost; its addresses will be re-claimed", "owner", owner, "lease", keyspace.LeaseHex(id))
	}
	n := len(owners)
	if node {
		a.log.Error("node lease lost; the node record will be written again", "lease", keyspace.LeaseHex(id))
	}
	if node || n > 0 {
		a.recovery.Wake()
	}
}

// blockLeaseLost drops, in every pool, the block claims on lease id if it is a block lease,
// which etcd no longer has, and has the recovery put back the held keys of the running pods
// that went with it; it reports whether it was one.
func (a *Agent) blockLeaseLost(id clientv3.LeaseID) bool {
	if !a.blockLeases.lost(id) {
		return false
	}
	a.pools.ForEachView(func(v *poolview.View) { v.Claims().LeaseLost(id) })
	a.recovery.HeldLost()
	return true
}

// validate canonicalises the request's pool and checks every name that becomes a key part.
// It returns the owner ID.
func (a *Agent) validate(req *allocator.Request) (string, error) {
	if err := a.Err(); err != nil {
		return "", fmt.Errorf("%w: the agent has stopped: %w", allocator.ErrUnavailable, err)
	}
	if req.Pool.Name == "" {
		req.Pool.Name = req.Network
	}
	if len(req.Pool.Ranges) > 0 {
		if err := req.Pool.Canonicalize(); err != nil {
			return "", err
		}
	} else if err := allocator.ValidateName("pool", req.Pool.Name); err != nil {
		return "", err
	}
	owner := req.OwnerID()
	if err := keyspace.ValidateNames("container ID", req.ContainerID, "interface name", req.IfName, "owner", owner); err != nil {
		return "", err
	}
	return owner, nil
}

// sleepCtx waits d, or until ctx ends: it reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	return pause.For(ctx, d)
}
