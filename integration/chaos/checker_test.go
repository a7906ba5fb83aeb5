package chaos

import (
	"encoding/json"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// The histories below are written by hand: a pool of 5 addresses (10.0.0.2-6), TTL 4 s,
// reuse delay 12 s, quarantine 2 s; times are seconds from the start.

var epoch = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)

func sec(s float64) time.Time { return epoch.Add(time.Duration(s * float64(time.Second))) }

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

func history() *History {
	return &History{Seed: 7, Start: sec(0), FaultsEnd: sec(100), End: sec(130),
		Params: Params{Nodes: 2, TTL: 4 * time.Second, ReuseDelay: 12 * time.Second, Quarantine: 2 * time.Second,
			Pool: "p", Subnet: "10.0.0.0/29", PoolSize: 5, Tight: true, Duration: 100 * time.Second}}
}

// pod adds a pod on slot holding ip, its ADD answered at add, its DEL answered at del (0:
// live at the end).
func (h *History) pod(uid string, slot int, ip string, add, del float64) *Pod {
	p := &Pod{UID: uid, Container: "c-" + uid, Slot: slot, Node: "n", NodeUID: "u", Created: sec(add - 0.1)}
	p.Addrs = []netip.Addr{addr(ip)}
	p.AddAnswered = sec(add)
	p.Attempts = []Attempt{{Op: "ADD", Sent: sec(add - 0.1), Answered: sec(add), OK: true}}
	if del > 0 {
		p.DelSent, p.DelAnswered = sec(del-0.1), sec(del)
		p.Attempts = append(p.Attempts, Attempt{Op: "DEL", Sent: sec(del - 0.1), Answered: sec(del), OK: true})
	}
	h.Pods = append(h.Pods, p)
	return p
}

// final sets the final snapshot to the allocations given as ip=owner.
func (h *History) final(allocs ...string) {
	h.Final = &Final{Time: sec(130), AllReady: true, Settled: true}
	for _, a := range allocs {
		ip, owner, _ := strings.Cut(a, "=")
		h.Final.Allocs = append(h.Final.Allocs, Alloc{IP: addr(ip), Owner: owner})
	}
}

// sample adds a sample at t holding the allocations given as ip=owner.
func (h *History) sample(t float64, allocs ...string) {
	s := Sample{T0: sec(t), T1: sec(t + 0.01)}
	for _, a := range allocs {
		ip, owner, _ := strings.Cut(a, "=")
		s.Allocs = append(s.Allocs, Alloc{IP: addr(ip), Owner: owner})
	}
	h.Samples = append(h.Samples, s)
}

func (h *History) conflict(t float64, owner, ip, holder string) {
	h.Logs = append(h.Logs, LogEvent{Time: sec(t), Kind: "conflict", Owner: owner, IfName: "eth0", Pool: "p",
		Taken: []Taken{{IP: addr(ip), Holder: holder}}, Msg: "CONFLICT: addresses of a running pod were taken"})
}

func (h *History) away(slot int, from, to float64, cause string) {
	h.Away = append(h.Away, Away{Slot: slot, Start: sec(from), End: sec(to), Cause: cause})
}

func failures(t *testing.T, h *History) []string {
	t.Helper()
	r := Check(h)
	t.Logf("\n%s", r)
	return r.Failures()
}

func wantPass(t *testing.T, h *History) *Report {
	t.Helper()
	if f := failures(t, h); len(f) > 0 {
		t.Fatalf("want a pass, got failures %v", f)
	}
	return Check(h)
}

func wantFailure(t *testing.T, h *History, what string) {
	t.Helper()
	f := failures(t, h)
	if !slices.ContainsFunc(f, func(s string) bool { return strings.HasSuffix(s, " "+what) }) {
		t.Fatalf("want the failure %q, got %v", what, f)
	}
}

// clean is a history without a problem: a is deleted and its address goes to b after the
// quarantine; c lives throughout; d never got an address and was torn down.
func clean() *History {
	h := history()
	h.pod("a", 0, "10.0.0.2", 1, 30)
	h.pod("b", 1, "10.0.0.2", 40, 0)
	h.pod("c", 0, "10.0.0.3", 5, 0)
	d := &Pod{UID: "d", Container: "c-d", Slot: 1, Created: sec(10), DelSent: sec(31), DelAnswered: sec(31.1),
		Attempts: []Attempt{{Op: "ADD", Sent: sec(10), Answered: sec(30), Code: 11, Msg: "try again"},
			{Op: "DEL", Sent: sec(31), Answered: sec(31.1), OK: true}}}
	h.Pods = append(h.Pods, d)
	h.sample(10, "10.0.0.2=a", "10.0.0.3=c")
	h.sample(35, "10.0.0.3=c")
	h.sample(50, "10.0.0.2=b", "10.0.0.3=c")
	h.final("10.0.0.2=b", "10.0.0.3=c")
	return h
}

func TestCheckPassesACleanHistory(t *testing.T) {
	r := wantPass(t, clean())
	if r.PodsCreated != 4 || r.LiveAtEnd != 2 || r.PodsNeverLive != 1 {
		t.Errorf("counts: created %d, live at end %d, never live %d", r.PodsCreated, r.LiveAtEnd, r.PodsNeverLive)
	}
}

func TestCheckFindsAnOverlap(t *testing.T) {
	h := clean()
	h.Pods[0].DelAnswered, h.Pods[0].DelSent = sec(45), sec(44.9) // a still held 10.0.0.2 when b got it at 40
	h.final("10.0.0.2=b", "10.0.0.3=c")
	wantFailure(t, h, "unexplained overlaps")
	if o := Check(h).Overlaps; len(o) != 1 || o[0].IP != addr("10.0.0.2") || !o[0].From.Equal(sec(40)) || !o[0].To.Equal(sec(44.9)) {
		t.Errorf("overlap: %+v", o)
	}
}

// TestCheckEndsAHoldAtTheFirstDelSent: a's first DEL was sent before b got a's address and
// answered after (the agent released, then was killed before answering; the runtime sent the
// DEL again): the release may have applied before b's ADD, so this is no overlap.
func TestCheckEndsAHoldAtTheFirstDelSent(t *testing.T) {
	h := clean()
	h.Pods[0].DelSent, h.Pods[0].DelAnswered = sec(30), sec(45)
	h.Pods[0].Attempts = append(h.Pods[0].Attempts[:1],
		Attempt{Op: "DEL", Sent: sec(30), Answered: sec(31), Code: 11, Msg: "closed the connection without answering"},
		Attempt{Op: "DEL", Sent: sec(44.9), Answered: sec(45), OK: true})
	if o := Check(h).Overlaps; len(o) != 0 {
		t.Errorf("a DEL sent before the address went to another pod: want no overlap, got %+v", o)
	}
}

// standing is a's node cut off for 20 s (more than TTL + reuse delay): b took a's address
// meanwhile and a's agent recorded the conflict when it came back.
func standing(awayFor float64) *History {
	h := history()
	h.pod("a", 0, "10.0.0.2", 1, 0)
	h.pod("b", 1, "10.0.0.2", 8+awayFor-1, 0)
	h.away(0, 8, 8+awayFor, "link-long")
	h.conflict(8+awayFor+1, "a", "10.0.0.2", "b")
	h.final("10.0.0.2=b")
	return h
}

func TestCheckAcceptsAConflictAfterALongAbsence(t *testing.T) {
	r := wantPass(t, standing(20))
	if len(r.Overlaps) != 1 || !r.Overlaps[0].Recorded {
		t.Errorf("want one recorded overlap, got %+v", r.Overlaps)
	}
	if len(r.Conflicts) != 1 || !r.Conflicts[0].Justified {
		t.Errorf("want one justified conflict, got %+v", r.Conflicts)
	}
	if len(r.Standing) != 1 || len(r.Lost) != 0 {
		t.Errorf("want a's address lost to a standing conflict, got lost %v standing %v", r.Lost, r.Standing)
	}
}

// TestCheckAcceptsAnOverlapEndedByADelWhileAway: a, cut off for 20 s, is deleted at 27.5 s,
// before its node comes back at 28 s: its agent never re-claims it and records nothing, and
// b's taking was justified. Deleted after its node came back, with no conflict recorded, the
// overlap is unexplained.
func TestCheckAcceptsAnOverlapEndedByADelWhileAway(t *testing.T) {
	build := func(del float64) *History {
		h := standing(20)
		h.Logs = nil
		h.Pods[0].DelSent, h.Pods[0].DelAnswered = sec(del), sec(del+0.1)
		h.Pods[0].Attempts = append(h.Pods[0].Attempts, Attempt{Op: "DEL", Sent: sec(del), Answered: sec(del + 0.1), OK: true})
		return h
	}
	r := wantPass(t, build(27.5))
	if len(r.Overlaps) != 1 || !r.Overlaps[0].Recorded || !strings.Contains(r.Overlaps[0].Hint, "nothing to record") {
		t.Errorf("want one overlap with nothing to record, got %+v", r.Overlaps)
	}
	wantFailure(t, build(29), "unexplained overlaps")
}

func TestCheckFindsAnUnjustifiedConflict(t *testing.T) {
	// 8 s away: more than the TTL, less than TTL + reuse delay, and the pool had room.
	wantFailure(t, standing(8), "unjustified conflicts")
}

func TestCheckAcceptsAConflictWhenThePoolWasFull(t *testing.T) {
	h := standing(8)
	// Three more pods hold the rest of the pool but one: with a's address, 4 of 5 are held
	// when b gets a's (within fullSlack of the size).
	h.pod("c", 1, "10.0.0.3", 2, 0)
	h.pod("d", 1, "10.0.0.4", 2, 0)
	h.pod("e", 1, "10.0.0.5", 2, 0)
	h.Logs = append(h.Logs, LogEvent{Time: sec(15), Slot: 1, Kind: "reuse", Pool: "p", IP: addr("10.0.0.2")})
	h.final("10.0.0.2=b", "10.0.0.3=c", "10.0.0.4=d", "10.0.0.5=e")
	r := wantPass(t, h)
	if len(r.Reuses) != 1 || !r.Reuses[0].Full {
		t.Errorf("want one reuse with the pool full, got %+v", r.Reuses)
	}
}

func TestCheckFindsAConflictTheHistoryCannotExcuse(t *testing.T) {
	h := standing(8)
	// The agent says it reused an expired holder's address, but by the history 1 of 5 was held.
	h.Logs = append(h.Logs, LogEvent{Time: sec(15), Slot: 1, Kind: "reuse", Pool: "p", IP: addr("10.0.0.2")})
	wantFailure(t, h, "unjustified conflicts")
	if r := Check(h); len(r.Reuses) != 1 || r.Reuses[0].Full {
		t.Errorf("want one reuse with room, got %+v", r.Reuses)
	}
}

func TestCheckFindsAnOverlapWithoutAConflictRecord(t *testing.T) {
	h := standing(20)
	h.Logs = nil // the agent took a's address back silently, or never noticed
	wantFailure(t, h, "unexplained overlaps")
}

func TestCheckFindsLeaks(t *testing.T) {
	for name, mutate := range map[string]func(h *History){
		"deleted pod": func(h *History) { h.final("10.0.0.2=b", "10.0.0.3=c", "10.0.0.4=a") },
		"never live":  func(h *History) { h.final("10.0.0.2=b", "10.0.0.3=c", "10.0.0.5=d") },
		"unknown":     func(h *History) { h.final("10.0.0.2=b", "10.0.0.3=c", "10.0.0.6=zz") },
		"dead node's pod past its allowance": func(h *History) {
			h.pod("x", 1, "10.0.0.6", 3, 0).DiedAt = sec(50)
			h.final("10.0.0.2=b", "10.0.0.3=c", "10.0.0.6=x")
		},
	} {
		t.Run(name, func(t *testing.T) {
			h := clean()
			mutate(h)
			wantFailure(t, h, "leaks")
		})
	}
}

func TestCheckAllowsADeadNodesKeysUntilTheyExpire(t *testing.T) {
	h := clean()
	h.pod("x", 1, "10.0.0.6", 100, 0).DiedAt = sec(125) // 5 s before the snapshot
	h.final("10.0.0.2=b", "10.0.0.3=c", "10.0.0.6=x")
	r := wantPass(t, h)
	if len(r.Pending) != 1 {
		t.Errorf("want the dead pod's key pending, got %+v", r.Pending)
	}
	if settled, why := FinalState(h, h.Final); settled {
		t.Errorf("FinalState: settled with a key waiting to expire (%s)", why)
	}
}

func TestCheckFindsALostKey(t *testing.T) {
	h := clean()
	h.final("10.0.0.2=b") // c is live but etcd no longer holds 10.0.0.3 for it
	wantFailure(t, h, "lost keys")
	if settled, _ := FinalState(h, h.Final); settled {
		t.Error("FinalState: settled with a lost key")
	}
	h.final("10.0.0.2=b", "10.0.0.3=c")
	if settled, why := FinalState(h, h.Final); !settled {
		t.Errorf("FinalState: not settled on the clean state: %s", why)
	}
}

func TestCheckFindsAResurrection(t *testing.T) {
	h := clean()
	h.sample(32, "10.0.0.2=a", "10.0.0.3=c") // 2 s after a's DEL answered: within the slack
	wantPass(t, h)
	h.sample(36, "10.0.0.2=a", "10.0.0.3=c") // 6 s after: a re-claim undid the DEL
	wantFailure(t, h, "resurrections")
	if r := Check(h); len(r.Resurrections) != 1 || r.Resurrections[0].Pod != "a" || r.Resurrections[0].Samples != 1 {
		t.Errorf("resurrections: %+v", r.Resurrections)
	}
}

// A DEL answered while etcd's leader was cut off is recorded and answered; its keys go when
// etcd answers again, or with their lease, which the new leader extends by its TTL.
func TestCheckAllowsADeletedPodsKeyAcrossALeaderChange(t *testing.T) {
	h := clean()
	h.Faults = append(h.Faults, &Fault{ID: 1, Kind: EtcdLeaderCut, Target: "e1", Slot: -1, Member: 1, Start: sec(29), End: sec(33)})
	h.sample(36, "10.0.0.2=a", "10.0.0.3=c") // 6 s after a's DEL answered, the lease extended
	wantPass(t, h)
	h.sample(45, "10.0.0.2=a", "10.0.0.3=c") // past a TTL from the new leader, and the slack
	wantFailure(t, h, "resurrections")
}

func TestCheckFindsAMissingKey(t *testing.T) {
	h := clean()
	h.sample(60, "10.0.0.2=b") // c runs on a node that was never away, without its key
	wantFailure(t, h, "keys missing")

	h = clean()
	h.away(0, 55, 57, "link-short")
	h.sample(60, "10.0.0.2=b") // within TTL + grace of the heal: the re-claim may still run
	wantPass(t, h)
	h.sample(80, "10.0.0.2=b") // long after
	wantFailure(t, h, "keys missing")
}

func TestCheckExcusesAMissingKeyNearAnEtcdFault(t *testing.T) {
	h := clean()
	h.Faults = append(h.Faults, &Fault{ID: 1, Kind: EtcdLeaderCut, Target: "e1", Slot: -1, Member: 1, Start: sec(52), End: sec(56)})
	h.sample(60, "10.0.0.2=b") // c lost its key while its agent's etcd member was cut off
	wantPass(t, h)
}

func TestCheckNamesAnUnresolvedConflict(t *testing.T) {
	// b took a's address, the conflict was recorded; b left and x got it while a still ran.
	h := standing(20)
	h.Pods[1].DelSent, h.Pods[1].DelAnswered = sec(39.9), sec(40)
	h.pod("x", 1, "10.0.0.2", 45, 0)
	h.final("10.0.0.2=x")
	wantFailure(t, h, "unexplained overlaps")
	r := Check(h)
	if u := r.Unexplained(); len(u) != 1 || !strings.Contains(u[0].Hint, "not resolved") {
		t.Errorf("want one unexplained overlap naming the unresolved conflict, got %+v", u)
	}
}

func TestCheckJudgesAConflictByWhenTheHolderGotTheAddressBack(t *testing.T) {
	// b held 10.0.0.2 first; a took it while b's node was away 20 s (justified), b's agent
	// recorded the conflict and, once a's lease expired during a 5 s cut-off of a's node, got
	// it back: a's agent then records a conflict that was not justified (5 s < TTL + delay).
	h := history()
	h.pod("b", 1, "10.0.0.2", 1, 0)
	h.pod("a", 0, "10.0.0.2", 27, 0)
	h.away(1, 6, 30, "link-long")
	h.conflict(31, "b", "10.0.0.2", "a")
	h.away(0, 40, 45, "link-mid")
	h.Logs = append(h.Logs, LogEvent{Time: sec(44), Slot: 1, Kind: "resolved", Owner: "b", IP: addr("10.0.0.2")})
	h.conflict(46, "a", "10.0.0.2", "b")
	h.final("10.0.0.2=b")
	r := Check(h)
	t.Logf("\n%s", r)
	if len(r.Conflicts) != 2 || !r.Conflicts[0].Justified || r.Conflicts[1].Justified ||
		!strings.Contains(r.Conflicts[1].Reason, "conflict resolution") {
		t.Errorf("want the first conflict justified, the second not, judged at the resolution: %+v", r.Conflicts)
	}
}

func TestCheckFailsOnTheDoctorAndOnACrash(t *testing.T) {
	h := clean()
	h.Final.DoctorExit, h.Final.DoctorOutput = 3, "ERROR something"
	wantFailure(t, h, "3")
	h = clean()
	h.Events = append(h.Events, Event{Time: sec(20), Kind: "agent-exit", Slot: 0, Detail: "exit status 2", Fails: true})
	wantFailure(t, h, "failing events")
}

func TestCheckFailsOnAnUnansweredDel(t *testing.T) {
	h := clean()
	h.Pods[2].DelSent = sec(90) // c's DEL was sent and never answered
	h.final("10.0.0.2=b", "10.0.0.3=c")
	wantFailure(t, h, "DELs never answered")
}

func TestHistoryRoundTripsThroughJSON(t *testing.T) {
	h := standing(8)
	b, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	var back History
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if a, z := Check(h).Failures(), Check(&back).Failures(); !slices.Equal(a, z) {
		t.Errorf("failures before %v and after the round trip %v", a, z)
	}
}

func TestAwayStretchesMerge(t *testing.T) {
	// Two faults back to back on one node make one stretch: 18 s away when b took a's
	// address, of which only 9.7 s in the second fault.
	h := history()
	h.pod("a", 0, "10.0.0.2", 1, 0)
	h.pod("b", 1, "10.0.0.2", 20, 0)
	h.away(0, 2, 10, "link-mid")
	h.away(0, 10.3, 30, "sigstop")
	h.conflict(31, "a", "10.0.0.2", "b")
	h.final("10.0.0.2=b")
	wantPass(t, h)
}

func TestCheckFindsAnAddressTakenTooEarlyInALongAbsence(t *testing.T) {
	// a's node is away 20 s, longer than TTL + reuse delay, but b took a's address 10 s in.
	h := history()
	h.pod("a", 0, "10.0.0.2", 1, 0)
	h.pod("b", 1, "10.0.0.2", 18, 0)
	h.away(0, 8, 28, "link-long")
	h.conflict(29, "a", "10.0.0.2", "b")
	h.final("10.0.0.2=b")
	wantFailure(t, h, "unjustified conflicts")
}

// TestCheckAcceptsAConflictOfAPodBeingDeleted: a's DEL was sent, its agent released the
// address and was killed before it could journal the DEL; b got the address; the restarted
// agent re-claims a and finds it taken. No overlap, and the conflict is no address handed out
// wrongly.
func TestCheckAcceptsAConflictOfAPodBeingDeleted(t *testing.T) {
	h := history()
	h.pod("a", 0, "10.0.0.2", 1, 30)
	h.Pods[0].DelSent = sec(20)
	h.pod("b", 1, "10.0.0.2", 24, 0)
	h.away(0, 20.1, 26, "kill-pause")
	h.conflict(27, "a", "10.0.0.2", "b")
	h.final("10.0.0.2=b")
	wantPass(t, h)
}

// TestCheckAcceptsAnOverlapEtcdForgot: a's node is away past TTL + reuse delay, b takes a's
// address and lets it go; etcd's history is compacted before a's agent re-claims, and it logs
// that it cannot tell who had the address. Justified and said: recorded as unknowable. Had b
// still held the address then, the agent could have named it: unexplained.
func TestCheckAcceptsAnOverlapEtcdForgot(t *testing.T) {
	h := history()
	h.pod("a", 0, "10.0.0.2", 1, 0)
	h.pod("b", 1, "10.0.0.2", 25, 28)
	h.away(0, 5, 30, "link-long")
	unknown := LogEvent{Time: sec(31), Slot: 0, Kind: "unknown", Owner: "a", Pool: "p", IP: addr("10.0.0.2"),
		Msg: "the hold of an address ran out while this node was away, and etcd's history no longer tells whether another pod had it meanwhile"}
	h.Logs = append(h.Logs, unknown)
	h.final("10.0.0.2=a")
	r := wantPass(t, h)
	if len(r.Overlaps) != 1 || !r.Overlaps[0].Unknown {
		t.Errorf("overlaps: %+v", r.Overlaps)
	}
	h.Pods[1].DelSent, h.Pods[1].DelAnswered = sec(33.9), sec(34)
	h.Pods[1].Attempts[1].Sent, h.Pods[1].Attempts[1].Answered = sec(33.9), sec(34)
	wantFailure(t, h, "unexplained overlaps")
}

// TestCheckExplainsAReuseInAKeepTime: a reuse with room by the history's account is not a
// failure while its agent is in the keep time after it logged etcd going back (TTL + reuse
// delay), when it leaves free what it knew taken; after that time it is.
func TestCheckExplainsAReuseInAKeepTime(t *testing.T) {
	for _, tc := range []struct {
		name       string
		wentBack   float64
		withinKeep bool
	}{{"within the keep time", 14, true}, {"after it", 15 - 1 - (standing(8).Params.TTL + standing(8).Params.ReuseDelay).Seconds(), false}} {
		t.Run(tc.name, func(t *testing.T) {
			h := standing(8)
			h.Logs = append(h.Logs, LogEvent{Time: sec(tc.wentBack), Slot: 1, Kind: "wentback"},
				LogEvent{Time: sec(15), Slot: 1, Kind: "reuse", Pool: "p", IP: addr("10.0.0.2")})
			r := Check(h)
			if len(r.Reuses) != 1 || r.Reuses[0].Full || r.Reuses[0].Keeping != tc.withinKeep {
				t.Fatalf("want one reuse with room, keeping %v; got %+v", tc.withinKeep, r.Reuses)
			}
			if tc.withinKeep {
				for _, f := range failures(t, h) {
					if strings.Contains(f, "while the pool had room") {
						t.Errorf("a reuse in the keep time failed the run: %v", f)
					}
				}
			} else {
				wantFailure(t, h, "reuses of held-back addresses while the pool had room")
			}
		})
	}
}

// vm adds a VM's pod of claim "chaos.vm-0" (a live migration's target of target, if not
// empty), as pod does.
func (h *History) vm(uid string, slot int, ip string, add, del float64, target string) *Pod {
	p := h.pod(uid, slot, ip, add, del)
	p.Claim, p.Target = "chaos.vm-0", target
	return p
}

// migration is a VM's live migration: a runs on node 0 from 1 s, its target b's ADD on node 1
// answers at 20 s with a's address; at 30 s the source's DEL completes it (or, fail, the
// target's fails it). Meanwhile etcd holds the address for a, the source.
func migration(fail bool) *History {
	h := history()
	if fail {
		h.vm("a", 0, "10.0.0.2", 1, 0, "")
		h.vm("b", 1, "10.0.0.2", 20, 30, "a")
	} else {
		h.vm("a", 0, "10.0.0.2", 1, 30, "")
		h.vm("b", 1, "10.0.0.2", 20, 0, "a")
	}
	h.sample(10, "10.0.0.2=a")
	h.sample(25, "10.0.0.2=a")
	if fail {
		h.sample(35, "10.0.0.2=a")
		h.final("10.0.0.2=a")
	} else {
		h.sample(35, "10.0.0.2=b")
		h.final("10.0.0.2=b")
	}
	return h
}

func TestCheckCountsAMigrationPairAsOneOwner(t *testing.T) {
	for _, fail := range []bool{false, true} {
		r := wantPass(t, migration(fail))
		if len(r.Overlaps) != 0 || len(r.Migrations) != 1 || r.Migrations[0].Source != "a" || r.Migrations[0].Target != "b" {
			t.Errorf("failed %v: want one migration a -> b and no overlap, got %+v, %+v", fail, r.Migrations, r.Overlaps)
		}
	}
}

func TestCheckRejectsAThirdPodOfAMigratingClaim(t *testing.T) {
	h := migration(false)
	h.vm("c", 2, "10.0.0.2", 25, 28, "a") // a third pod of the claim, on a third node, during the migration
	wantFailure(t, h, "unexplained overlaps")
	if u := Check(h).Unexplained(); len(u) == 0 || !strings.Contains(u[0].Hint, "third pod") {
		t.Errorf("want the overlap named as a third pod's, got %+v", u)
	}
}

func TestCheckRejectsAMigrationPairOnOneNode(t *testing.T) {
	h := migration(false)
	h.Pods[1].Slot = 0
	wantFailure(t, h, "unexplained overlaps")
}

func TestCheckRejectsAMigrationPastTheBound(t *testing.T) {
	h := migration(false)
	del := 20 + (migrationBound + 2*time.Second).Seconds()
	h.Pods[0].DelSent, h.Pods[0].DelAnswered = sec(del-0.1), sec(del)
	h.Pods[0].Attempts[1].Sent, h.Pods[0].Attempts[1].Answered = sec(del-0.1), sec(del)
	h.Samples = h.Samples[:2]
	wantFailure(t, h, "unexplained overlaps")
}

// TestCheckJudgesAMigrationsKeysAtTheEnd: a migration still on at the end leaves the key its
// source's, for both pods; a completed one must leave it the target's.
func TestCheckJudgesAMigrationsKeysAtTheEnd(t *testing.T) {
	h := migration(false)
	h.End = sec(25)
	h.Pods[0].DelSent, h.Pods[0].DelAnswered, h.Pods[0].Attempts = time.Time{}, time.Time{}, h.Pods[0].Attempts[:1]
	h.Samples = h.Samples[:2]
	h.final("10.0.0.2=a")
	if r := wantPass(t, h); len(r.Migrations) != 1 {
		t.Errorf("want the migration on at the end counted, got %+v", r.Migrations)
	}

	h = migration(false)
	h.final("10.0.0.2=a") // completed, but the key is still the source's
	wantFailure(t, h, "lost keys")
	if r := Check(h); len(r.Lost) != 1 || !strings.Contains(r.Lost[0].Why, "must hold") {
		t.Errorf("want b's key lost, said of its migration: %+v", r.Lost)
	}
}

// TestCheckJudgesAConflictOfAClaimsTwoPods: the source's node is cut off for 8 s during the
// migration (more than the TTL: its lease expires and the target is promoted); its re-claim
// finds the address the target's and records a conflict: the window that remains. Cut off
// for less than the TTL, the conflict is not justified.
func TestCheckJudgesAConflictOfAClaimsTwoPods(t *testing.T) {
	for _, tc := range []struct {
		away      float64
		justified bool
	}{{8, true}, {3, false}} {
		h := history()
		h.vm("a", 0, "10.0.0.2", 1, 40, "")
		h.vm("b", 1, "10.0.0.2", 20, 0, "a")
		h.away(0, 22, 22+tc.away, "link-mid")
		h.conflict(23+tc.away, "a", "10.0.0.2", "b")
		h.final("10.0.0.2=b")
		r := Check(h)
		if len(r.Conflicts) != 1 || r.Conflicts[0].Justified != tc.justified {
			t.Errorf("away %vs: want the conflict justified %v, got %+v", tc.away, tc.justified, r.Conflicts)
		}
	}
}

// TestParseAgentLogReadsAStickyClaimsConflict: the sticky claim's CONFLICT names the holder
// and its addresses in "held", not "taken".
func TestParseAgentLogReadsAStickyClaimsConflict(t *testing.T) {
	path := t.TempDir() + "/n0.log"
	line := `{"time":"2026-11-28T04:49:37.27036492Z","level":"ERROR","msg":"CONFLICT: the sticky claim of a running pod names another holder, ` +
		`which holds its addresses; it is left to that holder","owner":"uid-vm0-000-n0","claim":"chaos.vm-0","pool":"chaos",` +
		`"holder":"uid-vm0-004-n1/eth0 (node node-1, container ctr-x)","held":["10.77.0.199 held by uid-vm0-004-n1 (node node-1, container ctr-x)"]}`
	if err := os.WriteFile(path, []byte(line+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	evs, _, err := ParseAgentLog(path, 0, "node-0")
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 1 || evs[0].Kind != "conflict" || evs[0].Owner != "uid-vm0-000-n0" ||
		!slices.Equal(evs[0].Taken, []Taken{{IP: addr("10.77.0.199"), Holder: "uid-vm0-004-n1"}}) {
		t.Errorf("parsed %+v", evs)
	}
}

// TestCheckJudgesAConflictOfAClaimsTwoPodsByTheLeaseLost: the source's node is not away, but
// its agent logged its pod lease lost before its live migration's target took the keys (T4,
// by the conflict; the target got the address at its ADD): justified. Logged after the
// conflict (past the second the log may lag the expiry), or re-claimed between the loss and
// the conflict, it is not.
func TestCheckJudgesAConflictOfAClaimsTwoPodsByTheLeaseLost(t *testing.T) {
	for _, tc := range []struct {
		lost, reclaimed float64
		justified       bool
	}{{19, 0, true}, {19, 19.5, false}, {22, 0, true}, {22, 23, false}, {27, 0, false}} {
		h := history()
		h.vm("a", 0, "10.0.0.2", 1, 40, "")
		h.vm("b", 1, "10.0.0.2", 20, 0, "a")
		h.Logs = append(h.Logs, LogEvent{Time: sec(tc.lost), Slot: 0, Kind: "leaselost", Owner: "a"})
		if tc.reclaimed > 0 {
			h.Logs = append(h.Logs, LogEvent{Time: sec(tc.reclaimed), Slot: 0, Kind: "reclaimed", Owner: "a"})
		}
		h.conflict(25, "a", "10.0.0.2", "b")
		h.final("10.0.0.2=b")
		r := Check(h)
		if len(r.Conflicts) != 1 || r.Conflicts[0].Justified != tc.justified {
			t.Errorf("lost %v, re-claimed %v: want the conflict justified %v, got %+v", tc.lost, tc.reclaimed, tc.justified, r.Conflicts)
		}
	}
}

// TestCheckExcusesATargetsKeyMissingWhileItsSourceIsAway: the source's node is cut off
// longer than the TTL during the migration; its allocation key expires with its lease and is
// nobody's until the target's agent promotes the target (T4). Without the cut-off, the key
// missing fails the run.
func TestCheckExcusesATargetsKeyMissingWhileItsSourceIsAway(t *testing.T) {
	h := migration(false)
	h.sample(27) // nobody holds 10.0.0.2
	wantFailure(t, h, "keys missing")
	h.away(0, 21, 29.5, "link-mid")
	wantPass(t, h)
}
