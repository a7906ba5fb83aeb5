package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Fault kinds.
const (
	LinkShort     = "link-short"      // node link down for less than the TTL
	LinkMid       = "link-mid"        // between TTL and TTL + reuse delay
	LinkLong      = "link-long"       // longer than TTL + reuse delay
	KillRestart   = "kill-restart"    // agent kill -9, restarted at once
	KillPause     = "kill-pause"      // agent kill -9, restarted after more than the TTL
	SigStop       = "sigstop"         // agent SIGSTOP for 2x TTL, then SIGCONT
	SigStopDel    = "sigstop-del"     // the same, with DELs sent just before and after the SIGCONT
	DelKill       = "del-kill"        // a DEL answered, then kill -9 within 0-50 ms and restart
	NodeDeath     = "node-death"      // kill -9 for good; a new machine joins later
	EtcdKill      = "etcd-kill"       // an etcd member killed, restarted after a while
	EtcdLeaderCut = "etcd-leader-cut" // the etcd leader's link down for a few seconds
	Compact       = "compact"         // etcdctl compact to the current revision, maybe defrag
	// EtcdRestore is a backup (etcdctl snapshot save) and, a few TTLs of pods created and
	// deleted later, the whole cluster restored from it (etcdutl snapshot restore, plain or
	// with --bump-revision --mark-compacted) into fresh data directories at the same URLs.
	EtcdRestore = "etcd-restore"
	// KeyEdit is an admin's etcdctl del of one key of a running pod (its allocation, owner
	// index or pod record), or an etcdctl put of its own value over it without its lease.
	KeyEdit = "key-edit"
)

// How a restore is done: etcd's two documented ways.
const (
	RestorePlain = "plain" // the revision goes back to the backup's
	RestoreBump  = "bump"  // --bump-revision 1000000000 --mark-compacted: forward, watches compacted
)

// What a key-edit fault changes.
const (
	KeyAllocation = "allocation"
	KeyOwnerIndex = "owner-index"
	KeyPodRecord  = "pod-record"
)

type targetKind int

const (
	onNode targetKind = iota
	onEtcd
	onCluster
	// onEtcdAll needs the etcd target and the cluster's both (no member fault, no compaction).
	onEtcdAll
)

// faultKind is a kind with its weight in the random draw.
type faultKind struct {
	name   string
	target targetKind
	weight int
}

var faultKinds = []faultKind{
	{LinkShort, onNode, 3}, {LinkMid, onNode, 3}, {LinkLong, onNode, 2},
	{KillRestart, onNode, 2}, {KillPause, onNode, 2}, {SigStop, onNode, 2}, {SigStopDel, onNode, 2},
	{DelKill, onNode, 3}, {NodeDeath, onNode, 1},
	{EtcdKill, onEtcd, 2}, {EtcdLeaderCut, onEtcd, 2}, {Compact, onCluster, 2},
	{EtcdRestore, onEtcdAll, 1}, {KeyEdit, onNode, 2},
}

// faultPlan is one fault of the schedule, every parameter drawn from the seed.
type faultPlan struct {
	ID     int
	Kind   string
	At     time.Duration
	Slot   int // node faults
	Member int // etcd-kill; etcd-restore: the member the backup is taken from
	// Dur is how long the fault lasts (link down, stopped, paused, member down; from a
	// restore's backup to the loss of etcd's data).
	Dur time.Duration
	// Jitter is del-kill's delay between the DEL's answer and the kill.
	Jitter time.Duration
	// Before and After are how many DELs sigstop-del sends before and after the SIGCONT.
	Before, After int
	// Hold keeps del-kill's netns path until after the restart; SameName gives a dead
	// node's replacement the same name; Defrag follows a compaction with a defrag.
	Hold, SameName, Defrag bool
	// Way is a restore's (RestorePlain, RestoreBump); NewToken restores with another
	// --initial-cluster-token, so that the cluster ID changes too (by default it stays).
	Way      string
	NewToken bool
	// Key is what a key-edit changes (KeyAllocation, ...); Put writes the pod's own value over
	// it without its lease instead of deleting it.
	Key string
	Put bool
	// Pick seeds the choice of pods a fault deletes.
	Pick uint64
	busy time.Duration
}

func (f faultPlan) target() string {
	switch {
	case f.Slot >= 0:
		return fmt.Sprintf("n%d", f.Slot)
	case f.Kind == EtcdKill:
		return fmt.Sprintf("e%d", f.Member)
	case f.Kind == EtcdLeaderCut:
		return "leader"
	case f.Kind == EtcdRestore:
		return "all"
	}
	return "etcd"
}

func uniform(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	if hi <= lo {
		return lo
	}
	return lo + time.Duration(rng.Int64N(int64(hi-lo)))
}

// draw fills in a fault's parameters and how long its target stays busy.
func (f *faultPlan) draw(rng *rand.Rand, cfg Config) {
	ttl, rd := cfg.TTL, cfg.ReuseDelay
	switch f.Kind {
	case LinkShort:
		f.Dur = ttl / 2
	case LinkMid:
		f.Dur = uniform(rng, ttl+3*time.Second, ttl+rd-3*time.Second)
	case LinkLong:
		f.Dur = uniform(rng, ttl+rd+4*time.Second, ttl+rd+8*time.Second)
	case KillRestart:
	case KillPause:
		f.Dur = uniform(rng, ttl+2*time.Second, ttl+4*time.Second)
	case SigStop, SigStopDel:
		f.Dur = 2 * ttl
		f.Before, f.After = 1+rng.IntN(3), 1+rng.IntN(3)
	case DelKill:
		f.Jitter = time.Duration(rng.Int64N(int64(50 * time.Millisecond)))
		f.Hold = rng.IntN(2) == 0
	case NodeDeath:
		f.Dur = uniform(rng, 3*time.Second, 15*time.Second)
		f.SameName = rng.IntN(2) == 0
	case EtcdKill:
		f.Member = rng.IntN(3)
		f.Dur = uniform(rng, 3*time.Second, 10*time.Second)
	case EtcdLeaderCut:
		f.Dur = uniform(rng, 2*time.Second, 5*time.Second)
	case Compact:
		f.Defrag = rng.IntN(2) == 0
	case EtcdRestore:
		f.Member = rng.IntN(3)
		f.Dur = uniform(rng, 2*ttl, 4*ttl)
		f.Way = []string{RestorePlain, RestoreBump}[rng.IntN(2)]
		f.NewToken = rng.IntN(4) == 0
	case KeyEdit:
		f.Key = []string{KeyAllocation, KeyOwnerIndex, KeyPodRecord}[rng.IntN(3)]
		f.Put = rng.IntN(3) == 0
	}
	f.Pick = rng.Uint64()
	// How long the target stays busy: the fault, a restart, and a margin.
	f.busy = f.Dur + 8*time.Second
	if f.Kind == DelKill {
		f.busy = 15 * time.Second
	}
	if f.Kind == Compact {
		f.busy = 3 * time.Second
	}
	if f.Kind == EtcdRestore {
		// From the backup to the restored members serving: no other etcd fault may restart a
		// member meanwhile. One in the agents' repair after it is judged with it (restoreUntil).
		f.busy = f.Dur + restoreTakes + 2*time.Second
	}
	if f.Kind == KeyEdit {
		f.busy = keyWatch(ttl) + 3*time.Second
	}
}

// restoreTakes bounds a restore from the loss of etcd's data to its three members serving
// again (kill, etcdutl, start, an election); the fault ends when they do.
const restoreTakes = 10 * time.Second

// keyWatch is how long a key-edit fault looks for the key to be put back: past the bound
// the checker allows (keyGrace), so that a late repair is measured, not only failed.
func keyWatch(ttl time.Duration) time.Duration { return keyGrace(ttl) + 5*time.Second }

// longest is the upper bound of a kind's length (draw's ranges).
func longest(kind string, cfg Config) time.Duration {
	switch kind {
	case LinkShort:
		return cfg.TTL / 2
	case LinkMid:
		return cfg.TTL + cfg.ReuseDelay - 3*time.Second
	case LinkLong:
		return cfg.TTL + cfg.ReuseDelay + 8*time.Second
	case KillPause:
		return cfg.TTL + 4*time.Second
	case SigStop, SigStopDel:
		return 2 * cfg.TTL
	case NodeDeath:
		return 15 * time.Second
	case EtcdKill:
		return 10 * time.Second
	case EtcdLeaderCut:
		return 5 * time.Second
	case EtcdRestore:
		return 4*cfg.TTL + restoreTakes
	case KeyEdit:
		return keyWatch(cfg.TTL)
	}
	return time.Second
}

// planFaults draws the schedule: a fault every 2-6 s from warmup until the end of the fault
// phase, each on a target no other fault holds (one node fault per node, one etcd fault at a
// time so that a quorum stays). Kinds not drawn yet go first (those on etcd before the others,
// whenever etcd is free), the long ones as soon as they might no longer fit, so that a short
// run sees every kind; then kinds are drawn by weight.
// Only a fault that ends within the phase is planned.
func planFaults(cfg Config) []faultPlan {
	rng := newRand(cfg.Seed, 0xfa17)
	const warmup, gapMin, gapMax = 8 * time.Second, 2 * time.Second, 6 * time.Second
	nodeBusy := make([]time.Duration, cfg.Nodes)
	var etcdBusy, clusterBusy time.Duration
	uncovered := map[string]bool{}
	for _, k := range faultKinds {
		uncovered[k.name] = true
	}
	var plans []faultPlan
	// A short run (make test's) is a regression check of what is fixed: it restores no
	// backup. The restores are for the long runs (make chaos), which still find duplicates
	// (docs/chaos.md); issue 32 stays open until they pass. The tests of
	// integration/restore_test.go and the model (leases) restore etcd under make test.
	noRestores := cfg.Duration < 3*time.Minute
	t := warmup
	for {
		t += uniform(rng, gapMin, gapMax)
		if t > cfg.Duration-2*time.Second {
			return plans
		}
		// Candidates: kinds with a free target whose longest form still ends in the phase.
		var cands, fresh, freshEtcd, urgent []faultKind
		for _, k := range faultKinds {
			if t+longest(k.name, cfg)+2*time.Second > cfg.Duration {
				continue
			}
			free := false
			switch k.target {
			case onNode:
				for _, b := range nodeBusy {
					free = free || b <= t
				}
			case onEtcd:
				free = etcdBusy <= t
			case onCluster:
				free = clusterBusy <= t
			case onEtcdAll:
				free = etcdBusy <= t && clusterBusy <= t && !noRestores
			}
			if !free {
				continue
			}
			cands = append(cands, k)
			if uncovered[k.name] {
				fresh = append(fresh, k)
				if k.target == onEtcd || k.target == onEtcdAll {
					freshEtcd = append(freshEtcd, k)
				}
				if t+2*gapMax+longest(k.name, cfg)+2*time.Second > cfg.Duration {
					urgent = append(urgent, k)
				}
			}
		}
		var k faultKind
		switch {
		case len(urgent) > 0:
			k = urgent[rng.IntN(len(urgent))]
		case len(freshEtcd) > 0:
			// The etcd kinds share one target, the restore holds it for half a minute: they go
			// first, one after the other, or a short run has no room for them all.
			k = freshEtcd[rng.IntN(len(freshEtcd))]
		case len(fresh) > 0:
			k = fresh[rng.IntN(len(fresh))]
		case len(cands) > 0:
			total := 0
			for _, c := range cands {
				total += c.weight
			}
			n := rng.IntN(total)
			for _, c := range cands {
				if n < c.weight {
					k = c
					break
				}
				n -= c.weight
			}
		default:
			continue
		}
		delete(uncovered, k.name)
		f := faultPlan{ID: len(plans) + 1, Kind: k.name, At: t, Slot: -1, Member: -1}
		if k.target == onNode {
			var free []int
			for s, b := range nodeBusy {
				if b <= t {
					free = append(free, s)
				}
			}
			f.Slot = free[rng.IntN(len(free))]
		}
		f.draw(rng, cfg)
		switch k.target {
		case onNode:
			nodeBusy[f.Slot] = t + f.busy
		case onEtcd:
			etcdBusy = t + f.busy
		case onCluster:
			clusterBusy = t + f.busy
		case onEtcdAll:
			etcdBusy, clusterBusy = t+f.busy, t+f.busy
		}
		plans = append(plans, f)
	}
}

// injector applies the schedule.
type injector struct {
	e        *env
	nodeBusy []atomic.Bool
	etcdBusy atomic.Bool
	// restoring is set from a restore's loss of etcd's data until its members serve again:
	// a compaction then has nothing to compact.
	restoring atomic.Bool
	wg        sync.WaitGroup
	start     time.Time // of the run, for the notes
}

// run applies each planned fault at its time; ctx ending stops the faults in progress
// (each reverts at once). It returns when every fault has reverted.
func (in *injector) run(ctx context.Context, start time.Time, plans []faultPlan) {
	in.start = start
	for _, p := range plans {
		f := &Fault{ID: p.ID, Kind: p.Kind, Target: p.target(), Slot: p.Slot, Member: p.Member, Planned: p.At}
		in.e.rec.addFault(f)
		if !sleepCtx(ctx, time.Until(start.Add(p.At))) {
			in.e.rec.faultUpdate(f, func(f *Fault) { f.Skipped, f.Note = true, "the fault phase ended first" })
			continue
		}
		busy := &in.etcdBusy
		if p.Slot >= 0 {
			busy = &in.nodeBusy[p.Slot]
		}
		if p.Kind == Compact {
			busy = nil
		}
		if busy != nil && !poll(ctx, 15*time.Second, 200*time.Millisecond, func() bool { return busy.CompareAndSwap(false, true) }) {
			in.e.rec.faultUpdate(f, func(f *Fault) { f.Skipped, f.Note = true, "its target was still busy with an earlier fault" })
			continue
		}
		in.wg.Add(1)
		go func(p faultPlan) {
			defer in.wg.Done()
			if busy != nil {
				defer busy.Store(false)
			}
			in.apply(ctx, p, f)
		}(p)
	}
	in.wg.Wait()
}

func (in *injector) note(f *Fault, format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	in.e.rec.faultUpdate(f, func(f *Fault) {
		if f.Note != "" {
			f.Note += "; "
		}
		f.Note += s
	})
}

func (in *injector) started(f *Fault, t time.Time) {
	in.e.rec.faultUpdate(f, func(f *Fault) { f.Start = t })
}

func (in *injector) ended(f *Fault, t time.Time) {
	in.e.rec.faultUpdate(f, func(f *Fault) { f.End = t })
}

func (in *injector) skip(f *Fault, why string) {
	in.e.rec.faultUpdate(f, func(f *Fault) { f.Skipped, f.Note = true, why })
}

// revertCtx bounds what undoes a fault; it does not end with the fault phase.
func revertCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 3*time.Minute)
}

func (in *injector) apply(ctx context.Context, p faultPlan, f *Fault) {
	e := in.e
	var n *node
	if p.Slot >= 0 {
		n = e.nodes[p.Slot]
	}
	rng := rand.New(rand.NewPCG(p.Pick, 3))
	switch p.Kind {
	case LinkShort, LinkMid, LinkLong:
		in.linkDown(ctx, f, n.slot, n.host, p.Kind, p.Dur)
	case KillRestart, KillPause:
		n.mu.Lock()
		defer n.mu.Unlock()
		if n.dead || n.p == nil {
			in.skip(f, "the node is dead")
			return
		}
		t := time.Now()
		away := e.rec.awayBegin(n.slot, p.Kind, t)
		in.started(f, t)
		if err := n.p.kill(); err != nil {
			in.note(f, "%v", err)
		}
		sleepCtx(ctx, p.Dur)
		in.restart(f, n, away)
	case SigStop, SigStopDel:
		in.sigstop(ctx, p, f, n, rng)
	case DelKill:
		in.delKill(ctx, p, f, n, rng)
	case NodeDeath:
		in.nodeDeath(ctx, p, f, n)
	case EtcdKill:
		m := e.etcd.members[p.Member]
		in.started(f, time.Now())
		if err := e.etcd.kill(m); err != nil {
			in.note(f, "%v", err)
		}
		sleepCtx(ctx, p.Dur)
		if err := e.etcd.start(m); err != nil {
			in.note(f, "restart: %v", err)
		}
		in.ended(f, time.Now())
		rctx, cancel := revertCtx()
		defer cancel()
		if !e.etcd.healthy(rctx, 60*time.Second) {
			in.note(f, "the cluster was not healthy within 60s of the restart")
		}
	case EtcdLeaderCut:
		lctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		l, err := e.etcd.leader(lctx)
		cancel()
		if err != nil {
			in.skip(f, err.Error())
			return
		}
		in.e.rec.faultUpdate(f, func(f *Fault) { f.Target, f.Member = "e"+l.name[1:], l.i })
		in.linkDown(ctx, f, -1, l.host, p.Kind, p.Dur)
		rctx, cancel := revertCtx()
		defer cancel()
		if !e.etcd.healthy(rctx, 60*time.Second) {
			in.note(f, "the cluster was not healthy within 60s of the heal")
		}
	case Compact:
		in.compact(ctx, p, f, rng)
	case EtcdRestore:
		in.restore(ctx, p, f)
	case KeyEdit:
		in.keyEdit(ctx, p, f, n, rng)
	}
}

// linkDown cuts a host off for d (a node's away stretch when slot >= 0).
func (in *injector) linkDown(ctx context.Context, f *Fault, slot int, h *host, cause string, d time.Duration) {
	e := in.e
	rctx, cancel := revertCtx()
	defer cancel()
	t := time.Now()
	away := -1
	if slot >= 0 {
		away = e.rec.awayBegin(slot, cause, t)
	}
	in.started(f, t)
	if err := e.topo.setLink(rctx, h, false); err != nil {
		in.note(f, "%v", err)
	}
	sleepCtx(ctx, d)
	var err error
	for range 5 {
		if err = e.topo.setLink(rctx, h, true); err == nil {
			break
		}
		sleepCtx(rctx, time.Second)
	}
	if err != nil {
		e.rec.event(Event{Time: time.Now(), Kind: "fault-error", Slot: slot, Detail: "link up: " + err.Error(), Fails: true})
	}
	t = time.Now()
	in.ended(f, t)
	if away >= 0 {
		e.rec.awayEnd(away, t)
	}
}

// restart starts the node's agent again after a kill and ends its away stretch when it
// serves. The caller holds n.mu.
func (in *injector) restart(f *Fault, n *node, away int) {
	rctx, cancel := revertCtx()
	defer cancel()
	if err := in.e.startAgent(rctx, n); err != nil {
		in.note(f, "restart: %v", err)
	}
	t := time.Now()
	in.ended(f, t)
	in.e.rec.awayEnd(away, t)
}

func (in *injector) sigstop(ctx context.Context, p faultPlan, f *Fault, n *node, rng *rand.Rand) {
	e := in.e
	n.mu.Lock()
	if n.dead || n.p == nil {
		n.mu.Unlock()
		in.skip(f, "the node is dead")
		return
	}
	pr := n.p
	t := time.Now()
	away := e.rec.awayBegin(n.slot, p.Kind, t)
	in.started(f, t)
	if err := pr.stop(); err != nil {
		in.note(f, "SIGSTOP: %v", err)
	}
	n.mu.Unlock()
	k := e.rt.kubelets[n.slot]
	var names []string
	if p.Kind == SigStopDel {
		sleepCtx(ctx, p.Dur-500*time.Millisecond)
		for _, pc := range k.pickLive(rng, p.Before) {
			if k.requestDel(pc, nil) {
				names = append(names, pc.rec.UID+" before")
			}
		}
		sleepCtx(ctx, 500*time.Millisecond)
	} else {
		sleepCtx(ctx, p.Dur)
	}
	n.mu.Lock()
	if err := pr.cont(); err != nil {
		in.note(f, "SIGCONT: %v", err)
	}
	t = time.Now()
	n.mu.Unlock()
	in.ended(f, t)
	e.rec.awayEnd(away, t)
	if p.Kind == SigStopDel {
		for _, pc := range k.pickLive(rng, p.After) {
			if k.requestDel(pc, nil) {
				names = append(names, pc.rec.UID+" after")
			}
		}
		if len(names) == 0 {
			names = append(names, "none (no live pod on the node)")
		}
		in.note(f, "DELs around the SIGCONT: %s", strings.Join(names, ", "))
	}
}

func (in *injector) delKill(ctx context.Context, p faultPlan, f *Fault, n *node, rng *rand.Rand) {
	e := in.e
	k := e.rt.kubelets[n.slot]
	pcs := k.pickLive(rng, 1)
	req := &delReq{answered: make(chan struct{}), hold: p.Hold, release: make(chan struct{})}
	if len(pcs) == 0 || !k.requestDel(pcs[0], req) {
		in.skip(f, "no live pod to delete on the node")
		return
	}
	defer close(req.release)
	t := time.NewTimer(40 * time.Second)
	defer t.Stop()
	select {
	case <-req.answered:
	case <-t.C:
		in.skip(f, fmt.Sprintf("the DEL of %s did not answer within 40s", pcs[0].rec.UID))
		return
	case <-ctx.Done():
		in.skip(f, "the fault phase ended before the DEL answered")
		return
	}
	time.Sleep(p.Jitter) // the fault itself: 0-50 ms after the answer
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.dead || n.p == nil {
		in.skip(f, "the node is dead")
		return
	}
	killAt := time.Now()
	away := e.rec.awayBegin(n.slot, p.Kind, killAt)
	in.started(f, killAt)
	if err := n.p.kill(); err != nil {
		in.note(f, "%v", err)
	}
	in.note(f, "DEL of %s answered, kill -9 %s later", req.pod.UID, killAt.Sub(req.pod.DelAnswered).Round(time.Millisecond))
	in.restart(f, n, away)
	if p.Hold {
		sleepCtx(ctx, e.cfg.TTL) // the slow runtime's cleanup: the netns path outlives the restart
		in.note(f, "netns path kept until %s after the restart", e.cfg.TTL)
	}
}

func (in *injector) nodeDeath(ctx context.Context, p faultPlan, f *Fault, n *node) {
	e := in.e
	n.mu.Lock()
	if n.dead || n.p == nil {
		n.mu.Unlock()
		in.skip(f, "the node is dead")
		return
	}
	old := n.name
	t := time.Now()
	away := e.rec.awayBegin(n.slot, p.Kind, t)
	in.started(f, t)
	if err := n.p.kill(); err != nil {
		in.note(f, "%v", err)
	}
	e.rt.kubelets[n.slot].die(t)
	n.dead = true
	n.mu.Unlock()
	sleepCtx(ctx, p.Dur)
	name, uid := in.replace(f, n, p.SameName, away)
	in.note(f, "%s died; replaced by %s (%s)", old, name, uid)
}

// replace brings a dead node's slot back as a new machine.
func (in *injector) replace(f *Fault, n *node, sameName bool, away int) (name, uid string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.dead {
		return n.name, n.uid
	}
	n.newIdentity(in.e, sameName)
	rctx, cancel := revertCtx()
	defer cancel()
	if err := in.e.startAgent(rctx, n); err != nil {
		if f != nil {
			in.note(f, "replacement: %v", err)
		}
	}
	in.e.rt.kubelets[n.slot].join(n.name, n.uid)
	t := time.Now()
	if f != nil {
		in.ended(f, t)
	}
	in.e.rec.awayEnd(away, t)
	return n.name, n.uid
}

func (in *injector) compact(ctx context.Context, p faultPlan, f *Fault, rng *rand.Rand) {
	e := in.e
	if in.restoring.Load() {
		in.skip(f, "etcd was being restored")
		return
	}
	in.started(f, time.Now())
	defer func() { in.ended(f, time.Now()) }()
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	resp, err := e.cli.Get(gctx, "/chaos-compact-probe")
	cancel()
	if err != nil {
		in.note(f, "reading the revision: %v", err)
		return
	}
	rev := resp.Header.Revision
	out, err := e.etcd.etcdctl(ctx, 20*time.Second, e.etcd.endpoints(), "compact", fmt.Sprint(rev))
	if err != nil {
		in.note(f, "etcdctl compact %d: %v: %s", rev, err, out)
		return
	}
	in.note(f, "compacted to revision %d", rev)
	if p.Defrag {
		m := e.etcd.members[rng.IntN(3)]
		out, err := e.etcd.etcdctl(ctx, 30*time.Second, []string{m.client}, "defrag")
		if err != nil {
			in.note(f, "defrag %s: %v: %s", m.name, err, out)
			return
		}
		in.note(f, "defragmented %s", m.name)
	}
}
