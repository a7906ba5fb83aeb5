package chaos

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// restored is a history with a restore: backup at 20 s, etcd's data lost at 40 s and served
// again at 41 s (restoreGrace 13 s: the window ends at 54 s). "old" runs throughout; "new"
// was created after the backup, so its key is gone at the return, and its agent puts it back
// at 44 s; "gone" was deleted after the backup, so its key is back at the return, and goes at
// 47 s.
func restored() *History {
	h := history()
	h.Faults = append(h.Faults, &Fault{ID: 1, Kind: EtcdRestore, Target: "all", Slot: -1, Way: RestorePlain,
		Start: sec(20), BackupDone: sec(20.1), Lost: sec(40), End: sec(41)})
	h.pod("old", 0, "10.0.0.2", 5, 0)
	h.pod("new", 0, "10.0.0.3", 30, 0)
	h.pod("gone", 1, "10.0.0.4", 10, 30)
	h.sample(15, "10.0.0.2=old", "10.0.0.4=gone")
	h.sample(35, "10.0.0.2=old", "10.0.0.3=new")
	h.sample(42, "10.0.0.2=old", "10.0.0.4=gone")
	h.sample(45, "10.0.0.2=old", "10.0.0.3=new", "10.0.0.4=gone")
	h.sample(48, "10.0.0.2=old", "10.0.0.3=new")
	h.sample(60, "10.0.0.2=old", "10.0.0.3=new")
	h.final("10.0.0.2=old", "10.0.0.3=new")
	return h
}

func TestCheckJudgesARestore(t *testing.T) {
	r := wantPass(t, restored())
	if len(r.Restores) != 1 {
		t.Fatalf("restores: %+v", r.Restores)
	}
	v := r.Restores[0]
	if v.Running != 2 || v.Missing != 1 || v.SlowestPod != "new" || v.Restored != 1 || len(v.NotBack) != 0 {
		t.Errorf("verdict: %+v", v)
	}
}

func TestCheckFindsAPodNotBackAfterARestore(t *testing.T) {
	h := restored()
	h.Samples = h.Samples[:3] // "new" never holds its address again
	h.sample(50, "10.0.0.2=old")
	h.sample(60, "10.0.0.2=old")
	wantFailure(t, h, "running pods without their address after a restore")
	wantFailure(t, h, "keys missing") // after the window, as in any run
	if v := Check(h).Restores[0]; len(v.NotBack) != 1 || v.NotBack[0].Pod != "new" {
		t.Errorf("not back: %+v", v.NotBack)
	}
}

func TestCheckFindsARestoredKeyThatStays(t *testing.T) {
	h := restored()
	h.sample(56, "10.0.0.2=old", "10.0.0.3=new", "10.0.0.4=gone") // past the window: renewed by someone
	wantFailure(t, h, "resurrections")
}

func TestCheckExcusesAPodNotBackWhileALaterFaultHitsItsNode(t *testing.T) {
	h := restored()
	// An etcd member down during the repair stretches the window to 59 s; "new"'s node is
	// cut off from 55 s, after the window would have ended without it: its key, put back at
	// 44 s, is gone again at the window's end.
	h.Faults = append(h.Faults, &Fault{ID: 2, Kind: EtcdKill, Target: "e0", Slot: -1, Start: sec(43), End: sec(46)})
	h.away(0, 55, 62, "link-mid")
	h.Samples = h.Samples[:5]
	h.sample(58, "10.0.0.2=old")
	h.sample(80, "10.0.0.2=old", "10.0.0.3=new")
	r := wantPass(t, h)
	if v := r.Restores[0]; v.Excused != 1 || len(v.NotBack) != 0 {
		t.Errorf("verdict: %+v", v)
	}
}

func TestCheckHoldsKeysOfPodsDeletedBeforeTheBackupToTheTTL(t *testing.T) {
	h := restored()
	h.Pods[2].DelSent, h.Pods[2].DelAnswered = sec(12.9), sec(13) // gone by 17 s: not in the backup
	h.Pods[2].Attempts[1].Sent, h.Pods[2].Attempts[1].Answered = sec(12.9), sec(13)
	h.Samples = slices.DeleteFunc(h.Samples, func(s Sample) bool { return s.T0.Equal(sec(15)) })
	wantFailure(t, h, "resurrections")
}

// A pod got "gone"'s address after its DEL; the restore gives the address back to "gone"'s
// key, and the running pod's agent records the conflict: justified by the restore, and the
// pod holds its address again once that key goes.
func TestCheckAcceptsAConflictWithARestoredKey(t *testing.T) {
	h := restored()
	h.pod("later", 1, "10.0.0.4", 33, 0)
	h.conflict(43, "later", "10.0.0.4", "gone")
	for i := range h.Samples {
		if s := &h.Samples[i]; s.T0.After(sec(33)) && !slices.ContainsFunc(s.Allocs, func(a Alloc) bool { return a.IP == addr("10.0.0.4") }) {
			s.Allocs = append(s.Allocs, Alloc{IP: addr("10.0.0.4"), Owner: "later"})
		}
	}
	h.final("10.0.0.2=old", "10.0.0.3=new", "10.0.0.4=later")
	r := wantPass(t, h)
	if len(r.Conflicts) != 1 || !r.Conflicts[0].Justified || !strings.Contains(r.Conflicts[0].Reason, "restore #1") {
		t.Errorf("conflicts: %+v", r.Conflicts)
	}
	// A held key outlives its pod: one deleted before the backup may still be in it.
	h.Pods[2].DelSent, h.Pods[2].DelAnswered = sec(14.9), sec(15)
	h.Pods[2].Attempts[1].Sent, h.Pods[2].Attempts[1].Answered = sec(14.9), sec(15)
	h.Samples = slices.DeleteFunc(h.Samples, func(s Sample) bool {
		return slices.ContainsFunc(s.Allocs, func(a Alloc) bool { return a.Owner == "gone" })
	})
	wantPass(t, h)
	// A holder created after the backup is not in it: the restore does not explain it.
	h.Pods[2].Created, h.Pods[2].Attempts[0].Sent = sec(25), sec(25)
	wantFailure(t, h, "unjustified conflicts")
}

func TestCheckExcusesAMissingKeyOnlyWithinTheRestoresWindow(t *testing.T) {
	h := restored()
	h.away(0, 38, 50, "link-mid") // "new"'s node comes back at 50: its window ends at 63
	h.Samples = h.Samples[:3]
	h.sample(50, "10.0.0.2=old")
	h.sample(62, "10.0.0.2=old", "10.0.0.3=new")
	h.sample(66, "10.0.0.2=old", "10.0.0.3=new")
	wantPass(t, h)
	h.Samples = h.Samples[:len(h.Samples)-2]
	h.sample(64, "10.0.0.2=old")
	wantFailure(t, h, "keys missing")
}

// keyEdited is the clean history with c's allocation deleted by hand at 50 s (the deadline
// 63 s) and put back at 52 s.
func keyEdited(back float64) *History {
	h := clean()
	f := &Fault{ID: 1, Kind: KeyEdit, Target: "n0", Slot: 0, Key: KeyAllocation, Op: "del", Pod: "c",
		Path: "/leasehold/v1/ips/p/10.0.0.0-26/10.0.0.3", Start: sec(50), End: sec(back)}
	if back > 0 {
		f.Back = sec(back)
	}
	h.Faults = append(h.Faults, f)
	h.sample(51, "10.0.0.2=b")
	return h
}

func TestCheckJudgesAKeyEdit(t *testing.T) {
	r := wantPass(t, keyEdited(52))
	if len(r.KeyEdits) != 1 || !r.KeyEdits[0].Judged || !r.KeyEdits[0].OK {
		t.Errorf("key edits: %+v", r.KeyEdits)
	}
	wantFailure(t, keyEdited(0), "edited keys not put back")
	wantFailure(t, keyEdited(70), "edited keys not put back")
	h := keyEdited(0)
	h.Pods[2].DelSent, h.Pods[2].DelAnswered = sec(55), sec(55.1) // deleted before the deadline
	h.final("10.0.0.2=b")
	if r := wantPass(t, h); r.KeyEdits[0].Judged {
		t.Errorf("judged a pod deleted before the deadline, its key not back: %+v", r.KeyEdits[0])
	}
	h = keyEdited(52)
	h.Pods[2].DelSent, h.Pods[2].DelAnswered = sec(55), sec(55.1)
	h.final("10.0.0.2=b")
	if r := wantPass(t, h); !r.KeyEdits[0].Judged || !r.KeyEdits[0].OK {
		t.Errorf("a key back before the pod's DEL: %+v", r.KeyEdits[0])
	}
}

// TestCheckJudgesAConflictARestoreTurnedAround: "a" runs from 5 s; its node is away from 22 s
// to 45 s, and "b" takes its address at 39 s, after TTL + reuse delay (justified). The restore
// (backup at 20 s) erases b's keys and gives the address back to a's: b's agent records that b
// lost it to a, as justified as b's taking was. Had b taken it at 30 s, that taking, and so
// this conflict, would not be.
func TestCheckJudgesAConflictARestoreTurnedAround(t *testing.T) {
	build := func(took float64) *History {
		h := history()
		h.Faults = append(h.Faults, &Fault{ID: 1, Kind: EtcdRestore, Target: "all", Slot: -1, Way: RestoreBump,
			Start: sec(20), BackupDone: sec(20.1), Lost: sec(40), End: sec(41)})
		h.pod("a", 0, "10.0.0.2", 5, 0)
		h.pod("b", 1, "10.0.0.2", took, 0)
		h.away(0, 22, 45, "link-long")
		h.conflict(46, "b", "10.0.0.2", "a")
		h.final("10.0.0.2=a")
		return h
	}
	r := Check(build(39))
	t.Logf("\n%s", r)
	if len(r.Conflicts) != 1 || !r.Conflicts[0].Justified || !strings.Contains(r.Conflicts[0].Reason, "gave 10.0.0.2 back to a") {
		t.Errorf("conflicts: %+v", r.Conflicts)
	}
	wantFailure(t, build(30), "unjustified conflicts")
}

// TestCheckJudgesAConflictWithAnAddInFlightAcrossARestore: "a" is created after the backup
// (20 s), so the restore erases its key. "b"'s first ADD, sent at 40.5 s while etcd was being
// restored, chose a's address as free there; its agent found etcd gone back, gave the claim
// back and answered an error; a's agent recorded the conflict meanwhile (41.5 s). b's retry
// got another address. Justified: nobody but a was ever told the address. Had b been answered
// a's address, the conflict is judged as any other: unjustified with room in the pool and a's
// node never away.
func TestCheckJudgesAConflictWithAnAddInFlightAcrossARestore(t *testing.T) {
	build := func(told bool) *History {
		h := history()
		h.Faults = append(h.Faults, &Fault{ID: 1, Kind: EtcdRestore, Target: "all", Slot: -1, Way: RestoreBump,
			Start: sec(20), BackupDone: sec(20.1), Lost: sec(40), End: sec(41)})
		h.pod("a", 0, "10.0.0.2", 30, 0)
		b := h.pod("b", 1, "10.0.0.3", 45, 0)
		b.Created = sec(40.5)
		b.Attempts = append([]Attempt{{Op: "ADD", Sent: sec(40.5), Answered: sec(41.2)}}, b.Attempts...)
		if told {
			b.Addrs = []netip.Addr{addr("10.0.0.2")}
		}
		h.conflict(41.5, "a", "10.0.0.2", "b")
		h.final("10.0.0.2=a", "10.0.0.3=b")
		return h
	}
	r := Check(build(false))
	t.Logf("\n%s", r)
	if len(r.Conflicts) != 1 || !r.Conflicts[0].Justified || !strings.Contains(r.Conflicts[0].Reason, "never answered the address") {
		t.Errorf("conflicts: %+v", r.Conflicts)
	}
	wantFailure(t, build(true), "unjustified conflicts")
}

// TestCheckJudgesTheWindowThatRemains: "a" is created before the backup (20 s), but its first
// ADDs claim nothing (etcd does not answer), and the one sent at 24.9 s claims 10.0.0.2: the
// restore (etcd back at 41 s) erases its keys. a's agent notices at once (41 s) and is stopped
// at 41.5 s before it re-claims a; "b" gets the address at 49.5 s, after the settle time (two
// TTLs), and a's re-claim at 50.2 s records the conflict: the window that remains
// (ARCHITECTURE.md, invariant 15). Not it: a re-claimed before its node was stopped (its held
// key then keeps the address), b's address taken within the settle time, a's claim possibly
// in the backup, a's node away only before etcd's return.
func TestCheckJudgesTheWindowThatRemains(t *testing.T) {
	build := func(change func(h *History, a *Pod)) *History {
		h := history()
		h.Faults = append(h.Faults, &Fault{ID: 1, Kind: EtcdRestore, Target: "all", Slot: -1, Way: RestoreBump,
			Start: sec(20), BackupDone: sec(20.1), BackupRev: 100, Lost: sec(40), End: sec(41)})
		a := h.pod("a", 0, "10.0.0.2", 25, 0)
		a.Created = sec(10)
		a.Attempts = append([]Attempt{{Op: "ADD", Sent: sec(10), Answered: sec(12), Code: 11,
			Msg: "agent unavailable: etcd does not answer (no answer since 2026-01-01T12:00:05Z): context deadline exceeded"}}, a.Attempts...)
		h.pod("b", 1, "10.0.0.2", 49.5, 60)
		h.Logs = append(h.Logs, LogEvent{Time: sec(41), Slot: 0, Kind: "wentback", Msg: "etcd went back in time"},
			LogEvent{Time: sec(41), Slot: 1, Kind: "wentback", Msg: "etcd went back in time"})
		h.away(0, 41.5, 50, "sigstop")
		h.conflict(50.2, "a", "10.0.0.2", "b")
		h.Logs = append(h.Logs, LogEvent{Time: sec(50.3), Slot: 0, Kind: "reclaimed", Owner: "a", Msg: "pod re-claimed after its lease was lost"},
			LogEvent{Time: sec(60.1), Slot: 0, Kind: "resolved", Owner: "a", IP: addr("10.0.0.2"), Msg: "conflict resolved"})
		h.sample(30, "10.0.0.2=a")
		h.sample(45)
		h.sample(55, "10.0.0.2=b")
		h.sample(62, "10.0.0.2=a")
		h.final("10.0.0.2=a")
		if change != nil {
			change(h, a)
		}
		return h
	}
	r := Check(build(nil))
	t.Logf("\n%s", r)
	if len(r.Conflicts) != 1 || !r.Conflicts[0].Justified || !strings.Contains(r.Conflicts[0].Reason, "the window that remains") {
		t.Fatalf("conflicts: %+v", r.Conflicts)
	}
	// Its one ADD sent before the backup, answered after it: the sample read at the backup's
	// revision without a's key shows that the claim applied after the backup.
	wantPass(t, build(func(h *History, a *Pod) {
		a.Attempts = a.Attempts[1:]
		a.Created, a.Attempts[0].Sent = sec(19), sec(19)
		h.Samples[0].T0, h.Samples[0].T1, h.Samples[0].Rev = sec(21), sec(21.01), 101
		h.Samples[0].Allocs = nil
	}))
	for name, change := range map[string]func(h *History, a *Pod){
		"re-claimed before the stop": func(h *History, a *Pod) {
			h.Logs = append(h.Logs, LogEvent{Time: sec(41.3), Slot: 0, Kind: "reclaimed", Owner: "a", Msg: "pod re-claimed after its lease was lost"})
		},
		"seen back before the stop": func(h *History, a *Pod) { h.sample(41.2, "10.0.0.2=a") },
		"taken within the settle time": func(h *History, a *Pod) {
			b := h.Pods[1]
			b.AddAnswered, b.Attempts[0].Answered = sec(48.9), sec(48.9)
		},
		"an earlier ADD may have claimed": func(h *History, a *Pod) { a.Attempts[0].Msg = "context deadline exceeded" },
		"claimed before the backup's revision": func(h *History, a *Pod) {
			a.Attempts = a.Attempts[1:]
			a.Created, a.Attempts[0].Sent = sec(19), sec(19)
			h.Samples[0].T0, h.Samples[0].T1, h.Samples[0].Rev = sec(21), sec(21.01), 99
			h.Samples[0].Allocs = nil
		},
		"away only before the return": func(h *History, a *Pod) { h.Away = []Away{{Slot: 0, Start: sec(30), End: sec(38), Cause: "sigstop"}} },
	} {
		t.Run(name, func(t *testing.T) { wantFailure(t, build(change), "unjustified conflicts") })
	}
}
