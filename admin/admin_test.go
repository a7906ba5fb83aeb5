package admin

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

func adminRange(subnet string, startEnd ...string) allocator.Range {
	r := allocator.Range{Subnet: netip.MustParsePrefix(subnet)}
	if len(startEnd) == 2 {
		r.RangeStart, r.RangeEnd = netip.MustParseAddr(startEnd[0]), netip.MustParseAddr(startEnd[1])
	}
	return r
}

func adminPool(name string, sets ...allocator.RangeSet) allocator.PoolSpec {
	return allocator.PoolSpec{Name: name, Ranges: sets}
}

// byName is a request that names the stored pool without ranges, as a configuration that
// follows admin changes does.
func byName(pool, container, podUID string, ips ...string) allocator.Request {
	r := allocator.Request{Network: pool, Pool: allocator.PoolSpec{Name: pool}, ContainerID: container, IfName: "eth0",
		Pod: allocator.PodRef{UID: podUID, Namespace: "ns", Name: "pod-" + container}}
	for _, ip := range ips {
		r.RequestedIPs = append(r.RequestedIPs, netip.MustParseAddr(ip))
	}
	return r
}

func TestAdminCreatePool(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	name, invalid := etcdtest.Uniq("ap"), etcdtest.Uniq("ap")
	base := adminPool(name, allocator.RangeSet{adminRange("10.60.0.0/24")}, allocator.RangeSet{adminRange("fd60::/120")})
	base.Exclude = []netip.Prefix{netip.MustParsePrefix("10.60.0.9/32"), netip.MustParsePrefix("10.60.0.8/32")}
	spelled := adminPool(name, allocator.RangeSet{{Subnet: netip.MustParsePrefix("10.60.0.0/24"),
		RangeStart: netip.MustParseAddr("10.60.0.1"), RangeEnd: netip.MustParseAddr("10.60.0.254"), Gateway: netip.MustParseAddr("10.60.0.1")}},
		allocator.RangeSet{adminRange("fd60::/120")})
	spelled.Exclude = []netip.Prefix{netip.MustParsePrefix("10.60.0.8/31")}
	tests := []struct {
		name        string
		spec        allocator.PoolSpec
		wantCreated bool
		wantErr     error
		wantText    []string
	}{
		// The first definition is stored.
		{name: "new", spec: base, wantCreated: true},
		// Defaults written out and excludes merged differently define the same pool: a no-op, not an error.
		{name: "identical in another spelling", spec: spelled},
		// Another definition under the same name is refused, showing both so the admin sees the difference.
		{name: "different", spec: adminPool(name, allocator.RangeSet{adminRange("10.61.0.0/24")}), wantErr: allocator.ErrPoolMismatch,
			wantText: []string{"stored:", "10.60.0.0/24", "requested:", "10.61.0.0/24"}},
		// A definition that does not canonicalize never reaches etcd.
		{name: "invalid", spec: adminPool(invalid, allocator.RangeSet{adminRange("10.62.0.5/24")}), wantErr: allocator.ErrInvalidConfig},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			created, err := CreatePool(ctx, cli, tt.spec)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("CreatePool: err %v, want %v", err, tt.wantErr)
			}
			if created != tt.wantCreated {
				t.Errorf("created = %v, want %v", created, tt.wantCreated)
			}
			for _, s := range tt.wantText {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not say %q", err, s)
				}
			}
		})
	}
	if leaseOf(t, cli, keyspace.PoolKey(invalid)) != -1 {
		t.Errorf("an invalid definition was stored at %s", keyspace.PoolKey(invalid))
	}
}

func TestAdminAddRangeKeepsAllocationsAndGrowsAFullPool(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	name := etcdtest.Uniq("ap")
	// A /29 hands out .2-.6 (gw .1): five pods fill it.
	if _, err := CreatePool(ctx, cli, adminPool(name, allocator.RangeSet{adminRange("10.63.0.0/29")})); err != nil {
		t.Fatal(err)
	}
	first, err := a.Add(ctx, byName(name, "c0", "u0"))
	if err != nil {
		t.Fatalf("add: %v", err)
	}
	for i := 1; i < 5; i++ {
		if _, err := a.Add(ctx, byName(name, "c"+string(rune('0'+i)), "u"+string(rune('0'+i)))); err != nil {
			t.Fatalf("add %d: %v", i, err)
		}
	}
	if _, err := a.Add(ctx, byName(name, "c5", "u5")); !errors.Is(err, allocator.ErrPoolExhausted) {
		t.Fatalf("sixth ADD: %v, want exhausted", err)
	}
	before := etcdtest.Dump(t, cli, keyspace.IPsPrefix(name))

	tests := []struct {
		name    string
		pool    string
		set     int
		r       allocator.Range
		wantErr error
	}{
		// A range overlapping the existing one would hand out addresses twice.
		{name: "overlap refused", pool: name, set: 0, r: adminRange("10.63.0.0/28"), wantErr: allocator.ErrInvalidConfig},
		// An IPv6 range cannot join the IPv4 set, and there is no IPv6 set to pick by family.
		{name: "no set of the family", pool: name, set: -1, r: adminRange("fd63::/120"), wantErr: allocator.ErrInvalidConfig},
		// A new range set would change what every attachment gets.
		{name: "new set refused", pool: name, set: 1, r: adminRange("10.64.0.0/29"), wantErr: allocator.ErrInvalidConfig},
		// Only stored pools grow.
		{name: "unknown pool", pool: etcdtest.Uniq("ap"), set: -1, r: adminRange("10.65.0.0/29"), wantErr: ErrNotFound},
		// A gateway the new range brings into the old range must not be an allocated address.
		{name: "gateway allocated", pool: name, set: 0, r: allocator.Range{Subnet: netip.MustParsePrefix("10.63.0.0/24"),
			RangeStart: netip.MustParseAddr("10.63.0.100"), RangeEnd: netip.MustParseAddr("10.63.0.110"), Gateway: first.IPs[0].Address.Addr()},
			wantErr: allocator.ErrInvalidConfig},
		// The family picks the set; the pool grows.
		{name: "added", pool: name, set: -1, r: adminRange("10.63.1.0/29")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ch, err := AddRange(ctx, cli, tt.pool, tt.set, tt.r)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("AddRange: %v, want %v", err, tt.wantErr)
			}
			if err == nil && len(ch.New.Ranges[0]) != 2 {
				t.Errorf("new definition %s, want two ranges in set 0", ch.New)
			}
		})
	}
	after := etcdtest.Dump(t, cli, keyspace.IPsPrefix(name))
	for k, l := range before {
		if after[k] != l {
			t.Errorf("allocation %s changed: lease %x before, %x after", k, l, after[k])
		}
	}
	again, err := a.Add(ctx, byName(name, "c0", "u0"))
	if err != nil || again.IPs[0] != first.IPs[0] {
		t.Errorf("repeated ADD after add-range: %v, %v; want %v", again, err, first)
	}
	// The agent whose cached view of the pool was full notices the grown definition: an ADD
	// that finds no free address re-reads the definition's revision before giving up.
	grown, err := a.Add(ctx, byName(name, "c5", "u5"))
	if err != nil || !netip.MustParsePrefix("10.63.1.0/29").Contains(grown.IPs[0].Address.Addr()) {
		t.Errorf("ADD after add-range: %v, %v; want an address of the new range", grown, err)
	}
	// A configuration still listing the old ranges is refused until it follows the new definition.
	old := byName(name, "c6", "u6")
	old.Pool = adminPool(name, allocator.RangeSet{adminRange("10.63.0.0/29")})
	if _, err := a.Add(ctx, old); !errors.Is(err, allocator.ErrPoolMismatch) {
		t.Errorf("ADD with the old ranges: %v, want a pool mismatch", err)
	}
}

func TestAdminRemoveRange(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	name := etcdtest.Uniq("ap")
	spec := adminPool(name, allocator.RangeSet{adminRange("10.66.0.0/28"), adminRange("10.66.1.0/28")}, allocator.RangeSet{adminRange("fd66::/120")})
	if _, err := CreatePool(ctx, cli, spec); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Add(ctx, byName(name, "held", "uh", "10.66.1.5")); err != nil {
		t.Fatalf("add: %v", err)
	}
	t.Run("refused while allocated, naming the holder", func(t *testing.T) {
		_, err := RemoveRange(ctx, cli, name, -1, adminRange("10.66.1.0/28"))
		var inUse *RangeInUseError
		if !errors.As(err, &inUse) || !errors.Is(err, ErrRangeInUse) {
			t.Fatalf("RemoveRange: %v, want a RangeInUseError", err)
		}
		if len(inUse.Holders) != 1 || inUse.Holders[0].IP != netip.MustParseAddr("10.66.1.5") || inUse.Holders[0].Owner != "uh" {
			t.Errorf("holders %+v, want 10.66.1.5 held by uh", inUse.Holders)
		}
		for _, s := range []string{"10.66.1.5", "uh", "ns/pod-held", "n1"} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("error %q does not name %q", err, s)
			}
		}
		if st, _ := ReadState(ctx, cli); !mustPool(t, st, name).Value.Equal(mustCanon(t, withBlocks(spec))) {
			t.Errorf("definition changed by a refused remove-range")
		}
	})
	tests := []struct {
		name    string
		match   allocator.Range
		wantErr error
	}{
		// A subnet the pool does not have.
		{name: "unknown range", match: adminRange("10.67.0.0/28"), wantErr: ErrNotFound},
		// The last range of a set cannot go: the set would be empty.
		{name: "last of its set", match: adminRange("fd66::/120"), wantErr: allocator.ErrInvalidConfig},
		// An empty range goes; the rest of the definition stays.
		{name: "empty range removed", match: adminRange("10.66.0.0/28")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ch, err := RemoveRange(ctx, cli, name, -1, tt.match)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("RemoveRange: %v, want %v", err, tt.wantErr)
			}
			if err == nil && (len(ch.New.Ranges[0]) != 1 || ch.New.Ranges[0][0].Subnet != netip.MustParsePrefix("10.66.1.0/28") || len(ch.Appeared) != 0) {
				t.Errorf("new definition %s (appeared %v), want set 0 = 10.66.1.0/28 only", ch.New, ch.Appeared)
			}
		})
	}
	// Once the pod is deleted, its range can go too.
	if _, err := AddRange(ctx, cli, name, 0, adminRange("10.66.2.0/28")); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, byName(name, "held", "uh")); err != nil {
		t.Fatal(err)
	}
	if _, err := RemoveRange(ctx, cli, name, 0, adminRange("10.66.1.0/28")); err != nil {
		t.Errorf("RemoveRange after the DEL: %v", err)
	}
}

func mustCanon(t *testing.T, p allocator.PoolSpec) allocator.PoolSpec {
	t.Helper()
	if err := p.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	return p
}

func mustPool(t *testing.T, st *State, name string) PoolEntry {
	t.Helper()
	p, ok := st.Pool(name)
	if !ok {
		t.Fatalf("pool %s not stored", name)
	}
	return p
}

// leaseOf returns the lease of key, or -1 when the key does not exist.
func leaseOf(t *testing.T, cli *clientv3.Client, key string) int64 {
	t.Helper()
	if l, ok := etcdtest.Dump(t, cli, key)[key]; ok {
		return l
	}
	return -1
}

func TestAdminRelease(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	cluster := etcdtest.Uniq("c")
	a := startAgent(t, cluster, "n1", "uid1")
	name := etcdtest.Uniq("ap")
	if _, err := CreatePool(ctx, cli, adminPool(name, allocator.RangeSet{adminRange("10.68.0.0/24")}, allocator.RangeSet{adminRange("fd68::/120")})); err != nil {
		t.Fatal(err)
	}
	add := func(container string, ips ...string) (owner string, lease int64) {
		t.Helper()
		if _, err := a.Add(ctx, byName(name, container, "u-"+container, ips...)); err != nil {
			t.Fatalf("add %s: %v", container, err)
		}
		return keyspace.OwnerKey(cluster, "u-"+container, "eth0", name), leaseOf(t, cli, keyspace.IPKey(name, allocator.DefaultBlocks, netip.MustParseAddr(ips[0])))
	}
	ip := netip.MustParseAddr
	live, liveLease := add("live", "10.68.0.10", "fd68::10")
	foreign, _ := add("foreign", "10.68.0.20", "fd68::20")
	// The v6 address of "foreign" is rewritten onto another lease, as a hand edit or a later owner would.
	other, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, keyspace.IPKey(name, allocator.DefaultBlocks, ip("fd68::20")), `{"owner":"someone-else","cluster":"x"}`, clientv3.WithLease(other.ID)); err != nil {
		t.Fatal(err)
	}
	// A key written with a plain etcdctl put: no lease, no owner index.
	if _, err := cli.Put(ctx, keyspace.IPKey(name, allocator.DefaultBlocks, ip("10.68.0.30")), `{"owner":"by-hand","cluster":"x","ifName":"eth0"}`); err != nil {
		t.Fatal(err)
	}

	t.Run("live lease refused without force", func(t *testing.T) {
		_, err := Release(ctx, cli, name, ip("10.68.0.10"), ReleaseOptions{})
		var alive *LeaseAliveError
		if !errors.As(err, &alive) || !errors.Is(err, ErrLeaseAlive) || alive.TTL <= 0 {
			t.Fatalf("Release: %v, want a LeaseAliveError with TTL left", err)
		}
		for _, s := range []string{"ns/pod-live", "node n1", "--force", "renewing"} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("error %q does not say %q", err, s)
			}
		}
		if leaseOf(t, cli, keyspace.IPKey(name, allocator.DefaultBlocks, ip("10.68.0.10"))) != liveLease || leaseOf(t, cli, live) != liveLease {
			t.Errorf("a refused release changed keys")
		}
	})
	tests := []struct {
		name       string
		ip         string
		opt        ReleaseOptions
		wantErr    error
		gone, kept []string // keys deleted, keys untouched
		wantOwner  bool     // the owner index was deleted
	}{
		// Forced: both addresses of the attachment and its owner index go, the pod record stays with the agent.
		{name: "forced release of a live attachment", ip: "10.68.0.10", opt: ReleaseOptions{Force: true, Quarantine: 30 * time.Second},
			gone: []string{keyspace.IPKey(name, allocator.DefaultBlocks, ip("10.68.0.10")), keyspace.IPKey(name, allocator.DefaultBlocks, ip("fd68::10")), live},
			kept: []string{keyspace.PodKey(cluster, "n1", "u-live")}, wantOwner: true},
		// The sibling on a foreign lease is not this attachment's any more: it stays.
		{name: "foreign lease untouched", ip: "10.68.0.20", opt: ReleaseOptions{Force: true},
			gone: []string{keyspace.IPKey(name, allocator.DefaultBlocks, ip("10.68.0.20")), foreign}, kept: []string{keyspace.IPKey(name, allocator.DefaultBlocks, ip("fd68::20"))}, wantOwner: true},
		// A key without lease needs no force, and names no owner index to delete.
		{name: "leaseless key without force", ip: "10.68.0.30", gone: []string{keyspace.IPKey(name, allocator.DefaultBlocks, ip("10.68.0.30"))}},
		// Nothing there: not found, so scripts can tell it from a failure.
		{name: "no allocation", ip: "10.68.0.99", wantErr: ErrNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := Release(ctx, cli, name, ip(tt.ip), tt.opt)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("Release: %v, want %v", err, tt.wantErr)
			}
			for _, k := range tt.gone {
				if leaseOf(t, cli, k) != -1 {
					t.Errorf("%s still exists", k)
				}
			}
			for _, k := range tt.kept {
				if leaseOf(t, cli, k) == -1 {
					t.Errorf("%s was deleted", k)
				}
			}
			if (res.OwnerIndex != "") != tt.wantOwner {
				t.Errorf("owner index deleted %q (kept because %q), want deleted %v", res.OwnerIndex, res.KeptOwnerIndex, tt.wantOwner)
			}
			if tt.opt.Quarantine > 0 {
				for _, r := range res.Addresses {
					if l := leaseOf(t, cli, keyspace.QuarantineKey(name, allocator.DefaultBlocks, r.IP)); l <= 0 {
						t.Errorf("%s not quarantined on a lease (lease %d)", r.IP, l)
					}
				}
			}
		})
	}
	// The agent's own DEL of a force-released attachment releases nothing and fails nothing.
	if err := a.Del(ctx, byName(name, "live", "u-live")); err != nil {
		t.Errorf("DEL after a forced release: %v", err)
	}
}

func TestAdminReadStateFilesEveryFamily(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	st0, err := ReadState(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	pool := etcdtest.Uniq("ap")
	ip := netip.MustParseAddr
	block := netip.MustParsePrefix("10.69.0.0/26")
	puts := map[string]string{
		keyspace.IPKey(pool, allocator.Blocks{}, ip("10.69.0.1")):              `{"owner":"o"}`, // the flat layout
		keyspace.IPKey(pool, allocator.DefaultBlocks, ip("10.69.0.2")):         `{"owner":"o"}`, // a block
		keyspace.QuarantineKey(pool, allocator.Blocks{}, ip("10.69.0.3")):      `{}`,
		keyspace.QuarantineKey(pool, allocator.DefaultBlocks, ip("10.69.0.4")): `{}`,
		keyspace.BlockKey(pool, block):                                         `{"cluster":"c","node":"n"}`,
		keyspace.IPsPrefix(pool) + "not-an-address":                            `{}`,
		keyspace.IPsPrefix(pool) + "::ffff:10.69.0.2":                          `{}`, // not the canonical spelling
		keyspace.IPsPrefix(pool) + "10.69.0.0-26/10.69.1.5":                    `{}`, // an address outside its block
		keyspace.IPsPrefix(pool) + "10.69.0.5-26/10.69.0.5":                    `{}`, // a block not on its boundary
		keyspace.QuarantinePrefix(pool) + "10.69.0.0-26/010.69.0.6":            `{}`,
		keyspace.BlocksPrefix(pool) + "10.69.0.64/26":                          `{}`, // "/" for "-"
		keyspace.OwnerKey("c", "o", "eth0", pool):                              `nonsense`,
		keyspace.NodesPrefix("c") + pool + "/extra/parts/here/x":               `{}`,
	}
	for k, v := range puts {
		if _, err := cli.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}
	st, err := ReadState(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Allocations) != len(st0.Allocations)+2 || len(st.Quarantine) != len(st0.Quarantine)+2 || len(st.Blocks) != len(st0.Blocks)+1 ||
		len(st.BadKeys) != len(st0.BadKeys)+7 || st.Revision <= st0.Revision {
		t.Errorf("allocations %d->%d (want +2), quarantine %d->%d (want +2), block claims %d->%d (want +1), bad keys %d->%d (want +7)",
			len(st0.Allocations), len(st.Allocations), len(st0.Quarantine), len(st.Quarantine), len(st0.Blocks), len(st.Blocks),
			len(st0.BadKeys), len(st.BadKeys))
	}
	for _, a := range st.Allocations {
		if a.Pool == pool && a.Block != map[netip.Addr]netip.Prefix{ip("10.69.0.1"): {}, ip("10.69.0.2"): block}[a.IP] {
			t.Errorf("allocation %s filed in block %v", a.Key, a.Block)
		}
	}
	if c, ok := st.Claim(pool, block); !ok || c.Value.Node != "n" || c.Unreadable != "" {
		t.Errorf("block claim %+v (found %v), want node n's", c, ok)
	}
	var unreadable bool
	for _, o := range st.Owners {
		unreadable = unreadable || (o.Key == keyspace.OwnerKey("c", "o", "eth0", pool) && o.Unreadable != "")
	}
	if !unreadable {
		t.Errorf("the owner index with a nonsense value is not marked unreadable")
	}
}

// withBlocks is spec as CreatePool stores it: in the default block layout.
func withBlocks(spec allocator.PoolSpec) allocator.PoolSpec {
	spec.Blocks = allocator.DefaultBlocks
	return spec
}
