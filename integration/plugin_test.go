package integration

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// TestConcurrentPluginAddsGetDistinctAddresses is issue 2's acceptance test: 200 ADDs at
// once through the real plugin binary, against leaseholdd and etcd as separate processes.
func TestConcurrentPluginAddsGetDistinctAddresses(t *testing.T) {
	f := newFixture(t)
	name := f.Pool
	conf := netconf(name, f.Agent.Socket, dualStackIPAM("10.20.0.0/23", "fd20::/64"))

	const n = 200
	type got struct {
		v4, v6 netip.Addr
		err    error
	}
	results := make([]got, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 50) // 50 runtimes' worth of concurrent execs
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			res, err := f.add(conf, fmt.Sprintf("ctr%03d", i), "eth0", fmt.Sprintf("K8S_POD_UID=uid-%03d;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p%03d", i, i))
			if err != nil {
				results[i].err = err
				return
			}
			for _, ip := range res.IPs {
				if ip.Address.IP.To4() != nil {
					results[i].v4, _ = netip.AddrFromSlice(ip.Address.IP.To4())
				} else {
					results[i].v6, _ = netip.AddrFromSlice(ip.Address.IP)
				}
			}
		})
	}
	wg.Wait()
	v4s, v6s := map[netip.Addr]int{}, map[netip.Addr]int{}
	for i, r := range results {
		if r.err != nil {
			t.Fatalf("ADD %d: %v", i, r.err)
		}
		if !r.v4.IsValid() || !r.v6.IsValid() {
			t.Fatalf("ADD %d: want one IPv4 and one IPv6 address, got %v %v", i, r.v4, r.v6)
		}
		if j, dup := v4s[r.v4]; dup {
			t.Errorf("IPv4 %s handed to containers %d and %d", r.v4, j, i)
		}
		if j, dup := v6s[r.v6]; dup {
			t.Errorf("IPv6 %s handed to containers %d and %d", r.v6, j, i)
		}
		v4s[r.v4], v6s[r.v6] = i, i
	}
	if len(v4s) != n || len(v6s) != n {
		t.Errorf("want %d distinct addresses per family, got %d IPv4 and %d IPv6", n, len(v4s), len(v6s))
	}

	// Every allocation, owner index and pod record in etcd is bound to a lease.
	keys := snapshot(t, f.Cli, keyspace.Prefix)
	if got := len(keysUnder(keys, keyspace.IPsPrefix(name))); got != 2*n {
		t.Errorf("want %d allocation keys in etcd, got %d", 2*n, got)
	}
	for k, v := range keys {
		if strings.HasPrefix(k, keyspace.PoolKey("")) {
			continue
		}
		if strings.HasPrefix(v, "lease=0 ") {
			t.Errorf("key %s carries no lease", k)
		}
	}

	// A repeated ADD returns the same addresses.
	again, err := f.add(conf, "ctr007", "eth0", "K8S_POD_UID=uid-007;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p007")
	if err != nil {
		t.Fatal(err)
	}
	for _, ip := range again.IPs {
		a, _ := netip.AddrFromSlice(ip.Address.IP)
		a = a.Unmap()
		if a != results[7].v4 && a != results[7].v6 {
			t.Errorf("repeated ADD returned %s, first ADD returned %s and %s", a, results[7].v4, results[7].v6)
		}
	}
	if err := f.check(conf, "ctr007", "eth0", "K8S_POD_UID=uid-007"); err != nil {
		t.Errorf("CHECK: %v", err)
	}

	// DEL frees exactly the owner's keys: its two addresses and their held keys, owner index
	// and pod record.
	before := snapshot(t, f.Cli, keyspace.Prefix)
	if err := f.del(conf, "ctr007", "eth0", "K8S_POD_UID=uid-007"); err != nil {
		t.Fatal(err)
	}
	after := snapshot(t, f.Cli, keyspace.Prefix)
	var gone []string
	for k := range before {
		if _, ok := after[k]; !ok {
			gone = append(gone, k)
		}
	}
	want := []string{
		keyspace.IPKey(name, allocator.DefaultBlocks, results[7].v4), keyspace.IPKey(name, allocator.DefaultBlocks, results[7].v6),
		keyspace.OwnerKey(f.Cluster, "uid-007", "eth0", name), keyspace.PodKey(f.Cluster, f.Agent.Node, "uid-007"),
		keyspace.HeldKey(name, allocator.DefaultBlocks, results[7].v4), keyspace.HeldKey(name, allocator.DefaultBlocks, results[7].v6),
	}
	if fmt.Sprint(sorted(gone)) != fmt.Sprint(sorted(want)) {
		t.Errorf("DEL removed %v, want exactly %v", sorted(gone), sorted(want))
	}
	if len(after) != len(before)-len(want) {
		t.Errorf("DEL changed the key count from %d to %d, want %d", len(before), len(after), len(before)-len(want))
	}
	if err := f.del(conf, "ctr007", "eth0", "K8S_POD_UID=uid-007"); err != nil {
		t.Errorf("repeated DEL must succeed: %v", err)
	}
}

// TestRefusedRequestsThroughThePlugin: bad input gets a CNI error with the right code and a
// message a user can act on, and etcd is left unchanged.
func TestRefusedRequestsThroughThePlugin(t *testing.T) {
	f := newFixture(t)
	agent, name := f.Agent, f.Pool
	good := netconf(name, agent.Socket, dualStackIPAM("10.21.0.0/24", "fd21::/64"))
	held, err := f.add(good, "holder", "eth0", "")
	if err != nil {
		t.Fatal(err)
	}
	heldV4 := held.IPs[0].Address.IP.String()
	before := snapshot(t, f.Cli, keyspace.Prefix)

	cases := []struct {
		name      string
		conf      []byte
		container string
		cniArgs   string
		code      uint
		mention   string
	}{
		// Not JSON at all.
		{"malformed json", []byte(`{"cniVersion":"1.1.0","name":`), "x1", "", 6, ""},
		// A typo in an ipam field must not be silently ignored.
		{"unknown ipam field", netconf(name, agent.Socket, map[string]any{"rangez": []any{}}), "x2", "", 7, "rangez"},
		// ranges of the wrong JSON type.
		{"wrong type", netconf(name, agent.Socket, map[string]any{"ranges": "10.0.0.0/8"}), "x3", "", 7, "ranges"},
		// Not a CIDR.
		{"invalid cidr", netconf(name, agent.Socket, map[string]any{"ranges": []any{[]any{map[string]any{"subnet": "10.300.0.0/16"}}}}), "x4", "", 7, "10.300.0.0/16"},
		// rangeStart outside its subnet.
		{"rangeStart outside", netconf(uniq("net"), agent.Socket, map[string]any{"ranges": []any{[]any{map[string]any{"subnet": "10.22.0.0/24", "rangeStart": "10.23.0.5"}}}}), "x5", "", 7, "10.23.0.5"},
		// Two range sets sharing addresses.
		{"overlapping ranges", netconf(uniq("net"), agent.Socket, dualStackIPAM("10.24.0.0/16", "10.24.1.0/24")), "x6", "", 7, "overlap"},
		// The requested address lies in no range.
		{"requested outside", good, "x7", "IP=192.168.77.7", 100, "192.168.77.7"},
		// The requested address belongs to another owner.
		{"requested taken", good, "x8", "IP=" + heldV4, 101, heldV4},
		// A container ID that would become a path outside its key: CNI_CONTAINERID is an
		// environment variable, so the code is 4 (invalid environment variables).
		{"hostile container id", good, "../../etc", "", 4, "../../etc"},
		// A pod UID that would escape its key component.
		{"hostile pod uid", good, "x10", "K8S_POD_UID=a/../../b", 7, "a/../../b"},
		// Same pool name, other ranges: refused, showing both definitions.
		{"pool mismatch", netconf(name, agent.Socket, dualStackIPAM("10.25.0.0/24", "fd21::/64")), "x9", "", 7, "10.21.0.0/24"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := f.add(tc.conf, tc.container, "eth0", tc.cniArgs)
			if err == nil {
				t.Fatal("ADD succeeded, want an error")
			}
			if got := cniCode(err); got != tc.code {
				t.Errorf("CNI code %d, want %d (error: %v)", got, tc.code, err)
			}
			if tc.mention != "" && !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("error should mention %q: %v", tc.mention, err)
			}
		})
	}
	after := snapshot(t, f.Cli, keyspace.Prefix)
	// The one write a refused request makes: the pool mismatch leaves a report for the pool's
	// other users under poolconflicts/, on the node lease. No allocation state changes.
	for k := range after {
		if strings.HasPrefix(k, keyspace.PoolConflictsPrefix("")) {
			delete(after, k)
		}
	}
	if fmt.Sprint(after) != fmt.Sprint(before) {
		for k, v := range after {
			if before[k] != v {
				t.Errorf("refused requests changed %s: %q -> %q", k, before[k], v)
			}
		}
		for k := range before {
			if _, ok := after[k]; !ok {
				t.Errorf("refused requests deleted %s", k)
			}
		}
	}
}

// TestAgentUnreachable: the plugin fails with a CNI error that says so and names the socket.
func TestAgentUnreachable(t *testing.T) {
	f := newFixture(t, withoutEtcd())
	sock := filepath.Join(t.TempDir(), "nobody.sock")
	_, err := f.add(netconf("n", sock, dualStackIPAM("10.26.0.0/24", "fd26::/64")), "c1", "eth0", "")
	if err == nil {
		t.Fatal("ADD without an agent succeeded")
	}
	if cniCode(err) != 11 || !strings.Contains(err.Error(), sock) {
		t.Errorf("want code 11 (try again later) naming %s, got code %d: %v", sock, cniCode(err), err)
	}
}

// TestEmbeddedEtcdIsInspectableWithEtcdctl: leaseholdd --embedded-etcd serves its client URL
// on loopback, and plain etcdctl reads the allocations the plugin made.
func TestEmbeddedEtcdIsInspectableWithEtcdctl(t *testing.T) {
	f := newFixture(t, withAgentEmbeddedEtcd())
	name := f.Pool
	res, err := f.add(netconf(name, f.Agent.Socket, dualStackIPAM("10.27.0.0/24", "fd27::/64")), "c1", "eth0", "K8S_POD_UID=pod-1")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(f.Ctx, filepath.Join(binDir(t), "etcdctl"), "--endpoints", f.Endpoint,
		"get", "--prefix", keyspace.IPsPrefix(name), "--keys-only").CombinedOutput()
	if err != nil {
		t.Fatalf("etcdctl: %v\n%s", err, out)
	}
	keys := strings.Fields(string(out))
	for _, ip := range res.IPs {
		// The pool's layout (flat, or blocks: ips/<pool>/<block>/<ip>) is the agent's choice.
		if !slices.ContainsFunc(keys, func(k string) bool {
			return strings.HasPrefix(k, keyspace.IPsPrefix(name)) && strings.HasSuffix(k, "/"+ip.Address.IP.String())
		}) {
			t.Errorf("etcdctl does not show %s:\n%s", ip.Address.IP, out)
		}
	}
	ctl, err := exec.CommandContext(f.Ctx, filepath.Join(binDir(t), "leaseholdctl"), "--endpoints", f.Endpoint, "alloc", "list", "--pool", name).CombinedOutput()
	if err != nil {
		t.Fatalf("leaseholdctl: %v\n%s", err, ctl)
	}
	if !strings.Contains(string(ctl), "pod-1") || !strings.Contains(string(ctl), res.IPs[0].Address.IP.String()) {
		t.Errorf("leaseholdctl alloc list does not show the allocation:\n%s", ctl)
	}
}

func freeURL(t testing.TB) string {
	t.Helper()
	u, err := etcdserverFreeURL()
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

// TestDelWorksWhenTheConfigurationNoLongerValidates: the network's configuration was
// changed after the ADD into one leasehold refuses (here an off-link route). DEL must still
// release the addresses, or the runtime could never tear the sandbox down.
func TestDelWorksWhenTheConfigurationNoLongerValidates(t *testing.T) {
	f := newFixture(t)
	good := dualStackIPAM("10.28.0.0/24", "fd28::/64")
	if _, err := f.add(netconf(f.Pool, f.Agent.Socket, good), "c1", "eth0", "K8S_POD_UID=u1"); err != nil {
		t.Fatal(err)
	}
	bad := dualStackIPAM("10.28.0.0/24", "fd28::/64")
	bad["routes"] = []any{map[string]any{"dst": "0.0.0.0/0", "gw": "192.168.1.1"}}
	badConf := netconf(f.Pool, f.Agent.Socket, bad)
	if _, err := f.add(badConf, "c2", "eth0", ""); cniCode(err) != 7 {
		t.Fatalf("the changed configuration should be refused for ADD, got %v", err)
	}
	if err := f.del(badConf, "c1", "eth0", "K8S_POD_UID=u1"); err != nil {
		t.Fatalf("DEL with the changed configuration: %v", err)
	}
	if left := keysUnder(snapshot(t, f.Cli, keyspace.Prefix), keyspace.IPsPrefix(f.Pool)); len(left) != 0 {
		t.Errorf("DEL left %v", left)
	}
}

// TestRemovedSocketIsCreatedAgain: a cleanup that removes the agent's socket file must not
// leave a running agent that no runtime can reach.
func TestRemovedSocketIsCreatedAgain(t *testing.T) {
	f := newFixture(t)
	agent := f.Agent
	conf := netconf(f.Pool, agent.Socket, dualStackIPAM("10.29.0.0/24", "fd29::/64"))
	if _, err := f.add(conf, "before", "eth0", ""); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(agent.Socket); err != nil {
		t.Fatal(err)
	}
	took := eventually(t, "the socket is back", func() error {
		_, err := os.Stat(agent.Socket)
		return err
	})
	t.Logf("socket back %s after its removal", took.Round(100*time.Millisecond))
	if _, err := f.add(conf, "after", "eth0", ""); err != nil {
		t.Errorf("ADD after the socket came back: %v", err)
	}
	if fi, err := os.Stat(agent.Socket); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("recreated socket: mode %v, err %v; want 0600", fi.Mode().Perm(), err)
	}
}
