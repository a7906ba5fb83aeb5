package chaos

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"time"
)

// VMs (issue 35, docs/proposals/live-migration.md): a few VMs whose pods name a migratable
// claim, as KubeVirt's virt-launcher pods do, and which the runtime migrates between the
// nodes: a target pod's ADD on another slot while the source runs, then, the target live,
// the source's DEL (the migration completed) or, one in four, the target's (it failed). A VM
// whose pod is gone (deleted by a fault, or its node dead) starts again on another node: its
// ADD waits for the claim's hand-over. Their pods are their kubelets' like any: node deaths,
// cut-offs, kills, a fault's DELs, restores and key edits fall on them too.
const (
	vmNamespace = "chaos"
	// Between two migrations of a VM (or its start and the first) it runs this long.
	vmRestMin, vmRestMax = 5 * time.Second, 25 * time.Second
	// A migration's target live, the runtime ends it (the source's or the target's DEL sent)
	// after this long: the copy of the VM's memory.
	vmCopyMin, vmCopyMax = 1 * time.Second, 20 * time.Second
)

// vm is one VM: its claim and the pods that run it, one at a time but during a migration.
type vm struct {
	rt    *runtime
	i     int
	claim string
	rng   *rand.Rand
	// keep: the VM runs on at the end; else its pod is deleted. kept is closed then, so that
	// its pod is kept (its podCtl's end).
	keep bool
	kept chan struct{}
	n    int // pods created
}

// newVMs draws 2-4 VMs from the seed.
func (rt *runtime) newVMs(seed int64) []*vm {
	rng := newRand(seed, 2000)
	var out []*vm
	for i := range 2 + rng.IntN(3) {
		out = append(out, &vm{rt: rt, i: i, claim: fmt.Sprintf("%s.vm-%d", vmNamespace, i), rng: newRand(seed, 2001+uint64(i)),
			keep: rng.IntN(2) == 0, kept: make(chan struct{})})
	}
	return out
}

// vmConf makes conf a VM's network configuration for claim: args.cni's ipam-claim-reference
// (the claim's name without its namespace, which the plugin adds from K8S_POD_NAMESPACE), and
// the network's allowPersistentIPs or, for every other VM's, ipam migratable.
func vmConf(conf, ipam map[string]any, claim string) {
	ref := strings.TrimPrefix(claim, vmNamespace+".")
	conf["args"] = map[string]any{"cni": map[string]any{"ipam-claim-reference": ref}}
	var i int
	if _, err := fmt.Sscanf(ref, "vm-%d", &i); err == nil && i%2 == 1 {
		ipam["migratable"] = true
	} else {
		conf["allowPersistentIPs"] = true
	}
}

// loop runs the VM until the runtime's end: it starts the VM, migrates it now and then, and
// starts it again when its pod is gone; at the end a migration in progress is finished as
// planned, and the VM's pod is kept or deleted.
func (v *vm) loop(start time.Time) {
	rt := v.rt
	defer rt.wg.Done()
	if !sleepCtx(rt.ctx, time.Until(start.Add(uniform(v.rng, 2*time.Second, 8*time.Second)))) {
		return
	}
	var cur *podCtl // the VM's pod, live
	for {
		if cur == nil {
			if v.ended() {
				return
			}
			pc := v.launch(-1, "")
			if pc == nil || !v.waitLive(pc) {
				if !sleepCtx(rt.ctx, time.Second) {
					return
				}
				continue
			}
			cur = pc
		}
		rest := time.NewTimer(uniform(v.rng, vmRestMin, vmRestMax))
		select {
		case <-rest.C:
		case <-cur.done:
			rest.Stop()
			cur = nil
			continue
		case <-rt.end:
			rest.Stop()
			v.finish(cur)
			return
		case <-rt.ctx.Done():
			rest.Stop()
			return
		}
		cur = v.migrate(cur)
	}
}

// ended reports whether the runtime's end has come.
func (v *vm) ended() bool {
	select {
	case <-v.rt.end:
		return true
	default:
		return false
	}
}

// migrate moves the VM from src to a target pod on another slot: its ADD while src runs,
// then, once it is live, after the copy, src's DEL or (one in four) its own. It returns the
// VM's pod afterwards (nil: none is left).
func (v *vm) migrate(src *podCtl) *podCtl {
	copyFor, fail := uniform(v.rng, vmCopyMin, vmCopyMax), v.rng.IntN(4) == 0
	tgt := v.launch(src.rec.Slot, src.rec.UID)
	if tgt == nil {
		return src
	}
	if !v.waitLive(tgt) {
		return alive(src)
	}
	if alive(src) == nil {
		return tgt // the source went meanwhile: the target holds the claim
	}
	t := time.NewTimer(copyFor)
	select {
	case <-t.C:
	case <-src.done:
	case <-tgt.done:
	case <-v.rt.ctx.Done():
		t.Stop()
		return nil
	}
	t.Stop()
	del, keep := src, tgt
	if fail {
		del, keep = tgt, src
	}
	v.rt.kubelets[del.rec.Slot].requestDel(del, nil)
	select {
	case <-del.done:
	case <-v.rt.ctx.Done():
		return nil
	}
	if k := alive(keep); k != nil {
		return k
	}
	return alive(del) // its DEL did not go (a fault's DEL had ended the other)
}

// alive is pc if it still runs, else nil.
func alive(pc *podCtl) *podCtl {
	select {
	case <-pc.done:
		return nil
	default:
		return pc
	}
}

// finish ends the VM at the runtime's end: its pod kept, or deleted.
func (v *vm) finish(cur *podCtl) {
	if v.keep {
		close(v.kept)
		return
	}
	v.rt.kubelets[cur.rec.Slot].requestDel(cur, nil)
	select {
	case <-cur.done:
	case <-v.rt.ctx.Done():
	}
}

// waitLive waits until pc is live (true) or over without having been (false).
func (v *vm) waitLive(pc *podCtl) bool {
	select {
	case <-pc.liveCh:
		return true
	case <-pc.done:
		return false
	case <-v.rt.ctx.Done():
		return false
	}
}

// launch creates a pod of the VM on a slot other than not, whose node is alive and below its
// cap, chosen by the VM's rng; target is the source's UID for a migration's target. nil: no
// slot could take it.
func (v *vm) launch(not int, target string) *podCtl {
	rt := v.rt
	slots := v.rng.Perm(len(rt.kubelets))
	seed := v.rng.Uint64()
	for _, slot := range slots {
		k := rt.kubelets[slot]
		if slot == not {
			continue
		}
		k.mu.Lock()
		if !k.available || len(k.pods) >= rt.e.maxPods {
			k.mu.Unlock()
			continue
		}
		pc := k.newPod(fmt.Sprintf("vm%d-%03d-n%d", v.i, v.n, slot), podPlan{Keep: true, Seed: seed}, v.kept, v.claim, target)
		v.n++
		k.pods[pc.rec.UID] = pc
		k.mu.Unlock()
		rt.wg.Add(1)
		go k.run(pc)
		return pc
	}
	return nil
}
