package main

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/cniplugin"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
	"github.com/leasehold/leasehold/leases"
)

// inproc is a leasehold agent running inside the bench process, as leaseholdd runs it: its
// own etcd client, node name and node UID, its socket served by agentapi.Serve.
type inproc struct {
	agent  *leases.Agent
	cli    *clientv3.Client
	Socket string
	cfg    leases.Config
	close  func()
}

// startInproc starts an agent for node with leaseholdd's defaults (90 s leases, 8 spare
// leases, 30 s quarantine, liveness checks every 10 s) unless mod changes them.
func startInproc(ctx context.Context, env *env, e *etcdProc, node, stateDir string, mod func(*leases.Config)) (*inproc, error) {
	dir, err := env.tempDir("inproc-" + node)
	if err != nil {
		return nil, err
	}
	if stateDir == "" {
		stateDir = filepath.Join(dir, "state")
	}
	cfg := leases.Config{Cluster: "default", Node: node, NodeUID: "uid-" + node, StateDir: stateDir, Version: "bench", Logger: env.agentLog}
	if mod != nil {
		mod(&cfg)
	}
	cli, err := e.client()
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	a, err := leases.Start(sctx, cli, cfg)
	cancel()
	if err != nil {
		cli.Close()
		return nil, fmt.Errorf("start agent %s: %w", node, err)
	}
	p := &inproc{agent: a, cli: cli, Socket: filepath.Join(dir, "agent.sock"), cfg: cfg}
	if err := p.serve(); err != nil {
		a.Close()
		cli.Close()
		return nil, err
	}
	return p, nil
}

// serve puts the agent on its socket and registers its shutdown.
func (p *inproc) serve() error {
	l, err := agentapi.Listen(p.Socket)
	if err != nil {
		return err
	}
	sctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- agentapi.Serve(sctx, l, cniplugin.Served(p.agent), nil) }()
	p.close = cleanups.add(func() {
		stop()
		select {
		case <-served:
		case <-time.After(20 * time.Second):
		}
		p.agent.Close()
		p.cli.Close()
	})
	return nil
}

// client is a socket client of the agent: it sends invocations as the plugin binary does.
func (p *inproc) client() *agentapi.Client {
	return &agentapi.Client{Socket: p.Socket, Timeout: 60 * time.Second}
}

// conf is the network configuration of pool, a single range set on subnet, naming p's socket.
func (p *inproc) conf(pool string, subnet netip.Prefix) []byte {
	return leaseholdConf(pool, p.Socket, subnet)
}

// status sends a STATUS for the pool of conf as the plugin does.
func (p *inproc) status(ctx context.Context, conf []byte) error {
	_, err := invoke(ctx, p.client(), agentapi.NewInvocation("STATUS", conf, "", ""))
	return err
}
