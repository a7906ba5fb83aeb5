package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// Issue 32: alloc show and pool show tell a running pod's address whose keys etcd lost (an
// admin's etcdctl del) from an expired one, as doctor does, with doctor's fix; and what they
// say the agent does, it does. A real agent of node c1/n1 with a journal adds pod "web" on an
// etcd of its own, then stops: its pod lease lives on for the TTL, so nothing puts the keys
// back until it starts again.

// lostWorld is that agent's pod, its keys and the journal the agent starts again from.
type lostWorld struct {
	ep, stateDir                string
	cli                         *clientv3.Client
	ip, ipKey, heldKey, ownerIx string
	podLease                    clientv3.LeaseID
}

func newLostWorld(t *testing.T) *lostWorld {
	t.Helper()
	srv, stop, err := etcdtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	w := &lostWorld{ep: srv.ClientURL, cli: etcdtest.ClientAt(t, srv.ClientURL), stateDir: t.TempDir()}
	if r := ctlAt(w.ep, "pool", "create", "net", "--range", "10.97.0.0/24"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	a := w.start(t)
	res := attach(t, a, "net", "web")
	addr := res.IPs[0].Address.Addr()
	w.ip = addr.String()
	w.ipKey = keyspace.IPKey("net", allocator.DefaultBlocks, addr)
	w.heldKey = keyspace.HeldKey("net", allocator.DefaultBlocks, addr)
	w.ownerIx = keyspace.OwnerKey("c1", "u-web", "eth0", "net")
	a.Close() // its pods' leases live on: a restart resumes them
	kv := keys(t, w.cli, w.ipKey)
	if len(kv) != 1 {
		t.Fatalf("allocation %s: %v", w.ipKey, kv)
	}
	resp, err := w.cli.Get(etcdtest.Ctx(t), w.ipKey)
	if err != nil {
		t.Fatal(err)
	}
	w.podLease = clientv3.LeaseID(resp.Kvs[0].Lease)
	return w
}

// start runs the agent of c1/n1 with its journal, a TTL of 20 s: it checks its pods' keys
// every 10 s, and at once when it starts.
func (w *lostWorld) start(t *testing.T) *leases.Agent {
	t.Helper()
	return agent(t, w.ep, "c1", "n1", func(c *leases.Config) { c.StateDir = w.stateDir })
}

func (w *lostWorld) del(t *testing.T, key string) {
	t.Helper()
	if _, err := w.cli.Delete(etcdtest.Ctx(t), key); err != nil {
		t.Fatal(err)
	}
}

// doctorFix is the fix doctor prints for its finding of kind naming key.
func (w *lostWorld) doctorFix(t *testing.T, kind, key string) string {
	t.Helper()
	var d doctorJSON
	jsonOf(t, ctlAt(w.ep, "doctor", "-o", "json"), &d)
	for _, f := range d.Findings {
		for _, k := range f.Keys {
			if f.Kind == kind && k == key {
				return f.Fix
			}
		}
	}
	t.Fatalf("doctor has no %s finding of %s: %+v", kind, key, d.Findings)
	return ""
}

func TestAllocShowAndPoolShowOfARunningPodsLostKeys(t *testing.T) {
	tests := []struct {
		name     string
		deleted  func(w *lostWorld) []string
		kind     string
		findKey  func(w *lostWorld) string // a key of doctor's finding
		fixSays  func(w *lostWorld) string
		showSays []string
	}{
		// The case: etcdctl del of the allocation. The owner index still names it; the fix
		// restores the allocation on the pod's lease.
		{name: "allocation deleted", kind: admin.KindOwnerNoAlloc,
			deleted: func(w *lostWorld) []string { return []string{w.ipKey} },
			findKey: func(w *lostWorld) string { return w.ipKey },
			fixSays: func(w *lostWorld) string { return `create("` + w.ipKey + `") = "0"` },
			showSays: []string{"owner index names", "only its held key " + "%HELD%" + " keeps it from other pods",
				"To put it back at once, restore the allocation"}},
		// Allocation and owner index deleted: only the held key and the pod record are left; the
		// fix revokes the pod's lease, and the agent re-claims the pod from its journal.
		{name: "allocation and owner index deleted", kind: admin.KindPodAddrMissing,
			deleted: func(w *lostWorld) []string { return []string{w.ipKey, w.ownerIx} },
			findKey: func(w *lostWorld) string { return w.heldKey },
			fixSays: func(w *lostWorld) string { return "etcdctl lease revoke " + keyspace.LeaseHex(w.podLease) },
			showSays: []string{"pod ns/pod-web (owner u-web) on node c1/n1 still runs", "only the held keys keep them",
				"re-claims every address of the pod on a new lease"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newLostWorld(t)
			for _, k := range tt.deleted(w) {
				w.del(t, k)
			}
			subst := strings.NewReplacer("%HELD%", w.heldKey)

			// alloc show: not expired but an error, in doctor's words, with doctor's fix.
			fix := w.doctorFix(t, tt.kind, tt.findKey(w))
			r := ctlAt(w.ep, "alloc", "show", w.ip)
			says := append([]string{"KEYS LOST", "its pod still runs", "not expired: an error", tt.kind, w.heldKey, "node c1/n1, owner u-web",
				"within half a lease TTL", "keys of a running pod were deleted or changed in etcd; re-claiming its addresses",
				"leasehold_pod_keys_lost_total", "that agent is not running, cannot reach etcd", "fix:", fix, tt.fixSays(w)}, tt.showSays...)
			for _, s := range says {
				if s = subst.Replace(s); !strings.Contains(r.stdout, s) {
					t.Errorf("alloc show does not say %q:\n%s", s, r.stdout)
				}
			}
			for _, s := range []string{"EXPIRED", "nothing:", "until:"} {
				if strings.Contains(r.stdout, s) {
					t.Errorf("alloc show of a running pod's address says %q:\n%s", s, r.stdout)
				}
			}
			if r.code != exitNotFound || !strings.Contains(r.stderr, "its pod still runs") || strings.Contains(r.stderr, "expired") {
				t.Errorf("alloc show: exit %d, stderr %s", r.code, r.stderr)
			}
			var d []allocDetail
			jsonOf(t, ctlAt(w.ep, "alloc", "show", w.ip, "-o", "json"), &d)
			if len(d) != 1 || !d[0].KeysLost || d[0].Expired || d[0].Finding == nil || d[0].Finding.Kind != tt.kind ||
				d[0].Finding.Severity != admin.SeverityError || d[0].Finding.Fix != fix || d[0].Held == nil || d[0].Held.Key != w.heldKey {
				t.Errorf("alloc show -o json: %+v", d)
			}

			// pool show: apart from what is expired, with what the agent does and where the fix is.
			r = ctlAt(w.ep, "pool", "show", "net")
			for _, s := range []string{"keys lost: 1 address(es) held back whose pods still run: not expired, an error", w.ip, "c1/n1", "u-web", tt.kind,
				w.heldKey, "The agent of node n1 puts the pod's keys back by itself within half a lease TTL", "leaseholdctl doctor gives the fix",
				"no expired addresses or blocks"} {
				if !strings.Contains(r.stdout, s) {
					t.Errorf("pool show does not say %q:\n%s", s, r.stdout)
				}
			}
			if strings.Contains(r.stdout, "re-claims or frees them") || strings.Contains(r.stdout, "expired: 1 address") {
				t.Errorf("pool show calls a running pod's address expired:\n%s", r.stdout)
			}
			var pj poolJSON
			jsonOf(t, ctlAt(w.ep, "pool", "show", "net", "-o", "json"), &pj)
			if pj.Expired != 1 || len(pj.HeldBack) != 0 || len(pj.KeysLost) != 1 || pj.KeysLost[0].IP.String() != w.ip || pj.KeysLost[0].Kind != tt.kind ||
				pj.KeysLost[0].Fix != fix || pj.KeysLost[0].Node != "n1" || pj.KeysLost[0].Owner != "u-web" || pj.KeysLost[0].HeldKey != w.heldKey {
				t.Errorf("pool show -o json: expired %d, heldBack %+v, keysLost %+v", pj.Expired, pj.HeldBack, pj.KeysLost)
			}

			// What they say the agent does: started again, it puts the keys back within half a TTL.
			// The re-claim writes the allocation first, and the pod record once it has read that
			// answer: wait for the pod record too, or the doctor below could find it missing.
			w.start(t)
			podKey := keyspace.PodKey("c1", "n1", "u-web")
			etcdtest.Eventually(t, "the agent puts the pod's keys back", func() error {
				code, pod := ctlAt(w.ep, "alloc", "show", w.ip).code, keys(t, w.cli, podKey)
				return etcdtest.Saw(code == exitOK && len(pod) == 1, "alloc show exits %d; pod record %s present: %v", code, podKey, len(pod) == 1)
			})
			if r := ctlAt(w.ep, "pool", "show", "net"); strings.Contains(r.stdout, "keys lost") || !strings.Contains(r.stdout, "no expired addresses or blocks") {
				t.Errorf("pool show once the agent put the keys back:\n%s", r.stdout)
			}
			if r := ctlAt(w.ep, "doctor"); r.code != exitOK {
				t.Errorf("doctor once the agent put the keys back: %+v", r)
			}
			// And while it runs, by its own check, within half its lease TTL (10 s).
			for _, k := range tt.deleted(w) {
				w.del(t, k)
			}
			etcdtest.EventuallyTrue(t, "the running agent puts the pod's keys back", func() bool {
				return ctlAt(w.ep, "alloc", "show", w.ip).code == exitOK
			})
		})
	}
}

// TestAllocShowAndPoolShowOfExpiredAddressesSayWhatTheAgentDoes: the pods' leases ran out while
// their agent was stopped, so no key of them is left but their held keys: expired, with the
// node's agent still registered. What alloc show and pool show say it does, it does when it
// starts again: it re-claims the address of the pod still running (web) and frees the held key
// of the pod whose sandbox is gone (db).
func TestAllocShowAndPoolShowOfExpiredAddressesSayWhatTheAgentDoes(t *testing.T) {
	w := newLostWorld(t)
	netns := filepath.Join(t.TempDir(), "netns-db")
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	a := w.start(t)
	res, err := a.Add(etcdtest.Ctx(t), allocator.Request{Network: "net", Pool: allocator.PoolSpec{Name: "net"}, ContainerID: "db", IfName: "eth0",
		Netns: netns, Pod: allocator.PodRef{UID: "u-db", Namespace: "ns", Name: "pod-db"}})
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	dbIP := res.IPs[0].Address.Addr().String()
	dbHeld := keyspace.HeldKey("net", allocator.DefaultBlocks, res.IPs[0].Address.Addr())
	ctx := etcdtest.Ctx(t)
	for _, k := range []string{w.ipKey, keyspace.IPKey("net", allocator.DefaultBlocks, res.IPs[0].Address.Addr())} {
		resp, err := w.cli.Get(ctx, k)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("get %s: %v %v", k, resp, err)
		}
		if _, err := w.cli.Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil { // as etcd does when it expires
			t.Fatal(err)
		}
	}

	r := ctlAt(w.ep, "alloc", "show", w.ip)
	for _, s := range []string{"EXPIRED", "no key of its pod left", w.heldKey, "node n1 has an agent",
		"to do:      nothing: the agent of node n1 " + admin.AgentBack(),
		"re-claims the addresses of its pods still running as soon as it finds their leases lost",
		"within half a lease TTL", "frees the held keys of its pods that are gone", "held keys of addresses no pod of this node holds any more freed",
		"another node UID"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("alloc show of an expired address does not say %q:\n%s", s, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "KEYS LOST") || strings.Contains(r.stdout, "re-claims the address for its pod if that still runs") ||
		r.code != exitNotFound || !strings.Contains(r.stderr, "it is expired") {
		t.Errorf("alloc show of an expired address: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	var d []allocDetail
	jsonOf(t, ctlAt(w.ep, "alloc", "show", w.ip, "-o", "json"), &d)
	if len(d) != 1 || !d[0].Expired || d[0].KeysLost || d[0].Finding == nil || d[0].Finding.Kind != admin.KindAddressExpired {
		t.Errorf("alloc show -o json of an expired address: %+v", d)
	}
	r = ctlAt(w.ep, "pool", "show", "net")
	for _, s := range []string{"expired: 2 address(es) held back, 0 block(s)", "AGENT back", admin.AgentBack()} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("pool show does not say %q:\n%s", s, r.stdout)
		}
	}
	if row := strings.Fields(lineStarting(r.stdout, "c1/n1 ")); len(row) < 3 || row[1] != "back" || row[2] != "2" {
		t.Errorf("pool show's held-back row of c1/n1: %q", row)
	}
	if strings.Contains(r.stdout, "re-claims or frees them") || strings.Contains(r.stdout, "keys lost") {
		t.Errorf("pool show of expired addresses:\n%s", r.stdout)
	}

	// The db pod is gone, web still runs: the agent starts again.
	if err := os.Remove(netns); err != nil {
		t.Fatal(err)
	}
	w.start(t)
	etcdtest.EventuallyTrue(t, "the agent re-claims web's address and frees db's held key", func() bool {
		return ctlAt(w.ep, "alloc", "show", w.ip).code == exitOK && len(keys(t, w.cli, dbHeld)) == 0
	})
	if r := ctlAt(w.ep, "alloc", "show", dbIP); r.code != exitNotFound || strings.Contains(r.stdout+r.stderr, "expired") {
		t.Errorf("alloc show of the gone pod's address: %+v", r)
	}
	if r := ctlAt(w.ep, "pool", "show", "net"); !strings.Contains(r.stdout, "no expired addresses or blocks") {
		t.Errorf("pool show once the agent is back:\n%s", r.stdout)
	}
}

// lineStarting is the first line of out that starts with prefix, or "".
func lineStarting(out, prefix string) string {
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	return ""
}
