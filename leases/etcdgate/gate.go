// Package etcdgate is the agent's one way to etcd: every answer etcd gives passes the gate,
// which keeps when etcd last answered and notices etcd going back in time.
package etcdgate

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Gate sees every answer etcd gives the agent: the KV, lease and watch calls of the
// client it hands out (Client), and the keep-alive answers the keeper reads (Heard). From
// the answers it keeps when etcd answered last (reachability) and etcd's history as the agent
// has seen it: the cluster ID, the highest revision and the highest raft term.
//
// An answer from another cluster, or at a revision below one the agent already saw, means
// etcd went back in time: it was restored from a backup, or replaced by an empty etcd at the
// same endpoints. Keys the agent wrote may be gone while their leases live on, so a renewed
// lease proves nothing then. A linearizable request (every KV request the agent sends) is
// answered at the revision and in the raft term the gate had seen when it was sent, or later
// ones: an answer below the revision is proof, reported to WentBack. The term matters to an
// agent that was away while etcd was restored: the restored cluster's revision is above any
// it saw, but its terms count from the first again, and stay below the old cluster's until it
// has had as many elections. A member back from a cut answers in its old term for a moment
// too, so answers in an earlier term are proof only once they last termConfirm. Any other
// answer (a keep-alive, a lease or a watch answer, from a member that may lag behind another,
// or filled in before an answer the agent read first) is measured against the revision the
// agent had seen suspectAfter earlier, and the highest term; one below either is a suspicion,
// which the gate settles with a linearizable read of its own.
//
// etcd restored with its revision bumped and marked compacted, as etcd's documentation
// recommends under Kubernetes, goes forward: any answer whose revision grew far faster than
// etcd can write is proof of it (maxRevRate). A compacted watch is a suspicion of that kind,
// for a bump too small to tell: MayHaveGoneBack has the agent check its keys.
//
// Both signals are wired at start and called on the goroutine that got the answer, before
// the request returns: a decision that reads what the agent knows after such an answer must
// find the agent already repairing (leases/restorehold). So they must not block, nor take a lock that
// a caller of etcd may hold: they set state and wake the recovery loop.
type Gate struct {
	raw     *clientv3.Client
	client  *clientv3.Client // raw, with its KV, Lease and Watcher seen through the gate
	ctx     context.Context  // the agent's: confirmation reads end with it
	cfg     Config
	started time.Time
	last    atomic.Int64 // monotonic nanoseconds after started of the last answer

	mu      sync.Mutex
	cluster uint64
	rev     int64
	// term is the highest raft term a linearizable answer carried. A cluster's terms never
	// go down, and a restored one starts again from the first: an agent whose last answers
	// predate the backup sees no revision below its floor, but its term is above the new
	// cluster's for as long as that cluster has had fewer elections. termLow is when answers
	// in an earlier term began, none in the known term since (zero: none).
	term    uint64
	termLow time.Time
	revAt   time.Time // when rev was last raised
	// old is the highest revision seen at least suspectAfter ago (at most twice that), what
	// an answer that is not linearizable is measured against; recent becomes old at rotated.
	old, recent int64
	rotated     time.Time
	// epoch counts the times etcd went back: an answer to a request sent in an earlier epoch
	// is measured against a floor of a history that is gone, and proves nothing.
	epoch uint64
	// doubted is when the first answer came that the gate doubted (below its floor, not yet
	// proof), of those since the last answer it took; zero: none. A proof that etcd went back
	// dates the new history from it: the agent acted on answers from it before the proof.
	doubted    time.Time
	doubtedRev int64 // the lowest revision of those answers
	// first is the lowest revision the gate heard of etcd's history since it last found etcd
	// gone back in time (the doubted answers' and the proof's); 0: it never did.
	first      int64
	confirming bool
	confirmed  time.Time // when the last confirmation read was sent
}

// suspectAfter is how far behind the agent's own history an answer that is not linearizable
// may be without suspicion: a member lags by milliseconds, a keep-alive's header is filled in
// before it travels, and a watch's before its events wait in the client. A backup restored
// from the last few seconds of history is missed here; a linearizable answer proves it, and
// the check of the agent's keys finds what it lost (leases/audit).
const suspectAfter = 5 * time.Second

// A revision that grows faster than maxRevRate a second, plus revSlack, since the agent last
// saw it grow, is no history etcd wrote: a restore with --bump-revision (etcd's documentation
// gives 1,000,000,000 under Kubernetes), which shows no other sign but compacted watches.
// etcd writes one revision per transaction, and tens of thousands a second at most.
const (
	maxRevRate = 200_000
	revSlack   = 1_000_000
)

// Jumped reports whether etcd's revision growing from from to to in since is more than
// etcd can write: a restore with its revision bumped.
func Jumped(from, to int64, since time.Duration) bool {
	return to-from > revSlack+int64(max(since, 0).Seconds()*maxRevRate)
}

// termConfirm is how long answers in a term below the known one must last, with none in the
// known term between, to prove a restore: a member cut off from an election serves a few
// answers in the term before it as it comes back, until the new leader reaches it.
const termConfirm = 2 * time.Second

// confirmEvery bounds how often a suspicion sends a confirmation read: a member that lags
// answers keep-alives below the floor for as long as it lags.
const confirmEvery = time.Second

// Config is what a gate needs from the agent, the signals included: the gate is wired once,
// when it is made, before any request passes it.
type Config struct {
	// Probe is the key a confirmation read counts; ProbeTimeout bounds that read.
	Probe        string
	ProbeTimeout time.Duration
	// WentBack is told the proof that etcd went back in time, and since when the gate heard
	// the new history (the first answer it doubted before the proof, else the proof's own);
	// MayHaveGoneBack a sign of it that proves nothing alone (a compacted watch). Nil: nobody
	// is told.
	WentBack        func(why string, since time.Time)
	MayHaveGoneBack func(why string)
}

// New returns the gate of cli. Requests made through its Client end with ctx's (the agent's)
// confirmation reads; cli stays the caller's, and only the gate may call it.
func New(ctx context.Context, cli *clientv3.Client, cfg Config) *Gate {
	if cfg.WentBack == nil {
		cfg.WentBack = func(string, time.Time) {}
	}
	if cfg.MayHaveGoneBack == nil {
		cfg.MayHaveGoneBack = func(string) {}
	}
	g := &Gate{raw: cli, ctx: ctx, cfg: cfg, started: time.Now()}
	c := *cli // the copy shares the connection; its Close is never called
	c.KV = gatedKV{cli.KV, g}
	c.Lease = gatedLease{cli.Lease, g}
	c.Watcher = gatedWatcher{cli.Watcher, g}
	g.client = &c
	return g
}

// Client is etcd's client with every answer seen by the gate: the only one the agent uses.
func (g *Gate) Client() *clientv3.Client { return g.client }

// History watches key from past the gate, for a read of etcd's history: there a revision
// compacted away is an answer to the question, not a sign that etcd went back.
func (g *Gate) History(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	return g.raw.Watch(ctx, key, opts...)
}

// floor is what a request is measured against: the highest revision seen when it was sent,
// in the epoch it was sent in.
type floor struct {
	rev   int64
	term  uint64
	epoch uint64
}

func (g *Gate) floor() floor {
	g.mu.Lock()
	defer g.mu.Unlock()
	return floor{g.rev, g.term, g.epoch}
}

// Epoch counts the times etcd was found gone back in time: a decision taken from what the
// agent knew in an earlier epoch may be wrong in etcd's new history.
func (g *Gate) Epoch() uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.epoch
}

// answered records that etcd just answered.
func (g *Gate) answered() { g.last.Store(int64(time.Since(g.started))) }

// SilentFor is how long ago etcd last answered.
func (g *Gate) SilentFor() time.Duration {
	return time.Since(g.started) - time.Duration(g.last.Load())
}

// LastAnswer is when etcd last answered.
func (g *Gate) LastAnswer() time.Time {
	return time.Now().Add(-g.SilentFor())
}

// Answers tells whether etcd answers: at no cost when it answered within the last within,
// else by a count-only read of key bounded by Config.ProbeTimeout, whose error says since
// when etcd has not answered. Renewals count as answers: a node with pods seldom asks. The
// agent asks it before an ADD or DEL (so that a node cut off from etcd answers at once, not
// after the plugin's timeout), and for STATUS and /readyz.
func (g *Gate) Answers(ctx context.Context, key string, within time.Duration) error {
	if g.SilentFor() <= within {
		return nil
	}
	octx, cancel := context.WithTimeout(ctx, g.cfg.ProbeTimeout)
	defer cancel()
	if _, err := g.client.Get(octx, key, clientv3.WithCountOnly()); err != nil {
		return fmt.Errorf("etcd does not answer (no answer since %s): %w", g.LastAnswer().UTC().Format(time.RFC3339), err)
	}
	return nil
}

// seen notes the header of an answer to a request sent at floor f. proof says that the
// request was linearizable, so that an answer below f is proof that etcd went back.
func (g *Gate) seen(h *pb.ResponseHeader, f floor, proof bool) {
	g.answered()
	if h == nil || h.ClusterId == 0 {
		return // a header the client made up (a watch's end), not etcd's
	}
	g.mu.Lock()
	if f.epoch != g.epoch {
		g.mu.Unlock()
		return
	}
	if now := time.Now(); now.Sub(g.rotated) >= suspectAfter {
		g.old, g.recent, g.rotated = g.recent, g.rev, now
	}
	below, termBelow := f.rev, f.term
	if !proof {
		below, termBelow = g.old, g.term
	}
	// A term is measured against the one seen when the request was sent: answers to requests
	// in flight together may arrive in another order than they were served, across an election.
	termBack := g.cluster != 0 && h.RaftTerm != 0 && h.RaftTerm < termBelow
	back := g.cluster != 0 && (h.ClusterId != g.cluster || h.Revision < below)
	since := time.Since(g.revAt)
	jump := g.cluster != 0 && g.rev > 0 && Jumped(g.rev, h.Revision, since)
	if termBack && !back && !jump {
		// A member cut off from an election answers in the term before it for a moment
		// as it comes back; a restored cluster does in every answer. Only an earlier term
		// that lasts termConfirm, no answer in the known term between, is proof.
		now := time.Now()
		if g.termLow.IsZero() {
			g.termLow = now
			time.AfterFunc(termConfirm, g.confirm)
		}
		g.doubt(now, h.Revision)
		termBack = proof && now.Sub(g.termLow) >= termConfirm
		if !termBack {
			if h.Revision > g.rev {
				g.rev, g.revAt = h.Revision, now
			}
			g.mu.Unlock()
			g.confirm()
			return
		}
	}
	if !back && !jump && !termBack {
		if h.Revision > g.rev {
			g.rev, g.revAt = h.Revision, time.Now()
		}
		if h.RaftTerm != 0 && h.RaftTerm >= g.term {
			g.termLow = time.Time{} // the cluster the agent knows answers in its own terms
		}
		if proof && h.RaftTerm > g.term {
			g.term = h.RaftTerm
		}
		g.cluster = h.ClusterId
		g.doubted, g.doubtedRev = time.Time{}, 0
		g.mu.Unlock()
		return
	}
	if !proof && !jump {
		g.doubt(time.Now(), h.Revision)
		g.mu.Unlock()
		g.confirm()
		return
	}
	why := fmt.Sprintf("etcd answered at revision %d of cluster %x after revision %d of cluster %x", h.Revision, h.ClusterId, f.rev, g.cluster)
	switch {
	case h.ClusterId != g.cluster:
		why = fmt.Sprintf("etcd answered as cluster %x, not %x (revision %d after %d)", h.ClusterId, g.cluster, h.Revision, f.rev)
	case jump:
		why = fmt.Sprintf("etcd's revision jumped from %d to %d in %s, faster than any etcd writes: restored with its revision bumped",
			g.rev, h.Revision, since.Round(time.Second))
	case !back:
		why = fmt.Sprintf("etcd answered in raft term %d after term %d (revision %d after %d): a cluster restored from a backup",
			h.RaftTerm, f.term, h.Revision, f.rev)
	}
	g.cluster, g.rev, g.revAt, g.old, g.recent = h.ClusterId, h.Revision, time.Now(), 0, 0
	g.term, g.termLow = 0, time.Time{}
	if proof {
		g.term = h.RaftTerm
	}
	g.epoch++
	from := g.doubted
	if from.IsZero() {
		from = time.Now()
	}
	g.first = h.Revision
	if g.doubtedRev != 0 {
		g.first = min(g.first, g.doubtedRev)
	}
	g.doubted, g.doubtedRev = time.Time{}, 0
	g.mu.Unlock()
	g.cfg.WentBack(why, from)
}

// doubt notes an answer at rev, heard at now, that the gate doubted; under mu.
func (g *Gate) doubt(now time.Time, rev int64) {
	if g.doubted.IsZero() {
		g.doubted = now
	}
	if g.doubtedRev == 0 || rev < g.doubtedRev {
		g.doubtedRev = rev
	}
}

// FirstOfHistory is the lowest revision the gate heard of etcd's history since it last found
// etcd gone back in time (0: it never did): the answers it doubted before the proof, and the
// proof's. Every key written after the agent heard that answer has a higher ModRevision;
// one with a lower ModRevision was written before, the restore's or another writer's.
func (g *Gate) FirstOfHistory() int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.first
}

// HistoryStart is a revision at or below the one etcd's history started from: where the last
// restore left it (the backup's revision, bumped or not; 0 for an empty etcd). Every key
// written since has a higher ModRevision, whoever wrote it and whatever the agents had heard.
// It is a member's revision less its raft index: a restore starts a new raft log, every
// write since is one entry of it that raises the revision by one at most, and the member
// reads its committed index after its revision (Status), so revision - index <= restored
// revision - the log's first index. A history that had no restore gives a lower bound still.
// It errs low by the entries that wrote nothing (lease grants, elections). The answer passes
// the gate; the error is the last endpoint's that did not answer.
func (g *Gate) HistoryStart(ctx context.Context) (int64, error) {
	err := fmt.Errorf("etcd has no endpoint")
	for _, ep := range g.raw.Endpoints() {
		var resp *clientv3.StatusResponse
		if resp, err = g.raw.Status(ctx, ep); err == nil {
			g.Heard(resp.Header)
			return max(resp.Header.Revision-int64(resp.RaftIndex), 0), nil
		}
	}
	return 0, fmt.Errorf("read etcd's status: %w", err)
}

// Heard notes the header of an answer that is not linearizable: a keep-alive's.
func (g *Gate) Heard(h *pb.ResponseHeader) { g.seen(h, g.floor(), false) }

// confirm sends a linearizable read through the gate, at most once per confirmEvery: its
// answer is measured like any other, so it proves that etcd went back, or that a member lags.
func (g *Gate) confirm() {
	g.mu.Lock()
	if g.confirming || time.Since(g.confirmed) < confirmEvery || g.ctx.Err() != nil {
		g.mu.Unlock()
		return
	}
	g.confirming, g.confirmed = true, time.Now()
	g.mu.Unlock()
	go func() {
		defer func() {
			g.mu.Lock()
			g.confirming = false
			g.mu.Unlock()
		}()
		ctx, cancel := context.WithTimeout(g.ctx, g.cfg.ProbeTimeout)
		defer cancel()
		_, _ = g.client.Get(ctx, g.cfg.Probe, clientv3.WithCountOnly())
	}()
}

// watched notes a watch answer: a compaction, or its header.
func (g *Gate) watched(resp *clientv3.WatchResponse) {
	if resp.CompactRevision != 0 {
		g.Heard(&resp.Header) // a bumped revision proves more than the compaction suggests
		g.cfg.MayHaveGoneBack(fmt.Sprintf("a watch was compacted at revision %d", resp.CompactRevision))
		return
	}
	if resp.Err() == nil {
		g.Heard(&resp.Header)
	}
}
