package chaos

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// node is one node slot: a namespace with its veth, and the agent serving it. A node death
// gives the slot a new identity (a replaced machine): a new node UID, a fresh state
// directory, the same or a new name.
type node struct {
	slot int
	host *host

	// mu serializes what changes the agent process: start, kill, stop, continue.
	mu       sync.Mutex
	name     string
	uid      string
	gen      int
	stateDir string
	socket   string
	p        *proc
	inc      int
	dead     bool
}

// agentLog is one agent incarnation's stderr file.
type agentLog struct {
	Path string
	Slot int
	Node string
	Gen  int
	Inc  int
}

const metricsPort = "9615"

// directHTTP never goes through a proxy the environment names.
var directHTTP = &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}, Timeout: 3 * time.Second}

func (e *env) addNodes(ctx context.Context) error {
	if err := os.MkdirAll(filepath.Join(e.dir, "agents"), 0o755); err != nil {
		return err
	}
	for i := range e.cfg.Nodes {
		h, err := e.topo.addHost(ctx, fmt.Sprintf("n%d", i), 11+i)
		if err != nil {
			return err
		}
		n := &node{slot: i, host: h, socket: filepath.Join(e.dir, fmt.Sprintf("n%d.sock", i))}
		n.newIdentity(e, true)
		e.nodes = append(e.nodes, n)
	}
	// Started one at a time, as nodes join a cluster.
	for _, n := range e.nodes {
		n.mu.Lock()
		err := e.startAgent(ctx, n)
		n.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

// newIdentity gives the slot the next machine: a new node UID and a fresh state directory,
// the same name when sameName.
func (n *node) newIdentity(e *env, sameName bool) {
	n.gen++
	if n.name == "" || sameName {
		if n.name == "" {
			n.name = fmt.Sprintf("node-%d", n.slot)
		}
	} else {
		n.name = fmt.Sprintf("node-%d-r%d", n.slot, n.gen)
	}
	n.uid = fmt.Sprintf("machine-%d-%d.boot-%d", e.topo.X, n.slot, n.gen)
	n.stateDir = filepath.Join(e.dir, "state", fmt.Sprintf("n%d-g%d", n.slot, n.gen))
	n.dead = false
}

func (e *env) agentArgs(n *node) []string {
	p := e.cfg
	return []string{"--etcd-endpoints", joinComma(e.etcd.endpoints()),
		"--cluster", "default", "--node", n.name, "--node-uid", n.uid,
		"--state-dir", n.stateDir, "--socket", n.socket,
		"--metrics-addr", n.host.IP + ":" + metricsPort,
		"--lease-ttl", p.TTL.String(), "--reuse-delay", p.ReuseDelay.String(), "--quarantine", p.Quarantine.String(),
		"--liveness-interval", "1s", "--liveness-grace", "3s", "--gc-grace", "0s",
		"--publish-host-addresses=false", "--log-level", logLevel()}
}

func joinComma(s []string) string {
	out := ""
	for i, x := range s {
		if i > 0 {
			out += ","
		}
		out += x
	}
	return out
}

// startAgent runs a new incarnation of the slot's agent and waits (bounded) until it serves
// its socket. The caller holds n.mu. An agent that exits before serving is started again,
// three times at most.
func (e *env) startAgent(ctx context.Context, n *node) error {
	var lastErr error
	for attempt := 1; attempt <= 3; attempt++ {
		n.inc++
		l := agentLog{Path: filepath.Join(e.dir, "agents", fmt.Sprintf("n%d-g%d-i%d.log", n.slot, n.gen, n.inc)),
			Slot: n.slot, Node: n.name, Gen: n.gen, Inc: n.inc}
		e.logsMu.Lock()
		e.agentLogs = append(e.agentLogs, l)
		e.logsMu.Unlock()
		p, err := startProc(fmt.Sprintf("leaseholdd n%d", n.slot), n.host.NS, l.Path,
			filepath.Join(e.cfg.Bin, "leaseholdd"), e.agentArgs(n)...)
		if err != nil {
			return err
		}
		n.p = p
		exited := false
		served := poll(ctx, 60*time.Second, 100*time.Millisecond, func() bool {
			if p.exited() {
				exited = true
				return true
			}
			c, err := net.DialTimeout("unix", n.socket, time.Second)
			if err != nil {
				return false
			}
			c.Close()
			return true
		})
		if served && !exited {
			go e.watchAgent(n, p)
			return nil
		}
		if exited {
			lastErr = fmt.Errorf("leaseholdd n%d exited before serving: %v; %s", n.slot, p.err, tail(l.Path, 5))
		} else {
			lastErr = fmt.Errorf("leaseholdd n%d did not serve %s within 60s; %s", n.slot, n.socket, tail(l.Path, 5))
			_ = p.kill()
		}
		e.rec.event(Event{Time: time.Now(), Kind: "agent-start-failed", Slot: n.slot, Detail: lastErr.Error(), Fails: true})
		if ctx.Err() != nil {
			break
		}
	}
	return lastErr
}

// watchAgent restarts an agent that exited without being told to (kubelet's systemd would),
// and records it: an exit of its own fails the run.
func (e *env) watchAgent(n *node, p *proc) {
	<-p.done
	if p.expected.Load() || e.stopping.Load() {
		return
	}
	t := time.Now()
	n.mu.Lock()
	defer n.mu.Unlock()
	e.rec.event(Event{Time: t, Kind: "agent-exit", Slot: n.slot, Fails: true,
		Detail: fmt.Sprintf("leaseholdd n%d (%s) exited on its own: %v; %s", n.slot, n.name, p.err, crashSummary(e.lastLog(n.slot)))})
	if n.p != p || e.stopping.Load() {
		return
	}
	away := e.rec.awayBegin(n.slot, "crash", t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := e.startAgent(ctx, n); err != nil {
		e.rec.event(Event{Time: time.Now(), Kind: "agent-restart-failed", Slot: n.slot, Detail: err.Error(), Fails: true})
		return
	}
	e.rec.awayEnd(away, time.Now())
}

func (e *env) lastLog(slot int) string {
	e.logsMu.Lock()
	defer e.logsMu.Unlock()
	for i := len(e.agentLogs) - 1; i >= 0; i-- {
		if e.agentLogs[i].Slot == slot {
			return e.agentLogs[i].Path
		}
	}
	return ""
}

// ready asks the agent's /readyz (inside its namespace, through the bridge).
func (e *env) ready(ctx context.Context, n *node) bool {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+n.host.IP+":"+metricsPort+"/readyz", nil)
	if err != nil {
		return false
	}
	resp, err := directHTTP.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// logLevel is the agents' --log-level: info, or LEASEHOLD_CHAOS_LOG_LEVEL (debug logs every
// allocation and release, for a run being investigated).
func logLevel() string {
	if l := os.Getenv("LEASEHOLD_CHAOS_LOG_LEVEL"); l != "" {
		return l
	}
	return "info"
}
