package cniplugin

import (
	"cmp"
	"fmt"
	"net/netip"
	"strings"

	"github.com/leasehold/leasehold/allocator"
)

// CNIArgs is what leasehold reads from the CNI_ARGS environment variable.
type CNIArgs struct {
	// IPs are the addresses asked for with IP= (comma separated), in order.
	IPs []netip.Addr
	// Pod is filled from K8S_POD_UID, K8S_POD_NAMESPACE and K8S_POD_NAME.
	Pod allocator.PodRef
	// Claim is LEASEHOLD_CLAIM, the sticky claim the runtime names for the attachment;
	// empty when not given (or given empty). ParseConfig validates it, not ParseCNIArgs.
	Claim string
	// Pools is LEASEHOLD_POOL, the pools the pod asks for, in order (comma-separated);
	// ParseConfig validates them.
	Pools []string

	// claimErr is set by parseCNIArgs, instead of failing, when LEASEHOLD_CLAIM is given
	// twice with different values: a DEL needs no claim (the agent finds it in its own
	// records), so only the commands that use one refuse it (see ParseConfig).
	claimErr error
	// poolErr is claimErr for LEASEHOLD_POOL: only an ADD uses the pools asked for.
	poolErr error
}

// ParseCNIArgs parses CNI_ARGS: ';'-separated KEY=VALUE pairs. Keys are case-sensitive;
// keys other than IP, K8S_POD_UID, K8S_POD_NAMESPACE, K8S_POD_NAME, LEASEHOLD_CLAIM and
// LEASEHOLD_POOL are ignored (runtimes pass many, IgnoreUnknown among them). Empty segments (a trailing
// ';') are skipped. A VALUE may contain '='. IP= may be empty (no request) and empty
// entries in its list are skipped; an empty LEASEHOLD_CLAIM= names no claim.
//
// Errors wrap allocator.ErrInvalidConfig: a segment without '=' or with an empty key, a
// key leasehold reads given twice with different values, or an IP= entry that is not an
// address (see ParseRequestedIP). The pod UID and the claim name are validated by
// ParseConfig, not here.
func ParseCNIArgs(s string) (CNIArgs, error) {
	out, err := parseCNIArgs(s)
	if err == nil {
		err = cmp.Or(out.claimErr, out.poolErr)
	}
	if err != nil {
		return CNIArgs{}, err
	}
	return out, nil
}

// parseCNIArgs is ParseCNIArgs, except that a LEASEHOLD_CLAIM given twice with different
// values sets the result's claimErr (and leaves Claim empty) instead of failing.
func parseCNIArgs(s string) (CNIArgs, error) {
	var out CNIArgs
	seen := map[string]string{}
	for seg := range strings.SplitSeq(s, ";") {
		if strings.TrimSpace(seg) == "" {
			continue
		}
		key, val, ok := strings.Cut(seg, "=")
		if !ok || key == "" {
			return CNIArgs{}, fmt.Errorf("%w: CNI_ARGS: %q is not a KEY=VALUE pair; separate pairs with ';'",
				allocator.ErrInvalidConfig, seg)
		}
		switch key {
		case "IP", "K8S_POD_UID", "K8S_POD_NAMESPACE", "K8S_POD_NAME", "LEASEHOLD_CLAIM", "LEASEHOLD_POOL":
		default:
			continue
		}
		if prev, dup := seen[key]; dup && prev != val {
			err := fmt.Errorf("%w: CNI_ARGS gives %s twice (%q and %q); give it once",
				allocator.ErrInvalidConfig, key, prev, val)
			switch {
			case key == "LEASEHOLD_CLAIM":
				out.claimErr = cmp.Or(out.claimErr, err)
			case key == "LEASEHOLD_POOL":
				out.poolErr = cmp.Or(out.poolErr, err)
			default:
				return CNIArgs{}, err
			}
			continue
		}
		seen[key] = val
		switch key {
		case "IP":
			out.IPs = out.IPs[:0]
			for item := range strings.SplitSeq(val, ",") {
				if strings.TrimSpace(item) == "" {
					continue
				}
				ip, err := ParseRequestedIP("CNI_ARGS IP", item)
				if err != nil {
					return CNIArgs{}, err
				}
				out.IPs = append(out.IPs, ip)
			}
		case "K8S_POD_UID":
			out.Pod.UID = val
		case "K8S_POD_NAMESPACE":
			out.Pod.Namespace = val
		case "K8S_POD_NAME":
			out.Pod.Name = val
		case "LEASEHOLD_CLAIM":
			out.Claim = val
		case "LEASEHOLD_POOL":
			out.Pools = splitList(val)
		}
	}
	if out.claimErr != nil {
		out.Claim = ""
	}
	if out.poolErr != nil {
		out.Pools = nil
	}
	return out, nil
}

// splitList splits a comma-separated list, dropping empty entries and spaces around each.
func splitList(s string) []string {
	var out []string
	for item := range strings.SplitSeq(s, ",") {
		if item = strings.TrimSpace(item); item != "" {
			out = append(out, item)
		}
	}
	return out
}

// ParseRequestedIP parses one requested address as host-local does: "10.1.2.3" or
// "10.1.2.3/24" (the prefix length is ignored; the pool's subnet decides it). Spaces
// around it are trimmed and an IPv4-mapped IPv6 form becomes IPv4. source names where
// it came from for the error, which wraps allocator.ErrInvalidConfig.
func ParseRequestedIP(source, s string) (netip.Addr, error) {
	s = strings.TrimSpace(s)
	text := s
	if p, err := netip.ParsePrefix(s); err == nil {
		text = p.Addr().String()
	}
	a, err := netip.ParseAddr(text)
	if err != nil || a.Zone() != "" {
		return netip.Addr{}, fmt.Errorf("%w: %s: %q is not an IP address; write it as 10.1.2.3 or fd00::3 "+
			"(optionally with a prefix length, which is ignored)", allocator.ErrInvalidConfig, source, s)
	}
	return a.Unmap(), nil
}

// requestedIPs merges the requested addresses of the three sources host-local reads,
// in its order (CNI_ARGS, args.cni.ips, runtimeConfig.ips), dropping repeats: runtimes
// often pass the same address through two of them.
func requestedIPs(fromEnv []netip.Addr, argsIPs, runtimeIPs []string) ([]netip.Addr, error) {
	out := make([]netip.Addr, 0, len(fromEnv)+len(argsIPs)+len(runtimeIPs))
	add := func(a netip.Addr) {
		for _, b := range out {
			if a == b {
				return
			}
		}
		out = append(out, a)
	}
	for _, a := range fromEnv {
		add(a)
	}
	for _, src := range []struct {
		name string
		ips  []string
	}{{"args.cni.ips", argsIPs}, {"runtimeConfig.ips", runtimeIPs}} {
		for i, s := range src.ips {
			a, err := ParseRequestedIP(fmt.Sprintf("%s[%d]", src.name, i), s)
			if err != nil {
				return nil, err
			}
			add(a)
		}
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}
