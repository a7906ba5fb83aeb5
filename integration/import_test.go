package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// hostLocalAdd runs the real host-local plugin (bin/cni/host-local) for ADD, as a runtime
// runs a network's IPAM plugin, and returns the addresses it gave.
func hostLocalAdd(t *testing.T, ctx context.Context, conf []byte, container string) []netip.Addr {
	t.Helper()
	dir := filepath.Join(binDir(t), "cni")
	r, err := invoke.ExecPluginWithResult(ctx, filepath.Join(dir, "host-local"), conf,
		&invoke.Args{Command: "ADD", ContainerID: container, NetNS: ccNetnsPath(container), IfName: "eth0", Path: dir}, nil)
	if err != nil {
		t.Fatalf("host-local ADD %s: %v", container, err)
	}
	res, err := types100.NewResultFromResult(r)
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Addr
	for _, ip := range res.IPs {
		a, _ := netip.AddrFromSlice(ip.Address.IP)
		out = append(out, a.Unmap())
	}
	return out
}

// lastImportDone is the fields of the agent's last "import done" log line.
func lastImportDone(t *testing.T, a *agentProc) map[string]any {
	t.Helper()
	var last map[string]any
	sc := bufio.NewScanner(strings.NewReader(a.logs.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == "import done" {
			last = m
		}
	}
	if last == nil {
		t.Fatalf("the agent logged no \"import done\":\n%s", a.logs.String())
	}
	return last
}

func wantImportCounts(t *testing.T, a *agentProc, want map[string]float64) {
	t.Helper()
	got := lastImportDone(t, a)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("import done: %s = %v, want %v (%v)", k, got[k], v, got)
		}
	}
}

// heldAt returns the pool's allocations by address, failing on one listed twice.
func heldAt(t *testing.T, f *fixture, pool string) map[netip.Addr]admin.AllocationEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(f.Ctx, etcdtest.Patience)
	defer cancel()
	list, err := admin.ListAllocations(ctx, f.Cli, pool)
	if err != nil {
		t.Fatal(err)
	}
	out := map[netip.Addr]admin.AllocationEntry{}
	for _, a := range list {
		if prev, dup := out[a.IP]; dup {
			t.Errorf("%s is held twice: %s and %s", a.IP, prev.Owner, a.Owner)
		}
		out[a.IP] = a
	}
	return out
}

// TestSwitchFromHostLocalWithRunningContainers switches a node from host-local to leasehold
// without draining it. The real host-local plugin gives four running containers (real network
// namespaces) their addresses; another node's pod already holds one of them in etcd. The
// agent refuses to import into a pool etcd does not define, then, started with
// --import-host-local, claims the others for their containers before it serves, reports the
// one held by the other pod and leaves it. New ADDs through the leasehold plugin, until the
// pool is exhausted, are never given an imported address; the old pods' CHECK and DEL, naming
// their pod UIDs as a kubelet does, reach their attachments; a restart imports nothing new.
func TestSwitchFromHostLocalWithRunningContainers(t *testing.T) {
	f := newFixture(t, withNetns(), withoutAgent())
	network, dataDir := f.Pool, t.TempDir()
	ranges := []any{[]any{map[string]any{"subnet": "10.73.0.0/28"}}, []any{map[string]any{"subnet": "fd73::/124"}}}
	hlConf, _ := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": network, "type": "host-local",
		"ipam": map[string]any{"type": "host-local", "dataDir": dataDir, "ranges": ranges}})
	var ctrs []string
	old := map[string][]netip.Addr{}
	for range 4 {
		ctr := f.sandbox("lh-imp-")
		ctrs = append(ctrs, ctr)
		old[ctr] = hostLocalAdd(t, f.Ctx, hlConf, ctr)
		if len(old[ctr]) != 2 {
			t.Fatalf("host-local gave %s %v, want an IPv4 and an IPv6 address", ctr, old[ctr])
		}
	}
	dir := filepath.Join(dataDir, network)
	importFlag := []string{"--import-host-local", network + "=" + dir}

	// No pool in etcd yet: the agent will not serve, and says what to do.
	if out := refusedStart(t, f, importFlag...); !strings.Contains(out, "leaseholdctl pool create "+network) {
		t.Fatalf("import into a pool etcd does not define: want the agent to stop naming leaseholdctl pool create, got:\n%s", out)
	}

	// Another node's pod holds the fourth container's IPv4 address (and defines the pool).
	other := f.startAgent()
	taken := old[ctrs[3]][0]
	if _, err := f.add(netconf(network, other.Socket, map[string]any{"ranges": ranges}), "other-ctr", "eth0",
		"IP="+taken.String()+",fd73::e;K8S_POD_UID=other-uid"); err != nil {
		t.Fatal(err)
	}

	metricsAddr := strings.TrimPrefix(freeURL(t), "http://")
	a := f.startAgent(append(importFlag, "--metrics-addr", metricsAddr)...)
	wantImportCounts(t, a, map[string]float64{"imported": 7, "already_imported": 0, "conflicts": 1})
	// What the LeaseholdImportConflicts alert reads (deploy/monitoring).
	_, text := httpGet(t, "http://"+metricsAddr+"/metrics")
	for result, want := range map[string]float64{"imported": 7, "conflict": 1} {
		if got := metricValue(t, text, "leasehold_import_addresses_total", `result="`+result+`"`); got != want {
			t.Errorf("leasehold_import_addresses_total{result=%q} = %v, want %v", result, got, want)
		}
	}
	if !strings.Contains(a.logs.String(), `"msg":"IMPORT CONFLICT`) || !strings.Contains(a.logs.String(), `"ip":"`+taken.String()+`"`) {
		t.Errorf("the agent does not report %s as held by another owner:\n%s", taken, a.logs.String())
	}
	held := heldAt(t, f, network)
	imported := map[netip.Addr]string{}
	for _, ctr := range ctrs {
		for _, ip := range old[ctr] {
			if ip == taken {
				if h := held[ip]; h.Owner != "other-uid" {
					t.Errorf("%s: held by %q, want the other node's pod other-uid", ip, h.Owner)
				}
				continue
			}
			imported[ip] = ctr
			h, ok := held[ip]
			if !ok || h.Owner != ctr || h.ContainerID != ctr || h.IfName != "eth0" || h.Node != a.Node || h.NodeUID != a.NodeUID {
				t.Errorf("%s: %+v (found %v); want it held for container %s on node %s", ip, h.Allocation, ok, ctr, a.Node)
			}
		}
		for _, k := range []string{keyspace.OwnerKey(f.Cluster, ctr, "eth0", network), keyspace.PodKey(f.Cluster, a.Node, ctr)} {
			if !exists(t, f.Cli, k) {
				t.Errorf("no %s", k)
			}
		}
	}
	if err := f.check(netconf(network, a.Socket, map[string]any{"ranges": ranges}), ctrs[0], "eth0", "K8S_POD_UID=uid-"+ctrs[0]); err != nil {
		t.Errorf("CHECK of an imported container naming its pod UID: %v", err)
	}

	// New pods on the switched node: never an imported address, until the pool is exhausted.
	conf := netconf(network, a.Socket, map[string]any{"ranges": ranges})
	given := 0
	for i := range 20 {
		res, err := f.add(conf, fmt.Sprintf("new-%d", i), "eth0", fmt.Sprintf("K8S_POD_UID=new-uid-%d", i))
		if cniCode(err) == 102 {
			break
		}
		if err != nil {
			t.Fatalf("ADD new-%d: %v", i, err)
		}
		for _, p := range ccResultAddrs(res) {
			if ctr, ok := imported[p.Addr()]; ok || p.Addr() == taken {
				t.Errorf("new-%d was given %s, imported for %s (or the other node's)", i, p.Addr(), ctr)
			}
		}
		given++
	}
	if given != 9 {
		t.Errorf("%d new pods got addresses before the pool was exhausted; want 9 (13 IPv4 addresses, 4 held before)", given)
	}
	_, text = httpGet(t, "http://"+metricsAddr+"/metrics")
	if got := metricValue(t, text, "leasehold_pool_exhausted_total", `pool="`+network+`"`); got != 1 {
		t.Errorf("ADDs refused for pool %s being exhausted: %v, want 1", network, got)
	}
	after := heldAt(t, f, network)
	for ip, ctr := range imported {
		if after[ip].Owner != ctr || after[ip].ModRevision != held[ip].ModRevision {
			t.Errorf("%s changed hands during the new ADDs: %+v", ip, after[ip].Allocation)
		}
	}

	// The old pods' DELs, with the pod UID a kubelet sends: the first now, the others after a
	// restart that imports nothing new (the first's address stays released).
	del := func(ctr string) {
		t.Helper()
		if err := f.del(conf, ctr, "eth0", "K8S_POD_NAMESPACE=ns;K8S_POD_NAME="+ctr+";K8S_POD_UID=uid-"+ctr); err != nil {
			t.Fatalf("DEL %s: %v", ctr, err)
		}
		if keys := keysUnder(snapshot(t, f.Cli, keyspace.Prefix), keyspace.OwnerPrefix(f.Cluster, ctr)); len(keys) != 0 {
			t.Errorf("after the DEL of %s its owner index remains: %v", ctr, keys)
		}
		now := heldAt(t, f, network)
		for _, ip := range old[ctr] {
			if h, ok := now[ip]; ok && h.Owner == ctr {
				t.Errorf("after the DEL of %s it still holds %s", ctr, ip)
			}
		}
	}
	del(ctrs[0])
	before := snapshot(t, f.Cli, keyspace.Prefix)
	a.stop()
	a.restart(t)
	wantImportCounts(t, a, map[string]float64{"imported": 0, "already_imported": 5, "released_since_imported": 2, "conflicts": 1})
	for _, ctr := range ctrs {
		for _, p := range []string{keyspace.OwnerPrefix(f.Cluster, ctr), keyspace.PodKey(f.Cluster, a.Node, ctr)} {
			now := snapshot(t, f.Cli, p)
			for _, k := range slices.Concat(keysUnder(before, p), keysUnder(now, p)) {
				if before[k] != now[k] {
					t.Errorf("the second start changed %s: %q, now %q", k, before[k], now[k])
				}
			}
		}
	}
	for _, ctr := range ctrs[1:] {
		del(ctr)
	}
	if h := heldAt(t, f, network)[taken]; h.Owner != "other-uid" {
		t.Errorf("%s: %+v; the other node's pod must keep it", taken, h.Allocation)
	}
}

// refusedStart runs leaseholdd with flags, as launch does, and returns what it printed; the
// test fails unless it stops (exits non-zero) before serving.
func refusedStart(t *testing.T, f *fixture, flags ...string) string {
	t.Helper()
	cmd := exec.CommandContext(f.Ctx, filepath.Join(binDir(t), "leaseholdd"), append([]string{"--etcd-endpoints", f.Endpoint,
		"--socket", filepath.Join(t.TempDir(), "s.sock"), "--state-dir", t.TempDir(), "--cluster", f.Cluster,
		"--node", uniq("node-"), "--node-uid", uniq("uid-"), "--metrics-addr", "", "--publish-host-addresses=false",
		"--liveness-interval", "0s"}, flags...)...)
	out, err := cmd.CombinedOutput()
	if err == nil || f.Ctx.Err() != nil {
		t.Fatalf("leaseholdd %v: want it to stop before serving, got %v (test context: %v):\n%s", flags, err, f.Ctx.Err(), out)
	}
	return string(out)
}

// TestHostLocalImportChecksTheCNICache switches a node whose host-local configuration sets a
// dataDir, giving the default directory by mistake: an empty directory of that name exists,
// so nothing tells it from a network without containers but the CNI library's result cache,
// which records the running containers (written here by the real libcni, as a runtime does).
// The agent must refuse to start, naming the directory to give; given it, it imports every
// container; with the cache check turned off it would have imported nothing.
func TestHostLocalImportChecksTheCNICache(t *testing.T) {
	f := newFixture(t, withNetns(), withoutAgent())
	network, dataDir, cache, wrong := f.Pool, t.TempDir(), t.TempDir(), t.TempDir()
	ranges := []any{[]any{map[string]any{"subnet": "10.74.0.0/28"}}}
	conf, _ := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": network, "type": "host-local",
		"ipam": map[string]any{"type": "host-local", "dataDir": dataDir, "ranges": ranges}})
	netConf, err := libcni.ConfFromBytes(conf)
	if err != nil {
		t.Fatal(err)
	}
	runtime := libcni.NewCNIConfigWithCacheDir([]string{filepath.Join(binDir(t), "cni")}, cache, nil)
	var ctrs []string
	for range 2 {
		ctr := f.sandbox("lh-cache-")
		ctrs = append(ctrs, ctr)
		if _, err := runtime.AddNetwork(f.Ctx, netConf, &libcni.RuntimeConf{ContainerID: ctr, NetNS: ccNetnsPath(ctr), IfName: "eth0"}); err != nil {
			t.Fatalf("libcni ADD %s through host-local: %v", ctr, err)
		}
	}
	// A first ADD elsewhere defines the pool; its DEL gives the address back (no quarantine).
	define := netconf(network, f.startAgent().Socket, map[string]any{"ranges": ranges})
	if _, err := f.add(define, "define-pool", "eth0", ""); err != nil {
		t.Fatal(err)
	}
	if err := f.del(define, "define-pool", "eth0", ""); err != nil {
		t.Fatal(err)
	}

	out := refusedStart(t, f, "--import-host-local", network+"="+wrong, "--import-cni-cache", cache)
	for _, want := range []string{wrong + " holds no address file", "2 attachments of network " + network, ctrs[0], "dataDir/" + network} {
		if !strings.Contains(out, want) {
			t.Errorf("an empty directory while the cache has the network's containers: the error lacks %q:\n%s", want, out)
		}
	}

	a := f.startAgent("--import-host-local", network+"="+filepath.Join(dataDir, network), "--import-cni-cache", cache)
	wantImportCounts(t, a, map[string]float64{"imported": 2, "conflicts": 0})
	held := heldAt(t, f, network)
	for _, ctr := range ctrs {
		found := false
		for _, h := range held {
			found = found || h.Owner == ctr
		}
		if !found {
			t.Errorf("container %s's address was not imported: %v", ctr, held)
		}
	}
}

// TestSwitchFromWhereaboutsImportsThisNodesPods imports whereabouts IPPools (written by hand
// as kubectl prints them, an IPv4 and an IPv6 pool) into a pool made with leaseholdctl pool
// create. Only the allocations of the pods --import-pods places on this node are claimed,
// under their pod UIDs; a pod of another node keeps nothing here. A DEL naming the pod UID releases, and a
// restart imports nothing new.
func TestSwitchFromWhereaboutsImportsThisNodesPods(t *testing.T) {
	f := newFixture(t, withoutAgent())
	network, dir := f.Pool, t.TempDir()
	if out, err := exec.CommandContext(f.Ctx, filepath.Join(binDir(t), "leaseholdctl"), "--endpoints", f.Endpoint,
		"pool", "create", network, "--range", "10.74.0.0/24", "--range", "fd74::/64").CombinedOutput(); err != nil {
		t.Fatalf("pool create: %v\n%s", err, out)
	}
	alloc := func(id, pod string) map[string]string {
		return map[string]string{"id": id, "podref": "ns/" + pod, "ifname": "net1"}
	}
	pools := map[string]any{"apiVersion": "v1", "kind": "List", "items": []any{
		map[string]any{"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
			"metadata": map[string]any{"name": "10.74.0.0-24", "namespace": "kube-system"},
			"spec": map[string]any{"range": "10.74.0.0/24", "allocations": map[string]any{
				"10": alloc("ctr-p1", "p1"), "11": alloc("ctr-p2", "p2"), "12": alloc("ctr-p3", "p3")}}},
		map[string]any{"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
			"metadata": map[string]any{"name": "fd74---64", "namespace": "kube-system"},
			"spec": map[string]any{"range": "fd74::/64", "allocations": map[string]any{
				"10": alloc("ctr-p1", "p1"), "4096": alloc("ctr-p2", "p2"), "18446744073709551615": alloc("ctr-p3", "p3")}}},
	}}
	node := uniq("node-")
	pod := func(name, node string) map[string]any {
		return map[string]any{"kind": "Pod", "metadata": map[string]any{"namespace": "ns", "name": name, "uid": "uid-" + name},
			"spec": map[string]any{"nodeName": node}}
	}
	pods := map[string]any{"apiVersion": "v1", "kind": "List", "items": []any{pod("p1", node), pod("p2", node), pod("p3", "another-node")}}
	for name, v := range map[string]any{"pools.json": pools, "pods.json": pods} {
		b, _ := json.Marshal(v)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	a := f.startAgent("--node", node, "--import-whereabouts", network+"="+filepath.Join(dir, "pools.json"),
		"--import-pods", filepath.Join(dir, "pods.json"))
	wantImportCounts(t, a, map[string]float64{"imported": 4, "conflicts": 0, "outside_pool": 0})
	ip := netip.MustParseAddr
	want := map[netip.Addr]string{ip("10.74.0.10"): "uid-p1", ip("fd74::a"): "uid-p1", ip("10.74.0.11"): "uid-p2", ip("fd74::1000"): "uid-p2"}
	held := heldAt(t, f, network)
	if len(held) != len(want) {
		t.Errorf("held %v, want only this node's pods' %v", held, want)
	}
	for addr, owner := range want {
		if h := held[addr]; h.Owner != owner || h.IfName != "net1" || h.Pod.Name != strings.TrimPrefix(owner, "uid-") || h.Node != a.Node {
			t.Errorf("%s: %+v, want owner %s on interface net1 of node %s", addr, h.Allocation, owner, a.Node)
		}
	}
	conf := netconf(network, a.Socket, map[string]any{})
	if err := f.del(conf, "ctr-p1", "net1", "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p1;K8S_POD_UID=uid-p1"); err != nil {
		t.Fatal(err)
	}
	if held := heldAt(t, f, network); held[ip("10.74.0.10")].Owner != "" || held[ip("fd74::a")].Owner != "" || held[ip("10.74.0.11")].Owner != "uid-p2" {
		t.Errorf("after p1's DEL: %v", held)
	}
	a.stop()
	a.restart(t)
	wantImportCounts(t, a, map[string]float64{"imported": 0, "already_imported": 2, "released_since_imported": 2})
	if err := f.del(conf, "ctr-p2", "net1", "K8S_POD_UID=uid-p2"); err != nil {
		t.Fatal(err)
	}
	if held := heldAt(t, f, network); len(held) != 0 {
		t.Errorf("after every DEL the pool still holds %v", held)
	}
}
