package allocator_test

import (
	"errors"
	"math/big"
	"net/netip"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

func TestRangeCanonicalize(t *testing.T) {
	tests := []struct {
		name    string
		in      allocator.Range
		want    allocator.Range
		wantErr string // substring of the error; empty means success
	}{
		// host-local's defaults for IPv4: .1 to broadcast-1, gateway .1.
		{"v4 defaults", rng("10.0.0.0/24", "", "", ""), rng("10.0.0.0/24", "10.0.0.1", "10.0.0.254", "10.0.0.1"), ""},
		// IPv6 has no broadcast: the range ends at the last address.
		{"v6 defaults", rng("fd10::/64", "", "", ""), rng("fd10::/64", "fd10::1", "fd10::ffff:ffff:ffff:ffff", "fd10::1"), ""},
		// Given values are kept; the gateway may lie outside the range.
		{"explicit", rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "10.10.0.1"), rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "10.10.0.1"), ""},
		// A gateway default of .1 even when rangeStart is set, as host-local does.
		{"gateway default with start", rng("10.0.0.0/24", "10.0.0.100", "", ""), rng("10.0.0.0/24", "10.0.0.100", "10.0.0.254", "10.0.0.1"), ""},
		// /30 is the smallest IPv4 subnet with two usable addresses.
		{"v4 /30 smallest", rng("10.0.0.0/30", "", "", ""), rng("10.0.0.0/30", "10.0.0.1", "10.0.0.2", "10.0.0.1"), ""},
		// /126 is the smallest IPv6 subnet allowed, mirroring IPv4.
		{"v6 /126 smallest", rng("fd00::/126", "", "", ""), rng("fd00::/126", "fd00::1", "fd00::3", "fd00::1"), ""},
		// IPv4-mapped addresses are unmapped so one address has one spelling.
		{"4in6 start unmapped", rng("10.0.0.0/24", "::ffff:10.0.0.10", "", ""), rng("10.0.0.0/24", "10.0.0.10", "10.0.0.254", "10.0.0.1"), ""},
		// An IPv4-mapped subnet becomes its IPv4 form.
		{"4in6 subnet unmapped", rng("::ffff:10.0.0.0/120", "", "", ""), rng("10.0.0.0/24", "10.0.0.1", "10.0.0.254", "10.0.0.1"), ""},

		// A range without a subnet is meaningless.
		{"no subnet", allocator.Range{}, allocator.Range{}, "no valid subnet"},
		// Host bits usually mean a typo; say which network was meant.
		{"host bits", rng("10.0.0.1/24", "", "", ""), allocator.Range{}, "did you mean 10.0.0.0/24"},
		// /31 and /32 have no address besides network and broadcast (host-local refuses them).
		{"v4 /31", rng("10.0.0.0/31", "", "", ""), allocator.Range{}, "too small"},
		{"v4 /32", rng("10.0.0.1/32", "", "", ""), allocator.Range{}, "too small"},
		// Same rule for IPv6.
		{"v6 /127", rng("fd00::/127", "", "", ""), allocator.Range{}, "too small"},
		{"v6 /128", rng("fd00::1/128", "", "", ""), allocator.Range{}, "too small"},
		// Every address given must lie in the subnet.
		{"start outside", rng("10.0.0.0/24", "10.0.1.1", "", ""), allocator.Range{}, "rangeStart 10.0.1.1 lies outside subnet 10.0.0.0/24"},
		{"end outside", rng("10.0.0.0/24", "", "10.0.1.1", ""), allocator.Range{}, "rangeEnd 10.0.1.1 lies outside"},
		{"gateway outside", rng("10.0.0.0/24", "", "", "10.0.1.1"), allocator.Range{}, "gateway 10.0.1.1 lies outside"},
		// A reversed range is refused rather than treated as empty.
		{"start after end", rng("10.0.0.0/24", "10.0.0.20", "10.0.0.10", ""), allocator.Range{}, "rangeStart 10.0.0.20 is after rangeEnd 10.0.0.10"},
		// The network address cannot be handed out.
		{"start is network", rng("10.0.0.0/24", "10.0.0.0", "", ""), allocator.Range{}, "network address"},
		// Nor the IPv4 broadcast.
		{"end is broadcast", rng("10.0.0.0/24", "", "10.0.0.255", ""), allocator.Range{}, "broadcast address"},
		// Families must match.
		{"v6 start in v4 subnet", rng("10.0.0.0/24", "fd00::1", "", ""), allocator.Range{}, "is IPv6 but subnet 10.0.0.0/24 is IPv4"},
		// Zones have no place in a pool definition.
		{"zone", allocator.Range{Subnet: netip.MustParsePrefix("fe80::/64"), RangeStart: addr("fe80::5%eth0")}, allocator.Range{}, "zone"},
		// A mapped prefix shorter than /96 has no IPv4 form.
		{"short 4in6 subnet", rng("::ffff:0.0.0.0/95", "", "", ""), allocator.Range{}, "shorter than /96"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.in
			err := r.Canonicalize()
			if tt.wantErr != "" {
				if !errors.Is(err, allocator.ErrInvalidConfig) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("Canonicalize(%s) = %v, want ErrInvalidConfig containing %q", tt.in, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Canonicalize(%s): %v", tt.in, err)
			}
			if r != tt.want {
				t.Errorf("Canonicalize(%s) = %s, want %s", tt.in, r, tt.want)
			}
			again := r
			if err := again.Canonicalize(); err != nil || again != r {
				t.Errorf("second Canonicalize = %s, %v; want it idempotent", again, err)
			}
		})
	}
}

func TestRangeContainsOverlapsSize(t *testing.T) {
	canon := func(r allocator.Range) allocator.Range {
		t.Helper()
		if err := r.Canonicalize(); err != nil {
			t.Fatal(err)
		}
		return r
	}
	r := canon(rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "10.10.0.1"))

	contains := []struct {
		addr string
		want bool
	}{
		{"10.10.1.0", true},        // start is inclusive
		{"10.10.9.255", true},      // end is inclusive
		{"10.10.0.255", false},     // in the subnet but before the start
		{"10.10.10.0", false},      // just after the end
		{"::ffff:10.10.5.5", true}, // mapped form of a member
		{"fd00::1", false},         // other family
	}
	for _, tt := range contains {
		if got := r.Contains(addr(tt.addr)); got != tt.want {
			t.Errorf("%s.Contains(%s) = %v, want %v", r, tt.addr, got, tt.want)
		}
	}
	if r.Contains(netip.Addr{}) {
		t.Errorf("Contains(zero Addr) = true") // the zero Addr is in nothing
	}

	overlaps := []struct {
		name  string
		other allocator.Range
		want  bool
	}{
		// Touching at one address is an overlap.
		{"shares end", canon(rng("10.10.0.0/16", "10.10.9.255", "10.10.10.10", "")), true},
		// Adjacent but disjoint spans do not overlap, even in the same subnet.
		{"adjacent", canon(rng("10.10.0.0/16", "10.10.10.0", "10.10.10.10", "")), false},
		// A span strictly inside another overlaps.
		{"inside", canon(rng("10.10.0.0/16", "10.10.2.0", "10.10.2.10", "")), true},
		// Different families never overlap.
		{"v6", canon(rng("fd00::/64", "", "", "")), false},
	}
	for _, tt := range overlaps {
		t.Run("overlaps "+tt.name, func(t *testing.T) {
			if got := r.Overlaps(tt.other); got != tt.want {
				t.Errorf("%s.Overlaps(%s) = %v, want %v", r, tt.other, got, tt.want)
			}
			if got := tt.other.Overlaps(r); got != tt.want {
				t.Errorf("Overlaps is not symmetric for %s", tt.other)
			}
		})
	}

	two64 := new(big.Int).Lsh(big.NewInt(1), 64)
	sizes := []struct {
		name string
		r    allocator.Range
		want *big.Int
	}{
		// .1-.254 less the gateway .1.
		{"v4 /24", canon(rng("10.0.0.0/24", "", "", "")), big.NewInt(253)},
		// The gateway outside the range costs nothing.
		{"gateway outside range", r, big.NewInt(9 * 256)},
		// A gateway inside the span is subtracted.
		{"gateway inside", canon(rng("10.0.0.0/24", "10.0.0.10", "10.0.0.20", "10.0.0.15")), big.NewInt(10)},
		// ::1 to the last address is 2^64-1 addresses, less the gateway ::1.
		{"v6 /64", canon(rng("fd10::/64", "", "", "")), new(big.Int).Sub(two64, big.NewInt(2))},
	}
	for _, tt := range sizes {
		t.Run("size "+tt.name, func(t *testing.T) {
			if got := tt.r.Size(); got.Cmp(tt.want) != 0 {
				t.Errorf("%s.Size() = %s, want %s", tt.r, got, tt.want)
			}
		})
	}

	if got, want := r.String(), "10.10.0.0/16 [10.10.1.0-10.10.9.255] gw 10.10.0.1"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

func TestRangeSetCanonicalize(t *testing.T) {
	tests := []struct {
		name    string
		in      allocator.RangeSet
		wantErr string
		family  int
	}{
		// Two disjoint ranges of one subnet are a normal set.
		{"same subnet disjoint", allocator.RangeSet{rng("10.0.0.0/24", "10.0.0.10", "10.0.0.19", ""), rng("10.0.0.0/24", "10.0.0.20", "10.0.0.29", "")}, "", 4},
		// Ranges from several subnets are fine too.
		{"two subnets", allocator.RangeSet{rng("10.0.0.0/24", "", "", ""), rng("10.0.1.0/24", "", "", "")}, "", 4},
		// The family helper reports 6.
		{"v6", allocator.RangeSet{rng("fd00::/64", "", "", "")}, "", 6},
		// An empty set would yield no address.
		{"empty", allocator.RangeSet{}, "range set is empty", 0},
		// One set is one family: IPv4 and IPv6 go into separate sets.
		{"mixed families", allocator.RangeSet{rng("10.0.0.0/24", "", "", ""), rng("fd00::/64", "", "", "")}, "one range set holds one address family", 0},
		// Overlapping ranges inside a set would hand out an address twice.
		{"overlap inside set", allocator.RangeSet{rng("10.0.0.0/24", "", "", ""), rng("10.0.0.0/24", "10.0.0.100", "10.0.0.200", "")}, "range 1 (10.0.0.0/24 [10.0.0.100-10.0.0.200] gw 10.0.0.1) overlaps range 0", 0},
		// A bad range is named by position.
		{"bad range", allocator.RangeSet{rng("10.0.0.0/24", "", "", ""), rng("10.0.1.0/31", "", "", "")}, "range 1: invalid ipam configuration: subnet 10.0.1.0/31 is too small", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.in.Canonicalize()
			if tt.wantErr != "" {
				if !errors.Is(err, allocator.ErrInvalidConfig) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("Canonicalize = %v, want ErrInvalidConfig containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Canonicalize: %v", err)
			}
			if got := tt.in.Family(); got != tt.family {
				t.Errorf("Family() = %d, want %d", got, tt.family)
			}
		})
	}
}

func TestRangeSetAfter(t *testing.T) {
	s := allocator.RangeSet{rng("10.0.0.0/24", "10.0.0.10", "10.0.0.19", ""), rng("10.0.5.0/24", "10.0.5.100", "10.0.5.109", "")}
	if err := s.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		in, want string
	}{
		{"10.0.0.12", "10.0.0.13"},   // inside a range: the next address
		{"10.0.0.19", "10.0.5.100"},  // end of a range: start of the next range
		{"10.0.5.109", "10.0.0.10"},  // end of the last range wraps to the first
		{"192.168.0.1", "10.0.0.10"}, // outside the set: start of the first range
	}
	for _, tt := range tests {
		if got := s.After(addr(tt.in)); got != addr(tt.want) {
			t.Errorf("After(%s) = %s, want %s", tt.in, got, tt.want)
		}
	}
	if got := s.After(netip.Addr{}); got != addr("10.0.0.10") {
		t.Errorf("After(zero) = %s, want the first start", got) // no previous address yet
	}
}

func TestRangeSetOverlaps(t *testing.T) {
	canon := func(rs ...allocator.Range) allocator.RangeSet {
		s := allocator.RangeSet(rs)
		if err := s.Canonicalize(); err != nil {
			t.Fatal(err)
		}
		return s
	}
	a := canon(rng("10.0.0.0/24", "10.0.0.10", "10.0.0.19", ""), rng("10.0.1.0/24", "", "", ""))
	tests := []struct {
		name string
		b    allocator.RangeSet
		want bool
	}{
		{"second ranges meet", canon(rng("10.0.1.0/24", "10.0.1.200", "", "")), true},            // any pair overlapping counts
		{"same subnet disjoint", canon(rng("10.0.0.0/24", "10.0.0.20", "10.0.0.30", "")), false}, // sharing a subnet is not overlapping
		{"other family", canon(rng("fd00::/64", "", "", "")), false},                             // families never overlap
		{"empty", allocator.RangeSet{}, false},                                                   // nothing overlaps nothing
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := a.Overlaps(tt.b); got != tt.want {
				t.Errorf("%s overlaps %s = %v, want %v", a, tt.b, got, tt.want)
			}
		})
	}
}

func TestRangeSetSpread(t *testing.T) {
	set := allocator.RangeSet{
		{Subnet: netip.MustParsePrefix("10.0.0.0/24"), RangeStart: netip.MustParseAddr("10.0.0.10"), RangeEnd: netip.MustParseAddr("10.0.0.19")},
		{Subnet: netip.MustParsePrefix("10.0.1.0/24"), RangeStart: netip.MustParseAddr("10.0.1.0"), RangeEnd: netip.MustParseAddr("10.0.1.9")},
	}
	v6 := allocator.RangeSet{{Subnet: netip.MustParsePrefix("fd00::/64"), RangeStart: netip.MustParseAddr("fd00::1"), RangeEnd: netip.MustParseAddr("fd00::ffff:ffff:ffff:ffff")}}
	tests := []struct {
		name string
		set  allocator.RangeSet
		u    float64
		want string
	}{
		{"start", set, 0, "10.0.0.10"},                             // position 0 is the first range's start
		{"inside the first range", set, 0.25, "10.0.0.15"},         // 5 of 20
		{"into the second range", set, 0.5, "10.0.1.0"},            // 10 of 20 crosses into range two
		{"last", set, 0.999, "10.0.1.9"},                           // never past the end
		{"clamped above", set, 7, "10.0.1.9"},                      // out-of-range positions are clamped
		{"a /64 keeps its precision", v6, 0.5, "fd00::8000:0:0:0"}, // half of 2^64-1 from fd00::1
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.set.Spread(tc.u); got.String() != tc.want {
				t.Errorf("Spread(%v) = %s, want %s", tc.u, got, tc.want)
			}
		})
	}
}
