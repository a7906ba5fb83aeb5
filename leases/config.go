package leases

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/node"
)

// Config is what an agent needs to know about its node and its policies.
type Config struct {
	// Cluster, Node and NodeUID are the node identity. Only an agent with the same three
	// values ever renews, adopts or releases the leases this agent grants.
	Cluster string
	Node    string
	NodeUID string
	// NodeLabels are the node's labels as the agent is given them at start (--node-label):
	// selection rules choose a node's pools by them, without a Kubernetes API client.
	NodeLabels map[string]string
	// LeaseTTL is the TTL of pod leases and of the node lease; default DefaultLeaseTTL.
	LeaseTTL time.Duration
	// Quarantine is how long a released address rests before reuse; 0 uses DefaultQuarantine,
	// a negative value disables quarantine.
	Quarantine time.Duration
	// SpareLeases is how many pre-granted leases the keeper holds ready; default
	// DefaultSpareLeases. The keeper tops them up once half are taken.
	SpareLeases int
	// OpTimeout bounds every etcd call the agent makes for a request or on its own; default
	// DefaultOpTimeout.
	OpTimeout time.Duration
	// GCGrace protects attachments created less than this long ago from CNI GC; default
	// DefaultGCGrace, negative for none.
	GCGrace time.Duration
	// StateDir holds the local journal of this node's pods (one file, <dir>/journal); empty keeps
	// none, and a restart after a lease loss then cannot re-claim.
	StateDir string
	// LivenessInterval is how often the agent looks for sandboxes whose network namespace
	// is gone; default DefaultLivenessInterval, negative disables.
	LivenessInterval time.Duration
	// LivenessGrace protects a pod from the liveness check this long after an ADD; default
	// DefaultLivenessGrace.
	LivenessGrace time.Duration
	// PublishHostAddrs makes the agent publish the node's own addresses under
	// /leasehold/v1/hostips/, so that no pool hands them out (the DAD flap, docs/field-failures.md).
	PublishHostAddrs bool
	// HostNetns is the network namespace whose addresses are the node's; "" is the
	// agent's own (host networking).
	HostNetns string
	// HostResync is how often the host addresses are listed again besides following
	// netlink events; default DefaultHostResync.
	HostResync time.Duration
	// Host names the machine and boot this agent runs on; default node.DefaultHost (hostname and
	// boot ID). Two agents with one node identity on different hosts are refused (see
	// register); the same host may take over from its own previous process.
	Host string
	// WallClock gives the timestamps written into records (created, detected, started);
	// default time.Now. Nothing the agent decides reads it: ages, deadlines and grace
	// periods use the monotonic clock and leases use etcd's, so a stepped clock changes
	// only what the records say. Tests step it to show that.
	WallClock func() time.Time
	// BlockIdle is how long a block this node claimed must stay empty (no allocation, nothing
	// in quarantine) before the agent gives it back to the pool; default DefaultBlockIdle,
	// negative keeps blocks until the agent's identity goes.
	BlockIdle time.Duration
	// ClaimHold is how long a sticky claim outlives its holder's release when the network
	// configuration does not say (ipam "stickyHold"); default DefaultClaimHold. It must be at
	// least LeaseTTL: a dead node's claims must outlive its pods' leases.
	ClaimHold time.Duration
	// ReuseDelay is how long an address whose pod lease expired without a release (its node
	// cut off from etcd or dead) is held back from other pods while the pool has other room,
	// and how long a dead node's blocks stay its own: the node's block lease, which carries its
	// block claims and its pods' held keys, outlives its pods' leases by ReuseDelay at least
	// (blockLeaseTTL). Default
	// DefaultReuseDelay; negative holds nothing back.
	ReuseDelay time.Duration
	// LiveMigrationBound is the age above which a live migration this node takes part in has
	// hung (issue 35): KubeVirt finishes one in minutes. Each is logged once and counted in
	// leasehold_live_migrations_too_old (the LeaseholdLiveMigrationTooOld alert's). Default
	// DefaultLiveMigrationBound, as leaseholdctl doctor's; negative is invalid.
	LiveMigrationBound time.Duration
	// AuditInterval is how often the agent checks every key it keeps in etcd (its node record,
	// block claims, and its running pods' pod records, owner indexes and allocations) against
	// what it wrote, and re-claims a pod whose key was deleted or changed (audit.go); default
	// half of LeaseTTL, at most LeaseTTL.
	AuditInterval time.Duration
	// Version is the agent version written into the node record.
	Version string
	Logger  *slog.Logger
}

// Defaults of Config, each with its reason in ARCHITECTURE.md ("The pod lease lifecycle").
const (
	DefaultLeaseTTL         = 90 * time.Second
	DefaultQuarantine       = 30 * time.Second
	DefaultSpareLeases      = 8
	DefaultOpTimeout        = 10 * time.Second
	DefaultGCGrace          = 10 * time.Second
	DefaultLivenessInterval = 10 * time.Second
	DefaultLivenessGrace    = 30 * time.Second
	DefaultHostResync       = 15 * time.Second
	DefaultBlockIdle        = 5 * time.Minute
	DefaultClaimHold        = 10 * time.Minute
	DefaultReuseDelay       = 15 * time.Minute
	// DefaultLiveMigrationBound equals admin.DefaultLiveMigrationBound.
	DefaultLiveMigrationBound = time.Hour
)

// Bounds the agent sets itself. Every other wait is Config.OpTimeout.
const (
	// minLeaseTTL is etcd's minimum lease TTL; a shorter one is raised by etcd, silently.
	minLeaseTTL = keeper.MinTTL
	// probeAfter is how old the last etcd answer may be before STATUS and /readyz ask etcd
	// again: containerd polls STATUS every few seconds, and an agent in use talks to etcd far
	// more often than that.
	probeAfter = 5 * time.Second
	// probeTimeout bounds that question: a runtime's STATUS and a kubelet's probe must get an
	// answer well within their own timeouts.
	probeTimeout = 2 * time.Second
	// reachAfter is how long etcd may have been silent before an ADD or DEL asks it first
	// (Agent.reachable): they call etcd anyway, and must not wait a whole request's timeout
	// to learn that the node is cut off.
	reachAfter = 2 * time.Second
	// retryFirst and retryMax bound the backoff of the agent's background retries (view
	// lists, spare grants); the re-claim's are leases/reclaim's.
	retryFirst = 100 * time.Millisecond
	retryMax   = 5 * time.Second
)

// validate checks c and fills in its defaults. It does no I/O: Start creates the state
// directory.
func (c *Config) validate() error {
	if err := keyspace.ValidateNames("cluster", c.Cluster, "node", c.Node, "node UID", c.NodeUID); err != nil {
		return err
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.LeaseTTL < minLeaseTTL {
		return fmt.Errorf("%w: lease TTL %s is shorter than etcd's minimum of %s", allocator.ErrInvalidConfig, c.LeaseTTL, minLeaseTTL)
	}
	if c.AuditInterval == 0 {
		c.AuditInterval = c.LeaseTTL / 2
	}
	if c.AuditInterval < 0 || c.AuditInterval > c.LeaseTTL {
		return fmt.Errorf("%w: audit interval %s must be positive and at most the lease TTL %s: a key of a running pod "+
			"deleted by hand or lost with a restore must be put back within a TTL", allocator.ErrInvalidConfig, c.AuditInterval, c.LeaseTTL)
	}
	if c.ClaimHold == 0 {
		c.ClaimHold = DefaultClaimHold
	}
	if c.ClaimHold < c.LeaseTTL {
		return fmt.Errorf("%w: claim hold %s is shorter than the lease TTL %s: a dead node's claims must outlive its pods' leases",
			allocator.ErrInvalidConfig, c.ClaimHold, c.LeaseTTL)
	}
	if c.ReuseDelay == 0 {
		c.ReuseDelay = DefaultReuseDelay
	}
	if c.LiveMigrationBound == 0 {
		c.LiveMigrationBound = DefaultLiveMigrationBound
	}
	if c.LiveMigrationBound < 0 {
		return fmt.Errorf("%w: live migration bound %s is negative", allocator.ErrInvalidConfig, c.LiveMigrationBound)
	}
	if c.ReuseDelay < 0 {
		c.ReuseDelay = 0
	}
	if c.BlockIdle == 0 {
		c.BlockIdle = DefaultBlockIdle
	}
	if c.Quarantine == 0 {
		c.Quarantine = DefaultQuarantine
	}
	if c.SpareLeases <= 0 {
		c.SpareLeases = DefaultSpareLeases
	}
	if c.OpTimeout <= 0 {
		c.OpTimeout = DefaultOpTimeout
	}
	if c.GCGrace == 0 {
		c.GCGrace = DefaultGCGrace
	}
	if c.LivenessInterval == 0 {
		c.LivenessInterval = DefaultLivenessInterval
	}
	if c.LivenessGrace == 0 {
		c.LivenessGrace = DefaultLivenessGrace
	}
	if c.HostResync <= 0 {
		c.HostResync = DefaultHostResync
	}
	if c.Host == "" {
		c.Host = node.DefaultHost()
	}
	if c.WallClock == nil {
		c.WallClock = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// ErrAgentRunning: another agent serves this node identity (node.ErrAgentRunning).
var ErrAgentRunning = node.ErrAgentRunning
