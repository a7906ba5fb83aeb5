package cniplugin

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/leasehold/leasehold/allocator"
)

// NewResult builds the CNI result of an ADD in the current result format (1.1.0): one
// IPConfig {address, gateway} per allocated address, in range-set order and without an
// interface index (an IPAM plugin creates no interface; the main plugin sets it), then
// routes as given (already resolved, see ResolveRoutes) and dns. It returns no error.
func NewResult(alloc allocator.Result, routes []Route, dns types.DNS) *types100.Result {
	res := &types100.Result{CNIVersion: types100.ImplementedSpecVersion, DNS: *dns.Copy()}
	for _, ipc := range alloc.IPs {
		c := &types100.IPConfig{Address: ipNet(ipc.Address)}
		if ipc.Gateway.IsValid() {
			c.Gateway = net.IP(ipc.Gateway.AsSlice())
		}
		res.IPs = append(res.IPs, c)
	}
	for _, r := range routes {
		res.Routes = append(res.Routes, r.CNI())
	}
	return res
}

// PrintResult writes res to w as JSON in the format of cniVersion (0.3.0, 0.3.1, 0.4.0,
// 1.0.0 or 1.1.0; 0.1.0 and 0.2.0 work but lose routes' extra fields and all but one
// address per family). The error is the CNI library's, for a version it cannot convert
// to, or w's.
func PrintResult(w io.Writer, res types.Result, cniVersion string) error {
	out, err := res.GetAsVersion(cniVersion)
	if err != nil {
		return fmt.Errorf("converting result to cniVersion %s: %w", cniVersion, err)
	}
	return out.PrintTo(w)
}

// ipNet converts an address with prefix length (10.10.1.7/16), keeping the host bits.
func ipNet(p netip.Prefix) net.IPNet {
	a := p.Addr()
	return net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(p.Bits(), a.BitLen())}
}

// resultAddrs lists the addresses of a CNI result (any version) as prefixes.
// Entries that do not convert are skipped; the error is the conversion's.
func resultAddrs(r types.Result) ([]netip.Prefix, error) {
	cur, err := types100.GetResult(r)
	if err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for _, ipc := range cur.IPs {
		if ipc == nil {
			continue
		}
		a, ok := netip.AddrFromSlice(ipc.Address.IP)
		if !ok {
			continue
		}
		ones, _ := ipc.Address.Mask.Size()
		out = append(out, netip.PrefixFrom(a.Unmap(), ones))
	}
	return out, nil
}

// compareAddrs checks the agent's addresses against prevResult's; the error wraps
// allocator.ErrNotAllocated.
func compareAddrs(cfg *Config, held allocator.Result, prev []netip.Prefix) error {
	var heldList []netip.Prefix
	for _, ipc := range held.IPs {
		heldList = append(heldList, ipc.Address)
	}
	inPool := func(a netip.Addr) bool {
		for _, s := range cfg.Request.Pool.Ranges {
			for _, r := range s {
				if r.Subnet.Contains(a) {
					return true
				}
			}
		}
		return false
	}
	ok := true
	for _, h := range heldList {
		ok = ok && slices.Contains(prev, h)
	}
	for _, pr := range prev {
		if inPool(pr.Addr()) && !slices.Contains(heldList, pr) {
			ok = false
		}
	}
	if ok {
		return nil
	}
	return fmt.Errorf("%w: CHECK: leaseholdd holds [%s] for container %s interface %s in pool %s, "+
		"but prevResult lists [%s]; the attachment's addresses changed: delete and re-add it",
		allocator.ErrNotAllocated, joinPrefixes(heldList), cfg.Request.ContainerID, cfg.Request.IfName,
		cfg.Request.Pool.Name, joinPrefixes(prev))
}

func joinPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}
