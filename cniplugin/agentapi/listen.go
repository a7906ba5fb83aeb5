package agentapi

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// Listen creates the agent's unix socket at path, root-only, and returns its listener.
//
//   - The parent directory is created with mode 0700 when missing (an existing one is
//     left as it is).
//   - An existing file at path is removed only if it is a socket and nothing answers on
//     it (a leftover of a crashed agent). If a server accepts a connection there, Listen
//     refuses: two agents on one node would hand out leases twice. A non-socket file is
//     never removed.
//   - The socket is bound in a fresh 0700 directory next to path, set to mode 0600 and
//     then renamed into place, so it is never reachable with a wider mode, whatever the
//     process umask. The temporary name is about 15 bytes longer than path; unix socket
//     paths are limited to 107 bytes.
//
// Closing the listener removes the socket file, unless another server has replaced it
// since. Every error names path and says what to do; none wrap allocator sentinels.
func Listen(path string) (net.Listener, error) {
	if path == "" {
		return nil, errors.New("agentapi: empty socket path; pass the socket path leaseholdd should listen on")
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("agentapi: creating socket directory %s: %w", dir, err)
	}
	if err := removeStale(path); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(dir, ".lh")
	if err != nil {
		return nil, fmt.Errorf("agentapi: creating temporary directory in %s for socket %s: %w", dir, path, err)
	}
	defer os.RemoveAll(tmp)
	tmpSock := filepath.Join(tmp, "s")
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmpSock, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("agentapi: binding socket for %s: %w", path, err)
	}
	ul.SetUnlinkOnClose(false)
	fail := func(step string, err error) (net.Listener, error) {
		_ = ul.Close()
		return nil, fmt.Errorf("agentapi: %s for socket %s: %w", step, path, err)
	}
	if err := os.Chmod(tmpSock, 0o600); err != nil {
		return fail("setting mode 0600", err)
	}
	if err := os.Rename(tmpSock, path); err != nil {
		return fail("moving socket into place", err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return fail("checking socket", err)
	}
	return &listener{UnixListener: ul, path: path, fi: fi}, nil
}

// removeStale removes a dead socket at path. It returns nil when path does not exist.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("agentapi: checking existing socket %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("agentapi: %s exists and is not a socket (mode %s); remove it or choose another socket path",
			path, fi.Mode())
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		_ = c.Close()
		return fmt.Errorf("agentapi: another server is live on %s (it accepted a connection); "+
			"stop the other leaseholdd first or choose another socket path", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("agentapi: cannot tell whether socket %s is stale (%w); remove it by hand if no leaseholdd runs", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("agentapi: removing stale socket %s: %w", path, err)
	}
	return nil
}

// listener is a unix listener bound under a temporary name and renamed to path.
type listener struct {
	*net.UnixListener
	path string
	fi   fs.FileInfo
	once sync.Once
	err  error
}

// Addr returns the socket's final path (the bound name was temporary).
func (l *listener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

// Close stops accepting and removes the socket file if it is still this listener's.
func (l *listener) Close() error {
	l.once.Do(func() {
		l.err = l.UnixListener.Close()
		if fi, err := os.Lstat(l.path); err == nil && os.SameFile(fi, l.fi) {
			if err := os.Remove(l.path); err != nil && !errors.Is(err, fs.ErrNotExist) && l.err == nil {
				l.err = fmt.Errorf("agentapi: removing socket %s: %w", l.path, err)
			}
		}
	})
	return l.err
}
