// Package thin is what the leasehold plugin binary runs: the CNI protocol's process
// side, with as little as possible in the process. The plugin reads its environment and
// stdin, forwards them unparsed to the node agent (leaseholdd) over its unix socket, and
// replays the agent's answer: stdout, stderr and exit code. The agent parses the network
// configuration and renders the result with the same code the plugin used to run in-process
// (package cniplugin); see ARCHITECTURE.md, "The agent socket".
//
// The package imports no encoding/json, reflection-driven formatting, CNI library, net
// or gRPC: a plugin process lives for one call, so what it links and initializes is paid
// on every call. For the same reason it finds the two fields it needs with its own small
// JSON reader and talks to the socket with a blocking exchange on a raw socket, not through
// the net package (docs/performance.md has the measurements).
package thin

import (
	"context"
	"errors"
	"io"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// CallError is a failure of Exchange: which step failed and the system error. It is a
// net.Error, so callers can ask whether it was a timeout.
type CallError struct {
	// Op is "dial", "write" or "read".
	Op string
	// Err is the system error (a syscall.Errno), io.EOF, or ErrTooLarge.
	Err error
	// Timed is set when the deadline passed.
	Timed bool
}

func (e *CallError) Error() string {
	if e.Timed {
		return e.Op + ": i/o timeout"
	}
	return e.Op + ": " + e.Err.Error()
}

func (e *CallError) Unwrap() error { return e.Err }

// Timeout reports whether the deadline passed.
func (e *CallError) Timeout() bool { return e.Timed }

// Temporary is the deprecated half of net.Error; it is the same as Timeout.
func (e *CallError) Temporary() bool { return e.Timed }

// ErrTooLarge is wrapped by Exchange when the answer is longer than allowed.
var ErrTooLarge = errors.New("answer too large")

// Exchange connects to the unix stream socket at path, writes req, half-closes its side,
// and reads the answer until the agent closes (at most max bytes), all before ctx's
// deadline (ctx must have one). Cancelling ctx shuts the connection down.
// It blocks in the kernel: no goroutine parks on the netpoller, so the answer wakes this
// thread directly. A failed write still reads, since the agent may have refused the
// request and said why; the returned error is then the read's, or the write's when the
// read got nothing.
func Exchange(ctx context.Context, path string, req []byte, max int) ([]byte, error) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return nil, &CallError{Op: "dial", Err: errors.New("no deadline given")}
	}
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, &CallError{Op: "dial", Err: err}
	}
	// A cancelled ctx shuts the socket down, which wakes a blocked read or write; the
	// lock keeps that from touching the descriptor number once it is closed and reused.
	var mu sync.Mutex
	closed := false
	stop := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if !closed {
			_ = syscall.Shutdown(fd, syscall.SHUT_RDWR)
		}
	})
	defer func() {
		stop()
		mu.Lock()
		closed = true
		_ = syscall.Close(fd)
		mu.Unlock()
	}()
	if err := setTimeout(fd, syscall.SO_SNDTIMEO, deadline); err != nil {
		return nil, &CallError{Op: "dial", Err: err, Timed: errors.Is(err, errDeadline)}
	}
	for {
		err = syscall.Connect(fd, &syscall.SockaddrUnix{Name: path})
		if err != syscall.EINTR {
			break
		}
		// A connect cut short by a signal left the socket unconnected: the wait for room
		// in the listener's backlog comes before the connection is queued.
		if err := setTimeout(fd, syscall.SO_SNDTIMEO, deadline); err != nil {
			return nil, &CallError{Op: "dial", Err: err, Timed: true}
		}
	}
	if err != nil {
		// A full backlog until the send timeout ends in EAGAIN.
		return nil, &CallError{Op: "dial", Err: err, Timed: err == syscall.EAGAIN}
	}
	werr := writeAll(fd, req, deadline)
	if werr == nil {
		_ = syscall.Shutdown(fd, syscall.SHUT_WR)
	}
	out, rerr := readAll(fd, deadline, max)
	if rerr != nil {
		if werr != nil && len(out) == 0 {
			return nil, werr
		}
		return out, rerr
	}
	return out, nil
}

// errDeadline is returned by setTimeout when the deadline has passed.
var errDeadline = errors.New("deadline passed")

// setTimeout sets the socket's send or receive timeout to what is left until deadline.
func setTimeout(fd, opt int, deadline time.Time) error {
	left := time.Until(deadline)
	if left <= 0 {
		return errDeadline
	}
	// A zero timeval would mean no timeout at all.
	tv := syscall.NsecToTimeval(max(left.Nanoseconds(), int64(time.Microsecond)))
	return syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, opt, &tv)
}

func writeAll(fd int, data []byte, deadline time.Time) error {
	for len(data) > 0 {
		if err := setTimeout(fd, syscall.SO_SNDTIMEO, deadline); err != nil {
			return &CallError{Op: "write", Err: err, Timed: true}
		}
		// MSG_NOSIGNAL: an agent that went away is an EPIPE, not a SIGPIPE.
		n, err := syscall.SendmsgN(fd, data, nil, nil, syscall.MSG_NOSIGNAL)
		switch {
		case err == syscall.EINTR:
			continue
		case err != nil:
			return &CallError{Op: "write", Err: err, Timed: err == syscall.EAGAIN}
		}
		data = data[n:]
	}
	return nil
}

func readAll(fd int, deadline time.Time, max int) ([]byte, error) {
	buf := make([]byte, 0, 4096)
	for {
		if err := setTimeout(fd, syscall.SO_RCVTIMEO, deadline); err != nil {
			return buf, &CallError{Op: "read", Err: err, Timed: true}
		}
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := syscall.Read(fd, buf[len(buf):cap(buf)])
		switch {
		case err == syscall.EINTR:
			continue
		case err != nil:
			return buf, &CallError{Op: "read", Err: err, Timed: err == syscall.EAGAIN}
		case n == 0:
			if len(buf) == 0 {
				return buf, &CallError{Op: "read", Err: io.EOF}
			}
			return buf, nil
		}
		buf = buf[:len(buf)+n]
		if len(buf) > max {
			return buf, &CallError{Op: "read", Err: errTooLargeN(max)}
		}
	}
}

func errTooLargeN(max int) error {
	return &tooLarge{max}
}

type tooLarge struct{ max int }

func (t *tooLarge) Error() string {
	return "answer longer than " + strconv.Itoa(t.max) + " bytes"
}

func (t *tooLarge) Is(target error) bool { return target == ErrTooLarge }
