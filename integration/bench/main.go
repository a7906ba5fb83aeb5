// Command bench measures leasehold against host-local and bare etcd and writes
// bench/results/ (results.md, results.csv, latency_vs_occupancy.png). `make bench` runs it;
// see the -h flags for the sizes. Every figure is measured in one run against etcd running
// as its own process (bin/etcd, fsync on) and the real plugin binaries; progress goes to
// stderr, the table to stdout.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// config is the bench's flags. The defaults are the figures issue 6 asks for.
type config struct {
	out, bin string
	only     string

	cpuProfile, memProfile, mutexProfile, blockProfile string
	// phaseProfile, when set, is a directory for CPU profiles and execution traces of
	// single measured windows (the restart figure's recovery).
	phaseProfile string

	samples        int           // sequential ADD samples per occupancy level and plugin
	hlBudget       time.Duration // time cap on host-local's samples at one level
	lhLevels       []int
	hlLevels       []int
	versionN       int
	leaseGroup     int
	exhaustOcc     float64
	exhaustN       int
	tputConc       int
	tputDur        time.Duration
	tputRounds     int
	burstAgents    int
	burstAdds      int
	burstSubnet    netip.Prefix
	restartPods    int
	restartTTL     time.Duration
	sweepSubnet    netip.Prefix
	fanoutLevels   []int
	fanoutProcs    []int
	fanoutAdds     int
	churnPods      int
	scaleNodes     int
	scaleHosts     int
	scalePods      int
	scaleAgentPods int
	scaleFillRate  int
	scaleV4        netip.Prefix
	scaleV6        netip.Prefix
}

func parseFlags(args []string) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.StringVar(&c.out, "out", "../../bench/results", "directory for results.md, results.csv and latency_vs_occupancy.png")
	fs.StringVar(&c.bin, "bin", "../../bin", "directory holding leasehold, leaseholdd, etcd and cni/host-local (make build tools)")
	fs.StringVar(&c.only, "only", "", "comma-separated subset of figures to run: version,add,tput,parts,burst,restart,fanout,churn,rules,expiry,keepalive,holdback,exactfit,audit,scale (add includes exhaustion and rss); empty runs all but scale")
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write a CPU profile of the bench process (in-process agents included) to `file`")
	fs.StringVar(&c.memProfile, "memprofile", "", "write an allocation profile of the bench process (every allocation sampled: slower) to `file`")
	fs.StringVar(&c.mutexProfile, "mutexprofile", "", "write a mutex contention profile to `file`")
	fs.StringVar(&c.blockProfile, "blockprofile", "", "write a blocking profile to `file`")
	fs.StringVar(&c.phaseProfile, "phase-profile", "", "write a CPU profile and an execution trace of the restart figure's recovery window into `dir`")
	fs.IntVar(&c.samples, "samples", 100, "sequential plugin ADDs per occupancy level and plugin")
	fs.DurationVar(&c.hlBudget, "hl-budget", 25*time.Second, "time cap on host-local's ADD samples at one occupancy level")
	lh := fs.String("lh-levels", "0,1000,2000,5000,10000,20000,40000,60000", "allocated addresses at which leasehold's ADD is measured (/16 pool)")
	hl := fs.String("hl-levels", "0,1000,2000,5000,10000", "allocated addresses at which host-local's ADD is measured (a subset of -lh-levels)")
	fs.IntVar(&c.versionN, "version-samples", 200, "VERSION calls per plugin")
	fs.IntVar(&c.leaseGroup, "prefill-lease-group", 1, "pre-filled pods per etcd lease (1: one lease per pod, as leasehold does)")
	fs.Float64Var(&c.exhaustOcc, "exhaust-occupancy", 0.999, "occupancy of the near-exhaustion figure")
	fs.IntVar(&c.exhaustN, "exhaust-samples", 32, "ADDs measured near exhaustion (and at empty for comparison); a multiple of 4 keeps every block whole")
	fs.IntVar(&c.tputConc, "tput-concurrency", 64, "concurrent ADDs in the throughput figure")
	fs.DurationVar(&c.tputDur, "tput-duration", 3*time.Second, "length of one throughput round")
	fs.IntVar(&c.tputRounds, "tput-rounds", 2, "alternating rounds of raw etcd and agent throughput")
	fs.IntVar(&c.burstAgents, "burst-agents", 50, "agents in the burst figure")
	fs.IntVar(&c.burstAdds, "burst-adds", 1000, "ADDs in the burst, spread evenly over the agents")
	burst := fs.String("burst-subnet", "10.40.0.0/20", "pool of the burst figure")
	fs.IntVar(&c.restartPods, "restart-pods", 10000, "live allocations on the restarted agent's node")
	fs.DurationVar(&c.restartTTL, "restart-ttl", 30*time.Second, "pod lease TTL in the restart figure (the downtime before the restart is TTL/3 + 3s, so renewals are visible)")
	fan := fs.String("fanout-agents", "1,50,1000", "agents watching the pool in the fan-out simulation, in one process (ascending)")
	fanProcs := fs.String("fanout-procs", "1,50", "leaseholdd processes watching the pool in the fan-out figure (ascending)")
	fs.IntVar(&c.fanoutAdds, "fanout-adds", 1000, "sequential ADDs measured at each fan-out size")
	fs.IntVar(&c.churnPods, "churn-pods", 200, "pods ADDed and DELeted one after the other in the churn figure (and as many through host-local)")
	fs.IntVar(&c.scaleNodes, "scale-nodes", 5000, "agents of the scale figure (-only scale; not run by default)")
	fs.IntVar(&c.scaleHosts, "scale-hosts", 5, "processes the scale figure's agents run in")
	fs.IntVar(&c.scalePods, "scale-pods", 110, "pods per node in the scale figure's steady state (dual-stack: two addresses each)")
	fs.IntVar(&c.scaleAgentPods, "scale-agent-pods", 2, "pods each real agent of the scale figure ADDs, all agents at once")
	fs.IntVar(&c.scaleFillRate, "scale-fill-rate", 1000, "pods a second the scale figure's steady state is filled with at most (a lease grant and the pod's keys each)")
	scaleV4 := fs.String("scale-subnet-v4", "10.64.0.0/12", "IPv4 range of the scale figure's pool (room for -scale-nodes x -scale-pods pods)")
	scaleV6 := fs.String("scale-subnet-v6", "fd64::/104", "IPv6 range of the scale figure's pool")
	sweep := fs.String("sweep-subnet", "10.20.0.0/16", "pool of the occupancy sweep, the near-exhaustion and the RSS figures")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	var err error
	if c.lhLevels, err = parseLevels(*lh); err != nil {
		return nil, fmt.Errorf("-lh-levels: %w", err)
	}
	if c.hlLevels, err = parseLevels(*hl); err != nil {
		return nil, fmt.Errorf("-hl-levels: %w", err)
	}
	for _, l := range c.hlLevels {
		if !slices.Contains(c.lhLevels, l) {
			return nil, fmt.Errorf("-hl-levels: %d is not in -lh-levels", l)
		}
	}
	if c.fanoutLevels, err = parseLevels(*fan); err != nil || len(c.fanoutLevels) == 0 || c.fanoutLevels[0] < 1 {
		return nil, fmt.Errorf("-fanout-agents: want ascending counts >= 1 (%v)", err)
	}
	if c.fanoutProcs, err = parseLevels(*fanProcs); err != nil || len(c.fanoutProcs) == 0 || c.fanoutProcs[0] < 1 {
		return nil, fmt.Errorf("-fanout-procs: want ascending counts >= 1 (%v)", err)
	}
	if c.burstSubnet, err = netip.ParsePrefix(*burst); err != nil {
		return nil, fmt.Errorf("-burst-subnet: %w", err)
	}
	if c.scaleV4, err = netip.ParsePrefix(*scaleV4); err != nil || !c.scaleV4.Addr().Is4() {
		return nil, fmt.Errorf("-scale-subnet-v4: want an IPv4 prefix (%v)", err)
	}
	if c.scaleV6, err = netip.ParsePrefix(*scaleV6); err != nil || !c.scaleV6.Addr().Is6() {
		return nil, fmt.Errorf("-scale-subnet-v6: want an IPv6 prefix (%v)", err)
	}
	if c.sweepSubnet, err = netip.ParsePrefix(*sweep); err != nil {
		return nil, fmt.Errorf("-sweep-subnet: %w", err)
	}
	if c.samples < 1 || c.versionN < 1 || c.exhaustN < 1 || c.tputConc < 1 || c.tputRounds < 1 || c.burstAgents < 1 ||
		c.burstAdds < 1 || c.restartPods < 1 || c.fanoutAdds < 1 || c.churnPods < 1 || c.scaleFillRate < 1 || c.exhaustOcc <= 0 || c.exhaustOcc >= 1 {
		return nil, errors.New("sizes must be positive and -exhaust-occupancy in (0, 1)")
	}
	return c, nil
}

func parseLevels(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 0 {
			return nil, fmt.Errorf("%q is not a count", f)
		}
		out = append(out, n)
	}
	if !slices.IsSorted(out) {
		return nil, errors.New("levels must ascend")
	}
	return out, nil
}

// env is what every figure shares: binaries, the temporary tree, settings, where agents log.
type env struct {
	cfg  *config
	bin  string
	root string
	// netns is an existing file given as every sandbox's network namespace, so that the
	// agents' liveness checks see live sandboxes.
	netns    string
	agentLog *slog.Logger
}

func (e *env) tempDir(name string) (string, error) { return os.MkdirTemp(e.root, name+"-") }

func (e *env) wants(fig string) bool {
	if e.cfg.only == "" {
		return fig != "scale" // thousands of agents for tens of minutes: only when asked for
	}
	return slices.Contains(strings.Split(e.cfg.only, ","), fig)
}

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	if len(args) == 2 && args[0] == agentHostFlag {
		return runAgentHost(args[1]) // a share of the scale figure's agents, for a parent bench
	}
	if len(args) == 2 && args[0] == hopServerFlag {
		return runHopServer(args[1]) // the plugin ADD's socket floor, for a parent bench
	}
	cfg, err := parseFlags(args)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	defer cleanups.run()
	go func() {
		// A second signal, or a first one that the figures do not honour within 20 s,
		// still cleans up.
		<-ctx.Done()
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
		select {
		case <-sig:
		case <-time.After(20 * time.Second):
		}
		progress("interrupted; cleaning up")
		cleanups.run()
		os.Exit(130)
	}()

	if err := bench(ctx, cfg, strings.Join(args, " ")); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	return 0
}

func bench(ctx context.Context, cfg *config, argv string) error {
	bin, err := filepath.Abs(cfg.bin)
	if err != nil {
		return err
	}
	for _, b := range []string{"leasehold", "leaseholdd", "etcd", "cni/host-local"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			return fmt.Errorf("%s missing in %s: run `make build tools` first: %w", b, bin, err)
		}
	}
	out, err := filepath.Abs(cfg.out)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	root, err := os.MkdirTemp("", "leasehold-bench-")
	if err != nil {
		return err
	}
	cleanups.add(func() { _ = os.RemoveAll(root) })
	netns := filepath.Join(root, "netns")
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		return err
	}
	sink := &logSink{max: 20}
	ev := &env{cfg: cfg, bin: bin, root: root, netns: netns,
		agentLog: slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	res := &results{start: time.Now(), config: "go run . " + argv, version: describe(filepath.Dir(bin)),
		etcdVersion: etcdVersion(filepath.Join(bin, "etcd"))}
	stopProfiles, err := startProfiles(cfg.cpuProfile, cfg.memProfile, cfg.mutexProfile, cfg.blockProfile)
	if err != nil {
		return err
	}
	defer func() {
		if err := stopProfiles(); err != nil {
			progress("profiles: %v", err)
		}
	}()

	figures := []struct {
		name string
		run  func(context.Context, *env, *results) error
	}{
		{"version", figVersion},
		{"add", figAddSweep},
		{"tput", figThroughput},
		{"parts", figEtcdParts},
		{"burst", figBurst},
		{"exactfit", figExactFit},
		{"restart", figRestart},
		{"fanout", figFanout},
		{"churn", figChurn},
		{"rules", figRules},
		{"expiry", figExpiry},
		{"keepalive", figKeepalive},
		{"holdback", figHoldback},
		{"audit", figAudit},
		{"scale", figScale},
	}
	var loads []string
	for _, f := range figures {
		if !ev.wants(f.name) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		start := time.Now()
		progress("figure %s", f.name)
		warn0, lost0 := sink.n.Load(), sink.lost.Load()
		load0 := loadAvg()
		if err := f.run(ctx, ev, res); err != nil {
			return fmt.Errorf("figure %s: %w", f.name, err)
		}
		if warn, lost := sink.n.Load()-warn0, sink.lost.Load()-lost0; warn > 0 {
			res.note("Figure %s: the in-process agents logged %d warnings or errors, %d of them \"lease stopped being renewed\" "+
				"(the etcd client's keep-alive gave up on a lease; the agent then treats its pods as lost and re-claims them).", f.name, warn, lost)
		}
		progress("figure %s done in %s", f.name, time.Since(start).Round(100*time.Millisecond))
		loads = append(loads, fmt.Sprintf("%s %s→%s", f.name, load0, loadAvg()))
	}
	if len(loads) > 0 {
		res.note("The machine is shared with other work: its 1-minute load average (2 CPUs) at the start and end of each figure: %s.",
			strings.Join(loads, ", "))
	}
	res.took = time.Since(res.start)
	if err := res.write(out); err != nil {
		return err
	}
	if len(res.sweep) > 0 {
		if err := plotSweep(res, filepath.Join(out, "latency_vs_occupancy.png")); err != nil {
			return err
		}
	}
	fmt.Print(res.table())
	progress("wrote %s in %s", out, res.took.Round(time.Second))
	return nil
}

// logSink passes the in-process agents' first warnings to stderr and counts them all, and
// the lease losses among them.
type logSink struct {
	max     int64
	n, lost atomic.Int64
}

func (l *logSink) Write(p []byte) (int, error) {
	n := l.n.Add(1)
	if bytes.Contains(p, []byte("lease stopped being renewed")) {
		l.lost.Add(1)
	}
	if n <= l.max {
		_, _ = io.WriteString(os.Stderr, "bench: agent log: "+string(p))
	} else if n == l.max+1 {
		_, _ = io.WriteString(os.Stderr, "bench: agent log: (further agent warnings not shown)\n")
	}
	return len(p), nil
}

// describe names the leasehold source measured: `git describe --always --dirty` of the
// repository holding the binaries (read only), or "unknown".
func describe(repo string) string {
	out, err := exec.Command("git", "-C", repo, "describe", "--always", "--dirty").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

// etcdVersion is the version the etcd binary at path reports, or "?".
func etcdVersion(path string) string {
	out, err := exec.Command(path, "--version").Output()
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(line, "etcd Version: "); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// loadAvg is the 1-minute load average from /proc/loadavg, or "?".
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}
