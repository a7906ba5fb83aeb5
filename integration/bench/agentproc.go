package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// agentProc is bin/leaseholdd running as its own process against an etcd endpoint, with
// its socket and state directory in the bench's temporary tree.
type agentProc struct {
	Socket string
	cmd    *exec.Cmd
	done   chan struct{}
	logs   *tailBuffer
	stop   func()
}

// startLeaseholdd starts leaseholdd for node (identity uid-<node>) with the flags the bench
// always gives (no metrics server unless metricsAddr is set, no host address publication)
// and waits at most 30 s for its socket. stateDir is kept across restarts of one node.
func startLeaseholdd(ctx context.Context, env *env, endpoint, node, stateDir, metricsAddr string, extra ...string) (*agentProc, error) {
	dir, err := env.tempDir("agent-" + node)
	if err != nil {
		return nil, err
	}
	a := &agentProc{Socket: filepath.Join(dir, "leaseholdd.sock"), logs: newTailBuffer(64 << 10), done: make(chan struct{})}
	args := []string{"--etcd-endpoints", endpoint, "--metrics-addr", metricsAddr, "--publish-host-addresses=false",
		"--state-dir", stateDir, "--socket", a.Socket, "--node", node, "--node-uid", "uid-" + node}
	a.cmd = exec.Command(filepath.Join(env.bin, "leaseholdd"), append(args, extra...)...)
	a.cmd.Stdout, a.cmd.Stderr = a.logs, a.logs
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := a.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", a.cmd.Path, err)
	}
	go func() { _ = a.cmd.Wait(); close(a.done) }()
	a.stop = cleanups.add(func() {
		_ = a.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-a.done:
		case <-time.After(15 * time.Second):
			_ = a.cmd.Process.Kill()
			<-a.done
		}
	})
	for deadline := time.Now().Add(30 * time.Second); ; {
		if c, err := net.Dial("unix", a.Socket); err == nil {
			c.Close()
			return a, nil
		}
		select {
		case <-a.done:
			return nil, fmt.Errorf("leaseholdd exited before serving %s:\n%s", a.Socket, a.logs)
		case <-ctx.Done():
			a.stop()
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			a.stop()
			return nil, fmt.Errorf("leaseholdd did not serve %s within 30s:\n%s", a.Socket, a.logs)
		}
	}
}

// procStatusKB reads a "Vm...:   N kB" line of /proc/PID/status.
func procStatusKB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("/proc/%d/status has no %s", pid, field)
}

// cpuTime is the user+system CPU time pid has used so far (/proc/PID/stat, clock ticks of 10 ms).
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name may hold spaces; the fields after its closing parenthesis are fixed.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: unreadable times", pid)
	}
	return time.Duration(ut+st) * 10 * time.Millisecond, nil
}
