package adopt

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

func write(t *testing.T, dir, name, content string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

var (
	a4  = netip.MustParseAddr
	cid = strings.Repeat("ab", 32) // a container ID as runtimes make them
)

// TestHostLocalReadsTheDirectoryAsHostLocalWritesIt covers host-local's files: the current
// format (container ID, CRLF, interface), the old one (container ID alone), IPv6 names, and the
// lock and last_reserved_ip files and strays that are skipped.
func TestHostLocalReadsTheDirectoryAsHostLocalWritesIt(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "10.1.0.5", cid+"\r\neth0")
	write(t, dir, "fd01::5", cid+"\r\neth0")
	write(t, dir, "10.1.0.9", cid+"\r\nnet1")
	write(t, dir, "10.1.0.6", "old-container\n") // an older host-local: the ID alone
	write(t, dir, "lock", "")
	write(t, dir, "last_reserved_ip.0", "10.1.0.9")
	write(t, dir, "last_reserved_ip.1", "fd01::5")
	write(t, dir, "notes.txt", "not an allocation")
	if err := os.Mkdir(filepath.Join(dir, "10.1.0.200"), 0o700); err != nil {
		t.Fatal(err)
	}
	recs, skipped, err := HostLocal(dir, "net1")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{filepath.Join(dir, "10.1.0.200"), filepath.Join(dir, "notes.txt")}; !reflect.DeepEqual(skipped, want) {
		t.Errorf("skipped %v, want %v", skipped, want)
	}
	got := map[netip.Addr]string{}
	for _, r := range recs {
		got[r.Addr] = r.ContainerID + "/" + r.IfName
		if r.Where != filepath.Join(dir, r.Addr.String()) {
			t.Errorf("%s: Where %q", r.Addr, r.Where)
		}
	}
	want := map[netip.Addr]string{a4("10.1.0.5"): cid + "/eth0", a4("fd01::5"): cid + "/eth0", a4("10.1.0.9"): cid + "/net1",
		a4("10.1.0.6"): "old-container/"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("records %v, want %v", got, want)
	}

	ats := Group(recs, "")
	wantAts := []struct {
		container, ifName string
		ips               []netip.Addr
	}{
		{cid, "eth0", []netip.Addr{a4("10.1.0.5"), a4("fd01::5")}},
		{cid, "net1", []netip.Addr{a4("10.1.0.9")}},
		{"old-container", "eth0", []netip.Addr{a4("10.1.0.6")}}, // no interface named: the default
	}
	if len(ats) != len(wantAts) {
		t.Fatalf("attachments %+v, want %d", ats, len(wantAts))
	}
	for i, w := range wantAts {
		at := ats[i]
		if at.ContainerID != w.container || at.IfName != w.ifName || !reflect.DeepEqual(at.IPs, w.ips) || at.Owner() != w.container {
			t.Errorf("attachment %d: %+v (owner %s), want %+v", i, at, at.Owner(), w)
		}
	}
	if ats := Group(recs, "net9"); ats[2].IfName != "net9" {
		t.Errorf("with default interface net9, the old file's attachment is on %s", ats[2].IfName)
	}
}

// TestHostLocalRefusesWhatItCannotRead: an address file that names no usable container is an
// error naming the file, never skipped (it may be a running container's address); so is
// host-local's dataDir given for the network's directory, from which nothing would be read.
func TestHostLocalRefusesWhatItCannotRead(t *testing.T) {
	for name, content := range map[string]string{
		"empty":              "",
		"not a key part":     "bad/id\r\neth0",
		"bad interface":      cid + "\r\neth 0",
		"too long to be one": strings.Repeat("a", maxHostLocalFile+1),
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			write(t, dir, "10.1.0.5", content)
			_, _, err := HostLocal(dir, "net1")
			if err == nil || !strings.Contains(err.Error(), filepath.Join(dir, "10.1.0.5")) {
				t.Errorf("want an error naming the file, got %v", err)
			}
		})
	}
	_, _, err := HostLocal(filepath.Join(t.TempDir(), "missing"), "net1")
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "dataDir") {
		t.Errorf("a missing directory: want ErrNotExist and where host-local keeps its files, got %v", err)
	}
	// host-local's dataDir given for the network's directory: it would import nothing.
	data := t.TempDir()
	write(t, filepath.Join(data, "other"), "10.1.0.5", cid+"\r\neth0")
	write(t, filepath.Join(data, "net1"), "10.1.0.5", cid+"\r\neth0")
	_, _, err = HostLocal(data, "net1")
	if err == nil || !strings.Contains(err.Error(), "give the network's own directory, "+filepath.Join(data, "net1")) {
		t.Errorf("dataDir given for the network's directory: want an error naming %s, got %v", filepath.Join(data, "net1"), err)
	}
}

const ipPools = `{
  "apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
  "items": [
    {"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
     "metadata": {"name": "10.2.0.0-24", "namespace": "kube-system"},
     "spec": {"range": "10.2.0.0/24", "allocations": {
        "5": {"id": "c1", "podref": "ns/p1", "ifname": "net1"},
        "6": {"id": "c2", "podref": "ns/p2"},
        "7": {"id": "c3"}}}},
    {"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
     "metadata": {"name": "fd02--48", "namespace": "kube-system"},
     "spec": {"range": "fd02::/48", "allocations": {
        "18446744073709551621": {"id": "c1", "podref": "ns/p1", "ifname": "net1"},
        "4096": {"id": "c2", "podref": "ns/p2"}}}}
  ]
}`

// TestWhereaboutsReadsOffsetsIntoTheRange covers a List of IPPools: IPv4 offsets, IPv6 offsets
// past 64 bits, podrefs and interfaces, then OnNode with this node's pods.
func TestWhereaboutsReadsOffsetsIntoTheRange(t *testing.T) {
	recs, err := Whereabouts([]byte(ipPools), "pools.json")
	if err != nil {
		t.Fatal(err)
	}
	got := map[netip.Addr]string{}
	for _, r := range recs {
		got[r.Addr] = fmt.Sprintf("%s/%s %s/%s", r.ContainerID, r.IfName, r.Pod.Namespace, r.Pod.Name)
	}
	want := map[netip.Addr]string{
		a4("10.2.0.5"):      "c1/net1 ns/p1",
		a4("10.2.0.6"):      "c2/ ns/p2",
		a4("10.2.0.7"):      "c3/ /",
		a4("fd02:0:0:1::5"): "c1/net1 ns/p1", // 2^64 + 5
		a4("fd02::1000"):    "c2/ ns/p2",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("records %v, want %v", got, want)
	}

	pods, nodes, err := Pods([]byte(`{"kind": "List", "items": [
		{"kind": "Pod", "metadata": {"namespace": "ns", "name": "p1", "uid": "uid-1"}, "spec": {"nodeName": "node-a"}},
		{"kind": "Pod", "metadata": {"namespace": "ns", "name": "p2", "uid": "uid-2"}, "spec": {"nodeName": "node-b"}},
		{"kind": "Pod", "metadata": {"namespace": "other", "name": "p2", "uid": "uid-9"}, "spec": {"nodeName": "node-a"}}]}`), "pods.json", "node-a")
	if err != nil {
		t.Fatal(err)
	}
	if len(pods) != 2 || pods["ns/p2"] != (allocator.PodRef{}) {
		t.Errorf("node-a's pods: %v; want ns/p1 and other/p2 only", pods)
	}
	if !reflect.DeepEqual(nodes, []string{"node-a", "node-b"}) {
		t.Errorf("the pods' nodes: %v; want node-a and node-b", nodes)
	}
	here, elsewhere := OnNode(recs, pods)
	if len(here) != 2 || len(elsewhere) != 3 {
		t.Fatalf("on this node %+v, elsewhere %+v; want p1's two addresses here", here, elsewhere)
	}
	ats := Group(here, "")
	if len(ats) != 1 || ats[0].Owner() != "uid-1" || ats[0].Pod != (allocator.PodRef{UID: "uid-1", Namespace: "ns", Name: "p1"}) ||
		!reflect.DeepEqual(ats[0].IPs, []netip.Addr{a4("10.2.0.5"), a4("fd02:0:0:1::5")}) {
		t.Errorf("p1's attachment: %+v", ats)
	}

	one := `{"kind": "IPPool", "metadata": {"name": "x"}, "spec": {"range": "10.3.0.0/16", "allocations": {"258": {"id": "c9", "podref": "a/b"}}}}`
	if recs, err := Whereabouts([]byte(one), "one.json"); err != nil || len(recs) != 1 || recs[0].Addr != a4("10.3.1.2") {
		t.Errorf("one IPPool: %+v, %v; want 10.3.1.2", recs, err)
	}
}

func TestWhereaboutsRefusesWhatItCannotRead(t *testing.T) {
	pool := func(rng, off, alloc string) string {
		return `{"kind": "IPPool", "metadata": {"name": "x"}, "spec": {"range": "` + rng + `", "allocations": {"` + off + `": ` + alloc + `}}}`
	}
	ok := `{"id": "c1", "podref": "a/b"}`
	for name, in := range map[string]string{
		"not JSON":             `{`,
		"a pod list":           `{"kind": "List", "items": [{"kind": "Pod", "metadata": {"name": "p"}}]}`,
		"a Pod":                `{"kind": "Pod"}`,
		"range not a CIDR":     pool("10.2.0.0", "1", ok),
		"negative offset":      pool("10.2.0.0/24", "-1", ok),
		"offset not a number":  pool("10.2.0.0/24", "x1", ok),
		"offset with a sign":   pool("10.2.0.0/24", "+1", ok),
		"offset past range":    pool("10.2.0.0/24", "256", ok),
		"offset past IPv6":     pool("ffff::/16", "5192296858534827628530496329220096", ok),
		"no container ID":      pool("10.2.0.0/24", "1", `{"podref": "a/b"}`),
		"container ID not key": pool("10.2.0.0/24", "1", `{"id": "a/b", "podref": "a/b"}`),
	} {
		t.Run(name, func(t *testing.T) {
			if recs, err := Whereabouts([]byte(in), "f.json"); err == nil || !strings.HasPrefix(err.Error(), "f.json: ") {
				t.Errorf("want an error naming the file, got %v (%+v)", err, recs)
			}
		})
	}
	for name, in := range map[string]string{
		"no uid":  `{"kind": "List", "items": [{"metadata": {"namespace": "a", "name": "b"}}]}`,
		"no name": `{"kind": "List", "items": [{"metadata": {"uid": "u"}}]}`,
		"ippools": ipPools,
	} {
		if _, _, err := Pods([]byte(in), "p.json", ""); err == nil {
			t.Errorf("pods %s: want an error", name)
		}
	}
}
