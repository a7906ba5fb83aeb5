package integration

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/vishvananda/netns"
)

// ccInNetns runs f on an OS thread switched into the network namespace at path. Processes
// started by f (CNI plugins run by libcni) inherit that namespace. f must not call t.Fatal:
// it runs on another goroutine. If the thread cannot be switched back it stays locked, so
// the runtime discards it with the goroutine.
func ccInNetns(path string, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("current netns: %w", err)
			return
		}
		defer orig.Close()
		target, err := netns.GetFromPath(path)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open netns %s: %w", path, err)
			return
		}
		defer target.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		ferr := f()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("leave netns %s: %w", path, err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// ccLink is one interface as its namespace's kernel reports it.
type ccLink struct {
	Index int
	Addrs []netip.Prefix // every address except IPv6 link-local, tentative ones included
}

// ccReadLink returns interface ifName of the namespace at path, found false when the
// namespace has no interface of that name.
func ccReadLink(t testing.TB, path, ifName string) (link ccLink, found bool) {
	t.Helper()
	err := ccInNetns(path, func() error {
		ifs, err := net.Interfaces()
		if err != nil {
			return err
		}
		for _, ifc := range ifs {
			if ifc.Name != ifName {
				continue
			}
			found = true
			link.Index = ifc.Index
			addrs, err := ifc.Addrs()
			if err != nil {
				return err
			}
			for _, a := range addrs {
				ipn, ok := a.(*net.IPNet)
				if !ok {
					continue
				}
				p := ccPrefix(*ipn)
				if p.Addr().IsLinkLocalUnicast() {
					continue
				}
				link.Addrs = append(link.Addrs, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("reading %s in %s: %v", ifName, path, err)
	}
	return link, found
}

// ccPrefix converts a net.IPNet to a netip.Prefix with an IPv4 address unmapped.
func ccPrefix(n net.IPNet) netip.Prefix {
	a, _ := netip.AddrFromSlice(n.IP)
	a = a.Unmap()
	ones, bits := n.Mask.Size()
	if a.Is4() && bits == 128 {
		ones -= 96
	}
	return netip.PrefixFrom(a, ones)
}

// ccNexthop is one next hop of a route.
type ccNexthop struct {
	GW  netip.Addr // invalid for a device route
	OIF int
}

// ccRoute is one route of a FIB dump (RTM_GETROUTE). A multipath route has MultiPath set
// and one next hop per path; any other route has exactly one next hop.
type ccRoute struct {
	Dst       netip.Prefix
	Table     uint32
	Priority  uint32
	Type      uint8
	MultiPath bool
	Nexthops  []ccNexthop
}

func (r ccRoute) String() string {
	var hops []string
	for _, nh := range r.Nexthops {
		hops = append(hops, fmt.Sprintf("via %v oif %d", nh.GW, nh.OIF))
	}
	return fmt.Sprintf("{%s table %d metric %d multipath=%v %s}", r.Dst, r.Table, r.Priority, r.MultiPath, strings.Join(hops, ", "))
}

// ccReadRoutes dumps the routes of family (syscall.AF_INET or AF_INET6) in the namespace
// at path: every table, every interface; the caller filters.
func ccReadRoutes(t testing.TB, path string, family int) []ccRoute {
	t.Helper()
	var out []ccRoute
	err := ccInNetns(path, func() error {
		rib, err := syscall.NetlinkRIB(syscall.RTM_GETROUTE, family)
		if err != nil {
			return fmt.Errorf("RTM_GETROUTE dump: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(rib)
		if err != nil {
			return err
		}
		for i := range msgs {
			m := &msgs[i]
			if m.Header.Type != syscall.RTM_NEWROUTE || len(m.Data) < syscall.SizeofRtMsg {
				continue
			}
			// struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
			fam, dstLen, table, typ := m.Data[0], int(m.Data[1]), uint32(m.Data[4]), m.Data[7]
			if int(fam) != family {
				continue
			}
			attrs, err := syscall.ParseNetlinkRouteAttr(m)
			if err != nil {
				return err
			}
			r := ccRoute{Table: table, Type: typ}
			var dst netip.Addr
			single := ccNexthop{}
			for _, a := range attrs {
				switch a.Attr.Type {
				case syscall.RTA_DST:
					dst, _ = netip.AddrFromSlice(a.Value)
				case syscall.RTA_GATEWAY:
					single.GW, _ = netip.AddrFromSlice(a.Value)
				case syscall.RTA_OIF:
					single.OIF = int(int32(binary.NativeEndian.Uint32(a.Value)))
				case syscall.RTA_PRIORITY:
					r.Priority = binary.NativeEndian.Uint32(a.Value)
				case syscall.RTA_TABLE:
					r.Table = binary.NativeEndian.Uint32(a.Value)
				case syscall.RTA_MULTIPATH:
					hops, err := ccParseMultipath(a.Value)
					if err != nil {
						return err
					}
					r.MultiPath, r.Nexthops = true, hops
				}
			}
			if !dst.IsValid() {
				dst = netip.IPv4Unspecified()
				if family == syscall.AF_INET6 {
					dst = netip.IPv6Unspecified()
				}
			}
			r.Dst = netip.PrefixFrom(dst, dstLen)
			if !r.MultiPath {
				r.Nexthops = []ccNexthop{single}
			}
			out = append(out, r)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("reading the FIB of %s: %v", path, err)
	}
	return out
}

// ccParseMultipath parses RTA_MULTIPATH: a sequence of struct rtnexthop {u16 len; u8 flags;
// u8 hops; s32 ifindex} each followed by its own attributes (RTA_GATEWAY among them).
func ccParseMultipath(b []byte) ([]ccNexthop, error) {
	var out []ccNexthop
	for len(b) >= 8 {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		if l < 8 || l > len(b) {
			return nil, fmt.Errorf("RTA_MULTIPATH: rtnexthop length %d of %d bytes", l, len(b))
		}
		nh := ccNexthop{OIF: int(int32(binary.NativeEndian.Uint32(b[4:8])))}
		for attrs := b[8:l]; len(attrs) >= 4; {
			al := int(binary.NativeEndian.Uint16(attrs[0:2]))
			if al < 4 || al > len(attrs) {
				return nil, fmt.Errorf("RTA_MULTIPATH: attribute length %d of %d bytes", al, len(attrs))
			}
			if binary.NativeEndian.Uint16(attrs[2:4]) == syscall.RTA_GATEWAY {
				nh.GW, _ = netip.AddrFromSlice(attrs[4:al])
			}
			al = (al + syscall.NLA_ALIGNTO - 1) &^ (syscall.NLA_ALIGNTO - 1)
			if al >= len(attrs) {
				break
			}
			attrs = attrs[al:]
		}
		out = append(out, nh)
		l = (l + syscall.NLA_ALIGNTO - 1) &^ (syscall.NLA_ALIGNTO - 1)
		if l >= len(b) {
			break
		}
		b = b[l:]
	}
	return out, nil
}

// ccMainRoutesOn returns the main-table routes to dst that use interface index oif (a
// multipath route counts when any of its paths does).
func ccMainRoutesOn(routes []ccRoute, dst netip.Prefix, oif int) []ccRoute {
	var out []ccRoute
	for _, r := range routes {
		if r.Table != syscall.RT_TABLE_MAIN || r.Dst != dst {
			continue
		}
		if slices.ContainsFunc(r.Nexthops, func(nh ccNexthop) bool { return nh.OIF == oif }) {
			out = append(out, r)
		}
	}
	return out
}

// ccHasRoute reports whether routes hold a single-path route to dst via gw on oif.
func ccHasRoute(routes []ccRoute, dst netip.Prefix, gw netip.Addr, oif int) bool {
	for _, r := range ccMainRoutesOn(routes, dst, oif) {
		if !r.MultiPath && r.Nexthops[0].GW == gw {
			return true
		}
	}
	return false
}

// ccIP dumps ip's view of a namespace, for failure messages.
func ccIP(path string, args ...string) string {
	name := filepath.Base(path)
	out, err := exec.Command("ip", append([]string{"-n", name}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("ip %v: %v\n%s", args, err, out)
	}
	return string(out)
}
