package podbook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Writer is the journal's one writer. Callers record the newest state of an owner;
// a background loop appends what changed in one write, every flushEvery, or at once when an
// ADD or DEL waits for its change (Sync): concurrent callers share that write, and the file
// system sees one append, never a file per pod (docs/performance.md). An ADD or DEL is
// answered only once the journal holds it, so a crash right after an answer loses nothing;
// other changes (re-claims, recorded conflicts) may lose the last flushEvery, which the next
// recovery rebuilds from etcd.
//
// A write that fails (a full or failing disk, a short write) loses nothing: the changes stay
// with the writer, a partly written line is cut back off the file, and the write is tried
// again, from journalRetryFirst doubling to journalRetryMax, until the journal holds every
// pod again; no further change is needed for that. Meanwhile the failure is logged (at the
// first failure, every journalLogEvery, and on recovery), counted, and fails /readyz; a DEL
// waiting for it fails (code 11), an ADD does not.
type Writer struct {
	j   journal
	log *slog.Logger

	mu      sync.Mutex
	pending map[string]*PodState // owner -> newest state; nil: forget the owner
	seq     uint64               // changes taken so far (save, Remove)
	kick    chan struct{}        // asks the loop to write now (Sync)
	done    chan struct{}
	stopped chan struct{}
	once    sync.Once
	started atomic.Bool

	// Read by the metrics and by Ready.
	failures atomic.Int64 // failed write attempts
	hmu      sync.Mutex
	failErr  error     // the last failure while the journal misses changes; nil when it holds them all
	failedAt time.Time // the first failure of the current run of failures
	// written is the highest seq the file holds; failedThrough the highest seq the last failed
	// attempt tried to write. notify is closed, and replaced, whenever either moves (Sync).
	written, failedThrough uint64
	notify                 chan struct{}

	// Owned by the loop.
	absorbed  uint64 // seq of the last change absorbed
	f         *os.File
	size      int64             // bytes of f known to end with a whole line: where a failed append is cut back to
	live      map[string][]byte // owner -> its put line: what the journal must hold
	unwritten []byte            // lines of changes already in live, not yet appended
	lines     int               // lines in the file plus those in unwritten
	rewrite   bool              // the file must be rewritten from live before anything is appended to it
	aside     bool              // the file has unreadable lines: move it aside before the rewrite
	legacy    []string          // per-pod files of earlier versions, deleted at the next compaction

	backoff  time.Duration // 0 while writes succeed
	retryAt  time.Time     // while failing: the next attempt
	loggedAt time.Time     // while failing: the last log line
	unlogged int           // failed attempts since the last log line
	run      int           // failed attempts in the current run
}

const (
	flushEvery        = 50 * time.Millisecond
	journalRetryFirst = 100 * time.Millisecond
	journalRetryMax   = 5 * time.Second
	journalLogEvery   = time.Minute
)

// ErrJournalUnwritable is wrapped by Health's error, and so by the agent's Ready, while the
// local journal cannot be written (a full or failing --state-dir disk). ADDs still succeed
// (DELs wait); the pods they add are journaled once a retry succeeds.
var ErrJournalUnwritable = errors.New("the journal cannot be written; re-claim after a lease loss would miss the pods changed since")

// NewWriter makes the writer of the journal in the state directory dir (none: it writes
// nothing, and Sync returns at once). It writes once started.
func NewWriter(dir string, log *slog.Logger) *Writer {
	return &Writer{j: journal{dir: dir}, log: log, pending: map[string]*PodState{}, done: make(chan struct{}),
		stopped: make(chan struct{}), live: map[string][]byte{}, kick: make(chan struct{}, 1), notify: make(chan struct{})}
}

func (w *Writer) path() string { return filepath.Join(w.j.dir, JournalFile) }

// Start begins writing, from what Load found, in the background: an unreadable journal is
// kept aside and the per-pod files of earlier versions are folded in by a compaction first;
// then what changed is appended every flushEvery.
func (w *Writer) Start(from Loaded) {
	if w.j.dir == "" || !w.started.CompareAndSwap(false, true) {
		return
	}
	for _, ps := range from.Pods {
		if line, ok := from.lines[ps.Owner]; ok {
			w.live[ps.Owner] = line
		} else if line, err := encodeLine(journalLine{Put: &ps}); err == nil {
			w.live[ps.Owner] = line
		}
	}
	w.legacy, w.lines = from.legacy, from.nlines
	w.aside = from.unreadable
	w.rewrite = len(w.legacy) > 0 || from.unreadable || from.torn
	go func() {
		if !w.rewrite {
			// Else, or when it cannot be opened, the first change rewrites the whole journal.
			if f, err := os.OpenFile(w.path(), os.O_WRONLY|os.O_APPEND, 0o600); err == nil {
				if st, err := f.Stat(); err == nil {
					w.f, w.size = f, st.Size()
				} else {
					f.Close()
				}
			}
		}
		w.loop()
	}()
}

// save records ps as the owner's newest state. It never blocks on the disk and never fails;
// an ADD or DEL that must survive a crash waits with Sync.
func (w *Writer) save(ps PodState) {
	if w.j.dir == "" {
		return
	}
	w.mu.Lock()
	w.pending[ps.Owner] = &ps
	w.seq++
	w.mu.Unlock()
}

// Remove records that the owner is forgotten: the book's Drop does, and so does the agent's
// recovery for a pod of the journal it does not keep (a previous boot's, or one whose
// sandbox is gone).
func (w *Writer) Remove(owner string) {
	if w.j.dir == "" {
		return
	}
	w.mu.Lock()
	w.pending[owner] = nil
	w.seq++
	w.mu.Unlock()
}

// Sync returns once the journal holds every change taken before the call: an ADD or DEL is
// answered only then, so that a crash right after the answer (kill -9) neither forgets a pod
// the runtime was told it has nor brings back one it was told is deleted. No fsync: see
// journal. It asks the loop to write at once; concurrent callers share that write. It returns
// the error of the write that failed to record those changes (a full or failing disk), or
// ctx's. Without a journal it returns nil at once.
func (w *Writer) Sync(ctx context.Context) error {
	if w.j.dir == "" || !w.started.Load() {
		return nil
	}
	w.mu.Lock()
	target := w.seq
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
	for {
		w.hmu.Lock()
		written, failed, err, notify := w.written, w.failedThrough, w.failErr, w.notify
		w.hmu.Unlock()
		switch {
		case written >= target:
			return nil
		case err != nil && failed >= target:
			return w.Health()
		}
		select {
		case <-notify:
		case <-w.stopped:
			if w.written >= target {
				return nil
			}
			return fmt.Errorf("the journal writer stopped before writing the change")
		case <-ctx.Done():
			return fmt.Errorf("waiting for the journal to be written: %w", ctx.Err())
		}
	}
}

// publish records the outcome of a write attempt of the changes up to w.absorbed and wakes
// the Sync callers.
func (w *Writer) publish(err error) {
	w.hmu.Lock()
	if err == nil {
		w.written = w.absorbed
	} else {
		w.failedThrough = w.absorbed
	}
	close(w.notify)
	w.notify = make(chan struct{})
	w.hmu.Unlock()
}

// Health is nil while the journal holds every change the writer has taken, and an error
// wrapping ErrJournalUnwritable from a failed write until a retry succeeds.
func (w *Writer) Health() error {
	w.hmu.Lock()
	defer w.hmu.Unlock()
	if w.failErr == nil {
		return nil
	}
	return fmt.Errorf("%w (failing since %s): %w", ErrJournalUnwritable, w.failedAt.UTC().Format(time.RFC3339), w.failErr)
}

func (w *Writer) loop() {
	defer close(w.stopped)
	t := time.NewTicker(flushEvery)
	defer t.Stop()
	w.attempt(false, false) // a journal to keep aside, fold or heal is rewritten at once
	for {
		select {
		case <-w.done:
			w.attempt(true, true)
			if w.f != nil {
				w.f.Close()
			}
			return
		case <-w.kick:
			w.attempt(true, false) // someone waits for it (Sync): no backoff
		case <-t.C:
			w.attempt(false, false)
		}
	}
}

// attempt writes what changed, unless a failed write's backoff still runs and force is not
// set (the agent stops, or a caller waits: Sync), and reports the outcome.
func (w *Writer) attempt(force, stopping bool) {
	if !force && w.backoff > 0 && time.Now().Before(w.retryAt) {
		return
	}
	err := w.flush()
	now := time.Now()
	if err == nil {
		if w.backoff == 0 {
			w.publish(nil)
			return
		}
		w.hmu.Lock()
		since := w.failedAt
		w.failErr = nil
		w.hmu.Unlock()
		w.publish(nil)
		w.log.Warn("journal written again after failed writes; it holds every pod", "journal", w.path(),
			"failed_attempts", w.run, "failing_for", now.Sub(since).Round(time.Millisecond))
		w.backoff, w.run, w.unlogged = 0, 0, 0
		return
	}
	w.failures.Add(1)
	first := w.backoff == 0
	w.hmu.Lock()
	if first {
		w.failedAt = now
	}
	w.failErr = err
	w.hmu.Unlock()
	w.publish(err)
	w.backoff = min(max(2*w.backoff, journalRetryFirst), journalRetryMax)
	w.retryAt = now.Add(w.backoff)
	w.run++
	w.unlogged++
	if first || now.Sub(w.loggedAt) >= journalLogEvery || stopping {
		// The allocations stand in etcd; re-claim after a long outage, and DELs, depend on it.
		w.log.Error("journal write failed; re-claim after a lease loss may miss pods", "err", err,
			"failed_attempts", w.unlogged, "retry_in", w.backoff)
		w.loggedAt, w.unlogged = now, 0
	}
}

func encodeLine(l journalLine) ([]byte, error) {
	b, err := json.Marshal(l)
	return append(b, '\n'), err
}

// absorb moves the pending changes into live and their lines into unwritten.
func (w *Writer) absorb() {
	w.mu.Lock()
	batch := w.pending
	w.absorbed = w.seq
	if len(batch) == 0 {
		w.mu.Unlock()
		return
	}
	w.pending = map[string]*PodState{}
	w.mu.Unlock()
	for owner, ps := range batch {
		var line []byte
		if ps == nil {
			if _, ok := w.live[owner]; !ok {
				continue
			}
			delete(w.live, owner)
			line, _ = encodeLine(journalLine{Del: owner})
		} else {
			var err error
			if line, err = encodeLine(journalLine{Put: ps}); err != nil {
				w.log.Error("journal entry not encodable", "owner", owner, "err", err)
				continue
			}
			w.live[owner] = line
		}
		if !w.rewrite {
			w.unwritten = append(w.unwritten, line...)
		}
		w.lines++
	}
	if w.backoff > 0 && w.lines > 2*len(w.live)+64 {
		// Failing for long under churn: the rewrite the next attempt would make anyway keeps
		// the writer's memory to the live pods.
		w.rewrite, w.unwritten = true, nil
	}
}

// flush writes what changed: appended, or the whole journal rewritten when it must be or
// has grown to twice the live pods. What a failed write did not write stays for the next.
func (w *Writer) flush() error {
	w.absorb()
	if w.aside {
		aside := fmt.Sprintf("%s.unreadable-%d", w.path(), time.Now().Unix())
		switch err := os.Rename(w.path(), aside); {
		case err == nil:
			w.log.Error("journal had unreadable lines; kept aside, a new one is written", "kept", aside)
		case !errors.Is(err, fs.ErrNotExist):
			return fmt.Errorf("journal %s: keep it aside: %w", w.path(), err) // never compacted away
		}
		w.aside = false
	}
	switch {
	case w.rewrite:
		return w.compact()
	case len(w.unwritten) == 0:
		return nil
	case w.f == nil:
		return w.compact()
	case w.lines > 2*len(w.live)+64:
		if err := w.compact(); err != nil {
			// A rewrite needs room for a second copy; the append may still fit.
			if aerr := w.append(); aerr != nil {
				return errors.Join(err, aerr)
			}
		}
		return nil
	default:
		return w.append()
	}
}

// append writes unwritten at the end of the file. A failed or short write is cut back to the
// last whole line, so that no partial line stays: the next load would take it for a crash,
// and the next append would be glued to it. If it cannot be cut back, the file is rewritten.
func (w *Writer) append() error {
	n, err := w.f.Write(w.unwritten)
	if err == nil {
		w.size += int64(n)
		w.unwritten = nil
		return nil
	}
	err = fmt.Errorf("journal %s: append: %w", w.path(), err)
	if terr := w.f.Truncate(w.size); terr != nil {
		w.f.Close()
		w.f, w.rewrite, w.unwritten = nil, true, nil
		return errors.Join(err, fmt.Errorf("journal %s: cut back a partly written line: %w", w.path(), terr))
	}
	return err
}

// compact replaces the journal by the live pods' lines, then deletes the per-pod files of
// earlier versions it folded in. If it fails, the journal is left as it was.
func (w *Writer) compact() error {
	path := w.path()
	buf := make([]byte, 0, 512*len(w.live))
	for _, owner := range slices.Sorted(maps.Keys(w.live)) {
		buf = append(buf, w.live[owner]...)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, buf, 0o600); err != nil {
		os.Remove(tmp) // a partial copy holds room the next attempt needs
		return fmt.Errorf("journal %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("journal %s: %w", path, err)
	}
	// The journal holds every pod now, whether or not it opens for the next append.
	if w.f != nil {
		w.f.Close()
	}
	w.f, w.size, w.lines, w.unwritten, w.rewrite = nil, int64(len(buf)), len(w.live), nil, false
	if f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0o600); err == nil {
		w.f = f // else the next change rewrites the journal
	}
	for _, name := range w.legacy {
		if err := os.Remove(filepath.Join(w.j.dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			w.log.Warn("could not delete a folded-in journal file of an earlier version", "file", name, "err", err)
		}
	}
	w.legacy = nil
	return nil
}

// Failures counts the failed write attempts so far (a metric).
func (w *Writer) Failures() int64 { return w.failures.Load() }

// Abandon forgets the changes not written yet, as a kill -9 would (for tests); Close then
// stops the writer.
func (w *Writer) Abandon() {
	w.mu.Lock()
	w.pending = map[string]*PodState{}
	w.mu.Unlock()
}

// Close writes what is pending and stops the loop; closing again does nothing.
func (w *Writer) Close() {
	if !w.started.Load() {
		return
	}
	w.once.Do(func() { close(w.done) })
	<-w.stopped
}
