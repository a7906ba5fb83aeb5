package keyspace_test

import (
	"encoding/json"
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// A block name has one spelling: the masked prefix as netip prints it, "-" for "/". Any
// other spelling of the same block would be a second key range for its addresses.
func TestParseBlockName(t *testing.T) {
	valid := map[string]string{
		"10.10.1.64-26":   "10.10.1.64/26",
		"fd10::40-122":    "fd10::40/122",
		"10.10.0.0-16":    "10.10.0.0/16",
		"fd10::-112":      "fd10::/112",
		"192.168.0.4-30":  "192.168.0.4/30",
		"fd10::ffc0-122":  "fd10::ffc0/122",
		"10.255.255.0-24": "10.255.255.0/24",
	}
	for in, want := range valid {
		got, err := keyspace.ParseBlockName(in)
		if err != nil || got != netip.MustParsePrefix(want) {
			t.Errorf("ParseBlockName(%q) = %s, %v; want %s", in, got, err, want)
		}
		if keyspace.BlockName(got) != in {
			t.Errorf("BlockName(ParseBlockName(%q)) = %q", in, keyspace.BlockName(got))
		}
	}
	invalid := []struct {
		in, why string
	}{
		{"10.10.1.65-26", "host bits set: not where the block starts"},
		{"10.10.1.127-26", "the block's last address"},
		{"fd10::47-122", "IPv6 host bits set"},
		{"010.10.1.64-26", "leading zero in an octet"},
		{"10.10.1.64-026", "leading zero in the length"},
		{"10.10.1.64-+26", "signed length"},
		{"FD10::40-122", "upper-case hex"},
		{"fd10:0::40-122", "IPv6 not in its shortest form"},
		{"fd10::0040-122", "IPv6 group with leading zeros"},
		{"fd10:0:0:0:0:0:0:40-122", "IPv6 written out in full"},
		{"fd10::40%eth0-122", "zone"},
		{"10.10.1.64/26", "slash instead of dash"},
		{"10.10.1.64", "no length"},
		{"10.10.1.64-", "empty length"},
		{"-26", "no address"},
		{"10.10.1.64--26", "two dashes"},
		{"10.10.1.64-33", "IPv4 length beyond 32"},
		{"fd10::-129", "IPv6 length beyond 128"},
		{" 10.10.1.64-26", "leading space"},
		{"10.10.1.64-26 ", "trailing space"},
		{"", "empty"},
	}
	for _, tt := range invalid {
		if got, err := keyspace.ParseBlockName(tt.in); err == nil {
			t.Errorf("ParseBlockName(%q) = %s, want an error (%s)", tt.in, got, tt.why)
		} else if !strings.Contains(err.Error(), tt.in) {
			t.Errorf("ParseBlockName(%q): error %q does not quote the name", tt.in, err)
		}
	}
	// An unmasked spelling is answered with the canonical one.
	if _, err := keyspace.ParseBlockName("10.10.1.65-26"); err == nil || !strings.Contains(err.Error(), "10.10.1.64-26") {
		t.Errorf("ParseBlockName(10.10.1.65-26): %v, want the canonical spelling 10.10.1.64-26 named", err)
	}
}

func TestParseIPKeyLayouts(t *testing.T) {
	tests := []struct {
		key       string
		pool      string
		block, ip string // block "" for the flat layout
		err       string // non-empty: the error contains it
	}{
		// The flat layout of pools stored before blocks.
		{key: "/leasehold/v1/ips/net1/10.10.1.70", pool: "net1", ip: "10.10.1.70"},
		{key: "/leasehold/v1/ips/net1/fd10::47", pool: "net1", ip: "fd10::47"},
		// The block layout.
		{key: "/leasehold/v1/ips/net1/10.10.1.64-26/10.10.1.70", pool: "net1", block: "10.10.1.64/26", ip: "10.10.1.70"},
		{key: "/leasehold/v1/ips/net1/fd10::40-122/fd10::47", pool: "net1", block: "fd10::40/122", ip: "fd10::47"},
		// An address filed under a block that does not hold it.
		{key: "/leasehold/v1/ips/net1/10.10.1.0-26/10.10.1.70", err: "address 10.10.1.70 is not in block 10.10.1.0/26"},
		{key: "/leasehold/v1/ips/net1/fd10::-122/10.10.1.70", err: "is not in block"},
		// A block in another spelling is another key range: refused.
		{key: "/leasehold/v1/ips/net1/10.10.1.65-26/10.10.1.70", err: "not spelled canonically"},
		{key: "/leasehold/v1/ips/net1/10.10.1.64/26/10.10.1.70", err: "want /leasehold/v1/ips/<pool>/<block>/<ip>"},
		// A block's prefix, or a key with a trailing or extra component.
		{key: "/leasehold/v1/ips/net1/10.10.1.64-26/", err: "unable to parse IP"},
		{key: "/leasehold/v1/ips/net1/10.10.1.64-26", err: "ParseAddr(\"10.10.1.64-26\")"},
		{key: "/leasehold/v1/ips/net1/10.10.1.64-26/10.10.1.70/x", err: "want /leasehold/v1/ips/<pool>/<block>/<ip>"},
		{key: "/leasehold/v1/ips/net1", err: "want /leasehold/v1/ips/<pool>/<block>/<ip>"},
		{key: "/leasehold/v1/quarantine/net1/10.10.1.64-26/10.10.1.70", err: "is not under /leasehold/v1/ips/"},
	}
	for _, tt := range tests {
		pool, block, ip, err := keyspace.ParseIPKey(tt.key)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("ParseIPKey(%q) = %q, %s, %s, %v; want an error containing %q", tt.key, pool, block, ip, err, tt.err)
			}
			continue
		}
		var want netip.Prefix
		if tt.block != "" {
			want = netip.MustParsePrefix(tt.block)
		}
		if err != nil || pool != tt.pool || block != want || ip != netip.MustParseAddr(tt.ip) {
			t.Errorf("ParseIPKey(%q) = %q, %s, %s, %v; want %q, %s, %s", tt.key, pool, block, ip, err, tt.pool, want, tt.ip)
		}
		// The key is the one the builder makes for that layout.
		b := allocator.Blocks{}
		if tt.block != "" {
			b = allocator.DefaultBlocks
		}
		if k := keyspace.IPKey(tt.pool, b, ip); k != tt.key {
			t.Errorf("IPKey(%q, %v, %s) = %q, want %q", tt.pool, b, ip, k, tt.key)
		}
		qk := strings.Replace(tt.key, "/ips/", "/quarantine/", 1)
		if qp, qb, qa, err := keyspace.ParseQuarantineKey(qk); err != nil || qp != pool || qb != block || qa != ip {
			t.Errorf("ParseQuarantineKey(%q) = %q, %s, %s, %v", qk, qp, qb, qa, err)
		}
	}
}

// IPKey puts an IPv4-mapped address into its IPv4 block (Blocks.Of unmaps) but keeps the
// mapped spelling in the key's last part, so the key it builds is one ParseIPKey refuses
// ("address ::ffff:10.10.1.70 is not in block 10.10.1.64/26"), and the same address has a
// second key beside 10.10.1.70's in the same block. Either IPKey and QuarantineKey should
// unmap the address, or parsePoolAddr should accept what IPKey builds; in either case one
// address must have one key. Skipped until keyspace is fixed: remove the Skip then.
func TestIPKeyMappedAddress(t *testing.T) {
	mapped := netip.MustParseAddr("::ffff:10.10.1.70")
	for _, build := range []struct {
		name  string
		key   func(string, allocator.Blocks, netip.Addr) string
		parse func(string) (string, netip.Prefix, netip.Addr, error)
	}{
		{"IPKey", keyspace.IPKey, keyspace.ParseIPKey},
		{"QuarantineKey", keyspace.QuarantineKey, keyspace.ParseQuarantineKey},
	} {
		key := build.key("net1", allocator.DefaultBlocks, mapped)
		if _, block, _, err := build.parse(key); err != nil || !block.Contains(mapped.Unmap()) {
			t.Errorf("%s(net1, %v, %s) = %q, which does not parse back: block %s, %v", build.name, allocator.DefaultBlocks, mapped, key, block, err)
		}
		if plain := build.key("net1", allocator.DefaultBlocks, mapped.Unmap()); key != plain {
			t.Errorf("%s gives one address two keys: %q and %q", build.name, key, plain)
		}
	}
}

func TestParseBlockKey(t *testing.T) {
	block := netip.MustParsePrefix("fd10::40/122")
	key := keyspace.BlockKey("net1", block)
	if key != "/leasehold/v1/blocks/net1/fd10::40-122" {
		t.Errorf("BlockKey = %q", key)
	}
	if !strings.HasPrefix(key, keyspace.BlocksPrefix("net1")) || !strings.HasPrefix(key, keyspace.BlocksPrefix("")) ||
		strings.HasPrefix(key, keyspace.BlocksPrefix("net")) {
		t.Errorf("BlockKey %q is not under exactly its pool's BlocksPrefix", key)
	}
	if pool, b, err := keyspace.ParseBlockKey(key); err != nil || pool != "net1" || b != block {
		t.Errorf("ParseBlockKey(%q) = %q, %s, %v", key, pool, b, err)
	}
	for _, bad := range []string{
		"/leasehold/v1/blocks/net1",
		"/leasehold/v1/blocks/net1/fd10::47-122",
		"/leasehold/v1/blocks/net1/fd10::40-122/fd10::47",
		"/leasehold/v1/ips/net1/fd10::40-122",
	} {
		if pool, b, err := keyspace.ParseBlockKey(bad); err == nil {
			t.Errorf("ParseBlockKey(%q) = %q, %s; want an error", bad, pool, b)
		}
	}
	if got := keyspace.BlockIPsPrefix("net1", block); got != "/leasehold/v1/ips/net1/fd10::40-122/" {
		t.Errorf("BlockIPsPrefix = %q", got)
	}
	if got := keyspace.BlockQuarantinePrefix("net1", block); got != "/leasehold/v1/quarantine/net1/fd10::40-122/" {
		t.Errorf("BlockQuarantinePrefix = %q", got)
	}
	found := false
	for _, p := range keyspace.RolePrefixes("prod") {
		found = found || strings.HasPrefix(key, p)
	}
	if !found {
		t.Errorf("RolePrefixes do not grant the block claims (%q)", key)
	}
}

// oldPoolSpec is allocator.PoolSpec as agents from before blocks decode a stored
// definition (json.Unmarshal into name, ranges and exclude, then Canonicalize).
type oldPoolSpec struct {
	Name    string               `json:"name"`
	Ranges  []allocator.RangeSet `json:"ranges"`
	Exclude []netip.Prefix       `json:"exclude,omitempty"`
}

func canonicalPool(t *testing.T, blocks allocator.Blocks) allocator.PoolSpec {
	t.Helper()
	p := allocator.PoolSpec{
		Name: "net1",
		Ranges: []allocator.RangeSet{
			{{Subnet: netip.MustParsePrefix("10.10.0.0/16"), RangeStart: netip.MustParseAddr("10.10.1.0"), RangeEnd: netip.MustParseAddr("10.10.9.255")}},
			{{Subnet: netip.MustParsePrefix("fd10::/64")}},
		},
		Exclude: []netip.Prefix{netip.MustParsePrefix("10.10.1.0/28")},
		Blocks:  blocks,
	}
	if err := p.Canonicalize(); err != nil {
		t.Fatalf("Canonicalize: %v", err)
	}
	return p
}

// jsonFields is the top-level fields of a JSON object.
func jsonFields(t *testing.T, s string) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatalf("stored pool %s is not a JSON object: %v", s, err)
	}
	return m
}

func TestEncodePoolFlat(t *testing.T) {
	spec := canonicalPool(t, allocator.Blocks{})
	value := keyspace.EncodePool(spec)
	m := jsonFields(t, value)
	for _, k := range []string{"name", "ranges", "exclude"} {
		if _, ok := m[k]; !ok {
			t.Errorf("flat pool %s has no %q", value, k)
		}
	}
	for _, k := range []string{"layout", "rangeSets", "blocks", "migrating"} {
		if _, ok := m[k]; ok {
			t.Errorf("flat pool %s has %q", value, k)
		}
	}
	// Agents from before blocks read it as they always did.
	var old oldPoolSpec
	if err := json.Unmarshal([]byte(value), &old); err != nil || len(old.Ranges) != 2 {
		t.Fatalf("an old agent reads %s as %+v, %v; want both range sets", value, old, err)
	}
	again := allocator.PoolSpec{Name: old.Name, Ranges: old.Ranges, Exclude: old.Exclude}
	if err := again.Canonicalize(); err != nil || !again.Equal(spec) {
		t.Errorf("an old agent reads %s as %v, %v; want %v", value, again, err, spec)
	}
	// And a definition an old agent stored (allocator.PoolSpec's own JSON, flat) decodes.
	oldValue := keyspace.Encode(oldPoolSpec{Name: spec.Name, Ranges: spec.Ranges, Exclude: spec.Exclude})
	got, mig, err := keyspace.DecodePool(keyspace.PoolKey("net1"), []byte(oldValue))
	if err != nil || mig != nil || !got.Equal(spec) || !got.Blocks.Flat() {
		t.Errorf("DecodePool(%s) = %v, %v, %v; want the flat %v", oldValue, got, mig, err, spec)
	}
}

func TestEncodePoolBlocks(t *testing.T) {
	spec := canonicalPool(t, allocator.Blocks{IPv4: 24})
	if spec.Blocks != (allocator.Blocks{IPv4: 24, IPv6: allocator.DefaultBlocks.IPv6}) {
		t.Fatalf("canonical blocks %v", spec.Blocks)
	}
	value := keyspace.EncodePool(spec)
	m := jsonFields(t, value)
	if _, ok := m["ranges"]; ok {
		t.Errorf("block pool %s has a \"ranges\" key: an old agent would allocate from it in the flat layout", value)
	}
	for _, k := range []string{"name", "rangeSets", "exclude", "blocks", "layout"} {
		if _, ok := m[k]; !ok {
			t.Errorf("block pool %s has no %q", value, k)
		}
	}
	if string(m["layout"]) != `"blocks"` || string(m["blocks"]) != `{"ipv4":24,"ipv6":122}` {
		t.Errorf("block pool %s: layout %s blocks %s, want \"blocks\" and {\"ipv4\":24,\"ipv6\":122}", value, m["layout"], m["blocks"])
	}
	// An agent from before blocks finds no ranges, and so refuses the pool's ADDs.
	var old oldPoolSpec
	if err := json.Unmarshal([]byte(value), &old); err != nil {
		t.Fatalf("an old agent cannot unmarshal %s: %v", value, err)
	}
	if len(old.Ranges) != 0 {
		t.Errorf("an old agent reads %d range sets from %s, want none", len(old.Ranges), value)
	}
	oldSpec := allocator.PoolSpec{Name: old.Name, Ranges: old.Ranges, Exclude: old.Exclude}
	if err := oldSpec.Canonicalize(); err == nil || !errors.Is(err, allocator.ErrInvalidConfig) {
		t.Errorf("an old agent canonicalizes %s to %v, %v; want it refused", value, oldSpec, err)
	}
}

func TestDecodePoolRoundTrip(t *testing.T) {
	since := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, b := range []allocator.Blocks{{}, allocator.DefaultBlocks, {IPv4: 30, IPv6: 112}, {IPv4: 16, IPv6: 126}} {
		spec := canonicalPool(t, b)
		got, mig, err := keyspace.DecodePool(keyspace.PoolKey(spec.Name), []byte(keyspace.EncodePool(spec)))
		if err != nil || mig != nil || !got.Equal(spec) || !reflect.DeepEqual(got, spec) {
			t.Errorf("DecodePool(EncodePool(%v)) = %v, %v, %v", spec, got, mig, err)
		}
		// A pool being migrated says so, and by whom.
		r := keyspace.NewPoolRecord(spec)
		r.Migrating = &keyspace.Migration{By: "leaseholdctl@admin-1", Since: since}
		got, mig, err = keyspace.DecodePool(keyspace.PoolKey(spec.Name), []byte(keyspace.Encode(r)))
		if err != nil || !got.Equal(spec) || mig == nil || *mig != *r.Migrating {
			t.Errorf("DecodePool(migrating %v) = %v, %+v, %v", spec, got, mig, err)
		}
	}
	// A block pool stored without IPv6 length gets the default, as Canonicalize gives it.
	got, _, err := keyspace.DecodePool("/leasehold/v1/pools/p",
		[]byte(`{"name":"p","layout":"blocks","rangeSets":[[{"subnet":"10.0.0.0/24"}]],"blocks":{"ipv4":28}}`))
	if err != nil || got.Blocks != (allocator.Blocks{IPv4: 28, IPv6: allocator.DefaultBlocks.IPv6}) || len(got.Ranges) != 1 {
		t.Errorf("DecodePool(ipv4 /28 only) = %v, %v", got, err)
	}
}

func TestDecodePoolRefusesMixedLayouts(t *testing.T) {
	const key = "/leasehold/v1/pools/p"
	const ranges = `[[{"subnet":"10.0.0.0/24"}]]`
	tests := []struct {
		name, value, want string
	}{
		{"ranges and rangeSets", `{"name":"p","layout":"blocks","ranges":` + ranges + `,"rangeSets":` + ranges + `,"blocks":{"ipv4":26,"ipv6":122}}`, "mixes the flat layout"},
		{"ranges in the block layout", `{"name":"p","layout":"blocks","ranges":` + ranges + `,"blocks":{"ipv4":26,"ipv6":122}}`, "mixes the flat layout"},
		{"rangeSets without layout", `{"name":"p","rangeSets":` + ranges + `,"blocks":{"ipv4":26,"ipv6":122}}`, "mixes the flat layout"},
		{"blocks in the flat layout", `{"name":"p","ranges":` + ranges + `,"blocks":{"ipv4":26,"ipv6":122}}`, "mixes the flat layout"},
		{"block layout without blocks", `{"name":"p","layout":"blocks","rangeSets":` + ranges + `}`, "mixes the flat layout"},
		{"unknown layout", `{"name":"p","layout":"hex","rangeSets":` + ranges + `,"blocks":{"ipv4":26,"ipv6":122}}`, `"layout": "hex"`},
		// Not mixed, but not valid either: the error comes from Canonicalize.
		{"block length out of bounds", `{"name":"p","layout":"blocks","rangeSets":` + ranges + `,"blocks":{"ipv4":8,"ipv6":122}}`, "IPv4 block of /8 is out of bounds"},
		{"block layout without ranges", `{"name":"p","layout":"blocks","blocks":{"ipv4":26,"ipv6":122}}`, "no range sets"},
		{"not JSON", `{"name":`, "unreadable"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec, _, err := keyspace.DecodePool(key, []byte(tt.value))
			if err == nil {
				t.Fatalf("DecodePool(%s) = %v, want an error", tt.value, spec)
			}
			if !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), key) || !errors.Is(err, allocator.ErrInvalidConfig) {
				t.Errorf("DecodePool(%s): error %q; want one naming %s, containing %q, wrapping ErrInvalidConfig", tt.value, err, key, tt.want)
			}
		})
	}
}
