package leases

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
)

// Files the default node UID is read from.
var (
	machineIDFiles = []string{"/etc/machine-id", "/var/lib/dbus/machine-id"}
	bootIDFile     = "/proc/sys/kernel/random/boot_id"
)

// DefaultNodeUID is this machine's identity for one boot: its machine ID and boot ID. A
// replacement machine under the same node name, or the same machine after a reboot (when
// every sandbox is gone), gets a different UID and so never renews the old pods' leases.
func DefaultNodeUID() (string, error) {
	var machine string
	var errs []error
	for _, f := range machineIDFiles {
		b, err := os.ReadFile(f)
		if err == nil && len(strings.TrimSpace(string(b))) > 0 {
			machine = strings.TrimSpace(string(b))
			break
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	if machine == "" {
		return "", fmt.Errorf("no machine ID (%w); set --node-uid", errors.Join(errs...))
	}
	b, err := os.ReadFile(bootIDFile)
	if err != nil {
		return "", fmt.Errorf("no boot ID (%w); set --node-uid", err)
	}
	return machine + "." + strings.TrimSpace(string(b)), nil
}

// DefaultHost names this machine and boot: its hostname and boot ID. Unlike the node UID it
// cannot be set by a flag, so two machines given one --node-uid still differ here.
func DefaultHost() string {
	name, err := os.Hostname()
	if err != nil {
		name = "unknown-host"
	}
	if b, err := os.ReadFile(bootIDFile); err == nil {
		return name + "/" + strings.TrimSpace(string(b))
	}
	return name
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
// names another node UID (the same-name replacement of docs/field-failures.md) or this very host (this agent's
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
	rec := keyspace.NodeRecord{UID: a.cfg.NodeUID, Host: a.cfg.Host, PID: os.Getpid(), Version: a.cfg.Version, Blocks: true,
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
			if bl, err := keyspace.ParseLeaseHex(old.BlockLease); err == nil && bl != 0 && old.UID == a.cfg.NodeUID {
				// This identity's block lease from before a restart or a lost node lease: its
				// claims and held keys are this node's.
				if err := a.blockLeases.adopt(octx, bl); err != nil && !errors.Is(err, keeper.ErrLeaseLost) {
					a.log.Warn("resuming this node's block lease failed; its claims go with it", "lease", old.BlockLease, "err", err)
				}
			}
			cmp = keyspace.Unchanged(key, kv.ModRevision)
		}
		bl, err := a.blockLeases.get(octx)
		if err != nil {
			a.keeper.Return(id)
			return fmt.Errorf("%w: grant this node's block lease: %w", allocator.ErrUnavailable, err)
		}
		rec.BlockLease = keyspace.LeaseHex(bl)
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
	a.log.Info("node registered", "uid", a.cfg.NodeUID, "host", a.cfg.Host, "lease", keyspace.LeaseHex(id))
	return nil
}

// ErrAgentRunning: another agent holds this node's state directory.
var ErrAgentRunning = errors.New("another leaseholdd serves this node")

// lockStateDir takes an exclusive lock on dir/lock for as long as the agent lives, so that
// two agents for one node (a second start, a rollout overlapping the old pod) never both
// renew and release the node's pods. The lock is the kernel's (flock): it is released when
// the process dies, whatever way it dies, so a kill -9 never blocks the restart.
func lockStateDir(dir string) (release func(), err error) {
	path := filepath.Join(dir, "lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(path)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is locked by pid %s; stop that agent first (only one agent may hold a node's leases)",
				ErrAgentRunning, path, strings.TrimSpace(string(holder)))
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// lockIdentity takes a host-wide lock on one node identity (cluster, node, node UID, host)
// against one etcd cluster: an abstract unix socket bound in the agent's network namespace,
// which is the host's (leaseholdd runs with host networking). Like flock, the kernel drops it
// when the process dies, however it dies. It catches what the state directory's lock cannot:
// two agents of one identity on one host with different --state-dir values.
func lockIdentity(etcdCluster uint64, cfg *Config) (release func(), err error) {
	h := sha256.New()
	fmt.Fprintf(h, "%x\x00%s\x00%s\x00%s\x00%s", etcdCluster, cfg.Cluster, cfg.Node, cfg.NodeUID, cfg.Host)
	name := "@leasehold-" + hex.EncodeToString(h.Sum(nil)[:16])
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("%w: another agent on this host already serves node %q of cluster %q with node UID %q "+
			"against this etcd cluster (it holds the abstract socket %s; its --state-dir may differ); stop it first",
			ErrAgentRunning, cfg.Node, cfg.Cluster, cfg.NodeUID, name)
	}
	if err != nil {
		return nil, fmt.Errorf("take the host-wide lock %s for this node identity: %w", name, err)
	}
	return func() { c.Close() }, nil
}
