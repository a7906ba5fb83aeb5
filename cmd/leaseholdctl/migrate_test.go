package main

import (
	"encoding/json"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestPoolLayoutAndMigrate takes a pool of the flat layout, as the release before blocks
// stored it, through pool show, a refused and a done pool migrate, and alloc show of a moved
// key. It runs on an etcd of its own: migrate refuses on any older agent's node record.
func TestPoolLayoutAndMigrate(t *testing.T) {
	srv, stop, err := etcdtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	ep, ctx := srv.ClientURL, etcdtest.Ctx(t)
	cli := etcdtest.ClientAt(t, ep)
	grant := func() clientv3.LeaseID {
		g, err := cli.Grant(ctx, 120)
		if err != nil {
			t.Fatal(err)
		}
		return g.ID
	}
	put := func(key, value string, lease clientv3.LeaseID) {
		if _, err := cli.Put(ctx, key, value, clientv3.WithLease(lease)); err != nil {
			t.Fatal(err)
		}
	}
	spec := allocator.PoolSpec{Name: "net", Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.91.0.0/24")}}}}
	if err := spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, keyspace.PoolKey("net"), keyspace.EncodePool(spec)); err != nil {
		t.Fatal(err)
	}
	pod := grant()
	flat := allocator.Blocks{}
	put(keyspace.IPKey("net", flat, mustIP("10.91.0.5")), `{"owner":"u-web","cluster":"c1","node":"n1","ifName":"eth0"}`, pod)
	put(keyspace.OwnerKey("c1", "u-web", "eth0", "net"), `{"ips":["10.91.0.5"],"node":"n1"}`, pod)
	put(keyspace.PodKey("c1", "n1", "u-web"), `{"owner":"u-web"}`, pod)
	put(keyspace.QuarantineKey("net", flat, mustIP("10.91.0.6")), `{"releasedBy":"n1"}`, grant())
	blockLease := grant()
	put(keyspace.HeldKey("net", flat, mustIP("10.91.0.5")), `{"cluster":"c1","node":"n1","owner":"u-web"}`, blockLease)

	if r := ctlAt(ep, "pool", "show", "net"); r.code != 0 || !strings.Contains(r.stdout, "layout: flat (run leaseholdctl pool migrate net") {
		t.Errorf("pool show of a flat pool: %+v", r)
	}
	if r := ctlAt(ep, "pool", "list"); !strings.Contains(r.stdout, "flat (run leaseholdctl pool migrate)") {
		t.Errorf("pool list of a flat pool:\n%s", r.stdout)
	}
	// A flat pool has no blocks to draw: refused, saying what shows it and what moves it.
	if r := ctlAt(ep, "pool", "show", "net", "--blocks"); r.code != exitError || !strings.Contains(r.stderr, "flat layout") ||
		!strings.Contains(r.stderr, "leaseholdctl pool show net gives") || !strings.Contains(r.stderr, "leaseholdctl pool migrate net moves") {
		t.Errorf("pool show --blocks of a flat pool: %+v", r)
	}
	// The doctor recommends the migration, without failing.
	if r := ctlAt(ep, "doctor"); r.code != exitOK || !strings.Contains(r.stdout, "[pool-flat] (info)") || !strings.Contains(r.stdout, "fix: leaseholdctl pool migrate net") {
		t.Errorf("doctor on a flat pool: %+v", r)
	}

	// An agent of the release before blocks is live: refused, naming it; nothing changes.
	old := keyspace.NodeKey("c1", "old")
	put(old, `{"uid":"uid-old","host":"h-old","version":"v1.4.0","started":"2026-01-01T00:00:00Z"}`, grant())
	before := keys(t, cli, keyspace.PoolKey("net"))
	r := ctlAt(ep, "pool", "migrate", "net")
	if r.code != exitError || !strings.Contains(r.stderr, "c1/old uid uid-old host h-old version v1.4.0") || !strings.Contains(r.stderr, "--force") {
		t.Errorf("pool migrate with an older agent live: %+v", r)
	}
	if after := keys(t, cli, keyspace.PoolKey("net")); after[keyspace.PoolKey("net")] != before[keyspace.PoolKey("net")] {
		t.Errorf("a refused migration changed the definition")
	}
	if _, err := cli.Delete(ctx, old); err != nil {
		t.Fatal(err)
	}

	// Upgraded: migrated into /28 blocks, every key moved.
	r = ctlAt(ep, "pool", "migrate", "net", "--block-v4", "28")
	if r.code != 0 || !strings.Contains(r.stdout, "moved 1 allocation(s), 1 quarantine key(s) and 1 held key(s) to blocks of /28 (IPv4) and /122 (IPv6)") ||
		!strings.Contains(r.stdout, "unfrozen") {
		t.Fatalf("pool migrate: %+v", r)
	}
	moved := keyspace.IPKey("net", allocator.Blocks{IPv4: 28, IPv6: 122}, mustIP("10.91.0.5"))
	if moved != keyspace.IPsPrefix("net")+"10.91.0.0-28/10.91.0.5" || len(keys(t, cli, moved)) != 1 {
		t.Fatalf("the allocation is not at %s", moved)
	}
	heldMoved := keyspace.HeldKey("net", allocator.Blocks{IPv4: 28, IPv6: 122}, mustIP("10.91.0.5"))
	if resp, err := cli.Get(ctx, heldMoved); err != nil || len(resp.Kvs) != 1 || clientv3.LeaseID(resp.Kvs[0].Lease) != blockLease {
		t.Fatalf("the held key is not at %s on lease %x: %v %v", heldMoved, blockLease, resp, err)
	}
	var rep migrateJSON
	r = ctlAt(ep, "pool", "migrate", "net", "-o", "json")
	jsonOf(t, r, &rep)
	if r.code != 0 || !rep.AlreadyDone || rep.Blocks.IPv4 != 28 {
		t.Errorf("second pool migrate: exit %d %+v", r.code, rep)
	}
	if r := ctlAt(ep, "pool", "migrate", "net"); !strings.Contains(r.stdout, "nothing to do") {
		t.Errorf("third pool migrate: %+v", r)
	}

	// pool show: the layout and each block claim.
	claim := keyspace.Encode(keyspace.BlockRecord{Cluster: "c1", Node: "n1", NodeUID: "uid-n1", Since: time.Now().UTC()})
	put(keyspace.BlockKey("net", netip.MustParsePrefix("10.91.0.0/28")), claim, grant())
	r = ctlAt(ep, "pool", "show", "net")
	for _, s := range []string{"layout: blocks of /28 (IPv4) and /122 (IPv6)", "1 block(s) claimed", "10.91.0.0/28", "c1/n1", "uid-n1"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("pool show does not say %q:\n%s", s, r.stdout)
		}
	}
	var show poolJSON
	jsonOf(t, ctlAt(ep, "pool", "show", "net", "-o", "json"), &show)
	if show.Layout != "blocks" || show.ClaimedBlocks != 1 || len(show.Claims) != 1 || show.Claims[0].Node != "n1" || show.Claims[0].Block.Bits() != 28 {
		t.Errorf("pool show -o json: %+v", show)
	}
	// The map: the moved allocation in its block, which n1 claims without an agent (expired).
	if r := ctlAt(ep, "pool", "show", "net", "--blocks"); !strings.Contains(r.stdout, "\n10.91.0.0 A1"+strings.Repeat(" .", 15)+"\nblocks: 1 claimed (1 expired), 15 free\n") {
		t.Errorf("pool show --blocks after the migration:\n%s", r.stdout)
	}

	// alloc show: the real key, and an etcdctl line that reads it.
	r = ctlAt(ep, "alloc", "show", "10.91.0.5")
	line := "etcdctl get " + moved + " --print-value-only"
	if r.code != 0 || !strings.Contains(r.stdout, moved) || !strings.Contains(r.stdout, line) || !strings.Contains(r.stdout, "claimed by c1/n1") {
		t.Errorf("alloc show:\n%s", r.stdout)
	}
	if bin := etcdctlDir(); bin != "" {
		cmd := exec.Command("sh", "-c", line)
		cmd.Env = append(os.Environ(), "ETCDCTL_ENDPOINTS="+ep, "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
		if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "u-web") {
			t.Errorf("%s: %v: %s", line, err, out)
		}
	}
	if r := ctlAt(ep, "alloc", "show", "10.91.0.7", "--pool", "net"); r.code != exitNotFound ||
		!strings.Contains(r.stderr, keyspace.IPsPrefix("net")+"10.91.0.0-28/10.91.0.7") {
		t.Errorf("alloc show of a free address: %+v", r)
	}
	// alloc release finds the key where the layout puts it.
	if r := ctlAt(ep, "alloc", "release", "10.91.0.5", "--pool", "net", "--force"); r.code != 0 || len(keys(t, cli, moved)) != 0 {
		t.Errorf("alloc release: %+v", r)
	}
}

func TestPoolCreateBlockFlags(t *testing.T) {
	pool := etcdtest.Uniq("net")
	var out struct {
		Pool   allocator.PoolSpec `json:"pool"`
		Layout string             `json:"layout"`
	}
	r := ctl("pool", "create", pool, "--range", "10.92.0.0/24", "--range", "fd92::/120", "--block-v4", "27", "-o", "json")
	jsonOf(t, r, &out)
	if r.code != 0 || out.Layout != "blocks" || out.Pool.Blocks != (allocator.Blocks{IPv4: 27, IPv6: 122}) {
		t.Errorf("pool create --block-v4 27: exit %d %+v", r.code, out)
	}
	var raw map[string]any
	if err := json.Unmarshal([]byte(keys(t, etcdtest.ClientAt(t, endpoint), keyspace.PoolKey(pool))[keyspace.PoolKey(pool)]), &raw); err != nil {
		t.Fatal(err)
	}
	if _, ok := raw["ranges"]; ok || raw["layout"] != "blocks" {
		t.Errorf("stored %v: want the block shape, without \"ranges\"", raw)
	}
	// Without lengths, the same ranges are the same pool; other lengths are another pool.
	if r := ctl("pool", "create", pool, "--range", "10.92.0.0/24", "--range", "fd92::/120"); r.code != 0 || !strings.Contains(r.stdout, "unchanged") ||
		!strings.Contains(r.stdout, "layout: blocks of /27 (IPv4) and /122 (IPv6)") {
		t.Errorf("pool create again without lengths: %+v", r)
	}
	if r := ctl("pool", "create", pool, "--range", "10.92.0.0/24", "--range", "fd92::/120", "--block-v4", "26"); r.code != exitError {
		t.Errorf("pool create again with other lengths: %+v", r)
	}
	// Defaults: /26 and /122.
	other := etcdtest.Uniq("net")
	if r := ctl("pool", "create", other, "--range", "10.93.0.0/24"); r.code != 0 || !strings.Contains(r.stdout, "blocks /26, /122") {
		t.Errorf("pool create with default blocks: %+v", r)
	}
	// Out of bounds, or on a command that takes none: usage errors.
	for _, args := range [][]string{
		{"pool", "create", etcdtest.Uniq("net"), "--range", "10.94.0.0/24", "--block-v4", "8"},
		{"pool", "create", etcdtest.Uniq("net"), "--range", "10.94.0.0/24", "--block-v6", "-1"},
		{"pool", "add-range", pool, "--range", "10.95.0.0/24", "--block-v4", "26"},
	} {
		if r := ctl(args...); r.code != exitUsage {
			t.Errorf("%v: exit %d, want usage: %s", args, r.code, r.stderr)
		}
	}
}
