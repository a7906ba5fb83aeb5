//go:build linux

package leases

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/smalldisk"
	"github.com/leasehold/leasehold/internal/syncbuf"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

// journalIs is a condition for etcdtest.Eventually: that the journal in dir lists owners want.
func journalIs(dir string, want []string) func() error {
	return func() error {
		got, errs := journalOwners(dir)
		return etcdtest.Saw(slices.Equal(got, want), "the journal lists %v (load errors %v), want %v", got, errs, want)
	}
}

const journalFailedMsg = "journal write failed; re-claim after a lease loss may miss pods"

// journalOwners loads the journal in dir: its owners, and what load reported.
func journalOwners(dir string) ([]string, []error) {
	l, errs := podbook.Load(dir)
	var out []string
	for _, ps := range l.Pods {
		out = append(out, ps.Owner)
	}
	return out, errs
}

// gauge reads one unlabelled metric of reg.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name || len(mf.GetMetric()) != 1 {
			continue
		}
		m := mf.GetMetric()[0]
		if m.GetGauge() != nil {
			return m.GetGauge().GetValue()
		}
		return m.GetCounter().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestPodsAddedWhileTheStateDiskWasFullAreReclaimed: ADDs succeed while the state disk is
// full; /readyz and the metrics report the journal meanwhile; once the disk has room the
// journal holds those pods without any further ADD, so that an agent that restarts after their
// leases were lost re-claims them (before, they were missing and their addresses stayed free
// in etcd while the pods used them).
func TestPodsAddedWhileTheStateDiskWasFullAreReclaimed(t *testing.T) {
	disk := smalldisk.New(t)
	cluster := etcdtest.Uniq("c")
	var logs syncbuf.Log
	withState := func(c *Config) { c.StateDir, c.Logger = disk.Dir, logs.Logger(slog.LevelWarn) }
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.17.0.0/24")}}}}
	ctx := ctxT(t)
	a := startAgent(t, cluster, "n1", "uid1", withState)
	if _, err := a.Add(ctx, addReq(pool, "ctr-before", "eth0", "uid-before")); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "the first pod is journaled", journalIs(disk.Dir, []string{"uid-before"}))
	if err := a.Ready(ctx); err != nil {
		t.Fatalf("ready before the disk fills: %v", err)
	}

	disk.Fill(t)
	want := []string{"uid-before"}
	for i := range 20 {
		owner := fmt.Sprintf("uid-full-%02d", i)
		if _, err := a.Add(ctx, addReq(pool, fmt.Sprintf("ctr-full-%02d", i), "eth0", owner)); err != nil {
			t.Fatalf("ADD while the state disk is full: %v (it must keep working)", err)
		}
		want = append(want, owner)
	}
	etcdtest.Eventually(t, "/readyz fails while the journal cannot be written", func() error {
		err := a.Ready(ctx)
		return etcdtest.Saw(errors.Is(err, ErrJournalUnwritable), "Ready: %v", err)
	})
	if err := a.Ready(ctx); !errors.Is(err, ErrNotReady) || !strings.Contains(err.Error(), "no space left") {
		t.Errorf("Ready while the disk is full: want ErrNotReady naming the cause, got %v", err)
	}
	if g := gauge(t, a.Metrics(), "leasehold_journal_healthy"); g != 0 {
		t.Errorf("leasehold_journal_healthy while the disk is full: %v, want 0", g)
	}
	if n := gauge(t, a.Metrics(), "leasehold_journal_write_failures_total"); n < 1 {
		t.Errorf("leasehold_journal_write_failures_total while the disk is full: %v, want at least 1", n)
	}
	if got, errs := journalOwners(disk.Dir); len(errs) > 0 || slices.Equal(got, want) {
		t.Errorf("journal while the disk is full: %v, load reported %v; want some pods missing and nothing reported", got, errs)
	}

	disk.Free(t) // and no ADD after it
	etcdtest.Eventually(t, "the pods added while the disk was full reach the journal", journalIs(disk.Dir, want))
	etcdtest.Eventually(t, "/readyz passes again", func() error { return a.Ready(ctx) })
	if g := gauge(t, a.Metrics(), "leasehold_journal_healthy"); g != 1 {
		t.Errorf("leasehold_journal_healthy after the recovery: %v, want 1", g)
	}
	if _, errs := journalOwners(disk.Dir); len(errs) > 0 {
		t.Errorf("load after the recovery reported %v", errs)
	}
	if n := logs.Count(journalFailedMsg); n != 1 {
		t.Errorf("the failure logged %d lines; want 1", n)
	}

	// The agent stops and its pods' leases are lost meanwhile (here revoked from outside);
	// the pods still run. The restarted agent knows them only from its journal.
	var lost []clientv3.LeaseID
	for _, owner := range want {
		id, ok := a.pods.Lease(owner)
		if !ok {
			t.Fatalf("pod %s holds no lease", owner)
		}
		lost = append(lost, id)
	}
	a.Close()
	cli := etcdtest.Client(t)
	for _, id := range lost {
		if _, err := cli.Revoke(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	owned := func(owner string) bool {
		resp, err := cli.Get(ctx, keyspace.OwnerKey(cluster, owner, "eth0", pool.Name))
		return err == nil && len(resp.Kvs) == 1
	}
	for _, owner := range want {
		if owned(owner) {
			t.Fatalf("pod %s's owner index outlived its revoked lease", owner)
		}
	}
	startAgent(t, cluster, "n1", "uid1", withState)
	etcdtest.Eventually(t, "every pod, also those added while the disk was full, is re-claimed", func() error {
		for _, owner := range want {
			if !owned(owner) {
				return fmt.Errorf("%s holds no address", owner)
			}
		}
		return nil
	})
}
