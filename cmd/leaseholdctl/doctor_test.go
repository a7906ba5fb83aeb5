package main

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// doctorWorld is one doctor row's state: a fresh key space with pool "net" (10.90.0.0/24 less
// 10.90.0.250, fd90::/120) and one live attachment "web" (10.90.0.10, fd90::10) of an agent.
type doctorWorld struct {
	ep, cluster, node, pool string
	cli                     *clientv3.Client
	agent                   *leases.Agent
	ip4, ip6, owner, pod    string // web's keys
	lease                   clientv3.LeaseID
	saved                   string // a value a row puts back by hand
}

func newDoctorWorld(t *testing.T, ep string) *doctorWorld {
	t.Helper()
	w := &doctorWorld{ep: ep, cluster: "c1", node: "n1", pool: "net", cli: etcdtest.ClientAt(t, ep)}
	if _, err := w.cli.Delete(etcdtest.Ctx(t), keyspace.Prefix, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	if r := ctlAt(ep, "pool", "create", w.pool, "--range", "10.90.0.0/24", "--range", "fd90::/120", "--exclude", "10.90.0.250"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	a := agent(t, ep, w.cluster, w.node)
	w.agent = a
	attach(t, a, w.pool, "web", "10.90.0.10", "fd90::10")
	w.ip4, w.ip6 = keyspace.IPKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.10")), keyspace.IPKey(w.pool, allocator.DefaultBlocks, mustIP("fd90::10"))
	w.owner, w.pod = keyspace.OwnerKey(w.cluster, "u-web", "eth0", w.pool), keyspace.PodKey(w.cluster, w.node, "u-web")
	w.lease = w.leaseOf(t, w.ip4)
	return w
}

func (w *doctorWorld) leaseOf(t *testing.T, key string) clientv3.LeaseID {
	t.Helper()
	resp, err := w.cli.Get(etcdtest.Ctx(t), key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("get %s: %v", key, err)
	}
	return clientv3.LeaseID(resp.Kvs[0].Lease)
}

func (w *doctorWorld) value(t *testing.T, key string) string { return keys(t, w.cli, key)[key] }

// put writes key with a plain clientv3 Put, as a hand edit with etcdctl would; lease 0 is none.
func (w *doctorWorld) put(t *testing.T, key, value string, lease clientv3.LeaseID) {
	t.Helper()
	var opts []clientv3.OpOption
	if lease != 0 {
		opts = append(opts, clientv3.WithLease(lease))
	}
	if _, err := w.cli.Put(etcdtest.Ctx(t), key, value, opts...); err != nil {
		t.Fatal(err)
	}
}

// move puts key's value at to, on the same lease, and deletes key: a key in the wrong layout.
func (w *doctorWorld) move(t *testing.T, key, to string) {
	t.Helper()
	w.put(t, to, w.value(t, key), w.leaseOf(t, key))
	w.del(t, key)
}

func (w *doctorWorld) del(t *testing.T, key string) {
	t.Helper()
	if _, err := w.cli.Delete(etcdtest.Ctx(t), key); err != nil {
		t.Fatal(err)
	}
}

func (w *doctorWorld) grant(t *testing.T) clientv3.LeaseID {
	t.Helper()
	g, err := w.cli.Grant(etcdtest.Ctx(t), 60)
	if err != nil {
		t.Fatal(err)
	}
	return g.ID
}

func (w *doctorWorld) doctor(t *testing.T, args ...string) (int, doctorJSON) {
	t.Helper()
	r := ctlAt(w.ep, append([]string{"doctor", "-o", "json"}, args...)...)
	var out doctorJSON
	jsonOf(t, r, &out)
	if out.Clean != (r.code == exitOK) || (r.code != exitOK && r.code != exitProblems) {
		t.Fatalf("doctor: exit %d, clean %v: %s", r.code, out.Clean, r.stderr)
	}
	return r.code, out
}

// etcdctlDir is where the etcdctl binary `make tools` builds lives, or "" without one.
func etcdctlDir() string {
	for _, d := range []string{os.Getenv("LEASEHOLD_BIN"), "../../bin"} {
		if d == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "etcdctl")); err == nil {
			abs, _ := filepath.Abs(d)
			return abs
		}
	}
	return ""
}

// apply runs a finding's fix as the admin would paste it: leaseholdctl in-process, etcdctl
// through a shell with the real binary.
func (w *doctorWorld) apply(t *testing.T, f admin.Finding, bin string) {
	t.Helper()
	switch {
	case !f.Problem():
		// info: a state that passes by itself, or advice; doctor does not fail on it
	case strings.HasPrefix(f.Fix, "leaseholdctl "):
		if r := ctlAt(w.ep, strings.Fields(f.Fix)[1:]...); r.code != 0 {
			t.Errorf("fix %q: exit %d: %s", f.Fix, r.code, r.stderr)
		}
	case strings.Contains(f.Fix, "etcdctl "):
		cmd := exec.Command("sh", "-c", f.Fix)
		cmd.Env = append(os.Environ(), "ETCDCTL_ENDPOINTS="+w.ep, "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		if err != nil || strings.Contains(string(out), "FAILURE") {
			t.Errorf("fix %q: %v: %s", f.Fix, err, out)
		}
	default:
		t.Errorf("fix %q is not a command a test can run", f.Fix)
	}
}

func TestDoctor(t *testing.T) {
	srv, stop, err := etcdtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	ep := srv.ClientURL
	bin := etcdctlDir()
	ghost := `{"uid":"x","version":"v","leaseID":"0"}`
	tests := []struct {
		name    string
		seed    func(t *testing.T, w *doctorWorld)
		kind    string
		key     func(w *doctorWorld) string
		fix     func(w *doctorWorld) string // the fix is exactly this, or contains it when contains is set
		partial bool
		manual  func(t *testing.T, w *doctorWorld) // cleanup for fixes a test cannot run (kubectl)
	}{
		// A plain `etcdctl put` of an allocation: no lease, no owner index. Released without --force.
		{name: "hand-written allocation without lease", kind: admin.KindNoLease,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.IPKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.50")), `{"owner":"x","cluster":"c1","ifName":"eth0"}`, 0)
			},
			key: func(w *doctorWorld) string {
				return keyspace.IPKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.50"))
			},
			fix: func(w *doctorWorld) string { return "leaseholdctl alloc release 10.90.0.50 --pool net" }},
		// An agent's allocation put again by hand loses its lease; it goes back on its owner index's lease.
		{name: "allocation rewritten without lease", kind: admin.KindNoLease, partial: true,
			seed: func(t *testing.T, w *doctorWorld) { w.put(t, w.ip4, w.value(t, w.ip4), 0) },
			key:  func(w *doctorWorld) string { return w.ip4 },
			fix:  func(w *doctorWorld) string { return "--lease=" + keyspace.LeaseHex(w.lease) + "' '' '' | etcdctl txn" }},
		// The same for the owner index: its addresses' lease is where it belongs.
		{name: "owner index rewritten without lease", kind: admin.KindNoLease, partial: true,
			seed: func(t *testing.T, w *doctorWorld) { w.put(t, w.owner, w.value(t, w.owner), 0) },
			key:  func(w *doctorWorld) string { return w.owner },
			fix:  func(w *doctorWorld) string { return "--lease=" + keyspace.LeaseHex(w.lease) }},
		// And for the pod record.
		{name: "pod record rewritten without lease", kind: admin.KindNoLease, partial: true,
			seed: func(t *testing.T, w *doctorWorld) { w.put(t, w.pod, w.value(t, w.pod), 0) },
			key:  func(w *doctorWorld) string { return w.pod },
			fix:  func(w *doctorWorld) string { return "--lease=" + keyspace.LeaseHex(w.lease) }},
		// The owner index names an address whose key was deleted: restored create-if-absent on the pod's lease.
		{name: "owner index without allocation", kind: admin.KindOwnerNoAlloc, partial: true,
			seed: func(t *testing.T, w *doctorWorld) { w.del(t, w.ip6) },
			key:  func(w *doctorWorld) string { return w.ip6 },
			fix:  func(w *doctorWorld) string { return `create("` + w.ip6 + `") = "0"` }},
		// Allocations and owner index deleted, the pod record left: only the held keys name the
		// running pod's addresses. Revoking its lease makes the agent re-claim them.
		{name: "running pod without allocation or owner index", kind: admin.KindPodAddrMissing,
			seed: func(t *testing.T, w *doctorWorld) { w.del(t, w.ip4); w.del(t, w.ip6); w.del(t, w.owner) },
			key:  func(w *doctorWorld) string { return w.pod },
			fix:  func(w *doctorWorld) string { return "etcdctl lease revoke " + keyspace.LeaseHex(w.lease) }},
		// The reverse: allocations no owner index names; no DEL would release them.
		{name: "allocation without owner index", kind: admin.KindOrphan,
			seed: func(t *testing.T, w *doctorWorld) { w.del(t, w.owner) },
			key:  func(w *doctorWorld) string { return w.ip4 },
			fix:  func(w *doctorWorld) string { return "leaseholdctl alloc release 10.90.0.10 --pool net --force" }},
		// Without its pod record, a restarted agent would not resume the pod's lease.
		{name: "pod record missing", kind: admin.KindPodMissing, partial: true,
			seed: func(t *testing.T, w *doctorWorld) { w.del(t, w.pod) },
			key:  func(w *doctorWorld) string { return w.pod },
			fix:  func(w *doctorWorld) string { return `create("` + w.pod + `") = "0"` }},
		// Allocation and owner index on different leases: one would outlive the other.
		{name: "allocation on another lease", kind: admin.KindLeaseMismatch, partial: true,
			seed: func(t *testing.T, w *doctorWorld) { w.put(t, w.ip4, w.value(t, w.ip4), w.grant(t)) },
			key:  func(w *doctorWorld) string { return w.ip4 },
			fix:  func(w *doctorWorld) string { return "--lease=" + keyspace.LeaseHex(w.lease) }},
		// The definition was shrunk with a plain put, bypassing remove-range's check.
		{name: "allocation outside every range", kind: admin.KindOutOfRange,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.PoolKey(w.pool), `{"name":"net","layout":"blocks","rangeSets":[[{"subnet":"10.90.1.0/24"}],[{"subnet":"fd90::/120"}]],"blocks":{"ipv4":26,"ipv6":122}}`, 0)
			},
			key: func(w *doctorWorld) string { return w.ip4 },
			fix: func(w *doctorWorld) string { return "leaseholdctl alloc release 10.90.0.10 --pool net --force" }},
		// An exclude added by hand covers a held address.
		{name: "allocation in an exclude", kind: admin.KindOutOfRange,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.PoolKey(w.pool), `{"name":"net","layout":"blocks","rangeSets":[[{"subnet":"10.90.0.0/24"}],[{"subnet":"fd90::/120"}]],"exclude":["10.90.0.8/29"],"blocks":{"ipv4":26,"ipv6":122}}`, 0)
			},
			key: func(w *doctorWorld) string { return w.ip4 },
			fix: func(w *doctorWorld) string { return "leaseholdctl alloc release 10.90.0.10 --pool net --force" }},
		// A gateway set by hand onto a held address: the pod has the router's address.
		{name: "allocation on a gateway", kind: admin.KindOutOfRange,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.PoolKey(w.pool), `{"name":"net","layout":"blocks","rangeSets":[[{"subnet":"10.90.0.0/24","gateway":"10.90.0.10"}],[{"subnet":"fd90::/120"}]],"blocks":{"ipv4":26,"ipv6":122}}`, 0)
			},
			key: func(w *doctorWorld) string { return w.ip4 },
			fix: func(w *doctorWorld) string { return "leaseholdctl alloc release 10.90.0.10 --pool net --force" }},
		// The definition deleted: recreated around the held addresses.
		{name: "pool without definition", kind: admin.KindPoolUndefined,
			seed: func(t *testing.T, w *doctorWorld) { w.del(t, keyspace.PoolKey(w.pool)) },
			key:  func(w *doctorWorld) string { return w.ip4 },
			fix: func(w *doctorWorld) string {
				return "leaseholdctl pool create net --range 10.90.0.0/24 --range fd90::/64"
			}},
		// Two pools over one subnet hand out the same address: the newer holder is released.
		{name: "same address in overlapping pools", kind: admin.KindDuplicate,
			seed: func(t *testing.T, w *doctorWorld) {
				if r := ctlAt(w.ep, "pool", "create", "net2", "--range", "10.90.0.0/24"); r.code != 0 {
					t.Fatalf("pool create: %+v", r)
				}
				attach(t, w.agent, "net2", "db", "10.90.0.10")
			},
			key: func(w *doctorWorld) string { return w.ip4 },
			fix: func(w *doctorWorld) string { return "leaseholdctl alloc release 10.90.0.10 --pool net2 --force" }},
		// Garbage where an allocation should be, on a lease.
		{name: "unreadable allocation", kind: admin.KindUnreadable,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.IPKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.60")), "garbage", w.grant(t))
			},
			key: func(w *doctorWorld) string {
				return keyspace.IPKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.60"))
			},
			fix: func(w *doctorWorld) string { return "leaseholdctl alloc release 10.90.0.60 --pool net --force" }},
		// Garbage owner index: DEL and CHECK of that attachment would fail on it.
		{name: "unreadable owner index", kind: admin.KindUnreadable,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.OwnerKey("c1", "u-x", "eth0", "net"), "{", w.grant(t))
			},
			key: func(w *doctorWorld) string { return keyspace.OwnerKey("c1", "u-x", "eth0", "net") },
			fix: func(w *doctorWorld) string { return "etcdctl del " + keyspace.OwnerKey("c1", "u-x", "eth0", "net") }},
		// A key no component reads.
		{name: "malformed key", kind: admin.KindBadKey,
			seed: func(t *testing.T, w *doctorWorld) { w.put(t, keyspace.IPsPrefix(w.pool)+"not-an-ip", "{}", 0) },
			key:  func(w *doctorWorld) string { return keyspace.IPsPrefix(w.pool) + "not-an-ip" },
			fix:  func(w *doctorWorld) string { return "etcdctl del " + keyspace.IPsPrefix(w.pool) + "not-an-ip" }},
		// Records that only need a lease: quarantine, node, host address, conflict.
		{name: "quarantine without lease", kind: admin.KindNoLease,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.QuarantineKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.70")), `{"releasedBy":"x"}`, 0)
			},
			key: func(w *doctorWorld) string {
				return keyspace.QuarantineKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.70"))
			},
			fix: func(w *doctorWorld) string {
				return "etcdctl del " + keyspace.QuarantineKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.70"))
			}},
		{name: "node record without lease", kind: admin.KindNoLease,
			seed: func(t *testing.T, w *doctorWorld) { w.put(t, keyspace.NodeKey("c1", "ghost"), ghost, 0) },
			key:  func(w *doctorWorld) string { return keyspace.NodeKey("c1", "ghost") },
			fix:  func(w *doctorWorld) string { return "etcdctl del " + keyspace.NodeKey("c1", "ghost") }},
		{name: "host address without lease", kind: admin.KindNoLease,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.HostIPKey(mustIP("10.90.0.99"), "c1", "ghost"), "{}", 0)
			},
			key: func(w *doctorWorld) string { return keyspace.HostIPKey(mustIP("10.90.0.99"), "c1", "ghost") },
			fix: func(w *doctorWorld) string {
				return "etcdctl del " + keyspace.HostIPKey(mustIP("10.90.0.99"), "c1", "ghost")
			}},
		{name: "conflict record without lease", kind: admin.KindNoLease,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.ConflictKey("c1", "u-x", "eth0", "net"), `{"taken":[]}`, 0)
			},
			key: func(w *doctorWorld) string { return keyspace.ConflictKey("c1", "u-x", "eth0", "net") },
			fix: func(w *doctorWorld) string { return "etcdctl del " + keyspace.ConflictKey("c1", "u-x", "eth0", "net") }},
		// A pool definition on a lease would vanish with it: written again without one.
		{name: "pool definition on a lease", kind: admin.KindPoolOnLease, partial: true,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.PoolKey(w.pool), w.value(t, keyspace.PoolKey(w.pool)), w.grant(t))
			},
			key: func(w *doctorWorld) string { return keyspace.PoolKey(w.pool) },
			fix: func(w *doctorWorld) string { return `' '' 'put ` + keyspace.PoolKey(w.pool) + ` "` }},
		// The block layout. An allocation in a block of another size is moved to its block, value and lease kept.
		{name: "allocation in the wrong block", kind: admin.KindWrongLayout, partial: true,
			seed: func(t *testing.T, w *doctorWorld) {
				w.move(t, w.ip4, keyspace.IPsPrefix(w.pool)+"10.90.0.0-24/10.90.0.10")
			},
			key: func(w *doctorWorld) string { return keyspace.IPsPrefix(w.pool) + "10.90.0.0-24/10.90.0.10" },
			fix: func(w *doctorWorld) string { return `'del ` + keyspace.IPsPrefix(w.pool) + "10.90.0.0-24/10.90.0.10' " }},
		// An allocation left in the flat layout of a block pool: pool migrate moves it.
		{name: "allocation in the flat layout", kind: admin.KindWrongLayout,
			seed: func(t *testing.T, w *doctorWorld) {
				w.move(t, w.ip4, keyspace.IPKey(w.pool, allocator.Blocks{}, mustIP("10.90.0.10")))
			},
			key: func(w *doctorWorld) string { return keyspace.IPKey(w.pool, allocator.Blocks{}, mustIP("10.90.0.10")) },
			fix: func(w *doctorWorld) string { return "leaseholdctl pool migrate net" }},
		// A pool frozen by a migration that stopped: running it again finishes it.
		{name: "pool frozen by a migration", kind: admin.KindPoolMigrating,
			seed: func(t *testing.T, w *doctorWorld) {
				v := strings.Replace(w.value(t, keyspace.PoolKey(w.pool)), `"blocks":`, `"migrating":{"by":"x","since":"2026-01-01T00:00:00Z"},"blocks":`, 1)
				w.put(t, keyspace.PoolKey(w.pool), v, 0)
			},
			key: func(w *doctorWorld) string { return keyspace.PoolKey(w.pool) },
			fix: func(w *doctorWorld) string { return "leaseholdctl pool migrate net" }},
		// A block claim of a size the pool does not have: deleted.
		{name: "block claim of another size", kind: admin.KindBlockInvalid,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.BlockKey(w.pool, netip.MustParsePrefix("10.90.0.0/24")), `{"cluster":"c1","node":"n1","nodeUID":"uid-n1"}`, w.grant(t))
			},
			key: func(w *doctorWorld) string { return keyspace.BlockKey(w.pool, netip.MustParsePrefix("10.90.0.0/24")) },
			fix: func(w *doctorWorld) string {
				return "etcdctl del " + keyspace.BlockKey(w.pool, netip.MustParsePrefix("10.90.0.0/24"))
			}},
		// Sticky claims. A claim record written without lease never goes: released with claim release.
		{name: "claim without lease", kind: admin.KindNoLease,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.ClaimKey("c1", "net", "ns.web-0"), `{"ips":["10.90.0.30"],"holdSeconds":600}`, 0)
				w.put(t, keyspace.QuarantineKey("net", allocator.DefaultBlocks, mustIP("10.90.0.30")), `{"releasedBy":"n1","claim":"ns.web-0"}`, w.grant(t))
			},
			key: func(w *doctorWorld) string { return keyspace.ClaimKey("c1", "net", "ns.web-0") },
			fix: func(w *doctorWorld) string { return "leaseholdctl claim release ns.web-0 --pool net --cluster c1" }},
		// A claim of a pool that has no definition: its next holder's ADD is refused.
		{name: "claim of an undefined pool", kind: admin.KindClaimPoolUndefined,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.ClaimKey("c1", "gone", "ns.web-0"), `{"ips":["10.90.0.30"],"holdSeconds":600}`, w.grant(t))
			},
			key: func(w *doctorWorld) string { return keyspace.ClaimKey("c1", "gone", "ns.web-0") },
			fix: func(w *doctorWorld) string { return "leaseholdctl claim release ns.web-0 --pool gone --cluster c1" }},
		// Held keys (issue 23). One written with a plain etcdctl put never expires: put back on
		// the node's block lease when its node record names one, else deleted, guarded.
		{name: "held key without lease", kind: admin.KindNoLease, partial: true,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.10")), `{"cluster":"c1","node":"n1","owner":"u-web"}`, 0)
			},
			key: func(w *doctorWorld) string {
				return keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.10"))
			},
			fix: func(w *doctorWorld) string {
				return `mod("` + keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.10")) + `")`
			}},
		// Garbage where a held key should be.
		{name: "unreadable held key", kind: admin.KindUnreadable,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.77")), "garbage", w.grant(t))
			},
			key: func(w *doctorWorld) string {
				return keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.77"))
			},
			fix: func(w *doctorWorld) string {
				return "etcdctl del " + keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.77"))
			}},
		// A held key naming another node than web's allocation: rewritten for web, or deleted, guarded.
		{name: "held key naming another holder", kind: admin.KindHeldOtherHolder, partial: true,
			seed: func(t *testing.T, w *doctorWorld) {
				w.put(t, keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("fd90::10")), `{"cluster":"c1","node":"n9","owner":"u-old"}`, w.grant(t))
			},
			key: func(w *doctorWorld) string {
				return keyspace.HeldKey(w.pool, allocator.DefaultBlocks, mustIP("fd90::10"))
			},
			fix: func(w *doctorWorld) string { return `mod("` + w.ip6 + `")` }},
		// After a lost lease another pod took web's address (a recorded conflict): web must be recreated.
		{name: "owner index names another holder", kind: admin.KindOwnerOtherAlloc,
			seed: func(t *testing.T, w *doctorWorld) {
				other := attach(t, w.agent, w.pool, "thief").IPs[0].Address.Addr()
				w.saved = w.value(t, w.owner)
				w.put(t, w.owner, strings.Replace(w.value(t, w.owner), "10.90.0.10", other.String(), 1), w.lease)
				w.put(t, keyspace.ConflictKey("c1", "u-web", "eth0", "net"), `{"taken":[{"ip":"`+other.String()+`","holder":"u-thief"}]}`, w.lease)
			},
			key: func(w *doctorWorld) string { return w.owner },
			fix: func(w *doctorWorld) string { return "kubectl delete pod -n ns pod-web" },
			manual: func(t *testing.T, w *doctorWorld) {
				w.put(t, w.owner, w.saved, w.lease)
				w.del(t, keyspace.ConflictKey("c1", "u-web", "eth0", "net"))
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newDoctorWorld(t, ep)
			if code, out := w.doctor(t); code != exitOK {
				t.Fatalf("doctor before the corruption: exit %d: %+v", code, out.Findings)
			}
			tt.seed(t, w)
			code, out := w.doctor(t)
			i := slices.IndexFunc(out.Findings, func(f admin.Finding) bool { return f.Kind == tt.kind && slices.Contains(f.Keys, tt.key(w)) })
			if code != exitProblems || i < 0 {
				t.Fatalf("doctor: exit %d, no %s admin.Finding for %s in %+v", code, tt.kind, tt.key(w), out.Findings)
			}
			f, want := out.Findings[i], tt.fix(w)
			if (tt.partial && !strings.Contains(f.Fix, want)) || (!tt.partial && f.Fix != want) || f.Message == "" {
				t.Errorf("fix %q, want %q (partial %v); message %q", f.Fix, want, tt.partial, f.Message)
			}
			if r := ctlAt(w.ep, "doctor"); r.code != exitProblems || !strings.Contains(r.stdout, "["+tt.kind+"]") || !strings.Contains(r.stdout, "fix: "+f.Fix) {
				t.Errorf("table output: exit %d\n%s", r.code, r.stdout)
			}
			switch {
			case tt.manual != nil:
				tt.manual(t, w)
			case bin == "":
				t.Skip("no etcdctl (make tools): the fix commands are not run")
			default:
				for round := 0; round < 4 && len(out.Findings) > 0; round++ {
					for _, f := range out.Findings {
						w.apply(t, f, bin)
					}
					_, out = w.doctor(t)
				}
			}
			if code, out := w.doctor(t); code != exitOK {
				t.Errorf("after the fixes: exit %d, findings %+v", code, out.Findings)
			}
		})
	}
	// --cluster keeps one cluster's findings (and the shared pools'); -o json has stable names.
	t.Run("scope and json", func(t *testing.T) {
		w := newDoctorWorld(t, ep)
		w.put(t, keyspace.IPKey(w.pool, allocator.DefaultBlocks, mustIP("10.90.0.50")), `{"owner":"x","cluster":"c1","ifName":"eth0"}`, 0)
		if code, out := w.doctor(t, "--cluster", "c2"); code != exitOK || len(out.Findings) != 0 {
			t.Errorf("doctor --cluster c2: exit %d, %+v", code, out.Findings)
		}
		r := ctlAt(w.ep, "doctor", "--cluster", "c1", "-o", "json")
		var raw map[string]any
		jsonOf(t, r, &raw)
		findings, _ := raw["findings"].([]any)
		if r.code != exitProblems || raw["clean"] != false || raw["revision"] == nil || len(findings) != 1 {
			t.Fatalf("doctor --cluster c1: exit %d, %s", r.code, r.stdout)
		}
		for _, k := range []string{"kind", "keys", "cluster", "message", "fix"} {
			if _, ok := findings[0].(map[string]any)[k]; !ok {
				t.Errorf("admin.Finding has no %q: %s", k, r.stdout)
			}
		}
	})
}
