package chaos

import (
	"net/netip"
	"slices"
	"sync"
	"time"
)

// recorder holds the history while the run writes it, from many goroutines.
type recorder struct {
	mu      sync.Mutex
	pods    []*Pod
	faults  []*Fault
	away    []Away
	events  []Event
	samples []Sample
}

func (r *recorder) newPod(p *Pod) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pods = append(r.pods, p)
}

// addAttempt records an ADD; a successful one makes the pod live with addrs, unless its node
// died before the answer arrived. It reports whether the pod is live now.
func (r *recorder) addAttempt(p *Pod, a Attempt, addrs []netip.Addr) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	p.Attempts = append(p.Attempts, a)
	if !a.OK || !p.DiedAt.IsZero() && !a.Answered.Before(p.DiedAt) {
		return false
	}
	p.AddAnswered, p.Addrs = a.Answered, addrs
	return p.DiedAt.IsZero()
}

// delAttempt records a DEL; a successful one ends the pod, unless its node died first. It
// reports whether the DEL counts as answered.
func (r *recorder) delAttempt(p *Pod, a Attempt) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	p.Attempts = append(p.Attempts, a)
	if p.DelSent.IsZero() {
		p.DelSent = a.Sent
	}
	if !a.OK || !p.DiedAt.IsZero() && !a.Answered.Before(p.DiedAt) {
		return false
	}
	p.DelAnswered = a.Answered
	p.DiedAt = time.Time{} // answered before the node died: the pod ended normally
	return true
}

// markDelSent records that a DEL is about to be sent (before the call, so that the checker
// never expects a key the DEL may already have removed).
func (r *recorder) markDelSent(p *Pod, t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p.DelSent.IsZero() {
		p.DelSent = t
	}
}

// die ends every pod given that no DEL ended, at t.
func (r *recorder) die(pods []*Pod, t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, p := range pods {
		if p.DelAnswered.IsZero() && p.DiedAt.IsZero() {
			p.DiedAt = t
		}
	}
}

func (r *recorder) addFault(f *Fault) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.faults = append(r.faults, f)
}

// faultUpdate changes a fault under the lock.
func (r *recorder) faultUpdate(f *Fault, change func(f *Fault)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	change(f)
}

func (r *recorder) awayBegin(slot int, cause string, t time.Time) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.away = append(r.away, Away{Slot: slot, Start: t, Cause: cause})
	return len(r.away) - 1
}

func (r *recorder) awayEnd(i int, t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.away[i].End.IsZero() {
		r.away[i].End = t
	}
}

func (r *recorder) event(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *recorder) sample(s Sample) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.samples = append(r.samples, s)
}

// snapshot copies what was recorded into a history. withSamples false leaves the samples
// out (the settle loop needs only the pods).
func (r *recorder) snapshot(withSamples bool) *History {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := &History{}
	for _, p := range r.pods {
		c := *p
		c.Addrs = slices.Clone(p.Addrs)
		c.Attempts = slices.Clone(p.Attempts)
		h.Pods = append(h.Pods, &c)
	}
	for _, f := range r.faults {
		c := *f
		h.Faults = append(h.Faults, &c)
	}
	h.Away = slices.Clone(r.away)
	h.Events = slices.Clone(r.events)
	if withSamples {
		h.Samples = slices.Clone(r.samples)
	}
	return h
}
