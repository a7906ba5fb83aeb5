// Package node is the agent's node: who it is (the node identity and the locks that keep a
// second agent of it from running), its record in etcd, and the host addresses it publishes
// so that no pool hands them out.
//
// The identity is cluster, node name and node UID, on one host. Only the identity that wrote
// a record renews or adopts what hangs on it (ARCHITECTURE.md, invariant 5); two agents of
// one identity would both renew, adopt and release the same pods, so each takes a state
// directory lock and a host-wide lock before it writes anything, and refuses a live record
// of its identity written from another host.
package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Identity is who the agent is, as written into its node record.
type Identity struct {
	Cluster, Node, UID string
	// Host names the machine and boot (DefaultHost); Version the agent's.
	Host, Version string
}

// ErrAgentRunning: another agent holds this node's state directory.
var ErrAgentRunning = errors.New("another leaseholdd serves this node")

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

// LockStateDir takes an exclusive lock on dir/lock for as long as the agent lives, so that
// two agents for one node (a second start, a rollout overlapping the old pod) never both
// renew and release the node's pods. The lock is the kernel's (flock): it is released when
// the process dies, whatever way it dies, so a kill -9 never blocks the restart.
func LockStateDir(dir string) (release func(), err error) {
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

// LockIdentity takes a host-wide lock on one node identity (cluster, node, node UID, host)
// against the etcd cluster kv answers from (its cluster ID): an abstract unix socket bound in the agent's network namespace,
// which is the host's (leaseholdd runs with host networking). Like flock, the kernel drops it
// when the process dies, however it dies. It catches what the state directory's lock cannot:
// two agents of one identity on one host with different --state-dir values.
func LockIdentity(ctx context.Context, kv clientv3.KV, id Identity) (release func(), err error) {
	resp, err := kv.Get(ctx, keyspace.NodeKey(id.Cluster, id.Node), clientv3.WithCountOnly())
	if err != nil {
		return nil, fmt.Errorf("%w: ask etcd for its cluster ID: %w", allocator.ErrUnavailable, err)
	}
	h := sha256.New()
	fmt.Fprintf(h, "%x\x00%s\x00%s\x00%s\x00%s", resp.Header.ClusterId, id.Cluster, id.Node, id.UID, id.Host)
	name := "@leasehold-" + hex.EncodeToString(h.Sum(nil)[:16])
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("%w: another agent on this host already serves node %q of cluster %q with node UID %q "+
			"against this etcd cluster (it holds the abstract socket %s; its --state-dir may differ); stop it first",
			ErrAgentRunning, id.Node, id.Cluster, id.UID, name)
	}
	if err != nil {
		return nil, fmt.Errorf("take the host-wide lock %s for this node identity: %w", name, err)
	}
	return func() { c.Close() }, nil
}
