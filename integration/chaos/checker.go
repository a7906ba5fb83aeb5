package chaos

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// The checker's allowances. Each is a bound the system must meet, not a guess at its timing.
const (
	// deadSlack is what etcd adds to a TTL before a lease's keys are gone: the leader checks
	// for expired leases every 500 ms and revokes them in rate-limited batches.
	deadSlack = 5 * time.Second
	// healGrace is added to the TTL after a node heals: its agent re-claims or resumes its
	// pods' keys within it.
	healGrace = 5 * time.Second
	// fullSlack is how many addresses short of the pool size still count as "no other room"
	// (the agent's view of the pool lags etcd's by a watch event or a read).
	fullSlack = 2
	// mergeGap joins two away stretches of one node separated by less than this.
	mergeGap = 500 * time.Millisecond
	// migrationBound bounds a live migration's two pods' overlap, from the target's ADD
	// answered to the first DEL sent or node death of the pair: the runtime ends each
	// migration within vmCopyMax (it stands for the agent's live migration bound, an hour by
	// default, which a run never reaches).
	migrationBound = vmCopyMax + 10*time.Second
)

// restoreGrace bounds the repair after etcd came back from a restore (or the node did, if it
// was away then): every running pod holds its own address again and every key of a deleted
// pod the backup brought back is gone. The agent notices at its first linearizable answer
// (a revision below one it saw, or another cluster ID), or, after a restore with its revision
// bumped, at its watches' compaction and the check of its keys that follows, which runs
// every half TTL anyway; it re-claims its pods at once. A restored key of a deleted pod
// sits on a lease etcd's new leader renews for one TTL; unless an agent renews it, it goes
// within the TTL and etcd's expiry check (deadSlack), and the agent revokes its spare leases
// when it notices. Twice the TTL plus healGrace covers both with room for a loaded machine.
func restoreGrace(ttl time.Duration) time.Duration { return 2*ttl + healGrace }

// keyGrace bounds the repair of a key an admin deleted or overwrote: the agent compares its
// keys every half TTL and re-claims the pod at once; twice the TTL plus healGrace, as above.
func keyGrace(ttl time.Duration) time.Duration { return 2*ttl + healGrace }

// Check judges a history: overlaps, conflicts and their justification, the final state,
// resurrections and keys missing. It does no I/O.
func Check(h *History) *Report {
	c := newChecker(h)
	r := &Report{Seed: h.Seed, Params: h.Params, Start: h.Start, FaultsEnd: h.FaultsEnd, End: h.End,
		FaultsByKind: map[string]int{}, LogStats: h.LogStats}
	c.counts(r)
	r.Overlaps, r.Migrations = c.overlaps()
	r.Conflicts = c.conflicts()
	r.Reuses = c.reuses()
	for _, l := range h.Logs {
		if l.Kind == "resolved" {
			r.Resolved++
		}
	}
	r.Resurrections = c.resurrections()
	r.Missing = c.missing()
	r.Restores = c.restoreVerdicts()
	r.KeyEdits = c.keyVerdicts()
	if h.Final != nil {
		fr := c.final(h.Final)
		r.Leaks, r.Pending, r.Lost, r.Standing = fr.Leaks, fr.Pending, fr.Lost, fr.Standing
		r.FinalAllocs, r.FinalHeld, r.FinalConflicts = len(h.Final.Allocs), len(h.Final.Held), len(h.Final.Conflicts)
		r.Doctor, r.DoctorOutput, r.HaveFinal = h.Final.DoctorExit, h.Final.DoctorOutput, true
		r.AllReady, r.Settled, r.SettleTook, r.SettleNote = h.Final.AllReady, h.Final.Settled, h.Final.SettleTook, h.Final.SettleNote
	}
	for _, e := range h.Events {
		r.Events = append(r.Events, e)
	}
	return r
}

// FinalState judges a snapshot against the runtime's view in h: settled when there is no
// leak, no lost key, and no dead node's key still waiting to expire. The run polls it to know
// when the state has settled.
func FinalState(h *History, f *Final) (settled bool, summary string) {
	fr := newChecker(h).final(f)
	n := len(fr.Leaks) + len(fr.Pending) + len(fr.Lost)
	return n == 0, fmt.Sprintf("%d leaks, %d dead pods' keys not yet expired, %d lost keys, %d lost to a standing conflict",
		len(fr.Leaks), len(fr.Pending), len(fr.Lost), len(fr.Standing))
}

type checker struct {
	h    *History
	pods map[string]*Pod
	// away holds each slot's merged away stretches, sorted.
	away map[int][]Away
	// conflictsOf indexes the conflicts by owner.
	conflictsOf map[string][]LogEvent
	// restores are the etcd-restore faults carried out, in time order.
	restores []restoreWindow
}

// restoreWindow is one restore: the backup holds etcd's state at some time between
// backupFrom and backupTo; etcd's data was lost at lost and served again at back.
type restoreWindow struct {
	f                    *Fault
	backupFrom, backupTo time.Time
	lost, back           time.Time
}

func newChecker(h *History) *checker {
	c := &checker{h: h, pods: map[string]*Pod{}, away: map[int][]Away{}, conflictsOf: map[string][]LogEvent{}}
	for _, p := range h.Pods {
		c.pods[p.UID] = p
	}
	bySlot := map[int][]Away{}
	for _, a := range h.Away {
		bySlot[a.Slot] = append(bySlot[a.Slot], a)
	}
	for slot, as := range bySlot {
		slices.SortFunc(as, func(a, b Away) int { return a.Start.Compare(b.Start) })
		var merged []Away
		for _, a := range as {
			if n := len(merged); n > 0 {
				last := &merged[n-1]
				if last.End.IsZero() || !a.Start.After(last.End.Add(mergeGap)) {
					if last.End.IsZero() || a.End.IsZero() {
						last.End = time.Time{}
					} else if a.End.After(last.End) {
						last.End = a.End
					}
					last.Cause += "+" + a.Cause
					continue
				}
			}
			merged = append(merged, a)
		}
		c.away[slot] = merged
	}
	for _, l := range h.Logs {
		if l.Kind == "conflict" {
			c.conflictsOf[l.Owner] = append(c.conflictsOf[l.Owner], l)
		}
	}
	for _, f := range h.Faults {
		if f.Kind != EtcdRestore || f.Skipped || f.Lost.IsZero() {
			continue
		}
		w := restoreWindow{f: f, backupFrom: f.Start, backupTo: f.BackupDone, lost: f.Lost, back: f.End}
		if w.back.IsZero() {
			w.back = maxTime(h.End, h.FaultsEnd, time.Now())
		}
		c.restores = append(c.restores, w)
	}
	slices.SortFunc(c.restores, func(a, b restoreWindow) int { return a.lost.Compare(b.lost) })
	return c
}

// awayEnd is the end of an away stretch, the end of the history when it lasts.
func (c *checker) awayEnd(a Away) time.Time {
	if a.End.IsZero() {
		return maxTime(c.h.End, c.h.FaultsEnd, time.Now())
	}
	return a.End
}

func maxTime(ts ...time.Time) time.Time {
	var m time.Time
	for _, t := range ts {
		if t.After(m) {
			m = t
		}
	}
	return m
}

func (c *checker) counts(r *Report) {
	for _, p := range c.h.Pods {
		r.PodsCreated++
		switch {
		case p.Live():
			r.PodsEverLive++
		default:
			r.PodsNeverLive++
		}
		if !p.DiedAt.IsZero() {
			r.PodsDied++
		}
		if p.LiveAtEnd() {
			r.LiveAtEnd++
		}
		if !p.DelSent.IsZero() && p.DelAnswered.IsZero() && p.DiedAt.IsZero() {
			r.DelsUnanswered = append(r.DelsUnanswered, p.UID)
		}
		for _, a := range p.Attempts {
			r.Attempts++
			if !a.OK {
				r.FailedAttempts++
				r.FailuresByCode = addCode(r.FailuresByCode, a.Op, a.Code)
			}
		}
	}
	// The peak of live pods, each holding one address of the pool.
	type edge struct {
		t time.Time
		d int
	}
	var edges []edge
	for _, p := range c.h.Pods {
		if p.Live() {
			edges = append(edges, edge{p.AddAnswered, 1})
			if e := p.LiveEnd(); !e.IsZero() {
				edges = append(edges, edge{e, -1})
			}
		}
	}
	slices.SortStableFunc(edges, func(a, b edge) int { return a.t.Compare(b.t) })
	n := 0
	for _, e := range edges {
		n += e.d
		if n > r.PeakLive {
			r.PeakLive, r.PeakAt = n, e.t
		}
	}
	for _, f := range c.h.Faults {
		r.Faults = append(r.Faults, f)
		if f.Skipped {
			r.FaultsSkipped++
			continue
		}
		r.FaultsByKind[f.Kind]++
	}
}

func addCode(m map[string]int, op string, code uint) map[string]int {
	if m == nil {
		m = map[string]int{}
	}
	m[fmt.Sprintf("%s code %d", op, code)]++
	return m
}

// Overlap is two pods holding one address with overlapping live intervals.
type Overlap struct {
	IP   netip.Addr `json:"ip"`
	A    string     `json:"a"`
	B    string     `json:"b"`
	From time.Time  `json:"from"`
	To   time.Time  `json:"to"`
	// Recorded says an agent logged the conflict between them; Unknown that it logged it
	// could not tell (unknownLogged).
	Recorded bool `json:"recorded"`
	Unknown  bool `json:"unknown,omitempty"`
	// Hint judges an unrecorded overlap's reuse as a conflict would be judged.
	Hint string `json:"hint,omitempty"`
}

// Migration is a live migration's two pods holding the claim's address at once: counted as
// one owner (migrationPair).
type Migration struct {
	Claim string     `json:"claim"`
	IP    netip.Addr `json:"ip"`
	// Source is the pod live first, Target the other.
	Source, Target string
	From, To       time.Time
}

// overlaps finds the pods whose live intervals overlap on an address, but for a live
// migration's pair (migrationPair), returned apart.
func (c *checker) overlaps() ([]Overlap, []Migration) {
	byAddr := map[netip.Addr][]*Pod{}
	for _, p := range c.h.Pods {
		if !p.Live() {
			continue
		}
		for _, a := range p.Addrs {
			byAddr[a] = append(byAddr[a], p)
		}
	}
	far := maxTime(c.h.End, c.h.FaultsEnd).Add(time.Hour)
	end := func(p *Pod) time.Time {
		if e := p.HoldEnd(); !e.IsZero() {
			return e
		}
		return far
	}
	var out []Overlap
	var migrations []Migration
	for ip, ps := range byAddr {
		for i := range ps {
			for j := i + 1; j < len(ps); j++ {
				a, b := ps[i], ps[j]
				if !a.AddAnswered.Before(end(b)) || !b.AddAnswered.Before(end(a)) {
					continue
				}
				from := maxTime(a.AddAnswered, b.AddAnswered)
				to := end(a)
				if end(b).Before(to) {
					to = end(b)
				}
				if to.Equal(far) {
					to = time.Time{}
				}
				first, second := a, b
				if b.AddAnswered.Before(a.AddAnswered) {
					first, second = b, a
				}
				pair, notPair := c.migrationPair(first, second, ip, from, to, ps, end)
				if pair {
					migrations = append(migrations, Migration{Claim: a.Claim, IP: ip, Source: first.UID, Target: second.UID, From: from, To: to})
					continue
				}
				o := Overlap{IP: ip, A: a.UID, B: b.UID, From: from, To: to,
					Recorded: c.recorded(a.UID, b.UID, ip) || c.recorded(b.UID, a.UID, ip)}
				if !o.Recorded {
					// The agent that handed the address out logged that its holder had
					// expired: the overlap is on record even if that holder came back
					// after the address was free again, and found nothing to report.
					if _, how := c.gotAddress(second, ip, from.Add(time.Second)); how == "reuse logged" {
						o.Recorded = true
						o.Hint = "recorded by the reuse of an expired holder's address"
					}
				}
				if !o.Recorded {
					// The agent of the pod that lost the address could not read who had it:
					// etcd's history was compacted, and that holder had let it go by then.
					if ok, why := c.reuseJustified(first, second.UID, ip, from.Add(time.Second)); ok {
						if l, found := c.unknownLogged(first.UID, ip, from, end(second)); found {
							o.Recorded, o.Unknown = true, true
							o.Hint = fmt.Sprintf("recorded as unknowable: %s's agent logged at %s that etcd's history no longer tells "+
								"who had %s meanwhile; %s let it go at %s; %s", first.UID, c.at(l.Time), ip, second.UID, c.at(end(second)), why)
						}
					}
				}
				if !o.Recorded {
					// The pod that lost the address was deleted before its node came back: its
					// agent never re-claims it, so there is nothing for it to record, and the
					// overlap ended with that DEL.
					if ok, why := c.reuseJustified(first, second.UID, ip, from.Add(time.Second)); ok &&
						!first.DelSent.IsZero() && c.awayThrough(first.Slot, from, first.DelSent) {
						o.Recorded = true
						o.Hint = fmt.Sprintf("nothing to record: %s's DEL was sent at %s, before node n%d came back; %s",
							first.UID, c.at(first.DelSent), first.Slot, why)
					}
				}
				if !o.Recorded {
					ok, why := c.reuseJustified(first, second.UID, ip, from.Add(time.Second))
					o.Hint = "reuse UNJUSTIFIED: " + why
					if ok {
						o.Hint = "reuse justified, but no conflict recorded: " + why
					}
					if l, found := c.earlierConflict(first.UID, ip, second.UID); found {
						o.Hint = fmt.Sprintf("%s had lost %s to %s (conflict recorded at %s) and still ran when %s got it: "+
							"the conflict was not resolved when that holder released it; %s", first.UID, ip, l.Taken[0].Holder, c.at(l.Time), second.UID, o.Hint)
					}
					if notPair != "" {
						o.Hint += "; no live migration: " + notPair
					}
				}
				out = append(out, o)
			}
		}
	}
	slices.SortFunc(out, func(x, y Overlap) int { return x.From.Compare(y.From) })
	slices.SortFunc(migrations, func(x, y Migration) int { return x.From.Compare(y.From) })
	return out, migrations
}

// migrationPair judges an overlap of first and second on ip, from from to to, as a live
// migration's (ARCHITECTURE.md, invariant 1: while its claim's migration key lives, one
// attachment on another node uses the holder's addresses too, no other): two pods of one
// migratable claim, on different node slots, no third pod of the claim holding ip meanwhile
// (ps are ip's pods, end their hold's end), and the pair ended (a DEL sent, a node death)
// within migrationBound (or, still on at the end of the history, had not run longer). Else
// why not, for a pod of a claim ("" for the others).
func (c *checker) migrationPair(first, second *Pod, ip netip.Addr, from, to time.Time, ps []*Pod, end func(*Pod) time.Time) (bool, string) {
	switch {
	case first.Claim == "" && second.Claim == "":
		return false, ""
	case first.Claim != second.Claim:
		return false, fmt.Sprintf("%s and %s name different claims (%q, %q)", first.UID, second.UID, first.Claim, second.Claim)
	case first.Slot == second.Slot:
		return false, fmt.Sprintf("both pods of claim %s on node n%d", first.Claim, first.Slot)
	case to.IsZero() && c.h.End.Sub(from) > migrationBound:
		return false, fmt.Sprintf("the pair of claim %s never ended, in %s to the end", first.Claim,
			c.h.End.Sub(from).Round(100*time.Millisecond))
	case !to.IsZero() && to.Sub(from) > migrationBound:
		return false, fmt.Sprintf("the pair of claim %s lasted %s, longer than the bound %s", first.Claim,
			to.Sub(from).Round(100*time.Millisecond), migrationBound)
	}
	until := to
	if until.IsZero() {
		until = end(first) // both hold on: as far as the end does
	}
	for _, p := range ps {
		if p != first && p != second && p.Claim == first.Claim && p.AddAnswered.Before(until) && from.Before(end(p)) {
			return false, fmt.Sprintf("a third pod of claim %s, %s (n%d), held %s meanwhile", first.Claim, p.UID, p.Slot, ip)
		}
	}
	return true, ""
}

// claimMate reports whether owner is p's partner in a live migration: another pod of p's
// claim on another node slot, whose key etcd holds for both while the migration lasts.
func (c *checker) claimMate(p *Pod, owner string) bool {
	o := c.pods[owner]
	return o != nil && p.Claim != "" && o.Claim == p.Claim && o.Slot != p.Slot
}

// unknownLogged finds the line in which owner's agent said that etcd's history (compacted)
// no longer tells whether another pod had ip meanwhile, logged after from and once the other
// holder had let it go (by gone): then neither the history nor the key itself could name it.
func (c *checker) unknownLogged(owner string, ip netip.Addr, from, gone time.Time) (LogEvent, bool) {
	for _, l := range c.h.Logs {
		if l.Kind == "unknown" && l.Owner == owner && l.IP == ip && l.Time.After(from) && !l.Time.Before(gone) {
			return l, true
		}
	}
	return LogEvent{}, false
}

// earlierConflict finds a conflict recorded for owner's address ip with a holder other than
// not.
func (c *checker) earlierConflict(owner string, ip netip.Addr, not string) (LogEvent, bool) {
	for _, l := range c.conflictsOf[owner] {
		for _, t := range l.Taken {
			if t.IP == ip && t.Holder != not {
				l.Taken = []Taken{t}
				return l, true
			}
		}
	}
	return LogEvent{}, false
}

// recorded reports whether an agent logged owner's address ip as taken by holder.
func (c *checker) recorded(owner, holder string, ip netip.Addr) bool {
	for _, l := range c.conflictsOf[owner] {
		for _, t := range l.Taken {
			if t.IP == ip && t.Holder == holder {
				return true
			}
		}
	}
	return false
}

// ConflictVerdict judges one address of one CONFLICT an agent logged.
type ConflictVerdict struct {
	Time      time.Time  `json:"time"`
	Owner     string     `json:"owner"`
	Slot      int        `json:"slot"`
	IP        netip.Addr `json:"ip"`
	Holder    string     `json:"holder"`
	Justified bool       `json:"justified"`
	Reason    string     `json:"reason"`
	// Logged is how many times an agent logged this conflict (each re-claim logs it again).
	Logged int `json:"logged"`
}

func (c *checker) conflicts() []ConflictVerdict {
	var out []ConflictVerdict
	seen := map[string]int{}
	for _, l := range c.h.Logs {
		if l.Kind != "conflict" {
			continue
		}
		p := c.pods[l.Owner]
		slot := -1
		if p != nil {
			slot = p.Slot
		}
		taken := l.Taken
		if len(taken) == 0 {
			taken = []Taken{{}}
		}
		for _, t := range taken {
			key := l.Owner + "/" + t.IP.String() + "/" + t.Holder
			if i, dup := seen[key]; dup {
				out[i].Logged++
				continue
			}
			seen[key] = len(out)
			v := ConflictVerdict{Time: l.Time, Owner: l.Owner, Slot: slot, IP: t.IP, Holder: t.Holder, Logged: 1}
			switch {
			case p == nil:
				v.Reason = "the conflicted owner is no pod of the runtime"
			default:
				if ok, justified, why := c.restoredHolder(p, t.Holder, t.IP, l.Time); ok {
					v.Justified, v.Reason = justified, why
				} else if ok, why := c.claimTakeover(p, t.Holder, t.IP, l.Time); ok {
					v.Justified, v.Reason = true, why
				} else {
					v.Justified, v.Reason = c.reuseJustified(p, t.Holder, t.IP, l.Time)
				}
			}
			out = append(out, v)
		}
	}
	return out
}

// claimTakeover judges a conflict of p, which lost its claim's address ip to holder, the
// claim's other pod on another node (claimMate), recorded at t: justified when p's pod lease
// could expire before holder got ip: p's node away without a break for longer than the TTL
// after holder's first ADD was sent and before t, or p's agent logging p's lease lost before
// holder got ip (or, holder p's migration target, before the conflict), without a re-claim of p
// between. The claim's addresses go to its other pod
// at that expiry, not after the reuse delay: the promotion of a live migration's target
// (T4), or a hand-over to an ADD naming the claim. p's re-claim then finds them taken, the
// window that remains (docs/proposals/live-migration.md, T4).
func (c *checker) claimTakeover(p *Pod, holder string, ip netip.Addr, t time.Time) (bool, string) {
	hp := c.pods[holder]
	if hp == nil || !c.claimMate(p, holder) || len(hp.Attempts) == 0 {
		return false, ""
	}
	sent := hp.Attempts[0].Sent
	mates := fmt.Sprintf("%s and %s are claim %s's pods on two nodes", p.UID, hp.UID, p.Claim)
	for _, a := range c.away[p.Slot] {
		end := c.awayEnd(a)
		if end.After(sent) && a.Start.Before(t) && end.Sub(a.Start) > c.h.Params.TTL {
			return true, fmt.Sprintf("%s: node n%d was away %s (%s, %s..%s), longer than the TTL %s, after %s's ADD was sent at %s: "+
				"%s's lease could expire and the claim's addresses go to %s", mates, p.Slot, end.Sub(a.Start).Round(100*time.Millisecond),
				a.Cause, c.at(a.Start), c.at(end), c.h.Params.TTL, hp.UID, c.at(sent), p.UID, hp.UID)
		}
	}
	got, how := c.gotAddress(hp, ip, t.Add(time.Second))
	// holder, p's live migration's target, got ip at its ADD beside p; it takes the keys
	// when it finds p's gone (T4), at any time until the conflict.
	by, took := got, "got"
	if hp.Target == p.UID {
		by, took = t, "took the keys of"
	}
	var lost time.Time
	for _, l := range c.h.Logs {
		switch {
		case l.Owner != p.UID:
		case l.Kind == "leaselost" && !l.Time.After(by.Add(time.Second)): // logged a little after the expiry
			lost = l.Time
		case l.Kind == "reclaimed" && l.Time.Before(by):
			lost = time.Time{}
		}
	}
	if !lost.IsZero() {
		return true, fmt.Sprintf("%s: %s's agent logged its lease lost at %s, not re-claimed before %s %s %s by %s (got it at %s, %s): "+
			"the claim's addresses go to its other pod at the holder's expiry", mates, p.UID, c.at(lost), hp.UID, took, ip, c.at(by),
			c.at(got), how)
	}
	return false, ""
}

// reuseJustified judges the taking of prev's address ip by holder, at the time holder got
// it (gotAddress): justified when prev's node had by then been away without a break for
// longer than TTL + reuse delay (its addresses are free to take), or when the pool had no
// other room by the history's account (fullAt). The first is stricter than "a stretch
// longer than TTL + reuse delay before the conflict": an address taken 10 s into a 20 s
// cut-off is not justified by the 10 s that followed.
func (c *checker) reuseJustified(prev *Pod, holder string, ip netip.Addr, before time.Time) (bool, string) {
	need := c.h.Params.TTL + c.h.Params.ReuseDelay
	hp := c.pods[holder]
	if hp == nil {
		return false, fmt.Sprintf("holder %q is no pod of the runtime", holder)
	}
	at, how := c.gotAddress(hp, ip, before)
	if at.IsZero() {
		return false, fmt.Sprintf("holder %s never sent an ADD", hp.UID)
	}
	awayFor, cause := c.awayFor(prev.Slot, at)
	when := fmt.Sprintf("%s got %s at %s (%s)", hp.UID, ip, c.at(at), how)
	if !prev.DelSent.IsZero() && prev.DelSent.Before(at) {
		// Its release may have applied before the agent, killed, could journal it: the
		// restarted agent re-claims a pod being deleted, and finds the address taken.
		return true, fmt.Sprintf("%s, after %s's DEL was sent at %s (its release may have applied)", when, prev.UID, c.at(prev.DelSent))
	}
	if awayFor > need {
		return true, fmt.Sprintf("%s, when node n%d had been away %s (%s), longer than TTL+reuse delay %s",
			when, prev.Slot, awayFor.Round(100*time.Millisecond), cause, need)
	}
	if w, a, ok := c.acrossRestore(prev, hp, ip, at); ok {
		// ARCHITECTURE.md, invariant 15: a pod that claimed its address after the backup has
		// no key and no held key in the restored etcd until its agent re-claims it; its node
		// away before that, past the settle time (two TTLs) its address may go to another
		// pod, a conflict when its node is back.
		return true, fmt.Sprintf("%s, after the settle time of restore #%d: %s claimed %s after its backup, and node n%d "+
			"was away (%s, %s..%s) after etcd's return before its agent re-claimed it (the window that remains)",
			when, w.f.ID, prev.UID, ip, prev.Slot, a.Cause, c.at(a.Start), c.at(c.awayEnd(a)))
	}
	away := fmt.Sprintf("node n%d not away then", prev.Slot)
	if awayFor > 0 {
		away = fmt.Sprintf("node n%d away only %s then (%s)", prev.Slot, awayFor.Round(100*time.Millisecond), cause)
	}
	full, occ := c.fullAt(at, hp.Slot)
	if s, ok := c.sampleNear(at); ok && !full {
		occ += fmt.Sprintf(" (etcd at %s: %d allocations, %d held keys without one, %d quarantined)",
			c.at(s.T0), len(s.Allocs), s.HeldOnly, s.Quarantined)
	}
	if full {
		return true, fmt.Sprintf("%s, when the pool was full: %s; %s", when, occ, away)
	}
	return false, fmt.Sprintf("%s, when the pool had room: %s; %s, not longer than TTL+reuse delay %s", when, occ, away, need)
}

// acrossRestore finds the restore that left p without a key in a stretch its node was away,
// as of at, when another pod got p's address ip (the window that remains):
//   - p claimed ip after the backup (claimedAfterBackup): the restored etcd has neither p's
//     keys nor its held key;
//   - at is after the settle time of holder's agent (two TTLs after it noticed etcd going
//     back, its "etcd went back" line, or after etcd's return if earlier), when it claims and
//     borrows again;
//   - p's node was away in a stretch that began before the settle time ended and before at,
//     ended after etcd's return, and began before its agent re-claimed p in the restored etcd:
//     neither a "pod re-claimed" line of p nor a sample holding ip for p between etcd's loss
//     of its data and the stretch's start (a re-claim writes the held key, which keeps ip
//     from other pods for the reuse delay after p's lease ends: then the usual rules judge).
//     A node away across the return, or stopped between the return and its re-claim of p.
//
// The away stretch found is returned with the restore.
func (c *checker) acrossRestore(p, holder *Pod, ip netip.Addr, at time.Time) (restoreWindow, Away, bool) {
	for _, w := range c.restores {
		noticed := w.back
		for _, l := range c.h.Logs {
			if l.Kind == "wentback" && l.Slot == holder.Slot && l.Time.After(w.lost) && l.Time.Before(noticed) {
				noticed = l.Time // the run saw etcd serve a little after the agents
				break
			}
		}
		settled := noticed.Add(2 * c.h.Params.TTL)
		if !at.After(settled) || !c.claimedAfterBackup(p, ip, w) {
			continue
		}
		reclaimed := c.reclaimedAfter(p, ip, w.lost)
		for _, a := range c.away[p.Slot] {
			if !a.Start.Before(settled) || !a.Start.Before(at) || !c.awayEnd(a).After(w.back) {
				continue
			}
			if !reclaimed.IsZero() && !reclaimed.After(a.Start) {
				continue // re-claimed before the stretch: its held key keeps ip
			}
			if !reclaimed.IsZero() && reclaimed.Before(at) {
				continue // its key was back before the other pod got ip
			}
			return w, a, true
		}
	}
	return restoreWindow{}, Away{}, false
}

// claimedAfterBackup reports whether p's claim of ip cannot be in w's backup: p's first ADD
// that may have claimed was sent after the backup began (firstClaim), or one sent before it
// applied after it: a sample read at the backup's revision or later, before etcd lost its
// data and before p was answered, lacks ip for p.
func (c *checker) claimedAfterBackup(p *Pod, ip netip.Addr, w restoreWindow) bool {
	if firstClaim(p).After(w.backupFrom) {
		return true
	}
	if p.AddAnswered.IsZero() || !p.AddAnswered.After(w.backupFrom) || w.f.BackupRev == 0 {
		return false
	}
	for _, s := range c.h.Samples {
		if s.Rev < w.f.BackupRev || !s.T0.After(w.backupFrom) || !s.T1.Before(p.AddAnswered) || !s.T1.Before(w.lost) {
			continue
		}
		if !slices.ContainsFunc(s.Allocs, func(a Alloc) bool { return a.IP == ip && a.Owner == p.UID }) {
			return true
		}
	}
	return false
}

// reclaimedAfter is when p's agent first put p's keys back after from: its "pod re-claimed"
// line, or a sample that read ip held for p, whichever is first (zero when neither).
func (c *checker) reclaimedAfter(p *Pod, ip netip.Addr, from time.Time) time.Time {
	var t time.Time
	for _, l := range c.h.Logs {
		if l.Kind == "reclaimed" && l.Owner == p.UID && l.Time.After(from) && (t.IsZero() || l.Time.Before(t)) {
			t = l.Time
		}
	}
	for _, s := range c.h.Samples {
		if !s.T0.After(from) || (!t.IsZero() && !s.T1.Before(t)) {
			continue
		}
		if slices.ContainsFunc(s.Allocs, func(a Alloc) bool { return a.IP == ip && a.Owner == p.UID }) {
			return s.T1 // read by then
		}
	}
	return t
}

// awayThrough reports whether slot was away without a break from from to to.
func (c *checker) awayThrough(slot int, from, to time.Time) bool {
	for _, a := range c.away[slot] {
		if !a.Start.After(from) && !c.awayEnd(a).Before(to) {
			return true
		}
	}
	return false
}

// awayFor is how long slot had been away without a break at t (0 when it was not away), or,
// when it came back less than TTL + 5 s before t (its re-claim may not have run yet: the
// addresses whose hold ran out during the stretch are free in etcd until then), how long
// that stretch lasted.
func (c *checker) awayFor(slot int, t time.Time) (time.Duration, string) {
	for _, a := range c.away[slot] {
		end := c.awayEnd(a)
		switch {
		case !a.Start.After(t) && !end.Before(t):
			return t.Sub(a.Start), a.Cause
		case end.Before(t) && t.Sub(end) < c.h.Params.TTL+5*time.Second:
			return end.Sub(a.Start), fmt.Sprintf("%s, back %s before, not yet re-claimed", a.Cause, t.Sub(end).Round(100*time.Millisecond))
		}
	}
	return 0, ""
}

// gotAddress is when pod p was given ip, as known before the time before: the latest "conflict
// resolved" line giving ip back to p before it if any (the address came back to p then);
// else the agent's "reusing an address" line for ip during p's successful ADD; else when that
// ADD answered (the last ADD, for a pod never live; its sending plus the call's bound when it
// never answered).
func (c *checker) gotAddress(p *Pod, ip netip.Addr, before time.Time) (time.Time, string) {
	var back time.Time
	for _, l := range c.h.Logs {
		if l.Kind == "resolved" && l.Owner == p.UID && l.IP == ip && l.Time.Before(before) && l.Time.After(back) {
			back = l.Time
		}
	}
	if !back.IsZero() {
		return back, "given back to it by a conflict resolution"
	}
	// The claim may be an earlier attempt's: one whose answer the runtime did not get (a
	// timeout, code 11 while the claim applied) is repeated, and the repeat answers the
	// addresses it claimed. So the reuse is looked for on the pod's node from its first ADD.
	var first, sent, answered time.Time
	for _, a := range p.Attempts {
		if a.Op != "ADD" {
			continue
		}
		if first.IsZero() {
			first = a.Sent
		}
		sent, answered = a.Sent, a.Answered
		if a.OK {
			break
		}
	}
	if sent.IsZero() {
		return time.Time{}, ""
	}
	if answered.IsZero() {
		answered = sent.Add(30 * time.Second)
	}
	for _, l := range c.h.Logs {
		if l.Kind == "reuse" && l.IP == ip && l.Slot == p.Slot && !l.Time.Before(first.Add(-time.Second)) && !l.Time.After(answered.Add(time.Second)) {
			return l.Time, "reuse logged"
		}
	}
	return answered, "its ADD's answer; no reuse logged"
}

// fullAt judges by the history alone whether the pool had no other room at t: the addresses
// occupancy counts within fullSlack of its size.
//
// Or by etcd's account: the sample read last before t had no more free addresses (neither
// allocated, held back nor quarantined) than the ADDs sent since could have taken. The
// history cannot know when a quarantine key expires (its lease serves every release of a
// window) or which in-flight ADD already committed; etcd's sample can.
func (c *checker) fullAt(t time.Time, slot int) (bool, string) {
	n, inflight := c.occupancy(t, slot)
	size := c.h.Params.PoolSize
	why := fmt.Sprintf("%d of %d addresses held (%d of them by ADDs in flight or unanswered), %d free", n, size, inflight, size-n)
	if n+fullSlack >= size {
		return true, why
	}
	if s, ok := c.sampleNear(t); ok {
		free := size - len(s.Allocs) - s.HeldOnly - s.Quarantined
		adds := 0
		for _, p := range c.h.Pods {
			for _, a := range p.Attempts {
				if a.Op == "ADD" && !a.Sent.After(t) && (a.Answered.IsZero() || !a.Answered.Before(s.T0)) {
					adds++
				}
			}
		}
		if free <= adds+fullSlack {
			return true, fmt.Sprintf("%s by the history; by etcd at %s, %d free (%d allocations, %d held back, %d quarantined) "+
				"for %d ADDs in flight since", why, c.at(s.T0), free, len(s.Allocs), s.HeldOnly, s.Quarantined, adds)
		}
	}
	return false, why
}

// occupancy counts the addresses taken at t by the history's account: those of live pods
// (their node away or not), of pods released less than the quarantine before (releasedBy),
// of pods on a node dead for less than TTL + reuse delay, and of pods with an ADD in flight
// that may have committed: a successful ADD not answered yet, or an earlier attempt that
// failed without saying nothing was applied (code 11, try again, or no CNI error at all: the
// claim may have applied and its answer been lost). A pod that never got an address this way
// counts as one address it may hold until its DEL. inflight is how many of the addresses
// counted are such ADDs'.
func (c *checker) occupancy(t time.Time, slot int) (held, inflight int) {
	// A release's quarantine key lives on a lease shared by the releases of a window of
	// max(q/10, 1 s), and etcd expires it within about a second more.
	// A dead node's held keys live on its block lease, 1.5 x (TTL + reuse delay) from its last
	// renewal (leases.blockLeaseTTL), and etcd expires it within about a second more.
	q, hold := c.h.Params.Quarantine+max(c.h.Params.Quarantine/10, time.Second)+time.Second, (c.h.Params.TTL+c.h.Params.ReuseDelay)*3/2+time.Second
	addrs := map[netip.Addr]bool{}
	unknown := 0
	for _, p := range c.h.Pods {
		taken := p.liveAt(t) ||
			!p.DelAnswered.IsZero() && !t.Before(p.DelAnswered) && t.Before(c.releasedBy(p).Add(q)) ||
			// A DEL its node answered while away is released by that node's re-claim after
			// its return: till then the address is still its own pod's to it (invariant 14).
			p.Slot == slot && !p.DelAnswered.IsZero() && !t.Before(p.DelAnswered) && t.Before(c.releasedByOwnNode(p)) ||
			!p.DiedAt.IsZero() && p.Live() && !t.Before(p.DiedAt) && t.Before(p.DiedAt.Add(hold))
		if !taken {
			// An ADD in flight, or one that may have committed without an answer.
			var since time.Time
			for _, a := range p.Attempts {
				if a.Op == "ADD" && (a.OK || a.Code == 0 || a.Code == 11) {
					since = a.Sent
					break
				}
			}
			end := p.AddAnswered
			if !p.Live() {
				end = maxTime(c.releasedBy(p), p.DiedAt)
				if !end.IsZero() {
					end = end.Add(q)
				}
			}
			if !since.IsZero() && !t.Before(since) && (end.IsZero() || t.Before(end)) {
				inflight++
				if !p.Live() {
					unknown++
					continue
				}
				taken = true
			}
		}
		if taken {
			for _, a := range p.Addrs {
				addrs[a] = true
			}
		}
	}
	return len(addrs) + unknown, inflight
}

// releasedBy is when a deleted pod's address was released at the latest: its DEL's answer,
// unless its node was away then (an agent may answer a DEL it cannot reach etcd for and
// release once it can): then the end of that stretch, or the expiry of the pod's lease plus
// the reuse delay its held key stands for, whichever comes first.
func (c *checker) releasedBy(p *Pod) time.Time {
	for _, a := range c.away[p.Slot] {
		if !a.Start.After(p.DelAnswered) && !c.awayEnd(a).Before(p.DelAnswered) {
			end := c.awayEnd(a)
			if limit := a.Start.Add(c.h.Params.TTL + c.h.Params.ReuseDelay); limit.Before(end) {
				end = limit
			}
			if end.After(p.DelAnswered) {
				return end
			}
		}
	}
	return p.DelAnswered
}

// releasedByOwnNode is when p's node, which answered p's DEL while away, has run its re-claim
// after its return (as awayFor allows it: TTL + 5 s); p.DelAnswered when it was not away.
func (c *checker) releasedByOwnNode(p *Pod) time.Time {
	for _, a := range c.away[p.Slot] {
		if !a.Start.After(p.DelAnswered) && !c.awayEnd(a).Before(p.DelAnswered) {
			return c.awayEnd(a).Add(c.h.Params.TTL + 5*time.Second)
		}
	}
	return p.DelAnswered
}

// ReuseVerdict judges one "reusing an address whose holder expired" line: was the pool
// full by the history's account? Keeping: the reusing agent was in its keep time after it
// logged that etcd went back in time (TTL + reuse delay from then), when it leaves free the
// addresses it knew taken and the blocks the backup gave back to its node, as a cut-off
// node's pod may run on any of them: room the history counts and the agent does not.
type ReuseVerdict struct {
	Time    time.Time  `json:"time"`
	Slot    int        `json:"slot"`
	IP      netip.Addr `json:"ip"`
	Full    bool       `json:"full"`
	Keeping bool       `json:"keeping,omitempty"`
	Why     string     `json:"why"`
}

// WithRoom tells whether v is a reuse the pool's room did not justify.
func (v ReuseVerdict) WithRoom() bool { return !v.Full && !v.Keeping }

func (c *checker) reuses() []ReuseVerdict {
	var out []ReuseVerdict
	keep := c.h.Params.TTL + c.h.Params.ReuseDelay
	for _, l := range c.h.Logs {
		if l.Kind != "reuse" {
			continue
		}
		full, why := c.fullAt(l.Time, l.Slot)
		if s, ok := c.sampleNear(l.Time); ok {
			why += fmt.Sprintf("; etcd at %s: %d allocations, %d held keys without one, %d quarantined",
				c.at(s.T0), len(s.Allocs), s.HeldOnly, s.Quarantined)
		}
		v := ReuseVerdict{Time: l.Time, Slot: l.Slot, IP: l.IP, Full: full, Why: why}
		for _, w := range c.h.Logs {
			if w.Kind == "wentback" && w.Slot == l.Slot && !w.Time.After(l.Time) && l.Time.Sub(w.Time) < keep {
				v.Keeping = true
				v.Why += fmt.Sprintf("; in the keep time of n%d, which logged etcd going back at %s", l.Slot, c.at(w.Time))
			}
		}
		out = append(out, v)
	}
	return out
}

// sampleNear is the sample read last before t.
func (c *checker) sampleNear(t time.Time) (Sample, bool) {
	i, _ := slices.BinarySearchFunc(c.h.Samples, t, func(s Sample, t time.Time) int { return s.T0.Compare(t) })
	if i == 0 {
		return Sample{}, false
	}
	return c.h.Samples[i-1], true
}

// Resurrection is an allocation of a pod seen in etcd later than TTL after its DEL answered.
type Resurrection struct {
	Pod         string     `json:"pod"`
	Slot        int        `json:"slot"`
	IP          netip.Addr `json:"ip"`
	DelAnswered time.Time  `json:"delAnswered"`
	First, Last time.Time
	Samples     int `json:"samples"`
}

func (c *checker) resurrections() []Resurrection {
	// A key is due to be gone TTL after the pod's release (deletedBy). A restore brings back
	// the keys its backup may hold: those go by the end of its window (restoreUntil).
	gone := func(p *Pod) time.Time {
		t := c.deletedBy(p)
		for _, w := range c.restores {
			if c.mayBeInBackup(p, w) {
				t = maxTime(t, c.restoreUntil(w, p.Slot))
			}
		}
		return t
	}
	found := map[string]*Resurrection{}
	var order []string
	for _, s := range c.h.Samples {
		for _, a := range s.Allocs {
			p := c.pods[a.Owner]
			if p == nil || p.DelAnswered.IsZero() || !s.T0.After(gone(p)) {
				continue
			}
			key := p.UID + "/" + a.IP.String()
			r := found[key]
			if r == nil {
				r = &Resurrection{Pod: p.UID, Slot: p.Slot, IP: a.IP, DelAnswered: p.DelAnswered, First: s.T0}
				found[key] = r
				order = append(order, key)
			}
			r.Last = s.T0
			r.Samples++
		}
	}
	if f := c.h.Final; f != nil {
		for _, a := range f.Allocs {
			p := c.pods[a.Owner]
			if p == nil || p.DelAnswered.IsZero() || !f.Time.After(gone(p)) {
				continue
			}
			key := p.UID + "/" + a.IP.String()
			if r := found[key]; r != nil {
				r.Last = f.Time
				r.Samples++
			} else {
				found[key] = &Resurrection{Pod: p.UID, Slot: p.Slot, IP: a.IP, DelAnswered: p.DelAnswered, First: f.Time, Last: f.Time, Samples: 1}
				order = append(order, key)
			}
		}
	}
	out := make([]Resurrection, 0, len(order))
	for _, k := range order {
		out = append(out, *found[k])
	}
	return out
}

// deletedBy is when a pod's keys must be gone after its DEL answered: TTL after its release.
// A DEL answered while its node was away, or while etcd could not be reached from it (a
// leader cut off or killed: the DEL is recorded and answered), is released when etcd answers
// again, or the key expires with its lease (releasedBy), and etcd extends every lease when
// its leader changes: a key seen until then was never deleted, not brought back.
func (c *checker) deletedBy(p *Pod) time.Time {
	slack := c.h.Params.TTL
	t := c.releasedBy(p).Add(slack)
	if c.etcdFaultNear(p.DelAnswered.Add(-slack), t) {
		t = t.Add(c.h.Params.TTL + 2*time.Second)
	}
	return t
}

// Missing is a live pod on a node not away (nor healed within TTL + healGrace) whose
// address etcd did not hold for it in some samples.
type Missing struct {
	Pod         string     `json:"pod"`
	Slot        int        `json:"slot"`
	IP          netip.Addr `json:"ip"`
	First, Last time.Time
	Samples     int `json:"samples"`
	// HeldBy is who held the address in the first such sample ("" for nobody).
	HeldBy string `json:"heldBy"`
	// Near names the faults active shortly before First.
	Near string `json:"near"`
}

func (c *checker) missing() []Missing {
	grace := c.h.Params.TTL + healGrace
	found := map[string]*Missing{}
	var order []string
	for _, s := range c.h.Samples {
		holder := make(map[netip.Addr]string, len(s.Allocs))
		for _, a := range s.Allocs {
			holder[a.IP] = a.Owner
		}
		for _, p := range c.h.Pods {
			if !p.Live() || !p.AddAnswered.Before(s.T0) ||
				!p.DelSent.IsZero() && !p.DelSent.After(s.T1) ||
				!p.DiedAt.IsZero() && !p.DiedAt.After(s.T1) {
				continue
			}
			if c.awayNear(p.Slot, s.T0.Add(-grace), s.T1) || c.etcdFaultNear(s.T0.Add(-grace), s.T1) ||
				c.inRestore(p.Slot, s.T0, s.T1) || c.keyEdited(p.UID, s.T0, s.T1) || c.mateAwayNear(p, s.T0.Add(-grace), s.T1) {
				continue
			}
			for _, ip := range p.Addrs {
				if holder[ip] == p.UID || c.claimMate(p, holder[ip]) || c.conflictOn(p.UID, ip, s.T1.Add(grace)) {
					continue
				}
				key := p.UID + "/" + ip.String()
				m := found[key]
				if m == nil {
					m = &Missing{Pod: p.UID, Slot: p.Slot, IP: ip, First: s.T0, HeldBy: holder[ip], Near: c.faultsNear(s.T0)}
					found[key] = m
					order = append(order, key)
				}
				m.Last = s.T0
				m.Samples++
			}
		}
	}
	out := make([]Missing, 0, len(order))
	for _, k := range order {
		out = append(out, *found[k])
	}
	return out
}

// mateAwayNear reports whether a pod of p's claim on another node (claimMate), holding
// then, had its node away or dead at some time in [from, to]: a live migration's source
// whose lease expires takes the claim's allocation keys with it, and its target's agent
// promotes it (T4) at its next audit; till then the key is nobody's.
func (c *checker) mateAwayNear(p *Pod, from, to time.Time) bool {
	if p.Claim == "" {
		return false
	}
	for _, o := range c.h.Pods {
		if o == p || !o.Live() || !c.claimMate(p, o.UID) || !o.AddAnswered.Before(to) {
			continue
		}
		if end := o.HoldEnd(); !end.IsZero() && end.Before(from) {
			continue
		}
		if c.awayNear(o.Slot, from, to) || !o.DiedAt.IsZero() && o.DiedAt.Before(to) && o.DiedAt.After(from) {
			return true
		}
	}
	return false
}

// awayNear reports whether slot was away at some time in [from, to].
func (c *checker) awayNear(slot int, from, to time.Time) bool {
	for _, a := range c.away[slot] {
		if a.Start.Before(to) && c.awayEnd(a).After(from) {
			return true
		}
	}
	return false
}

// etcdFaultNear reports whether an etcd member was killed or the leader cut off at some time
// in [from, to]. An agent whose connection went to that member is cut off as surely as if
// its own link were down, for as long (longer than a 4 s TTL, for a 5 s cut); which agents
// were is not known, so for the keys missing every node counts as away.
func (c *checker) etcdFaultNear(from, to time.Time) bool {
	for _, f := range c.h.Faults {
		if f.Skipped || f.Start.IsZero() || f.Kind != EtcdKill && f.Kind != EtcdLeaderCut {
			continue
		}
		end := f.End
		if end.IsZero() {
			end = maxTime(c.h.End, c.h.FaultsEnd, time.Now())
		}
		if f.Start.Before(to) && end.After(from) {
			return true
		}
	}
	return false
}

// conflictOn reports whether an agent logged owner's address ip as taken before t.
func (c *checker) conflictOn(owner string, ip netip.Addr, before time.Time) bool {
	for _, l := range c.conflictsOf[owner] {
		if l.Time.After(before) {
			continue
		}
		for _, t := range l.Taken {
			if t.IP == ip {
				return true
			}
		}
	}
	return false
}

// faultsNear names the faults active within TTL + healGrace before t.
func (c *checker) faultsNear(t time.Time) string {
	from := t.Add(-c.h.Params.TTL - healGrace)
	s := ""
	for _, f := range c.h.Faults {
		if f.Skipped || f.Start.IsZero() || f.Start.After(t) {
			continue
		}
		if end := f.End; !end.IsZero() && end.Before(from) {
			continue
		}
		if s != "" {
			s += ", "
		}
		s += fmt.Sprintf("#%d %s %s", f.ID, f.Kind, f.Target)
	}
	return s
}

// Leak is an allocation in the final state that no live pod should hold.
type Leak struct {
	IP     netip.Addr `json:"ip"`
	Owner  string     `json:"owner"`
	Reason string     `json:"reason"`
}

// Lost is a live pod whose address the final state does not hold for it.
type Lost struct {
	Pod    string     `json:"pod"`
	Slot   int        `json:"slot"`
	IP     netip.Addr `json:"ip"`
	HeldBy string     `json:"heldBy"`
	// Why is said of a live migration's target: its migration completed, the key is not its.
	Why string `json:"why,omitempty"`
}

type finalResult struct {
	Leaks, Pending []Leak
	Lost, Standing []Lost
}

// final compares the allocations of f with the pods live at the end. Pending are the keys of
// a dead node's pods still within TTL + reuse delay + deadSlack of its death (not leaks, but
// not settled either); Standing the lost addresses a recorded conflict gave to a holder still
// live.
func (c *checker) final(f *Final) finalResult {
	var fr finalResult
	allow := c.h.Params.TTL + c.h.Params.ReuseDelay + deadSlack
	byIP := map[netip.Addr]Alloc{}
	for _, a := range f.Allocs {
		byIP[a.IP] = a
		p := c.pods[a.Owner]
		reason := ""
		switch {
		case p == nil:
			reason = "owner is no pod of the runtime"
		case p.LiveAtEnd() && p.hasAddr(a.IP):
			continue
		case p.LiveAtEnd():
			reason = fmt.Sprintf("a live pod's key for %s, not an address its ADD returned (%v)", a.IP, p.Addrs)
		case !p.DiedAt.IsZero():
			if f.Time.Sub(p.DiedAt) <= allow {
				fr.Pending = append(fr.Pending, Leak{IP: a.IP, Owner: a.Owner,
					Reason: fmt.Sprintf("node n%d died %s before the snapshot", p.Slot, f.Time.Sub(p.DiedAt).Round(100*time.Millisecond))})
				continue
			}
			reason = fmt.Sprintf("its node n%d died %s before the snapshot (allowed %s)", p.Slot,
				f.Time.Sub(p.DiedAt).Round(100*time.Millisecond), allow)
		case !p.DelAnswered.IsZero() && !p.Live():
			reason = "never live; its DEL answered at " + c.at(p.DelAnswered)
		case !p.DelAnswered.IsZero():
			reason = "its DEL answered at " + c.at(p.DelAnswered)
		case !p.Live():
			reason = "never live; its DEL never answered"
		default:
			reason = "its DEL never answered"
		}
		fr.Leaks = append(fr.Leaks, Leak{IP: a.IP, Owner: a.Owner, Reason: reason})
	}
	for _, p := range c.h.Pods {
		if !p.LiveAtEnd() {
			continue
		}
		for _, ip := range p.Addrs {
			a, ok := byIP[ip]
			if ok && a.Owner == p.UID {
				continue
			}
			src := c.pods[p.Target]
			if ok && src != nil && a.Owner == src.UID && src.LiveAtEnd() && c.claimMate(p, src.UID) {
				continue // a live migration's target: the key is its live source's until the migration ends
			}
			l := Lost{Pod: p.UID, Slot: p.Slot, IP: ip, HeldBy: a.Owner}
			if src != nil && !src.LiveAtEnd() {
				l.Why = fmt.Sprintf("the live migration from %s ended (%s's DEL answered %s, its node died %s) with the target live: "+
					"the target must hold the claim's keys", src.UID, src.UID, c.at(src.DelAnswered), c.at(src.DiedAt))
			}
			if ok && c.recorded(p.UID, a.Owner, ip) {
				if hp := c.pods[a.Owner]; hp != nil && hp.LiveAtEnd() {
					fr.Standing = append(fr.Standing, l)
					continue
				}
			}
			fr.Lost = append(fr.Lost, l)
		}
	}
	return fr
}

// at formats t as an offset from the start of the run.
func (c *checker) at(t time.Time) string { return offset(c.h.Start, t) }

func offset(start, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return fmt.Sprintf("+%.1fs", t.Sub(start).Seconds())
}

// sortedKeys returns m's keys in order.
func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, cmp.Compare[string])
	return ks
}
