package allocator

import (
	"fmt"
	"math/big"
	"net/netip"
)

// This file holds the address arithmetic the rest of the package builds on: first and
// last address of a prefix, exact counts with math/big, and the normalisation of
// IPv4-mapped IPv6 forms. None of it is exported: callers work with Range and PoolSpec.

// family returns 4 or 6 for a valid address and 0 for the zero Addr.
func family(a netip.Addr) int {
	switch {
	case a.Is4():
		return 4
	case a.Is6():
		return 6
	}
	return 0
}

// normAddr unmaps an IPv4-mapped IPv6 address ("::ffff:10.0.0.1") to plain IPv4 so that
// one address has one spelling everywhere. Zones are kept: callers refuse them.
func normAddr(a netip.Addr) netip.Addr {
	if a.Is4In6() {
		return a.Unmap()
	}
	return a
}

// normPrefix turns an IPv4-mapped IPv6 prefix (::ffff:10.0.0.0/104) into its IPv4 form
// (10.0.0.0/8). A mapped prefix shorter than /96 covers more than the mapped space and
// has no IPv4 form: it is returned unchanged with ok false.
func normPrefix(p netip.Prefix) (netip.Prefix, bool) {
	if !p.Addr().Is4In6() {
		return p, true
	}
	if p.Bits() < 96 {
		return p, false
	}
	return netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96), true
}

// firstAddr is the network address of p (p need not be masked).
func firstAddr(p netip.Prefix) netip.Addr {
	return p.Masked().Addr()
}

// lastAddr is the highest address of p: the IPv4 broadcast, or the last IPv6 address.
func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr()
	if a.Is4() {
		b := a.As4()
		setHostBits(b[:], p.Bits())
		return netip.AddrFrom4(b)
	}
	b := a.As16()
	setHostBits(b[:], p.Bits())
	return netip.AddrFrom16(b)
}

// setHostBits sets every bit of b after the first bits bits.
func setHostBits(b []byte, bits int) {
	for i := range b {
		switch {
		case bits >= 8:
			bits -= 8
		case bits <= 0:
			b[i] = 0xff
		default:
			b[i] |= 0xff >> bits
			bits = 0
		}
	}
}

// addrInt is a as an unsigned integer.
func addrInt(a netip.Addr) *big.Int {
	return new(big.Int).SetBytes(a.AsSlice())
}

// countBetween is the number of addresses in [lo, hi], or zero when hi < lo.
// Both must be of the same family.
func countBetween(lo, hi netip.Addr) *big.Int {
	if hi.Less(lo) {
		return new(big.Int)
	}
	n := addrInt(hi)
	n.Sub(n, addrInt(lo))
	return n.Add(n, big.NewInt(1))
}

// maxAddr returns the larger of a and b; minAddr the smaller.
func maxAddr(a, b netip.Addr) netip.Addr {
	if a.Less(b) {
		return b
	}
	return a
}

func minAddr(a, b netip.Addr) netip.Addr {
	if a.Less(b) {
		return a
	}
	return b
}

// between reports whether lo <= a <= hi, all in one family.
func between(a, lo, hi netip.Addr) bool {
	return a.BitLen() == lo.BitLen() && lo.Compare(a) <= 0 && a.Compare(hi) <= 0
}

// checkAddr normalises an optional address field of a range and refuses zones and a
// family other than the subnet's. The zero Addr passes through unchanged.
func checkAddr(field string, a netip.Addr, subnet netip.Prefix) (netip.Addr, error) {
	if !a.IsValid() {
		return a, nil
	}
	if a.Zone() != "" {
		return a, fmt.Errorf("%w: %s %s has an IPv6 zone; write the address without %%%s",
			ErrInvalidConfig, field, a, a.Zone())
	}
	a = normAddr(a)
	if family(a) != family(subnet.Addr()) {
		return a, fmt.Errorf("%w: %s %s is IPv%d but subnet %s is IPv%d; use an address of the subnet's family",
			ErrInvalidConfig, field, a, family(a), subnet, family(subnet.Addr()))
	}
	if !subnet.Contains(a) {
		hi := lastAddr(subnet)
		if subnet.Addr().Is4() {
			hi = hi.Prev()
		}
		return a, fmt.Errorf("%w: %s %s lies outside subnet %s; choose an address inside it (%s-%s)",
			ErrInvalidConfig, field, a, subnet, firstAddr(subnet).Next(), hi)
	}
	return a, nil
}
