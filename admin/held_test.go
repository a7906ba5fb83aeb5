package admin

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// Held keys (issue 23): the blockWorld of doctor_blocks_test.go is the healthy state, with
// web's held keys on n1's block lease beside its allocations. Its node "dies" here by the pod
// lease being revoked (every key of the pod goes, as at expiry) and the node record deleted.

func heldValue(cluster, node, owner string) string {
	return keyspace.Encode(keyspace.HeldRecord{Cluster: cluster, Node: node, Owner: owner})
}

// expire ends web's pod lease as etcd does when its node is cut off: its allocations, owner
// index and pod record go; its held keys, on the block lease, stay.
func (w *blockWorld) expire(t *testing.T) {
	t.Helper()
	if _, err := w.cli.Revoke(etcdtest.Ctx(t), w.pod); err != nil {
		t.Fatal(err)
	}
}

func readState(t *testing.T, cli *clientv3.Client) *State {
	t.Helper()
	st, err := ReadState(etcdtest.Ctx(t), cli)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func heldKeys(hs []HeldEntry) []string {
	var out []string
	for _, h := range hs {
		out = append(out, h.Key)
	}
	return out
}

func TestReadStateHeldKeysExpiredAddressesAndBlocks(t *testing.T) {
	cli := privateEtcd(t)
	w := newBlockWorld(t, cli)
	ip := netip.MustParseAddr
	flat := keyspace.HeldKey(wPool, allocator.Blocks{}, ip("10.77.0.30"))
	put(t, cli, flat, heldValue(wCluster, wNode, "u-flat"), w.blockL)
	put(t, cli, keyspace.HeldPrefix(wPool)+"10.77.0.0-26/not-an-ip", "{}", w.blockL)
	put(t, cli, keyspace.HeldPrefix(wPool)+"::ffff:10.77.0.31", "{}", w.blockL)

	st := readState(t, cli)
	if got := heldKeys(st.Held); !slices.Equal(got, []string{w.held4, flat, w.held6}) {
		t.Errorf("held keys %v, want web's two and the flat one, in key order", got)
	}
	if len(st.BadKeys) != 2 {
		t.Errorf("bad keys %+v, want the two malformed held keys", st.BadKeys)
	}
	h := st.HeldAt(wPool, ip("10.77.0.10"))
	if len(h) != 1 || h[0].Block != w.block4 || h[0].Value != (keyspace.HeldRecord{Cluster: wCluster, Node: wNode, Owner: "u-web"}) || h[0].Lease != w.blockL {
		t.Errorf("held key of 10.77.0.10: %+v", h)
	}
	// Allocated addresses are not expired; the flat held key without allocation is.
	if got := heldKeys(st.Expired()); !slices.Equal(got, []string{flat}) {
		t.Errorf("expired %v, want only %s", got, flat)
	}
	if got := st.ExpiredBlocks(); len(got) != 0 || st.AgentOf(wCluster, wNode, wUID) != AgentLive {
		t.Errorf("expired blocks of a live node: %+v", got)
	}

	// The pod lease expires: web's addresses are expired, its held keys stay.
	w.expire(t)
	st = readState(t, cli)
	if got := heldKeys(st.Expired()); !slices.Equal(got, []string{w.held4, flat, w.held6}) {
		t.Errorf("expired after the pod lease: %v", got)
	}
	// The agent goes too: its blocks are expired.
	w.del(t, keyspace.NodeKey(wCluster, wNode))
	st = readState(t, cli)
	if got := st.ExpiredBlocks(); len(got) != 2 || got[0].Key != w.claim4 || got[1].Key != w.claim6 {
		t.Errorf("expired blocks of a gone node: %+v", got)
	}
	if a := st.AgentOf(wCluster, wNode, wUID); a != AgentGone {
		t.Errorf("agent %s, want gone", a)
	}
	// A replacement under the same name: another node UID.
	put(t, cli, keyspace.NodeKey(wCluster, wNode), keyspace.Encode(keyspace.NodeRecord{UID: "uid-new"}), w.nodeLease)
	st = readState(t, cli)
	if a, b := st.AgentOf(wCluster, wNode, wUID), st.AgentOf(wCluster, wNode, ""); a != AgentReplaced || b != AgentLive {
		t.Errorf("agent of the old UID %s (want replaced), of any UID %s (want live)", a, b)
	}
	if len(st.ExpiredBlocks()) != 2 {
		t.Errorf("blocks of a replaced node are not expired")
	}

	// A narrow read that did not read the allocations reports nothing expired.
	narrow, err := ReadKeys(etcdtest.Ctx(t), cli, keyspace.HeldPrefix(""))
	if err != nil {
		t.Fatal(err)
	}
	if len(narrow.Held) != 3 || len(narrow.Expired()) != 0 || narrow.AgentOf(wCluster, wNode, "") != AgentUnknown {
		t.Errorf("narrow read: %d held, expired %v, agent %s", len(narrow.Held), heldKeys(narrow.Expired()), narrow.AgentOf(wCluster, wNode, ""))
	}

	// When they become reusable: the block lease's TTL; a lease etcd no longer has is -1.
	gone := grant(t, cli)
	if _, err := cli.Revoke(etcdtest.Ctx(t), gone); err != nil {
		t.Fatal(err)
	}
	ttls, err := LeaseTTLs(etcdtest.Ctx(t), cli, w.blockL, w.blockL, gone, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(ttls) != 3 || ttls[w.blockL].TTL <= 0 || ttls[w.blockL].GrantedTTL != 120 || ttls[gone].TTL != -1 || ttls[0].TTL != -1 {
		t.Errorf("lease TTLs %+v", ttls)
	}
}

// TestFindAddressTellsAnExpiredAddress: alloc show's read finds a held key without allocation,
// and covers the allocation key, so Expired says so; with the allocation it is not expired.
func TestFindAddressTellsAnExpiredAddress(t *testing.T) {
	cli := privateEtcd(t)
	w := newBlockWorld(t, cli)
	ip := netip.MustParseAddr("10.77.0.10")
	st, err := FindAddress(etcdtest.Ctx(t), cli, "", ip)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Allocations) != 1 || len(st.Held) != 1 || len(st.Expired()) != 0 || st.AgentOf(wCluster, wNode, "") != AgentLive {
		t.Fatalf("allocated: %d allocations, %d held, expired %v", len(st.Allocations), len(st.Held), heldKeys(st.Expired()))
	}
	w.expire(t)
	w.del(t, keyspace.NodeKey(wCluster, wNode))
	st, err = FindAddress(etcdtest.Ctx(t), cli, wPool, ip)
	if err != nil {
		t.Fatal(err)
	}
	if got := heldKeys(st.Expired()); len(st.Allocations) != 0 || !slices.Equal(got, []string{w.held4}) {
		t.Errorf("expired: %d allocations, expired %v", len(st.Allocations), got)
	}
	if st.AgentOf(wCluster, wNode, "") != AgentGone {
		t.Errorf("the node record was not read: agent %s", st.AgentOf(wCluster, wNode, ""))
	}
	if c, ok := st.Claim(wPool, w.block4); !ok || c.Value.Node != wNode {
		t.Errorf("block claim of the expired address not read")
	}
}

// TestDoctorHeldKeys seeds one state of held keys per row into a healthy block layout and
// checks what doctor reports: expired addresses and blocks as information, inconsistent held
// keys as errors, each with its fix.
func TestDoctorHeldKeys(t *testing.T) {
	cli := privateEtcd(t)
	ip := netip.MustParseAddr
	other := keyspace.HeldKey(wPool, allocator.DefaultBlocks, ip("10.77.0.50"))
	tests := []struct {
		name     string
		seed     func(t *testing.T, w *blockWorld)
		kind     string
		severity string
		key      func(w *blockWorld) string
		fix      func(w *blockWorld) string // contained in the finding's fix; "" wants no fix
		says     []string
	}{
		// The node was cut off: its pod's lease expired, its agent is gone. Information: the
		// addresses come back when the block lease ends, or at once with node forget.
		{name: "expired addresses of a gone node", kind: KindAddressExpired, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) {
				w.expire(t)
				w.del(t, keyspace.NodeKey(wCluster, wNode))
			},
			key:  func(w *blockWorld) string { return w.held4 },
			fix:  func(*blockWorld) string { return "leaseholdctl node forget n1 --cluster c1" },
			says: []string{"2 address(es)", "10.77.0.10, fd77::10", "node c1/n1", "no agent"}},
		// The pods' leases expired but the agent is back: it re-claims or frees them.
		{name: "expired addresses of a node that is back", kind: KindAddressExpired, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) { w.expire(t) },
			key:  func(w *blockWorld) string { return w.held6 },
			fix:  func(*blockWorld) string { return "" },
			says: []string{"has an agent again", "Nothing to do"}},
		// The expired blocks of the gone node, beside them.
		{name: "expired block of a gone node", kind: KindBlockStale, severity: SeverityInfo,
			seed: func(t *testing.T, w *blockWorld) {
				w.expire(t)
				w.del(t, keyspace.NodeKey(wCluster, wNode))
			},
			key:  func(w *blockWorld) string { return w.claim6 },
			fix:  func(*blockWorld) string { return "leaseholdctl node forget n1 --cluster c1" },
			says: []string{"expired block", "reuse delay"}},
		// Written with a plain etcdctl put: it never expires. Back on the node's block lease.
		{name: "held key without lease", kind: KindNoLease, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { put(t, w.cli, w.held4, w.value(t, w.held4), 0) },
			key:  func(w *blockWorld) string { return w.held4 },
			fix:  func(w *blockWorld) string { return "--lease=" + keyspace.LeaseHex(w.blockL) },
			says: []string{"never expires", "leak"}},
		// The same of a gone node: no block lease to put it back on, so it is deleted, guarded.
		{name: "held key without lease of a gone node", kind: KindNoLease, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, other, heldValue(wCluster, "n9", "u-x"), 0)
			},
			key: func(*blockWorld) string { return other },
			fix: func(*blockWorld) string { return `'' 'del ` + other + `'` }},
		// A value that is no held record.
		{name: "held key unreadable", kind: KindUnreadable, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { put(t, w.cli, other, "garbage", w.blockL) },
			key:  func(*blockWorld) string { return other },
			fix:  func(*blockWorld) string { return "etcdctl del " + other }},
		// A claim took the address without writing its own held key: written for the holder on
		// its node's block lease, compared with the allocation.
		{name: "held key naming another holder", kind: KindHeldOtherHolder, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, w.held4, heldValue(wCluster, "n2", "u-old"), w.blockL)
			},
			key: func(w *blockWorld) string { return w.held4 },
			fix: func(w *blockWorld) string {
				return "'put " + w.held4 + " " + strconv.Quote(heldValue(wCluster, wNode, "u-web")) + " --lease=" + keyspace.LeaseHex(w.blockL) + "'"
			},
			says: []string{"names node c1/n2 and owner u-old", "owner u-web"}},
		// The holder's node names no block lease (its agent is gone): the held key is deleted, guarded.
		{name: "held key naming another holder of a gone node", kind: KindHeldOtherHolder, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				w.del(t, keyspace.NodeKey(wCluster, wNode))
				put(t, w.cli, w.held6, heldValue(wCluster, wNode, "u-someone"), w.blockL)
			},
			key: func(w *blockWorld) string { return w.held6 },
			fix: func(w *blockWorld) string { return `'' 'del ` + w.held6 + `'` }},
		// A held key of the flat layout in a block pool holds nothing back: pool migrate moves it.
		{name: "flat held key in a block pool", kind: KindWrongLayout, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) {
				put(t, w.cli, keyspace.HeldKey(wPool, allocator.Blocks{}, ip("10.77.0.40")), heldValue(wCluster, wNode, "u-x"), w.blockL)
			},
			key:  func(*blockWorld) string { return keyspace.HeldKey(wPool, allocator.Blocks{}, ip("10.77.0.40")) },
			fix:  func(*blockWorld) string { return "leaseholdctl pool migrate " + wPool },
			says: []string{"holds the address back for nobody"}},
		// A malformed held key.
		{name: "held key malformed", kind: KindBadKey, severity: SeverityError,
			seed: func(t *testing.T, w *blockWorld) { put(t, w.cli, keyspace.HeldPrefix(wPool)+"x", "{}", w.blockL) },
			key:  func(*blockWorld) string { return keyspace.HeldPrefix(wPool) + "x" },
			fix:  func(*blockWorld) string { return "etcdctl del " + keyspace.HeldPrefix(wPool) + "x" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newBlockWorld(t, cli)
			if fs := w.check(t); len(fs) != 0 {
				t.Fatalf("findings on a healthy state with held keys: %+v", fs)
			}
			tt.seed(t, w)
			fs := w.check(t)
			f := findingOf(fs, tt.kind, tt.key(w))
			if f == nil {
				t.Fatalf("no %s finding for %s in %+v", tt.kind, tt.key(w), fs)
			}
			want := tt.fix(w)
			if f.Severity != tt.severity || !strings.Contains(f.Fix, want) || (want == "" && f.Fix != "") {
				t.Errorf("finding %+v: want severity %s and a fix containing %q", *f, tt.severity, want)
			}
			for _, s := range tt.says {
				if !strings.Contains(f.Message, s) {
					t.Errorf("message %q does not say %q", f.Message, s)
				}
			}
			if tt.severity == SeverityInfo {
				for _, f := range fs {
					if f.Problem() {
						t.Errorf("an expired node is no problem, but doctor reports %+v", f)
					}
				}
			}
		})
	}
}

func TestAdminReleaseDeletesHeldKeys(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	w := newBlockWorld(t, cli)
	ip := netip.MustParseAddr
	// A held key of web's v4 address left in the flat layout too, and another address's.
	flat := keyspace.HeldKey(wPool, allocator.Blocks{}, ip("10.77.0.10"))
	put(t, cli, flat, heldValue(wCluster, wNode, "u-web"), w.blockL)
	other := keyspace.HeldKey(wPool, allocator.DefaultBlocks, ip("10.77.0.11"))
	put(t, cli, other, heldValue(wCluster, wNode, "u-other"), w.blockL)

	res, err := Release(ctx, cli, wPool, ip("10.77.0.10"), ReleaseOptions{Force: true})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(res.HeldKeys)
	want := []string{flat, w.held4, w.held6}
	slices.Sort(want)
	if len(res.Addresses) != 2 || res.OwnerIndex != w.owner || !slices.Equal(res.HeldKeys, want) {
		t.Errorf("released %d addresses, owner index %q, held keys %v; want both, %s, %v", len(res.Addresses), res.OwnerIndex, res.HeldKeys, w.owner, want)
	}
	after := dumpKVs(t, cli, keyspace.HeldPrefix(wPool))
	if len(after) != 1 || after[other].lease != int64(w.blockL) {
		t.Errorf("held keys after the release: %v, want only %s", after, other)
	}
	// The released address is free, not expired.
	if st := readState(t, cli); len(st.Expired()) != 1 || st.Expired()[0].Key != other {
		t.Errorf("expired after the release: %v", heldKeys(st.Expired()))
	}
}

func TestMigratePoolMovesHeldKeys(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	storeFlat(t, cli, adminPool("net", allocator.RangeSet{adminRange("10.79.0.0/24")}, allocator.RangeSet{adminRange("fd79::/120")}))
	nodeRecord(t, cli, "c1", "n1", true)
	pod, blockL := grant(t, cli), grant(t, cli)
	flat := allocator.Blocks{}
	ip := netip.MustParseAddr
	want := map[string]kv{} // block key -> value and lease
	// 60 attachments (more than a batch), each an allocation with its held key; one expired
	// address (a held key alone); one v6.
	for i := range 60 {
		a := ip(fmt.Sprintf("10.79.0.%d", 10+i))
		owner := fmt.Sprint("o", i)
		put(t, cli, keyspace.IPKey("net", flat, a), allocValue(owner), pod)
		put(t, cli, keyspace.HeldKey("net", flat, a), heldValue("c1", "n1", owner), blockL)
		want[keyspace.IPKey("net", allocator.DefaultBlocks, a)] = kv{allocValue(owner), int64(pod)}
		want[keyspace.HeldKey("net", allocator.DefaultBlocks, a)] = kv{heldValue("c1", "n1", owner), int64(blockL)}
	}
	for _, a := range []netip.Addr{ip("10.79.0.200"), ip("fd79::20")} {
		put(t, cli, keyspace.HeldKey("net", flat, a), heldValue("c1", "n1", "gone"), blockL)
		want[keyspace.HeldKey("net", allocator.DefaultBlocks, a)] = kv{heldValue("c1", "n1", "gone"), int64(blockL)}
	}
	rep, err := MigratePool(ctx, cli, "net", "test")
	if err != nil || rep.MovedAllocations != 60 || rep.MovedHeld != 62 || rep.Revision == 0 {
		t.Fatalf("MigratePool: %+v, %v; want 60 allocations and 62 held keys moved, unfrozen", rep, err)
	}
	got := dumpKVs(t, cli, keyspace.Prefix)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %+v, want %+v", k, got[k], v)
		}
	}
	for k := range got {
		if p, b, _, err := keyspace.ParseHeldKey(k); err == nil && p == "net" && !b.IsValid() {
			t.Errorf("held key %s left in the flat layout", k)
		}
	}
	// Doctor finds nothing wrong with the moved held keys; the expired addresses are information.
	expiredSeen := false
	for _, f := range Check(readState(t, cli)) {
		if !strings.Contains(strings.Join(f.Keys, " "), keyspace.HeldPrefix("net")) {
			continue // the hand-written allocations have no owner index: not this test's
		}
		expiredSeen = expiredSeen || f.Kind == KindAddressExpired
		if f.Problem() || f.Kind != KindAddressExpired || len(f.Keys) != 2 {
			t.Errorf("doctor after the migration: %+v", f)
		}
	}
	if !expiredSeen {
		t.Errorf("doctor does not tell the two expired addresses")
	}

	// A flat held key whose block key exists is left, as an allocation would be, and named.
	storeFlat(t, cli, adminPool("net2", allocator.RangeSet{adminRange("10.78.0.0/24")}))
	a := ip("10.78.0.5")
	put(t, cli, keyspace.HeldKey("net2", flat, a), heldValue("c1", "n1", "x"), blockL)
	put(t, cli, keyspace.HeldKey("net2", allocator.DefaultBlocks, a), heldValue("c1", "n2", "y"), blockL)
	rep, err = MigratePool(ctx, cli, "net2", "test")
	if !errors.Is(err, ErrMigrateConflicts) || len(rep.Conflicts) != 1 || !rep.Conflicts[0].Held || rep.Conflicts[0].Quarantine ||
		rep.Conflicts[0].Old != keyspace.HeldKey("net2", flat, a) {
		t.Errorf("conflicting held key: %+v, %v", rep, err)
	}
}

func TestForgetNode(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	w := newBlockWorld(t, cli)
	ip := netip.MustParseAddr
	// Another node's claim and held key, which must stay.
	otherL := grant(t, cli)
	otherClaim := keyspace.BlockKey(wPool, netip.MustParsePrefix("10.77.0.64/26"))
	put(t, cli, otherClaim, keyspace.Encode(keyspace.BlockRecord{Cluster: wCluster, Node: "n2", NodeUID: "uid-n2"}), otherL)
	otherHeld := keyspace.HeldKey(wPool, allocator.DefaultBlocks, ip("10.77.0.70"))
	put(t, cli, otherHeld, heldValue(wCluster, "n2", "u-n2"), otherL)
	// An expired address of n1 from earlier, and one of a node n1 in another cluster.
	expired := keyspace.HeldKey(wPool, allocator.DefaultBlocks, ip("10.77.0.30"))
	put(t, cli, expired, heldValue(wCluster, wNode, "u-old"), w.blockL)
	elsewhere := keyspace.HeldKey(wPool, allocator.DefaultBlocks, ip("10.77.0.31"))
	put(t, cli, elsewhere, heldValue("c2", wNode, "u-c2"), otherL)
	before := dumpKVs(t, cli, keyspace.Prefix)

	// Its agent runs: refused, naming the node record's lease and its TTL; nothing changes.
	_, err := ForgetNode(ctx, cli, wCluster, wNode)
	var inUse *NodeInUseError
	if !errors.As(err, &inUse) || !errors.Is(err, ErrNodeAlive) || inUse.Record == nil || inUse.TTL <= 0 {
		t.Fatalf("ForgetNode of a live node: %v", err)
	}
	for _, s := range []string{keyspace.NodeKey(wCluster, wNode), keyspace.LeaseHex(w.nodeLease), "left", "stop its agent", "uid-n1"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("refusal %q does not say %q", err, s)
		}
	}
	// Its agent stopped, but its pod's lease lives: refused too, it may come back and resume it.
	w.del(t, keyspace.NodeKey(wCluster, wNode))
	_, err = ForgetNode(ctx, cli, wCluster, wNode)
	if !errors.As(err, &inUse) || inUse.Record != nil || inUse.Pods != 1 || !strings.Contains(err.Error(), keyspace.PodsPrefix(wCluster, wNode)) {
		t.Fatalf("ForgetNode with a live pod lease: %v", err)
	}
	if after := dumpKVs(t, cli, keyspace.Prefix); len(after) != len(before)-1 {
		t.Errorf("a refused forget changed keys: %d before (less the node record), %d after", len(before)-1, len(after))
	}
	// Without a cluster, the node's keys in two clusters are ambiguous.
	var amb *NodeClustersError
	if _, err := ForgetNode(ctx, cli, "", wNode); !errors.As(err, &amb) || !errors.Is(err, ErrAmbiguousNode) || !slices.Equal(amb.Clusters, []string{"c1", "c2"}) {
		t.Errorf("ForgetNode without a cluster: %v", err)
	}

	// The node is gone: its blocks and every held key naming it go; the others stay.
	w.expire(t)
	rep, err := ForgetNode(ctx, cli, wCluster, wNode)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Blocks) != 2 || len(rep.Held) != 3 || !slices.Equal(rep.Leases, []string{keyspace.LeaseHex(w.blockL)}) || len(rep.Kept) != 0 ||
		rep.Revision == 0 || rep.Nothing() {
		t.Errorf("report %+v: want 2 blocks, 3 held keys on the block lease", rep)
	}
	after := dumpKVs(t, cli, keyspace.Prefix)
	for _, k := range []string{w.claim4, w.claim6, w.held4, w.held6, expired} {
		if _, ok := after[k]; ok {
			t.Errorf("%s still exists", k)
		}
	}
	for _, k := range []string{otherClaim, otherHeld, elsewhere, keyspace.PoolKey(wPool), w.quar} {
		if _, ok := after[k]; !ok {
			t.Errorf("%s was deleted", k)
		}
	}
	st := readState(t, cli)
	if len(st.ExpiredBlocks()) != 1 || st.ExpiredBlocks()[0].Key != otherClaim {
		t.Errorf("expired blocks after forget: %+v", st.ExpiredBlocks())
	}
	// Idempotent: a second run finds nothing.
	if rep, err := ForgetNode(ctx, cli, wCluster, wNode); err != nil || !rep.Nothing() || rep.Revision != 0 {
		t.Errorf("second run: %+v, %v", rep, err)
	}
	// Without a cluster, the one cluster still naming the node is found.
	if rep, err := ForgetNode(ctx, cli, "", wNode); err != nil || rep.Cluster != "c2" || len(rep.Held) != 1 || rep.Held[0].Key != elsewhere {
		t.Errorf("ForgetNode without a cluster: %+v, %v", rep, err)
	}
	if _, err := ForgetNode(ctx, cli, "c1", "a/b"); !errors.Is(err, allocator.ErrInvalidName) {
		t.Errorf("a bad node name: %v", err)
	}
}

// TestForgetNodeLeavesWhatChangedMeanwhile drives the delete step against keys changed after
// the read: a held key another node's claim took over is kept, one still naming the node is
// deleted at its new revision, one gone is counted, and a node record that appeared stops it.
func TestForgetNodeLeavesWhatChangedMeanwhile(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	lease := grant(t, cli)
	ip := netip.MustParseAddr
	key := func(s string) string { return keyspace.HeldKey("net", allocator.DefaultBlocks, ip(s)) }
	rev := map[string]int64{}
	for _, s := range []string{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"} {
		resp, err := cli.Put(ctx, key(s), heldValue("c1", "n1", "u"), clientv3.WithLease(lease))
		if err != nil {
			t.Fatal(err)
		}
		rev[s] = resp.Header.Revision
	}
	put(t, cli, key("10.1.0.1"), heldValue("c1", "n2", "u-thief"), lease) // taken over by n2's claim
	put(t, cli, key("10.1.0.2"), heldValue("c1", "n1", "u2"), lease)      // rewritten, still n1's
	if _, err := cli.Delete(ctx, key("10.1.0.3")); err != nil {           // expired meanwhile
		t.Fatal(err)
	}
	rep := ForgetReport{}
	f := &forgetter{cli: cli, cluster: "c1", node: "n1", rep: &rep, nodeKey: keyspace.NodeKey("c1", "n1"), leases: map[string]bool{}}
	var ts []forgetTarget
	for _, s := range []string{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"} {
		ts = append(ts, forgetTarget{ForgottenKey{Key: key(s), Pool: "net", IP: ip(s)}, rev[s], true})
	}
	if err := f.batch(ctx, ts); err != nil {
		t.Fatal(err)
	}
	if len(rep.Kept) != 1 || rep.Kept[0].Key != key("10.1.0.1") || !strings.Contains(rep.Kept[0].Reason, "c1/n2") || rep.Gone != 1 || len(rep.Held) != 2 {
		t.Errorf("report %+v: want 10.1.0.1 kept (n2's now), 10.1.0.3 gone, 10.1.0.2 and 10.1.0.4 deleted", rep)
	}
	after := dumpKVs(t, cli, keyspace.HeldPrefix(""))
	if len(after) != 1 || after[key("10.1.0.1")].value != heldValue("c1", "n2", "u-thief") {
		t.Errorf("held keys after: %v", after)
	}
	// An agent of the node registers between the read and the delete: nothing more is deleted.
	resp, err := cli.Put(ctx, key("10.1.0.5"), heldValue("c1", "n1", "u"), clientv3.WithLease(lease))
	if err != nil {
		t.Fatal(err)
	}
	nodeRecord(t, cli, "c1", "n1", true)
	err = f.batch(ctx, []forgetTarget{{ForgottenKey{Key: key("10.1.0.5")}, resp.Header.Revision, true}})
	if !errors.Is(err, ErrNodeAlive) {
		t.Errorf("delete with the node back: %v, want refused", err)
	}
	if len(dumpKVs(t, cli, key("10.1.0.5"))) != 1 {
		t.Errorf("the held key was deleted though the node came back")
	}
}
