package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/integration/chaos"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// TestACutOffNodeKeepsItsAddressesWhileAnotherFillsThePool is issue 23 with a real cut-off:
// two agents, each in its own network namespace reaching a three-member etcd over a veth.
// The first runs 20 pods; its link goes down (the agent keeps running) and stays down past
// the TTL, so etcd expires their leases. The second node then fills every other address of
// the pool, claiming the free blocks and borrowing in the cut-off node's: it never gets one
// of the 20. The link comes back within the reuse delay: every pod is re-claimed, with no
// conflict, and the doctor finds nothing wrong.
func TestACutOffNodeKeepsItsAddressesWhileAnotherFillsThePool(t *testing.T) {
	requireNetns(t)
	bin := binDir(t)
	ctx, cancel := testCtx(t)
	defer cancel()
	// The reuse delay is far longer than the test takes on a busy machine: the link comes back
	// within it, whatever filling the pool meanwhile cost.
	const ttl, delay = 4 * time.Second, 10 * time.Minute
	tb, err := chaos.NewTestbed(ctx, chaos.Config{Bin: bin, Nodes: 2, TTL: ttl, ReuseDelay: delay, Quarantine: 2 * time.Second, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close()
	defer func() {
		if t.Failed() {
			t.Logf("cut-off agent's log:\n%s\nthe other's:\n%s", tb.Log(0), tb.Log(1))
		}
	}()
	// The pods' netns paths are named after the pool: ccUniq keeps them apart from those of
	// another run of this package on the machine, whose cleanup would remove them.
	pool := ccUniq("cut")
	subnet := netip.MustParsePrefix("10.85.0.0/24")
	spec := allocator.PoolSpec{Name: pool, Ranges: []allocator.RangeSet{{{Subnet: subnet}}}}
	if err := spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	size := int(spec.SetSize(0).Int64())
	conf := func(i int) []byte {
		return netconf(pool, tb.Socket(i), map[string]any{"type": "leasehold", "socket": tb.Socket(i),
			"ranges": [][]map[string]string{{{"subnet": subnet.String()}}}, "timeout": "20s"})
	}
	pl := newPlugin(t)
	add := func(i int, pod string) (netip.Addr, error) {
		netnsPath(t, pod)
		res, err := pl.add(ctx, conf(i), pod, "eth0", "K8S_POD_UID=uid-"+pod)
		if err != nil {
			return netip.Addr{}, err
		}
		a, _ := netip.AddrFromSlice(res.IPs[0].Address.IP.To4())
		return a, nil
	}
	cut := map[netip.Addr]string{}
	for i := range 20 {
		pod := fmt.Sprintf("%s-run-%d", pool, i)
		ip, err := add(0, pod)
		if err != nil {
			t.Fatal(err)
		}
		cut[ip] = "uid-" + pod
	}
	if err := tb.Cut(ctx, 0); err != nil {
		t.Fatal(err)
	}
	cli := tb.Client()
	eventually(t, "the cut-off node's pods' leases expire in etcd", func() error {
		for ip := range cut {
			if o := cutOwner(t, cli, pool, ip); o != "" {
				return fmt.Errorf("%s still allocated to %s", ip, o)
			}
		}
		return nil
	})
	// The cut-off agent answers an ADD at once, with what stops it: "no answer since" comes
	// only from the question an ADD asks etcd first after seconds of silence, bounded by 2 s
	// (leases.probeTimeout); an ADD that waited for its etcd calls' own timeout (10 s) to
	// learn it would answer otherwise, and after that timeout.
	start := time.Now()
	_, err = add(0, pool+"-while-cut")
	took := time.Since(start)
	if cniCode(err) != 11 || !strings.Contains(err.Error(), "etcd does not answer (no answer since") {
		t.Errorf("ADD on the cut-off node after %s: want code 11 saying etcd does not answer, got %v", took.Round(time.Millisecond), err)
	}
	if took >= leases.DefaultOpTimeout {
		t.Errorf("the cut-off node took %s to answer an ADD, as long as an etcd call's own timeout (%s)", took.Round(time.Millisecond), leases.DefaultOpTimeout)
	}
	for n := 0; n < size-len(cut); n++ {
		ip, err := add(1, fmt.Sprintf("%s-fill-%d", pool, n))
		if err != nil {
			t.Fatalf("ADD %d of %d on the other node, with %d addresses free that no expired holder had: %v",
				n+1, size-len(cut), size-len(cut)-n, err)
		}
		if owner, ok := cut[ip]; ok {
			t.Fatalf("ADD %d on the other node got %s, held back for %s of the cut-off node, while %d other addresses were free",
				n+1, ip, owner, size-len(cut)-n)
		}
	}
	if err := tb.Heal(ctx, 0); err != nil {
		t.Fatal(err)
	}
	// A re-claim writes a pod's allocations before its pod record, which it writes (and logs a
	// conflict) only once it has read the answer of the claim: wait for the pod records too,
	// or the doctor below could find one missing.
	eventually(t, "every pod of the cut-off node holds its address again", func() error {
		for ip, owner := range cut {
			if o := cutOwner(t, cli, pool, ip); o != owner {
				return fmt.Errorf("%s allocated to %q, want %s", ip, o, owner)
			}
			if !cutPodRecorded(t, cli, pool, ip) {
				return fmt.Errorf("%s is allocated to %s, whose pod record is not on its lease yet", ip, owner)
			}
		}
		return nil
	})
	if strings.Contains(tb.Log(0), `"msg":"CONFLICT`) {
		t.Errorf("the cut-off node logged a conflict on coming back within the reuse delay")
	}
	out, err := exec.CommandContext(ctx, filepath.Join(bin, "leaseholdctl"), "--endpoints", strings.Join(tb.Endpoints(), ","), "doctor").CombinedOutput()
	if err != nil {
		t.Errorf("leaseholdctl doctor after the heal: %v\n%s", err, out)
	}
}

// cutOwner is the owner of ip's allocation in pool (blocks of the default size), "" if none.
func cutOwner(t *testing.T, cli *clientv3.Client, pool string, ip netip.Addr) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	resp, err := cli.Get(ctx, keyspace.IPKey(pool, allocator.DefaultBlocks, ip))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return ""
	}
	var a keyspace.Allocation
	if err := json.Unmarshal(resp.Kvs[0].Value, &a); err != nil {
		t.Fatal(err)
	}
	return a.Owner
}

// cutPodRecorded reports whether the allocation of ip in pool (blocks of the default size)
// has its pod's record on its lease.
func cutPodRecorded(t *testing.T, cli *clientv3.Client, pool string, ip netip.Addr) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	resp, err := cli.Get(ctx, keyspace.IPKey(pool, allocator.DefaultBlocks, ip))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return false
	}
	var a keyspace.Allocation
	if err := json.Unmarshal(resp.Kvs[0].Value, &a); err != nil {
		t.Fatal(err)
	}
	pr, err := cli.Get(ctx, keyspace.PodKey(a.Cluster, a.Node, a.Owner))
	if err != nil {
		t.Fatal(err)
	}
	return len(pr.Kvs) == 1 && pr.Kvs[0].Lease == resp.Kvs[0].Lease
}

// netnsPath makes /var/run/netns/<container>, the netns path the plugin passes, a plain file:
// the agent looks only whether it exists (sandbox liveness), and a real namespace per pod of
// a filled /24 would cost seconds. Removed when the test ends.
func netnsPath(t *testing.T, container string) {
	t.Helper()
	path := filepath.Join("/var/run/netns", container)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, nil, 0o644); err != nil && !errors.Is(err, os.ErrExist) {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(path) })
}
