package admin

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// Issue 32: doctor says what is true of a running pod whose keys etcd no longer holds (an
// admin's etcdctl del), and of truly expired addresses. In blockWorld, pod ns/web (owner u-web)
// runs on node c1/n1: its pod record and owner index are on the pod lease, which its agent
// renews, and its held keys are on n1's block lease.

// TestDoctorRunningPodKeysMissing seeds one deletion per row and checks the one finding that
// tells of the address: an error with its fix while the pod runs, never also called expired;
// information, with true text for a live and a gone agent, once no key of the pod is left.
func TestDoctorRunningPodKeysMissing(t *testing.T) {
	cli := privateEtcd(t)
	ip := netip.MustParseAddr
	other := keyspace.HeldKey(wPool, allocator.DefaultBlocks, ip("10.77.0.33"))
	tests := []struct {
		name     string
		seed     func(t *testing.T, w *blockWorld)
		kind     string
		severity string
		key      func(w *blockWorld) string
		fix      func(w *blockWorld) string // contained in the finding's fix; "" wants no fix
		says     []string
		notSays  []string
		// notExpired are held keys no address-expired finding may name: their pod runs.
		notExpired func(w *blockWorld) []string
	}{
		// The case: `etcdctl del` of a running pod's allocation key. The owner index still
		// names the address: one error, which says the agent puts it back and restores it at once.
		{name: "allocation of a running pod deleted", kind: KindOwnerNoAlloc, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { w.del(t, w.ip4) },
			key:  func(w *blockWorld) string { return w.ip4 },
			fix: func(w *blockWorld) string {
				return `'create("` + w.ip4 + `") = "0"'`
			},
			says: []string{"pod ns/web", "node c1/n1", "10.77.0.10", "still runs", "only its held key", "half a lease TTL", podKeysLostLog, podKeysLostMetric,
				"lease " + "%POD%"},
			notSays:    []string{"Nothing to do", "expired"},
			notExpired: func(w *blockWorld) []string { return []string{w.held4} }},
		// Its held key deleted too: nothing keeps the address from the next ADD, and the message says so.
		{name: "allocation and held key of a running pod deleted", kind: KindOwnerNoAlloc, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { w.del(t, w.ip6); w.del(t, w.held6) },
			key:  func(w *blockWorld) string { return w.ip6 },
			fix:  func(w *blockWorld) string { return `'create("` + w.ip6 + `") = "0"'` },
			says: []string{"fd77::10", "no held key keeps it back", "the next ADD may give it to another pod"}},
		// Allocations and owner index deleted, the pod record left on the pod's lease: only the held
		// keys name the addresses. The owner index (the interface) cannot be rebuilt from etcd, so
		// the fix revokes the pod's lease: the agent re-claims the pod from its journal.
		{name: "allocations and owner index of a running pod deleted", kind: KindPodAddrMissing, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { w.del(t, w.ip4); w.del(t, w.ip6); w.del(t, w.owner) },
			key:  func(w *blockWorld) string { return w.held4 },
			fix:  func(w *blockWorld) string { return "etcdctl lease revoke %POD%" },
			says: []string{"10.77.0.10, fd77::10", "pod ns/web", "node c1/n1", "%PODKEY%", "half a lease TTL", podKeysLostLog, podKeysLostMetric,
				"re-claims every address of the pod"},
			notSays:    []string{"Nothing to do", "expired", "other attachments"},
			notExpired: func(w *blockWorld) []string { return []string{w.held4, w.held6} }},
		// The pod record gone as well, but an owner index of the pod on the node (another interface)
		// is on a live lease: the pod still runs.
		{name: "running pod known by another interface's owner index", kind: KindPodAddrMissing, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				w.del(t, w.ip4)
				w.del(t, w.ip6)
				w.del(t, w.owner)
				w.del(t, w.podKey)
				put(t, w.cli, keyspace.OwnerKey(wCluster, "u-web", "net1", wPool), keyspace.Encode(keyspace.OwnerRecord{ContainerID: "ctr",
					Network: wPool, Node: wNode, NodeUID: wUID, LeaseID: keyspace.LeaseHex(w.pod)}), w.pod)
			},
			key:        func(w *blockWorld) string { return keyspace.OwnerKey(wCluster, "u-web", "net1", wPool) },
			fix:        func(w *blockWorld) string { return "etcdctl lease revoke %POD%" },
			says:       []string{"other attachments", "wait for the agent"},
			notExpired: func(w *blockWorld) []string { return []string{w.held4, w.held6} }},
		// Truly expired: the pod's lease ran out, so no key of the pod is left but the held keys.
		// The agent is back: information, and the text says what it does and when.
		{name: "expired addresses, agent back", kind: KindAddressExpired, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) { w.expire(t) },
			key:  func(w *blockWorld) string { return w.held4 },
			fix:  func(*blockWorld) string { return "" },
			says: []string{"are expired", "has an agent again", "re-claims the addresses of its pods still running", "half a lease TTL",
				"frees the held keys of its pods that are gone", heldFreedLog, "Nothing to do", "another node UID"},
			notSays: []string{"the others it frees"}},
		// The same with the agent gone: held back until the block lease expires; forget frees them.
		{name: "expired addresses, agent gone", kind: KindAddressExpired, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) {
				w.expire(t)
				w.del(t, keyspace.NodeKey(wCluster, wNode))
			},
			key: func(w *blockWorld) string { return w.held6 },
			fix: func(*blockWorld) string { return "leaseholdctl node forget n1 --cluster c1" },
			says: []string{"no agent", "cut off from etcd or dead", "held back until block lease", "re-claims the addresses of its pods still running",
				"Nothing to do"}},
		// A held key of another owner of the node, gone, beside a running pod: the running pod is no
		// evidence for another owner's address.
		{name: "expired address of another pod of a node whose pods run", kind: KindAddressExpired, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, other, heldValue(wCluster, wNode, "u-gone"), w.blockL)
			},
			key:  func(*blockWorld) string { return other },
			fix:  func(*blockWorld) string { return "" },
			says: []string{"1 address(es)", "10.77.0.33"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newBlockWorld(t, cli)
			if fs := w.check(t); len(fs) != 0 {
				t.Fatalf("findings on a healthy state: %+v", fs)
			}
			tt.seed(t, w)
			fs := w.check(t)
			f := findingOf(fs, tt.kind, tt.key(w))
			if f == nil {
				t.Fatalf("no %s finding for %s in %+v", tt.kind, tt.key(w), fs)
			}
			subst := strings.NewReplacer("%POD%", keyspace.LeaseHex(w.pod), "%PODKEY%", w.podKey)
			want := subst.Replace(tt.fix(w))
			if f.Severity != tt.severity || !strings.Contains(f.Fix, want) || (want == "" && f.Fix != "") {
				t.Errorf("finding %+v: want severity %s and a fix containing %q", *f, tt.severity, want)
			}
			for _, s := range tt.says {
				if s = subst.Replace(s); !strings.Contains(f.Message, s) {
					t.Errorf("message %q does not say %q", f.Message, s)
				}
			}
			for _, s := range tt.notSays {
				if strings.Contains(f.Message, s) {
					t.Errorf("message %q says %q", f.Message, s)
				}
			}
			// Doctor fails (exit 3) exactly when the pod runs without its keys.
			problem := slices.ContainsFunc(fs, Finding.Problem)
			if problem != (tt.severity == SeverityError) {
				t.Errorf("doctor fails: %v, want %v: %+v", problem, tt.severity == SeverityError, fs)
			}
			if tt.notExpired == nil {
				return
			}
			for _, k := range tt.notExpired(w) {
				if e := findingOf(fs, KindAddressExpired, k); e != nil {
					t.Errorf("the address of a running pod is also called expired: %+v", *e)
				}
			}
		})
	}
}

// TestDoctorRunningPodFixWithTheAgent runs the fix of running-pod-address-missing against a
// real agent: revoking the pod's lease makes it re-claim the pod's addresses on a new lease,
// and doctor is clean again, without a finding left for the pod.
func TestDoctorRunningPodFixWithTheAgent(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	if _, err := CreatePool(ctx, cli, adminPool("net", allocator.RangeSet{adminRange("10.80.0.0/24")})); err != nil {
		t.Fatal(err)
	}
	a := startAgentOn(t, cli, "c1", "n1", "uid-n1", 6*time.Second)
	res, err := a.Add(ctx, byName("net", "ctr", "u-web"))
	if err != nil {
		t.Fatal(err)
	}
	addr := res.IPs[0].Address.Addr()
	ipKey := keyspace.IPKey("net", allocator.DefaultBlocks, addr)
	owner := keyspace.OwnerKey("c1", "u-web", "eth0", "net")
	if fs := Check(readState(t, cli)); len(fs) != 0 {
		t.Fatalf("findings with a live agent and one pod: %+v", fs)
	}
	// As an admin would: etcdctl del of the allocation and the owner index.
	for _, k := range []string{ipKey, owner} {
		if _, err := cli.Delete(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	fs := Check(readState(t, cli))
	f := findingOf(fs, KindPodAddrMissing, keyspace.HeldKey("net", allocator.DefaultBlocks, addr))
	if f == nil || len(fs) != 1 {
		t.Fatalf("want one %s finding, got %+v", KindPodAddrMissing, fs)
	}
	runFix(t, cli, f.Fix)
	etcdtest.EventuallyTrue(t, "the agent re-claims the pod's address and doctor is clean", func() bool {
		st, err := ReadState(ctx, cli)
		if err != nil {
			return false
		}
		return len(Check(st)) == 0 && len(dumpKVs(t, cli, ipKey)) == 1 && len(dumpKVs(t, cli, owner)) == 1
	})
	if got := dumpKVs(t, cli, ipKey)[ipKey].value; !strings.Contains(got, `"owner":"u-web"`) {
		t.Errorf("allocation after the fix: %s", got)
	}
}

// runFix runs one doctor fix as an admin pastes it, with the etcdctl make tools builds
// (LEASEHOLD_BIN, or ../bin). Without one, a lease revoke goes through the client API, as
// that command does; any other fix skips the test.
func runFix(t *testing.T, cli *clientv3.Client, fix string) {
	t.Helper()
	for _, d := range []string{os.Getenv("LEASEHOLD_BIN"), "../bin"} {
		if d == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "etcdctl")); err != nil {
			continue
		}
		abs, _ := filepath.Abs(d)
		cmd := exec.Command("sh", "-c", fix)
		cmd.Env = append(os.Environ(), "ETCDCTL_ENDPOINTS="+cli.Endpoints()[0], "PATH="+abs+string(os.PathListSeparator)+os.Getenv("PATH"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("fix %q: %v: %s", fix, err, out)
		}
		return
	}
	hex, ok := strings.CutPrefix(fix, "etcdctl lease revoke ")
	if !ok {
		t.Skipf("no etcdctl (make tools) to run the fix %q", fix)
	}
	id, err := keyspace.ParseLeaseHex(hex)
	if err != nil {
		t.Fatalf("fix %q: %v", fix, err)
	}
	if _, err := cli.Revoke(etcdtest.Ctx(t), id); err != nil {
		t.Fatalf("fix %q: %v", fix, err)
	}
}

// TestHeldFindingsTellAnAddressAsDoctorDoes: leaseholdctl alloc show and pool show tell an
// address without allocation by HeldFindings, over alloc show's narrow read (FindAddress) or
// the whole state: each gives, for 10.77.0.10's held key, the finding Check reports of it,
// with its kind, severity and fix, so they say what doctor says.
func TestHeldFindingsTellAnAddressAsDoctorDoes(t *testing.T) {
	cli := privateEtcd(t)
	ip4 := netip.MustParseAddr("10.77.0.10")
	tests := []struct {
		name string
		seed func(t *testing.T, w *blockWorld)
		kind string
		// sameMessage: the narrow read names what the whole state does (one address of the pod).
		sameMessage bool
	}{
		{"allocation of a running pod deleted", func(t *testing.T, w *blockWorld) { w.del(t, w.ip4) }, KindOwnerNoAlloc, true},
		{"allocations and owner index of a running pod deleted", func(t *testing.T, w *blockWorld) {
			w.del(t, w.ip4)
			w.del(t, w.ip6)
			w.del(t, w.owner)
		}, KindPodAddrMissing, false},
		{"pod record gone too, another interface's owner index on the pod's lease", func(t *testing.T, w *blockWorld) {
			w.del(t, w.ip4)
			w.del(t, w.ip6)
			w.del(t, w.owner)
			w.del(t, w.podKey)
			put(t, w.cli, keyspace.OwnerKey(wCluster, "u-web", "net1", wPool), keyspace.Encode(keyspace.OwnerRecord{ContainerID: "ctr",
				Network: wPool, Node: wNode, NodeUID: wUID, LeaseID: keyspace.LeaseHex(w.pod)}), w.pod)
		}, KindPodAddrMissing, false},
		{"expired: no key of the pod left", func(t *testing.T, w *blockWorld) { w.expire(t) }, KindAddressExpired, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newBlockWorld(t, cli)
			if told := HeldFindings(readState(t, cli)); len(told) != 0 {
				t.Fatalf("held findings of a healthy state: %+v", told)
			}
			tt.seed(t, w)
			all := readState(t, cli)
			fs := Check(all)
			told, ok := HeldFindings(all)[w.held4]
			if !ok || told.Kind != tt.kind || findingOf(fs, told.Kind, told.Keys[0]) == nil {
				t.Fatalf("whole state: held finding %+v (ok %v), want the %s Check reports: %+v", told, ok, tt.kind, fs)
			}
			if f := findingOf(fs, told.Kind, told.Keys[0]); f.Message != told.Message || f.Fix != told.Fix {
				t.Errorf("held finding %+v is not Check's %+v", told, *f)
			}
			if told.KeysLost() != (tt.kind != KindAddressExpired) {
				t.Errorf("KeysLost %v for %s", told.KeysLost(), tt.kind)
			}
			st, err := FindAddress(etcdtest.Ctx(t), cli, "", ip4)
			if err != nil {
				t.Fatal(err)
			}
			narrow, ok := HeldFindings(st)[w.held4]
			if !ok || narrow.Kind != told.Kind || narrow.Severity != told.Severity || narrow.Fix != told.Fix ||
				(tt.sameMessage && narrow.Message != told.Message) {
				t.Errorf("alloc show's read: %+v (ok %v)\nwant as doctor: %+v", narrow, ok, told)
			}
		})
	}
}

// TestCheckOfANarrowReadReportsNoFalseAbsence: an owner index read without the allocation keys
// of its addresses is no evidence that they are gone (State.Covers).
func TestCheckOfANarrowReadReportsNoFalseAbsence(t *testing.T) {
	cli := privateEtcd(t)
	newBlockWorld(t, cli)
	st, err := ReadKeys(etcdtest.Ctx(t), cli, keyspace.OwnersPrefix(wCluster), keyspace.NodesPrefix(wCluster))
	if err != nil {
		t.Fatal(err)
	}
	if fs := Check(st); len(fs) != 0 {
		t.Errorf("findings of a healthy state read in part: %+v", fs)
	}
}
