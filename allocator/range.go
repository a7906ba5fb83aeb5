package allocator

import (
	"fmt"
	"math/big"
	"net/netip"
	"strings"
)

// Canonicalize checks r and fills its defaults, with host-local's semantics, so that
// later code can trust it:
//
//   - Subnet must be a valid prefix without host bits set. An IPv4-mapped IPv6 subnet
//     (::ffff:10.10.0.0/112) is rewritten to its IPv4 form (10.10.0.0/16).
//   - IPv4 /31 and /32 and IPv6 /127 and /128 are too small to allocate from.
//   - RangeStart, RangeEnd and Gateway, when given, must be of the subnet's family
//     (IPv4-mapped IPv6 addresses are unmapped first), carry no zone and lie in the subnet.
//   - RangeStart defaults to the network address + 1; RangeEnd to the IPv4 broadcast
//     address - 1, or the last address of an IPv6 subnet; Gateway to the network
//     address + 1 (even when RangeStart is set, as host-local does; candidate choice
//     never hands out a gateway).
//   - RangeStart <= RangeEnd, and neither is the network address or the IPv4 broadcast.
//
// Canonicalize is idempotent. Every failure wraps ErrInvalidConfig and names the subnet
// and the offending field; r may be partly modified when an error is returned.
func (r *Range) Canonicalize() error {
	if !r.Subnet.IsValid() {
		return fmt.Errorf("%w: range has no valid subnet; set \"subnet\" to a CIDR such as 10.10.0.0/16",
			ErrInvalidConfig)
	}
	subnet, ok := normPrefix(r.Subnet)
	if !ok {
		return fmt.Errorf("%w: subnet %s is an IPv4-mapped prefix shorter than /96; write the IPv4 subnet instead",
			ErrInvalidConfig, r.Subnet)
	}
	if subnet != subnet.Masked() {
		return fmt.Errorf("%w: subnet %s has host bits set; did you mean %s?",
			ErrInvalidConfig, subnet, subnet.Masked())
	}
	if subnet.Bits() > subnet.Addr().BitLen()-2 {
		return fmt.Errorf("%w: subnet %s is too small to allocate from; use at most /%d",
			ErrInvalidConfig, subnet, subnet.Addr().BitLen()-2)
	}
	r.Subnet = subnet

	var err error
	if r.RangeStart, err = checkAddr("rangeStart", r.RangeStart, subnet); err != nil {
		return err
	}
	if r.RangeEnd, err = checkAddr("rangeEnd", r.RangeEnd, subnet); err != nil {
		return err
	}
	if r.Gateway, err = checkAddr("gateway", r.Gateway, subnet); err != nil {
		return err
	}

	network := firstAddr(subnet)
	last := lastAddr(subnet)
	if !r.RangeStart.IsValid() {
		r.RangeStart = network.Next()
	}
	if !r.RangeEnd.IsValid() {
		r.RangeEnd = last
		if subnet.Addr().Is4() {
			r.RangeEnd = last.Prev()
		}
	}
	if !r.Gateway.IsValid() {
		r.Gateway = network.Next()
	}

	for _, f := range []struct {
		name string
		addr netip.Addr
	}{{"rangeStart", r.RangeStart}, {"rangeEnd", r.RangeEnd}} {
		if f.addr == network {
			return fmt.Errorf("%w: %s %s is the network address of subnet %s; start at %s or later",
				ErrInvalidConfig, f.name, f.addr, subnet, network.Next())
		}
		if subnet.Addr().Is4() && f.addr == last {
			return fmt.Errorf("%w: %s %s is the broadcast address of subnet %s; end at %s or earlier",
				ErrInvalidConfig, f.name, f.addr, subnet, last.Prev())
		}
	}
	if r.RangeEnd.Less(r.RangeStart) {
		return fmt.Errorf("%w: subnet %s: rangeStart %s is after rangeEnd %s; swap them",
			ErrInvalidConfig, subnet, r.RangeStart, r.RangeEnd)
	}
	return nil
}

// Contains reports whether addr lies between r's RangeStart and RangeEnd inclusive.
// An IPv4-mapped IPv6 addr is unmapped first. r must be canonical.
func (r Range) Contains(addr netip.Addr) bool {
	addr = normAddr(addr)
	if !addr.IsValid() || addr.Zone() != "" || !r.RangeStart.IsValid() || !r.RangeEnd.IsValid() {
		return false
	}
	return between(addr, r.RangeStart, r.RangeEnd)
}

// Overlaps reports whether r and other share at least one address between their
// starts and ends. Ranges of different families never overlap. Both must be canonical.
func (r Range) Overlaps(other Range) bool {
	if !r.RangeStart.IsValid() || !other.RangeStart.IsValid() ||
		r.RangeStart.BitLen() != other.RangeStart.BitLen() {
		return false
	}
	return r.RangeStart.Compare(other.RangeEnd) <= 0 && other.RangeStart.Compare(r.RangeEnd) <= 0
}

// Size is the number of addresses r can hand out on its own: RangeEnd - RangeStart + 1,
// less one when r's Gateway lies in that span. Pool-wide exclusions and other ranges'
// gateways are counted by PoolSpec.SetSize. r must be canonical; a range without
// start or end has size zero.
func (r Range) Size() *big.Int {
	if !r.RangeStart.IsValid() || !r.RangeEnd.IsValid() {
		return new(big.Int)
	}
	n := countBetween(r.RangeStart, r.RangeEnd)
	if r.Contains(r.Gateway) {
		n.Sub(n, big.NewInt(1))
	}
	return n
}

// String is r in a compact form: "10.10.0.0/16 [10.10.1.0-10.10.9.255] gw 10.10.0.1".
// Missing parts are left out.
func (r Range) String() string {
	s := r.Subnet.String()
	if r.RangeStart.IsValid() || r.RangeEnd.IsValid() {
		s += " [" + optAddr(r.RangeStart) + "-" + optAddr(r.RangeEnd) + "]"
	}
	if r.Gateway.IsValid() {
		s += " gw " + r.Gateway.String()
	}
	return s
}

// optAddr is a's text, or "?" for the zero Addr.
func optAddr(a netip.Addr) string {
	if !a.IsValid() {
		return "?"
	}
	return a.String()
}

// Canonicalize canonicalizes every range of s (see Range.Canonicalize) and checks that
// s is not empty, that all its ranges are of one address family and that no two of
// them overlap. Ranges may share a subnet. Every failure wraps ErrInvalidConfig and
// names the range at fault by its position and value.
func (s RangeSet) Canonicalize() error {
	if len(s) == 0 {
		return fmt.Errorf("%w: range set is empty; give at least one range with a \"subnet\"",
			ErrInvalidConfig)
	}
	for i := range s {
		if err := s[i].Canonicalize(); err != nil {
			return fmt.Errorf("range %d: %w", i, err)
		}
	}
	fam := s.Family()
	for i, r := range s {
		if f := family(r.Subnet.Addr()); f != fam {
			return fmt.Errorf("%w: range %d (%s) is IPv%d but range 0 (%s) is IPv%d; "+
				"one range set holds one address family, put the other family in its own range set",
				ErrInvalidConfig, i, r, f, s[0], fam)
		}
		for j := range i {
			if s[j].Overlaps(r) {
				return fmt.Errorf("%w: range %d (%s) overlaps range %d (%s); make their start-end spans disjoint",
					ErrInvalidConfig, i, r, j, s[j])
			}
		}
	}
	return nil
}

// Contains reports whether addr lies in one of s's ranges (between its start and end).
func (s RangeSet) Contains(addr netip.Addr) bool {
	return s.index(addr) >= 0
}

// index returns the position of the range of s containing addr, or -1.
func (s RangeSet) index(addr netip.Addr) int {
	for i, r := range s {
		if r.Contains(addr) {
			return i
		}
	}
	return -1
}

// Overlaps reports whether any range of s overlaps any range of other. Both must be
// canonical.
func (s RangeSet) Overlaps(other RangeSet) bool {
	_, _, ok := s.overlap(other)
	return ok
}

// overlap returns the positions of the first pair of overlapping ranges.
func (s RangeSet) overlap(other RangeSet) (i, j int, ok bool) {
	for i, r := range s {
		for j, o := range other {
			if r.Overlaps(o) {
				return i, j, true
			}
		}
	}
	return 0, 0, false
}

// Family is the address family of s, 4 or 6, taken from its first range's subnet; 0
// when s is empty or its first subnet is unset.
func (s RangeSet) Family() int {
	if len(s) == 0 {
		return 0
	}
	return family(normAddr(s[0].Subnet.Addr()))
}

// String lists s's ranges, separated by commas.
func (s RangeSet) String() string {
	parts := make([]string, len(s))
	for i, r := range s {
		parts[i] = r.String()
	}
	return strings.Join(parts, ", ")
}

// After returns the address that follows addr in s's round-robin order: the next
// address of the same range, or the start of the next range when addr is its range's
// end, wrapping from the last range to the first. An addr outside s yields the start of
// the first range. Callers use it to turn the last address they handed out into the
// from argument of PoolSpec.Next. s must be canonical and non-empty.
func (s RangeSet) After(addr netip.Addr) netip.Addr {
	if len(s) == 0 {
		return netip.Addr{}
	}
	addr = normAddr(addr)
	i := s.index(addr)
	if i < 0 {
		return s[0].RangeStart
	}
	if addr != s[i].RangeEnd {
		return addr.Next()
	}
	return s[(i+1)%len(s)].RangeStart
}

// Spread returns the address of range set s at position u (0 <= u < 1) of its span, counting
// every address from each range's start to its end: a starting point for candidate search
// that lets allocators on different nodes begin in different places instead of all racing
// for the same first addresses. A set with no ranges returns the zero Addr.
func (s RangeSet) Spread(u float64) netip.Addr {
	total := new(big.Int)
	spans := make([]*big.Int, len(s))
	for i, r := range s {
		spans[i] = countBetween(r.RangeStart, r.RangeEnd)
		total.Add(total, spans[i])
	}
	if total.Sign() == 0 {
		return netip.Addr{}
	}
	u = min(max(u, 0), 1)
	// off = floor(u * total), computed in big.Float so a /64 keeps its precision.
	off, _ := new(big.Float).Mul(new(big.Float).SetInt(total), big.NewFloat(u)).Int(nil)
	if off.Cmp(total) >= 0 {
		off.Sub(total, big.NewInt(1))
	}
	for i, r := range s {
		if off.Cmp(spans[i]) < 0 {
			n := addrInt(r.RangeStart)
			n.Add(n, off)
			b := n.FillBytes(make([]byte, r.RangeStart.BitLen()/8))
			a, _ := netip.AddrFromSlice(b)
			return a
		}
		off.Sub(off, spans[i])
	}
	return s[0].RangeStart
}
