package cniplugin

import (
	"net/netip"

	"errors"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

func intp(v int) *int { return &v }

func TestRoutesFromConfig(t *testing.T) {
	c, err := ParseConfig(readFixture(t, "routes_same_dst.json"), "", "", "", "")
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	want := []struct {
		dst, gw  string
		priority int
		why      string
	}{
		{"0.0.0.0/0", "10.0.0.1", 1024, "first IPv4 default: preferred"},
		{"::/0", "2001:db8::1", 1024, "first IPv6 default: preferred, same rule as IPv4"},
		{"0.0.0.0/0", "10.0.0.2", 1025, "second IPv4 default: separate fallback route, not last-wins"},
		{"::/0", "2001:db8::2", 1025, "second IPv6 default: separate fallback route, not ECMP"},
		{"0.0.0.0/0", "10.0.0.3", 0, "other table: its own group of one"},
		{"192.168.0.0/16", "10.0.0.1", 0, "single route keeps the kernel default"},
		{"172.16.0.0/12", "10.0.0.1", 10, "explicit priority is kept"},
		{"172.16.0.0/12", "10.0.0.2", 1025, "numbered by position in its group, after the explicit one"},
	}
	if len(c.Routes) != len(want) {
		t.Fatalf("got %d routes, want %d", len(c.Routes), len(want))
	}
	for i, w := range want {
		r := c.Routes[i]
		if r.Dst.String() != w.dst || r.GW.String() != w.gw || r.Priority != w.priority {
			t.Errorf("route %d = %s via %s priority %d, want %s via %s priority %d (%s)",
				i, r.Dst, r.GW, r.Priority, w.dst, w.gw, w.priority, w.why)
		}
	}
	if c.Routes[5].MTU != 1400 || c.Routes[4].Table == nil || *c.Routes[4].Table != 100 {
		t.Errorf("route attributes lost: %+v %+v", c.Routes[5], c.Routes[4])
	}
}

func TestResolveRoutes(t *testing.T) {
	pool := allocator.PoolSpec{Name: "p", Ranges: []allocator.RangeSet{
		{{Subnet: pfx("10.0.0.0/24")}, {Subnet: pfx("10.0.1.0/24")}},
		{{Subnet: pfx("2001:db8::/64")}},
	}, Exclude: []netip.Prefix{pfx("10.0.0.2/31"), pfx("2001:db8::2/127")}} // the second routers
	if err := pool.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	v4 := func(dst, gw string) Route { return Route{Dst: pfx(dst), GW: addr(gw)} }
	tests := []struct {
		name   string
		routes []Route
		want   []int // priorities, when no error
		err    string
	}{
		// No routes, no result routes.
		{"none", nil, nil, ""},
		// Different destinations never interact.
		{"distinct", []Route{v4("0.0.0.0/0", "10.0.0.1"), v4("10.9.0.0/16", "10.0.0.1")}, []int{0, 0}, ""},
		// Three IPv6 routes to one destination are ordered 1024, 1025, 1026.
		{"v6 group of three", []Route{
			{Dst: pfx("::/0"), GW: addr("2001:db8::1")},
			{Dst: pfx("::/0"), GW: addr("2001:db8::2")},
			{Dst: pfx("::/0"), GW: addr("2001:db8::3")},
		}, []int{1024, 1025, 1026}, ""},
		// An absent table is the main table: grouped with an explicit 254.
		{"table 254 is main", []Route{
			v4("0.0.0.0/0", "10.0.0.1"),
			{Dst: pfx("0.0.0.0/0"), GW: addr("10.0.0.2"), Table: intp(254)},
		}, []int{1024, 1025}, ""},
		// An absent scope is universe: grouped with an explicit 0.
		{"scope 0 is default", []Route{
			v4("0.0.0.0/0", "10.0.0.1"),
			{Dst: pfx("0.0.0.0/0"), GW: addr("10.0.0.2"), Scope: intp(0)},
		}, []int{1024, 1025}, ""},
		// A different scope is a different group.
		{"scope separates", []Route{
			{Dst: pfx("10.9.0.0/16"), Scope: intp(253)},
			v4("10.9.0.0/16", "10.0.0.1"),
		}, []int{0, 0}, ""},
		// Distinct explicit priorities are fine as they are.
		{"explicit distinct", []Route{
			{Dst: pfx("0.0.0.0/0"), GW: addr("10.0.0.1"), Priority: 200},
			{Dst: pfx("0.0.0.0/0"), GW: addr("10.0.0.2"), Priority: 100},
		}, []int{200, 100}, ""},
		// A gateway in the second range's subnet is on-link.
		{"gw in any subnet", []Route{v4("0.0.0.0/0", "10.0.1.1")}, []int{0}, ""},
		// Same explicit priority: ECMP on IPv6 only, so refused (IPv4 too, for one meaning).
		{"v4 duplicate priority", []Route{
			{Dst: pfx("0.0.0.0/0"), GW: addr("10.0.0.1"), Priority: 5},
			{Dst: pfx("0.0.0.0/0"), GW: addr("10.0.0.2"), Priority: 5},
		}, nil, "both go to 0.0.0.0/0 with priority 5"},
		// A gateway of the other family is refused.
		{"v6 gw for v4 dst", []Route{{Dst: pfx("0.0.0.0/0"), GW: addr("2001:db8::1")}}, nil, "different address families"},
		// A gateway outside every subnet cannot be reached.
		{"off-link gw", []Route{v4("0.0.0.0/0", "10.0.2.1")}, nil, "gateway 10.0.2.1 is not on-link: it lies in no subnet of pool p"},
		{"off-link v6 gw", []Route{{Dst: pfx("::/0"), GW: addr("2001:db9::1")}}, nil, "not on-link"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := append([]Route(nil), tt.routes...)
			got, err := ResolveRoutes(in, pool)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) || !errors.Is(err, allocator.ErrInvalidConfig) {
					t.Errorf("error %v, want ErrInvalidConfig containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ResolveRoutes: %v", err)
			}
			if len(got) != len(tt.want) {
				t.Fatalf("got %d routes, want %d", len(got), len(tt.want))
			}
			for i := range got {
				if got[i].Priority != tt.want[i] {
					t.Errorf("route %d priority %d, want %d", i, got[i].Priority, tt.want[i])
				}
				if in[i].Priority != tt.routes[i].Priority {
					t.Errorf("input route %d was modified", i)
				}
			}
		})
	}
}
