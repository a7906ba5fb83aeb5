package leases

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
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
	// SpareLeases is how many pre-granted leases the keeper holds ready; default 8.
	SpareLeases int
	// OpTimeout bounds every etcd call; default 10s.
	OpTimeout time.Duration
	// GCGrace protects attachments created less than this long ago from CNI GC; default 10s.
	GCGrace time.Duration
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
	if err := validateNames("cluster", c.Cluster, "node", c.Node, "node UID", c.NodeUID); err != nil {
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
	locks  ownerLocks

	ctx    context.Context
	cancel context.CancelFunc

	mu        sync.Mutex
	pods      map[string]clientv3.LeaseID // owner -> pod lease this agent keeps alive
	nodeLease clientv3.LeaseID

	lastOK atomic.Int64 // unix nanos of the last etcd call that succeeded
}

// Start registers the node (its record on the agent's own lease) and returns a serving agent.
// cli stays the caller's; Close does not close it.
func Start(ctx context.Context, cli *clientv3.Client, cfg Config) (*Agent, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	actx, cancel := context.WithCancel(context.Background())
	a := &Agent{
		cfg:    cfg,
		cli:    cli,
		log:    cfg.Logger.With("cluster", cfg.Cluster, "node", cfg.Node),
		ctx:    actx,
		cancel: cancel,
		pods:   make(map[string]clientv3.LeaseID),
	}
	a.keeper = NewKeeper(cli, cfg.LeaseTTL, cfg.SpareLeases, a.log, a.leaseLost)
	a.pools = newPools(actx, cli, a.log)
	if err := a.register(ctx); err != nil {
		a.Close()
		return nil, err
	}
	return a, nil
}

// register writes the node record on a fresh node lease.
func (a *Agent) register(ctx context.Context) error {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	id, err := a.keeper.Take(octx)
	if err != nil {
		return fmt.Errorf("%w: register node %s in etcd: %w", allocator.ErrUnavailable, a.cfg.Node, err)
	}
	rec := NodeRecord{UID: a.cfg.NodeUID, Version: a.cfg.Version, Started: time.Now().UTC(), LeaseID: LeaseHex(id)}
	if _, err := a.cli.Put(octx, NodeKey(a.cfg.Cluster, a.cfg.Node), mustJSON(rec), clientv3.WithLease(id)); err != nil {
		return fmt.Errorf("%w: write node record %s: %w", allocator.ErrUnavailable, NodeKey(a.cfg.Cluster, a.cfg.Node), err)
	}
	a.mu.Lock()
	a.nodeLease = id
	a.mu.Unlock()
	a.ok()
	a.log.Info("node registered", "uid", a.cfg.NodeUID, "lease", LeaseHex(id))
	return nil
}

// Close stops the agent. Pod leases stop being renewed but are not revoked: a restarted
// agent with the same node identity adopts them, and otherwise they expire after their TTL.
func (a *Agent) Close() {
	a.cancel()
	a.mu.Lock()
	node := a.nodeLease
	a.mu.Unlock()
	if node != 0 {
		if err := a.keeper.Revoke(node); err != nil {
			a.log.Warn("revoke node lease", "err", err)
		}
	}
	a.keeper.Close()
}

// LeasesHeld is the number of leases this agent keeps alive (pods, node, spares).
func (a *Agent) LeasesHeld() int { return a.keeper.Held() }

func (a *Agent) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, a.cfg.OpTimeout)
}

func (a *Agent) ok() { a.lastOK.Store(time.Now().UnixNano()) }

// unavailable wraps an etcd error so that the runtime retries.
func (a *Agent) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

func (a *Agent) podLease(owner string) (clientv3.LeaseID, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	id, ok := a.pods[owner]
	return id, ok
}

func (a *Agent) setPodLease(owner string, id clientv3.LeaseID) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if id == 0 {
		delete(a.pods, owner)
		return
	}
	a.pods[owner] = id
}

// leaseLost runs when the keeper could not renew a lease in time: etcd has deleted (or
// will delete) every key on it.
func (a *Agent) leaseLost(id clientv3.LeaseID) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for owner, l := range a.pods {
		if l == id {
			delete(a.pods, owner)
			a.log.Error("pod lease lost; its addresses are no longer held", "owner", owner, "lease", LeaseHex(id))
		}
	}
}

// validate canonicalises the request's pool and checks every name that becomes a key part.
// It returns the owner ID.
func (a *Agent) validate(req *allocator.Request) (string, error) {
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
	if err := validateNames("container ID", req.ContainerID, "interface name", req.IfName, "owner", owner); err != nil {
		return "", err
	}
	return owner, nil
}
