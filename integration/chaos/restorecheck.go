package chaos

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"
)

// What the checker relaxes for a restore and a key edit, and what it judges instead.
//
// A restore legitimately makes etcd forget: the keys of pods created after the backup are
// gone at etcd's return, and those of pods deleted since are back. So, for each pod, from
// etcd's loss of its data until restoreUntil (etcd's return, or the pod's node's if it was
// away then, plus restoreGrace):
//   - a running pod's key missing from a sample is not "keys missing" (missing); instead the
//     restore's verdict requires the key held for the pod in the last sample before the end of
//     that window, and "keys missing" judges every sample after it as always;
//   - a deleted pod's key seen again is no resurrection if the backup may hold it (the pod's
//     ADD was sent before the backup was saved, its keys not due to be gone before the backup
//     began); seen after the window, it is one;
//   - a conflict an agent records because the address is held by a restored key (allocation
//     or held key) of a pod no longer running is justified by the restore; one with a running pod that had the
//     address before the backup, which the conflicted pod took after it, is as justified as
//     that taking was (restoredHolder).
//
// Nothing else is relaxed: two running pods on one address are an overlap whatever the
// reason, a conflict with a running pod is judged as any other (a node's addresses handed to
// another pod while its agent had not re-claimed them yet is unjustified), and the final
// state, the reuses and the doctor are judged as in any run.
//
// A key edit: the edited pod's keys may be missing from its edit until keyGrace after it (or
// after its node's return if it was away meanwhile); the key must be back on a lease with the
// pod's value by then (KeyVerdict). Overlaps and the rest are judged as always.

// restoreUntil is the end of w's window for the pods of slot: etcd's return, or the end of
// the slot's away stretch, or of an etcd member's kill or cut-off, that overlaps the restore
// or the repair after it (the agent could not reach etcd to repair), plus restoreGrace.
func (c *checker) restoreUntil(w restoreWindow, slot int) time.Time {
	grace := restoreGrace(c.h.Params.TTL)
	t := w.back
	for _, a := range c.away[slot] {
		if end := c.awayEnd(a); a.Start.Before(w.back.Add(grace)) && end.After(w.lost) && end.After(t) {
			t = end
		}
	}
	for _, f := range c.h.Faults {
		if f.Skipped || f.Start.IsZero() || f.Kind != EtcdKill && f.Kind != EtcdLeaderCut {
			continue
		}
		end := f.End
		if end.IsZero() {
			end = maxTime(c.h.End, c.h.FaultsEnd, time.Now())
		}
		if f.Start.Before(w.back.Add(grace)) && end.After(w.lost) && end.After(t) {
			t = end
		}
	}
	return t.Add(grace)
}

// inRestore reports whether [from, to] meets a restore's window for slot.
func (c *checker) inRestore(slot int, from, to time.Time) bool {
	for _, w := range c.restores {
		if w.lost.Before(to) && c.restoreUntil(w, slot).After(from) {
			return true
		}
	}
	return false
}

// mayBeInBackup reports whether pod p's keys may be in w's backup: its ADD was sent before
// the backup was saved, and its keys were not due to be gone before the backup began.
func (c *checker) mayBeInBackup(p *Pod, w restoreWindow) bool {
	if !p.Created.Before(w.backupTo) {
		return false
	}
	var gone time.Time
	switch {
	case !p.DelAnswered.IsZero():
		gone = c.deletedBy(p)
	case !p.DiedAt.IsZero():
		gone = p.DiedAt.Add(c.h.Params.TTL + c.h.Params.ReuseDelay + deadSlack)
	default:
		return true
	}
	return gone.After(w.backupFrom)
}

// restoredHolder judges a conflict of p, which lost ip to holder, recorded at t in a
// restore's window for p's node. The restore gave the address back to holder's key when:
//   - holder no longer held its addresses when etcd came back (deleted, or its DEL sent), and
//     its ADD was sent before the backup was saved: justified, etcd handed a deleted pod's
//     allocation or held key back (no running pod has the address);
//   - or holder still ran, had the address before the backup was saved, and p sent its first
//     ADD that may have claimed (firstClaim) after the backup began (the backup cannot hold
//     p's key; ADDs refused for the settle time of an earlier restore claimed nothing): p had taken the address from
//     holder, and the restore undid that. The conflict is then as justified as that taking
//     was (reuseJustified, holder as the pod that lost it): both pods have run with the
//     address since p got it; justified when both are one claim's pods on two nodes (p a
//     live migration's target, whose migration key the backup lacks);
//   - or p's first ADD that may have claimed was sent after the backup began (its key is not in the restored etcd),
//     holder was never answered the address (no successful ADD of it has ip), and an ADD of
//     holder was in flight when etcd came back and failed: it chose ip as free in the
//     restored etcd, and its agent, finding etcd gone back, gave the claim back and answered
//     an error. Justified: no pod was ever told the address but p.
//
// ok is false when none applies: the conflict is judged as any other.
func (c *checker) restoredHolder(p *Pod, holder string, ip netip.Addr, t time.Time) (ok, justified bool, why string) {
	hp := c.pods[holder]
	if hp == nil {
		return false, false, ""
	}
	for _, w := range c.restores {
		if t.Before(w.lost) || t.After(c.restoreUntil(w, p.Slot)) {
			continue
		}
		end := hp.HoldEnd()
		if !hp.Live() && end.IsZero() {
			end = hp.DelSent
		}
		if !end.IsZero() && !end.After(w.back) {
			// Its allocation, or its held key: that one outlives the pod until its node's
			// release or its block lease's end (TTL + reuse delay, more when an etcd election
			// renews every lease), which the history cannot bound.
			if !hp.Created.Before(w.backupTo) {
				continue
			}
			return true, true, fmt.Sprintf("the restore #%d (backup %s, etcd back %s) brought back a key of %s (its allocation or held key), "+
				"which had let the address go at %s", w.f.ID, c.at(w.backupFrom), c.at(w.back), hp.UID, c.at(end))
		}
		hpGot, _ := c.gotAddress(hp, ip, w.backupTo)
		if hpGot.IsZero() || !hpGot.Before(w.backupTo) || !firstClaim(p).After(w.backupFrom) {
			continue
		}
		pGot, _ := c.gotAddress(p, ip, t)
		j, why := c.reuseJustified(hp, p.UID, ip, pGot.Add(time.Second))
		if c.claimMate(p, holder) {
			// Not taken: shared, as claim p.Claim's other pod on another node (a live
			// migration's target); its migration key, written after the backup, is not in
			// the restored etcd, so its re-claim finds the address its source's.
			j, why = true, fmt.Sprintf("%s got %s at %s as claim %s's other pod on node n%d, beside %s (a live migration's target): "+
				"the backup has no migration key naming it", p.UID, ip, c.at(pGot), p.Claim, p.Slot, hp.UID)
		}
		return true, j, fmt.Sprintf("the restore #%d (backup %s, etcd back %s) gave %s back to %s, which had it before the backup; "+
			"%s had taken it: %s", w.f.ID, c.at(w.backupFrom), c.at(w.back), ip, hp.UID, p.UID, why)
	}
	for _, w := range c.restores {
		if t.Before(w.lost) || t.After(c.restoreUntil(w, p.Slot)) || !firstClaim(p).After(w.backupFrom) || slices.Contains(hp.Addrs, ip) {
			continue
		}
		if a, ok := failedAcross(hp, w); ok {
			return true, true, fmt.Sprintf("the restore #%d (backup %s, etcd back %s) lost %s's key (created after the backup); "+
				"%s's ADD sent at %s, in flight when etcd came back, claimed %s there and failed at %s: never answered the address",
				w.f.ID, c.at(w.backupFrom), c.at(w.back), p.UID, hp.UID, c.at(a.Sent), ip, c.at(a.Answered))
		}
	}
	return false, false, ""
}

// firstClaim is when the first ADD of p that may have claimed an address was sent: one that
// succeeded, or failed without an answer that says it claimed nothing (the agent not
// reachable, the settle time after a restore, a full pool). A key of p cannot be in a backup
// begun before it.
func firstClaim(p *Pod) time.Time {
	for _, a := range p.Attempts {
		if a.Op != "ADD" {
			continue
		}
		if a.OK || !slices.ContainsFunc(claimedNothing, func(m string) bool { return strings.Contains(a.Msg, m) }) {
			return a.Sent
		}
	}
	return p.Created
}

// claimedNothing are parts of the answers of ADDs refused before they claimed anything.
// "etcd does not answer (no answer since" is the agent's check that etcd answers, before
// the ADD claims anything (leases/agent.go, reachable).
var claimedNothing = []string{"is not reachable at", "settling after a restore", "pool exhausted", "only quarantined addresses are free",
	"etcd does not answer (no answer since"}

// failedAcross finds an ADD of p that was sent before etcd came back from w and failed after
// etcd lost its data.
func failedAcross(p *Pod, w restoreWindow) (Attempt, bool) {
	for _, a := range p.Attempts {
		if a.Op == "ADD" && !a.OK && !a.Sent.After(w.back) && !a.Answered.IsZero() && a.Answered.After(w.lost) {
			return a, true
		}
	}
	return Attempt{}, false
}

// keyDeadline is when the key a key-edit fault changed must be back: keyGrace after the edit,
// or after the return of the pod's node if it was away meanwhile.
func (c *checker) keyDeadline(f *Fault, slot int) time.Time {
	grace := keyGrace(c.h.Params.TTL)
	t := f.Start
	for _, a := range c.away[slot] {
		if end := c.awayEnd(a); a.Start.Before(f.Start.Add(grace)) && end.After(f.Start) && end.After(t) {
			t = end
		}
	}
	return t.Add(grace)
}

// keyEdited reports whether [from, to] meets the window of a key edit of pod uid.
func (c *checker) keyEdited(uid string, from, to time.Time) bool {
	p := c.pods[uid]
	if p == nil {
		return false
	}
	for _, f := range c.h.Faults {
		if f.Kind == KeyEdit && !f.Skipped && f.Pod == uid && !f.Start.IsZero() &&
			f.Start.Before(to) && c.keyDeadline(f, p.Slot).After(from) {
			return true
		}
	}
	return false
}

// RestoreVerdict judges one etcd-restore.
type RestoreVerdict struct {
	Fault                  int       `json:"fault"`
	Way                    string    `json:"way"`
	NewToken               bool      `json:"newToken"`
	Backup, Lost, Back     time.Time `json:"-"`
	BackupRev, RestoredRev int64     `json:"-"`
	// Running counts the pods live when etcd came back and still running at the end of their
	// window (restoreUntil); Missing those of them etcd did not hold the address for in the
	// first sample after the return; Conflicted those with a conflict recorded (judged among
	// the conflicts); Excused those without their address in the window's last sample while
	// their node was away or an etcd member down (a fault after the restore's: keys missing
	// judges them); Unjudged those without a sample in their window.
	Running, Missing, Conflicted, Excused, Unjudged int
	// Slowest is the longest from etcd's return (or the pod's node's, or an etcd fault's end,
	// restoreUntil) until a pod's address was held for it in every later sample of its
	// window, and that pod.
	Slowest    time.Duration
	SlowestPod string
	// NotBack are the running pods whose address etcd did not hold for them in the last
	// sample of their window, without a recorded conflict: each FAILS the run.
	NotBack []Missing
	// Restored counts the keys of pods deleted before etcd's return seen after it; Gone is
	// how long after the return the last was seen.
	Restored int
	Gone     time.Duration
	// Noticed is, per node slot, how long after etcd's return its agent logged that etcd went
	// back in time (absent: never logged).
	Noticed map[int]time.Duration
}

func (c *checker) restoreVerdicts() []RestoreVerdict {
	var out []RestoreVerdict
	for i, w := range c.restores {
		v := RestoreVerdict{Fault: w.f.ID, Way: w.f.Way, NewToken: w.f.NewToken, Backup: w.backupFrom, Lost: w.lost, Back: w.back,
			BackupRev: w.f.BackupRev, RestoredRev: w.f.RestoredRev, Noticed: map[int]time.Duration{}}
		next := maxTime(c.h.End, c.h.FaultsEnd).Add(time.Hour)
		if i+1 < len(c.restores) {
			next = c.restores[i+1].lost
		}
		for _, l := range c.h.Logs {
			if l.Kind == "wentback" && l.Time.After(w.lost) && l.Time.Before(next) {
				if _, seen := v.Noticed[l.Slot]; !seen {
					v.Noticed[l.Slot] = l.Time.Sub(w.back)
				}
			}
		}
		for _, p := range c.h.Pods {
			if !p.Live() || !p.AddAnswered.Before(w.back) {
				continue
			}
			until := c.restoreUntil(w, p.Slot)
			if end := p.HoldEnd(); !end.IsZero() && !end.After(until) {
				continue
			}
			var in []Sample
			for _, s := range c.h.Samples {
				if !s.T0.Before(w.back) && !s.T1.After(until) {
					in = append(in, s)
				}
			}
			if len(in) == 0 {
				v.Unjudged++
				continue
			}
			v.Running++
			holds := func(s Sample) (netip.Addr, bool) {
				for _, ip := range p.Addrs {
					if !slices.ContainsFunc(s.Allocs, func(a Alloc) bool { return a.IP == ip && (a.Owner == p.UID || c.claimMate(p, a.Owner)) }) {
						return ip, false
					}
				}
				return netip.Addr{}, true
			}
			if _, ok := holds(in[0]); !ok {
				v.Missing++
			}
			last := in[len(in)-1]
			if ip, ok := holds(last); !ok {
				if c.conflictOn(p.UID, ip, until) {
					v.Conflicted++
					continue
				}
				// A fault after the restore's own (its node away, an etcd member down near the
				// end of the window) excuses the last sample as it excuses any (missing).
				if grace := c.h.Params.TTL + healGrace; c.awayNear(p.Slot, last.T0.Add(-grace), last.T1) ||
					c.etcdFaultNear(last.T0.Add(-grace), last.T1) {
					v.Excused++
					continue
				}
				held := ""
				for _, a := range last.Allocs {
					if a.IP == ip {
						held = a.Owner
					}
				}
				v.NotBack = append(v.NotBack, Missing{Pod: p.UID, Slot: p.Slot, IP: ip, First: in[0].T0, Last: last.T0,
					Samples: len(in), HeldBy: held, Near: fmt.Sprintf("restore #%d, window until %s", w.f.ID, c.at(until))})
				continue
			}
			from := len(in) - 1
			for from > 0 {
				if _, ok := holds(in[from-1]); !ok {
					break
				}
				from--
			}
			if from > 0 {
				// From when its agent could repair: etcd's return, or its node's.
				if d := max(in[from].T1.Sub(until.Add(-restoreGrace(c.h.Params.TTL))), 0); d > v.Slowest {
					v.Slowest, v.SlowestPod = d, p.UID
				}
			}
		}
		seen := map[string]bool{}
		for _, s := range c.h.Samples {
			if !s.T0.After(w.back) || !s.T0.Before(next) {
				continue
			}
			for _, a := range s.Allocs {
				p := c.pods[a.Owner]
				if p == nil || p.DelAnswered.IsZero() || !p.DelAnswered.Before(w.back) || !s.T0.After(c.deletedBy(p)) {
					continue
				}
				if !seen[a.Owner+"/"+a.IP.String()] {
					seen[a.Owner+"/"+a.IP.String()] = true
					v.Restored++
				}
				v.Gone = max(v.Gone, s.T0.Sub(w.back))
			}
		}
		out = append(out, v)
	}
	return out
}

// KeyVerdict judges one key-edit: the key back on a lease with the pod's value by Deadline.
type KeyVerdict struct {
	Fault    int       `json:"fault"`
	Slot     int       `json:"slot"`
	Pod      string    `json:"pod"`
	Key      string    `json:"key"`
	Op       string    `json:"op"`
	Path     string    `json:"path"`
	At       time.Time `json:"at"`
	Back     time.Time `json:"back,omitzero"`
	Deadline time.Time `json:"deadline"`
	// Noticed is when the pod's agent logged its keys lost after the edit (zero: not logged).
	Noticed time.Time `json:"noticed,omitzero"`
	// Judged is false when the pod stopped running before the deadline, the key not back.
	Judged, OK bool
	Why        string `json:"why"`
}

func (c *checker) keyVerdicts() []KeyVerdict {
	var out []KeyVerdict
	for _, f := range c.h.Faults {
		if f.Kind != KeyEdit || f.Skipped || f.Start.IsZero() || f.Pod == "" {
			continue
		}
		v := KeyVerdict{Fault: f.ID, Slot: f.Slot, Pod: f.Pod, Key: f.Key, Op: f.Op, Path: f.Path, At: f.Start, Back: f.Back}
		p := c.pods[f.Pod]
		if p == nil {
			v.Why = "the pod is no pod of the runtime"
			out = append(out, v)
			continue
		}
		v.Deadline = c.keyDeadline(f, p.Slot)
		for _, l := range c.h.Logs {
			if l.Kind == "keyslost" && l.Owner == p.UID && !l.Time.Before(f.Start) {
				v.Noticed = l.Time
				break
			}
		}
		end := p.HoldEnd()
		if end.IsZero() || !end.Before(v.Deadline) || !f.Back.IsZero() && !f.Back.After(v.Deadline) {
			v.Judged = true
		} else {
			v.Why = fmt.Sprintf("not judged: the pod stopped running at %s, before the key was seen back", c.at(end))
			out = append(out, v)
			continue
		}
		switch {
		case f.Back.IsZero():
			v.Why = "not back on a lease with the pod's value by the end of the watch"
		case f.Back.After(v.Deadline):
			v.Why = fmt.Sprintf("back %s after the edit, after the deadline %s", f.Back.Sub(f.Start).Round(100*time.Millisecond), c.at(v.Deadline))
		default:
			v.OK = true
			v.Why = fmt.Sprintf("back %s after the edit", f.Back.Sub(f.Start).Round(100*time.Millisecond))
		}
		out = append(out, v)
	}
	return out
}
