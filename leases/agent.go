package leases

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Config is what an agent needs to know about its node and its policies.
type Config struct {
	// Cluster, Node and NodeUID are the node identity. Only an agent with the same three
	// values ever renews, adopts or releases the leases this agent grants.
	Cluster string
	Node    string
	NodeUID string
	// LeaseTTL is the TTL of pod leases and of the node lease; default DefaultLeaseTTL.
	LeaseTTL time.Duration
	// Quarantine is how long a released address rests before reuse; 0 uses DefaultQuarantine,
	// a negative value disables quarantine.
	Quarantine time.Duration
	// SpareLeases is how many pre-granted leases the keeper holds ready; default 8. The keeper
	// tops them up once half are taken.
	SpareLeases int
	// OpTimeout bounds every etcd call; default 10s.
	OpTimeout time.Duration
	// GCGrace protects attachments created less than this long ago from CNI GC; default
	// 10s, negative for none.
	GCGrace time.Duration
	// StateDir holds the local journal of this node's pods (one file each); empty keeps
	// none, and a restart after a lease loss then cannot re-claim.
	StateDir string
	// LivenessInterval is how often the agent looks for sandboxes whose network namespace
	// is gone; default 10s, negative disables.
	LivenessInterval time.Duration
	// LivenessGrace protects a pod from the liveness check this long after an ADD; default 30s.
	LivenessGrace time.Duration
	// PublishHostAddrs makes the agent publish the node's own addresses under
	// /leasehold/v1/hostips/, so that no pool hands them out (seed 000).
	PublishHostAddrs bool
	// HostNetns is the network namespace whose addresses are the node's; "" is the
	// agent's own (host networking).
	HostNetns string
	// HostResync is how often the host addresses are listed again besides following
	// netlink events; default 15s.
	HostResync time.Duration
	// Host names the machine and boot this agent runs on; default DefaultHost (hostname and
	// boot ID). Two agents with one node identity on different hosts are refused (see
	// register); the same host may take over from its own previous process.
	Host string
	// WallClock gives the timestamps written into records (created, detected, started);
	// default time.Now. Nothing the agent decides reads it: ages, deadlines and grace
	// periods use the monotonic clock and leases use etcd's, so a stepped clock changes
	// only what the records say. Tests step it to show that.
	WallClock func() time.Time
	// Version is the agent version written into the node record.
	Version string
	Logger  *slog.Logger
}

// Defaults, justified in ARCHITECTURE.md ("Lease lifecycle").
const (
	DefaultLeaseTTL   = 90 * time.Second
	DefaultQuarantine = 30 * time.Second
)

func (c *Config) fill() error {
	if err := keyspace.ValidateNames("cluster", c.Cluster, "node", c.Node, "node UID", c.NodeUID); err != nil {
		return err
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.LeaseTTL < 2*time.Second {
		return fmt.Errorf("%w: lease TTL %s is shorter than etcd's minimum of 2s", allocator.ErrInvalidConfig, c.LeaseTTL)
	}
	if c.Quarantine == 0 {
		c.Quarantine = DefaultQuarantine
	}
	if c.SpareLeases <= 0 {
		c.SpareLeases = 8
	}
	if c.OpTimeout <= 0 {
		c.OpTimeout = 10 * time.Second
	}
	if c.GCGrace == 0 {
		c.GCGrace = 10 * time.Second
	}
	if c.LivenessInterval == 0 {
		c.LivenessInterval = 10 * time.Second
	}
	if c.LivenessGrace == 0 {
		c.LivenessGrace = 30 * time.Second
	}
	if c.HostResync <= 0 {
		c.HostResync = 15 * time.Second
	}
	if c.StateDir != "" {
		if err := os.MkdirAll(c.StateDir, 0o700); err != nil {
			return fmt.Errorf("state directory %s: %w (give --state-dir a writable directory)", c.StateDir, err)
		}
	}
	if c.Host == "" {
		c.Host = DefaultHost()
	}
	if c.WallClock == nil {
		c.WallClock = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Agent is the node agent's service: it allocates, checks and releases addresses for the
// sandboxes of one node, holding their leases. Its methods satisfy the plugin's agent API.
type Agent struct {
	cfg    Config
	cli    *clientv3.Client
	log    *slog.Logger
	keeper *Keeper
	pools  *pools
	claims *claimBatcher
	locks  ownerLocks

	ctx    context.Context
	cancel context.CancelFunc

	journal journal
	jw      *journalWriter
	unlock  func()        // releases the state directory's lock
	lost    chan struct{} // wakes the re-claim loop
	wg      sync.WaitGroup

	pods        *pods
	nodeLeaseID atomic.Int64 // the node record's lease; 0 before registration

	metrics   *metrics
	started   time.Time    // monotonic origin of lastOK
	lastOK    atomic.Int64 // monotonic nanoseconds after started of the last etcd call that succeeded
	conflicts atomic.Int64 // addresses found taken by another owner on re-claim

	stopped  chan struct{} // closed when the agent stops itself (fail)
	stopOnce sync.Once
	stopErr  error
}

// Start registers the node (its record on the agent's own lease) and returns a serving agent.
// cli stays the caller's; Close does not close it.
func Start(ctx context.Context, cli *clientv3.Client, cfg Config) (*Agent, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	unlock := func() {}
	if cfg.StateDir != "" {
		var err error
		if unlock, err = lockStateDir(cfg.StateDir); err != nil {
			return nil, err
		}
	}
	actx, cancel := context.WithCancel(context.Background())
	a := &Agent{
		unlock:  unlock,
		cfg:     cfg,
		cli:     cli,
		log:     cfg.Logger.With("cluster", cfg.Cluster, "node", cfg.Node),
		ctx:     actx,
		cancel:  cancel,
		journal: journal{dir: cfg.StateDir},
		jw:      newJournalWriter(journal{dir: cfg.StateDir}, cfg.Logger),
		lost:    make(chan struct{}, 1),
		started: time.Now(),
		stopped: make(chan struct{}),
	}
	a.pods = newPods(cfg.NodeUID, a.jw)
	a.metrics = newMetrics(a)
	a.claims = &claimBatcher{cli: cli, timeout: cfg.OpTimeout, m: a.metrics}
	a.keeper = NewKeeper(cli, cfg.LeaseTTL, cfg.SpareLeases, a.log, a.leaseLost)
	a.pools = newPools(actx, cli, a.log)
	a.pools.onMismatch = a.recordPoolConflict
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%s/%s", cfg.Cluster, cfg.Node, cfg.NodeUID)
	a.pools.seed = h.Sum64()
	if err := a.lockIdentity(ctx); err != nil {
		a.Close()
		return nil, err
	}
	if err := a.register(ctx); err != nil {
		a.Close()
		return nil, err
	}
	if err := a.recover(ctx); err != nil {
		a.Close()
		return nil, err
	}
	a.wg.Add(2)
	go a.reclaimLoop()
	go a.livenessLoop()
	if cfg.PublishHostAddrs {
		a.wg.Add(1)
		go a.publishHosts(actx)
	}
	return a, nil
}

// lockIdentity takes the host-wide lock on this node identity against the etcd cluster
// the client talks to (see lockIdentity in lock.go).
func (a *Agent) lockIdentity(ctx context.Context) error {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	resp, err := a.cli.Get(octx, keyspace.NodeKey(a.cfg.Cluster, a.cfg.Node), clientv3.WithCountOnly())
	if err != nil {
		return fmt.Errorf("%w: ask etcd for its cluster ID: %w", allocator.ErrUnavailable, err)
	}
	release, err := lockIdentity(resp.Header.ClusterId, &a.cfg)
	if err != nil {
		return err
	}
	prev := a.unlock
	a.unlock = func() { release(); prev() }
	return nil
}

// register writes the node record on a fresh node lease. The record is this node
// identity's claim: it is created if absent, and replaced (compared by revision) only when it
// names another node UID (a same-name replacement, seed 002) or this very host (this agent's
// own previous process, dead since this one holds the host-wide lock on the identity). A live record
// with this node UID from another host means two machines run one node identity: both would
// renew, adopt and release the same pods, so the agent refuses with ErrAgentRunning.
func (a *Agent) register(ctx context.Context) error {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	defer a.keeper.Refill()
	id, err := a.keeper.Take(octx)
	if err != nil {
		return fmt.Errorf("%w: register node %s in etcd: %w", allocator.ErrUnavailable, a.cfg.Node, err)
	}
	key := keyspace.NodeKey(a.cfg.Cluster, a.cfg.Node)
	rec := keyspace.NodeRecord{UID: a.cfg.NodeUID, Host: a.cfg.Host, PID: os.Getpid(), Version: a.cfg.Version,
		Started: a.wall(), LeaseID: keyspace.LeaseHex(id)}
	for attempt := 0; ; attempt++ {
		cur, err := a.cli.Get(octx, key)
		if err != nil {
			a.keeper.Return(id)
			return fmt.Errorf("%w: read node record %s: %w", allocator.ErrUnavailable, key, err)
		}
		cmp := keyspace.Absent(key)
		if len(cur.Kvs) > 0 {
			kv := cur.Kvs[0]
			var old keyspace.NodeRecord
			// A record without a host is an earlier version's: its host is unknown, and refusing
			// would keep a restarted node down for a TTL after an upgrade.
			if json.Unmarshal(kv.Value, &old) == nil && old.UID == a.cfg.NodeUID && old.Host != "" && old.Host != a.cfg.Host && kv.Lease != 0 {
				a.keeper.Return(id)
				return fmt.Errorf("%w: node %q of cluster %q with node UID %q is already served by an agent on host %q "+
					"(pid %d, started %s, lease %s), and this agent runs on host %q; stop one of them or give them "+
					"different --node-uid values (the record expires within the lease TTL once that agent stops)",
					ErrAgentRunning, a.cfg.Node, a.cfg.Cluster, a.cfg.NodeUID, old.Host, old.PID,
					old.Started.Format(time.RFC3339), old.LeaseID, a.cfg.Host)
			}
			if old.UID != a.cfg.NodeUID && old.UID != "" {
				a.log.Warn("node record of another node UID replaced (a same-name replacement)", "previous_uid", old.UID,
					"previous_host", old.Host)
			}
			cmp = keyspace.Unchanged(key, kv.ModRevision)
		}
		resp, err := a.cli.Txn(octx).If(cmp).Then(clientv3.OpPut(key, keyspace.Encode(rec), clientv3.WithLease(id))).Commit()
		if err != nil {
			a.keeper.Return(id)
			return fmt.Errorf("%w: write node record %s: %w", allocator.ErrUnavailable, key, err)
		}
		if resp.Succeeded {
			break
		}
		if attempt == 4 {
			a.keeper.Return(id)
			return fmt.Errorf("%w: node record %s changed under every one of 5 attempts", ErrAgentRunning, key)
		}
	}
	a.nodeLeaseID.Store(int64(id))
	a.ok()
	a.log.Info("node registered", "uid", a.cfg.NodeUID, "host", a.cfg.Host, "lease", keyspace.LeaseHex(id))
	return nil
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
func (a *Agent) Close() {
	a.cancel()
	a.wg.Wait()
	if node := a.nodeLease(); node != 0 {
		if err := a.keeper.Revoke(node); err != nil {
			a.log.Warn("revoke node lease", "err", err)
		}
	}
	a.keeper.Close()
	a.jw.close()
	a.unlock()
}

// LeasesHeld is the number of leases this agent keeps alive (pods, node, spares).
func (a *Agent) LeasesHeld() int { return a.keeper.Held() }

// nodeLease is the node record's lease; 0 before the node is registered.
func (a *Agent) nodeLease() clientv3.LeaseID { return clientv3.LeaseID(a.nodeLeaseID.Load()) }

func (a *Agent) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, a.cfg.OpTimeout)
}

func (a *Agent) ok() { a.lastOK.Store(int64(time.Since(a.started))) }

// sinceOK is how long ago an etcd call last succeeded, on the monotonic clock.
func (a *Agent) sinceOK() time.Duration {
	return time.Since(a.started) - time.Duration(a.lastOK.Load())
}

// wall is the time written into records; see Config.WallClock.
func (a *Agent) wall() time.Time { return a.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries.
func (a *Agent) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// recordPoolConflict leaves a refused pool definition under /leasehold/v1/poolconflicts/
// on the node lease, so that the clusters already using the pool hear of it (their agents
// log it) and leaseholdctl lists it; it leaves with this node.
func (a *Agent) recordPoolConflict(ctx context.Context, wanted, stored allocator.PoolSpec) {
	lease := a.nodeLease()
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
	node := a.nodeLease() == id
	owners := a.pods.lose(id)
	for _, owner := range owners {
		a.log.Error("pod lease lost; its addresses will be re-claimed", "owner", owner, "lease", keyspace.LeaseHex(id))
	}
	n := len(owners)
	if node {
		a.log.Error("node lease lost; the node record will be written again", "lease", keyspace.LeaseHex(id))
	}
	if node || n > 0 {
		select {
		case a.lost <- struct{}{}:
		default:
		}
	}
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
