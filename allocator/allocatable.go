package allocator

import (
	"fmt"
	"math/big"
	"net/netip"
	"slices"
	"sort"
	"strings"
)

// This file holds what a pool hands out and what it never does: excluded prefixes and
// gateways, the exact count of what is left, and the questions asked about one address.
// All methods take p as canonical and unmap IPv4-mapped IPv6 addresses first.

// canonicalExcludes validates p.Exclude and returns its canonical form: masked, IPv4
// for IPv4-mapped forms, sorted, disjoint, minimal (nested prefixes dropped, sibling
// halves merged into their parent), nil when empty. p.Ranges must be canonical.
func (p *PoolSpec) canonicalExcludes() ([]netip.Prefix, error) {
	if len(p.Exclude) == 0 {
		return nil, nil
	}
	fams := map[int]bool{}
	for _, s := range p.Ranges {
		fams[s.Family()] = true
	}
	list := make([]netip.Prefix, 0, len(p.Exclude))
	for i, x := range p.Exclude {
		if !x.IsValid() {
			return nil, fmt.Errorf("%w: pool %s exclude entry %d is not a valid prefix; write a CIDR such as 10.10.1.0/28",
				ErrInvalidConfig, p.Name, i)
		}
		n, ok := normPrefix(x)
		if !ok {
			return nil, fmt.Errorf("%w: pool %s exclude %s is an IPv4-mapped prefix shorter than /96; write it as IPv4",
				ErrInvalidConfig, p.Name, x)
		}
		n = n.Masked()
		if f := family(n.Addr()); !fams[f] {
			return nil, fmt.Errorf("%w: pool %s exclude %s is IPv%d but the pool has no IPv%d range set; remove it",
				ErrInvalidConfig, p.Name, x, f, f)
		}
		list = append(list, n)
	}
	slices.SortFunc(list, comparePrefix)
	out := make([]netip.Prefix, 0, len(list))
	for _, x := range list {
		if k := len(out); k > 0 && out[k-1].Contains(x.Addr()) {
			// Sorted by address then length, a prefix that covers x comes right before it.
			continue
		}
		out = append(out, x)
		for k := len(out); k >= 2 && siblings(out[k-2], out[k-1]); k = len(out) {
			parent := netip.PrefixFrom(out[k-2].Addr(), out[k-2].Bits()-1)
			out = append(out[:k-2], parent)
		}
	}
	return out, nil
}

// comparePrefix orders prefixes by address (IPv4 first), then by length, shorter first.
func comparePrefix(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return a.Bits() - b.Bits()
}

// siblings reports whether masked prefixes a < b are the two halves of one parent.
func siblings(a, b netip.Prefix) bool {
	if a.Bits() != b.Bits() || a.Bits() == 0 || a.Addr().BitLen() != b.Addr().BitLen() || a == b {
		return false
	}
	pa := netip.PrefixFrom(a.Addr(), a.Bits()-1).Masked()
	return pa.Addr() == a.Addr() && pa.Contains(b.Addr())
}

// joinPrefixes lists prefixes separated by commas, or "none".
func joinPrefixes(ps []netip.Prefix) string {
	if len(ps) == 0 {
		return "none"
	}
	parts := make([]string, len(ps))
	for i, x := range ps {
		parts[i] = x.String()
	}
	return strings.Join(parts, ", ")
}

// ExcludedBy returns the exclude prefix containing a, if any. p.Exclude must be
// canonical (sorted and disjoint), so a binary search finds it.
func (p *PoolSpec) ExcludedBy(a netip.Addr) (netip.Prefix, bool) {
	i := sort.Search(len(p.Exclude), func(i int) bool { return a.Less(p.Exclude[i].Addr()) })
	if i > 0 && p.Exclude[i-1].Contains(a) {
		return p.Exclude[i-1], true
	}
	return netip.Prefix{}, false
}

// GatewayOf returns a range of p (of any set) whose gateway is a. A gateway is never
// handed out, whichever range it lies in: pods of the range that names it route through it.
func (p *PoolSpec) GatewayOf(a netip.Addr) (Range, bool) {
	for _, s := range p.Ranges {
		for _, r := range s {
			if r.Gateway == a {
				return r, true
			}
		}
	}
	return Range{}, false
}

// appendGateways appends the distinct gateways of p's ranges of family fam to gws.
func (p *PoolSpec) appendGateways(gws []netip.Addr, fam int) []netip.Addr {
	for _, s := range p.Ranges {
		for _, r := range s {
			if family(r.Gateway) == fam && !slices.Contains(gws, r.Gateway) {
				gws = append(gws, r.Gateway)
			}
		}
	}
	return gws
}

// SetSize is the exact number of addresses range set i can hand out: the addresses of
// its ranges, less those inside an Exclude prefix, less every gateway of the pool that
// lies in them and is not already excluded. It is computed from prefix and range
// bounds, without iterating, so a /64 costs no more than a /24. p must be canonical.
// An i outside p.Ranges has size zero.
func (p *PoolSpec) SetSize(i int) *big.Int {
	n := new(big.Int)
	if i < 0 || i >= len(p.Ranges) {
		return n
	}
	set := p.Ranges[i]
	for _, r := range set {
		if !r.RangeStart.IsValid() || !r.RangeEnd.IsValid() {
			continue
		}
		n.Add(n, countBetween(r.RangeStart, r.RangeEnd))
		for _, x := range p.Exclude {
			if x.Addr().BitLen() != r.RangeStart.BitLen() {
				continue
			}
			lo := maxAddr(firstAddr(x), r.RangeStart)
			hi := minAddr(lastAddr(x), r.RangeEnd)
			n.Sub(n, countBetween(lo, hi))
		}
	}
	for _, gw := range p.appendGateways(nil, set.Family()) {
		if _, excluded := p.ExcludedBy(gw); set.Contains(gw) && !excluded {
			n.Sub(n, big.NewInt(1))
		}
	}
	return n
}

// Size is SetSize for every range set of p, in order.
func (p *PoolSpec) Size() []*big.Int {
	sizes := make([]*big.Int, len(p.Ranges))
	for i := range p.Ranges {
		sizes[i] = p.SetSize(i)
	}
	return sizes
}

// SetOf returns the index of the range set with a range containing addr (between its
// start and end), and ok false when there is none.
func (p *PoolSpec) SetOf(addr netip.Addr) (set int, ok bool) {
	set, _, ok = p.Locate(addr)
	return set, ok
}

// Locate returns the range set and the range within it that contain addr (between the
// range's start and end), and ok false when there is none. It does not say whether the pool
// hands addr out (see Allocatable).
func (p *PoolSpec) Locate(addr netip.Addr) (set, rng int, ok bool) {
	for i, s := range p.Ranges {
		if j := s.index(addr); j >= 0 {
			return i, j, true
		}
	}
	return 0, 0, false
}

// Allocatable reports whether addr may be handed out by p: it lies in a range of some
// range set, is not the gateway of any range of p and is not inside an Exclude prefix.
// It does not look at who holds addresses; that is Taken's business.
//
// It returns nil or an error wrapping ErrNotInRange that says why, for example
// "10.9.0.1 is the gateway of range 10.9.0.0/24 [10.9.0.1-10.9.0.254] gw 10.9.0.1",
// "10.10.1.3 is excluded by 10.10.1.0/28" or "10.11.0.1 lies in no range of pool net1
// (ranges: ...)".
func (p *PoolSpec) Allocatable(addr netip.Addr) error {
	addr = normAddr(addr)
	if !addr.IsValid() {
		return fmt.Errorf("%w: pool %s: the address is empty; give a valid IP address", ErrNotInRange, p.Name)
	}
	if _, ok := p.SetOf(addr); !ok {
		return fmt.Errorf("%w: %s lies in no range of pool %s (ranges: %s); request an address inside one",
			ErrNotInRange, addr, p.Name, p.rangesString())
	}
	if r, ok := p.GatewayOf(addr); ok {
		return fmt.Errorf("%w: %s is the gateway of range %s in pool %s; request another address",
			ErrNotInRange, addr, r, p.Name)
	}
	if x, ok := p.ExcludedBy(addr); ok {
		return fmt.Errorf("%w: %s is excluded by %s in pool %s; request an address outside the excludes",
			ErrNotInRange, addr, x, p.Name)
	}
	return nil
}

// IPConfig returns the result entry for addr: addr with the prefix length of the subnet
// of the range containing it, and that range's gateway. It checks only that addr lies in
// a range (an error wrapping ErrNotInRange otherwise), not that it is Allocatable, so it
// can describe an allocation that already exists.
func (p *PoolSpec) IPConfig(addr netip.Addr) (IPConfig, error) {
	addr = normAddr(addr)
	set, rng, ok := p.Locate(addr)
	if !ok {
		return IPConfig{}, fmt.Errorf("%w: %s lies in no range of pool %s (ranges: %s)",
			ErrNotInRange, optAddr(addr), p.Name, p.rangesString())
	}
	r := p.Ranges[set][rng]
	return IPConfig{
		Address: netip.PrefixFrom(addr, r.Subnet.Bits()),
		Gateway: r.Gateway,
	}, nil
}

// MatchRequested sorts requested addresses into p's range sets. The result has one
// entry per range set: entry i is the address requested for set i, unmapped to IPv4
// where it was IPv4-mapped, or the zero Addr when none was requested for it (the caller
// picks one with Next). ips may be empty.
//
// Errors wrap ErrNotInRange: an address that is not Allocatable (with Allocatable's
// reason), the same address requested twice, or two addresses in the same range set
// (both named).
func (p *PoolSpec) MatchRequested(ips []netip.Addr) ([]netip.Addr, error) {
	out := make([]netip.Addr, len(p.Ranges))
	for i, ip := range ips {
		ip = normAddr(ip)
		for _, prev := range ips[:i] {
			if normAddr(prev) == ip {
				return nil, fmt.Errorf("%w: %s is requested twice; request each address once",
					ErrNotInRange, optAddr(ip))
			}
		}
		if err := p.Allocatable(ip); err != nil {
			return nil, err
		}
		set, _ := p.SetOf(ip)
		if prev := out[set]; prev.IsValid() {
			return nil, fmt.Errorf("%w: %s and %s both fall into range set %d (%s) of pool %s; "+
				"each range set yields one address, request at most one per set",
				ErrNotInRange, prev, ip, set, p.Ranges[set], p.Name)
		}
		out[set] = ip
	}
	return out, nil
}

// RangeSize is what range rng of set hands out: its addresses, less excluded ones and every
// gateway of the pool inside it. Summed over a set's ranges it equals SetSize(set).
func (p *PoolSpec) RangeSize(set, rng int) *big.Int {
	r := p.Ranges[set][rng]
	one := PoolSpec{Name: p.Name, Ranges: []RangeSet{{r}}, Exclude: p.Exclude}
	n := one.SetSize(0)
	seen := map[netip.Addr]bool{r.Gateway: true}
	for _, s := range p.Ranges {
		for _, o := range s {
			if g := o.Gateway; !seen[g] && one.Allocatable(g) == nil {
				seen[g] = true
				n.Sub(n, big.NewInt(1))
			}
		}
	}
	return n
}

// Overlaps tells whether any range of p overlaps any range of o: two pools that could both
// hand out one address.
func (p *PoolSpec) Overlaps(o PoolSpec) bool {
	for _, s := range p.Ranges {
		for _, t := range o.Ranges {
			if s.Overlaps(t) {
				return true
			}
		}
	}
	return false
}
