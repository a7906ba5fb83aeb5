package chaos

import (
	"reflect"
	"testing"
	"time"
)

func testConfig(seed int64, d time.Duration) Config {
	c := Config{Seed: seed, Nodes: 5, Duration: d, TTL: 4 * time.Second, ReuseDelay: 12 * time.Second, Quarantine: 2 * time.Second}
	return c
}

// TestPlanFaultsIsSeeded: one seed draws one schedule; the short run's schedule holds every
// kind, never two faults on one node at once, never two etcd faults at once and no
// compaction during a restore, and every fault ends within the fault phase.
func TestPlanFaultsIsSeeded(t *testing.T) {
	for seed := int64(1); seed <= 50; seed++ {
		cfg := testConfig(seed, 120*time.Second)
		a, b := planFaults(cfg), planFaults(cfg)
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("seed %d: two schedules differ", seed)
		}
		kinds := map[string]int{}
		nodeFree := map[int]time.Duration{}
		var etcdFree, restoreFree, compactFree time.Duration
		for _, f := range a {
			kinds[f.Kind]++
			if f.At+f.Dur > cfg.Duration {
				t.Errorf("seed %d: fault %d %s at %s lasts %s, past the %s phase", seed, f.ID, f.Kind, f.At, f.Dur, cfg.Duration)
			}
			switch {
			case f.Slot >= 0:
				if f.At < nodeFree[f.Slot] {
					t.Errorf("seed %d: fault %d on n%d while another holds it", seed, f.ID, f.Slot)
				}
				nodeFree[f.Slot] = f.At + f.busy
			case f.Kind == EtcdKill || f.Kind == EtcdLeaderCut:
				if f.At < etcdFree {
					t.Errorf("seed %d: fault %d on etcd while another holds it", seed, f.ID)
				}
				etcdFree = f.At + f.busy
			case f.Kind == Compact:
				if f.At < restoreFree {
					t.Errorf("seed %d: compaction %d during a restore", seed, f.ID)
				}
				compactFree = f.At + f.busy
			case f.Kind == EtcdRestore:
				if f.At < etcdFree || f.At < compactFree {
					t.Errorf("seed %d: restore %d while another fault holds etcd", seed, f.ID)
				}
				etcdFree, restoreFree = f.At+f.busy, f.At+f.busy
			}
		}
		if len(kinds) != len(faultKinds)-1 || kinds[EtcdRestore] > 0 {
			t.Errorf("seed %d: %d faults cover %d of %d kinds: %v", seed, len(a), len(kinds), len(faultKinds), kinds)
		}
	}
	// A short run (make test) restores no backup; a long one does (make chaos).
	for _, f := range planFaults(testConfig(1, 2*time.Minute)) {
		if f.Kind == EtcdRestore {
			t.Errorf("seed 1's 2 min run restores etcd at +%s", f.At)
		}
	}
	restores := 0
	for _, f := range planFaults(testConfig(1, 10*time.Minute)) {
		if f.Kind == EtcdRestore {
			restores++
		}
	}
	if restores == 0 {
		t.Error("seed 1's 10 min run does not restore etcd")
	}
	if reflect.DeepEqual(planFaults(testConfig(1, 2*time.Minute)), planFaults(testConfig(2, 2*time.Minute))) {
		t.Error("seeds 1 and 2 draw the same schedule")
	}
}

func TestPlanPodsIsSeeded(t *testing.T) {
	for seed := int64(1); seed <= 20; seed++ {
		cfg := testConfig(seed, 120*time.Second)
		load := planLoad(cfg.Seed, cfg.Duration)
		if !reflect.DeepEqual(planPods(newRand(cfg.Seed, 1000), load, cfg.Duration), planPods(newRand(cfg.Seed, 1000), load, cfg.Duration)) {
			t.Fatal("two pod schedules of one seed differ")
		}
		n := len(planPods(newRand(cfg.Seed, 1000), load, cfg.Duration))
		if n < 30 || n > 300 {
			t.Errorf("seed %d: a node's schedule holds %d pods in 90s", seed, n)
		}
		surge := false
		for _, p := range load {
			surge = surge || p.Rate == 3 && p.Until-25*time.Second < 80*time.Second
		}
		if !surge {
			t.Errorf("seed %d: no surge in the first 80s: %v", seed, load)
		}
	}
}
