package leases

import (
	"net/netip"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/adopt"
)

func addrsOf(es []ImportedAddr) []netip.Addr {
	var out []netip.Addr
	for _, e := range es {
		out = append(out, e.IP)
	}
	return out
}

// TestImportClaimsReleasesByContainerAndIsIdempotent runs imports against a real etcd: the
// addresses are claimed under the container ID on leases the agent renews, one held by
// another node's pod is reported and left, one outside the pool is reported; a DEL and a
// CHECK naming the pod UID reach the imported attachment by container ID, GC collects one
// the runtime no longer lists, and imports run again (also after a restart) claim nothing
// new: what is held is "already", what was released stays released, and so does the address
// of a conflict whose container was deleted, once its other holder is gone.
func TestImportClaimsReleasesByContainerAndIsIdempotent(t *testing.T) {
	cluster, state := etcdtest.Uniq("c"), t.TempDir()
	withState := func(c *Config) { c.StateDir, c.GCGrace = state, -1 }
	a := startAgent(t, cluster, "n1", "uid1", withState)
	other := startAgent(t, cluster, "n2", "uid2")
	pool := dualStack(etcdtest.Uniq("p"), "10.5.0.0/24", "fd05::/64")
	ctx := ctxT(t)

	if _, err := a.Import(ctx, Import{Network: pool.Name, Source: "test"}); err == nil || !strings.Contains(err.Error(), "leaseholdctl pool create") {
		t.Fatalf("import into an undefined pool: want an error saying to create it, got %v", err)
	}
	held, err := other.Add(ctx, addReq(pool, "other-ctr", "eth0", "other-uid")) // defines the pool
	if err != nil {
		t.Fatal(err)
	}
	taken := held.IPs[0].Address.Addr()
	ip := netip.MustParseAddr
	imp := Import{Network: pool.Name, Source: "test", Attachments: []adopt.Attachment{
		{ContainerID: "ctr-a", IfName: "eth0", IPs: []netip.Addr{ip("10.5.0.200"), ip("fd05::200")}},
		{ContainerID: "ctr-b", IfName: "eth0", IPs: []netip.Addr{ip("10.5.0.201")}},
		{ContainerID: "ctr-c", IfName: "eth0", IPs: []netip.Addr{taken, ip("fd05::202")}},
		{ContainerID: "ctr-d", IfName: "net1", IPs: []netip.Addr{ip("10.9.9.9"), ip("10.5.0.0")}},
	}}
	rep, err := a.Import(ctx, imp)
	if err != nil {
		t.Fatal(err)
	}
	want := func(what string, got []ImportedAddr, addrs ...netip.Addr) {
		t.Helper()
		if g := addrsOf(got); len(g) != len(addrs) || len(addrs) > 0 && !sameAddrs(g, addrs) {
			t.Errorf("%s: %v, want %v", what, got, addrs)
		}
	}
	want("imported", rep.Imported, ip("10.5.0.200"), ip("fd05::200"), ip("10.5.0.201"), ip("fd05::202"))
	want("conflicts", rep.Conflicts, taken)
	want("outside the pool", rep.OutsidePool, ip("10.9.9.9"), ip("10.5.0.0"))
	if len(rep.Conflicts) == 1 && !strings.Contains(rep.Conflicts[0].Detail, "other-uid") {
		t.Errorf("the conflict does not name its holder: %+v", rep.Conflicts[0])
	}
	keys := etcdtest.Dump(t, etcdtest.Client(t), keyspace.Prefix)
	for _, k := range []string{keyspace.OwnerKey(cluster, "ctr-a", "eth0", pool.Name), keyspace.PodKey(cluster, "n1", "ctr-a"),
		keyspace.IPKey(pool.Name, allocator.DefaultBlocks, ip("fd05::200"))} {
		if l, ok := keys[k]; !ok || !a.keeper.Holds(clientv3.LeaseID(l)) {
			t.Errorf("%s: present %v, on a lease the agent renews: want both", k, ok)
		}
	}
	resp, err := etcdtest.Client(t).Get(ctx, keyspace.IPKey(pool.Name, allocator.DefaultBlocks, taken))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("read %s: %v", taken, err)
	}
	if h, _ := keyspace.Decode[keyspace.Allocation](string(resp.Kvs[0].Key), resp.Kvs[0].Value); h.Owner != "other-uid" {
		t.Errorf("%s now belongs to %q; the import must leave it to its holder", taken, h.Owner)
	}

	// Requests name the pod UID; the attachment is found by container ID, and only for it.
	withUID := func(ctr string) allocator.Request {
		return allocator.Request{Network: pool.Name, Pool: allocator.PoolSpec{Name: pool.Name}, ContainerID: ctr, IfName: "eth0",
			Pod: allocator.PodRef{UID: "uid-of-" + ctr, Namespace: "ns", Name: ctr}}
	}
	if res, err := a.Check(ctx, withUID("ctr-b")); err != nil || len(res.IPs) != 1 || res.IPs[0].Address.Addr() != ip("10.5.0.201") {
		t.Errorf("CHECK of ctr-b by pod UID: %+v, %v", res, err)
	}
	if res, err := a.Add(ctx, withUID("ctr-b")); err != nil || len(res.IPs) != 1 || res.IPs[0].Address.Addr() != ip("10.5.0.201") {
		t.Errorf("a repeated ADD of ctr-b by pod UID must return its imported address: %+v, %v", res, err)
	}
	if err := a.Del(ctx, withUID("ctr-a")); err != nil {
		t.Fatal(err)
	}
	keys = etcdtest.Dump(t, etcdtest.Client(t), keyspace.Prefix)
	if etcdtest.Count(keys, "/ctr-a/") != 0 || etcdtest.Count(keys, "10.5.0.200") != 0 {
		t.Errorf("after ctr-a's DEL its keys remain: %v", keys)
	}
	if err := a.GC(ctx, allocator.GCRequest{Network: pool.Name, Pool: allocator.PoolSpec{Name: pool.Name},
		ValidAttachments: []allocator.Attachment{{ContainerID: "ctr-c", IfName: "eth0"}}}); err != nil {
		t.Fatal(err)
	}
	keys = etcdtest.Dump(t, etcdtest.Client(t), keyspace.Prefix)
	if etcdtest.Count(keys, "/ctr-b/") != 0 || etcdtest.Count(keys, "/ctr-c/") == 0 {
		t.Errorf("GC listing only ctr-c: want ctr-b's keys gone and ctr-c's kept: %v", keys)
	}

	again := func(a *Agent) {
		t.Helper()
		rep, err := a.Import(ctx, imp)
		if err != nil {
			t.Fatal(err)
		}
		want("imported again", rep.Imported)
		want("already", rep.Already, ip("fd05::202"))
		want("released since", rep.Released, ip("10.5.0.200"), ip("fd05::200"), ip("10.5.0.201"))
		want("conflicts again", rep.Conflicts, taken)
	}
	again(a)
	before := etcdtest.Dump(t, etcdtest.Client(t), keyspace.Prefix)
	a.Close()
	b := startAgent(t, cluster, "n1", "uid1", withState)
	again(b)
	if after := etcdtest.Dump(t, etcdtest.Client(t), keyspace.Prefix); etcdtest.Count(after, "/ctr-") != etcdtest.Count(before, "/ctr-") {
		t.Errorf("an import after a restart changed the imported keys:\nbefore %v\nafter  %v", before, after)
	}

	// ctr-c, whose first address the import left to another owner, is deleted; then that
	// owner too. A restart with the same import imports nothing new: not the address of the
	// deleted container.
	if err := b.Del(ctx, withUID("ctr-c")); err != nil {
		t.Fatal(err)
	}
	if err := other.Del(ctx, addReq(pool, "other-ctr", "eth0", "other-uid")); err != nil {
		t.Fatal(err)
	}
	b.Close()
	rep, err = startAgent(t, cluster, "n1", "uid1", withState).Import(ctx, imp)
	if err != nil {
		t.Fatal(err)
	}
	want("imported after the conflict's container was deleted", rep.Imported)
	want("released since, the conflict's included", rep.Released, ip("10.5.0.200"), ip("fd05::200"), ip("10.5.0.201"),
		ip("fd05::202"), taken)
	if n := etcdtest.Count(etcdtest.Dump(t, etcdtest.Client(t), keyspace.Prefix), "/ctr-c/"); n != 0 {
		t.Errorf("the deleted container ctr-c has %d keys after a restart's import", n)
	}
}

func sameAddrs(a, b []netip.Addr) bool {
	m := map[netip.Addr]int{}
	for _, x := range a {
		m[x]++
	}
	for _, x := range b {
		m[x]--
	}
	for _, n := range m {
		if n != 0 {
			return false
		}
	}
	return true
}
