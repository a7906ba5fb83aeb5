package etcdgate

import (
	"context"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestGateTellsEtcdGoingBack: what the gate makes of the headers of etcd's answers. A
// linearizable answer below the revision seen when it was sent, or of another cluster, and
// any answer whose revision jumped further than etcd can write, are proof; a keep-alive behind
// the agent's history by less than suspectAfter is nothing; an answer to a request sent before
// etcd was found gone back proves nothing more.
func TestGateTellsEtcdGoingBack(t *testing.T) {
	const cluster = 0xc1
	type answer struct {
		h      *pb.ResponseHeader
		proof  bool          // linearizable
		after  time.Duration // since the gate last saw the revision grow
		stale  bool          // sent before the first proof
		lowFor time.Duration // how long answers in an earlier term have come, if they have
		wantGB bool          // proof that etcd went back
	}
	hdr := func(c uint64, rev int64) *pb.ResponseHeader { return &pb.ResponseHeader{ClusterId: c, Revision: rev} }
	hdrT := func(rev int64, term uint64) *pb.ResponseHeader {
		return &pb.ResponseHeader{ClusterId: cluster, Revision: rev, RaftTerm: term}
	}
	for _, c := range []struct {
		name    string
		answers []answer
	}{
		// The history as etcd writes it: nothing to say.
		{"revisions that grow", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(cluster, 150), proof: true}, {h: hdr(cluster, 151)}}},
		// A plain restore: the revision of the backup.
		{"a linearizable answer below the floor", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(cluster, 60), proof: true, wantGB: true}}},
		// A new etcd at the same endpoints.
		{"another cluster", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(0xc2, 500), proof: true, wantGB: true}}},
		// A keep-alive filled in before an answer the agent read first, or from a member that
		// lags: behind, but within suspectAfter of the agent's history.
		{"a keep-alive a little behind", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(cluster, 120), proof: true}, {h: hdr(cluster, 110)}}},
		// A restore with --bump-revision 1000000000 after a minute of etcd down.
		{"a bumped revision", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(cluster, 1_000_000_100), after: time.Minute, wantGB: true}}},
		// A node cut off for an hour from a busy etcd sees the revision far ahead, as fast as
		// etcd can write at most: not a restore.
		{"an hour of writes", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(cluster, 100+3600*maxRevRate), after: time.Hour}}},
		// Once etcd is found gone back, an answer to a request sent before proves nothing more.
		{"an answer of the old epoch", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(cluster, 60), proof: true, wantGB: true},
			{h: hdr(cluster, 50), proof: true, stale: true}}},
		// An agent away while etcd was restored: the backup's revision is above the last it
		// saw, but the restored cluster counts its raft terms from the first again, in every
		// answer.
		{"answers in an earlier term for termConfirm", []answer{{h: hdrT(100, 9), proof: true}, {h: hdrT(400, 2), proof: true},
			{h: hdrT(401, 2)}, {h: hdrT(402, 2), proof: true, lowFor: termConfirm, wantGB: true}}},
		// A member back from a cut answers in its old term for a moment; the others answer in
		// the new one meanwhile.
		{"a member back from a cut", []answer{{h: hdrT(100, 4), proof: true}, {h: hdrT(110, 5), proof: true},
			{h: hdrT(111, 4), proof: true}, {h: hdrT(112, 5)}, {h: hdrT(113, 4), proof: true, lowFor: termConfirm}}},
		// Elections move the term on.
		{"terms that grow", []answer{{h: hdrT(100, 2), proof: true}, {h: hdrT(120, 5), proof: true}, {h: hdrT(130, 5), proof: true}}},
		// Two requests in flight across an election: the one served first in the old term is
		// read second. It is measured against the term seen when it was sent.
		{"an answer sent before the election was seen", []answer{{h: hdrT(100, 4), proof: true}, {h: hdrT(120, 5), proof: true},
			{h: hdrT(110, 4), proof: true, stale: true}}},
		// A keep-alive from a member that has not heard of the last election yet: a suspicion,
		// which a confirmation read settles.
		{"a keep-alive in an earlier term", []answer{{h: hdrT(100, 4), proof: true}, {h: hdrT(120, 5), proof: true}, {h: hdrT(121, 4)}}},
		// A header the client made up (a watch's end) is not etcd's.
		{"no cluster ID", []answer{{h: hdr(cluster, 100), proof: true}, {h: hdr(0, 0), proof: true}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // no confirmation read: this gate has no client
			went := make(chan string, 4)
			g := &Gate{ctx: ctx, started: time.Now(), cfg: Config{WentBack: func(why string, _ time.Time) { went <- why }, MayHaveGoneBack: func(string) {}}}
			first := g.floor()
			for i, an := range c.answers {
				f := g.floor()
				if an.stale {
					f = first
				}
				if an.lowFor > 0 {
					g.mu.Lock()
					if !g.termLow.IsZero() {
						g.termLow = time.Now().Add(-an.lowFor)
					}
					g.mu.Unlock()
				}
				if an.after > 0 {
					g.mu.Lock()
					g.revAt = time.Now().Add(-an.after)
					g.mu.Unlock()
				}
				before := g.Epoch()
				g.seen(an.h, f, an.proof)
				// The epoch moves with the proof, before the signal's goroutine runs.
				if gb := g.Epoch() != before; gb != an.wantGB {
					t.Errorf("answer %d (%v): etcd gone back %v, want %v", i, an.h, gb, an.wantGB)
				}
			}
			for _, an := range c.answers {
				if !an.wantGB {
					continue
				}
				select {
				case why := <-went:
					if why == "" {
						t.Errorf("etcd gone back without a reason")
					}
				case <-time.After(30 * time.Second):
					t.Errorf("the proof was never signalled")
				}
			}
		})
	}
}

// TestGateDatesTheNewHistoryFromItsFirstDoubtedAnswer: the proof that etcd went back is told
// with when the gate first heard the new history: the first answer below its floor that it
// doubted (a keep-alive's, a lease's) before a linearizable answer proved it. The agent acted
// on that answer already (a lease the keeper then took for lost). An answer the gate took
// between ends the doubt. FirstOfHistory is the revision of the same answer: a key with a
// higher ModRevision was written after the agent heard the new history.
func TestGateDatesTheNewHistoryFromItsFirstDoubtedAnswer(t *testing.T) {
	const cluster = 0xc1
	hdr := func(c uint64, rev int64) *pb.ResponseHeader { return &pb.ResponseHeader{ClusterId: c, Revision: rev} }
	for _, c := range []struct {
		name    string
		settled bool // an answer in the known history came between the doubt and the proof
	}{{"doubted, then proven", false}, {"doubted, taken again, then proven", true}} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // no confirmation read: this gate has no client
			var from time.Time
			g := &Gate{ctx: ctx, started: time.Now(), cfg: Config{WentBack: func(_ string, f time.Time) { from = f },
				MayHaveGoneBack: func(string) {}}}
			g.seen(hdr(cluster, 100), g.floor(), true)
			g.mu.Lock()
			g.old = 100 // a non-linearizable answer is measured against it
			g.mu.Unlock()
			beforeDoubt := time.Now()
			g.seen(hdr(cluster, 40), g.floor(), false) // a keep-alive from the restored etcd: doubted
			afterDoubt := time.Now()
			if c.settled {
				g.seen(hdr(cluster, 101), g.floor(), true)
			}
			for time.Since(afterDoubt) < 2*time.Millisecond {
				// the proof comes later than the doubt: time.Now() moves on
			}
			proofAt := time.Now()
			g.seen(hdr(cluster, 41), g.floor(), true)
			switch {
			case from.IsZero():
				t.Fatal("the proof was never signalled")
			case !c.settled && (from.Before(beforeDoubt) || from.After(afterDoubt)):
				t.Errorf("new history dated %v, want the doubted answer's time, between %v and %v", from, beforeDoubt, afterDoubt)
			case c.settled && from.Before(proofAt):
				t.Errorf("new history dated %v, before the proof at %v, though an answer in the known history came after the doubt", from, proofAt)
			}
			want := int64(40) // the doubted answer's
			if c.settled {
				want = 41 // the proof's
			}
			if got := g.FirstOfHistory(); got != want {
				t.Errorf("FirstOfHistory %d, want %d", got, want)
			}
		})
	}
}
