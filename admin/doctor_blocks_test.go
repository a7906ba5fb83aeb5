package admin

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// blockWorld is a healthy state of the block layout, written key by key as an agent of blocks
// writes it: pool "net" (10.77.0.0/24, fd77::/120, default blocks), node c1/n1's agent, its
// claims of 10.77.0.0/26 and fd77::/122 on its block lease (named in its node record), and one
// attachment "web" (10.77.0.10, fd77::10) with its owner index and pod record on the pod lease
// and its held keys on the block lease, and 10.77.0.20 resting in quarantine.
type blockWorld struct {
	cli                       *clientv3.Client
	pod, nodeLease, blockL, q clientv3.LeaseID
	ip4, ip6, owner, podKey   string
	held4, held6              string
	claim4, claim6, quar      string
	block4                    netip.Prefix
}

const wPool, wCluster, wNode, wUID = "net", "c1", "n1", "uid-n1"

func newBlockWorld(t *testing.T, cli *clientv3.Client) *blockWorld {
	t.Helper()
	ctx := etcdtest.Ctx(t)
	if _, err := cli.Delete(ctx, keyspace.Prefix, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	if _, err := CreatePool(ctx, cli, adminPool(wPool, allocator.RangeSet{adminRange("10.77.0.0/24")}, allocator.RangeSet{adminRange("fd77::/120")})); err != nil {
		t.Fatal(err)
	}
	w := &blockWorld{cli: cli, pod: grant(t, cli), nodeLease: grant(t, cli), blockL: grant(t, cli), q: grant(t, cli),
		block4: netip.MustParsePrefix("10.77.0.0/26")}
	now := time.Now().UTC()
	put(t, cli, keyspace.NodeKey(wCluster, wNode), keyspace.Encode(keyspace.NodeRecord{UID: wUID, Host: "h1", Version: "v", Blocks: true, LiveMigration: true,
		Started: now, LeaseID: keyspace.LeaseHex(w.nodeLease), BlockLease: keyspace.LeaseHex(w.blockL)}), w.nodeLease)
	claim := keyspace.Encode(keyspace.BlockRecord{Cluster: wCluster, Node: wNode, NodeUID: wUID, LeaseID: keyspace.LeaseHex(w.blockL), Since: now})
	w.claim4, w.claim6 = keyspace.BlockKey(wPool, w.block4), keyspace.BlockKey(wPool, netip.MustParsePrefix("fd77::/122"))
	put(t, cli, w.claim4, claim, w.blockL)
	put(t, cli, w.claim6, claim, w.blockL)
	ips := []netip.Addr{netip.MustParseAddr("10.77.0.10"), netip.MustParseAddr("fd77::10")}
	pod := allocator.PodRef{UID: "u-web", Namespace: "ns", Name: "web"}
	alloc := keyspace.Encode(keyspace.Allocation{Owner: "u-web", Cluster: wCluster, Node: wNode, NodeUID: wUID, Pod: pod, ContainerID: "ctr",
		IfName: "eth0", Network: wPool, LeaseID: keyspace.LeaseHex(w.pod), Created: now})
	w.ip4, w.ip6 = keyspace.IPKey(wPool, allocator.DefaultBlocks, ips[0]), keyspace.IPKey(wPool, allocator.DefaultBlocks, ips[1])
	put(t, cli, w.ip4, alloc, w.pod)
	put(t, cli, w.ip6, alloc, w.pod)
	w.held4, w.held6 = keyspace.HeldKey(wPool, allocator.DefaultBlocks, ips[0]), keyspace.HeldKey(wPool, allocator.DefaultBlocks, ips[1])
	held := keyspace.Encode(keyspace.HeldRecord{Cluster: wCluster, Node: wNode, Owner: "u-web"})
	put(t, cli, w.held4, held, w.blockL)
	put(t, cli, w.held6, held, w.blockL)
	w.owner, w.podKey = keyspace.OwnerKey(wCluster, "u-web", "eth0", wPool), keyspace.PodKey(wCluster, wNode, "u-web")
	put(t, cli, w.owner, keyspace.Encode(keyspace.OwnerRecord{IPs: ips, ContainerID: "ctr", Network: wPool, Node: wNode, NodeUID: wUID,
		LeaseID: keyspace.LeaseHex(w.pod), Created: now}), w.pod)
	put(t, cli, w.podKey, keyspace.Encode(keyspace.PodRecord{Owner: "u-web", Pod: pod, NodeUID: wUID, LeaseID: keyspace.LeaseHex(w.pod),
		ContainerID: "ctr", Created: now}), w.pod)
	w.quar = keyspace.QuarantineKey(wPool, allocator.DefaultBlocks, netip.MustParseAddr("10.77.0.20"))
	put(t, cli, w.quar, keyspace.Encode(keyspace.QuarantineRecord{ReleasedBy: wNode, Until: now.Add(time.Minute)}), w.q)
	return w
}

func (w *blockWorld) check(t *testing.T) []Finding {
	t.Helper()
	st, err := ReadState(etcdtest.Ctx(t), w.cli)
	if err != nil {
		t.Fatal(err)
	}
	return Check(st)
}

func (w *blockWorld) value(t *testing.T, key string) string { return dumpKVs(t, w.cli, key)[key].value }

func (w *blockWorld) del(t *testing.T, key string) {
	t.Helper()
	if _, err := w.cli.Delete(etcdtest.Ctx(t), key); err != nil {
		t.Fatal(err)
	}
}

// TestDoctorBlockLayout seeds one problem of the block layout per row into a healthy state and
// checks doctor reports it, with its severity and fix; the healthy state has no finding at all.
func TestDoctorBlockLayout(t *testing.T) {
	cli := privateEtcd(t)
	ip := netip.MustParseAddr
	flatKey := keyspace.IPKey(wPool, allocator.Blocks{}, ip("10.77.0.40"))
	wrongBlock := keyspace.IPsPrefix(wPool) + "10.77.0.0-24/10.77.0.41" // a /24 where the pool has /26
	rightOfWrong := keyspace.IPKey(wPool, allocator.DefaultBlocks, ip("10.77.0.41"))
	tests := []struct {
		name     string
		seed     func(t *testing.T, w *blockWorld)
		kind     string
		severity string
		key      func(w *blockWorld) string
		fix      func(w *blockWorld) string // contained in the finding's fix
	}{
		// A claim key that is no block name: no agent reads it.
		{name: "claim key malformed", kind: KindBadKey, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, keyspace.BlocksPrefix(wPool)+"10.77.0.5-26", "{}", w.blockL)
			},
			key: func(*blockWorld) string { return keyspace.BlocksPrefix(wPool) + "10.77.0.5-26" },
			fix: func(*blockWorld) string { return "etcdctl del " + keyspace.BlocksPrefix(wPool) + "10.77.0.5-26" }},
		// A /24 claimed in a pool of /26 blocks.
		{name: "claim of another size", kind: KindBlockInvalid, severity: SeverityWarning,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, keyspace.BlockKey(wPool, netip.MustParsePrefix("10.77.1.0/24")), w.value(t, w.claim4), w.blockL)
			},
			key: func(*blockWorld) string { return keyspace.BlockKey(wPool, netip.MustParsePrefix("10.77.1.0/24")) },
			fix: func(*blockWorld) string {
				return "etcdctl del " + keyspace.BlockKey(wPool, netip.MustParsePrefix("10.77.1.0/24"))
			}},
		// A claim in a pool that has no definition.
		{name: "claim of an undefined pool", kind: KindBlockInvalid, severity: SeverityWarning,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, keyspace.BlockKey("gone", w.block4), w.value(t, w.claim4), w.blockL)
			},
			key: func(w *blockWorld) string { return keyspace.BlockKey("gone", w.block4) },
			fix: func(w *blockWorld) string { return "etcdctl del " + keyspace.BlockKey("gone", w.block4) }},
		// A claim in a pool of the flat layout (its definition was put back by hand).
		{name: "claim in a flat pool", kind: KindBlockInvalid, severity: SeverityWarning,
			seed: func(t *testing.T, w *blockWorld) { storeFlat(t, w.cli, readSpec(t, w)) },
			key:  func(w *blockWorld) string { return w.claim4 },
			fix:  func(w *blockWorld) string { return "etcdctl del " + w.claim4 }},
		// A claim whose value is not a block record.
		{name: "claim unreadable", kind: KindUnreadable, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { put(t, w.cli, w.claim4, "garbage", w.blockL) },
			key:  func(w *blockWorld) string { return w.claim4 },
			fix:  func(w *blockWorld) string { return "etcdctl del " + w.claim4 }},
		// A claim written without lease never goes.
		{name: "claim without lease", kind: KindNoLease, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { put(t, w.cli, w.claim4, w.value(t, w.claim4), 0) },
			key:  func(w *blockWorld) string { return w.claim4 },
			fix:  func(w *blockWorld) string { return "etcdctl del " + w.claim4 }},
		// The claiming node's agent is gone: an expired block, reusable when its lease expires, or
		// at once with node forget.
		{name: "claim of a gone node", kind: KindBlockStale, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) { w.del(t, keyspace.NodeKey(wCluster, wNode)) },
			key:  func(w *blockWorld) string { return w.claim4 },
			fix:  func(w *blockWorld) string { return "leaseholdctl node forget " + wNode + " --cluster " + wCluster }},
		// The node was replaced: its record has another node UID than the claim. node forget
		// refuses while the name has an agent; the old identity's block lease can go.
		{name: "claim of a replaced node", kind: KindBlockStale, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, keyspace.NodeKey(wCluster, wNode), keyspace.Encode(keyspace.NodeRecord{UID: "uid-other", Blocks: true}), w.nodeLease)
			},
			key: func(w *blockWorld) string { return w.claim6 },
			fix: func(w *blockWorld) string { return "etcdctl lease revoke " + keyspace.LeaseHex(w.blockL) }},
		// An allocation in the flat layout of a block pool: agents compare only the block key.
		{name: "flat allocation in a block pool", kind: KindWrongLayout, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { put(t, w.cli, flatKey, w.value(t, w.ip4), w.pod) },
			key:  func(*blockWorld) string { return flatKey },
			fix:  func(*blockWorld) string { return "leaseholdctl pool migrate " + wPool }},
		// The same for a quarantine key.
		{name: "flat quarantine key in a block pool", kind: KindWrongLayout, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, keyspace.QuarantineKey(wPool, allocator.Blocks{}, ip("10.77.0.42")), "{}", w.q)
			},
			key: func(*blockWorld) string { return keyspace.QuarantineKey(wPool, allocator.Blocks{}, ip("10.77.0.42")) },
			fix: func(*blockWorld) string { return "leaseholdctl pool migrate " + wPool }},
		// An allocation in a block of the wrong size: moved to its block, guarded.
		{name: "allocation in the wrong block", kind: KindWrongLayout, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { put(t, w.cli, wrongBlock, w.value(t, w.ip4), w.pod) },
			key:  func(*blockWorld) string { return wrongBlock },
			fix: func(*blockWorld) string {
				return `'create("` + rightOfWrong + `") = "0"' '' 'put ` + rightOfWrong + ` `
			}},
		// A flat key whose block key exists protects nothing: deleted.
		{name: "flat allocation beside its block key", kind: KindWrongLayout, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, keyspace.IPKey(wPool, allocator.Blocks{}, ip("10.77.0.10")), w.value(t, w.ip4), w.pod)
			},
			key: func(*blockWorld) string { return keyspace.IPKey(wPool, allocator.Blocks{}, ip("10.77.0.10")) },
			fix: func(*blockWorld) string {
				return "etcdctl del " + keyspace.IPKey(wPool, allocator.Blocks{}, ip("10.77.0.10"))
			}},
		// A block key in a pool of the flat layout: moved to the flat key.
		{name: "block allocation in a flat pool", kind: KindWrongLayout, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { storeFlat(t, w.cli, readSpec(t, w)) },
			key:  func(w *blockWorld) string { return w.ip4 },
			fix: func(*blockWorld) string {
				return `'put ` + keyspace.IPKey(wPool, allocator.Blocks{}, ip("10.77.0.10")) + ` `
			}},
		// A pool frozen by a migration that did not finish.
		{name: "pool frozen", kind: KindPoolMigrating, severity: SeverityWarning,
			seed: func(t *testing.T, w *blockWorld) {
				rec := keyspace.NewPoolRecord(readSpec(t, w))
				rec.Migrating = &keyspace.Migration{By: "someone", Since: time.Now()}
				put(t, w.cli, keyspace.PoolKey(wPool), keyspace.Encode(rec), 0)
			},
			key: func(*blockWorld) string { return keyspace.PoolKey(wPool) },
			fix: func(*blockWorld) string { return "leaseholdctl pool migrate " + wPool }},
		// A pool still in the flat layout.
		{name: "pool flat", kind: KindPoolFlat, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) {
				storeFlat(t, w.cli, adminPool("old", allocator.RangeSet{adminRange("10.78.0.0/24")}))
			},
			key: func(*blockWorld) string { return keyspace.PoolKey("old") },
			fix: func(*blockWorld) string { return "leaseholdctl pool migrate old" }},
		// The node died: its claim expired before its pods' leases. Nothing to do.
		{name: "allocations of a dead node in an unclaimed block", kind: KindUnclaimedBlock, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) {
				w.del(t, keyspace.NodeKey(wCluster, wNode))
				w.del(t, w.claim4)
			},
			key: func(w *blockWorld) string { return w.ip4 },
			fix: func(*blockWorld) string { return "" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newBlockWorld(t, cli)
			if fs := w.check(t); len(fs) != 0 {
				t.Fatalf("findings on a healthy block layout: %+v", fs)
			}
			tt.seed(t, w)
			fs := w.check(t)
			f := findingOf(fs, tt.kind, tt.key(w))
			if f == nil {
				t.Fatalf("no %s finding for %s in %+v", tt.kind, tt.key(w), fs)
			}
			if f.Severity != tt.severity || f.Message == "" || !strings.Contains(f.Fix, tt.fix(w)) || (tt.fix(w) == "" && f.Fix != "") {
				t.Errorf("finding %+v: want severity %s and a fix containing %q", *f, tt.severity, tt.fix(w))
			}
			if f.Problem() != (tt.severity != SeverityInfo) {
				t.Errorf("Problem() = %v for severity %s", f.Problem(), f.Severity)
			}
		})
	}
	// An allocation of a live node in a block nobody claims is a static address: no finding.
	t.Run("static address of a live node", func(t *testing.T) {
		w := newBlockWorld(t, cli)
		w.del(t, w.claim4)
		if fs := w.check(t); len(fs) != 0 {
			t.Errorf("findings: %+v", fs)
		}
	})
}

func readSpec(t *testing.T, w *blockWorld) allocator.PoolSpec {
	t.Helper()
	spec, _, _ := stored(t, w.cli, wPool)
	return spec
}
