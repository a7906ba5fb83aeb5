package podbook

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

func quietLog() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError + 1}))
}

func testPod(owner string, lease clientv3.LeaseID, ip string) PodState {
	ps := PodState{Owner: owner, NodeUID: "uid1", Netns: "/run/netns/" + owner,
		Attachments: []Attachment{{IfName: "eth0", Pool: "p", Network: "n", ContainerID: "ctr-1", IPs: []netip.Addr{netip.MustParseAddr(ip)}}}}
	ps.hold(lease)
	return ps
}

func owners(pods []PodState) string {
	var s []string
	for _, ps := range pods {
		s = append(s, ps.Owner+"="+ps.Attachments[0].IPs[0].String())
	}
	return strings.Join(s, ",")
}

func openJournal(t *testing.T, dir string) (*Writer, Loaded) {
	t.Helper()
	l, errs := journal{dir: dir}.load()
	if len(errs) > 0 {
		t.Fatalf("load: %v", errs)
	}
	w := NewWriter(dir, quietLog())
	w.Start(l)
	return w, l
}

// TestJournalReplaysPutsAndDels: the newest state of each pod survives a restart of the
// writer, forgotten pods stay forgotten, and a long run of changes is compacted.
func TestJournalReplaysPutsAndDels(t *testing.T) {
	dir := t.TempDir()
	w, _ := openJournal(t, dir)
	for i := range 300 {
		w.save(testPod(fmt.Sprintf("pod-%d", i%30), clientv3.LeaseID(i+1), fmt.Sprintf("10.0.%d.%d", i/250, i%250+1)))
		if i%50 == 0 {
			time.Sleep(2 * flushEvery) // let the writer append, so that the journal grows
		}
	}
	w.Remove("pod-3")
	w.Remove("pod-never-saved")
	time.Sleep(2 * flushEvery)
	long := strings.Repeat("x", 253)
	w.save(testPod(long, 9999, "10.9.9.9"))
	w.Close()

	l, errs := journal{dir: dir}.load()
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	if len(l.Pods) != 30 { // 29 of the 30, and the long owner
		t.Fatalf("got %d pods: %s", len(l.Pods), owners(l.Pods))
	}
	for _, ps := range l.Pods {
		if ps.Owner == "pod-3" {
			t.Error("a removed pod came back")
		}
		if ps.Owner == "pod-7" && (ps.Attachments[0].IPs[0] != netip.MustParseAddr("10.0.1.28") || ps.lease.id != 278) {
			t.Errorf("pod-7: want its newest state (10.0.1.28 on lease 278), got %v on %d", ps.Attachments[0].IPs, ps.lease.id)
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, JournalFile))
	if n := bytes.Count(b, []byte{'\n'}); n > 2*30+64 {
		t.Errorf("journal has %d lines for 30 pods: never compacted", n)
	}
}

// TestJournalFoldsInPerPodFilesOfEarlierVersions: an upgrade reads the old <owner>.json
// files, writes them into the journal, and deletes them; an unreadable one is left alone.
func TestJournalFoldsInPerPodFilesOfEarlierVersions(t *testing.T) {
	dir := t.TempDir()
	for i, owner := range []string{"old-a", "old-b", strings.Repeat("y", 240)} {
		b, _ := json.Marshal(testPod(owner, clientv3.LeaseID(i+1), fmt.Sprintf("10.1.0.%d", i+1)))
		if err := os.WriteFile(filepath.Join(dir, legacyName(owner)), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(dir, "broken.json"), []byte("{not json"), 0o600)
	l, errs := journal{dir: dir}.load()
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "broken.json") {
		t.Fatalf("want one error naming broken.json, got %v", errs)
	}
	w := NewWriter(dir, quietLog())
	w.Start(l)
	w.save(testPod("new-c", 7, "10.1.0.9"))
	w.Close()
	entries, _ := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if got := strings.Join(names, ","); got != "broken.json,journal" {
		t.Errorf("state dir after the upgrade: %s; want broken.json,journal", got)
	}
	l, _ = journal{dir: dir}.load()
	if got := owners(l.Pods); got != "new-c=10.1.0.9,old-a=10.1.0.1,old-b=10.1.0.2,"+strings.Repeat("y", 240)+"=10.1.0.3" {
		t.Errorf("after the upgrade: %s", got)
	}
}

// TestJournalSurvivesATornAppendAndKeepsUnreadableLines: a crash in the middle of an append
// loses only that line; a damaged line in the middle is reported, and the file is kept aside
// rather than compacted away.
func TestJournalSurvivesATornAppendAndKeepsUnreadableLines(t *testing.T) {
	dir := t.TempDir()
	w, _ := openJournal(t, dir)
	w.save(testPod("a", 1, "10.2.0.1"))
	w.save(testPod("b", 2, "10.2.0.2"))
	w.Close()
	path := filepath.Join(dir, JournalFile)
	f, _ := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	f.WriteString(`{"put":{"owner":"c","nodeUID":"ui`)
	f.Close()
	l, errs := journal{dir: dir}.load()
	if owners(l.Pods) != "a=10.2.0.1,b=10.2.0.2" || len(errs) != 1 || !strings.Contains(errs[0].Error(), "partly written") || l.unreadable {
		t.Fatalf("torn append: pods %s, errors %v, unreadable %v", owners(l.Pods), errs, l.unreadable)
	}
	// The next writer does not append to the fragment: what it writes reads back whole.
	w = NewWriter(dir, quietLog())
	w.Start(l)
	w.save(testPod("d", 4, "10.2.0.4"))
	w.Close()
	if l, errs := (journal{dir: dir}).load(); len(errs) != 0 || owners(l.Pods) != "a=10.2.0.1,b=10.2.0.2,d=10.2.0.4" {
		t.Fatalf("after a torn append and a restart: pods %s, errors %v", owners(l.Pods), errs)
	}

	os.WriteFile(path, []byte(`{"put":{"owner":"a","nodeUID":"uid1","leaseID":"1","attachments":[{"ifName":"eth0","pool":"p","containerID":"c1","ips":["10.2.0.1"]}]}}`+"\ngarbage\n"), 0o600)
	l, errs = journal{dir: dir}.load()
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "line 2") || !l.unreadable || len(l.Pods) != 1 {
		t.Fatalf("damaged line: pods %d, errors %v, unreadable %v", len(l.Pods), errs, l.unreadable)
	}
	w = NewWriter(dir, quietLog())
	w.Start(l)
	w.Close()
	aside, _ := filepath.Glob(path + ".unreadable-*")
	if len(aside) != 1 {
		t.Fatalf("the damaged journal was not kept aside: %v", aside)
	}
	if b, _ := os.ReadFile(aside[0]); !bytes.Contains(b, []byte("garbage")) {
		t.Error("the kept file lost its content")
	}
	if l, errs := (journal{dir: dir}).load(); len(errs) != 0 || len(l.Pods) != 1 {
		t.Errorf("the new journal: %d pods, %v", len(l.Pods), errs)
	}
}
