package main

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/leasehold/leasehold/allocator"
)

// listFlag collects every value of a repeatable flag.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, " ") }

// Set appends one value.
func (l *listFlag) Set(v string) error {
	*l = append(*l, v)
	return nil
}

// csvFlag collects the comma-separated values of a repeatable flag, in order; empty values
// are dropped.
type csvFlag []string

func (l *csvFlag) String() string { return strings.Join(*l, ",") }

// Set appends each comma-separated value.
func (l *csvFlag) Set(v string) error {
	for s := range strings.SplitSeq(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			*l = append(*l, s)
		}
	}
	return nil
}

// rangeFlag is one parsed --range (or --subnet) value: a range and the set it names (-1: none).
type rangeFlag struct {
	r    allocator.Range
	set  int
	text string
}

// parseRange reads SUBNET[,start=ADDR][,end=ADDR][,gw=ADDR][,set=N]; allowed lists the keys
// the flag accepts. Errors are usage errors naming the flag and the part at fault.
func parseRange(flagName, s string, allowed ...string) (rangeFlag, error) {
	parts := strings.Split(s, ",")
	out := rangeFlag{set: -1, text: s}
	sub, err := netip.ParsePrefix(strings.TrimSpace(parts[0]))
	if err != nil {
		return out, usagef("--%s %q: %q is not a subnet in CIDR form (such as 10.10.0.0/16 or fd10::/64)", flagName, s, parts[0])
	}
	out.r.Subnet = sub
	seen := map[string]bool{}
	for _, p := range parts[1:] {
		k, v, ok := strings.Cut(strings.TrimSpace(p), "=")
		if !ok || !slices.Contains(allowed, k) {
			return out, usagef("--%s %q: %q is not one of %s=VALUE", flagName, s, p, strings.Join(allowed, "=, "))
		}
		if seen[k] {
			return out, usagef("--%s %q: %s is given twice", flagName, s, k)
		}
		seen[k] = true
		if k == "set" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return out, usagef("--%s %q: set=%q is not a range set index (0, 1, ...)", flagName, s, v)
			}
			out.set = n
			continue
		}
		a, err := netip.ParseAddr(v)
		if err != nil {
			return out, usagef("--%s %q: %s=%q is not an IP address", flagName, s, k, v)
		}
		switch k {
		case "start":
			out.r.RangeStart = a
		case "end":
			out.r.RangeEnd = a
		case "gw":
			out.r.Gateway = a
		}
	}
	return out, nil
}

// checkRange canonicalizes a copy of rf's range on its own: a range that is wrong whatever the
// pool (host bits set, start after end, gateway outside the subnet) is a usage error.
func checkRange(rf rangeFlag) (allocator.Range, error) {
	r := rf.r
	if err := r.Canonicalize(); err != nil {
		return r, usagef("--range %q: %v", rf.text, err)
	}
	return rf.r, nil
}

// rangeSets groups --range values into range sets. Each range goes to its set= or, without
// one, to defSet; when neither is given anywhere, ranges of one family form one set, in order
// of first appearance.
func rangeSets(values []string, defSet int) ([]allocator.RangeSet, error) {
	if len(values) == 0 {
		return nil, usagef("give at least one --range SUBNET[,start=A][,end=B][,gw=G][,set=N]")
	}
	var flags []rangeFlag
	explicit := defSet >= 0
	for _, v := range values {
		rf, err := parseRange("range", v, "start", "end", "gw", "set")
		if err != nil {
			return nil, err
		}
		if _, err := checkRange(rf); err != nil {
			return nil, err
		}
		if rf.set < 0 {
			rf.set = defSet
		}
		explicit = explicit || rf.set >= 0
		flags = append(flags, rf)
	}
	byFamily := map[bool]int{} // is IPv4 -> set
	var sets []allocator.RangeSet
	for _, rf := range flags {
		i := rf.set
		switch {
		case explicit && i < 0:
			return nil, usagef("--range %q has no set=N but other ranges do; give set= on every --range, or --set N", rf.text)
		case !explicit:
			v4 := rf.r.Subnet.Addr().Unmap().Is4()
			n, ok := byFamily[v4]
			if !ok {
				n = len(byFamily)
				byFamily[v4] = n
			}
			i = n
		}
		for len(sets) <= i {
			sets = append(sets, nil)
		}
		sets[i] = append(sets[i], rf.r)
	}
	for i, s := range sets {
		if len(s) == 0 {
			return nil, usagef("range set %d has no --range; number the sets 0, 1, ... without gaps", i)
		}
	}
	return sets, nil
}

// oneRange reads the single --range of add-range, with its set= folded into --set.
func oneRange(values []string, set int) (allocator.Range, int, error) {
	if len(values) != 1 {
		return allocator.Range{}, 0, usagef("give exactly one --range SUBNET[,start=A][,end=B][,gw=G][,set=N] (got %d)", len(values))
	}
	rf, err := parseRange("range", values[0], "start", "end", "gw", "set")
	if err != nil {
		return allocator.Range{}, 0, err
	}
	if _, err := checkRange(rf); err != nil {
		return allocator.Range{}, 0, err
	}
	if rf.set >= 0 && set >= 0 && rf.set != set {
		return allocator.Range{}, 0, usagef("--range %q says set=%d but --set says %d", rf.text, rf.set, set)
	}
	if rf.set >= 0 {
		set = rf.set
	}
	return rf.r, set, nil
}

// parseExcludes reads --exclude values: CIDRs or single addresses, comma-separated or repeated.
func parseExcludes(values []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, v := range values {
		for _, s := range strings.Split(v, ",") {
			s = strings.TrimSpace(s)
			if p, err := netip.ParsePrefix(s); err == nil {
				out = append(out, p)
				continue
			}
			a, err := netip.ParseAddr(s)
			if err != nil {
				return nil, usagef("--exclude %q: want a CIDR (10.10.1.0/28) or an address (10.10.2.7)", s)
			}
			a = a.Unmap()
			out = append(out, netip.PrefixFrom(a, a.BitLen()))
		}
	}
	return out, nil
}

// parseIP reads an address argument in any spelling; keys hold the plain canonical form.
func parseIP(s string) (netip.Addr, error) {
	a, err := netip.ParseAddr(s)
	if err != nil || a.Zone() != "" {
		return netip.Addr{}, usagef("%q is not an IP address (without zone)", s)
	}
	return a.Unmap(), nil
}

// poolArg checks a pool name argument.
func poolArg(name string) (string, error) {
	if err := allocator.ValidateName("pool", name); err != nil {
		return "", usageError{err.Error()}
	}
	return name, nil
}

// setText describes a --set value for messages.
func setText(set int) string {
	if set < 0 {
		return "the set of its family"
	}
	return fmt.Sprintf("set %d", set)
}
