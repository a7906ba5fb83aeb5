package admin

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// privateEtcd is an etcd of the test's own: pool migrate refuses on any live node record of
// an older agent, and doctor reads every key, so these tests must not see other tests' keys.
func privateEtcd(t *testing.T) *clientv3.Client {
	t.Helper()
	srv, stop, err := etcdtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return etcdtest.ClientAt(t, srv.ClientURL)
}

// kv is one key as etcd holds it.
type kv struct {
	value string
	lease int64
}

func dumpKVs(t *testing.T, cli *clientv3.Client, prefix string) map[string]kv {
	t.Helper()
	resp, err := cli.Get(etcdtest.Ctx(t), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]kv{}
	for _, x := range resp.Kvs {
		out[string(x.Key)] = kv{string(x.Value), x.Lease}
	}
	return out
}

func put(t *testing.T, cli *clientv3.Client, key, value string, lease clientv3.LeaseID) {
	t.Helper()
	var opts []clientv3.OpOption
	if lease != 0 {
		opts = append(opts, clientv3.WithLease(lease))
	}
	if _, err := cli.Put(etcdtest.Ctx(t), key, value, opts...); err != nil {
		t.Fatal(err)
	}
}

func grant(t *testing.T, cli *clientv3.Client) clientv3.LeaseID {
	t.Helper()
	g, err := cli.Grant(etcdtest.Ctx(t), 120)
	if err != nil {
		t.Fatal(err)
	}
	return g.ID
}

// storeFlat stores spec in the flat layout of the release before blocks: {"name","ranges",...}.
func storeFlat(t *testing.T, cli *clientv3.Client, spec allocator.PoolSpec) allocator.PoolSpec {
	t.Helper()
	spec.Blocks = allocator.Blocks{}
	spec = mustCanon(t, spec)
	put(t, cli, keyspace.PoolKey(spec.Name), keyspace.EncodePool(spec), 0)
	return spec
}

// nodeRecord puts a live agent's node record (on a lease of its own).
func nodeRecord(t *testing.T, cli *clientv3.Client, cluster, node string, blocks bool) {
	t.Helper()
	rec := keyspace.NodeRecord{UID: "uid-" + node, Host: "host-" + node, Version: "v-" + node, Blocks: blocks, Started: time.Now().UTC()}
	put(t, cli, keyspace.NodeKey(cluster, node), keyspace.Encode(rec), grant(t, cli))
}

func stored(t *testing.T, cli *clientv3.Client, pool string) (allocator.PoolSpec, *keyspace.Migration, map[string]any) {
	t.Helper()
	v := dumpKVs(t, cli, keyspace.PoolKey(pool))[keyspace.PoolKey(pool)].value
	spec, mig, err := keyspace.DecodePool(keyspace.PoolKey(pool), []byte(v))
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	if err := json.Unmarshal([]byte(v), &raw); err != nil {
		t.Fatal(err)
	}
	return spec, mig, raw
}

func allocValue(owner string) string {
	return keyspace.Encode(keyspace.Allocation{Owner: owner, Cluster: "c1", Node: "n1", NodeUID: "uid-n1", IfName: "eth0"})
}

func TestMigratePoolMovesEveryKeyKeepingValueAndLease(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	spec := storeFlat(t, cli, adminPool("net", allocator.RangeSet{adminRange("10.70.0.0/24")}, allocator.RangeSet{adminRange("fd70::/120")}))
	storeFlat(t, cli, adminPool("netb", allocator.RangeSet{adminRange("10.70.0.0/24")}))
	nodeRecord(t, cli, "c1", "n1", true) // an upgraded agent does not hold the migration back
	pod1, pod2, pods, quarantine := grant(t, cli), grant(t, cli), grant(t, cli), grant(t, cli)
	flat := allocator.Blocks{}
	ip := netip.MustParseAddr
	put(t, cli, keyspace.IPKey("net", flat, ip("10.70.0.10")), allocValue("o1"), pod1)
	put(t, cli, keyspace.IPKey("net", flat, ip("fd70::10")), allocValue("o1"), pod1)
	put(t, cli, keyspace.IPKey("net", flat, ip("10.70.0.100")), allocValue("o2"), pod2)
	put(t, cli, keyspace.IPKey("net", flat, ip("10.70.0.20")), allocValue("by-hand"), 0) // no lease: it keeps none
	for i := range 60 {                                                                  // more than one batch
		put(t, cli, keyspace.IPKey("net", flat, ip(fmt.Sprintf("10.70.0.%d", 150+i))), allocValue(fmt.Sprint("p", i)), pods)
	}
	put(t, cli, keyspace.QuarantineKey("net", flat, ip("10.70.0.30")), `{"releasedBy":"n1"}`, quarantine)
	put(t, cli, keyspace.QuarantineKey("net", flat, ip("fd70::30")), `{"releasedBy":"n1"}`, quarantine)
	put(t, cli, keyspace.IPKey("netb", flat, ip("10.70.0.10")), allocValue("other"), pod1) // another pool: untouched
	before := dumpKVs(t, cli, keyspace.Prefix)

	rep, err := MigratePool(ctx, cli, "net", "test")
	if err != nil {
		t.Fatalf("MigratePool: %v", err)
	}
	if rep.MovedAllocations != 64 || rep.MovedQuarantine != 2 || rep.AlreadyDone || rep.Resumed || len(rep.Conflicts) != 0 || rep.Gone != 0 ||
		rep.Blocks != allocator.DefaultBlocks || rep.FrozenRevision == 0 || rep.Revision <= rep.FrozenRevision {
		t.Errorf("report %+v, want 64 allocations and 2 quarantine keys moved into the default blocks", rep)
	}
	after := dumpKVs(t, cli, keyspace.Prefix)
	for key, was := range before {
		pool, block, a, err := keyspace.ParseIPKey(key)
		parsedQ := false
		if err != nil {
			if pool, block, a, err = keyspace.ParseQuarantineKey(key); err != nil {
				continue
			}
			parsedQ = true
		}
		if pool != "net" {
			if after[key] != was {
				t.Errorf("%s of another pool changed: %+v, was %+v", key, after[key], was)
			}
			continue
		}
		moved := keyspace.IPKey("net", allocator.DefaultBlocks, a)
		if parsedQ {
			moved = keyspace.QuarantineKey("net", allocator.DefaultBlocks, a)
		}
		if _, ok := after[key]; ok || block.IsValid() {
			t.Errorf("%s is still there after the migration", key)
		}
		if after[moved] != was {
			t.Errorf("%s moved to %s as %+v, want the same value and lease %+v", key, moved, after[moved], was)
		}
	}
	got, mig, raw := stored(t, cli, "net")
	want := spec
	want.Blocks = allocator.DefaultBlocks
	if !got.Equal(want) || mig != nil || raw["layout"] != "blocks" || raw["ranges"] != nil || raw["migrating"] != nil {
		t.Errorf("stored definition %s (migrating %+v, raw %v), want %s in the block shape, unfrozen", got, mig, raw, want)
	}
	st, err := ReadState(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range Check(st) {
		if f.Kind == KindWrongLayout || f.Kind == KindPoolMigrating || (f.Kind == KindPoolFlat && f.Keys[0] == keyspace.PoolKey("net")) {
			t.Errorf("doctor after the migration: %+v", f)
		}
	}

	again, err := MigratePool(ctx, cli, "net", "test")
	if err != nil || !again.AlreadyDone || again.MovedAllocations+again.MovedQuarantine != 0 || again.Blocks != allocator.DefaultBlocks {
		t.Errorf("second run: %+v, %v; want nothing to do", again, err)
	}
	if _, err := MigratePool(ctx, cli, "nope", "test"); !errors.Is(err, ErrNotFound) {
		t.Errorf("MigratePool of an undefined pool: %v, want not found", err)
	}
}

func TestMigratePoolRefusesWhileAnOlderAgentIsLive(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	storeFlat(t, cli, adminPool("net", allocator.RangeSet{adminRange("10.72.0.0/24")}))
	nodeRecord(t, cli, "c1", "new", true)
	nodeRecord(t, cli, "c2", "old", false)
	key := keyspace.IPKey("net", allocator.Blocks{}, netip.MustParseAddr("10.72.0.5"))
	put(t, cli, key, allocValue("o"), grant(t, cli))
	before := dumpKVs(t, cli, keyspace.Prefix)

	rep, err := MigratePool(ctx, cli, "net", "test")
	var old *AgentsNotUpgradedError
	if !errors.As(err, &old) || !errors.Is(err, ErrAgentsNotUpgraded) || len(old.Nodes) != 1 {
		t.Fatalf("MigratePool: %v, want the older agent refused", err)
	}
	for _, s := range []string{"c2/old", "uid-old", "host-old", "v-old", "--force"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not say %q", err, s)
		}
	}
	if strings.Contains(err.Error(), "c1/new") || rep.FrozenRevision != 0 {
		t.Errorf("error names the upgraded agent, or the pool was frozen: %v, %+v", err, rep)
	}
	if after := dumpKVs(t, cli, keyspace.Prefix); len(after) != len(before) || after[keyspace.PoolKey("net")] != before[keyspace.PoolKey("net")] || after[key] != before[key] {
		t.Errorf("a refused migration changed keys")
	}

	rep, err = MigratePool(ctx, cli, "net", "test", MigrateForce())
	if err != nil || !rep.Forced || rep.MovedAllocations != 1 {
		t.Errorf("forced: %+v, %v", rep, err)
	}
}

func TestMigratePoolResumesAFrozenPool(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	blocks := allocator.Blocks{IPv4: 28, IPv6: 124}
	spec := mustCanon(t, allocator.PoolSpec{Name: "net", Ranges: []allocator.RangeSet{{adminRange("10.73.0.0/24")}}, Blocks: blocks})
	// An earlier run froze the pool and moved one key, then stopped.
	rec := keyspace.NewPoolRecord(spec)
	rec.Migrating = &keyspace.Migration{By: "an earlier run", Since: time.Now().UTC()}
	put(t, cli, keyspace.PoolKey("net"), keyspace.Encode(rec), 0)
	lease := grant(t, cli)
	ip := netip.MustParseAddr
	put(t, cli, keyspace.IPKey("net", blocks, ip("10.73.0.5")), allocValue("moved"), lease)
	put(t, cli, keyspace.IPKey("net", allocator.Blocks{}, ip("10.73.0.6")), allocValue("left"), lease)
	put(t, cli, keyspace.QuarantineKey("net", allocator.Blocks{}, ip("10.73.0.7")), `{}`, lease)

	// The doctor says the pool is frozen, and how to finish.
	st, err := ReadState(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	if f := findingOf(Check(st), KindPoolMigrating, keyspace.PoolKey("net")); f == nil || f.Severity != SeverityWarning ||
		f.Fix != "leaseholdctl pool migrate net" || !strings.Contains(f.Message, "an earlier run") {
		t.Errorf("doctor on a frozen pool: %+v", f)
	}
	// Its block lengths are those it was frozen with.
	if _, err := MigratePool(ctx, cli, "net", "test", MigrateWithBlocks(allocator.DefaultBlocks)); !errors.Is(err, allocator.ErrInvalidConfig) {
		t.Errorf("resume with other block lengths: %v, want refused", err)
	}
	rep, err := MigratePool(ctx, cli, "net", "test")
	if err != nil || !rep.Resumed || rep.MovedAllocations != 1 || rep.MovedQuarantine != 1 || rep.Blocks != blocks {
		t.Fatalf("resume: %+v, %v", rep, err)
	}
	after := dumpKVs(t, cli, keyspace.Prefix)
	for _, k := range []string{keyspace.IPKey("net", blocks, ip("10.73.0.5")), keyspace.IPKey("net", blocks, ip("10.73.0.6")),
		keyspace.QuarantineKey("net", blocks, ip("10.73.0.7"))} {
		if after[k].lease != int64(lease) {
			t.Errorf("%s: %+v, want it on lease %x", k, after[k], lease)
		}
	}
	if got, mig, _ := stored(t, cli, "net"); mig != nil || got.Blocks != blocks {
		t.Errorf("definition after the resume: %s, migrating %+v", got, mig)
	}
}

func TestMigratePoolLeavesConflictsFrozenUntilResolved(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	storeFlat(t, cli, adminPool("net", allocator.RangeSet{adminRange("10.74.0.0/24")}))
	lease := grant(t, cli)
	ip := netip.MustParseAddr
	flat5, block5 := keyspace.IPKey("net", allocator.Blocks{}, ip("10.74.0.5")), keyspace.IPKey("net", allocator.DefaultBlocks, ip("10.74.0.5"))
	put(t, cli, flat5, allocValue("flat"), lease)
	put(t, cli, block5, allocValue("block"), lease) // one address, two keys: a hand edit
	put(t, cli, keyspace.IPKey("net", allocator.Blocks{}, ip("10.74.0.6")), allocValue("fine"), lease)

	rep, err := MigratePool(ctx, cli, "net", "test")
	if !errors.Is(err, ErrMigrateConflicts) || !strings.Contains(err.Error(), flat5) || !strings.Contains(err.Error(), "stays frozen") {
		t.Fatalf("MigratePool: %v, want the conflict named and the pool kept frozen", err)
	}
	if rep.MovedAllocations != 1 || len(rep.Conflicts) != 1 || rep.Conflicts[0] != (MigrateConflict{IP: ip("10.74.0.5"), Old: flat5, New: block5}) {
		t.Errorf("report %+v, want 10.74.0.6 moved and 10.74.0.5 a conflict", rep)
	}
	after := dumpKVs(t, cli, keyspace.IPsPrefix("net"))
	if after[flat5].value != allocValue("flat") || after[block5].value != allocValue("block") {
		t.Errorf("a conflicting key was changed: %v", after)
	}
	if _, mig, _ := stored(t, cli, "net"); mig == nil || mig.By != "test" {
		t.Errorf("pool not frozen after a conflict: %+v", mig)
	}
	// The doctor names the stale key of the flat layout and deletes it.
	st, err := ReadState(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	if f := findingOf(Check(st), KindPoolMigrating, keyspace.PoolKey("net")); f == nil {
		t.Errorf("doctor does not report the frozen pool")
	}
	if _, err := cli.Delete(ctx, flat5); err != nil {
		t.Fatal(err)
	}
	rep, err = MigratePool(ctx, cli, "net", "test")
	if err != nil || !rep.Resumed || rep.Revision == 0 {
		t.Errorf("after the conflict was resolved: %+v, %v", rep, err)
	}
}

func TestMigratePoolMovesKeysLeftInTheFlatLayoutOfABlockPool(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	if _, err := CreatePool(ctx, cli, adminPool("net", allocator.RangeSet{adminRange("10.75.0.0/24")})); err != nil {
		t.Fatal(err)
	}
	nodeRecord(t, cli, "c1", "old", false) // no freeze, so no agent check
	lease := grant(t, cli)
	put(t, cli, keyspace.IPKey("net", allocator.Blocks{}, netip.MustParseAddr("10.75.0.9")), allocValue("left"), lease)
	rep, err := MigratePool(ctx, cli, "net", "test", MigrateWithBlocks(allocator.Blocks{IPv4: 24}))
	if !errors.Is(err, allocator.ErrInvalidConfig) {
		t.Errorf("other blocks for a block pool: %+v, %v; want refused", rep, err)
	}
	rep, err = MigratePool(ctx, cli, "net", "test")
	if err != nil || rep.AlreadyDone || rep.MovedAllocations != 1 || rep.FrozenRevision != 0 {
		t.Errorf("leftover: %+v, %v; want it moved without a freeze", rep, err)
	}
	if k := keyspace.IPKey("net", allocator.DefaultBlocks, netip.MustParseAddr("10.75.0.9")); dumpKVs(t, cli, k)[k].lease != int64(lease) {
		t.Errorf("leftover not moved to %s", k)
	}
	if rep, err := MigratePool(ctx, cli, "net", "test"); err != nil || !rep.AlreadyDone {
		t.Errorf("second run: %+v, %v; want nothing to do", rep, err)
	}
}

func TestAdminCreatePoolStoresTheBlockShape(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	name, custom, flat := etcdtest.Uniq("ap"), etcdtest.Uniq("ap"), etcdtest.Uniq("ap")
	if _, err := CreatePool(ctx, cli, adminPool(name, allocator.RangeSet{adminRange("10.76.0.0/24")})); err != nil {
		t.Fatal(err)
	}
	spec, mig, raw := stored(t, cli, name)
	if spec.Blocks != allocator.DefaultBlocks || mig != nil || raw["layout"] != "blocks" || raw["rangeSets"] == nil {
		t.Errorf("stored %s (raw %v), want the default blocks in the block shape", spec, raw)
	}
	if _, ok := raw["ranges"]; ok {
		t.Errorf("the stored definition has \"ranges\", which an agent from before blocks would read: %v", raw)
	}
	// Given lengths are kept; a missing family gets the default.
	c := adminPool(custom, allocator.RangeSet{adminRange("10.76.1.0/24")})
	c.Blocks = allocator.Blocks{IPv4: 28}
	if _, err := CreatePool(ctx, cli, c); err != nil {
		t.Fatal(err)
	}
	if spec, _, _ := stored(t, cli, custom); spec.Blocks != (allocator.Blocks{IPv4: 28, IPv6: allocator.DefaultBlocks.IPv6}) {
		t.Errorf("stored blocks %+v, want /28 and the default /122", spec.Blocks)
	}
	c.Blocks = allocator.Blocks{IPv4: 27}
	if _, err := CreatePool(ctx, cli, c); !errors.Is(err, allocator.ErrPoolMismatch) {
		t.Errorf("other block lengths: %v, want a mismatch", err)
	}
	c.Blocks = allocator.Blocks{IPv4: 8}
	if _, err := CreatePool(ctx, cli, c); !errors.Is(err, allocator.ErrInvalidConfig) {
		t.Errorf("a /8 block: %v, want refused", err)
	}
	// A pool of the flat layout created again with its ranges and no lengths is unchanged.
	storeFlat(t, cli, adminPool(flat, allocator.RangeSet{adminRange("10.76.2.0/24")}))
	if created, err := CreatePool(ctx, cli, adminPool(flat, allocator.RangeSet{adminRange("10.76.2.0/24")})); created || err != nil {
		t.Errorf("create of an existing flat pool: %v, %v; want unchanged", created, err)
	}
	if spec, _, _ := stored(t, cli, flat); !spec.Blocks.Flat() {
		t.Errorf("the flat pool became %s", spec)
	}
	pools, err := ListPools(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pools {
		if p.Name == name && p.Blocks != allocator.DefaultBlocks || p.Name == flat && !p.Blocks.Flat() {
			t.Errorf("ListPools: %s", p)
		}
	}
}

// findingOf returns the finding of kind naming key, or nil.
func findingOf(fs []Finding, kind, key string) *Finding {
	for i, f := range fs {
		if f.Kind == kind && len(f.Keys) > 0 && (key == "" || strings.Contains(strings.Join(f.Keys, " "), key)) {
			return &fs[i]
		}
	}
	return nil
}
