package chaos

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Report is what Check found.
type Report struct {
	Seed                  int64
	Params                Params
	Start, FaultsEnd, End time.Time

	PodsCreated, PodsEverLive, PodsNeverLive, PodsDied, LiveAtEnd int
	// PeakLive is the most pods live at once, at PeakAt.
	PeakLive                 int
	PeakAt                   time.Time
	Attempts, FailedAttempts int
	FailuresByCode           map[string]int
	// DelsUnanswered are pods (of living nodes) whose DEL never answered success.
	DelsUnanswered []string

	Faults        []*Fault
	FaultsByKind  map[string]int
	FaultsSkipped int

	Overlaps []Overlap
	// Migrations are the live migrations' pairs, each counted as one owner of its address.
	Migrations    []Migration
	Conflicts     []ConflictVerdict
	Resolved      int
	Reuses        []ReuseVerdict
	Resurrections []Resurrection
	Missing       []Missing
	Restores      []RestoreVerdict
	KeyEdits      []KeyVerdict

	HaveFinal                              bool
	Leaks, Pending                         []Leak
	Lost, Standing                         []Lost
	FinalAllocs, FinalHeld, FinalConflicts int
	AllReady, Settled                      bool
	SettleTook, SettleNote                 string
	Doctor                                 int
	DoctorOutput                           string
	Events                                 []Event
	LogStats                               map[string]int
}

// Unexplained are the overlaps no agent recorded as a conflict.
func (r *Report) Unexplained() []Overlap {
	var out []Overlap
	for _, o := range r.Overlaps {
		if !o.Recorded {
			out = append(out, o)
		}
	}
	return out
}

// Unjustified are the conflicts neither a long enough absence nor a full pool explains.
func (r *Report) Unjustified() []ConflictVerdict {
	var out []ConflictVerdict
	for _, v := range r.Conflicts {
		if !v.Justified {
			out = append(out, v)
		}
	}
	return out
}

// Failures names each reason the run failed; none means it passed.
func (r *Report) Failures() []string {
	var out []string
	add := func(n int, what string) {
		if n > 0 {
			out = append(out, fmt.Sprintf("%d %s", n, what))
		}
	}
	add(len(r.Unexplained()), "unexplained overlaps")
	add(len(r.Unjustified()), "unjustified conflicts")
	withRoom := 0
	for _, v := range r.Reuses {
		if v.WithRoom() {
			withRoom++
		}
	}
	add(withRoom, "reuses of held-back addresses while the pool had room")
	add(len(r.Resurrections), "resurrections")
	add(len(r.Missing), "keys missing")
	notBack, notPut := 0, 0
	for _, v := range r.Restores {
		notBack += len(v.NotBack)
	}
	for _, v := range r.KeyEdits {
		if v.Judged && !v.OK {
			notPut++
		}
	}
	add(notBack, "running pods without their address after a restore")
	add(notPut, "edited keys not put back")
	add(len(r.Leaks), "leaks")
	add(len(r.Lost), "lost keys")
	add(len(r.DelsUnanswered), "DELs never answered")
	n := 0
	for _, e := range r.Events {
		if e.Fails {
			n++
		}
	}
	add(n, "failing events")
	switch {
	case !r.HaveFinal:
		out = append(out, "no final snapshot")
	case r.Doctor != 0:
		out = append(out, fmt.Sprintf("doctor exit %d", r.Doctor))
	}
	return out
}

// Failed reports whether the run failed.
func (r *Report) Failed() bool { return len(r.Failures()) > 0 }

// maxListed bounds each detail list of the report.
const maxListed = 25

// String is the report as printed.
func (r *Report) String() string {
	var b strings.Builder
	p := r.Params
	at := func(t time.Time) string { return offset(r.Start, t) }
	w := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	mode := "roomy"
	if p.Tight {
		mode = "tight"
	}
	w("=== leasehold chaos report ===")
	w("seed %d: %d nodes, pool %s %s (%d addresses, %s), faults planned for %s, run %s (faults ended %s)",
		r.Seed, p.Nodes, p.Pool, p.Subnet, p.PoolSize, mode, p.Duration, r.End.Sub(r.Start).Round(time.Second), at(r.FaultsEnd))
	w("timings: TTL %s, reuse delay %s, quarantine %s", p.TTL, p.ReuseDelay, p.Quarantine)
	w("pods: %d created, %d live at some time, %d never live, %d died with their node, %d live at end",
		r.PodsCreated, r.PodsEverLive, r.PodsNeverLive, r.PodsDied, r.LiveAtEnd)
	w("peak: %d pods live at once at %s (%.0f%% of the pool)", r.PeakLive, at(r.PeakAt), 100*float64(r.PeakLive)/float64(max(p.PoolSize, 1)))
	w("plugin calls: %d, %d failed %s", r.Attempts, r.FailedAttempts, countsLine(r.FailuresByCode))
	nf := 0
	for _, n := range r.FaultsByKind {
		nf += n
	}
	w("faults: %d injected %s, %d skipped", nf, countsLine(r.FaultsByKind), r.FaultsSkipped)
	for _, f := range r.Faults {
		state := fmt.Sprintf("%s..%s", at(f.Start), at(f.End))
		if f.Skipped {
			state = "skipped"
		}
		note := ""
		if f.Note != "" {
			note = ": " + f.Note
		}
		w("  #%-3d %-16s %-5s planned +%.0fs  %s%s", f.ID, f.Kind, f.Target, f.Planned.Seconds(), state, note)
	}
	for _, e := range r.Events {
		where := ""
		if e.Slot >= 0 {
			where = fmt.Sprintf(" n%d", e.Slot)
		}
		tag := ""
		if e.Fails {
			tag = " (FAILS the run)"
		}
		w("event %s %s%s%s: %s", at(e.Time), e.Kind, where, tag, e.Detail)
	}

	un := r.Unexplained()
	unknown := 0
	for _, o := range r.Overlaps {
		if o.Unknown {
			unknown++
		}
	}
	w("(a) overlaps: %d unexplained, %d with a recorded conflict (%d of them recorded as unknowable: etcd's history compacted)",
		len(un), len(r.Overlaps)-len(un), unknown)
	claims := map[string]int{}
	for _, m := range r.Migrations {
		claims[m.Claim]++
	}
	w("    live migrations (two pods of one claim on two nodes, one owner): %d %s", len(r.Migrations), countsLine(claims))
	overlaps := slices.Clone(r.Overlaps) // the unexplained first, as the conflicts below
	slices.SortStableFunc(overlaps, func(a, b Overlap) int { return cmpBool(a.Recorded, b.Recorded) })
	for i, o := range overlaps {
		if i == maxListed {
			w("    ... %d more", len(r.Overlaps)-i)
			break
		}
		tag := "UNEXPLAINED"
		switch {
		case o.Unknown:
			tag = "unknowable"
		case o.Recorded:
			tag = "recorded"
		}
		w("    %s %s held by %s and %s from %s to %s", tag, o.IP, o.A, o.B, at(o.From), at(o.To))
		if o.Hint != "" {
			w("        %s", o.Hint)
		}
	}
	uj := r.Unjustified()
	w("(b) conflicts (distinct owner, address and holder): %d recorded, %d justified, %d UNJUSTIFIED; %d resolved later", len(r.Conflicts),
		len(r.Conflicts)-len(uj), len(uj), r.Resolved)
	// The unjustified first: a long run's list is cut at maxListed.
	conflicts := slices.Clone(r.Conflicts)
	slices.SortStableFunc(conflicts, func(a, b ConflictVerdict) int { return cmpBool(a.Justified, b.Justified) })
	for i, v := range conflicts {
		if i == maxListed {
			w("    ... %d more", len(r.Conflicts)-i)
			break
		}
		tag := "UNJUSTIFIED"
		if v.Justified {
			tag = "justified"
		}
		times := ""
		if v.Logged > 1 {
			times = fmt.Sprintf(" (logged %d times)", v.Logged)
		}
		w("    %s %s: %s (n%d) lost %s to %s%s: %s", tag, at(v.Time), v.Owner, v.Slot, v.IP, v.Holder, times, v.Reason)
	}
	full, keeping := 0, 0
	for _, v := range r.Reuses {
		switch {
		case v.Full:
			full++
		case v.Keeping:
			keeping++
		}
	}
	w("    reuses logged: %d, %d with the pool full by the history, %d in a keep time after etcd went back, %d with room",
		len(r.Reuses), full, keeping, len(r.Reuses)-full-keeping)
	listed := 0
	for _, v := range r.Reuses {
		if v.Full {
			continue
		}
		if listed == maxListed {
			break
		}
		listed++
		tag := "reuse with room"
		if v.Keeping {
			tag = "explained: reuse in a keep time"
		}
		w("    %s %s n%d %s: %s", tag, at(v.Time), v.Slot, v.IP, v.Why)
	}
	w("(c) final state (%s; settled %v after %s; all agents ready %v): %d allocations, %d held keys, %d conflict records",
		"after the runtime's DELs", r.Settled, r.SettleTook, r.AllReady, r.FinalAllocs, r.FinalHeld, r.FinalConflicts)
	if !r.Settled && r.SettleNote != "" {
		w("    not settled at the deadline: %s", r.SettleNote)
	}
	w("    leaks: %d", len(r.Leaks))
	for i, l := range r.Leaks {
		if i == maxListed {
			w("    ... %d more", len(r.Leaks)-i)
			break
		}
		w("      %s owner %s: %s", l.IP, l.Owner, l.Reason)
	}
	w("    lost keys: %d (and %d lost to a standing conflict whose holder is live)", len(r.Lost), len(r.Standing))
	for i, l := range r.Lost {
		if i == maxListed {
			w("    ... %d more", len(r.Lost)-i)
			break
		}
		held := "nobody"
		if l.HeldBy != "" {
			held = l.HeldBy
		}
		w("      %s of %s (n%d) is held by %s", l.IP, l.Pod, l.Slot, held)
		if l.Why != "" {
			w("        %s", l.Why)
		}
	}
	if len(r.Pending) > 0 {
		w("    dead nodes' keys still within TTL+reuse delay+%s: %d", deadSlack, len(r.Pending))
	}
	w("    doctor: exit %d", r.Doctor)
	if r.Doctor != 0 && r.DoctorOutput != "" {
		for _, line := range firstLines(r.DoctorOutput, 30) {
			w("      | %s", line)
		}
	}
	w("(d) resurrections (a deleted pod's key seen later than TTL after its DEL answered): %d", len(r.Resurrections))
	for i, x := range r.Resurrections {
		if i == maxListed {
			w("    ... %d more", len(r.Resurrections)-i)
			break
		}
		w("    %s of %s (n%d): DEL answered %s, key seen %s..%s in %d samples", x.IP, x.Pod, x.Slot,
			at(x.DelAnswered), at(x.First), at(x.Last), x.Samples)
	}
	w("(e) keys missing (a live pod without its key, its node neither away nor healed within TTL+%s, no etcd member down or cut off then): %d",
		healGrace, len(r.Missing))
	for i, m := range r.Missing {
		if i == maxListed {
			w("    ... %d more", len(r.Missing)-i)
			break
		}
		held := "nobody"
		if m.HeldBy != "" {
			held = m.HeldBy
		}
		near := m.Near
		if near == "" {
			near = "no fault"
		}
		w("    %s of %s (n%d): missing %s..%s in %d samples, held by %s at first; near %s", m.IP, m.Pod, m.Slot,
			at(m.First), at(m.Last), m.Samples, held, near)
	}
	w("(f) restores (every running pod holds its address again, every restored key of a deleted pod gone, within %s of etcd's return or its node's): %d",
		restoreGrace(p.TTL), len(r.Restores))
	for _, v := range r.Restores {
		token := "same token (cluster ID kept)"
		if v.NewToken {
			token = "new token (new cluster ID)"
		}
		w("    #%d %s, %s: backup %s at revision %d, etcd lost %s, back %s at revision %d", v.Fault, v.Way, token,
			at(v.Backup), v.BackupRev, at(v.Lost), at(v.Back), v.RestoredRev)
		w("      %d running pods judged: %d without their address at the return, the slowest back %s after it, or its node's (%s); %d with a conflict recorded; "+
			"%d without it at the window's end, a later fault near; %d unjudged (no sample)",
			v.Running, v.Missing, v.Slowest.Round(100*time.Millisecond), orNone(v.SlowestPod), v.Conflicted, v.Excused, v.Unjudged)
		w("      deleted pods' keys seen after the return: %d, the last %s after it", v.Restored, v.Gone.Round(100*time.Millisecond))
		var noticed []string
		for slot := range p.Nodes {
			if d, ok := v.Noticed[slot]; ok {
				noticed = append(noticed, fmt.Sprintf("n%d %+.1fs", slot, d.Seconds()))
			} else {
				noticed = append(noticed, fmt.Sprintf("n%d never", slot))
			}
		}
		w("      agents that logged etcd going back (from the return): %s", strings.Join(noticed, ", "))
		for i, m := range v.NotBack {
			if i == maxListed {
				w("      ... %d more", len(v.NotBack)-i)
				break
			}
			w("      NOT BACK %s of %s (n%d): not its own in the last sample of its window (%s), held by %s; in %d samples from %s",
				m.IP, m.Pod, m.Slot, at(m.Last), orNone(m.HeldBy), m.Samples, at(m.First))
		}
	}
	w("(g) key edits (put back on a lease with the pod's value within %s): %d", keyGrace(p.TTL), len(r.KeyEdits))
	for _, v := range r.KeyEdits {
		tag := "ok"
		switch {
		case !v.Judged:
			tag = "unjudged"
		case !v.OK:
			tag = "NOT PUT BACK"
		}
		noticed := "the agent logged nothing"
		if !v.Noticed.IsZero() {
			noticed = fmt.Sprintf("the agent noticed %s after", v.Noticed.Sub(v.At).Round(100*time.Millisecond))
		}
		w("    %s #%d %s: etcdctl %s of %s's %s %s: %s; %s", tag, v.Fault, at(v.At), v.Op, v.Pod, v.Key, v.Path, v.Why, noticed)
	}
	if len(r.DelsUnanswered) > 0 {
		w("DELs never answered: %d %v", len(r.DelsUnanswered), firstN(r.DelsUnanswered, 10))
	}
	if len(r.LogStats) > 0 {
		w("agent log lines (WARN/ERROR, by message):")
		keys := sortedKeys(r.LogStats)
		slices.SortStableFunc(keys, func(a, b string) int { return r.LogStats[b] - r.LogStats[a] })
		for i, k := range keys {
			if i == 15 {
				w("    ... %d more messages", len(keys)-i)
				break
			}
			w("    %6d %s", r.LogStats[k], k)
		}
	}
	if f := r.Failures(); len(f) > 0 {
		w("RESULT: FAIL: %s", strings.Join(f, ", "))
	} else {
		w("RESULT: PASS")
	}
	return b.String()
}

func orNone(s string) string {
	if s == "" {
		return "nobody"
	}
	return s
}

func countsLine(m map[string]int) string {
	if len(m) == 0 {
		return ""
	}
	parts := make([]string, 0, len(m))
	for _, k := range sortedKeys(m) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return "(" + strings.Join(parts, ", ") + ")"
}

func firstLines(s string, n int) []string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = append(lines[:n], fmt.Sprintf("... %d more lines", len(lines)-n))
	}
	return lines
}

func firstN(s []string, n int) []string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// cmpBool orders false before true.
func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case !a:
		return -1
	}
	return 1
}
