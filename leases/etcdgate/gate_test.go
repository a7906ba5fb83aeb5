package etcdgate

import (
	"context"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestGateTellsEtcdGoingBack: what the gate makes of the headers of etcd's answers. A write
// answered below the revision seen when it was sent, linearizable reads below it for
// revConfirm, an answer of another cluster, and any answer whose revision jumped further than
// etcd can write, are proof; a read from a member behind that catches up, or a keep-alive
// behind the agent's history by less than suspectAfter, is nothing; an answer to a request
// sent before etcd was found gone back proves nothing more.
func TestGateTellsEtcdGoingBack(t *testing.T) {
	const cluster = 0xc1
	type answer struct {
		h      *pb.ResponseHeader
		kind   answerKind    // linearizable: a read or a write
		after  time.Duration // since the gate last saw the revision grow
		stale  bool          // sent before the first proof
		lowFor time.Duration // how long answers in an earlier term, or reads below the floor, have come
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
		{"revisions that grow", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 150), kind: write}, {h: hdr(cluster, 151)}}},
		// A plain restore: the revision of the backup.
		{"a linearizable answer below the floor", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 60), kind: write, wantGB: true}}},
		// A new etcd at the same endpoints.
		{"another cluster", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(0xc2, 500), kind: write, wantGB: true}}},
		// A keep-alive filled in before an answer the agent read first, or from a member that
		// lags: behind, but within suspectAfter of the agent's history.
		{"a keep-alive a little behind", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 120), kind: write}, {h: hdr(cluster, 110)}}},
		// A restore with --bump-revision 1000000000 after a minute of etcd down.
		{"a bumped revision", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 1_000_000_100), after: time.Minute, wantGB: true}}},
		// A node cut off for an hour from a busy etcd sees the revision far ahead, as fast as
		// etcd can write at most: not a restore.
		{"an hour of writes", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 100+3600*maxRevRate), after: time.Hour}}},
		// Once etcd is found gone back, an answer to a request sent before proves nothing more.
		{"an answer of the old epoch", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 60), kind: write, wantGB: true},
			{h: hdr(cluster, 50), kind: write, stale: true}}},
		// An agent away while etcd was restored: the backup's revision is above the last it
		// saw, but the restored cluster counts its raft terms from the first again, in every
		// answer.
		{"answers in an earlier term for termConfirm", []answer{{h: hdrT(100, 9), kind: write}, {h: hdrT(400, 2), kind: write},
			{h: hdrT(401, 2)}, {h: hdrT(402, 2), kind: write, lowFor: termConfirm, wantGB: true}}},
		// A member back from a cut answers in its old term for a moment; the others answer in
		// the new one meanwhile.
		{"a member back from a cut", []answer{{h: hdrT(100, 4), kind: write}, {h: hdrT(110, 5), kind: write},
			{h: hdrT(111, 4), kind: write}, {h: hdrT(112, 5)}, {h: hdrT(113, 4), kind: write, lowFor: termConfirm}}},
		// Elections move the term on.
		{"terms that grow", []answer{{h: hdrT(100, 2), kind: write}, {h: hdrT(120, 5), kind: write}, {h: hdrT(130, 5), kind: write}}},
		// Two requests in flight across an election: the one served first in the old term is
		// read second. It is measured against the term seen when it was sent.
		{"an answer sent before the election was seen", []answer{{h: hdrT(100, 4), kind: write}, {h: hdrT(120, 5), kind: write},
			{h: hdrT(110, 4), kind: write, stale: true}}},
		// A keep-alive from a member that has not heard of the last election yet: a suspicion,
		// which a confirmation read settles.
		{"a keep-alive in an earlier term", []answer{{h: hdrT(100, 4), kind: write}, {h: hdrT(120, 5), kind: write}, {h: hdrT(121, 4)}}},
		// A member behind answers a linearizable read below the floor right after a leader
		// change (etcd's own stale reads); it catches up at once.
		{"a read from a member behind", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 80), kind: read},
			{h: hdr(cluster, 101), kind: read}, {h: hdr(cluster, 90), kind: read}}},
		// A plain restore seen only by reads: below the floor for revConfirm.
		{"reads below the floor for revConfirm", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(cluster, 60), kind: read},
			{h: hdr(cluster, 61), kind: read}, {h: hdr(cluster, 62), kind: read, lowFor: revConfirm, wantGB: true}}},
		// A header the client made up (a watch's end) is not etcd's.
		{"no cluster ID", []answer{{h: hdr(cluster, 100), kind: write}, {h: hdr(0, 0), kind: write}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // no confirmation read: this gate has no client
			went := make(chan string, 4)
			g := &Gate{ctx: ctx, started: time.Now(), cfg: Config{WentBack: func(why string) { went <- why }, MayHaveGoneBack: func(string) {}}}
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
					if !g.revLow.IsZero() {
						g.revLow = time.Now().Add(-an.lowFor)
					}
					g.mu.Unlock()
				}
				if an.after > 0 {
					g.mu.Lock()
					g.revAt = time.Now().Add(-an.after)
					g.mu.Unlock()
				}
				before := g.Epoch()
				g.seen(an.h, f, an.kind)
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

// TestKindOfAnAnswer: which requests' answers are writes, placed in etcd's history by raft,
// and which are reads.
func TestKindOfAnAnswer(t *testing.T) {
	for _, c := range []struct {
		name string
		ops  []clientv3.Op
		want answerKind
	}{
		{"a get", []clientv3.Op{clientv3.OpGet("k")}, read},
		{"a serializable get", []clientv3.Op{clientv3.OpGet("k", clientv3.WithSerializable())}, other},
		{"a put", []clientv3.Op{clientv3.OpPut("k", "v")}, write},
		{"a delete among gets", []clientv3.Op{clientv3.OpGet("k"), clientv3.OpDelete("k")}, write},
		{"a transaction of gets", []clientv3.Op{clientv3.OpTxn(nil, []clientv3.Op{clientv3.OpGet("k")}, nil)}, read},
		{"a transaction writing in its else branch", []clientv3.Op{clientv3.OpTxn(nil, []clientv3.Op{clientv3.OpGet("k")},
			[]clientv3.Op{clientv3.OpPut("k", "v")})}, write},
	} {
		if got := kindOf(c.ops...); got != c.want {
			t.Errorf("%s: kind %d, want %d", c.name, got, c.want)
		}
	}
}
