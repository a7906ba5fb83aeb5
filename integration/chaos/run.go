package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Key prefixes the run reads (ARCHITECTURE.md, key layout).
const (
	ipsPrefix        = "/leasehold/v1/ips/"
	ownersPrefix     = "/leasehold/v1/owners/"
	conflictsPrefix  = "/leasehold/v1/conflicts/"
	heldPrefix       = "/leasehold/v1/held/"
	quarantinePrefix = "/leasehold/v1/quarantine/"
)

// Config is one chaos run.
type Config struct {
	// Bin holds leasehold, leaseholdd, leaseholdctl, etcd, etcdctl and (for Run) etcdutl.
	Bin  string
	Seed int64
	// Nodes is how many agents run (at least 5).
	Nodes int
	// Duration is the fault phase; the end phase and the settling follow.
	Duration time.Duration
	// Roomy gives the pool 4 times the addresses; by default (tight) the nodes' pods can
	// nearly fill it.
	Roomy bool
	// Dir is where the run's directory is made (default: the system's temporary directory);
	// Keep keeps it after a passing run.
	Dir  string
	Keep bool
	// EtcdOnDisk puts the etcd members' data in the run directory instead of /dev/shm.
	EtcdOnDisk bool
	// TTL, ReuseDelay and Quarantine are the agents' --lease-ttl, --reuse-delay and
	// --quarantine (defaults 4s, 12s, 2s).
	TTL, ReuseDelay, Quarantine time.Duration
	Logf                        func(format string, args ...any)
}

// Outcome is what a run produced.
type Outcome struct {
	Report  *Report
	History *History
	// Dir is the run's directory: agent and etcd logs, history.json, report.txt. Empty when
	// it was removed (a passing run without Keep).
	Dir     string
	Elapsed time.Duration
}

// env is a run in progress.
type env struct {
	cfg  Config
	dir  string
	topo *topology
	etcd *etcdCluster
	// etcdData holds the members' data directories.
	etcdData string
	cli      *clientv3.Client
	nodes    []*node
	rt       *runtime
	rec      *recorder
	pool     string
	subnet   string
	maxPods  int

	logsMu    sync.Mutex
	agentLogs []agentLog
	// stopping is set when the run takes everything down: exits are no longer crashes.
	stopping atomic.Bool
}

func (c *Config) defaults() error {
	if c.Nodes == 0 {
		c.Nodes = 5
	}
	if c.Nodes < 5 || c.Nodes > 200 {
		return fmt.Errorf("nodes: %d, want 5 to 200", c.Nodes)
	}
	if c.Duration == 0 {
		c.Duration = 90 * time.Second
	}
	if c.Duration < 30*time.Second {
		return fmt.Errorf("duration %s: want at least 30s", c.Duration)
	}
	if c.TTL == 0 {
		c.TTL = 4 * time.Second
	}
	if c.ReuseDelay == 0 {
		c.ReuseDelay = 12 * time.Second
	}
	if c.Quarantine == 0 {
		c.Quarantine = 2 * time.Second
	}
	if c.Logf == nil {
		c.Logf = func(string, ...any) {}
	}
	for _, b := range []string{"leasehold", "leaseholdd", "leaseholdctl", "etcd", "etcdctl"} {
		if _, err := os.Stat(filepath.Join(c.Bin, b)); err != nil {
			return fmt.Errorf("binary %s missing in %s (make build tools): %w", b, c.Bin, err)
		}
	}
	return nil
}

// Run performs one seeded run: it builds the topology, starts etcd and the agents, runs the
// runtime and the faults for cfg.Duration, ends the faults, lets the runtime delete part of
// its pods, waits for the state to settle, snapshots etcd, runs leaseholdctl doctor, stops
// everything and judges the history. An error means the run itself could not be carried out.
// Everything it started is taken down before it returns, whatever happened.
func Run(ctx context.Context, cfg Config) (out *Outcome, err error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	// The restore fault's (the testbed restores nothing).
	if _, err := os.Stat(filepath.Join(cfg.Bin, "etcdutl")); err != nil {
		return nil, fmt.Errorf("binary etcdutl missing in %s (make tools): %w", cfg.Bin, err)
	}
	if err := NetnsAvailable(ctx); err != nil {
		return nil, err
	}
	began := time.Now()
	dir, err := os.MkdirTemp(cfg.Dir, fmt.Sprintf("lhchaos-%d-", cfg.Seed))
	if err != nil {
		return nil, err
	}
	for _, d := range []string{"netns", "state"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	e := &env{cfg: cfg, dir: dir, rec: &recorder{}, pool: "chaos"}
	// Tight: one /24 (253 addresses) and at most 1.2 times that many pods on all nodes at
	// once, so that the pool is nearly full now and then. Roomy: a /22 for as many pods.
	e.subnet = "10.77.0.0/24"
	tight := poolSize(netip.MustParsePrefix(e.subnet))
	e.maxPods = (tight*6/5 + cfg.Nodes - 1) / cfg.Nodes
	if cfg.Roomy {
		e.subnet = "10.77.0.0/22"
	}
	logf := cfg.Logf
	defer func() {
		e.teardown()
		if out != nil && out.Report != nil && !out.Report.Failed() && !cfg.Keep && err == nil {
			_ = os.RemoveAll(dir)
			out.Dir = ""
		}
	}()

	e.topo, err = newTopology(ctx, logf)
	if err != nil {
		return nil, err
	}
	logf("chaos: seed %d, %d nodes, bridge %s (198.18.%d.254/24), run directory %s", cfg.Seed, cfg.Nodes, e.topo.bridge, e.topo.X, dir)
	if err := e.startEtcd(ctx); err != nil {
		return &Outcome{Dir: dir}, err
	}
	if err := e.addNodes(ctx); err != nil {
		return &Outcome{Dir: dir}, err
	}
	logf("chaos: etcd and %d agents up after %s", cfg.Nodes, time.Since(began).Round(100*time.Millisecond))

	e.rt = e.newRuntime()
	plans := planFaults(cfg)
	start := time.Now()
	sampleCtx, stopSampling := context.WithCancel(context.Background())
	sampled := make(chan struct{})
	go func() { e.sampleLoop(sampleCtx); close(sampled) }()
	defer func() { stopSampling(); <-sampled }()

	e.rt.start(start)
	in := &injector{e: e, nodeBusy: make([]atomic.Bool, cfg.Nodes)}
	faultCtx, endFaults := context.WithDeadline(ctx, start.Add(cfg.Duration))
	in.run(faultCtx, start, plans)
	sleepCtx(faultCtx, time.Until(start.Add(cfg.Duration))) // the fault phase lasts its duration
	endFaults()
	e.restoreAll()
	faultsEnd := time.Now()
	logf("chaos: faults over after %s; the runtime keeps or deletes its pods", faultsEnd.Sub(start).Round(100*time.Millisecond))

	if !e.rt.finish(90 * time.Second) {
		e.rec.event(Event{Time: time.Now(), Kind: "runtime-stuck", Slot: -1, Fails: true,
			Detail: "pods still adding or deleting 90s after the faults ended; stopped"})
	}
	hctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	e.etcd.healthy(hctx, 60*time.Second)
	cancel()
	e.endConflicts()
	final := e.settle()
	stopSampling()
	<-sampled
	logf("chaos: settled %v after %s; doctor exit %d", final.Settled, final.SettleTook, final.DoctorExit)

	e.stopping.Store(true)
	e.stopAgents()
	h := e.rec.snapshot(true)
	h.Seed, h.Start, h.FaultsEnd, h.End, h.Final = cfg.Seed, start, faultsEnd, final.Time, final
	size := poolSize(netip.MustParsePrefix(e.subnet))
	h.Params = Params{Nodes: cfg.Nodes, TTL: cfg.TTL, ReuseDelay: cfg.ReuseDelay, Quarantine: cfg.Quarantine,
		Pool: e.pool, Subnet: e.subnet, PoolSize: size, Tight: !cfg.Roomy, Duration: cfg.Duration}
	var logEvents []Event
	h.Logs, h.LogStats, logEvents = e.parseLogs()
	h.Events = append(h.Events, logEvents...)
	skipped := 0
	for _, k := range e.rt.kubelets {
		k.mu.Lock()
		skipped += k.skipped
		k.mu.Unlock()
	}
	if skipped > 0 {
		h.Events = append(h.Events, Event{Time: h.End, Kind: "pods-capped", Slot: -1,
			Detail: fmt.Sprintf("%d planned pods not created: their node was dead or at %d pods", skipped, e.maxPods)})
	}
	r := Check(h)
	out = &Outcome{Report: r, History: h, Dir: dir, Elapsed: time.Since(began)}
	if b, err := json.MarshalIndent(h, "", " "); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "history.json"), b, 0o644)
	}
	_ = os.WriteFile(filepath.Join(dir, "report.txt"), []byte(r.String()), 0o644)
	_ = os.WriteFile(filepath.Join(dir, "doctor.txt"), []byte(final.DoctorOutput), 0o644)
	return out, nil
}

// parseLogs reads every agent incarnation's log, the lines in time order.
func (e *env) parseLogs() ([]LogEvent, map[string]int, []Event) {
	e.logsMu.Lock()
	files := slices.Clone(e.agentLogs)
	e.logsMu.Unlock()
	var logs []LogEvent
	var events []Event
	stats := map[string]int{}
	for _, l := range files {
		evs, st, err := ParseAgentLog(l.Path, l.Slot, l.Node)
		if err != nil {
			events = append(events, Event{Time: time.Now(), Kind: "log-unreadable", Slot: l.Slot, Detail: err.Error()})
		}
		logs = append(logs, evs...)
		for k, v := range st {
			stats[k] += v
		}
	}
	slices.SortStableFunc(logs, func(a, b LogEvent) int { return a.Time.Compare(b.Time) })
	return logs, stats, events
}

// restoreAll undoes whatever a fault left: every link up, every agent continued and
// running, every etcd member running, every dead node replaced.
func (e *env) restoreAll() {
	ctx, cancel := revertCtx()
	defer cancel()
	for _, h := range e.topo.hosts {
		_ = e.topo.setLink(ctx, h, true)
	}
	for _, m := range e.etcd.members {
		if !e.etcd.running(m) {
			_ = e.etcd.start(m)
		}
	}
	in := &injector{e: e}
	for _, n := range e.nodes {
		n.mu.Lock()
		dead, p := n.dead, n.p
		if p != nil && p.stopped.Load() {
			_ = p.cont()
		}
		n.mu.Unlock()
		if dead {
			in.replace(nil, n, true, e.rec.awayBegin(n.slot, "node-death-end", time.Now()))
		}
	}
}

// endConflicts deletes, as an operator would, each live pod that holds an address a standing
// conflict record says a running pod lost: the agent of the running pod takes it back as
// soon as that holder lets it go, so that the end state can be exactly the live pods'.
func (e *env) endConflicts() {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	resp, err := e.cli.Get(ctx, conflictsPrefix, clientv3.WithPrefix())
	if err != nil {
		return
	}
	holders := map[string]bool{}
	for _, kv := range resp.Kvs {
		var rec struct {
			Taken []struct {
				Holder string `json:"holder"`
			} `json:"taken"`
		}
		if json.Unmarshal(kv.Value, &rec) == nil {
			for _, t := range rec.Taken {
				holders[t.Holder] = true
			}
		}
	}
	var wg sync.WaitGroup
	e.rec.mu.Lock()
	pods := slices.Clone(e.rec.pods) // the recorded pods themselves: their DELs go in the history
	e.rec.mu.Unlock()
	for _, p := range pods {
		e.rec.mu.Lock()
		end := holders[p.UID] && p.LiveAtEnd() && p.Slot < len(e.rt.kubelets)
		e.rec.mu.Unlock()
		if !end {
			continue
		}
		k := e.rt.kubelets[p.Slot]
		pc := &podCtl{rec: p, name: strings.Replace(p.UID, "uid-", "pod-", 1), netns: filepath.Join(e.dir, "netns", p.Container)}
		pc.ctx, pc.cancel = context.WithCancel(ctx)
		e.rec.event(Event{Time: time.Now(), Kind: "conflict-ended", Slot: p.Slot,
			Detail: fmt.Sprintf("%s holds an address a running pod lost: deleted, as an operator would", p.UID)})
		wg.Go(func() {
			defer pc.cancel()
			k.del(pc, nil)
		})
	}
	wg.Wait()
}

// settle waits (bounded) until every agent is ready and the allocations are exactly the
// live pods' (FinalState), then takes the final snapshot and runs the doctor.
func (e *env) settle() *Final {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	began := time.Now()
	within := e.cfg.TTL + e.cfg.ReuseDelay + 15*time.Second
	var f *Final
	why := "no snapshot could be read"
	settled := poll(ctx, within, time.Second, func() bool {
		snap, err := e.snapshot(ctx)
		if err != nil {
			return false
		}
		f = snap
		h := e.rec.snapshot(false)
		h.Params = Params{TTL: e.cfg.TTL, ReuseDelay: e.cfg.ReuseDelay, Quarantine: e.cfg.Quarantine}
		h.Logs, _, _ = e.parseLogs() // a conflict recorded explains a lost address
		ok, summary := FinalState(h, f)
		why = summary
		if !f.AllReady {
			why += "; not every agent ready"
		}
		return ok && f.AllReady
	})
	if f == nil {
		f = &Final{Time: time.Now()}
		if snap, err := e.snapshot(ctx); err == nil {
			f = snap
		}
	}
	f.Settled, f.SettleTook, f.SettleNote = settled, time.Since(began).Round(100*time.Millisecond).String(), why
	dctx, dcancel := context.WithTimeout(ctx, 60*time.Second)
	defer dcancel()
	cmd := exec.CommandContext(dctx, filepath.Join(e.cfg.Bin, "leaseholdctl"), "--endpoints", joinComma(e.etcd.endpoints()),
		"--command-timeout", "50s", "doctor")
	b, err := cmd.CombinedOutput()
	f.DoctorOutput = string(b)
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		f.DoctorExit = ee.ExitCode()
	default:
		f.DoctorExit = -1
		f.DoctorOutput += "\n" + err.Error()
	}
	return f
}

// snapshot reads ips/, owners/, conflicts/ and held/ at one revision, and asks every agent
// whether it is ready.
func (e *env) snapshot(ctx context.Context) (*Final, error) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := e.cli.Txn(rctx).Then(
		clientv3.OpGet(ipsPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(ownersPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(conflictsPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(heldPrefix, clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, err
	}
	f := &Final{Time: time.Now(), Rev: resp.Header.Revision, Owners: map[string]string{}, Conflicts: map[string]string{},
		Held: map[string]string{}, AllReady: true}
	for i, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			switch i {
			case 0:
				if a, ok := parseAlloc(kv.Key, kv.Value, kv.Lease); ok {
					f.Allocs = append(f.Allocs, a)
				}
			case 1:
				f.Owners[string(kv.Key)] = string(kv.Value)
			case 2:
				f.Conflicts[string(kv.Key)] = string(kv.Value)
			case 3:
				f.Held[string(kv.Key)] = string(kv.Value)
			}
		}
	}
	for _, n := range e.nodes {
		if !e.ready(ctx, n) {
			f.AllReady = false
		}
	}
	return f, nil
}

// parseAlloc reads an allocation key /leasehold/v1/ips/<pool>/<block>/<ip> and its value.
func parseAlloc(key, value []byte, lease int64) (Alloc, bool) {
	k := string(key)
	ip, err := netip.ParseAddr(k[strings.LastIndexByte(k, '/')+1:])
	if err != nil {
		return Alloc{}, false
	}
	var v struct {
		Owner string `json:"owner"`
		Node  string `json:"node"`
	}
	_ = json.Unmarshal(value, &v)
	return Alloc{IP: ip, Owner: v.Owner, Node: v.Node, Lease: lease}, true
}

// sampleLoop reads the allocations (and counts the held keys without one and the quarantined
// addresses) about every second until ctx ends.
func (e *env) sampleLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		t0 := time.Now()
		resp, err := e.cli.Txn(rctx).Then(clientv3.OpGet(ipsPrefix, clientv3.WithPrefix()),
			clientv3.OpGet(heldPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly()),
			clientv3.OpGet(quarantinePrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())).Commit()
		t1 := time.Now()
		cancel()
		if err != nil {
			continue
		}
		s := Sample{T0: t0, T1: t1, Rev: resp.Header.Revision}
		allocated := map[netip.Addr]bool{}
		for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
			if a, ok := parseAlloc(kv.Key, kv.Value, kv.Lease); ok {
				a.Node, a.Lease = "", 0 // kept small: the checker needs address and owner
				s.Allocs = append(s.Allocs, a)
				allocated[a.IP] = true
			}
		}
		for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
			k := string(kv.Key)
			if ip, err := netip.ParseAddr(k[strings.LastIndexByte(k, '/')+1:]); err == nil && !allocated[ip] {
				s.HeldOnly++
			}
		}
		s.Quarantined = int(resp.Responses[2].GetResponseRange().Count)
		e.rec.sample(s)
	}
}

// stopAgents ends every agent (SIGTERM, then SIGKILL).
func (e *env) stopAgents() {
	var wg sync.WaitGroup
	for _, n := range e.nodes {
		n.mu.Lock()
		p := n.p
		n.mu.Unlock()
		if p != nil && !p.exited() {
			wg.Go(func() { p.terminate(10 * time.Second) })
		}
	}
	wg.Wait()
}

// teardown stops every process and removes the topology and the bulky etcd data.
func (e *env) teardown() {
	e.stopping.Store(true)
	if e.rt != nil {
		e.rt.cancel()
	}
	for _, n := range e.nodes {
		n.mu.Lock()
		if n.p != nil && !n.p.exited() {
			_ = n.p.kill()
		}
		n.mu.Unlock()
	}
	if e.etcd != nil {
		for _, m := range e.etcd.members {
			_ = e.etcd.kill(m)
		}
	}
	if e.cli != nil {
		e.cli.Close()
	}
	if e.topo != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		e.topo.close(ctx)
		cancel()
	}
	if e.rt != nil {
		done := make(chan struct{})
		go func() { e.rt.wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(callTimeout + 5*time.Second):
		}
	}
	if e.etcdData != "" {
		if ents, err := filepath.Glob(filepath.Join(e.etcdData, "*.data")); err == nil {
			for _, d := range ents {
				_ = os.RemoveAll(d)
			}
		}
		if strings.HasPrefix(e.etcdData, "/dev/shm/") {
			_ = os.RemoveAll(e.etcdData)
		}
	}
	_ = os.RemoveAll(filepath.Join(e.dir, "netns"))
}
