package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// etcdProc is bin/etcd running as its own process: a single member, fsync on (etcd's
// default), its data in a directory of the bench's temporary tree, on free loopback ports.
type etcdProc struct {
	URL  string
	cmd  *exec.Cmd
	done chan struct{}
	logs *tailBuffer
	stop func()
}

// startEtcd starts a fresh etcd member named name, with etcd's flags added, and waits (at most 30 s) until it answers.
// A port found free can be taken before etcd binds it (the figures' own clients open
// connections from ephemeral loopback ports meanwhile), so a member that exits because
// its address is in use is started again on other ports, at most three times in all.
func startEtcd(ctx context.Context, env *env, name string, flags ...string) (*etcdProc, error) {
	for attempt := 1; ; attempt++ {
		e, err := startEtcdOnce(ctx, env, name, flags)
		if err == nil || attempt == 3 || !errors.Is(err, errAddrInUse) {
			return e, err
		}
		progress("etcd %s: a port was taken before etcd bound it; starting it again on other ports", name)
	}
}

// startEtcdClient is startEtcd plus a client of the new member; done closes the client and
// stops the member.
func startEtcdClient(ctx context.Context, env *env, name string) (e *etcdProc, cli *clientv3.Client, done func(), err error) {
	if e, err = startEtcd(ctx, env, name); err != nil {
		return nil, nil, nil, err
	}
	if cli, err = e.client(); err != nil {
		e.stop()
		return nil, nil, nil, err
	}
	return e, cli, func() { cli.Close(); e.stop() }, nil
}

// errAddrInUse is wrapped by startEtcdOnce when etcd exited because a port was taken.
var errAddrInUse = errors.New("address already in use")

func startEtcdOnce(ctx context.Context, env *env, name string, flags []string) (*etcdProc, error) {
	curl, err := freeLoopbackURL()
	if err != nil {
		return nil, err
	}
	purl, err := freeLoopbackURL()
	if err != nil {
		return nil, err
	}
	dir, err := env.tempDir("etcd-" + name)
	if err != nil {
		return nil, err
	}
	e := &etcdProc{URL: curl, logs: newTailBuffer(64 << 10), done: make(chan struct{})}
	e.cmd = exec.Command(filepath.Join(env.bin, "etcd"), append([]string{
		"--name", name, "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", curl, "--advertise-client-urls", curl,
		"--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
		"--initial-cluster", name + "=" + purl, "--log-level", "error"}, flags...)...)
	e.cmd.Stdout, e.cmd.Stderr = e.logs, e.logs
	e.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := e.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", e.cmd.Path, err)
	}
	go func() { _ = e.cmd.Wait(); close(e.done) }()
	e.stop = cleanups.add(func() {
		_ = e.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-e.done:
		case <-time.After(10 * time.Second):
			_ = e.cmd.Process.Kill()
			<-e.done
		}
	})
	cli, err := e.client()
	if err != nil {
		e.stop()
		return nil, err
	}
	defer cli.Close()
	for deadline := time.Now().Add(30 * time.Second); ; {
		c, cancel := context.WithTimeout(ctx, time.Second)
		_, err := cli.Get(c, "health")
		cancel()
		if err == nil {
			return e, nil
		}
		select {
		case <-e.done:
			if strings.Contains(e.logs.String(), "address already in use") {
				return nil, fmt.Errorf("etcd exited before answering: %w:\n%s", errAddrInUse, e.logs)
			}
			return nil, fmt.Errorf("etcd exited before answering:\n%s", e.logs)
		case <-ctx.Done():
			e.stop()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			e.stop()
			return nil, fmt.Errorf("etcd at %s did not answer within 30s: %v\n%s", curl, err, e.logs)
		}
	}
}

// client returns a new client of this member, configured as leaseholdd configures its own.
func (e *etcdProc) client() (*clientv3.Client, error) {
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: []string{e.URL}, DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialKeepAliveTime: 10 * time.Second, DialKeepAliveTimeout: 5 * time.Second,
	})
	if err != nil {
		return nil, fmt.Errorf("etcd client for %s: %w", e.URL, err)
	}
	return cli, nil
}

// freeLoopbackURL returns http://127.0.0.1:PORT for a port that was free a moment ago.
func freeLoopbackURL() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free loopback port: %w", err)
	}
	defer l.Close()
	return "http://" + l.Addr().String(), nil
}
