package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/integration/chaos"
)

// TestChaos is the fault-injection run (integration/chaos): real etcd members and agents,
// each in its own network namespace behind a veth on one bridge, a simulated runtime
// creating and deleting pods through the real plugin binary, and seeded faults: links cut
// for less than the TTL, between TTL and TTL + reuse delay, and longer; kill -9 with a quick
// or late restart; SIGSTOP; node deaths and replacements; an etcd member killed, the etcd
// leader cut off; compactions; issue 27's races (a DEL answered then kill -9 within 50 ms;
// DELs around a SIGCONT); issue 32's: the etcd cluster restored from a backup (plain, or
// with its revision bumped and marked compacted), a running pod's key deleted or overwritten
// with etcdctl. The checker then judges the recorded history: overlaps, conflicts and
// whether each is justified, the final state against the live pods, resurrections of
// deleted pods' keys, live pods' keys missing, and the repair after a restore or an edit.
//
// Under make test it is the short version (2 min of faults, 5 nodes, about 2.5 minutes) of seed
// 1, so that the run is the same schedule every time; make chaos runs the long one with a new
// seed each time. Environment:
//
//	LEASEHOLD_CHAOS_SEED      the seed, or "random" for a new one (printed); default 1
//	LEASEHOLD_CHAOS_SEEDS     run that many seeds in a row (seed, seed+1, ...)
//	LEASEHOLD_CHAOS_DURATION  fault phase of each run (default 2m)
//	LEASEHOLD_CHAOS_NODES     agents (default 5, at least 5)
//	LEASEHOLD_CHAOS_POOL      tight (default: the pods can nearly fill a /24) or roomy (a /22)
//	LEASEHOLD_CHAOS_KEEP      keep the run directory of a passing run too
//	LEASEHOLD_CHAOS_DIR       where run directories go (default: the temporary directory)
//	LEASEHOLD_CHAOS_ETCD_DISK put etcd's data on disk, not in /dev/shm (fsync stalls become faults too)
//	LEASEHOLD_CHAOS_HISTORY   judge the history.json of an earlier run again (with the agent
//	                          logs beside it, if kept); nothing is run
func TestChaos(t *testing.T) {
	if path := os.Getenv("LEASEHOLD_CHAOS_HISTORY"); path != "" {
		h, err := chaos.LoadHistory(path)
		if err != nil {
			t.Fatal(err)
		}
		// The agents' logs next to it, if kept, are read again: a newer checker may read
		// lines the run's did not.
		if err := chaos.ReloadLogs(h, filepath.Dir(path)); err != nil {
			t.Logf("judged with the log lines history.json holds: %v", err)
		}
		r := chaos.Check(h)
		t.Logf("%s judged again:\n%s", path, r)
		if r.Failed() {
			t.Errorf("seed %d FAILED: %s", h.Seed, strings.Join(r.Failures(), ", "))
		}
		return
	}
	requireNetns(t)
	if err := chaos.NetnsAvailable(t.Context()); err != nil {
		cannotRun(t, "network namespaces are not available: %v", err)
	}
	bin := binDir(t)
	seed := int64(1)
	if s := os.Getenv("LEASEHOLD_CHAOS_SEED"); s == "random" {
		seed = time.Now().UnixNano() % 1_000_000_000
	} else if s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("LEASEHOLD_CHAOS_SEED=%q: %v", s, err)
		}
		seed = v
	}
	seeds := envInt(t, "LEASEHOLD_CHAOS_SEEDS", 1)
	nodes := envInt(t, "LEASEHOLD_CHAOS_NODES", 5)
	if nodes < 5 {
		t.Fatalf("LEASEHOLD_CHAOS_NODES=%d: at least 5", nodes)
	}
	duration := 2 * time.Minute
	if s := os.Getenv("LEASEHOLD_CHAOS_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("LEASEHOLD_CHAOS_DURATION=%q: %v", s, err)
		}
		duration = d
	}
	pool := os.Getenv("LEASEHOLD_CHAOS_POOL")
	if pool != "" && pool != "tight" && pool != "roomy" {
		t.Fatalf("LEASEHOLD_CHAOS_POOL=%q: tight or roomy", pool)
	}
	var failed []int64
	for i := range seeds {
		s := seed + int64(i)
		// Bounded: the fault phase, the end phase and settling, setup and teardown.
		ctx, cancel := context.WithTimeout(t.Context(), duration+8*time.Minute)
		out, err := chaos.Run(ctx, chaos.Config{Bin: bin, Seed: s, Nodes: nodes, Duration: duration, Roomy: pool == "roomy",
			Dir: os.Getenv("LEASEHOLD_CHAOS_DIR"), Keep: os.Getenv("LEASEHOLD_CHAOS_KEEP") != "", EtcdOnDisk: os.Getenv("LEASEHOLD_CHAOS_ETCD_DISK") != "", Logf: t.Logf})
		cancel()
		replay := fmt.Sprintf("LEASEHOLD_CHAOS_SEED=%d LEASEHOLD_CHAOS_DURATION=%s LEASEHOLD_CHAOS_NODES=%d", s, duration, nodes)
		if pool != "" {
			replay += " LEASEHOLD_CHAOS_POOL=" + pool
		}
		if err != nil {
			dir := ""
			if out != nil {
				dir = out.Dir
			}
			t.Errorf("seed %d: the run could not be carried out: %v (run directory %s)\nreplay: %s make chaos", s, err, dir, replay)
			failed = append(failed, s)
			continue
		}
		t.Logf("seed %d: run took %s\n%s", s, out.Elapsed.Round(time.Second), out.Report)
		if out.Report.Failed() {
			failed = append(failed, s)
			t.Errorf("seed %d FAILED: %s\nartifacts (agent and etcd logs, history.json, report.txt): %s\n"+
				"replay: %s make chaos\n   or: %s LEASEHOLD_BIN=%s go test -count=1 -timeout 0 -run '^TestChaos$' -v ./integration/",
				s, strings.Join(out.Report.Failures(), ", "), out.Dir, replay, replay, bin)
		}
	}
	if seeds > 1 {
		t.Logf("%d seeds from %d: %d failed %v", seeds, seed, len(failed), failed)
	}
}

func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil || v < 1 {
		t.Fatalf("%s=%q: want a positive number", name, s)
	}
	return v
}
