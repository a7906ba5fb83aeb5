package chaos

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// member is one etcd member in its own namespace, listening on its veth address.
type member struct {
	i       int
	name    string
	host    *host
	client  string
	peer    string
	args    []string
	logPath string
	// data is the member's data directory (a restore gives it a fresh one).
	data string

	mu  sync.Mutex
	p   *proc
	inc int
}

// etcdCluster is a real three-member etcd cluster (fsync on).
type etcdCluster struct {
	e       *env
	members []*member
	// initial is the --initial-cluster every member was started (or restored) with; token
	// the --initial-cluster-token.
	initial, token string
}

func (e *env) startEtcd(ctx context.Context) error {
	c := &etcdCluster{e: e}
	var peers []string
	for i := range 3 {
		h, err := e.topo.addHost(ctx, fmt.Sprintf("e%d", i), 1+i)
		if err != nil {
			return err
		}
		m := &member{i: i, name: fmt.Sprintf("m%d", i), host: h, client: "http://" + h.IP + ":2379", peer: "http://" + h.IP + ":2380",
			logPath: filepath.Join(e.dir, "etcd", fmt.Sprintf("m%d.log", i))}
		peers = append(peers, m.name+"="+m.peer)
		c.members = append(c.members, m)
	}
	if err := os.MkdirAll(filepath.Join(e.dir, "etcd"), 0o755); err != nil {
		return err
	}
	// The members' data goes to memory unless asked otherwise: etcd still calls fdatasync,
	// but three members sharing one disk with everything else on 2 cores see fsync stalls of
	// seconds, which with 4 s leases are a fault of their own, not the one under test.
	data := filepath.Join(e.dir, "etcd")
	if !e.cfg.EtcdOnDisk {
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			if d, err := os.MkdirTemp("/dev/shm", e.topo.prefix+"etcd-"); err == nil {
				data = d
			}
		}
	}
	e.etcdData = data
	c.initial, c.token = strings.Join(peers, ","), fmt.Sprintf("lhchaos-%d", e.topo.X)
	for _, m := range c.members {
		m.data = filepath.Join(data, m.name+".data")
		m.args = c.memberArgs(m)
		if err := c.start(m); err != nil {
			return err
		}
	}
	e.etcd = c
	cli, err := clientv3.New(clientv3.Config{Endpoints: c.endpoints(), DialTimeout: 5 * time.Second,
		Logger: zap.NewNop(), AutoSyncInterval: 0})
	if err != nil {
		return err
	}
	e.cli = cli
	if !c.healthy(ctx, 60*time.Second) {
		return fmt.Errorf("the etcd cluster did not answer within 60s (logs in %s)", filepath.Join(e.dir, "etcd"))
	}
	return nil
}

// memberArgs are m's etcd flags: its data directory, URLs and the cluster's bootstrap
// configuration (read only when the data directory is new).
func (c *etcdCluster) memberArgs(m *member) []string {
	return []string{"--name", m.name, "--data-dir", m.data,
		"--listen-client-urls", m.client, "--advertise-client-urls", m.client,
		"--listen-peer-urls", m.peer, "--initial-advertise-peer-urls", m.peer,
		"--initial-cluster", c.initial, "--initial-cluster-token", c.token,
		"--initial-cluster-state", "new", "--log-level", "warn"}
}

func (c *etcdCluster) endpoints() []string {
	var eps []string
	for _, m := range c.members {
		eps = append(eps, m.client)
	}
	return eps
}

// start runs a member (again, on its data directory). Caller holds no lock.
func (c *etcdCluster) start(m *member) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.p != nil && !m.p.exited() {
		return nil
	}
	m.inc++
	appendLine(m.logPath, fmt.Sprintf("=== chaos: start %s incarnation %d at %s", m.name, m.inc, time.Now().Format(time.RFC3339Nano)))
	p, err := startProc("etcd "+m.name, m.host.NS, m.logPath, filepath.Join(c.e.cfg.Bin, "etcd"), m.args...)
	if err != nil {
		return err
	}
	m.p = p
	go c.watch(m, p)
	return nil
}

// watch records a member that exited without being killed by the run.
func (c *etcdCluster) watch(m *member, p *proc) {
	<-p.done
	if p.expected.Load() || c.e.stopping.Load() {
		return
	}
	c.e.rec.event(Event{Time: time.Now(), Kind: "etcd-exit", Slot: -1, Fails: true,
		Detail: fmt.Sprintf("etcd %s exited on its own: %v; %s", m.name, p.err, tail(m.logPath, 5))})
}

func (c *etcdCluster) kill(m *member) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.p == nil {
		return nil
	}
	return m.p.kill()
}

func (c *etcdCluster) running(m *member) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.p != nil && !m.p.exited()
}

// healthy waits (bounded) until every running member answers and a linearizable read works.
func (c *etcdCluster) healthy(ctx context.Context, within time.Duration) bool {
	return poll(ctx, within, 300*time.Millisecond, func() bool {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if _, err := c.e.cli.Get(rctx, "/chaos-health"); err != nil {
			return false
		}
		for _, m := range c.members {
			if !c.running(m) {
				return false
			}
			sctx, cancel := context.WithTimeout(ctx, time.Second)
			_, err := c.e.cli.Status(sctx, m.client)
			cancel()
			if err != nil {
				return false
			}
		}
		return true
	})
}

// leader returns the member that leads, asking each (bounded).
func (c *etcdCluster) leader(ctx context.Context) (*member, error) {
	var found *member
	ok := poll(ctx, 15*time.Second, 300*time.Millisecond, func() bool {
		for _, m := range c.members {
			if !c.running(m) {
				continue
			}
			sctx, cancel := context.WithTimeout(ctx, time.Second)
			st, err := c.e.cli.Status(sctx, m.client)
			cancel()
			if err == nil && st.Leader != 0 && st.Leader == st.Header.MemberId {
				found = m
				return true
			}
		}
		return false
	})
	if !ok {
		return nil, errors.New("no etcd member says it leads")
	}
	return found, nil
}

// etcdctl runs bin/etcdctl against the endpoints given.
func (c *etcdCluster) etcdctl(ctx context.Context, within time.Duration, endpoints []string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(c.e.cfg.Bin, "etcdctl"),
		append([]string{"--endpoints", strings.Join(endpoints, ","), "--command-timeout", within.String()}, args...)...)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func appendLine(path, line string) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(f, line)
}

// crashSummary is a panic's message and the frame it came from, if the log holds one, else
// its last lines.
func crashSummary(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(string(b), "\n")
	for i, l := range lines {
		if !strings.HasPrefix(l, "panic: ") && !strings.HasPrefix(l, "fatal error: ") {
			continue
		}
		s := l
		for _, f := range lines[i+1:] {
			if f := strings.TrimSpace(f); strings.Contains(f, ".go:") {
				return s + " at " + f
			}
		}
		return s
	}
	return tail(path, 5)
}

// tail returns the last n lines of a file, joined by " | ".
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
