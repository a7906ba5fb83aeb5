package leases

import (
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
)

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
