package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
)

// The kubelet-like behaviour of the simulated runtime.
const (
	addRetryFor  = 20 * time.Second // an ADD is retried this long after the first failure
	delRetry     = 2 * time.Second  // a DEL is retried this often until it answers success
	callTimeout  = 30 * time.Second // one plugin call (the plugin's own timeout is 20 s)
	maxInFlight  = 16               // plugin calls one node's runtime runs at once
	meanLifetime = 30 * time.Second
)

// runtime is the simulated container runtime: one kubelet per node slot, each creating and
// deleting pods on its own schedule by running the real plugin binary.
type runtime struct {
	e        *env
	kubelets []*kubelet
	// end is closed when the faults are over: no more pods are created, a live pod is kept or
	// deleted as its plan says.
	end     chan struct{}
	endOnce sync.Once
	// ctx ends every pod goroutine at the hard stop.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	exec   invoke.Exec
	// vms are the VMs the runtime runs and migrates between the nodes (vms.go).
	vms []*vm
}

// podPlan is one pod of a node's schedule, drawn from the seed.
type podPlan struct {
	At       time.Duration
	Lifetime time.Duration
	Keep     bool
	Seed     uint64
}

type kubelet struct {
	rt    *runtime
	slot  int
	sched []podPlan
	sem   chan struct{}

	mu        sync.Mutex
	pods      map[string]*podCtl // not finished, of the current node identity
	available bool
	node, uid string
	skipped   int
}

// podCtl drives one pod.
type podCtl struct {
	rec    *Pod
	plan   podPlan
	rng    *rand.Rand
	netns  string
	name   string
	ctx    context.Context
	cancel context.CancelFunc
	// delNow asks a live pod to be deleted now (a fault's request, or its VM's).
	delNow chan *delReq
	// end is when a live pod is kept or deleted as its plan says: the runtime's end, or, for a
	// VM's pod, its VM's (vms.go). liveCh is closed when its ADD succeeded, done when it is
	// over (deleted, kept at the end, dead or never live).
	end          <-chan struct{}
	liveCh, done chan struct{}
	// live and deleting are guarded by the kubelet's mu.
	live, deleting bool
}

// delReq is a fault's DEL: answered is closed when the DEL answered success; with hold the
// pod's netns path stays until release is closed (a slow runtime's cleanup).
type delReq struct {
	answered chan struct{}
	hold     bool
	release  chan struct{}
	pod      *Pod
}

// loadPhase is a stretch of the cluster's load: every node creates pods at about rate a
// second until the phase ends.
type loadPhase struct {
	Until time.Duration
	Rate  float64
}

// planLoad draws the cluster's load, shared by all nodes as a deployment's scale-up would
// be: phases of 10-25 s, calm (0.4 pods a second per node), busy (1.2) or a surge (3), each
// group of four phases a shuffle of calm, busy, busy and surge, so that every minute or so the
// nodes fill a tight pool together.
func planLoad(seed int64, d time.Duration) []loadPhase {
	rng := newRand(seed, 999)
	var out []loadPhase
	var t time.Duration
	for t < d {
		for _, i := range rng.Perm(4) {
			t += time.Duration(10+rng.IntN(16)) * time.Second
			out = append(out, loadPhase{Until: t, Rate: []float64{0.4, 1.2, 1.2, 3}[i]})
		}
	}
	return out
}

// planPods draws a node's schedule under the cluster's load: gaps exponential at the phase's
// rate (times a factor of 0.7-1.3 per node and phase), each pod living an exponential time
// (mean 30 s) and kept or deleted at the end.
func planPods(rng *rand.Rand, load []loadPhase, d time.Duration) []podPlan {
	var plans []podPlan
	var t time.Duration
	phase, factor := -1, 1.0
	for {
		for phase < 0 || phase < len(load)-1 && t >= load[phase].Until {
			phase++
			factor = 0.7 + 0.6*rng.Float64()
		}
		t += time.Duration(rng.ExpFloat64() / (load[phase].Rate * factor) * float64(time.Second))
		life := time.Duration(rng.ExpFloat64() * float64(meanLifetime))
		life = min(max(life, 2*time.Second), 2*time.Minute)
		keep := rng.IntN(2) == 0
		seed := rng.Uint64()
		if t >= d {
			return plans
		}
		plans = append(plans, podPlan{At: t, Lifetime: life, Keep: keep, Seed: seed})
	}
}

func (e *env) newRuntime() *runtime {
	rt := &runtime{e: e, end: make(chan struct{}),
		exec: &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: io.Discard}}}
	rt.ctx, rt.cancel = context.WithCancel(context.Background())
	load := planLoad(e.cfg.Seed, e.cfg.Duration)
	for _, n := range e.nodes {
		k := &kubelet{rt: rt, slot: n.slot, sched: planPods(newRand(e.cfg.Seed, 1000+uint64(n.slot)), load, e.cfg.Duration), sem: make(chan struct{}, maxInFlight),
			pods: map[string]*podCtl{}, available: true, node: n.name, uid: n.uid}
		rt.kubelets = append(rt.kubelets, k)
	}
	rt.vms = rt.newVMs(e.cfg.Seed)
	return rt
}

// netconf is the network configuration of slot's node: one IPv4 pool shared by all nodes. A
// VM's pod (claim not empty) names its claim as Multus' cni-args would, in args.cni's
// ipam-claim-reference, and makes it migratable by the network's allowPersistentIPs or by
// ipam migratable (vmConf).
func (rt *runtime) netconf(slot int, claim string) []byte {
	ipam := map[string]any{"type": "leasehold", "socket": rt.e.nodes[slot].socket,
		"ranges": []any{[]any{map[string]any{"subnet": rt.e.subnet}}}, "timeout": "20s"}
	conf := map[string]any{"cniVersion": "1.0.0", "name": rt.e.pool, "type": "leasehold", "ipam": ipam}
	if claim != "" {
		vmConf(conf, ipam, claim)
	}
	b, err := json.Marshal(conf)
	if err != nil {
		panic(err)
	}
	return b
}

// start runs every kubelet's creation loop and every VM from start.
func (rt *runtime) start(start time.Time) {
	for _, k := range rt.kubelets {
		rt.wg.Add(1)
		go k.loop(start)
	}
	for _, v := range rt.vms {
		rt.wg.Add(1)
		go v.loop(start)
	}
}

// finish ends the creation loops and lets every pod reach its end state (kept live, or
// deleted and answered), waiting at most within; then stops whatever is left.
func (rt *runtime) finish(within time.Duration) bool {
	rt.endOnce.Do(func() { close(rt.end) })
	done := make(chan struct{})
	go func() { rt.wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(within):
		rt.cancel()
		select {
		case <-done:
		case <-time.After(callTimeout + 5*time.Second):
		}
		return false
	}
}

func (k *kubelet) loop(start time.Time) {
	defer k.rt.wg.Done()
	for i, plan := range k.sched {
		wait := time.Until(start.Add(plan.At))
		t := time.NewTimer(max(wait, 0))
		select {
		case <-t.C:
		case <-k.rt.end:
			t.Stop()
			return
		case <-k.rt.ctx.Done():
			t.Stop()
			return
		}
		k.mu.Lock()
		if !k.available || len(k.pods) >= k.rt.e.maxPods {
			k.skipped++
			k.mu.Unlock()
			continue
		}
		pc := k.newPod(fmt.Sprintf("n%d-%04d", k.slot, i), plan, k.rt.end, "", "")
		k.pods[pc.rec.UID] = pc
		k.mu.Unlock()
		k.rt.wg.Add(1)
		go k.run(pc)
	}
}

// newPod makes a pod's controller and its netns path: uid-<id>, pod-<id>, ctr-<id>-<seed>; end
// is when it is kept or deleted as its plan says; claim and target are a VM's pod's (Pod).
// The caller holds k.mu.
func (k *kubelet) newPod(id string, plan podPlan, end <-chan struct{}, claim, target string) *podCtl {
	pc := &podCtl{plan: plan, rng: rand.New(rand.NewPCG(plan.Seed, 7)), name: "pod-" + id,
		delNow: make(chan *delReq, 1), end: end, liveCh: make(chan struct{}), done: make(chan struct{})}
	pc.rec = &Pod{UID: "uid-" + id, Container: fmt.Sprintf("ctr-%s-%08x", id, uint32(plan.Seed)), Slot: k.slot,
		Node: k.node, NodeUID: k.uid, KeepAtEnd: plan.Keep, Claim: claim, Target: target}
	pc.netns = filepath.Join(k.rt.e.dir, "netns", pc.rec.Container)
	pc.ctx, pc.cancel = context.WithCancel(k.rt.ctx)
	pc.rec.Created = time.Now()
	k.rt.e.rec.newPod(pc.rec)
	return pc
}

// run is one pod's life: ADD (retried), live until its lifetime ends (none for a VM's pod) or
// its end comes or a fault or its VM asks, DEL (retried until answered). A node death cancels
// it at any point.
func (k *kubelet) run(pc *podCtl) {
	defer k.rt.wg.Done()
	defer close(pc.done)
	defer pc.cancel()
	defer k.forget(pc)
	if err := os.WriteFile(pc.netns, nil, 0o644); err != nil {
		k.rt.e.rec.event(Event{Time: time.Now(), Kind: "runtime-error", Slot: k.slot, Detail: err.Error(), Fails: true})
		return
	}
	live := false
	first := time.Now()
	for {
		a, addrs := k.call(pc, "ADD")
		// An answer that arrived before the node died counts (the recorder compares the times).
		if k.rt.e.rec.addAttempt(pc.rec, a, addrs) {
			live = true
			break
		}
		if pc.ctx.Err() != nil {
			return
		}
		if time.Since(first) > addRetryFor {
			break
		}
		if !sleepCtx(pc.ctx, time.Second+time.Duration(pc.rng.Int64N(int64(time.Second)))) {
			return
		}
	}
	var req *delReq
	if live {
		k.mu.Lock()
		pc.live = true
		k.mu.Unlock()
		close(pc.liveCh)
		life := time.NewTimer(pc.plan.Lifetime)
		lifeEnd := life.C
		if pc.plan.Lifetime == 0 {
			lifeEnd = nil // a VM's pod lives until its VM deletes it
		}
		select {
		case <-lifeEnd:
		case req = <-pc.delNow:
		case <-pc.end:
			if pc.plan.Keep {
				life.Stop()
				return
			}
		case <-pc.ctx.Done():
			life.Stop()
			return
		}
		life.Stop()
		k.mu.Lock()
		pc.deleting = true
		k.mu.Unlock()
		// A request that raced with the end of the pod's life is still honoured.
		if req == nil {
			select {
			case req = <-pc.delNow:
			default:
			}
		}
	}
	k.del(pc, req)
}

// del sends DEL until it answers success, then removes the netns path.
func (k *kubelet) del(pc *podCtl, req *delReq) {
	for {
		k.rt.e.rec.markDelSent(pc.rec, time.Now())
		a, _ := k.call(pc, "DEL")
		if pc.ctx.Err() != nil {
			k.rt.e.rec.delAttempt(pc.rec, a)
			return
		}
		if k.rt.e.rec.delAttempt(pc.rec, a) {
			break
		}
		if a.OK {
			return // answered after its node died: the pod is dead, not deleted
		}
		if !sleepCtx(pc.ctx, delRetry) {
			return
		}
	}
	if req != nil {
		req.pod = pc.rec
		close(req.answered)
		if req.hold {
			t := time.NewTimer(2 * time.Minute)
			select {
			case <-req.release:
			case <-t.C:
			case <-k.rt.ctx.Done():
			}
			t.Stop()
		}
	}
	_ = os.Remove(pc.netns)
}

func (k *kubelet) forget(pc *podCtl) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.pods[pc.rec.UID] == pc {
		delete(k.pods, pc.rec.UID)
	}
}

// call runs the plugin binary once, as a runtime does.
func (k *kubelet) call(pc *podCtl, op string) (Attempt, []netip.Addr) {
	select {
	case k.sem <- struct{}{}:
	case <-pc.ctx.Done():
		return Attempt{Op: op, Sent: time.Now(), Answered: time.Now(), Msg: "cancelled before it was sent"}, nil
	}
	defer func() { <-k.sem }()
	ctx, cancel := context.WithTimeout(pc.ctx, callTimeout)
	defer cancel()
	args := &invoke.Args{Command: op, ContainerID: pc.rec.Container, NetNS: pc.netns, IfName: "eth0",
		PluginArgsStr: fmt.Sprintf("K8S_POD_UID=%s;K8S_POD_NAMESPACE=chaos;K8S_POD_NAME=%s", pc.rec.UID, pc.name),
		Path:          k.rt.e.cfg.Bin}
	plugin := filepath.Join(k.rt.e.cfg.Bin, "leasehold")
	conf := k.rt.netconf(k.slot, pc.rec.Claim)
	a := Attempt{Op: op, Sent: time.Now()}
	var addrs []netip.Addr
	var err error
	if op == "ADD" {
		var res types.Result
		res, err = invoke.ExecPluginWithResult(ctx, plugin, conf, args, k.rt.exec)
		if err == nil {
			var r *types100.Result
			if r, err = types100.NewResultFromResult(res); err == nil {
				for _, ip := range r.IPs {
					if a4, ok := netip.AddrFromSlice(ip.Address.IP.To4()); ok && ip.Address.IP.To4() != nil {
						addrs = append(addrs, a4)
					}
				}
				if len(addrs) == 0 {
					err = fmt.Errorf("ADD result without an IPv4 address: %v", r)
				}
			}
		}
	} else {
		err = invoke.ExecPluginWithoutResult(ctx, plugin, conf, args, k.rt.exec)
	}
	a.Answered = time.Now()
	if err == nil {
		a.OK = true
		return a, addrs
	}
	var ce *types.Error
	if errors.As(err, &ce) {
		a.Code, a.Msg = ce.Code, ce.Msg
		if ce.Details != "" {
			a.Msg += ": " + ce.Details
		}
	} else {
		a.Msg = err.Error()
	}
	if len(a.Msg) > 300 {
		a.Msg = a.Msg[:300] + "..."
	}
	return a, nil
}

// die ends every pod of the slot's node identity at t: no DEL is sent for them, their netns
// paths go, their plugin calls are cancelled. No pod is created until join.
func (k *kubelet) die(t time.Time) {
	k.mu.Lock()
	k.available = false
	var pcs []*podCtl
	var recs []*Pod
	for _, pc := range k.pods {
		pcs = append(pcs, pc)
		recs = append(recs, pc.rec)
	}
	k.mu.Unlock()
	k.rt.e.rec.die(recs, t)
	for _, pc := range pcs {
		pc.cancel()
		_ = os.Remove(pc.netns)
	}
}

// join lets the slot's new node identity have pods.
func (k *kubelet) join(node, uid string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.node, k.uid, k.available = node, uid, true
}

// pickLive chooses up to n live pods not being deleted, by rng, in a stable order.
func (k *kubelet) pickLive(rng *rand.Rand, n int) []*podCtl {
	k.mu.Lock()
	defer k.mu.Unlock()
	var live []*podCtl
	for _, pc := range k.pods {
		if pc.live && !pc.deleting {
			live = append(live, pc)
		}
	}
	slices.SortFunc(live, func(a, b *podCtl) int { return cmpString(a.rec.UID, b.rec.UID) })
	var out []*podCtl
	for len(out) < n && len(live) > 0 {
		i := rng.IntN(len(live))
		out = append(out, live[i])
		live = slices.Delete(live, i, i+1)
	}
	return out
}

// requestDel asks a live pod to be deleted now; false when it is already leaving.
func (k *kubelet) requestDel(pc *podCtl, req *delReq) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !pc.live || pc.deleting {
		return false
	}
	select {
	case pc.delNow <- req:
		return true
	default:
		return false
	}
}

// newRand is the random stream stream of a seed.
func newRand(seed int64, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(uint64(seed), stream))
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// poolSize is how many addresses an IPv4 subnet hands out: all but network, broadcast and
// the gateway (network+1).
func poolSize(p netip.Prefix) int {
	return int(math.Pow(2, float64(32-p.Bits()))) - 3
}
