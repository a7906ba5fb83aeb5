package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// Lifecycle tests use 4 s leases: long enough for keep-alive (every TTL/3) on a loaded
// 2-core machine, short enough to watch expiry happen. How soon etcd then deletes the keys
// (its leader looks every 500 ms, revokes in rate-limited batches, later on a busy machine)
// is not asserted: the tests wait for it (eventually).
const ttl = 4 * time.Second

func exists(t testing.TB, cli *clientv3.Client, key string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	resp, err := cli.Get(ctx, key, clientv3.WithCountOnly())
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return resp.Count > 0
}

func allocation(t testing.TB, cli *clientv3.Client, key string) (keyspace.Allocation, int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
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

func v4conf(name, socket, subnet string) []byte {
	return netconf(name, socket, map[string]any{"ranges": []any{[]any{map[string]any{"subnet": subnet}}}})
}

// TestAgentKilledAndRestartedAdoptsLiveSandboxes: kill -9, restart within the TTL. The live
// pod keeps its address beyond several TTLs (the new process renews the same lease); the pod
// whose netns vanished meanwhile is released at start.
func TestAgentKilledAndRestartedAdoptsLiveSandboxes(t *testing.T) {
	f := newFixture(t, withShortLeases(), withNetns())
	agent := f.Agent
	conf := v4conf(f.Pool, agent.Socket, "10.30.0.0/24")
	live, gone := f.sandbox("lh-live-"), f.sandbox("lh-gone-")
	liveIP := f.ipv4(conf, live, "K8S_POD_UID=uid-"+live)
	goneIP := f.ipv4(conf, gone, "K8S_POD_UID=uid-"+gone)
	_, liveLease := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, liveIP))

	agent.kill()
	removeSandbox(t, gone) // the sandbox dies while the agent is down
	agent.restart(t)

	eventually(t, "the gone sandbox's address is released at restart", func() error {
		return saw(!exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, goneIP)), "%s is still there", keyspace.IPKey(f.Pool, allocator.DefaultBlocks, goneIP))
	})
	time.Sleep(3 * ttl) // no condition to poll: the test is that several TTLs pass and the address stays
	holder, lease := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, liveIP))
	if holder.Owner != "uid-"+live || lease != liveLease {
		t.Errorf("live pod's address: owner %s lease %x, want owner uid-%s on its original lease %x", holder.Owner, lease, live, liveLease)
	}
	if err := f.check(conf, live, "eth0", "K8S_POD_UID=uid-"+live); err != nil {
		t.Errorf("CHECK of the live pod after the restart: %v", err)
	}
}

// TestDeadNodeAllocationsExpireWithoutAnyoneActing: kill -9 and no restart. Every key of the
// node is on a lease of the TTL, and disappears with it, no sooner, with no other component
// running.
func TestDeadNodeAllocationsExpireWithoutAnyoneActing(t *testing.T) {
	f := newFixture(t, withShortLeases())
	conf := v4conf(f.Pool, f.Agent.Socket, "10.31.0.0/24")
	for i := range 5 {
		f.ipv4(conf, fmt.Sprintf("dead%d", i), "")
	}
	if n := len(keysUnder(snapshot(t, f.Cli, keyspace.Prefix), keyspace.IPsPrefix(f.Pool))); n != 5 {
		t.Fatalf("want 5 allocations before the kill, got %d", n)
	}
	// The keys go with leases of the TTL: how soon etcd gets to expire them on a busy machine
	// is etcd's, so the test checks the leases and then waits for the outcome.
	for _, prefix := range []string{keyspace.IPsPrefix(f.Pool), keyspace.NodesPrefix(f.Cluster), keyspace.OwnersPrefix(f.Cluster)} {
		resp, err := f.Cli.Get(f.Ctx, prefix, clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		for _, kv := range resp.Kvs {
			l, err := f.Cli.TimeToLive(f.Ctx, clientv3.LeaseID(kv.Lease))
			if err != nil || l.GrantedTTL != int64(ttl.Seconds()) {
				t.Errorf("key %s is on lease %x (%+v, %v), not on one of the %s TTL", kv.Key, kv.Lease, l, err, ttl)
			}
		}
	}
	f.Agent.kill()
	killed := time.Now()
	took := eventually(t, "every key of the dead node expires", func() error {
		s := snapshot(t, f.Cli, keyspace.Prefix)
		left := append(append(keysUnder(s, keyspace.IPsPrefix(f.Pool)), keysUnder(s, keyspace.NodesPrefix(f.Cluster))...),
			keysUnder(s, keyspace.OwnersPrefix(f.Cluster))...)
		return saw(len(left) == 0, "keys left: %v", left)
	})
	t.Logf("dead node's keys gone %s after kill -9 (TTL %s)", took.Round(100*time.Millisecond), ttl)
	if time.Since(killed) < ttl-time.Second {
		t.Errorf("keys vanished after %s, before the %s TTL: something other than expiry removed them", time.Since(killed), ttl)
	}
}

// TestSameNameReplacementNeverAdopts reproduces the same-name replacement
// (docs/field-failures.md, the Azure CNS report): a node replaced under the same name while
// the old node's state is still in the store. Here the new agent
// (same name, new identity) never adopts, renews or releases the old node's allocations;
// they expire on their leases; the new node allocates correctly from the same range at once.
func TestSameNameReplacementNeverAdopts(t *testing.T) {
	f := newFixture(t, withShortLeases(), withoutAgent(), withNetns())
	old := f.startAgent("--node", "node-x", "--node-uid", "machine-1.boot-1")
	subnet := "10.32.0.0/29" // 5 usable addresses: the old node's two and the new node's must not collide
	oldConf := v4conf(f.Pool, old.Socket, subnet)
	static := f.sandbox("lh-static-")
	oldIPs := map[netip.Addr]string{}
	oldIPs[f.ipv4(oldConf, static, "K8S_POD_UID=static-pod-uid")] = "static-pod-uid"
	oldIPs[f.ipv4(oldConf, "old-ctr", "K8S_POD_UID=old-pod-uid")] = "old-pod-uid"

	old.kill() // the machine is gone; its leases still run
	repl := f.startAgent("--node", "node-x", "--node-uid", "machine-2.boot-1")
	conf := v4conf(f.Pool, repl.Socket, subnet)

	// The new node allocates from the same range right away, never an address the old node's pods hold.
	fresh := f.ipv4(conf, "new-ctr", "K8S_POD_UID=new-pod-uid")
	if _, clash := oldIPs[fresh]; clash {
		t.Fatalf("new node was given %s, still held by the old node's pod %s", fresh, oldIPs[fresh])
	}
	// A static pod has the same UID on the replacement: its old keys are not adopted.
	_, err := f.add(conf, "static-ctr-2", "eth0", "K8S_POD_UID=static-pod-uid")
	if cniCode(err) != 11 || !strings.Contains(err.Error(), "never adopts") {
		t.Errorf("ADD for an owner the old identity holds: want code 11 explaining it is never adopted, got %v", err)
	}
	// A DEL replayed on the new node for the old node's container releases nothing.
	if err := f.del(conf, "old-ctr", "eth0", "K8S_POD_UID=old-pod-uid"); err != nil {
		t.Errorf("DEL: %v", err)
	}
	for ip, owner := range oldIPs {
		if a, _ := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip)); a.Owner != owner || a.NodeUID != "machine-1.boot-1" {
			t.Errorf("old allocation %s changed hands before expiry: %+v", ip, a)
		}
	}
	// The old allocations leave by expiry, the new one stays.
	eventually(t, "the old node's allocations expire", func() error {
		for ip := range oldIPs {
			if exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip)) {
				return fmt.Errorf("%s is still allocated", ip)
			}
		}
		return nil
	})
	if a, _ := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, fresh)); a.Owner != "new-pod-uid" || a.NodeUID != "machine-2.boot-1" {
		t.Errorf("new node's allocation: %+v", a)
	}
	// Once the old keys are gone, the static pod gets an address on the new node.
	if _, err := f.add(conf, "static-ctr-2", "eth0", "K8S_POD_UID=static-pod-uid"); err != nil {
		t.Errorf("static pod ADD after the old keys expired: %v", err)
	}
	if !strings.Contains(repl.logs.String(), `"other_identities_left_to_expire":2`) {
		t.Errorf("replacement agent should report the old identity's two pod records as left to expire:\n%s", repl.logs.String())
	}
}

// TestReconcilerRaceStatefulSetReplacementKeepsBothOwners reproduces the reconciler race
// (docs/field-failures.md, the whereabouts report): a StatefulSet pod is replaced (same
// name, new UID, another node) while the old allocation still lives. Nothing frees the new pod's address, ever; the old one leaves only by DEL or
// by lease expiry. There is no reconciler that could look at a pod without an IP yet.
func TestReconcilerRaceStatefulSetReplacementKeepsBothOwners(t *testing.T) {
	f := newFixture(t, withShortLeases(), withAgents(2))
	nodeA, nodeB := f.Agents[0], f.Agents[1]
	confA, confB := v4conf(f.Pool, nodeA.Socket, "10.33.0.0/24"), v4conf(f.Pool, nodeB.Socket, "10.33.0.0/24")
	oldIP := f.ipv4(confA, "web0-old", "K8S_POD_UID=uid-1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0")
	newIP := f.ipv4(confB, "web0-new", "K8S_POD_UID=uid-2;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0")
	if oldIP == newIP {
		t.Fatalf("old and new web-0 share %s", oldIP)
	}
	check := func(ip netip.Addr, uid, node string) {
		t.Helper()
		a, _ := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip))
		if a.Owner != uid || a.Pod.Name != "web-0" || a.Node != node {
			t.Errorf("%s: want owner %s (web-0) on %s, got %+v", ip, uid, node, a)
		}
	}
	// Several TTLs with both agents alive: both records stay exactly as written.
	time.Sleep(3 * ttl) // no condition to poll: the test is that several TTLs pass and nothing changes
	check(oldIP, "uid-1", nodeA.Node)
	check(newIP, "uid-2", nodeB.Node)
	// A DEL of the old container replayed against the new pod's node releases nothing.
	if err := f.del(confB, "web0-old", "eth0", "K8S_POD_UID=uid-1"); err != nil {
		t.Fatal(err)
	}
	check(newIP, "uid-2", nodeB.Node)
	// The old pod leaves by its own DEL, on its own node; the new pod is untouched.
	if err := f.del(confA, "web0-old", "eth0", "K8S_POD_UID=uid-1"); err != nil {
		t.Fatal(err)
	}
	if exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, oldIP)) {
		t.Errorf("old web-0's %s survived its DEL", oldIP)
	}
	check(newIP, "uid-2", nodeB.Node)
	// And a pod's address leaves otherwise only by lease expiry, when its node dies.
	nodeB.kill()
	eventually(t, "the new pod's address expires with its node", func() error {
		return saw(!exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, newIP)), "%s is still there", keyspace.IPKey(f.Pool, allocator.DefaultBlocks, newIP))
	})
}

// TestPartitionLongerThanTTLReclaimsAndReportsConflict: the agent loses etcd for longer than
// the TTL while its pods run. Meanwhile another node is given one of the addresses. On heal
// the agent re-claims what is free and reports the taken address as a conflict: error log,
// conflict record, CHECK code 104. Never two owners silently.
func TestPartitionLongerThanTTLReclaimsAndReportsConflict(t *testing.T) {
	f := newFixture(t, withShortLeases(), withoutAgent(), withNetns())
	px := newProxy(t, f.Endpoint)
	agent := f.startAgent("--etcd-endpoints", px.URL) // reaches etcd through the proxy only
	other := f.startAgent()
	conf := v4conf(f.Pool, agent.Socket, "10.34.0.0/24")
	p1, p2 := f.sandbox("lh-p1-"), f.sandbox("lh-p2-")
	ip1 := f.ipv4(conf, p1, "K8S_POD_UID=uid-"+p1)
	ip2 := f.ipv4(conf, p2, "K8S_POD_UID=uid-"+p2)

	px.partition()
	eventually(t, "the partitioned agent's leases expire in etcd", func() error {
		one, two := exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip1)), exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip2))
		return saw(!one && !two, "%s allocated %v, %s allocated %v", ip1, one, ip2, two)
	})
	// Another node asks for ip1 while it is free in etcd.
	thief := f.ipv4(v4conf(f.Pool, other.Socket, "10.34.0.0/24"), "thief", "K8S_POD_UID=thief;IP="+ip1.String())
	if thief != ip1 {
		t.Fatalf("other node got %s, asked for %s", thief, ip1)
	}
	px.heal()

	eventually(t, "p2's address is re-claimed", func() error {
		return saw(exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip2)), "no key %s", keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip2))
	})
	if a, _ := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip2)); a.Owner != "uid-"+p2 || a.NodeUID != agent.NodeUID {
		t.Errorf("re-claimed %s: %+v", ip2, a)
	}
	if a, _ := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip1)); a.Owner != "thief" {
		t.Errorf("%s must stay with the owner that got it meanwhile, got %+v", ip1, a)
	}
	conflictKey := keyspace.ConflictKey(f.Cluster, "uid-"+p1, "eth0", f.Pool)
	// The agent logs the conflict once it has read the answer of the claim that wrote the
	// record: wait for the log line too.
	const conflictLogged = `"level":"ERROR","msg":"CONFLICT`
	eventually(t, "conflict record "+conflictKey, func() error {
		recorded, logged := exists(t, f.Cli, conflictKey), strings.Contains(agent.logs.String(), conflictLogged)
		return saw(recorded && logged, "key %s present %v; the conflict logged at error level %v", conflictKey, recorded, logged)
	})
	err := f.check(conf, p1, "eth0", "K8S_POD_UID=uid-"+p1)
	if cniCode(err) != 104 || !strings.Contains(err.Error(), "thief") {
		t.Errorf("CHECK of the conflicted pod: want code 104 naming the holder, got %v", err)
	}
	if err := f.check(conf, p2, "eth0", "K8S_POD_UID=uid-"+p2); err != nil {
		t.Errorf("CHECK of the re-claimed pod: %v", err)
	}
	// DEL of the conflicted pod releases its record, never the other owner's address.
	if err := f.del(conf, p1, "eth0", "K8S_POD_UID=uid-"+p1); err != nil {
		t.Fatal(err)
	}
	if a, _ := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip1)); a.Owner != "thief" {
		t.Errorf("DEL of the conflicted pod touched the other owner's %s: %+v", ip1, a)
	}
	if exists(t, f.Cli, conflictKey) {
		t.Errorf("conflict record outlived the pod's DEL")
	}
}

// TestGCReleasesOnlyAttachmentsMissingFromTheValidList: CNI 1.1 GC with a partial list.
func TestGCReleasesOnlyAttachmentsMissingFromTheValidList(t *testing.T) {
	f := newFixture(t, withAgentFlags("--gc-grace", "0s"))
	conf := v4conf(f.Pool, f.Agent.Socket, "10.35.0.0/24")
	ips := map[string]netip.Addr{}
	for _, c := range []string{"keep1", "keep2", "drop1", "drop2"} {
		ips[c] = f.ipv4(conf, c, "")
	}
	// Another network's attachment is never GC'd by this network's GC.
	otherName := uniq("net")
	otherIP := f.ipv4(v4conf(otherName, f.Agent.Socket, "10.36.0.0/24"), "drop1", "")

	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		t.Fatal(err)
	}
	m["cni.dev/valid-attachments"] = []map[string]string{{"containerID": "keep1", "ifname": "eth0"}, {"containerID": "keep2", "ifname": "eth0"}}
	gcConf, _ := json.Marshal(m)
	if err := f.run("GC", gcConf); err != nil {
		t.Fatalf("GC: %v", err)
	}
	for c, ip := range ips {
		want := strings.HasPrefix(c, "keep")
		if got := exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip)); got != want {
			t.Errorf("after GC, %s (%s) present=%v, want %v", c, ip, got, want)
		}
	}
	if !exists(t, f.Cli, keyspace.IPKey(otherName, allocator.DefaultBlocks, otherIP)) {
		t.Errorf("GC of %s released an attachment of network %s", f.Pool, otherName)
	}
}

// TestStatus: cheap, and error 50 when the pool is exhausted or the agent is unreachable.
func TestStatus(t *testing.T) {
	f := newFixture(t)
	conf := v4conf(f.Pool, f.Agent.Socket, "10.37.0.0/30") // one usable address
	if err := f.run("STATUS", conf); err != nil {
		t.Fatalf("STATUS with a free address: %v", err)
	}
	f.ipv4(conf, "only", "")
	if err := f.run("STATUS", conf); cniCode(err) != 50 {
		t.Errorf("STATUS of an exhausted pool: want code 50, got %v", err)
	}
	f.Agent.stop()
	if err := f.run("STATUS", conf); cniCode(err) != 50 {
		t.Errorf("STATUS without an agent: want code 50, got %v", err)
	}
}

// TestAgentDownLongerThanTTLReclaimsFromJournal: the agent is away longer than the TTL, so
// etcd expired its pods' keys while the pods kept running. The restarted agent re-claims them
// from its local journal; the pod whose sandbox died meanwhile is not re-claimed.
func TestAgentDownLongerThanTTLReclaimsFromJournal(t *testing.T) {
	f := newFixture(t, withShortLeases(), withNetns())
	agent := f.Agent
	conf := v4conf(f.Pool, agent.Socket, "10.38.0.0/24")
	live, gone := f.sandbox("lh-jl-"), f.sandbox("lh-jg-")
	liveIP := f.ipv4(conf, live, "K8S_POD_UID=uid-"+live)
	goneIP := f.ipv4(conf, gone, "K8S_POD_UID=uid-"+gone)
	// An ADD answers once the journal holds the pod (ARCHITECTURE.md, "Journal"): a kill -9
	// right after the answer, followed by an outage past the TTL, loses nothing.
	if j := agent.journaled(t); !j["uid-"+live] || !j["uid-"+gone] {
		t.Fatalf("ADDs answered, but the journal holds %v", j)
	}
	agent.kill()
	eventually(t, "the pods' keys expire while the agent is down", func() error {
		l, g := exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, liveIP)), exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, goneIP))
		return saw(!l && !g, "%s allocated %v, %s allocated %v", liveIP, l, goneIP, g)
	})
	removeSandbox(t, gone)
	agent.restart(t)
	eventually(t, "the live pod's address is re-claimed", func() error {
		return saw(exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, liveIP)), "no key %s", keyspace.IPKey(f.Pool, allocator.DefaultBlocks, liveIP))
	})
	if err := f.check(conf, live, "eth0", "K8S_POD_UID=uid-"+live); err != nil {
		t.Errorf("CHECK after re-claim: %v", err)
	}
	// The restarted agent forgets the pod whose sandbox died instead of re-claiming it.
	eventually(t, "the dead sandbox's pod leaves the journal", func() error {
		j := agent.journaled(t)
		return saw(j["uid-"+live] && !j["uid-"+gone], "the journal lists %v", j)
	})
	if exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, goneIP)) {
		t.Errorf("the address of a sandbox that died while the agent was down was re-claimed")
	}
}

// TestAgentKilledDuringABurst: kill -9 in the middle of a burst of ADDs, then a restart.
// Every ADD answered (addresses or a CNI error), every success keeps its addresses after the
// restart (its lease is resumed), no address has two owners, and the runtime's retries of
// the failed ADDs succeed.
func TestAgentKilledDuringABurst(t *testing.T) {
	f := newFixture(t, withShortLeases(), withNetns())
	agent := f.Agent
	conf := v4conf(f.Pool, agent.Socket, "10.40.0.0/24")
	prefix := ccUniq("lhk")
	const n = 40
	for i := range n {
		sandbox(t, fmt.Sprintf("%s-%02d", prefix, i))
	}
	type outcome struct {
		ip  netip.Addr
		err error
	}
	results := make([]outcome, n)
	var answered, failures atomic.Int32 // read while the burst runs; results only after done
	done := make(chan struct{})
	go func() {
		for i := range n {
			ctx, cancel := context.WithTimeout(f.Ctx, etcdtest.Patience)
			ctr := fmt.Sprintf("%s-%02d", prefix, i)
			res, err := f.pl.add(ctx, conf, ctr, "eth0", "K8S_POD_UID=uid-"+ctr)
			cancel()
			if err == nil {
				results[i].ip, _ = netip.AddrFromSlice(res.IPs[0].Address.IP.To4())
			} else {
				failures.Add(1)
			}
			results[i].err = err
			answered.Add(1)
		}
		close(done)
	}()
	eventually(t, "the burst's first ADDs are answered", func() error { // others still to come
		n := answered.Load()
		return saw(n >= 5, "%d answered", n)
	})
	agent.kill()
	failedBefore := failures.Load()
	eventually(t, "the burst meets the dead agent", func() error {
		n := failures.Load()
		return saw(n > failedBefore, "%d failed", n)
	})
	agent.restart(t)
	<-done
	ok, failed := 0, 0
	for i, r := range results {
		if r.err != nil {
			failed++
			if cniCode(r.err) == 0 {
				t.Errorf("ADD %d failed without a CNI error: %v", i, r.err)
			}
			ctr := fmt.Sprintf("%s-%02d", prefix, i)
			if _, err := f.add(conf, ctr, "eth0", "K8S_POD_UID=uid-"+ctr); err != nil {
				t.Errorf("retry of ADD %d after the restart: %v", i, err)
			}
			continue
		}
		ok++
	}
	t.Logf("kill -9 during the burst: %d ADDs succeeded, %d failed and were retried", ok, failed)
	// Several TTLs later, every success still holds its address on a renewed lease.
	time.Sleep(2 * ttl) // no condition to poll: the test is that several TTLs pass and every success keeps its address
	seen := map[netip.Addr]int{}
	for i, r := range results {
		if r.err != nil {
			continue
		}
		if j, dup := seen[r.ip]; dup {
			t.Errorf("%s given to ADDs %d and %d", r.ip, j, i)
		}
		seen[r.ip] = i
		if a, _ := allocation(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, r.ip)); a.Owner != fmt.Sprintf("uid-%s-%02d", prefix, i) {
			t.Errorf("ADD %d's %s is held by %q after the restart", i, r.ip, a.Owner)
		}
	}
	checkInvariants(t, f.Cli, f.Pool, n, 1)
}
