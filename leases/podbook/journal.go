package podbook

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/leasehold/leasehold/internal/parallel"
	"github.com/leasehold/leasehold/keyspace"
)

// journal is the node's own record of its pods, kept so that after a lease loss (or a restart
// after one) the agent can re-claim the addresses of the pods that still run. It is one file,
// <dir>/journal, of JSON lines appended by a single writer: {"put": <pod>} gives a pod's newest
// state, {"del": "<owner>"} forgets it; replaying the lines gives every pod. A new file with only
// the live pods replaces it (written aside and renamed) when it has grown to twice their number.
// Earlier versions kept one <owner>.json file per pod; Load reads those too, and the writer's
// first compaction folds them in and deletes them.
//
// There is no fsync: a process crash keeps the page cache, and after a machine crash the boot
// ID, and with it the node UID, changes and every sandbox of the old boot is gone anyway. A
// crash in the middle of an append leaves a partial last line, which Load skips; a failed
// append leaves none (Writer.append cuts it back).
type journal struct {
	dir string // empty: no journal
}

const (
	// JournalFile is the journal's name in the state directory.
	JournalFile = "journal"
	journalExt  = ".json" // the per-pod files of earlier versions
)

// journalLine is one line of the journal.
type journalLine struct {
	Put *PodState `json:"put,omitempty"`
	Del string    `json:"del,omitempty"`
}

// Loaded is what Load found: the pods, and the per-pod files of earlier versions that were
// read (the writer deletes them once they are folded into the journal). It is handed to
// Writer.Start.
type Loaded struct {
	Pods   []PodState        // sorted by owner
	lines  map[string][]byte // owner -> its put line in the journal, reused by the writer
	nlines int               // lines in the journal file
	legacy []string
	// unreadable is set when lines in the middle of the journal could not be read: the
	// writer keeps that file aside instead of compacting it away.
	unreadable bool
	// torn is set when the journal ends in a partial line: the writer rewrites the file
	// rather than append to the fragment.
	torn bool
}

// Load replays the journal in the state directory dir (none: nothing). Unreadable lines and
// files are reported and kept, never deleted: they may be the only record of a running pod.
func Load(dir string) (Loaded, []error) {
	return journal{dir: dir}.load()
}

func (j journal) load() (Loaded, []error) {
	if j.dir == "" {
		return Loaded{}, nil
	}
	pods, legacy, errs := j.loadLegacy()
	out := Loaded{legacy: legacy, lines: map[string][]byte{}}
	b, err := os.ReadFile(filepath.Join(j.dir, JournalFile))
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		errs = append(errs, fmt.Errorf("read journal: %w", err))
		out.unreadable = true
	default:
		var lines [][]byte // complete lines, each with its newline
		for len(b) > 0 {
			i := bytes.IndexByte(b, '\n')
			if i < 0 {
				out.torn = true
				// The writer cuts a failed append back to the last whole line, so this is a
				// stop in the middle of an append, or a failed one that could not be cut back.
				errs = append(errs, fmt.Errorf("journal %s: skipping a partly written last line (the agent stopped while appending it, "+
					"or an append failed and could not be cut back, which the agent logged as \"journal write failed\")",
					filepath.Join(j.dir, JournalFile)))
				break
			}
			lines, b = append(lines, b[:i+1]), b[i+1:]
		}
		type decoded struct {
			l   journalLine
			err error
		}
		// Decode on every CPU, then replay in order.
		for n, d := range parallel.Map(len(lines), func(i int) (d decoded) {
			d.err = json.Unmarshal(lines[i], &d.l)
			switch {
			case d.err == nil && (d.l.Put == nil) == (d.l.Del == ""):
				d.err = errors.New("neither a put nor a del")
			case d.err == nil && d.l.Put != nil:
				d.err = d.l.Put.validate()
			}
			return d
		}) {
			switch {
			case d.err != nil:
				errs = append(errs, fmt.Errorf("journal %s: line %d is unreadable (%v); keeping the file aside", filepath.Join(j.dir, JournalFile), n+1, d.err))
				out.unreadable = true
			case d.l.Put != nil:
				pods[d.l.Put.Owner] = *d.l.Put
				out.lines[d.l.Put.Owner] = lines[n]
			default:
				delete(pods, d.l.Del)
				delete(out.lines, d.l.Del)
			}
		}
		out.nlines = len(lines)
	}
	for _, owner := range slices.Sorted(maps.Keys(pods)) {
		ps := pods[owner]
		if id, err := keyspace.ParseLeaseHex(ps.LeaseID); err == nil {
			ps.lease.id = id
		}
		out.Pods = append(out.Pods, ps)
	}
	return out, errs
}

// loadLegacy reads the per-pod files of earlier versions, on every CPU.
func (j journal) loadLegacy() (map[string]PodState, []string, []error) {
	pods := map[string]PodState{}
	entries, err := os.ReadDir(j.dir)
	if err != nil {
		return pods, nil, []error{fmt.Errorf("read journal %s: %w", j.dir, err)}
	}
	entries = slices.DeleteFunc(entries, func(e fs.DirEntry) bool { return e.IsDir() || !strings.HasSuffix(e.Name(), journalExt) })
	type slot struct {
		ps  PodState
		err error
	}
	slots := parallel.Map(len(entries), func(i int) (s slot) {
		s.ps, s.err = j.loadLegacyFile(entries[i].Name())
		return s
	})
	var legacy []string
	var errs []error
	for i, s := range slots {
		if s.err != nil {
			errs = append(errs, s.err)
			continue
		}
		pods[s.ps.Owner] = s.ps
		legacy = append(legacy, entries[i].Name())
	}
	return pods, legacy, errs
}

func (j journal) loadLegacyFile(name string) (PodState, error) {
	b, err := os.ReadFile(filepath.Join(j.dir, name))
	if err != nil {
		return PodState{}, err
	}
	var ps PodState
	err = json.Unmarshal(b, &ps)
	if err == nil {
		err = ps.validate()
	}
	if err != nil || legacyName(ps.Owner) != name {
		return PodState{}, fmt.Errorf("journal file %s is unreadable (%v); leaving it", name, err)
	}
	return ps, nil
}

// validate checks the names a re-claim turns into keys, as an ADD checks them: the journal
// is the agent's own file, but a damaged one must not become keys of another shape.
func (ps *PodState) validate() error {
	if err := keyspace.ValidateNames("owner", ps.Owner); err != nil {
		return err
	}
	for _, at := range ps.Attachments {
		if err := keyspace.ValidateNames("interface name", at.IfName, "pool", at.Pool, "container ID", at.ContainerID); err != nil {
			return err
		}
	}
	return nil
}

// legacyName is the per-pod file of earlier versions: the owner, or a hash of a long one.
func legacyName(owner string) string {
	if len(owner) <= 200 {
		return owner + journalExt
	}
	sum := sha256.Sum256([]byte(owner))
	return "h-" + hex.EncodeToString(sum[:16]) + journalExt
}
