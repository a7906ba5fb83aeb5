package chaos

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync/atomic"
	"syscall"
	"time"
)

// proc is a program run inside a network namespace (ip netns exec execs it: the process ID
// is the program's), its output appended to a file. It dies with the test process
// (Pdeathsig), so a crashed run leaves no process outside its namespaces.
type proc struct {
	name    string
	cmd     *exec.Cmd
	done    chan struct{}
	err     error
	log     *os.File
	started time.Time
	// expected is set before the run signals the process to end, so that its exit is not
	// taken for a crash.
	expected atomic.Bool
	stopped  atomic.Bool
}

func startProc(name, ns, logPath, bin string, args ...string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns, bin}, args...)...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{}), log: f, started: time.Now()}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill sends SIGKILL and waits (bounded) for the process to be gone.
func (p *proc) kill() error {
	p.expected.Store(true)
	_ = syscall.Kill(p.pid(), syscall.SIGKILL)
	select {
	case <-p.done:
		return nil
	case <-time.After(20 * time.Second):
		return fmt.Errorf("%s (pid %d) did not die within 20s of SIGKILL", p.name, p.pid())
	}
}

// terminate sends SIGTERM (continuing a stopped process), then SIGKILL after grace.
func (p *proc) terminate(grace time.Duration) {
	p.expected.Store(true)
	_ = syscall.Kill(p.pid(), syscall.SIGTERM)
	_ = syscall.Kill(p.pid(), syscall.SIGCONT)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.kill()
	}
}

func (p *proc) stop() error {
	p.stopped.Store(true)
	return syscall.Kill(p.pid(), syscall.SIGSTOP)
}

func (p *proc) cont() error {
	err := syscall.Kill(p.pid(), syscall.SIGCONT)
	p.stopped.Store(false)
	return err
}

// sleepCtx waits d or until ctx ends; it reports whether d passed. Faults use it for their
// own length, never to wait for a condition.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// poll calls cond every interval until it holds or within has passed, and reports whether it
// held.
func poll(ctx context.Context, within, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	for {
		if cond() {
			return true
		}
		if time.Now().Add(interval).After(deadline) || !sleepCtx(ctx, interval) {
			return cond()
		}
	}
}
