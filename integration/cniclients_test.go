package integration

// leasehold driven by real CNI clients: libcni (what container runtimes link) and cnitool,
// delegated to by the reference bridge and macvlan plugins, with the result read back from
// the kernel of a real network namespace.
//
// Every helper of this file starts with cc so it cannot collide with the other files of
// the package. Reading the kernel's state uses rtnetlink dumps from the standard library
// (syscall.NetlinkRIB) on a thread switched into the namespace: the main module does not
// require github.com/vishvananda/netlink, only github.com/vishvananda/netns.

import (
	"context"
	"crypto/sha512"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/vishvananda/netns"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// ccTag makes the names of namespaces and links of this test process differ from those of
// another run of the same tests on the machine (they share the root namespace and
// /var/run/netns).
var ccTag = strconv.FormatInt(int64(os.Getpid()%46656), 36)

// ccUniq is uniq with ccTag: at most len(prefix)+3+1+digits characters (link names: 15).
func ccUniq(prefix string) string { return uniq(prefix + ccTag + "-") }

// ccNetnsPath is where `ip netns add NAME` (and so sandbox) puts a namespace.
func ccNetnsPath(name string) string { return "/var/run/netns/" + name }

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

// ccResultAddrs returns the addresses of a CNI result, sorted.
func ccResultAddrs(res *types100.Result) []netip.Prefix {
	var out []netip.Prefix
	for _, ip := range res.IPs {
		out = append(out, ccPrefix(ip.Address))
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}

func ccSorted(p []netip.Prefix) []netip.Prefix {
	out := slices.Clone(p)
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}

// ccHeldBy returns the allocation keys of pool whose record names owner.
func ccHeldBy(t testing.TB, cli *clientv3.Client, pool, owner string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, keyspace.IPsPrefix(pool), clientv3.WithPrefix())
	if err != nil {
		t.Fatalf("get %s: %v", keyspace.IPsPrefix(pool), err)
	}
	var out []string
	for _, kv := range resp.Kvs {
		var a keyspace.Allocation
		if err := json.Unmarshal(kv.Value, &a); err != nil {
			t.Fatalf("%s: %v", kv.Key, err)
		}
		if a.Owner == owner {
			out = append(out, string(kv.Key))
		}
	}
	slices.Sort(out)
	return out
}

// ccKeysOf returns the etcd keys of a result's addresses in pool, sorted.
func ccKeysOf(pool string, addrs []netip.Prefix) []string {
	var out []string
	for _, p := range addrs {
		out = append(out, keyspace.IPKey(pool, p.Addr()))
	}
	slices.Sort(out)
	return out
}

// ccRuntime is a container runtime's libcni, running the plugins inside a namespace that
// stands for the host (so the bridge, the host veths and the forwarding sysctls the bridge
// plugin sets are all the test's own).
type ccRuntime struct {
	cni    *libcni.CNIConfig
	list   *libcni.NetworkConfigList
	hostNS string
}

// ccNewRuntime parses conflist and returns a runtime with its own result cache.
func ccNewRuntime(t testing.TB, hostNS string, conflist []byte) ccRuntime {
	t.Helper()
	list, err := libcni.ConfListFromBytes(conflist)
	if err != nil {
		t.Fatalf("conflist %s: %v", conflist, err)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{filepath.Join(binDir(t), "cni")}, t.TempDir(), nil)
	return ccRuntime{cni: cni, list: list, hostNS: hostNS}
}

// ccRT is the runtime configuration of a pod sandbox as a Kubernetes runtime passes it.
func ccRT(container, uid string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: container,
		NetNS:       ccNetnsPath(container),
		IfName:      "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "ns"}, {"K8S_POD_NAME", "pod-" + container},
			{"K8S_POD_UID", uid}},
	}
}

func (r ccRuntime) add(ctx context.Context, rt *libcni.RuntimeConf) (*types100.Result, error) {
	var res types.Result
	err := ccInNetns(r.hostNS, func() error {
		var err error
		res, err = r.cni.AddNetworkList(ctx, r.list, rt)
		return err
	})
	if err != nil {
		return nil, err
	}
	return types100.NewResultFromResult(res)
}

func (r ccRuntime) check(ctx context.Context, rt *libcni.RuntimeConf) error {
	return ccInNetns(r.hostNS, func() error { return r.cni.CheckNetworkList(ctx, r.list, rt) })
}

func (r ccRuntime) del(ctx context.Context, rt *libcni.RuntimeConf) error {
	return ccInNetns(r.hostNS, func() error { return r.cni.DelNetworkList(ctx, r.list, rt) })
}

func (r ccRuntime) gc(ctx context.Context, valid ...string) error {
	args := &libcni.GCArgs{}
	for _, c := range valid {
		args.ValidAttachments = append(args.ValidAttachments, types.GCAttachment{ContainerID: c, IfName: "eth0"})
	}
	return ccInNetns(r.hostNS, func() error { return r.cni.GCNetworkList(ctx, r.list, args) })
}

// ccLeaseholdIPAM is an ipam object for leasehold.
func ccLeaseholdIPAM(socket string, ranges []any, routes ...map[string]any) map[string]any {
	ipam := map[string]any{"type": "leasehold", "socket": socket, "ranges": ranges}
	if len(routes) > 0 {
		ipam["routes"] = routes
	}
	return ipam
}

// ccConflist is a cniVersion 1.1.0 network configuration list of one plugin.
func ccConflist(name string, plugin map[string]any) []byte {
	b, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name, "plugins": []any{plugin}})
	if err != nil {
		panic(err)
	}
	return b
}

// ccHostNS creates a namespace standing for the host, with a bridge name for it; both are
// removed at cleanup (the bridge first).
func ccHostNS(t *testing.T) (hostNS, bridge string) {
	t.Helper()
	name := ccUniq("lh-cchost-")
	sandbox(t, name)
	bridge = ccUniq("ccbr")
	t.Cleanup(func() { _ = exec.Command("ip", "-n", name, "link", "del", bridge).Run() })
	return ccNetnsPath(name), bridge
}

// ccRouteConf is a route object of ipam.routes; extra are more key, value pairs.
func ccRouteConf(dst, gw string, extra ...any) map[string]any {
	r := map[string]any{"dst": dst}
	if gw != "" {
		r["gw"] = gw
	}
	for i := 0; i+1 < len(extra); i += 2 {
		r[extra[i].(string)] = extra[i+1]
	}
	return r
}

// ccCheckAttachment asserts that eth0 in the container's namespace carries exactly the
// result's addresses (IPv6 possibly tentative: addresses are compared, not flags) and the
// given default routes, and returns eth0.
func ccCheckAttachment(t *testing.T, container string, res *types100.Result, gw4, gw6 netip.Addr) ccLink {
	t.Helper()
	path := ccNetnsPath(container)
	eth0, ok := ccReadLink(t, path, "eth0")
	if !ok {
		t.Fatalf("no eth0 in %s after ADD:\n%s", path, ccIP(path, "addr"))
	}
	if got, want := ccSorted(eth0.Addrs), ccResultAddrs(res); !slices.Equal(got, want) {
		t.Errorf("%s eth0 addresses %v, the CNI result says %v\n%s", container, got, want, ccIP(path, "addr"))
	}
	v4, v6 := ccReadRoutes(t, path, syscall.AF_INET), ccReadRoutes(t, path, syscall.AF_INET6)
	if !ccHasRoute(v4, netip.MustParsePrefix("0.0.0.0/0"), gw4, eth0.Index) {
		t.Errorf("%s: no IPv4 default route via %s on eth0: %v\n%s", container, gw4, v4, ccIP(path, "route"))
	}
	if !ccHasRoute(v6, netip.MustParsePrefix("::/0"), gw6, eth0.Index) {
		t.Errorf("%s: no IPv6 default route via %s on eth0: %v\n%s", container, gw6, v6, ccIP(path, "-6", "route"))
	}
	return eth0
}

// ccWantDualStack asserts one IPv4 address in sub4 and one IPv6 address in sub6.
func ccWantDualStack(t *testing.T, res *types100.Result, sub4, sub6 netip.Prefix) {
	t.Helper()
	addrs := ccResultAddrs(res)
	if len(addrs) != 2 || !sub4.Contains(addrs[0].Addr()) || !sub6.Contains(addrs[1].Addr()) ||
		addrs[0].Bits() != sub4.Bits() || addrs[1].Bits() != sub6.Bits() {
		t.Fatalf("want one address in %s and one in %s, got %v", sub4, sub6, addrs)
	}
}

// TestBridgeWithLeaseholdViaLibcni proves that leasehold works as the IPAM of the
// reference bridge plugin (isGateway) when a runtime drives it through libcni: ADD puts
// exactly the result's IPv4 and IPv6 addresses and the configured routes on eth0 of a
// real namespace and records them in etcd for the pod UID, CHECK (libcni's cached result
// as prevResult) passes, DEL removes the interface and every allocation of the owner. And
// CNI GC with a valid-attachments list releases exactly the attachments not named: first
// the way libcni does it for attachments in its cache (a DEL; the bridge plugin of
// plugins v1.9.1 does not implement GC itself), then through leasehold's own GC for an
// attachment this runtime has no cache entry for.
func TestBridgeWithLeaseholdViaLibcni(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	agent := startAgent(t, etcd.URL, "--gc-grace", "0s")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	hostNS, bridge := ccHostNS(t)
	name := uniq("ccnet")
	sub4, sub6 := netip.MustParsePrefix("10.61.0.0/24"), netip.MustParsePrefix("fd61::/64")
	gw4, gw6 := netip.MustParseAddr("10.61.0.1"), netip.MustParseAddr("fd61::1")
	ranges := []any{
		[]any{map[string]any{"subnet": sub4.String(), "gateway": gw4.String()}},
		[]any{map[string]any{"subnet": sub6.String(), "gateway": gw6.String()}},
	}
	ipam := ccLeaseholdIPAM(agent.Socket, ranges, ccRouteConf("0.0.0.0/0", gw4.String()), ccRouteConf("::/0", gw6.String()))
	rtm := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{"type": "bridge", "bridge": bridge, "isGateway": true, "ipam": ipam}))

	ctr := ccUniq("lh-ccbr-")
	sandbox(t, ctr)
	uid := "uid-" + ctr
	rt := ccRT(ctr, uid)
	res, err := rtm.add(ctx, rt)
	if err != nil {
		t.Fatalf("libcni ADD: %v", err)
	}
	ccWantDualStack(t, res, sub4, sub6)
	for _, ip := range res.IPs {
		want := gw4
		if ip.Address.IP.To4() == nil {
			want = gw6
		}
		if !ip.Gateway.Equal(net.IP(want.AsSlice())) {
			t.Errorf("result IP %s has gateway %v, want the range's %s", ip.Address.String(), ip.Gateway, want)
		}
	}
	var sandboxIf bool
	for _, ifc := range res.Interfaces {
		sandboxIf = sandboxIf || (ifc.Name == "eth0" && ifc.Sandbox == rt.NetNS)
	}
	if !sandboxIf {
		t.Errorf("result names no eth0 in sandbox %s: %+v", rt.NetNS, res.Interfaces)
	}
	ccCheckAttachment(t, ctr, res, gw4, gw6)

	// isGateway: the bridge (in the stand-in host namespace) carries both gateways.
	br, ok := ccReadLink(t, hostNS, bridge)
	if !ok {
		t.Fatalf("bridge %s missing in %s:\n%s", bridge, hostNS, ccIP(hostNS, "link"))
	}
	for _, gw := range []netip.Prefix{netip.PrefixFrom(gw4, sub4.Bits()), netip.PrefixFrom(gw6, sub6.Bits())} {
		if !slices.Contains(br.Addrs, gw) {
			t.Errorf("bridge %s addresses %v lack gateway %s", bridge, br.Addrs, gw)
		}
	}

	// etcd holds exactly the result's addresses for the pod UID, for this container.
	keys := ccKeysOf(name, ccResultAddrs(res))
	if held := ccHeldBy(t, cli, name, uid); !slices.Equal(held, keys) {
		t.Errorf("etcd allocations of %s: %v, want %v", uid, held, keys)
	}
	for _, k := range keys {
		if a, _ := allocation(t, cli, k); a.ContainerID != ctr || a.IfName != "eth0" || a.Network != name || a.Pod.Name != "pod-"+ctr {
			t.Errorf("%s: %+v, want container %s, eth0, network %s, pod pod-%s", k, a, ctr, name, ctr)
		}
	}

	if err := rtm.check(ctx, rt); err != nil {
		t.Errorf("libcni CHECK: %v", err)
	}

	if err := rtm.del(ctx, rt); err != nil {
		t.Fatalf("libcni DEL: %v", err)
	}
	if _, ok := ccReadLink(t, rt.NetNS, "eth0"); ok {
		t.Errorf("eth0 still in %s after DEL:\n%s", rt.NetNS, ccIP(rt.NetNS, "addr"))
	}
	if held := ccHeldBy(t, cli, name, uid); len(held) != 0 {
		t.Errorf("after DEL etcd still holds %v for %s", held, uid)
	}
	if left := keysUnder(snapshot(t, cli, keyspace.Prefix), keyspace.OwnerPrefix("default", uid)); len(left) != 0 {
		t.Errorf("after DEL the owner index still has %v", left)
	}

	// GC, step 1: two attachments in this runtime's cache, the list names one.
	keep, drop := ccUniq("lh-cckeep-"), ccUniq("lh-ccdrop-")
	sandbox(t, keep)
	sandbox(t, drop)
	keepRes, err := rtm.add(ctx, ccRT(keep, "uid-"+keep))
	if err != nil {
		t.Fatalf("ADD %s: %v", keep, err)
	}
	dropRes, err := rtm.add(ctx, ccRT(drop, "uid-"+drop))
	if err != nil {
		t.Fatalf("ADD %s: %v", drop, err)
	}
	keepKeys := ccKeysOf(name, ccResultAddrs(keepRes))
	if held := ccHeldBy(t, cli, name, "uid-"+drop); !slices.Equal(held, ccKeysOf(name, ccResultAddrs(dropRes))) {
		t.Fatalf("before GC, etcd holds %v for %s, want %v", held, drop, ccKeysOf(name, ccResultAddrs(dropRes)))
	}
	if err := rtm.gc(ctx, keep); err != nil {
		t.Fatalf("libcni GC: %v", err)
	}
	if held := ccHeldBy(t, cli, name, "uid-"+drop); len(held) != 0 {
		t.Errorf("after GC naming only %s, etcd still holds %v for %s", keep, held, drop)
	}
	if held := ccHeldBy(t, cli, name, "uid-"+keep); !slices.Equal(held, keepKeys) {
		t.Errorf("after GC naming %s, etcd holds %v for it, want %v", keep, held, keepKeys)
	}

	// GC, step 2: an attachment made by another runtime instance (another cache), so libcni
	// has nothing to DEL; only leasehold's GC, given the same valid list, can release it.
	orphan := ccUniq("lh-ccorph-")
	sandbox(t, orphan)
	other := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{"type": "bridge", "bridge": bridge, "isGateway": true, "ipam": ipam}))
	orphanRes, err := other.add(ctx, ccRT(orphan, "uid-"+orphan))
	if err != nil {
		t.Fatalf("ADD %s: %v", orphan, err)
	}
	if held := ccHeldBy(t, cli, name, "uid-"+orphan); !slices.Equal(held, ccKeysOf(name, ccResultAddrs(orphanRes))) {
		t.Fatalf("etcd holds %v for %s, want %v", held, orphan, ccKeysOf(name, ccResultAddrs(orphanRes)))
	}
	ipamOnly := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{"type": "leasehold", "ipam": ipam}))
	if err := ipamOnly.gc(ctx, keep); err != nil {
		t.Fatalf("libcni GC of leasehold: %v", err)
	}
	if held := ccHeldBy(t, cli, name, "uid-"+orphan); len(held) != 0 {
		t.Errorf("after leasehold's GC naming only %s, etcd still holds %v for %s", keep, held, orphan)
	}
	if held := ccHeldBy(t, cli, name, "uid-"+keep); !slices.Equal(held, keepKeys) {
		t.Errorf("after leasehold's GC naming %s, etcd holds %v for it, want %v", keep, held, keepKeys)
	}
}

// ccCnitool runs bin/cnitool with NETCONFPATH=netDir and CNI_PATH=bin/cni.
func ccCnitool(ctx context.Context, t *testing.T, netDir, cniArgs string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir(t), "cnitool"), args...)
	cmd.Env = append(os.Environ(), "NETCONFPATH="+netDir, "CNI_PATH="+filepath.Join(binDir(t), "cni"), "CNI_ARGS="+cniArgs,
		"CNI_IFNAME=eth0")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("cnitool %v: %w\nstdout: %s\nstderr: %s", args, err, out, stderr.String())
	}
	return out, nil
}

// ccVethPair creates a veth pair in the root namespace, both ends up, deleted at cleanup.
func ccVethPair(t *testing.T) (a, b string) {
	t.Helper()
	a, b = ccUniq("ccmva"), ccUniq("ccmvb")
	if out, err := exec.Command("ip", "link", "add", a, "type", "veth", "peer", "name", b).CombinedOutput(); err != nil {
		t.Fatalf("ip link add %s type veth peer name %s: %v\n%s", a, b, err, out)
	}
	t.Cleanup(func() {
		if _, err := net.InterfaceByName(a); err == nil {
			if out, err := exec.Command("ip", "link", "del", a).CombinedOutput(); err != nil {
				t.Errorf("ip link del %s: %v\n%s", a, err, out)
			}
		}
	})
	for _, l := range []string{a, b} {
		if out, err := exec.Command("ip", "link", "set", l, "up").CombinedOutput(); err != nil {
			t.Fatalf("ip link set %s up: %v\n%s", l, err, out)
		}
	}
	return a, b
}

// TestMacvlanWithLeaseholdViaCnitool proves that leasehold works as the IPAM of the
// reference macvlan plugin when driven by cnitool from a configuration file: the printed
// result's IPv4 and IPv6 addresses are exactly those on eth0 of the namespace, with the
// configured default routes, etcd records them for the pod UID, `cnitool check` passes,
// and `cnitool del` removes the interface and every allocation of the owner.
func TestMacvlanWithLeaseholdViaCnitool(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	agent := startAgent(t, etcd.URL)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	master, _ := ccVethPair(t)
	ctr := ccUniq("lh-ccmv-")
	sandbox(t, ctr)
	nsPath := ccNetnsPath(ctr)
	name := uniq("ccmvnet")
	// cnitool keeps its result cache in /var/lib/cni, named after the network and the
	// container ID it derives from the netns path; remove ours whatever happens.
	sum := sha512.Sum512([]byte(nsPath))
	cacheFile := filepath.Join("/var/lib/cni/results", fmt.Sprintf("%s-cnitool-%x-eth0", name, sum[:10]))
	t.Cleanup(func() { _ = os.Remove(cacheFile) })

	sub4, sub6 := netip.MustParsePrefix("10.62.0.0/24"), netip.MustParsePrefix("fd62::/64")
	gw4, gw6 := netip.MustParseAddr("10.62.0.1"), netip.MustParseAddr("fd62::1")
	conf := map[string]any{
		"cniVersion": "1.1.0", "name": name, "type": "macvlan", "master": master, "mode": "bridge",
		"ipam": ccLeaseholdIPAM(agent.Socket, []any{
			[]any{map[string]any{"subnet": sub4.String(), "gateway": gw4.String()}},
			[]any{map[string]any{"subnet": sub6.String(), "gateway": gw6.String()}},
		}, ccRouteConf("0.0.0.0/0", gw4.String()), ccRouteConf("::/0", gw6.String())),
	}
	netDir := t.TempDir()
	b, _ := json.Marshal(conf)
	if err := os.WriteFile(filepath.Join(netDir, "10-"+name+".conf"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	uid := "uid-" + ctr
	cniArgs := "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-" + ctr + ";K8S_POD_UID=" + uid

	out, err := ccCnitool(ctx, t, netDir, cniArgs, "add", name, nsPath)
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := types100.NewResult(out)
	if err != nil {
		t.Fatalf("cnitool add printed no CNI result: %v\n%s", err, out)
	}
	res, err := types100.NewResultFromResult(parsed)
	if err != nil {
		t.Fatal(err)
	}
	ccWantDualStack(t, res, sub4, sub6)
	eth0 := ccCheckAttachment(t, ctr, res, gw4, gw6)
	var macvlanIf bool
	for _, ifc := range res.Interfaces {
		macvlanIf = macvlanIf || (ifc.Name == "eth0" && ifc.Sandbox == nsPath)
	}
	if !macvlanIf {
		t.Errorf("result names no eth0 in sandbox %s: %+v", nsPath, res.Interfaces)
	}
	if details := ccIP(nsPath, "-d", "link", "show", "eth0"); !strings.Contains(details, "macvlan mode bridge") {
		t.Errorf("eth0 (index %d) is not a macvlan in bridge mode:\n%s", eth0.Index, details)
	}
	keys := ccKeysOf(name, ccResultAddrs(res))
	if held := ccHeldBy(t, cli, name, uid); !slices.Equal(held, keys) {
		t.Errorf("etcd allocations of %s: %v, want %v", uid, held, keys)
	}
	for _, k := range keys {
		if a, _ := allocation(t, cli, k); a.ContainerID != fmt.Sprintf("cnitool-%x", sum[:10]) || a.IfName != "eth0" {
			t.Errorf("%s: %+v, want cnitool's container ID and eth0", k, a)
		}
	}

	if _, err := ccCnitool(ctx, t, netDir, cniArgs, "check", name, nsPath); err != nil {
		t.Errorf("check: %v", err)
	}
	if _, err := ccCnitool(ctx, t, netDir, cniArgs, "del", name, nsPath); err != nil {
		t.Fatalf("del: %v", err)
	}
	if _, ok := ccReadLink(t, nsPath, "eth0"); ok {
		t.Errorf("eth0 still in %s after del:\n%s", nsPath, ccIP(nsPath, "addr"))
	}
	if held := ccHeldBy(t, cli, name, uid); len(held) != 0 {
		t.Errorf("after del etcd still holds %v for %s", held, uid)
	}
	for _, k := range keys {
		if exists(t, cli, k) {
			t.Errorf("after del %s still exists", k)
		}
	}
	if left := keysUnder(snapshot(t, cli, keyspace.Prefix), keyspace.OwnerPrefix("default", uid)); len(left) != 0 {
		t.Errorf("after del the owner index still has %v", left)
	}
}
