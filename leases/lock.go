package leases

import (
	"errors"
	"fmt"
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
