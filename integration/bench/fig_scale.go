package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// figScale measures a cluster of -scale-nodes real agents, not an extrapolation: the agents
// run in -scale-hosts processes (one process cannot hold the file descriptors of 5,000: each
// agent has an etcd connection, a socket, a journal and a lock), every one with its own etcd
// client, node identity and keep-alive stream, all serving one dual-stack pool. It measures,
// in this order:
//   - the agents' start: the STATUS each answers (pool definition, block claims listed,
//     watches opened), as its processes report them;
//   - one ADD at that size: etcd CPU and watch events per ADD (as the fan-out figure);
//   - the fill: -scale-pods pods on every node, through each agent's socket (real pod
//     leases: a pod is one lease);
//   - the keep-alives of every pod lease with nothing else happening: etcd's CPU over a
//     window after a full renewal period;
//   - etcd's database (size, in use, keys) and memory with every pod allocated;
//   - a new node's start in the full cluster (every other node's blocks claimed): agent
//     start, STATUS and first ADD.
func figScale(ctx context.Context, env *env, res *results) error {
	cfg := env.cfg
	if cfg.scaleHosts < 1 || cfg.scaleNodes < cfg.scaleHosts {
		return fmt.Errorf("-scale-hosts %d, -scale-nodes %d: want 1 <= hosts <= nodes", cfg.scaleHosts, cfg.scaleNodes)
	}
	// 550,000 dual-stack pods are about 2.2 million keys: over etcd's default 2 GiB quota
	// once their history is counted, as docs/performance.md says a production etcd at this
	// size must be configured.
	e, err := startEtcd(ctx, env, "scale", "--quota-backend-bytes", strconv.FormatInt(8<<30, 10))
	if err != nil {
		return err
	}
	defer e.stop()
	const pool = "scale"
	spec := hostSpec{Etcd: e.URL, Pool: pool, V4: cfg.scaleV4.String(), V6: cfg.scaleV6.String(), Pods: cfg.scalePods,
		Root: env.root, Netns: env.netns}

	// The agents' start, every host process starting its share 8 at a time.
	t0 := time.Now()
	var hosts []*agentHost
	defer func() {
		for _, h := range hosts {
			h.stop()
		}
	}()
	per := cfg.scaleNodes / cfg.scaleHosts
	for i := range cfg.scaleHosts {
		s := spec
		s.First, s.Count = i*per, per
		if i == cfg.scaleHosts-1 {
			s.Count = cfg.scaleNodes - s.First
		}
		h, err := startAgentHost(ctx, s)
		if err != nil {
			return err
		}
		hosts = append(hosts, h)
	}
	var statusP50, statusP99 time.Duration
	for _, h := range hosts {
		f, err := h.await(ctx, "ready")
		if err != nil {
			return err
		}
		statusP50, statusP99 = max(statusP50, micros(f[1])), max(statusP99, micros(f[2]))
	}
	started := time.Since(t0)
	progress("scale: %d agents in %d processes serve the pool after %s (STATUS p50 %s, p99 %s, the worst process's)",
		cfg.scaleNodes, len(hosts), started.Round(time.Second), statusP50, statusP99)

	// One ADD at this size, through an agent of this process.
	probe, err := startInproc(ctx, env, e, "scale-probe", "", nil)
	if err != nil {
		return err
	}
	defer probe.close()
	probeConf := scaleConf(pool, probe.Socket, cfg.scaleV4, cfg.scaleV6)
	if err := probe.status(ctx, probeConf); err != nil {
		return err
	}
	cost, err := measureAddCost(ctx, env, res, e, probe.Socket, probeConf, cfg.fanoutAdds, fmt.Sprintf("Scale, %d agents", cfg.scaleNodes))
	if err != nil {
		return err
	}
	progress("scale: ADD with %d agents: p50 %.2f ms, etcd CPU %.0f µs, %.1f watch events per ADD", cfg.scaleNodes, ms(cost.p50),
		cost.etcdCPU, cost.events)

	// The fill: every host ADDs its nodes' pods at once.
	t0 = time.Now()
	for _, h := range hosts {
		if err := h.send("pods"); err != nil {
			return err
		}
	}
	var placed, failed int
	var firstFail string
	for _, h := range hosts {
		f, err := h.await(ctx, "pods")
		if err != nil {
			return err
		}
		ok, _ := strconv.Atoi(f[1])
		bad, _ := strconv.Atoi(f[2])
		placed, failed = placed+ok, failed+bad
		if bad > 0 && firstFail == "" {
			firstFail = strings.Join(f[3:], " ")
		}
	}
	fill := time.Since(t0)
	progress("scale: %d pods placed (%d failed) in %s", placed, failed, fill.Round(time.Second))
	if failed > 0 {
		res.note("Scale: %d of %d pod ADDs of the fill failed, the first with: %s.", failed, placed+failed, firstFail)
	}

	// Keep-alives alone: one renewal period (a third of the 90 s TTL) after the last grant,
	// then a window of two periods.
	time.Sleep(30 * time.Second)
	c0, w0 := e.cpu().etcd, time.Now()
	m0, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return err
	}
	time.Sleep(60 * time.Second)
	m1, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return err
	}
	window := time.Since(w0)
	keepaliveCPU := float64(e.cpu().etcd-c0) / float64(window)
	renewals := (sum(m1, "grpc_server_msg_received_total", map[string]string{"grpc_method": "LeaseKeepAlive"}) -
		sum(m0, "grpc_server_msg_received_total", map[string]string{"grpc_method": "LeaseKeepAlive"})) / window.Seconds()
	dbSize := sum(m1, "etcd_mvcc_db_total_size_in_bytes", nil)
	dbInUse := sum(m1, "etcd_mvcc_db_total_size_in_use_in_bytes", nil)
	keys := sum(m1, "etcd_debugging_mvcc_keys_total", nil)
	rssKB, _ := procStatusKB(e.cmd.Process.Pid, "VmRSS")
	progress("scale: keep-alives alone: etcd %.1f%% of a core, %.0f renewals/s; database %.0f MB (%.0f MB in use), %.0f keys, etcd RSS %d MB",
		100*keepaliveCPU, renewals, dbSize/1e6, dbInUse/1e6, keys, rssKB/1024)

	// A new node joins the full cluster.
	t0 = time.Now()
	late, err := startInproc(ctx, env, e, "scale-late", "", nil)
	if err != nil {
		return err
	}
	defer late.close()
	lateStart := time.Since(t0)
	lateConf := scaleConf(pool, late.Socket, cfg.scaleV4, cfg.scaleV6)
	t0 = time.Now()
	if err := late.status(ctx, lateConf); err != nil {
		return err
	}
	lateStatus := time.Since(t0)
	t0 = time.Now()
	inv, _ := podAdd(lateConf, env.netns)
	if _, err := invoke(ctx, late.client(), inv); err != nil {
		return fmt.Errorf("the new node's first ADD: %w", err)
	}
	lateAdd := time.Since(t0)

	n := fmt.Sprintf("%d nodes", cfg.scaleNodes)
	pods := cfg.scaleNodes * cfg.scalePods
	for _, r := range []row{
		{Figure: "scale, " + n + ": agents started, every one serving the pool (wall time)", Leasehold: float64(started.Milliseconds()), Unit: "ms"},
		{Figure: "scale, " + n + ": an agent's STATUS at start (pool read, block claims listed) p99", Leasehold: ms(statusP99), Unit: "ms"},
		{Figure: "scale, " + n + ": etcd CPU per ADD", Leasehold: cost.etcdCPU, Unit: "µs"},
		{Figure: "scale, " + n + ": watch events sent per ADD", Leasehold: cost.events, Target: "<= 2", pass: passIf(cost.events <= 2)},
		{Figure: fmt.Sprintf("scale, %s: %d dual-stack pods placed (fill wall time)", n, pods), Leasehold: float64(fill.Milliseconds()), Unit: "ms"},
		{Figure: fmt.Sprintf("scale, %s: failed ADDs of the fill", n), Leasehold: float64(failed), Target: "0", pass: passIf(failed == 0)},
		{Figure: fmt.Sprintf("scale, %s x %d pods: etcd CPU for keep-alives alone", n, cfg.scalePods), Leasehold: 100 * keepaliveCPU, Unit: "% of a core"},
		{Figure: fmt.Sprintf("scale, %s x %d pods: lease renewals received", n, cfg.scalePods), Leasehold: renewals, Unit: "/s"},
		{Figure: fmt.Sprintf("scale, %d pods: etcd database size", pods), Leasehold: dbSize / 1e6, Unit: "MB"},
		{Figure: fmt.Sprintf("scale, %d pods: etcd database in use", pods), Leasehold: dbInUse / 1e6, Unit: "MB"},
		{Figure: fmt.Sprintf("scale, %d pods: etcd keys", pods), Leasehold: keys},
		{Figure: fmt.Sprintf("scale, %d pods: etcd RSS", pods), Leasehold: float64(rssKB) / 1024, Unit: "MB"},
		{Figure: "scale, " + n + " full: a new agent's start (leases.Start)", Leasehold: ms(lateStart), Unit: "ms"},
		{Figure: "scale, " + n + " full: a new agent's first STATUS", Leasehold: ms(lateStatus), Unit: "ms"},
		{Figure: "scale, " + n + " full: a new agent's first ADD", Leasehold: ms(lateAdd), Unit: "ms"},
	} {
		res.add(r)
	}
	res.note("Scale (%s): %d agents (leases.Agent with leaseholdd's defaults, each its own etcd client, node identity, socket "+
		"and journal) in %d processes of %d, all serving one dual-stack pool (%s and %s, /26 and /122 blocks); etcd with an 8 GiB "+
		"quota. Start: each process starts its agents 8 at a time and each answers a STATUS; the STATUS p50/p99 are the worst "+
		"process's. ADD: %d sequential ADDs through one more agent, etcd CPU less its idle rate, watch events = delta of "+
		"etcd_debugging_mvcc_events_total. Fill: each process ADDs %d pods on each of its agents through their sockets, 64 "+
		"agents at a time per process. Keep-alives: 30 s after the fill, etcd's CPU over 60 s; renewals = LeaseKeepAlive "+
		"messages etcd received per second. Database: etcd_mvcc_db_total_size(_in_use)_in_bytes, etcd_debugging_mvcc_keys_total, "+
		"VmRSS. A new node: an agent started after the fill, its STATUS and first ADD (claiming a block among every node's). "+
		"Borrowing when every block is claimed is the RSS figure's case (a /16), not measured here.",
		n, cfg.scaleNodes, len(hosts), per, cfg.scaleV4, cfg.scaleV6, cfg.fanoutAdds, cfg.scalePods)
	return nil
}

func passIf(ok bool) string {
	if ok {
		return "yes"
	}
	return "no"
}

// micros parses a count of microseconds printed by an agent host.
func micros(s string) time.Duration {
	n, _ := strconv.ParseInt(s, 10, 64)
	return time.Duration(n) * time.Microsecond
}

// scaleConf is a dual-stack network whose IPAM is leasehold, one range set per family.
func scaleConf(network, socket string, v4, v6 netip.Prefix) []byte {
	return mustJSON(map[string]any{
		"cniVersion": "1.1.0", "name": network, "type": "macvlan", "master": "eth0",
		"ipam": map[string]any{
			"type": "leasehold", "socket": socket,
			"ranges": []any{[]any{map[string]any{"subnet": v4.String()}}, []any{map[string]any{"subnet": v6.String()}}},
		},
	})
}

// hostSpec is what an agent host process runs: agents First..First+Count-1 of the figure.
type hostSpec struct {
	Etcd, Pool, V4, V6, Root, Netns string
	First, Count, Pods              int
}

// agentHost is a child process of the bench running a share of the figure's agents. It
// speaks in lines: it prints "ready P50 P99" (µs) once its agents serve the pool, then
// "pods OK FAILED [FIRST ERROR]" after each "pods" it is sent; it exits when its stdin
// closes, and on an error prints "error MESSAGE".
type agentHost struct {
	stop  func()
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan []string
	done  chan struct{}
}

// agentHostFlag runs the bench as an agent host instead (hidden).
const agentHostFlag = "-agent-host"

func startAgentHost(ctx context.Context, spec hostSpec) (*agentHost, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	b, _ := json.Marshal(spec)
	h := &agentHost{cmd: exec.Command(self, agentHostFlag, string(b)), lines: make(chan []string, 4), done: make(chan struct{})}
	h.cmd.Stderr = os.Stderr
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if h.in, err = h.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := h.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := h.cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			h.lines <- strings.Fields(sc.Text())
		}
		close(h.lines)
	}()
	go func() { _ = h.cmd.Wait(); close(h.done) }()
	h.stop = cleanups.add(func() {
		_ = h.in.Close()
		select {
		case <-h.done:
		case <-time.After(60 * time.Second):
			_ = h.cmd.Process.Kill()
			<-h.done
		}
	})
	return h, nil
}

func (h *agentHost) send(cmd string) error {
	_, err := io.WriteString(h.in, cmd+"\n")
	return err
}

// await is the host's next line, which must begin with word.
func (h *agentHost) await(ctx context.Context, word string) ([]string, error) {
	select {
	case f, ok := <-h.lines:
		switch {
		case !ok:
			return nil, fmt.Errorf("agent host %d exited before %q", h.cmd.Process.Pid, word)
		case len(f) > 0 && f[0] == word:
			return f, nil
		default:
			return nil, fmt.Errorf("agent host %d: %s", h.cmd.Process.Pid, strings.Join(f, " "))
		}
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// runAgentHost is the child's side of agentHost.
func runAgentHost(arg string) int {
	var spec hostSpec
	if err := json.Unmarshal([]byte(arg), &spec); err != nil {
		fmt.Println("error", err)
		return 2
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	defer cleanups.run()
	err := agentHostRun(ctx, spec)
	if err != nil {
		fmt.Println("error", strings.ReplaceAll(err.Error(), "\n", " "))
		return 1
	}
	return 0
}

func agentHostRun(ctx context.Context, spec hostSpec) error {
	v4, err := netip.ParsePrefix(spec.V4)
	if err != nil {
		return err
	}
	v6, err := netip.ParsePrefix(spec.V6)
	if err != nil {
		return err
	}
	root, err := os.MkdirTemp(spec.Root, fmt.Sprintf("host-%d-", spec.First))
	if err != nil {
		return err
	}
	// IDs unique across the run: the parent and every host draw from their own stream.
	ids = &idGen{r: rand.New(rand.NewPCG(6, uint64(spec.First)+1<<32))}
	sink := &logSink{max: 5}
	env := &env{root: root, netns: spec.Netns, agentLog: slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	e := &etcdProc{URL: spec.Etcd}
	agents := make([]*inproc, spec.Count)
	var lat durations
	var mu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range agents {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			a, err := startInproc(ctx, env, e, fmt.Sprintf("scale-%05d", spec.First+i), "", nil)
			var took time.Duration
			if err == nil {
				t := time.Now()
				err = a.status(ctx, scaleConf(spec.Pool, a.Socket, v4, v6))
				took = time.Since(t)
			}
			mu.Lock()
			defer mu.Unlock()
			agents[i], lat = a, append(lat, took)
			if err != nil && firstErr == nil {
				firstErr = err
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	fmt.Printf("ready %d %d\n", lat.pct(50).Microseconds(), lat.pct(99).Microseconds())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if in.Text() != "pods" {
			return fmt.Errorf("unknown command %q", in.Text())
		}
		var ok, failed atomic.Int64
		var first atomic.Value
		sem := make(chan struct{}, 64)
		for _, a := range agents {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				conf := scaleConf(spec.Pool, a.Socket, v4, v6)
				cl := a.client()
				for range spec.Pods {
					inv, _ := podAdd(conf, spec.Netns)
					if _, err := invoke(ctx, cl, inv); err != nil {
						failed.Add(1)
						first.CompareAndSwap(nil, strings.ReplaceAll(err.Error(), "\n", " "))
						continue
					}
					ok.Add(1)
				}
			})
		}
		wg.Wait()
		msg, _ := first.Load().(string)
		fmt.Printf("pods %d %d %s\n", ok.Load(), failed.Load(), msg)
	}
	if err := in.Err(); err != nil && !errors.Is(err, os.ErrClosed) {
		return err
	}
	return nil
}
