package integration

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/keyspace"
)

// TestStickyAddressFollowsAStatefulSetPod runs a StatefulSet's web-2 through the real plugin
// and two real agents: ADD on node a; its replacement's ADD on node b while it lives fails
// naming it; after its DEL the replacement gets the same addresses on b; then node b is
// killed, and once its pod lease has expired a third incarnation on node a gets them again.
func TestStickyAddressFollowsAStatefulSetPod(t *testing.T) {
	f := newFixture(t, withAgents(2), withShortLeases())
	a, b := f.Agents[0], f.Agents[1]
	conf := func(ag *agentProc, timeout string) []byte {
		ipam := dualStackIPAM("10.93.0.0/24", "fd93::/64")
		ipam["sticky"], ipam["timeout"] = true, timeout
		return netconf(f.Pool, ag.Socket, ipam)
	}
	args := func(uid string) string {
		return "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-2;K8S_POD_UID=" + uid
	}
	addrs := func(ag *agentProc, container, uid, timeout string) ([]netip.Addr, error) {
		t.Helper()
		res, err := f.add(conf(ag, timeout), container, "eth0", args(uid))
		if err != nil {
			return nil, err
		}
		return resultAddrs(res), nil
	}
	// Timeouts: ample for an ADD on a busy machine; the refused one waits for the live holder
	// until shortly before its own, then names it; the last waits for a dead node's lease.
	first, err := addrs(a, "web-2-a", "uid-1", "20s")
	if err != nil {
		t.Fatal(err)
	}
	key := keyspace.ClaimKey(f.Cluster, f.Pool, "default.web-2")
	if !exists(t, f.Cli, key) {
		t.Fatalf("no claim %s after the first ADD", key)
	}

	if _, err := addrs(b, "web-2-b", "uid-2", "5s"); err == nil || cniCode(err) != 11 || !strings.Contains(err.Error(), "uid-1") {
		t.Fatalf("the replacement's ADD while web-2 lives: %v, want code 11 naming uid-1", err)
	}
	if err := f.del(conf(a, "20s"), "web-2-a", "eth0", args("uid-1")); err != nil {
		t.Fatal(err)
	}
	second, err := addrs(b, "web-2-b", "uid-2", "20s")
	if err != nil {
		t.Fatal(err)
	}
	if !sameAddrs(first, second) {
		t.Fatalf("after the DEL the replacement got %v, want %v", second, first)
	}

	b.kill() // node b dies with web-2 on it: its pod lease expires after the TTL
	third, err := addrs(a, "web-2-c", "uid-3", "60s")
	if err != nil {
		t.Fatal(err)
	}
	if !sameAddrs(first, third) {
		t.Fatalf("after node b died the next incarnation got %v, want %v", third, first)
	}
}

func sameAddrs(x, y []netip.Addr) bool {
	if len(x) != len(y) {
		return false
	}
	for i := range x {
		if x[i] != y[i] {
			return false
		}
	}
	return true
}
