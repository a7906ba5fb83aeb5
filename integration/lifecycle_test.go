package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/keyspace"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Lifecycle tests use 4 s leases: long enough for keep-alive (every TTL/3) on a loaded
// 2-core machine, short enough to watch expiry happen.
const ttl = 4 * time.Second

// expirySlack is what etcd adds to a TTL before the keys are gone: the leader checks for
// expired leases every 500 ms and revokes them in rate-limited batches (ARCHITECTURE.md).
const expirySlack = 5 * time.Second

// sandbox creates a real network namespace named after a container, so that the agent's
// sandbox liveness sees it at /var/run/netns/<container> as the runtime's netns path.
func sandbox(t testing.TB, container string) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("network namespace tests need root, and CI runs as root")
		}
		t.Skip("network namespaces need root")
	}
	if out, err := exec.Command("ip", "netns", "add", container).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v\n%s", container, err, out)
	}
	t.Cleanup(func() { removeSandbox(t, container) })
}

func removeSandbox(t testing.TB, container string) {
	if _, err := os.Stat("/var/run/netns/" + container); err != nil {
		return
	}
	if out, err := exec.Command("ip", "netns", "del", container).CombinedOutput(); err != nil {
		t.Errorf("ip netns del %s: %v\n%s", container, err, out)
	}
}

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for time.Since(start) < timeout {
		if cond() {
			return time.Since(start)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s: not within %s", what, timeout)
	return 0
}

func exists(t testing.TB, cli *clientv3.Client, key string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, key, clientv3.WithCountOnly())
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return resp.Count > 0
}

func allocation(t testing.TB, cli *clientv3.Client, key string) (keyspace.Allocation, int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatalf("get %s: %v (found %d)", key, err, len(resp.Kvs))
	}
	var a keyspace.Allocation
	if err := json.Unmarshal(resp.Kvs[0].Value, &a); err != nil {
		t.Fatal(err)
	}
	return a, resp.Kvs[0].Lease
}

func ipv4(t testing.TB, p plugin, ctx context.Context, conf []byte, container, cniArgs string) netip.Addr {
	t.Helper()
	res, err := p.add(ctx, conf, container, "eth0", cniArgs)
	if err != nil {
		t.Fatalf("ADD %s: %v", container, err)
	}
	for _, ip := range res.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP.To4()); ok && ip.Address.IP.To4() != nil {
			return a
		}
	}
	t.Fatalf("ADD %s: no IPv4 address in %v", container, res)
	return netip.Addr{}
}

func v4conf(name, socket, subnet string) []byte {
	return netconf(name, socket, map[string]any{"ranges": []any{[]any{map[string]any{"subnet": subnet}}}})
}

// TestAgentKilledAndRestartedAdoptsLiveSandboxes: kill -9, restart within the TTL. The live
// pod keeps its address beyond several TTLs (the new process renews the same lease); the pod
// whose netns vanished meanwhile is released at start.
func TestAgentKilledAndRestartedAdoptsLiveSandboxes(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	agent := startAgent(t, etcd.URL, "--lease-ttl", ttl.String())
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := uniq("net")
	conf := v4conf(name, agent.Socket, "10.30.0.0/24")
	live, gone := uniq("lh-live-"), uniq("lh-gone-")
	sandbox(t, live)
	sandbox(t, gone)
	liveIP := ipv4(t, pl, ctx, conf, live, "K8S_POD_UID=uid-"+live)
	goneIP := ipv4(t, pl, ctx, conf, gone, "K8S_POD_UID=uid-"+gone)
	_, liveLease := allocation(t, cli, keyspace.IPKey(name, liveIP))

	agent.kill()
	removeSandbox(t, gone) // the sandbox dies while the agent is down
	agent.restart(t)

	waitFor(t, ttl+expirySlack, "the gone sandbox's address is released at restart", func() bool {
		return !exists(t, cli, keyspace.IPKey(name, goneIP))
	})
	time.Sleep(3 * ttl)
	holder, lease := allocation(t, cli, keyspace.IPKey(name, liveIP))
	if holder.Owner != "uid-"+live || lease != liveLease {
		t.Errorf("live pod's address: owner %s lease %x, want owner uid-%s on its original lease %x", holder.Owner, lease, live, liveLease)
	}
	if err := pl.check(ctx, conf, live, "eth0", "K8S_POD_UID=uid-"+live); err != nil {
		t.Errorf("CHECK of the live pod after the restart: %v", err)
	}
}

// TestDeadNodeAllocationsExpireWithoutAnyoneActing: kill -9 and no restart. Every key of the
// node disappears within TTL plus etcd's expiry slack, with no other component running.
func TestDeadNodeAllocationsExpireWithoutAnyoneActing(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	agent := startAgent(t, etcd.URL, "--lease-ttl", ttl.String())
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := uniq("net")
	conf := v4conf(name, agent.Socket, "10.31.0.0/24")
	for i := range 5 {
		ipv4(t, pl, ctx, conf, fmt.Sprintf("dead%d", i), "")
	}
	if n := len(keysUnder(snapshot(t, cli, keyspace.Prefix), keyspace.IPsPrefix(name))); n != 5 {
		t.Fatalf("want 5 allocations before the kill, got %d", n)
	}
	agent.kill()
	killed := time.Now()
	took := waitFor(t, ttl+expirySlack, "every key of the dead node expires", func() bool {
		s := snapshot(t, cli, keyspace.Prefix)
		return len(keysUnder(s, keyspace.IPsPrefix(name))) == 0 &&
			len(keysUnder(s, keyspace.NodesPrefix("default"))) == 0 &&
			len(keysUnder(s, keyspace.OwnersPrefix("default"))) == 0
	})
	t.Logf("dead node's keys gone %s after kill -9 (TTL %s)", took.Round(100*time.Millisecond), ttl)
	if time.Since(killed) < ttl-time.Second {
		t.Errorf("keys vanished after %s, before the %s TTL: something other than expiry removed them", time.Since(killed), ttl)
	}
}

// TestSeed003ReplacementNodeNeverAdopts reproduces the Azure CNS report: a node replaced
// under the same name while the old node's state is still in the store. Here the new agent
// (same name, new identity) never adopts, renews or releases the old node's allocations;
// they expire on their leases; the new node allocates correctly from the same range at once.
func TestSeed003ReplacementNodeNeverAdopts(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	old := startAgent(t, etcd.URL, "--lease-ttl", ttl.String(), "--node", "node-x", "--node-uid", "machine-1.boot-1")
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := uniq("net")
	subnet := "10.32.0.0/29" // 5 usable addresses: the old node's two and the new node's must not collide
	oldConf := v4conf(name, old.Socket, subnet)
	static := uniq("lh-static-")
	sandbox(t, static)
	oldIPs := map[netip.Addr]string{}
	oldIPs[ipv4(t, pl, ctx, oldConf, static, "K8S_POD_UID=static-pod-uid")] = "static-pod-uid"
	oldIPs[ipv4(t, pl, ctx, oldConf, "old-ctr", "K8S_POD_UID=old-pod-uid")] = "old-pod-uid"

	old.kill() // the machine is gone; its leases still run
	repl := startAgent(t, etcd.URL, "--lease-ttl", ttl.String(), "--node", "node-x", "--node-uid", "machine-2.boot-1")
	conf := v4conf(name, repl.Socket, subnet)

	// The new node allocates from the same range right away, never an address the old node's pods hold.
	fresh := ipv4(t, pl, ctx, conf, "new-ctr", "K8S_POD_UID=new-pod-uid")
	if _, clash := oldIPs[fresh]; clash {
		t.Fatalf("new node was given %s, still held by the old node's pod %s", fresh, oldIPs[fresh])
	}
	// A static pod has the same UID on the replacement: its old keys are not adopted.
	_, err := pl.add(ctx, conf, "static-ctr-2", "eth0", "K8S_POD_UID=static-pod-uid")
	if cniCode(err) != 11 || !strings.Contains(err.Error(), "never adopts") {
		t.Errorf("ADD for an owner the old identity holds: want code 11 explaining it is never adopted, got %v", err)
	}
	// A DEL replayed on the new node for the old node's container releases nothing.
	if err := pl.del(ctx, conf, "old-ctr", "eth0", "K8S_POD_UID=old-pod-uid"); err != nil {
		t.Errorf("DEL: %v", err)
	}
	for ip, owner := range oldIPs {
		if a, _ := allocation(t, cli, keyspace.IPKey(name, ip)); a.Owner != owner || a.NodeUID != "machine-1.boot-1" {
			t.Errorf("old allocation %s changed hands before expiry: %+v", ip, a)
		}
	}
	// The old allocations leave by expiry, the new one stays.
	waitFor(t, ttl+expirySlack, "the old node's allocations expire", func() bool {
		for ip := range oldIPs {
			if exists(t, cli, keyspace.IPKey(name, ip)) {
				return false
			}
		}
		return true
	})
	if a, _ := allocation(t, cli, keyspace.IPKey(name, fresh)); a.Owner != "new-pod-uid" || a.NodeUID != "machine-2.boot-1" {
		t.Errorf("new node's allocation: %+v", a)
	}
	// Once the old keys are gone, the static pod gets an address on the new node.
	if _, err := pl.add(ctx, conf, "static-ctr-2", "eth0", "K8S_POD_UID=static-pod-uid"); err != nil {
		t.Errorf("static pod ADD after the old keys expired: %v", err)
	}
	if !strings.Contains(repl.logs.String(), `"other_identities_left_to_expire":2`) {
		t.Errorf("replacement agent should report the old identity's two pod records as left to expire:\n%s", repl.logs.String())
	}
}

// TestSeed002StatefulSetReplacementKeepsBothOwners reproduces the whereabouts report: a
// StatefulSet pod is replaced (same name, new UID, another node) while the old allocation
// still lives. Nothing frees the new pod's address, ever; the old one leaves only by DEL or
// by lease expiry. There is no reconciler that could look at a pod without an IP yet.
func TestSeed002StatefulSetReplacementKeepsBothOwners(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	nodeA := startAgent(t, etcd.URL, "--lease-ttl", ttl.String(), "--node", "node-a", "--node-uid", "uid-a")
	nodeB := startAgent(t, etcd.URL, "--lease-ttl", ttl.String(), "--node", "node-b", "--node-uid", "uid-b")
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := uniq("net")
	confA, confB := v4conf(name, nodeA.Socket, "10.33.0.0/24"), v4conf(name, nodeB.Socket, "10.33.0.0/24")
	oldIP := ipv4(t, pl, ctx, confA, "web0-old", "K8S_POD_UID=uid-1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0")
	newIP := ipv4(t, pl, ctx, confB, "web0-new", "K8S_POD_UID=uid-2;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0")
	if oldIP == newIP {
		t.Fatalf("old and new web-0 share %s", oldIP)
	}
	check := func(ip netip.Addr, uid, node string) {
		t.Helper()
		a, _ := allocation(t, cli, keyspace.IPKey(name, ip))
		if a.Owner != uid || a.Pod.Name != "web-0" || a.Node != node {
			t.Errorf("%s: want owner %s (web-0) on %s, got %+v", ip, uid, node, a)
		}
	}
	// Several TTLs with both agents alive: both records stay exactly as written.
	time.Sleep(3 * ttl)
	check(oldIP, "uid-1", "node-a")
	check(newIP, "uid-2", "node-b")
	// A DEL of the old container replayed against the new pod's node releases nothing.
	if err := pl.del(ctx, confB, "web0-old", "eth0", "K8S_POD_UID=uid-1"); err != nil {
		t.Fatal(err)
	}
	check(newIP, "uid-2", "node-b")
	// The old pod leaves by its own DEL, on its own node; the new pod is untouched.
	if err := pl.del(ctx, confA, "web0-old", "eth0", "K8S_POD_UID=uid-1"); err != nil {
		t.Fatal(err)
	}
	if exists(t, cli, keyspace.IPKey(name, oldIP)) {
		t.Errorf("old web-0's %s survived its DEL", oldIP)
	}
	check(newIP, "uid-2", "node-b")
	// And a pod's address leaves otherwise only by lease expiry, when its node dies.
	nodeB.kill()
	waitFor(t, ttl+expirySlack, "the new pod's address expires with node-b", func() bool {
		return !exists(t, cli, keyspace.IPKey(name, newIP))
	})
}

// TestPartitionLongerThanTTLReclaimsAndReportsConflict: the agent loses etcd for longer than
// the TTL while its pods run. Meanwhile another node is given one of the addresses. On heal
// the agent re-claims what is free and reports the taken address as a conflict: error log,
// conflict record, CHECK code 104. Never two owners silently.
func TestPartitionLongerThanTTLReclaimsAndReportsConflict(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	px := newProxy(t, etcd.URL)
	agent := startAgent(t, px.URL, "--lease-ttl", ttl.String(), "--node", "node-p", "--node-uid", "uid-p")
	other := startAgent(t, etcd.URL, "--lease-ttl", ttl.String(), "--node", "node-q", "--node-uid", "uid-q")
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := uniq("net")
	conf := v4conf(name, agent.Socket, "10.34.0.0/24")
	p1, p2 := uniq("lh-p1-"), uniq("lh-p2-")
	sandbox(t, p1)
	sandbox(t, p2)
	ip1 := ipv4(t, pl, ctx, conf, p1, "K8S_POD_UID=uid-"+p1)
	ip2 := ipv4(t, pl, ctx, conf, p2, "K8S_POD_UID=uid-"+p2)

	px.partition()
	waitFor(t, ttl+expirySlack, "the partitioned agent's leases expire in etcd", func() bool {
		return !exists(t, cli, keyspace.IPKey(name, ip1)) && !exists(t, cli, keyspace.IPKey(name, ip2))
	})
	// Another node asks for ip1 while it is free in etcd.
	thief := ipv4(t, pl, ctx, v4conf(name, other.Socket, "10.34.0.0/24"), "thief", "K8S_POD_UID=thief;IP="+ip1.String())
	if thief != ip1 {
		t.Fatalf("other node got %s, asked for %s", thief, ip1)
	}
	px.heal()

	waitFor(t, 30*time.Second, "p2's address is re-claimed", func() bool { return exists(t, cli, keyspace.IPKey(name, ip2)) })
	if a, _ := allocation(t, cli, keyspace.IPKey(name, ip2)); a.Owner != "uid-"+p2 || a.NodeUID != "uid-p" {
		t.Errorf("re-claimed %s: %+v", ip2, a)
	}
	if a, _ := allocation(t, cli, keyspace.IPKey(name, ip1)); a.Owner != "thief" {
		t.Errorf("%s must stay with the owner that got it meanwhile, got %+v", ip1, a)
	}
	conflictKey := keyspace.ConflictKey("default", "uid-"+p1, "eth0", name)
	waitFor(t, 10*time.Second, "conflict record "+conflictKey, func() bool { return exists(t, cli, conflictKey) })
	err := pl.check(ctx, conf, p1, "eth0", "K8S_POD_UID=uid-"+p1)
	if cniCode(err) != 104 || !strings.Contains(err.Error(), "thief") {
		t.Errorf("CHECK of the conflicted pod: want code 104 naming the holder, got %v", err)
	}
	if err := pl.check(ctx, conf, p2, "eth0", "K8S_POD_UID=uid-"+p2); err != nil {
		t.Errorf("CHECK of the re-claimed pod: %v", err)
	}
	if !strings.Contains(agent.logs.String(), `"level":"ERROR","msg":"CONFLICT`) {
		t.Errorf("the conflict must be logged at error level")
	}
	// DEL of the conflicted pod releases its record, never the other owner's address.
	if err := pl.del(ctx, conf, p1, "eth0", "K8S_POD_UID=uid-"+p1); err != nil {
		t.Fatal(err)
	}
	if a, _ := allocation(t, cli, keyspace.IPKey(name, ip1)); a.Owner != "thief" {
		t.Errorf("DEL of the conflicted pod touched the other owner's %s: %+v", ip1, a)
	}
	if exists(t, cli, conflictKey) {
		t.Errorf("conflict record outlived the pod's DEL")
	}
}

// TestGCReleasesOnlyAttachmentsMissingFromTheValidList: CNI 1.1 GC with a partial list.
func TestGCReleasesOnlyAttachmentsMissingFromTheValidList(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	agent := startAgent(t, etcd.URL, "--gc-grace", "0s")
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := uniq("net")
	conf := v4conf(name, agent.Socket, "10.35.0.0/24")
	ips := map[string]netip.Addr{}
	for _, c := range []string{"keep1", "keep2", "drop1", "drop2"} {
		ips[c] = ipv4(t, pl, ctx, conf, c, "")
	}
	// Another network's attachment is never GC'd by this network's GC.
	otherName := uniq("net")
	otherIP := ipv4(t, pl, ctx, v4conf(otherName, agent.Socket, "10.36.0.0/24"), "drop1", "")

	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		t.Fatal(err)
	}
	m["cni.dev/valid-attachments"] = []map[string]string{{"containerID": "keep1", "ifname": "eth0"}, {"containerID": "keep2", "ifname": "eth0"}}
	gcConf, _ := json.Marshal(m)
	if err := execPlugin(ctx, pl, "GC", gcConf); err != nil {
		t.Fatalf("GC: %v", err)
	}
	for c, ip := range ips {
		want := strings.HasPrefix(c, "keep")
		if got := exists(t, cli, keyspace.IPKey(name, ip)); got != want {
			t.Errorf("after GC, %s (%s) present=%v, want %v", c, ip, got, want)
		}
	}
	if !exists(t, cli, keyspace.IPKey(otherName, otherIP)) {
		t.Errorf("GC of %s released an attachment of network %s", name, otherName)
	}
}

// TestStatus: cheap, and error 50 when the pool is exhausted or the agent is unreachable.
func TestStatus(t *testing.T) {
	etcd := startEtcdProcess(t)
	agent := startAgent(t, etcd.URL)
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conf := v4conf(uniq("net"), agent.Socket, "10.37.0.0/30") // one usable address
	if err := execPlugin(ctx, pl, "STATUS", conf); err != nil {
		t.Fatalf("STATUS with a free address: %v", err)
	}
	ipv4(t, pl, ctx, conf, "only", "")
	if err := execPlugin(ctx, pl, "STATUS", conf); cniCode(err) != 50 {
		t.Errorf("STATUS of an exhausted pool: want code 50, got %v", err)
	}
	agent.stop()
	if err := execPlugin(ctx, pl, "STATUS", conf); cniCode(err) != 50 {
		t.Errorf("STATUS without an agent: want code 50, got %v", err)
	}
}

func execPlugin(ctx context.Context, pl plugin, cmd string, conf []byte) error {
	return invokeWithoutResult(ctx, pl, cmd, conf)
}

// TestAgentDownLongerThanTTLReclaimsFromJournal: the agent is away longer than the TTL, so
// etcd expired its pods' keys while the pods kept running. The restarted agent re-claims them
// from its local journal; the pod whose sandbox died meanwhile is not re-claimed.
func TestAgentDownLongerThanTTLReclaimsFromJournal(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	agent := startAgent(t, etcd.URL, "--lease-ttl", ttl.String())
	pl := newPlugin(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := uniq("net")
	conf := v4conf(name, agent.Socket, "10.38.0.0/24")
	live, gone := uniq("lh-jl-"), uniq("lh-jg-")
	sandbox(t, live)
	sandbox(t, gone)
	liveIP := ipv4(t, pl, ctx, conf, live, "K8S_POD_UID=uid-"+live)
	goneIP := ipv4(t, pl, ctx, conf, gone, "K8S_POD_UID=uid-"+gone)
	// The journal is written every 50 ms, off the ADD path: a crash inside that window
	// followed by an outage past the TTL is the one case it misses (ARCHITECTURE.md).
	time.Sleep(200 * time.Millisecond)
	agent.kill()
	waitFor(t, ttl+expirySlack, "the pods' keys expire while the agent is down", func() bool {
		return !exists(t, cli, keyspace.IPKey(name, liveIP)) && !exists(t, cli, keyspace.IPKey(name, goneIP))
	})
	removeSandbox(t, gone)
	agent.restart(t)
	waitFor(t, 15*time.Second, "the live pod's address is re-claimed", func() bool { return exists(t, cli, keyspace.IPKey(name, liveIP)) })
	if err := pl.check(ctx, conf, live, "eth0", "K8S_POD_UID=uid-"+live); err != nil {
		t.Errorf("CHECK after re-claim: %v", err)
	}
	time.Sleep(time.Second)
	if exists(t, cli, keyspace.IPKey(name, goneIP)) {
		t.Errorf("the address of a sandbox that died while the agent was down was re-claimed")
	}
}

// TestAgentKilledDuringABurst: kill -9 in the middle of a burst of ADDs, then a restart.
// Every ADD answered (addresses or a CNI error), every success keeps its addresses after the
// restart (its lease is resumed), no address has two owners, and the runtime's retries of
// the failed ADDs succeed.
func TestAgentKilledDuringABurst(t *testing.T) {
	etcd := startEtcdProcess(t)
	cli := etcdClient(t, etcd.URL)
	agent := startAgent(t, etcd.URL, "--lease-ttl", ttl.String())
	pl := newPlugin(t)
	name := uniq("net")
	conf := v4conf(name, agent.Socket, "10.40.0.0/24")
	prefix := uniq("lhk")
	const n = 40
	for i := range n {
		sandbox(t, fmt.Sprintf("%s-%02d", prefix, i))
	}
	type outcome struct {
		ip  netip.Addr
		err error
	}
	results := make([]outcome, n)
	done := make(chan struct{})
	go func() {
		for i := range n {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			ctr := fmt.Sprintf("%s-%02d", prefix, i)
			res, err := pl.add(ctx, conf, ctr, "eth0", "K8S_POD_UID=uid-"+ctr)
			cancel()
			if err == nil {
				results[i].ip, _ = netip.AddrFromSlice(res.IPs[0].Address.IP.To4())
			}
			results[i].err = err
		}
		close(done)
	}()
	time.Sleep(150 * time.Millisecond) // some ADDs done, others in flight
	agent.kill()
	time.Sleep(500 * time.Millisecond)
	agent.restart(t)
	<-done
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ok, failed := 0, 0
	for i, r := range results {
		if r.err != nil {
			failed++
			if cniCode(r.err) == 0 {
				t.Errorf("ADD %d failed without a CNI error: %v", i, r.err)
			}
			ctr := fmt.Sprintf("%s-%02d", prefix, i)
			if _, err := pl.add(ctx, conf, ctr, "eth0", "K8S_POD_UID=uid-"+ctr); err != nil {
				t.Errorf("retry of ADD %d after the restart: %v", i, err)
			}
			continue
		}
		ok++
	}
	t.Logf("kill -9 during the burst: %d ADDs succeeded, %d failed and were retried", ok, failed)
	// Several TTLs later, every success still holds its address on a renewed lease.
	time.Sleep(2 * ttl)
	seen := map[netip.Addr]int{}
	for i, r := range results {
		if r.err != nil {
			continue
		}
		if j, dup := seen[r.ip]; dup {
			t.Errorf("%s given to ADDs %d and %d", r.ip, j, i)
		}
		seen[r.ip] = i
		if a, _ := allocation(t, cli, keyspace.IPKey(name, r.ip)); a.Owner != fmt.Sprintf("uid-%s-%02d", prefix, i) {
			t.Errorf("ADD %d's %s is held by %q after the restart", i, r.ip, a.Owner)
		}
	}
	checkInvariants(t, cli, name, n, 1)
}
