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
	"encoding/json"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// ccTag makes the names of namespaces and links of this test process differ from those of
// another run of the same tests on the machine (they share the root namespace and
// /var/run/netns).
var ccTag = strconv.FormatInt(int64(os.Getpid()%46656), 36)

// ccUniq is uniq with ccTag: at most len(prefix)+3+1+digits characters (link names: 15).
func ccUniq(prefix string) string { return uniq(prefix + ccTag + "-") }

// ccNetnsPath is where `ip netns add NAME` (and so sandbox) puts a namespace.
func ccNetnsPath(name string) string { return "/var/run/netns/" + name }

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
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
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
		out = append(out, keyspace.IPKey(pool, allocator.DefaultBlocks, p.Addr()))
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
	f := newFixture(t, withAgentFlags("--gc-grace", "0s"), withNetns())
	hostNS, bridge := ccHostNS(t)
	name := f.Pool
	sub4, sub6 := netip.MustParsePrefix("10.61.0.0/24"), netip.MustParsePrefix("fd61::/64")
	gw4, gw6 := netip.MustParseAddr("10.61.0.1"), netip.MustParseAddr("fd61::1")
	ranges := []any{
		[]any{map[string]any{"subnet": sub4.String(), "gateway": gw4.String()}},
		[]any{map[string]any{"subnet": sub6.String(), "gateway": gw6.String()}},
	}
	ipam := ccLeaseholdIPAM(f.Agent.Socket, ranges, ccRouteConf("0.0.0.0/0", gw4.String()), ccRouteConf("::/0", gw6.String()))
	rtm := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{"type": "bridge", "bridge": bridge, "isGateway": true, "ipam": ipam}))

	ctr := f.sandbox("lh-ccbr-")
	uid := "uid-" + ctr
	rt := ccRT(ctr, uid)
	res, err := rtm.add(f.Ctx, rt)
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
	if held := ccHeldBy(t, f.Cli, name, uid); !slices.Equal(held, keys) {
		t.Errorf("etcd allocations of %s: %v, want %v", uid, held, keys)
	}
	for _, k := range keys {
		if a, _ := allocation(t, f.Cli, k); a.ContainerID != ctr || a.IfName != "eth0" || a.Network != name || a.Pod.Name != "pod-"+ctr {
			t.Errorf("%s: %+v, want container %s, eth0, network %s, pod pod-%s", k, a, ctr, name, ctr)
		}
	}

	if err := rtm.check(f.Ctx, rt); err != nil {
		t.Errorf("libcni CHECK: %v", err)
	}

	if err := rtm.del(f.Ctx, rt); err != nil {
		t.Fatalf("libcni DEL: %v", err)
	}
	if _, ok := ccReadLink(t, rt.NetNS, "eth0"); ok {
		t.Errorf("eth0 still in %s after DEL:\n%s", rt.NetNS, ccIP(rt.NetNS, "addr"))
	}
	if held := ccHeldBy(t, f.Cli, name, uid); len(held) != 0 {
		t.Errorf("after DEL etcd still holds %v for %s", held, uid)
	}
	if left := keysUnder(snapshot(t, f.Cli, keyspace.Prefix), keyspace.OwnerPrefix(f.Cluster, uid)); len(left) != 0 {
		t.Errorf("after DEL the owner index still has %v", left)
	}

	// GC, step 1: two attachments in this runtime's cache, the list names one.
	keep, drop := f.sandbox("lh-cckeep-"), f.sandbox("lh-ccdrop-")
	keepRes, err := rtm.add(f.Ctx, ccRT(keep, "uid-"+keep))
	if err != nil {
		t.Fatalf("ADD %s: %v", keep, err)
	}
	dropRes, err := rtm.add(f.Ctx, ccRT(drop, "uid-"+drop))
	if err != nil {
		t.Fatalf("ADD %s: %v", drop, err)
	}
	keepKeys := ccKeysOf(name, ccResultAddrs(keepRes))
	if held := ccHeldBy(t, f.Cli, name, "uid-"+drop); !slices.Equal(held, ccKeysOf(name, ccResultAddrs(dropRes))) {
		t.Fatalf("before GC, etcd holds %v for %s, want %v", held, drop, ccKeysOf(name, ccResultAddrs(dropRes)))
	}
	if err := rtm.gc(f.Ctx, keep); err != nil {
		t.Fatalf("libcni GC: %v", err)
	}
	if held := ccHeldBy(t, f.Cli, name, "uid-"+drop); len(held) != 0 {
		t.Errorf("after GC naming only %s, etcd still holds %v for %s", keep, held, drop)
	}
	if held := ccHeldBy(t, f.Cli, name, "uid-"+keep); !slices.Equal(held, keepKeys) {
		t.Errorf("after GC naming %s, etcd holds %v for it, want %v", keep, held, keepKeys)
	}

	// GC, step 2: an attachment made by another runtime instance (another cache), so libcni
	// has nothing to DEL; only leasehold's GC, given the same valid list, can release it.
	orphan := f.sandbox("lh-ccorph-")
	other := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{"type": "bridge", "bridge": bridge, "isGateway": true, "ipam": ipam}))
	orphanRes, err := other.add(f.Ctx, ccRT(orphan, "uid-"+orphan))
	if err != nil {
		t.Fatalf("ADD %s: %v", orphan, err)
	}
	if held := ccHeldBy(t, f.Cli, name, "uid-"+orphan); !slices.Equal(held, ccKeysOf(name, ccResultAddrs(orphanRes))) {
		t.Fatalf("etcd holds %v for %s, want %v", held, orphan, ccKeysOf(name, ccResultAddrs(orphanRes)))
	}
	ipamOnly := ccNewRuntime(t, hostNS, ccConflist(name, map[string]any{"type": "leasehold", "ipam": ipam}))
	if err := ipamOnly.gc(f.Ctx, keep); err != nil {
		t.Fatalf("libcni GC of leasehold: %v", err)
	}
	if held := ccHeldBy(t, f.Cli, name, "uid-"+orphan); len(held) != 0 {
		t.Errorf("after leasehold's GC naming only %s, etcd still holds %v for %s", keep, held, orphan)
	}
	if held := ccHeldBy(t, f.Cli, name, "uid-"+keep); !slices.Equal(held, keepKeys) {
		t.Errorf("after leasehold's GC naming %s, etcd holds %v for it, want %v", keep, held, keepKeys)
	}
}
