//go:build linux

package podbook

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/smalldisk"
	"github.com/leasehold/leasehold/internal/syncbuf"
)

// journalIs is a condition for etcdtest.Eventually: that the journal in dir lists owners want.
func journalIs(dir string, want []string) func() error {
	return func() error {
		got, errs := journalOwners(dir)
		return etcdtest.Saw(slices.Equal(got, want), "the journal lists %v (load errors %v), want %v", got, errs, want)
	}
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
			disk := smalldisk.New(t)
			var logs syncbuf.Log
			w := NewWriter(disk.Dir, logs.Logger(slog.LevelWarn))
			w.Start(Loaded{})
			t.Cleanup(w.Close)
			var want []string
			for i := range tc.before {
				want = append(want, fmt.Sprintf("before-%d", i))
				w.save(testPod(want[i], clientv3.LeaseID(i+1), fmt.Sprintf("10.3.0.%d", i+1)))
			}
			etcdtest.Eventually(t, "the pods saved before the disk fills are journaled", journalIs(disk.Dir, want))
			journaled := slices.Clone(want)

			disk.Fill(t)
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
			got, errs := journalOwners(disk.Dir)
			if len(errs) > 0 || !slices.Equal(got, journaled) {
				t.Errorf("journal while the disk is full: %v, load reported %v; want %v and nothing reported (no partial line)", got, errs, journaled)
			}
			if _, err := os.Stat(filepath.Join(disk.Dir, JournalFile+".tmp")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a failed rewrite left its partial copy: %v", err)
			}

			disk.Free(t) // no further change: the writer's own retry must write them
			etcdtest.Eventually(t, "the pods saved while the disk was full reach the journal", journalIs(disk.Dir, want))
			// The writer reports itself healthy before it logs the recovery: wait for the line too.
			etcdtest.Eventually(t, "the journal reports itself healthy", func() error {
				if err := w.Health(); err != nil {
					return err
				}
				n := logs.Count(journalRecoveredMsg)
				return etcdtest.Saw(n == 1, "the recovery logged %d lines; want 1", n)
			})
			if _, errs := journalOwners(disk.Dir); len(errs) > 0 {
				t.Errorf("load after the recovery reported %v", errs)
			}
			if n := logs.Count(journalFailedMsg); n != 1 {
				t.Errorf("%d failed attempts logged %d lines; want 1 (the first; then one a minute)", w.Failures(), n)
			}

			// Appends go on after the recovery.
			w.save(testPod("after", 999, "10.3.2.1"))
			want = append(want, "after")
			slices.Sort(want)
			etcdtest.Eventually(t, "a pod saved after the recovery is journaled", journalIs(disk.Dir, want))
		})
	}
}
