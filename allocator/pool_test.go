package allocator_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

func TestValidateName(t *testing.T) {
	tests := []struct {
		name string
		kind string
		in   string
		ok   bool
	}{
		{"uuid", "owner", "0b9f1c1e-4a4e-4f7a-9d55-2f1f2b8c6d01", true},                                            // pod UIDs are the usual owner
		{"container id", "container ID", "3f4e8d2a9b1c0d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e", true}, // 64 hex digits from containerd/CRI-O
		{"eth0", "interface", "eth0", true},                                                                        // a classic interface name
		{"net1", "pool", "net1", true},                                                                             // a network name as pool name
		{"punctuation", "node", "node-1.example.com:x_y@z", true},                                                  // every allowed punctuation mark
		{"max length", "pool", strings.Repeat("a", 253), true},                                                     // exactly at the limit
		{"empty", "pool", "", false},                                                                               // an empty key component collapses the key
		{"dot", "pool", ".", false},                                                                                // path-like names confuse key tooling
		{"dotdot", "pool", "..", false},                                                                            // same
		{"slash", "pool", "a/b", false},                                                                            // "/" is the key separator
		{"nul", "container ID", "x\x00", false},                                                                    // control characters
		{"too long", "pool", strings.Repeat("a", 254), false},                                                      // one byte over the limit
		{"unicode", "pool", "réseau", false},                                                                       // non-ASCII is refused, not normalised
		{"space", "interface", "eth 0", false},                                                                     // spaces break shell use of keys
		{"leading dash", "pool", "-net", false},                                                                    // must start with a letter or digit
		{"leading dot", "pool", ".hidden", false},                                                                  // same
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := allocator.ValidateName(tt.kind, tt.in)
			if tt.ok {
				if err != nil {
					t.Errorf("ValidateName(%q, %q) = %v, want nil", tt.kind, tt.in, err)
				}
				return
			}
			if !errors.Is(err, allocator.ErrInvalidName) {
				t.Fatalf("ValidateName(%q, %q) = %v, want ErrInvalidName", tt.kind, tt.in, err)
			}
			if !strings.Contains(err.Error(), tt.kind) {
				t.Errorf("error %q does not name the kind %q", err, tt.kind)
			}
			if tt.in != "" && len(tt.in) < 100 && !strings.Contains(err.Error(), strconv.Quote(tt.in)) {
				t.Errorf("error %q does not quote the value", err)
			}
		})
	}
}

func TestPoolCanonicalize(t *testing.T) {
	v4 := rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "10.10.0.1")
	v6 := rng("fd10::/64", "", "", "")
	tests := []struct {
		name        string
		spec        allocator.PoolSpec
		wantErr     error
		wantMsg     string
		wantExclude []string
	}{
		// The design brief's dual-stack example.
		{"design example", spec("net1", [][]allocator.Range{{v4}, {v6}}, "10.10.1.0/28"), nil, "", []string{"10.10.1.0/28"}},
		// Excludes are masked, sorted, deduplicated, and nested ones dropped.
		{"exclude normalised", spec("net1", [][]allocator.Range{{v4}, {v6}}, "fd10::1:0/112", "10.10.2.7/24", "10.10.1.0/28", "10.10.1.0/28", "10.10.2.128/25"), nil, "",
			[]string{"10.10.1.0/28", "10.10.2.0/24", "fd10::1:0/112"}},
		// Sibling halves merge so equivalent spellings store alike.
		{"exclude siblings merged", spec("net1", [][]allocator.Range{{v4}}, "10.10.3.0/25", "10.10.3.128/26", "10.10.3.192/26"), nil, "", []string{"10.10.3.0/24"}},
		// Mapped excludes become IPv4.
		{"exclude 4in6", spec("net1", [][]allocator.Range{{v4}}, "::ffff:10.10.4.0/120"), nil, "", []string{"10.10.4.0/24"}},
		// The pool name becomes a key component.
		{"bad name", spec("a/b", [][]allocator.Range{{v4}}), allocator.ErrInvalidName, `"a/b"`, nil},
		// A pool with nothing to allocate is a mistake.
		{"no sets", spec("net1", nil), allocator.ErrInvalidConfig, "no range sets", nil},
		// Set errors name the pool and the set.
		{"bad set", spec("net1", [][]allocator.Range{{v4}, {rng("fd10::/128", "", "", "")}}), allocator.ErrInvalidConfig, "pool net1 range set 1: range 0:", nil},
		// Two sets sharing addresses could hand one address out twice in one ADD.
		{"overlap across sets", spec("net1", [][]allocator.Range{{v4}, {rng("10.10.0.0/16", "10.10.5.0", "10.10.5.10", "")}}), allocator.ErrInvalidConfig, "overlaps range 10.10.0.0/16 [10.10.1.0-10.10.9.255] gw 10.10.0.1 of set 0", nil},
		// Two sets of one family are allowed when disjoint (two IPv4 addresses per ADD).
		{"two v4 sets", spec("net1", [][]allocator.Range{{v4}, {rng("10.20.0.0/24", "", "", "")}}), nil, "", nil},
		// An exclude of a family the pool lacks is a typo.
		{"exclude wrong family", spec("net1", [][]allocator.Range{{v4}}, "fd00::/64"), allocator.ErrInvalidConfig, "has no IPv6 range set", nil},
		// An unset exclude entry.
		{"exclude invalid", allocator.PoolSpec{Name: "net1", Ranges: []allocator.RangeSet{{v4}}, Exclude: []netip.Prefix{{}}}, allocator.ErrInvalidConfig, "exclude entry 0 is not a valid prefix", nil},
		// Excluding everything leaves a set that can never allocate.
		{"everything excluded", spec("net1", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}, "10.0.0.0/24"), allocator.ErrInvalidConfig, "no allocatable address", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.spec
			err := p.Canonicalize()
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) || !strings.Contains(err.Error(), tt.wantMsg) {
					t.Errorf("Canonicalize = %v, want %v containing %q", err, tt.wantErr, tt.wantMsg)
				}
				return
			}
			if err != nil {
				t.Fatalf("Canonicalize: %v", err)
			}
			var got []string
			for _, x := range p.Exclude {
				got = append(got, x.String())
			}
			if !slices.Equal(got, tt.wantExclude) {
				t.Errorf("Exclude = %v, want %v", got, tt.wantExclude)
			}
			again := p
			again.Ranges = slices.Clone(p.Ranges)
			for i := range again.Ranges {
				again.Ranges[i] = slices.Clone(p.Ranges[i])
			}
			if err := again.Canonicalize(); err != nil || !again.Equal(p) {
				t.Errorf("second Canonicalize = %v, %v; want idempotent", again, err)
			}
		})
	}
}

// spec builds a PoolSpec without canonicalizing it.
func spec(name string, sets [][]allocator.Range, exclude ...string) allocator.PoolSpec {
	p := allocator.PoolSpec{Name: name}
	for _, s := range sets {
		p.Ranges = append(p.Ranges, slices.Clone(allocator.RangeSet(s)))
	}
	for _, x := range exclude {
		p.Exclude = append(p.Exclude, netip.MustParsePrefix(x))
	}
	return p
}

func TestPoolEqualAndString(t *testing.T) {
	// Written with defaults left out, excludes unsorted and unmasked...
	a := pool(t, "net1", [][]allocator.Range{{rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "")}, {rng("fd10::/64", "", "", "")}}, "10.10.1.5/28", "10.10.1.0/28")
	// ...and with every default spelled out: the same pool.
	b := pool(t, "net1", [][]allocator.Range{{rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "10.10.0.1")}, {rng("fd10::/64", "fd10::1", "fd10::ffff:ffff:ffff:ffff", "fd10::1")}}, "10.10.1.0/28")
	if !a.Equal(b) {
		t.Errorf("equivalent specs differ:\n%s\n%s", a, b)
	}
	differ := []struct {
		name string
		o    allocator.PoolSpec
	}{
		{"name", pool(t, "net2", [][]allocator.Range{{rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "")}, {rng("fd10::/64", "", "", "")}}, "10.10.1.0/28")},               // same ranges, other pool
		{"gateway", pool(t, "net1", [][]allocator.Range{{rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "10.10.0.254")}, {rng("fd10::/64", "", "", "")}}, "10.10.1.0/28")}, // results would differ
		{"exclude", pool(t, "net1", [][]allocator.Range{{rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "")}, {rng("fd10::/64", "", "", "")}})},                            // allocates more
		{"set order", pool(t, "net1", [][]allocator.Range{{rng("fd10::/64", "", "", "")}, {rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "")}}, "10.10.1.0/28")},          // result order differs
	}
	for _, tt := range differ {
		if a.Equal(tt.o) {
			t.Errorf("%s: specs compare equal:\n%s\n%s", tt.name, a, tt.o)
		}
	}
	want := "pool net1: set 0: 10.10.0.0/16 [10.10.1.0-10.10.9.255] gw 10.10.0.1; " +
		"set 1: fd10::/64 [fd10::1-fd10::ffff:ffff:ffff:ffff] gw fd10::1; exclude 10.10.1.0/28"
	if got := a.String(); got != want {
		t.Errorf("String() =\n%s\nwant\n%s", got, want)
	}
}

func TestPoolSize(t *testing.T) {
	two64 := new(big.Int).Lsh(big.NewInt(1), 64)
	tests := []struct {
		name string
		p    allocator.PoolSpec
		want []*big.Int
	}{
		// A /24 without excludes: 253 (254 hosts less the gateway).
		{"plain /24", pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}), []*big.Int{big.NewInt(253)}},
		// A /28 exclude in the range removes 16.
		{"exclude inside", pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}, "10.0.0.64/28"), []*big.Int{big.NewInt(237)}},
		// An exclude straddling the range start counts only the part inside the range.
		{"exclude straddles start", pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "10.0.0.10", "10.0.0.29", "")}}, "10.0.0.0/28"), []*big.Int{big.NewInt(14)}},
		// An excluded gateway is not subtracted twice.
		{"gateway excluded", pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}, "10.0.0.0/30"), []*big.Int{big.NewInt(251)}},
		// Another range's gateway inside this range is never handed out either.
		{"foreign gateway", pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "10.0.0.10", "10.0.0.19", "10.0.0.1"), rng("10.0.0.0/24", "10.0.0.20", "10.0.0.29", "10.0.0.15")}}), []*big.Int{big.NewInt(19)}},
		// An exclude outside every range costs nothing.
		{"exclude outside", pool(t, "p", [][]allocator.Range{{rng("10.0.0.0/24", "10.0.0.10", "10.0.0.19", "")}}, "10.0.0.128/25"), []*big.Int{big.NewInt(10)}},
		// A /64 with half excluded: exact arithmetic, no iteration.
		{"v6 half excluded", pool(t, "p", [][]allocator.Range{{rng("fd10::/64", "", "", "")}, {rng("10.0.0.0/24", "", "", "")}}, "fd10::/65"),
			[]*big.Int{new(big.Int).Rsh(two64, 1), big.NewInt(253)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.p.Size()
			if !slices.EqualFunc(got, tt.want, func(a, b *big.Int) bool { return a.Cmp(b) == 0 }) {
				t.Errorf("Size() = %v, want %v", got, tt.want)
			}
		})
	}
	if n := (&allocator.PoolSpec{Name: "empty"}).SetSize(5); n.Sign() != 0 {
		t.Errorf("SetSize(out of range) = %s, want 0", n)
	}
}

// TestPoolJSONRoundTrip checks the stored form: a canonical spec read back from its
// JSON is Equal to itself, so the agent's mismatch check compares like with like.
func TestPoolJSONRoundTrip(t *testing.T) {
	p := pool(t, "net1", [][]allocator.Range{{rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "")}, {rng("fd10::/64", "", "", "")}}, "10.10.1.0/28")
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	var q allocator.PoolSpec
	if err := json.Unmarshal(b, &q); err != nil {
		t.Fatalf("Unmarshal(%s): %v", b, err)
	}
	if !q.Equal(p) {
		t.Errorf("round trip changed the spec:\n%s\n%s", p, q)
	}
	if err := q.Canonicalize(); err != nil || !q.Equal(p) {
		t.Errorf("stored form is not canonical: %v\n%s\n%s", err, p, q)
	}
	// The design brief's host-local JSON parses into the same pool.
	const conf = `{"name":"net1","ranges":[[{"subnet":"10.10.0.0/16","rangeStart":"10.10.1.0","rangeEnd":"10.10.9.255"}],[{"subnet":"fd10::/64"}]],"exclude":["10.10.1.0/28"]}`
	var c allocator.PoolSpec
	if err := json.Unmarshal([]byte(conf), &c); err != nil {
		t.Fatal(err)
	}
	if err := c.Canonicalize(); err != nil || !c.Equal(p) {
		t.Errorf("host-local JSON gives %s (%v), want %s", c, err, p)
	}
}

// TestTooManyRangeSets: an ADD claims one address per range set in one etcd transaction,
// which etcd bounds; more sets than MaxRangeSets are refused as configuration, not failed at
// claim time as "try again later" (found by the hostile-input tests).
func TestTooManyRangeSets(t *testing.T) {
	p := allocator.PoolSpec{Name: "many"}
	for i := range allocator.MaxRangeSets + 1 {
		p.Ranges = append(p.Ranges, allocator.RangeSet{{Subnet: netip.MustParsePrefix(fmt.Sprintf("10.%d.0.0/24", i))}})
	}
	if err := p.Canonicalize(); !errors.Is(err, allocator.ErrInvalidConfig) || !strings.Contains(err.Error(), "more than the 8") {
		t.Errorf("want ErrInvalidConfig naming the limit, got %v", err)
	}
	p.Ranges = p.Ranges[:allocator.MaxRangeSets]
	if err := p.Canonicalize(); err != nil {
		t.Errorf("%d range sets must be accepted: %v", allocator.MaxRangeSets, err)
	}
}

func TestRangeSizesSumToSetSize(t *testing.T) {
	// The second range's gateway lies inside the first range: it is counted out of the first.
	spec := allocator.PoolSpec{Name: "p", Ranges: []allocator.RangeSet{{
		{Subnet: netip.MustParsePrefix("10.86.0.0/24"), RangeStart: netip.MustParseAddr("10.86.0.10"), RangeEnd: netip.MustParseAddr("10.86.0.20")},
		{Subnet: netip.MustParsePrefix("10.86.0.0/24"), RangeStart: netip.MustParseAddr("10.86.0.30"), RangeEnd: netip.MustParseAddr("10.86.0.40"),
			Gateway: netip.MustParseAddr("10.86.0.15")},
	}}, Exclude: []netip.Prefix{netip.MustParsePrefix("10.86.0.32/31")}}
	if err := spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	r0, r1 := spec.RangeSize(0, 0), spec.RangeSize(0, 1)
	if r0.Int64() != 10 || r1.Int64() != 9 || r0.Int64()+r1.Int64() != spec.SetSize(0).Int64() {
		t.Errorf("range sizes %s + %s, set size %s; want 10 + 9 = 19", r0, r1, spec.SetSize(0))
	}
}
