package integration

import (
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/leasehold/leasehold/keyspace"
)

// ccHop is the shape of one route of a same-destination group: its metric, the gateway it
// goes through (a single-path route) and how many paths it has.
type ccHop struct {
	Priority uint32
	GW       netip.Addr
	Paths    int
}

// ccShape returns the routes of a FIB as their shapes, ordered by metric.
func ccShape(routes []ccRoute) []ccHop {
	var out []ccHop
	for _, r := range routes {
		h := ccHop{Priority: r.Priority, Paths: len(r.Nexthops)}
		if !r.MultiPath && len(r.Nexthops) == 1 {
			h.GW = r.Nexthops[0].GW
		}
		out = append(out, h)
	}
	slices.SortFunc(out, func(a, b ccHop) int { return int(a.Priority) - int(b.Priority) })
	return out
}

// ccGWRank maps a shape's gateways to their position in the configuration (A=0, B=1), so
// the shapes of the two families can be compared.
func ccGWRank(shape []ccHop, gws ...netip.Addr) []string {
	var out []string
	for _, h := range shape {
		out = append(out, fmt.Sprintf("metric %d via gw#%d paths %d", h.Priority, slices.Index(gws, h.GW), h.Paths))
	}
	return out
}

// TestRouteFamilySplitSameDestinationRoutesHaveOneShape reproduces the route family split
// (docs/field-failures.md), containernetworking/plugins#1261, against a real kernel. Two routes to the same
// destination with no metric mean different things per family: IPv4 keeps them as two
// separate routes (only the first is used, the second is a dormant duplicate), while IPv6
// merges the second into the first as one ECMP multipath route (traffic is spread over
// both gateways). leasehold's result gives such routes ordered priorities (1024 for the
// first listed, 1025 for the next, ARCHITECTURE.md "Routes"), so that the reference
// plugins install, in both FIBs, two separate routes: the first-listed gateway preferred on
// 1024, the other a fallback on 1025, and no IPv6 multipath route. The routes are listed
// interleaved (v4 A, v6 A, v4 B, v6 B) to show that the position counts inside the group,
// not in the list. The bridge plugin runs with isGateway and isDefaultGateway off, so every
// default route in the namespace is one of leasehold's.
func TestRouteFamilySplitSameDestinationRoutesHaveOneShape(t *testing.T) {
	f := newFixture(t, withNetns())
	hostNS, bridge := ccHostNS(t)
	name := f.Pool
	sub4, sub6 := netip.MustParsePrefix("10.63.0.0/24"), netip.MustParsePrefix("fd63::/64")
	gwA4, gwB4 := netip.MustParseAddr("10.63.0.1"), netip.MustParseAddr("10.63.0.2")
	gwA6, gwB6 := netip.MustParseAddr("fd63::1"), netip.MustParseAddr("fd63::2")
	def4, def6 := netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")
	ipam := ccLeaseholdIPAM(f.Agent.Socket, []any{
		[]any{map[string]any{"subnet": sub4.String(), "gateway": gwA4.String()}},
		[]any{map[string]any{"subnet": sub6.String(), "gateway": gwA6.String()}},
	},
		ccRouteConf(def4.String(), gwA4.String()),
		ccRouteConf(def6.String(), gwA6.String()),
		ccRouteConf(def4.String(), gwB4.String()),
		ccRouteConf(def6.String(), gwB6.String()),
	)
	// The second routers lie inside the ranges: leasehold refuses such a configuration
	// unless they are excluded (it would otherwise hand a router's address to a pod).
	ipam["exclude"] = []string{gwB4.String(), gwB6.String()}
	rtm := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{
		"type": "bridge", "bridge": bridge, "isGateway": false, "isDefaultGateway": false, "ipam": ipam,
	}))
	ctr := f.sandbox("lh-ccrt-")
	rt := ccRT(ctr, "uid-"+ctr)
	res, err := rtm.add(f.Ctx, rt)
	if err != nil {
		t.Fatalf("libcni ADD: %v", err)
	}
	ccWantDualStack(t, res, sub4, sub6)

	// The CNI result carries the priorities.
	var got []string
	for _, r := range res.Routes {
		got = append(got, fmt.Sprintf("%s via %s priority %d", r.Dst.String(), r.GW, r.Priority))
	}
	want := []string{
		"0.0.0.0/0 via 10.63.0.1 priority 1024",
		"::/0 via fd63::1 priority 1024",
		"0.0.0.0/0 via 10.63.0.2 priority 1025",
		"::/0 via fd63::2 priority 1025",
	}
	if !slices.Equal(got, want) {
		t.Errorf("result routes:\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}

	// Both FIBs have the same shape.
	path := ccNetnsPath(ctr)
	eth0, ok := ccReadLink(t, path, "eth0")
	if !ok {
		t.Fatalf("no eth0 in %s", path)
	}
	fib4 := ccMainRoutesOn(ccReadRoutes(t, path, syscall.AF_INET), def4, eth0.Index)
	fib6 := ccMainRoutesOn(ccReadRoutes(t, path, syscall.AF_INET6), def6, eth0.Index)
	t.Logf("IPv4 FIB:\n%sIPv6 FIB:\n%s", ccIP(path, "-4", "route", "show", "default"), ccIP(path, "-6", "route", "show", "default"))
	shape4, shape6 := ccShape(fib4), ccShape(fib6)
	wantShape := []string{"metric 1024 via gw#0 paths 1", "metric 1025 via gw#1 paths 1"}
	rank4, rank6 := ccGWRank(shape4, gwA4, gwB4), ccGWRank(shape6, gwA6, gwB6)
	if !slices.Equal(rank4, wantShape) {
		t.Errorf("IPv4 default routes on eth0: %v (%v), want %v", rank4, fib4, wantShape)
	}
	if !slices.Equal(rank6, wantShape) {
		t.Errorf("IPv6 default routes on eth0: %v (%v), want %v", rank6, fib6, wantShape)
	}
	for _, r := range fib6 {
		if r.MultiPath {
			t.Errorf("IPv6 merged the same-destination routes into a multipath route: %v", r)
		}
	}
	if !slices.Equal(rank4, rank6) {
		t.Errorf("one configuration, two shapes: IPv4 %v, IPv6 %v", rank4, rank6)
	}

	// Control: what the kernel does with two same-destination routes of one metric, added
	// as the plugins add routes (netlink.RouteAddEcmp: NLM_F_CREATE without NLM_F_EXCL, which
	// is `ip route prepend`). IPv4 keeps two routes, IPv6 makes one multipath route; this
	// also shows that the FIB reader above tells the two shapes apart.
	ctl4, ctl6 := netip.MustParsePrefix("198.51.100.0/24"), netip.MustParsePrefix("2001:db8:63::/64")
	for _, c := range []struct {
		dst netip.Prefix
		gw  netip.Addr
	}{{ctl4, gwA4}, {ctl4, gwB4}, {ctl6, gwA6}, {ctl6, gwB6}} {
		if out, err := exec.Command("ip", "-n", ctr, "route", "prepend", c.dst.String(), "via", c.gw.String(),
			"dev", "eth0", "metric", "2000").CombinedOutput(); err != nil {
			t.Fatalf("ip route prepend %s via %s: %v\n%s", c.dst, c.gw, err, out)
		}
	}
	raw4 := ccShape(ccMainRoutesOn(ccReadRoutes(t, path, syscall.AF_INET), ctl4, eth0.Index))
	raw6 := ccShape(ccMainRoutesOn(ccReadRoutes(t, path, syscall.AF_INET6), ctl6, eth0.Index))
	if len(raw4) != 2 || raw4[0].Paths != 1 || raw4[1].Paths != 1 {
		t.Errorf("control: IPv4 should keep two separate routes for one metric, FIB has %v", raw4)
	}
	if len(raw6) != 1 || raw6[0].Paths != 2 {
		t.Errorf("control: IPv6 should merge them into one 2-path route, FIB has %v", raw6)
	}

	// The reference plugin's CHECK finds every route of the result; DEL clears it all.
	if err := rtm.check(f.Ctx, rt); err != nil {
		t.Errorf("libcni CHECK: %v", err)
	}
	if err := rtm.del(f.Ctx, rt); err != nil {
		t.Fatalf("libcni DEL: %v", err)
	}
	if held := ccHeldBy(t, f.Cli, name, "uid-"+ctr); len(held) != 0 {
		t.Errorf("after DEL etcd still holds %v", held)
	}
}

// TestRouteFamilySplitAmbiguousRoutesAreRefusedBeforeAnythingIsWritten proves that routes whose
// meaning would depend on the kernel or the family are refused at ADD, through the bridge
// plugin and libcni, with CNI code 7 and a message that says what is wrong, and that such
// an ADD writes nothing to etcd (not even the pool definition): a gateway that lies in no
// subnet of the pool (not on-link), a gateway of the other family, and two routes to one
// destination with the same explicit priority (IPv6 would make them ECMP, IPv4 would not).
func TestRouteFamilySplitAmbiguousRoutesAreRefusedBeforeAnythingIsWritten(t *testing.T) {
	f := newFixture(t, withNetns())
	hostNS, bridge := ccHostNS(t)
	// The agent's node record is written once at start; wait for it so that the snapshots
	// below see a quiet store.
	eventually(t, "the agent's node record", func() error {
		return saw(exists(t, f.Cli, keyspace.NodeKey(f.Cluster, f.Agent.Node)), "no %s", keyspace.NodeKey(f.Cluster, f.Agent.Node))
	})

	ranges := []any{
		[]any{map[string]any{"subnet": "10.64.0.0/24"}},
		[]any{map[string]any{"subnet": "fd64::/64", "rangeEnd": "fd64::ffff"}}, // fd64::1:1 is on-link, outside the range
	}
	for _, tc := range []struct {
		name   string
		routes []map[string]any
		want   []string // substrings of the error message
	}{
		{"gateway outside every subnet", []map[string]any{ccRouteConf("0.0.0.0/0", "192.168.64.1")},
			[]string{"ipam.routes[0]", "192.168.64.1", "not on-link", "no subnet of pool"}},
		{"IPv6 gateway for an IPv4 destination", []map[string]any{ccRouteConf("0.0.0.0/0", "fd64::1")},
			[]string{"ipam.routes[0]", "fd64::1", "different address families"}},
		{"IPv4 gateway for an IPv6 destination", []map[string]any{ccRouteConf("::/0", "10.64.0.1")},
			[]string{"ipam.routes[0]", "10.64.0.1", "different address families"}},
		{"gateway inside a range", []map[string]any{ccRouteConf("0.0.0.0/0", "10.64.0.1"), ccRouteConf("0.0.0.0/0", "10.64.0.7")},
			[]string{"ipam.routes[1]", "10.64.0.7", "could hand the router's address to a pod", "exclude"}},
		{"same destination, same explicit priority", []map[string]any{
			ccRouteConf("::/0", "fd64::1", "priority", 100), ccRouteConf("::/0", "fd64::1:1", "priority", 100)},
			[]string{"ipam.routes[0] and ipam.routes[1]", "priority 100", "multipath"}},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			name := uniq("ccbad")
			rtm := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{
				"type": "bridge", "bridge": bridge, "ipam": ccLeaseholdIPAM(f.Agent.Socket, ranges, tc.routes...),
			}))
			ctr := ccUniq("lh-ccbad-")
			sandbox(t, ctr)
			before := snapshot(t, f.Cli, keyspace.Prefix)
			res, err := rtm.add(f.Ctx, ccRT(ctr, "uid-"+ctr))
			if err == nil {
				t.Fatalf("ADD accepted, result %v", res)
			}
			if cniCode(err) != 7 {
				t.Errorf("want CNI code 7, got %d: %v", cniCode(err), err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q: %v", w, err)
				}
			}
			after := snapshot(t, f.Cli, keyspace.Prefix)
			for k, v := range after {
				if before[k] != v {
					t.Errorf("refused ADD wrote %s = %s", k, v)
				}
			}
			for k := range before {
				if _, ok := after[k]; !ok {
					t.Errorf("refused ADD removed %s", k)
				}
			}
			if exists(t, f.Cli, keyspace.PoolKey(name)) {
				t.Errorf("refused ADD stored pool %s", name)
			}
		})
	}
}
