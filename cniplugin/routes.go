package cniplugin

import (
	"fmt"
	"math"
	"net"
	"net/netip"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
)

// Route is one route of the network configuration and of the ADD result, in CNI's
// format: {"dst", "gw", "mtu", "advmss", "priority", "table", "scope"}.
type Route struct {
	// Dst is the destination, a masked prefix ("0.0.0.0/0").
	Dst netip.Prefix
	// GW is the next hop; the zero Addr for a device route.
	GW netip.Addr
	// MTU and AdvMSS are optional route attributes; zero means unset.
	MTU    int
	AdvMSS int
	// Priority is the route metric; zero means the kernel's default.
	Priority int
	// Table is the routing table; nil means the main table (254).
	Table *int
	// Scope is the route scope; nil means universe (0).
	Scope *int
}

// GroupBasePriority is the metric given to the first route of a same-destination group
// that has no explicit priority; the next one gets GroupBasePriority+1, and so on.
// 1024 is the kernel's default IPv6 metric, so the preferred IPv6 route keeps it.
const GroupBasePriority = 1024

// rawRoute is a route as written in ipam.routes.
type rawRoute struct {
	Dst      string `json:"dst"`
	GW       string `json:"gw"`
	MTU      int    `json:"mtu"`
	AdvMSS   int    `json:"advmss"`
	Priority int    `json:"priority"`
	Table    *int   `json:"table"`
	Scope    *int   `json:"scope"`
}

// parseRoutes parses ipam.routes; errors wrap allocator.ErrInvalidConfig and name the
// route by its position.
func parseRoutes(raw []rawRoute) ([]Route, error) {
	var out []Route
	for i, rr := range raw {
		where := fmt.Sprintf("ipam.routes[%d]", i)
		dst, err := netip.ParsePrefix(rr.Dst)
		if err != nil {
			return nil, fmt.Errorf("%w: %s.dst %q is not a CIDR; write it like 0.0.0.0/0, 10.0.0.0/8 or ::/0",
				allocator.ErrInvalidConfig, where, rr.Dst)
		}
		if dst != dst.Masked() {
			return nil, fmt.Errorf("%w: %s.dst %s has host bits set, which the kernel refuses; did you mean %s?",
				allocator.ErrInvalidConfig, where, rr.Dst, dst.Masked())
		}
		r := Route{Dst: dst, MTU: rr.MTU, AdvMSS: rr.AdvMSS, Priority: rr.Priority, Table: rr.Table, Scope: rr.Scope}
		if rr.GW != "" {
			gw, err := netip.ParseAddr(rr.GW)
			if err != nil || gw.Zone() != "" {
				return nil, fmt.Errorf("%w: %s.gw %q is not an IP address; write a plain address such as 10.10.0.1",
					allocator.ErrInvalidConfig, where, rr.GW)
			}
			r.GW = gw.Unmap()
		}
		for _, f := range []struct {
			name string
			v    *int
			max  int
		}{{"mtu", &r.MTU, 1 << 30}, {"advmss", &r.AdvMSS, 1 << 30}, {"priority", &r.Priority, math.MaxInt32},
			{"table", r.Table, math.MaxInt32}, {"scope", r.Scope, 255}} {
			if f.v != nil && (*f.v < 0 || *f.v > f.max) {
				return nil, fmt.Errorf("%w: %s.%s %d is out of range; use 0 to %d",
					allocator.ErrInvalidConfig, where, f.name, *f.v, f.max)
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// ResolveRoutes checks routes against pool (canonical) and returns them, in order, with
// the priorities they will carry in the result.
//
// Checks, each refused with an error wrapping allocator.ErrInvalidConfig that names the
// route and what to change:
//
//   - a route's gateway is of the destination's family;
//   - the pool has a range set of the route's family (otherwise the interface would get
//     no address of that family to route from);
//   - a gateway lies in the subnet of some range of the pool, that is on-link for the
//     interface the addresses go to;
//   - a gateway is not an address the pool could hand out (a range's own gateway and
//     excluded addresses are fine; another address inside a range would one day be a
//     pod's, a duplicate of the router).
//
// Same-destination routes. Routes that share destination, table and scope form a
// group (an absent table counts as the main table, 254; an absent scope as universe,
// 0). The kernel treats such routes differently per family when they share a metric:
// IPv4 keeps separate routes of which only one is used, while IPv6 merges them into one
// ECMP multipath route (containernetworking/plugins#1261). leasehold gives them one
// meaning for both families: in a group of two or more, every route without an
// explicit priority gets priority GroupBasePriority (1024) plus its position in the
// group, in config order, so the first listed route has the lowest metric and is
// preferred, and the others are ordered fallbacks, installed as separate routes on
// IPv4 and IPv6 alike. Two routes of one group with the same explicit priority are
// refused (IPv6 would make them ECMP, IPv4 would not), as is an explicit priority equal
// to one assigned to another route of the group. A route alone in its group keeps
// priority 0, the kernel's default. Routes of different destinations, tables or scopes
// are never renumbered.
func ResolveRoutes(routes []Route, pool allocator.PoolSpec) ([]Route, error) {
	if len(routes) == 0 {
		return nil, nil
	}
	out := make([]Route, len(routes))
	copy(out, routes)
	type key struct {
		dst          netip.Prefix
		table, scope int
	}
	groups := map[key][]int{}
	var order []key
	for i, r := range out {
		if err := checkRoute(i, r, pool); err != nil {
			return nil, err
		}
		k := key{r.Dst, 254, 0}
		if r.Table != nil {
			k.table = *r.Table
		}
		if r.Scope != nil {
			k.scope = *r.Scope
		}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], i)
	}
	for _, k := range order {
		members := groups[k]
		if len(members) < 2 {
			continue
		}
		owner := map[int]int{} // priority -> route index
		for _, i := range members {
			if p := out[i].Priority; p != 0 {
				if j, dup := owner[p]; dup {
					return nil, fmt.Errorf("%w: ipam.routes[%d] and ipam.routes[%d] both go to %s with priority %d; "+
						"IPv6 would merge them into one multipath route and IPv4 would not, so leasehold refuses this: "+
						"give them different priorities, or none to keep config order",
						allocator.ErrInvalidConfig, j, i, k.dst, p)
				}
				owner[p] = i
			}
		}
		for pos, i := range members {
			if out[i].Priority != 0 {
				continue
			}
			p := GroupBasePriority + pos
			if j, taken := owner[p]; taken {
				return nil, fmt.Errorf("%w: ipam.routes[%d] (to %s) would get priority %d by its place in the group, "+
					"but ipam.routes[%d] has that priority explicitly; give all routes to %s explicit priorities or none",
					allocator.ErrInvalidConfig, i, k.dst, p, j, k.dst)
			}
			out[i].Priority = p
		}
	}
	return out, nil
}

// checkRoute checks families and on-link gateways of route i.
func checkRoute(i int, r Route, pool allocator.PoolSpec) error {
	fam := 4
	if r.Dst.Addr().Is6() {
		fam = 6
	}
	if r.GW.IsValid() && r.GW.Is4() != r.Dst.Addr().Is4() {
		return fmt.Errorf("%w: ipam.routes[%d]: gateway %s and destination %s are of different address families; "+
			"use an IPv%d gateway or drop gw", allocator.ErrInvalidConfig, i, r.GW, r.Dst, fam)
	}
	if len(pool.Ranges) == 0 {
		// The pool is a reference to a definition in etcd that the plugin does not see;
		// what needs the ranges (family present, gateway on-link and not allocatable) is
		// the pool creator's to get right.
		return nil
	}
	hasFamily := false
	for _, s := range pool.Ranges {
		if s.Family() == fam {
			hasFamily = true
		}
	}
	if !hasFamily {
		return fmt.Errorf("%w: ipam.routes[%d]: route to %s is IPv%d but pool %s has no IPv%d range set, so the "+
			"interface gets no IPv%d address to use it; remove the route or add an IPv%d range set",
			allocator.ErrInvalidConfig, i, r.Dst, fam, pool.Name, fam, fam, fam)
	}
	if !r.GW.IsValid() {
		return nil
	}
	onLink := false
	for _, s := range pool.Ranges {
		for _, rg := range s {
			onLink = onLink || rg.Subnet.Contains(r.GW)
		}
	}
	if !onLink {
		return fmt.Errorf("%w: ipam.routes[%d]: gateway %s is not on-link: it lies in no subnet of pool %s; "+
			"add the subnet or drop gw", allocator.ErrInvalidConfig, i, r.GW, pool.Name)
	}
	// A router's address the pool could hand to a pod would be a duplicate on the link.
	if pool.Allocatable(r.GW) == nil {
		return fmt.Errorf("%w: ipam.routes[%d]: gateway %s lies inside a range of pool %s, so the pool could hand the "+
			"router's address to a pod; add %q to \"exclude\" or move the range past it",
			allocator.ErrInvalidConfig, i, r.GW, pool.Name, r.GW.String())
	}
	return nil
}

// CNI returns r as a CNI route.
func (r Route) CNI() *types.Route {
	out := &types.Route{
		Dst:      net.IPNet{IP: net.IP(r.Dst.Addr().AsSlice()), Mask: net.CIDRMask(r.Dst.Bits(), r.Dst.Addr().BitLen())},
		MTU:      r.MTU,
		AdvMSS:   r.AdvMSS,
		Priority: r.Priority,
	}
	if r.GW.IsValid() {
		out.GW = net.IP(r.GW.AsSlice())
	}
	if r.Table != nil {
		t := *r.Table
		out.Table = &t
	}
	if r.Scope != nil {
		s := *r.Scope
		out.Scope = &s
	}
	return out
}
