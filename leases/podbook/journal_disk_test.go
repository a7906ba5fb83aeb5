//go:build linux

package podbook

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
)

// smallDisk is a 64 KiB tmpfs, so that the journal meets a real ENOSPC: fill takes its
// last free byte, free gives the room back.
type smallDisk struct{ dir, filler string }

func newSmallDisk(t *testing.T) *smallDisk {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,mode=0700"); err != nil {
		t.Skipf("mount a tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() { // after the agents' and writers' cleanups, registered later
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	// The filler lives outside the state directory: the journal must not see it.
	state := filepath.Join(dir, "state")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}
	return &smallDisk{dir: state, filler: filepath.Join(dir, "filler")}
}

func (d *smallDisk) fill(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(d.filler, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4096)
	for {
		if _, err := f.Write(buf); errors.Is(err, syscall.ENOSPC) {
			return
		} else if err != nil {
			t.Fatalf("fill the disk: %v", err)
		}
	}
}

func (d *smallDisk) free(t *testing.T) {
	t.Helper()
	if err := os.Remove(d.filler); err != nil {
		t.Fatal(err)
	}
}

// journalIs is a condition for etcdtest.Eventually: that the journal in dir lists owners want.
func journalIs(dir string, want []string) func() error {
	return func() error {
		got, errs := journalOwners(dir)
		return etcdtest.Saw(slices.Equal(got, want), "the journal lists %v (load errors %v), want %v", got, errs, want)
	}
}

// logLines is a slog handler's output, safe to read while the writer logs.
type logLines struct{ syncbuf.Buffer }

func (l *logLines) count(msg string) int {
	return strings.Count(l.String(), fmt.Sprintf("msg=%q", msg))
}

func (l *logLines) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

const (
	journalFailedMsg    = "journal write failed; re-claim after a lease loss may miss pods"
	journalRecoveredMsg = "journal written again after failed writes; it holds every pod"
)

// journalOwners loads the journal in dir: its owners, and what load reported.
func journalOwners(dir string) ([]string, []error) {
	l, errs := Load(dir)
	var out []string
	for _, ps := range l.Pods {
		out = append(out, ps.Owner)
	}
	return out, errs
}

// TestJournalWriterRecoversFromAFullDisk: changes saved while the state disk is full are
// kept, retried without any further change, and written once the disk has room again; while
// the disk is full the journal reads back whole (a failed append is cut back, a failed rewrite
// leaves no partial copy), and the failure is logged once and reported until it ends.
func TestJournalWriterRecoversFromAFullDisk(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before int // pods journaled before the disk fills
	}{
		// The journal exists: the pods of the full disk are one append, bigger than the
		// room left in the file's last page, so the write is short, then ENOSPC.
		{"append", 1},
		// No journal yet: the first write is a rewrite (journal.tmp, renamed), which fails.
		{"rewrite", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			disk := newSmallDisk(t)
			var logs logLines
			w := NewWriter(disk.dir, logs.logger())
			w.Start(Loaded{})
			t.Cleanup(w.Close)
			var want []string
			for i := range tc.before {
				want = append(want, fmt.Sprintf("before-%d", i))
				w.save(testPod(want[i], clientv3.LeaseID(i+1), fmt.Sprintf("10.3.0.%d", i+1)))
			}
			etcdtest.Eventually(t, "the pods saved before the disk fills are journaled", journalIs(disk.dir, want))
			journaled := slices.Clone(want)

			disk.fill(t)
			for i := range 40 {
				owner := fmt.Sprintf("full-%02d", i)
				want = append(want, owner)
				w.save(testPod(owner, clientv3.LeaseID(100+i), fmt.Sprintf("10.3.1.%d", i+1)))
			}
			etcdtest.Eventually(t, "the write fails and is retried", func() error {
				err, n := w.Health(), w.Failures()
				return etcdtest.Saw(err != nil && n >= 2, "health %v after %d failures", err, n)
			})
			if err := w.Health(); !errors.Is(err, ErrJournalUnwritable) || !errors.Is(err, syscall.ENOSPC) {
				t.Errorf("health while the disk is full: want ErrJournalUnwritable wrapping ENOSPC, got %v", err)
			}
			got, errs := journalOwners(disk.dir)
			if len(errs) > 0 || !slices.Equal(got, journaled) {
				t.Errorf("journal while the disk is full: %v, load reported %v; want %v and nothing reported (no partial line)", got, errs, journaled)
			}
			if _, err := os.Stat(filepath.Join(disk.dir, JournalFile+".tmp")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a failed rewrite left its partial copy: %v", err)
			}

			disk.free(t) // no further change: the writer's own retry must write them
			etcdtest.Eventually(t, "the pods saved while the disk was full reach the journal", journalIs(disk.dir, want))
			// The writer reports itself healthy before it logs the recovery: wait for the line too.
			etcdtest.Eventually(t, "the journal reports itself healthy", func() error {
				if err := w.Health(); err != nil {
					return err
				}
				n := logs.count(journalRecoveredMsg)
				return etcdtest.Saw(n == 1, "the recovery logged %d lines; want 1", n)
			})
			if _, errs := journalOwners(disk.dir); len(errs) > 0 {
				t.Errorf("load after the recovery reported %v", errs)
			}
			if n := logs.count(journalFailedMsg); n != 1 {
				t.Errorf("%d failed attempts logged %d lines; want 1 (the first; then one a minute)", w.Failures(), n)
			}

			// Appends go on after the recovery.
			w.save(testPod("after", 999, "10.3.2.1"))
			want = append(want, "after")
			slices.Sort(want)
			etcdtest.Eventually(t, "a pod saved after the recovery is journaled", journalIs(disk.dir, want))
		})
	}
}
