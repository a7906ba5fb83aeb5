package allocator

import (
	"math/big"
	"net/netip"
	"testing"
)

func TestLastAddr(t *testing.T) {
	tests := []struct {
		prefix, want string
	}{
		{"10.0.0.0/24", "10.0.0.255"},                       // byte-aligned IPv4
		{"10.0.0.0/20", "10.0.15.255"},                      // a mask inside a byte
		{"10.0.0.7/30", "10.0.0.7"},                         // host bits in the input are ignored
		{"0.0.0.0/0", "255.255.255.255"},                    // the whole IPv4 space
		{"fd10::/64", "fd10::ffff:ffff:ffff:ffff"},          // a normal IPv6 pool
		{"fd10::/65", "fd10::7fff:ffff:ffff:ffff"},          // half of it
		{"::/0", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"}, // the whole IPv6 space
		{"fd10::1/128", "fd10::1"},                          // a single address
	}
	for _, tt := range tests {
		p := netip.MustParsePrefix(tt.prefix)
		if got := lastAddr(p); got != netip.MustParseAddr(tt.want) {
			t.Errorf("lastAddr(%s) = %s, want %s", tt.prefix, got, tt.want)
		}
	}
}

func TestCountBetween(t *testing.T) {
	tests := []struct {
		lo, hi string
		want   *big.Int
	}{
		{"10.0.0.1", "10.0.0.1", big.NewInt(1)},                                                 // one address
		{"10.0.0.0", "10.0.1.255", big.NewInt(512)},                                             // across a byte boundary
		{"10.0.0.5", "10.0.0.4", big.NewInt(0)},                                                 // hi < lo is empty, not negative
		{"::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", new(big.Int).Lsh(big.NewInt(1), 128)}, // beyond uint64
	}
	for _, tt := range tests {
		got := countBetween(netip.MustParseAddr(tt.lo), netip.MustParseAddr(tt.hi))
		if got.Cmp(tt.want) != 0 {
			t.Errorf("countBetween(%s, %s) = %s, want %s", tt.lo, tt.hi, got, tt.want)
		}
	}
}

func TestSiblings(t *testing.T) {
	tests := []struct {
		a, b string
		want bool
	}{
		{"10.0.0.0/25", "10.0.0.128/25", true},     // two halves of a /24
		{"10.0.0.128/25", "10.0.1.0/25", false},    // adjacent but of different parents
		{"10.0.0.0/25", "10.0.0.128/26", false},    // different lengths
		{"0.0.0.0/0", "0.0.0.0/0", false},          // nothing is above /0
		{"10.0.0.0/25", "10.0.0.0/25", false},      // a prefix is not its own sibling
		{"fd10::/65", "fd10::8000:0:0:0/65", true}, // IPv6 halves
	}
	for _, tt := range tests {
		if got := siblings(netip.MustParsePrefix(tt.a), netip.MustParsePrefix(tt.b)); got != tt.want {
			t.Errorf("siblings(%s, %s) = %v, want %v", tt.a, tt.b, got, tt.want)
		}
	}
}

func TestExcludedBy(t *testing.T) {
	p := PoolSpec{Exclude: []netip.Prefix{
		netip.MustParsePrefix("10.0.0.16/28"),
		netip.MustParsePrefix("10.0.1.0/24"),
		netip.MustParsePrefix("fd10::/64"),
	}}
	tests := []struct {
		addr string
		want string // "" for not excluded
	}{
		{"10.0.0.15", ""},             // just before the first prefix
		{"10.0.0.16", "10.0.0.16/28"}, // its first address
		{"10.0.0.31", "10.0.0.16/28"}, // its last address
		{"10.0.0.32", ""},             // between prefixes
		{"10.0.1.200", "10.0.1.0/24"}, // inside the second
		{"fd10::5", "fd10::/64"},      // IPv6 sorts after IPv4
		{"fd11::", ""},                // after everything
		{"1.1.1.1", ""},               // before everything
	}
	for _, tt := range tests {
		x, ok := p.ExcludedBy(netip.MustParseAddr(tt.addr))
		if got := map[bool]string{true: x.String(), false: ""}[ok]; got != tt.want {
			t.Errorf("ExcludedBy(%s) = %q, want %q", tt.addr, got, tt.want)
		}
	}
}
