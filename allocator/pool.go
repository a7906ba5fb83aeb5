package allocator

import (
	"fmt"
	"slices"
	"strings"
)

// MaxNameLen is the longest name ValidateName accepts, in bytes (a DNS name's limit).
const MaxNameLen = 253

// MaxRangeSets bounds the range sets of a pool: an ADD claims one address from each in one
// etcd transaction, and etcd refuses transactions of more than 128 operations (its default
// --max-txn-ops); each address costs three reads in the claim's else branch.
const MaxRangeSets = 8

// MaxRangesPerSet and MaxExcludes bound a pool's definition: canonicalization compares
// ranges with each other and with the excludes, on every request that carries ranges, so
// a request with tens of thousands of them could hold a core for seconds (found by the
// hostile-input tests). Real pools have a handful.
const (
	MaxRangesPerSet = 1024
	MaxExcludes     = 1024
)

// ValidateName checks a name that becomes one component of an etcd key: a pool,
// cluster or node name, an owner (pod UID), a container ID or an interface name. kind
// says which, for the error message ("pool", "container ID", ...).
//
// A valid name is 1 to MaxNameLen bytes long, starts with an ASCII letter or digit and
// continues with ASCII letters, digits and the characters . _ : @ -. So "/" (the key
// separator), spaces, control characters and non-ASCII text are refused, and so are
// "." and "..". UUIDs, 64-hex-digit container IDs and names like eth0 or net1 pass.
//
// The error wraps ErrInvalidName and quotes the kind and the value.
func ValidateName(kind, s string) error {
	const allowed = "letters, digits and . _ : @ -"
	switch {
	case s == "":
		return fmt.Errorf("%w: %s name is empty; give a non-empty name", ErrInvalidName, kind)
	case s == "." || s == "..":
		return fmt.Errorf("%w: %s name %q is reserved; use a name starting with a letter or digit",
			ErrInvalidName, kind, s)
	case len(s) > MaxNameLen:
		return fmt.Errorf("%w: %s name %q is %d bytes long; use at most %d",
			ErrInvalidName, kind, s, len(s), MaxNameLen)
	}
	if !isAlnum(s[0]) {
		return fmt.Errorf("%w: %s name %q starts with %q; start it with a letter or digit",
			ErrInvalidName, kind, s, s[0])
	}
	for i := 1; i < len(s); i++ {
		c := s[i]
		if isAlnum(c) || strings.IndexByte("._:@-", c) >= 0 {
			continue
		}
		return fmt.Errorf("%w: %s name %q has %q at byte %d; use only %s",
			ErrInvalidName, kind, s, c, i, allowed)
	}
	return nil
}

func isAlnum(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
}

// Canonicalize checks p and puts it in the stable form that is stored in etcd and
// compared with Equal:
//
//   - Name passes ValidateName("pool", ...).
//   - There is at least one range set; each is canonicalized (RangeSet.Canonicalize),
//     and no range of one set overlaps a range of another.
//   - Each Exclude entry is a valid prefix of a family some range set has; it is masked
//     (10.10.1.5/28 becomes 10.10.1.0/28), IPv4-mapped forms become IPv4, and the list is
//     reduced to the smallest sorted list of disjoint prefixes covering the same
//     addresses (duplicates and prefixes inside others dropped, sibling halves merged).
//     An empty list becomes nil.
//   - Every range set keeps at least one allocatable address after gateways and
//     excludes are taken out.
//
// Errors wrap ErrInvalidName (bad name) or ErrInvalidConfig, and name the pool, the
// range set and the value at fault. Canonicalize is idempotent, and it works on copies of
// the range and exclude slices: specs that share their slices (copies of one request) may
// be canonicalized concurrently.
func (p *PoolSpec) Canonicalize() error {
	if err := ValidateName("pool", p.Name); err != nil {
		return err
	}
	p.Ranges = slices.Clone(p.Ranges)
	for i := range p.Ranges {
		p.Ranges[i] = slices.Clone(p.Ranges[i])
	}
	p.Exclude = slices.Clone(p.Exclude)
	if len(p.Ranges) == 0 {
		return fmt.Errorf("%w: pool %s has no range sets; give \"ranges\" at least one list of ranges",
			ErrInvalidConfig, p.Name)
	}
	for i, set := range p.Ranges {
		if len(set) > MaxRangesPerSet {
			return fmt.Errorf("%w: pool %s range set %d has %d ranges, more than the %d allowed; "+
				"merge adjacent ranges into fewer, larger ones", ErrInvalidConfig, p.Name, i, len(set), MaxRangesPerSet)
		}
	}
	if len(p.Exclude) > MaxExcludes {
		return fmt.Errorf("%w: pool %s has %d exclude entries, more than the %d allowed; exclude whole prefixes instead "+
			"of single addresses", ErrInvalidConfig, p.Name, len(p.Exclude), MaxExcludes)
	}
	if len(p.Ranges) > MaxRangeSets {
		return fmt.Errorf("%w: pool %s has %d range sets, more than the %d an attachment may take addresses from "+
			"(one transaction claims them all, and etcd bounds its size); use fewer lists in \"ranges\"",
			ErrInvalidConfig, p.Name, len(p.Ranges), MaxRangeSets)
	}
	for i, s := range p.Ranges {
		if err := s.Canonicalize(); err != nil {
			return fmt.Errorf("pool %s range set %d: %w", p.Name, i, err)
		}
		for j := range i {
			if a, b, ok := p.Ranges[j].overlap(s); ok {
				return fmt.Errorf("%w: pool %s: range %s of set %d overlaps range %s of set %d; "+
					"range sets must not share addresses",
					ErrInvalidConfig, p.Name, s[b], i, p.Ranges[j][a], j)
			}
		}
	}
	p.Blocks = p.Blocks.WithDefaults()
	if err := p.Blocks.validate(p.Name); err != nil {
		return err
	}
	ex, err := p.canonicalExcludes()
	if err != nil {
		return err
	}
	p.Exclude = ex
	for i := range p.Ranges {
		if p.SetSize(i).Sign() == 0 {
			return fmt.Errorf("%w: pool %s range set %d (%s) has no allocatable address once gateways "+
				"and excludes (%s) are taken out; widen the ranges or shrink the excludes",
				ErrInvalidConfig, p.Name, i, p.Ranges[i], joinPrefixes(p.Exclude))
		}
	}
	return nil
}

// Equal reports whether p and o define the same pool: same name, same range sets with
// the same ranges in the same order, same excludes. Both must be canonical, so that
// equivalent spellings (defaults left out or written, mapped addresses, excludes in a
// different order) compare equal.
func (p PoolSpec) Equal(o PoolSpec) bool {
	return p.Name == o.Name &&
		slices.EqualFunc(p.Ranges, o.Ranges, func(a, b RangeSet) bool { return slices.Equal(a, b) }) &&
		slices.Equal(p.Exclude, o.Exclude) && p.Blocks == o.Blocks
}

// String describes p on one line, for error messages and logs:
//
//	pool net1: set 0: 10.10.0.0/16 [10.10.1.0-10.10.9.255] gw 10.10.0.1; set 1: fd10::/64 [fd10::1-fd10::ffff:ffff:ffff:ffff] gw fd10::1; exclude 10.10.1.0/28
func (p PoolSpec) String() string {
	var b strings.Builder
	b.WriteString("pool " + p.Name + ":")
	if len(p.Ranges) == 0 {
		b.WriteString(" no ranges")
	}
	for i, s := range p.Ranges {
		if i > 0 {
			b.WriteString(";")
		}
		fmt.Fprintf(&b, " set %d: %s", i, s)
	}
	if len(p.Exclude) > 0 {
		b.WriteString("; exclude " + joinPrefixes(p.Exclude))
	}
	if !p.Blocks.Flat() {
		fmt.Fprintf(&b, "; blocks /%d, /%d", p.Blocks.IPv4, p.Blocks.IPv6)
	}
	return b.String()
}

// rangesString lists p's range sets, as in String but without name and excludes.
func (p *PoolSpec) rangesString() string {
	parts := make([]string, len(p.Ranges))
	for i, s := range p.Ranges {
		parts[i] = fmt.Sprintf("set %d: %s", i, s)
	}
	return strings.Join(parts, "; ")
}
