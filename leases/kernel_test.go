package leases

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/kernel"
)

// needRoot skips a bare `go test` that cannot create network namespaces; under make test
// (LEASEHOLD_TEST_ALL) and in CI, which run as root, it fails instead, so the kernel tests are
// never silently skipped there.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") != "" || os.Getenv("LEASEHOLD_TEST_ALL") != "" {
		t.Fatal("kernel tests need root, and make test and CI run as root")
	}
	t.Skip("kernel tests need root")
}

func ip(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// testNetns creates a network namespace and returns its path.
func testNetns(t *testing.T) string {
	t.Helper()
	name := etcdtest.Uniq("lhk")
	ip(t, "netns", "add", name)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	return "/var/run/netns/" + name
}

func nsName(path string) string { return path[strings.LastIndex(path, "/")+1:] }

// vethIn creates a veth pair with ends a (in nsA) and b (in nsB), both up.
func vethIn(t *testing.T, nsA, a, nsB, b string) {
	t.Helper()
	tmpA, tmpB := etcdtest.Uniq("lhva"), etcdtest.Uniq("lhvb")
	ip(t, "link", "add", tmpA, "type", "veth", "peer", "name", tmpB)
	ip(t, "link", "set", tmpA, "netns", nsName(nsA), "name", a)
	ip(t, "link", "set", tmpB, "netns", nsName(nsB), "name", b)
	ip(t, "-n", nsName(nsA), "link", "set", a, "up")
	ip(t, "-n", nsName(nsB), "link", "set", b, "up")
}

// TestHostAddressesNeverFlapUnderDAD reproduces the DAD flap (docs/field-failures.md), the OVN-Kubernetes report: an IPv6
// address goes through real duplicate address detection while host-address resyncs run back
// to back. The published set must gain the address and never lose it (no delete of any of
// the node's host keys) until the kernel removes it; then it goes at once.
func TestHostAddressesNeverFlapUnderDAD(t *testing.T) {
	needRoot(t)
	host := testNetns(t)
	vethIn(t, host, "uplink", host, "uplink-peer")
	ip(t, "-n", nsName(host), "addr", "add", "10.99.0.1/24", "dev", "uplink")
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	ctx := ctxT(t)
	rev, err := cli.Get(ctx, "rev")
	if err != nil {
		t.Fatal(err)
	}
	watch := cli.Watch(ctx, keyspace.HostIPPrefix(netip.Addr{}), clientv3.WithPrefix(), clientv3.WithRev(rev.Header.Revision+1))
	startAgent(t, cluster, "n1", "uid1", func(c *Config) {
		c.PublishHostAddrs, c.HostNetns, c.HostResync = true, host, 5*time.Millisecond
	})
	// Five DAD probes a second apart keep the address tentative for about five seconds once
	// the link is up; on a link that is down it stays tentative until the link comes up, so
	// the test sees it published while tentative however slow the machine.
	ip(t, "netns", "exec", nsName(host), "sysctl", "-qw", "net.ipv6.conf.uplink.dad_transmits=5")
	v6 := netip.MustParseAddr("2001:db8:77::1")
	v6Key := keyspace.HostIPKey(v6, cluster, "n1")
	ip(t, "-n", nsName(host), "link", "set", "uplink", "down")
	ip(t, "-n", nsName(host), "addr", "add", v6.String()+"/64", "dev", "uplink")
	etcdtest.Eventually(t, v6.String()+" is published while tentative", func() error {
		addrs, err := kernel.LinkAddrs(host, "uplink")
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(addrs, func(a kernel.Addr) bool { return a.Prefix.Addr() == v6 && a.Tentative }) {
			t.Fatalf("%s is not tentative on a link that is down: %+v", v6, addrs)
		}
		n := len(etcdtest.Dump(t, cli, v6Key))
		return etcdtest.Saw(n == 1, "%d keys at %s", n, v6Key)
	})
	ip(t, "-n", nsName(host), "link", "set", "uplink", "up")
	// Follow both sides until DAD is over: the kernel's flags and what etcd publishes.
	dadDone := false
	deletes := 0
	for start := time.Now(); !dadDone; time.Sleep(20 * time.Millisecond) {
		if waited := time.Since(start); waited > etcdtest.Patience {
			t.Fatalf("DAD did not finish after %s", waited.Round(time.Second))
		}
		addrs, err := kernel.LinkAddrs(host, "uplink")
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range addrs {
			if a.Prefix.Addr() == v6 {
				dadDone = !a.Tentative
			}
		}
		for drained := false; !drained; {
			select {
			case wr := <-watch:
				for _, ev := range wr.Events {
					if strings.HasSuffix(string(ev.Kv.Key), "/"+cluster+"/n1") && ev.Type == clientv3.EventTypeDelete {
						deletes++
						t.Errorf("host key %s deleted while its address was present: the published set flapped", ev.Kv.Key)
					}
				}
			default:
				drained = true
			}
		}
	}
	// Resyncs keep running back to back after DAD: still published, still no delete.
	time.Sleep(time.Second)
	for drained := false; !drained; {
		select {
		case wr := <-watch:
			for _, ev := range wr.Events {
				if strings.HasSuffix(string(ev.Kv.Key), "/"+cluster+"/n1") && ev.Type == clientv3.EventTypeDelete {
					t.Errorf("host key %s deleted after DAD while the address was present", ev.Kv.Key)
				}
			}
		default:
			drained = true
		}
	}
	for _, want := range []netip.Addr{v6, netip.MustParseAddr("10.99.0.1")} {
		if len(etcdtest.Dump(t, cli, keyspace.HostIPKey(want, cluster, "n1"))) != 1 {
			t.Errorf("%s is not published", want)
		}
	}
	// The kernel removes it: the key goes at once.
	ip(t, "-n", nsName(host), "addr", "del", v6.String()+"/64", "dev", "uplink")
	etcdtest.Eventually(t, v6.String()+" removed by the kernel is unpublished", etcdtest.Keys(t, cli, keyspace.HostIPKey(v6, cluster, "n1"), 0))
}

// TestHostAddressIsNeverHandedOut: an address a node publishes as its own is skipped by
// candidate choice and refused when requested, in any pool and any cluster.
func TestHostAddressIsNeverHandedOut(t *testing.T) {
	needRoot(t)
	host := testNetns(t)
	vethIn(t, host, "uplink", host, "uplink-peer")
	ip(t, "-n", nsName(host), "addr", "add", "10.98.0.2/24", "dev", "uplink")
	publisher := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1", func(c *Config) {
		c.PublishHostAddrs, c.HostNetns, c.HostResync = true, host, time.Second
	})
	_ = publisher
	cli := etcdtest.Client(t)
	hostAddr := netip.MustParseAddr("10.98.0.2")
	etcdtest.Eventually(t, "the host address is published", func() error {
		n := len(etcdtest.Dump(t, cli, keyspace.HostIPPrefix(hostAddr)))
		return etcdtest.Saw(n > 0, "no key under %s", keyspace.HostIPPrefix(hostAddr))
	})
	other := startAgent(t, etcdtest.Uniq("c"), "n2", "uid2") // another cluster allocating from a pool over the host's subnet
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.98.0.0/29")}}}}
	ctx := ctxT(t)
	req := addReq(pool, "wants-host", "eth0", "")
	req.RequestedIPs = []netip.Addr{hostAddr}
	if _, err := other.Add(ctx, req); !errors.Is(err, allocator.ErrAddressInUse) || !strings.Contains(err.Error(), "host address") {
		t.Errorf("requesting a host address: want ErrAddressInUse naming it a host address, got %v", err)
	}
	for i := range 4 { // .2 is the host's; .3-.6 are free
		res, err := other.Add(ctx, addReq(pool, etcdtest.Uniq("ctr"), "eth0", ""))
		if err != nil {
			t.Fatalf("add %d: %v", i, err)
		}
		if res.IPs[0].Address.Addr() == hostAddr {
			t.Fatalf("handed out the host address %s", hostAddr)
		}
	}
	if _, err := other.Add(ctx, addReq(pool, "one-too-many", "eth0", "")); !errors.Is(err, allocator.ErrPoolExhausted) {
		t.Errorf("with the host address excluded the /29 holds 4 pods; the fifth: want ErrPoolExhausted, got %v", err)
	}
}

// TestCheckReportsDADFailureAsDuplicate: CHECK looks inside the sandbox. While DAD has not
// finished the address is tentative and CHECK passes; once DAD finds the same address on the
// veth peer, CHECK fails with a conflict naming the address and the interface.
func TestCheckReportsDADFailureAsDuplicate(t *testing.T) {
	needRoot(t)
	sandboxNs, peerNs := testNetns(t), testNetns(t)
	vethIn(t, sandboxNs, "eth0", peerNs, "peer0")
	dup := netip.MustParseAddr("fd77::5")
	ip(t, "-n", nsName(peerNs), "addr", "add", dup.String()+"/64", "dev", "peer0") // the other holder on the link
	etcdtest.Eventually(t, "the peer's address finishes DAD", func() error {
		addrs, err := kernel.LinkAddrs(peerNs, "peer0")
		return etcdtest.Saw(err == nil && hasSettled(addrs, dup), "addresses %+v, err %v", addrs, err)
	})
	a := startAgent(t, etcdtest.Uniq("c"), "n1", "uid1")
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("fd77::/64")}}}}
	ctx := ctxT(t)
	req := addReq(pool, "ctr", "eth0", "")
	req.Netns = sandboxNs
	req.RequestedIPs = []netip.Addr{dup}
	if _, err := a.Add(ctx, req); err != nil {
		t.Fatal(err)
	}
	// On a link that is down the address stays tentative until the link comes up, so the
	// first CHECK sees it tentative whatever the machine's timing (DAD's first probe goes
	// out at a random moment within a second, and the peer answers it at once).
	ip(t, "-n", nsName(sandboxNs), "link", "set", "eth0", "down")
	ip(t, "-n", nsName(sandboxNs), "addr", "add", dup.String()+"/64", "dev", "eth0")
	if _, err := a.Check(ctx, req); err != nil {
		t.Errorf("CHECK while DAD waits (tentative counts as present): %v", err)
	}
	ip(t, "-n", nsName(sandboxNs), "link", "set", "eth0", "up")
	var err error
	etcdtest.Eventually(t, "CHECK fails once DAD finds the duplicate", func() error {
		if _, err = a.Check(ctx, req); err != nil {
			return nil
		}
		return errors.New("CHECK passes")
	})
	if !errors.Is(err, allocator.ErrConflict) || !strings.Contains(err.Error(), dup.String()) || !strings.Contains(err.Error(), "eth0") {
		t.Fatalf("CHECK after DAD failed: want ErrConflict naming %s and eth0, got %v", dup, err)
	}
}

func hasSettled(addrs []kernel.Addr, want netip.Addr) bool {
	for _, a := range addrs {
		if a.Prefix.Addr() == want {
			return !a.Tentative && !a.DADFailed
		}
	}
	return false
}

var _ = context.Background
