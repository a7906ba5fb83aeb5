package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Testbed is the run's topology for a test of its own: three etcd members and agents, each
// in its own network namespace behind a veth, and nothing else: no runtime, no faults but
// those the test makes (Cut, Heal).
type Testbed struct {
	e *env
}

// NewTestbed starts cfg.Nodes agents (at least 5 is not required here: 2 or more) with cfg's
// TTL, reuse delay and quarantine. Close takes everything down.
func NewTestbed(ctx context.Context, cfg Config) (tb *Testbed, err error) {
	if cfg.Nodes == 0 {
		cfg.Nodes = 2
	}
	nodes := cfg.Nodes
	cfg.Nodes = 5 // defaults() wants a run's size; the testbed starts its own count
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	cfg.Nodes = nodes
	if err := NetnsAvailable(ctx); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(cfg.Dir, "lhtestbed-")
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(dir, "state"), 0o755); err != nil {
		return nil, err
	}
	e := &env{cfg: cfg, dir: dir, rec: &recorder{}, pool: "testbed"}
	tb = &Testbed{e: e}
	defer func() {
		if err != nil {
			tb.Close()
		}
	}()
	if e.topo, err = newTopology(ctx, cfg.Logf); err != nil {
		return nil, err
	}
	if err := e.startEtcd(ctx); err != nil {
		return nil, err
	}
	if err := e.addNodes(ctx); err != nil {
		return nil, err
	}
	return tb, nil
}

// Client is a client of the etcd members, from the root namespace.
func (tb *Testbed) Client() *clientv3.Client { return tb.e.cli }

// Endpoints are the etcd members' client URLs.
func (tb *Testbed) Endpoints() []string { return tb.e.etcd.endpoints() }

// Socket is agent i's socket.
func (tb *Testbed) Socket(i int) string { return tb.e.nodes[i].socket }

// Node is agent i's node name.
func (tb *Testbed) Node(i int) string { return tb.e.nodes[i].name }

// Cut takes agent i's link down: it keeps running, cut off from etcd.
func (tb *Testbed) Cut(ctx context.Context, i int) error {
	return tb.e.topo.setLink(ctx, tb.e.nodes[i].host, false)
}

// Heal brings agent i's link up again.
func (tb *Testbed) Heal(ctx context.Context, i int) error {
	return tb.e.topo.setLink(ctx, tb.e.nodes[i].host, true)
}

// Log is what agent i logged so far (every incarnation).
func (tb *Testbed) Log(i int) string {
	var out []byte
	tb.e.logsMu.Lock()
	logs := append([]agentLog(nil), tb.e.agentLogs...)
	tb.e.logsMu.Unlock()
	for _, l := range logs {
		if l.Slot == i {
			b, _ := os.ReadFile(l.Path)
			out = append(out, b...)
		}
	}
	return string(out)
}

// Dir is the testbed's directory (agent and etcd logs).
func (tb *Testbed) Dir() string { return tb.e.dir }

// Close stops every process and removes the topology; keep leaves the directory.
func (tb *Testbed) Close() {
	tb.e.stopping.Store(true)
	tb.e.teardown()
}

func (tb *Testbed) String() string {
	return fmt.Sprintf("testbed %s: %d agents, etcd %v", tb.e.dir, len(tb.e.nodes), tb.Endpoints())
}
