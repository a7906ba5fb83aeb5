package main

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// cutOffWorld is a node whose pods' leases expired while it was cut off from etcd (issue 23),
// written key by key as an agent of held keys writes them, on an etcd of its own (doctor reads
// every key): pool "net" (10.96.0.0/24, fd96::/120), node c1/n1's agent with its node lease and
// its block lease (claims of 10.96.0.0/26 and fd96::/122), and pod "web" (10.96.0.10, fd96::10)
// whose allocations, owner index and pod record are on the pod lease and whose held keys are on
// the block lease.
type cutOffWorld struct {
	ep                         string
	cli                        *clientv3.Client
	nodeLease, blockL, podL    clientv3.LeaseID
	ip4, ip6, held4, held6     string
	claim4, claim6, node, pool string
}

func newCutOffWorld(t *testing.T) *cutOffWorld {
	t.Helper()
	srv, stop, err := etcdtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	w := &cutOffWorld{ep: srv.ClientURL, cli: etcdtest.ClientAt(t, srv.ClientURL), node: keyspace.NodeKey("c1", "n1"), pool: "net"}
	ctx := etcdtest.Ctx(t)
	if r := ctlAt(w.ep, "pool", "create", "net", "--range", "10.96.0.0/24", "--range", "fd96::/120"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	grant := func(ttl int64) clientv3.LeaseID {
		g, err := w.cli.Grant(ctx, ttl)
		if err != nil {
			t.Fatal(err)
		}
		return g.ID
	}
	w.nodeLease, w.blockL, w.podL = grant(60), grant(900), grant(60)
	put := func(key, value string, lease clientv3.LeaseID) {
		if _, err := w.cli.Put(ctx, key, value, clientv3.WithLease(lease)); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now().UTC()
	put(w.node, keyspace.Encode(keyspace.NodeRecord{UID: "uid-n1", Host: "h1", Version: "v", Blocks: true, Started: now,
		LeaseID: keyspace.LeaseHex(w.nodeLease), BlockLease: keyspace.LeaseHex(w.blockL)}), w.nodeLease)
	claim := keyspace.Encode(keyspace.BlockRecord{Cluster: "c1", Node: "n1", NodeUID: "uid-n1", LeaseID: keyspace.LeaseHex(w.blockL), Since: now})
	w.claim4, w.claim6 = keyspace.BlockKey("net", netip.MustParsePrefix("10.96.0.0/26")), keyspace.BlockKey("net", netip.MustParsePrefix("fd96::/122"))
	put(w.claim4, claim, w.blockL)
	put(w.claim6, claim, w.blockL)
	ips := []netip.Addr{mustIP("10.96.0.10"), mustIP("fd96::10")}
	pod := allocator.PodRef{UID: "u-web", Namespace: "ns", Name: "web"}
	alloc := keyspace.Encode(keyspace.Allocation{Owner: "u-web", Cluster: "c1", Node: "n1", NodeUID: "uid-n1", Pod: pod, ContainerID: "ctr",
		IfName: "eth0", Network: "net", LeaseID: keyspace.LeaseHex(w.podL), Created: now})
	w.ip4, w.ip6 = keyspace.IPKey("net", allocator.DefaultBlocks, ips[0]), keyspace.IPKey("net", allocator.DefaultBlocks, ips[1])
	w.held4, w.held6 = keyspace.HeldKey("net", allocator.DefaultBlocks, ips[0]), keyspace.HeldKey("net", allocator.DefaultBlocks, ips[1])
	put(w.ip4, alloc, w.podL)
	put(w.ip6, alloc, w.podL)
	put(keyspace.OwnerKey("c1", "u-web", "eth0", "net"), keyspace.Encode(keyspace.OwnerRecord{IPs: ips, ContainerID: "ctr", Network: "net",
		Node: "n1", NodeUID: "uid-n1", LeaseID: keyspace.LeaseHex(w.podL), Created: now}), w.podL)
	put(keyspace.PodKey("c1", "n1", "u-web"), keyspace.Encode(keyspace.PodRecord{Owner: "u-web", Pod: pod, NodeUID: "uid-n1",
		LeaseID: keyspace.LeaseHex(w.podL), ContainerID: "ctr", Created: now}), w.podL)
	held := keyspace.Encode(keyspace.HeldRecord{Cluster: "c1", Node: "n1", Owner: "u-web"})
	put(w.held4, held, w.blockL)
	put(w.held6, held, w.blockL)
	return w
}

// expire is what etcd does when the node is cut off: the pod lease expires, taking the pod's
// keys; the node lease too, taking the node record. The block lease, a reuse delay longer,
// still holds the claims and the held keys.
func (w *cutOffWorld) expire(t *testing.T) {
	t.Helper()
	for _, l := range []clientv3.LeaseID{w.podL, w.nodeLease} {
		if _, err := w.cli.Revoke(etcdtest.Ctx(t), l); err != nil {
			t.Fatal(err)
		}
	}
}

func (w *cutOffWorld) exists(t *testing.T, key string) bool {
	t.Helper()
	return len(keys(t, w.cli, key)) == 1
}

func TestAllocShowOfAnAllocatedAddressShowsItsHeldKey(t *testing.T) {
	w := newCutOffWorld(t)
	r := ctlAt(w.ep, "alloc", "show", "10.96.0.10")
	if r.code != 0 || !strings.Contains(r.stdout, "held key:") || !strings.Contains(r.stdout, w.held4+" on node n1's block lease "+keyspace.LeaseHex(w.blockL)) {
		t.Errorf("alloc show: %+v", r)
	}
	var d []allocDetail
	jsonOf(t, ctlAt(w.ep, "alloc", "show", "10.96.0.10", "-o", "json"), &d)
	if len(d) != 1 || d[0].Expired || d[0].Held == nil || d[0].Held.Key != w.held4 || d[0].Held.Node != "n1" || d[0].Held.TTL <= 0 ||
		d[0].Held.OtherHolder || d[0].Held.ReusableAt != nil {
		t.Errorf("alloc show -o json: %+v", d)
	}
	// A held key naming another holder than the allocation is shown as such.
	if _, err := w.cli.Put(etcdtest.Ctx(t), w.held6, keyspace.Encode(keyspace.HeldRecord{Cluster: "c1", Node: "n7", Owner: "u-old"}),
		clientv3.WithLease(w.blockL)); err != nil {
		t.Fatal(err)
	}
	if r := ctlAt(w.ep, "alloc", "show", "fd96::10"); !strings.Contains(r.stdout, "names node c1/n7 and owner u-old, not this holder") {
		t.Errorf("alloc show of a held key naming another holder:\n%s", r.stdout)
	}
}

// TestCutOffNodeIsVisibleAndForgotten follows a node cut off from etcd through pool show, pool
// list, alloc show and doctor, a refused and a done node forget, and a second one.
func TestCutOffNodeIsVisibleAndForgotten(t *testing.T) {
	w := newCutOffWorld(t)
	// While its agent runs, node forget is refused, naming the node lease and its TTL.
	r := ctlAt(w.ep, "node", "forget", "n1", "--cluster", "c1")
	if r.code != exitError || !strings.Contains(r.stderr, keyspace.LeaseHex(w.nodeLease)) || !strings.Contains(r.stderr, "stop its agent") ||
		!w.exists(t, w.claim4) || !w.exists(t, w.held4) {
		t.Fatalf("node forget of a live node: %+v", r)
	}
	var fj forgetJSON
	r = ctlAt(w.ep, "node", "forget", "n1", "--cluster", "c1", "-o", "json")
	jsonOf(t, r, &fj)
	if r.code != exitError || !fj.Refused || fj.Nothing || fj.Error == "" {
		t.Errorf("node forget -o json of a live node: exit %d %+v", r.code, fj)
	}
	if r := ctlAt(w.ep, "pool", "show", "net"); r.code != 0 || !strings.Contains(r.stdout, "no expired addresses or blocks") {
		t.Errorf("pool show of a healthy pool: %+v", r)
	}

	w.expire(t)

	// pool show: the counts, and per node when they become reusable.
	r = ctlAt(w.ep, "pool", "show", "net")
	for _, s := range []string{"EXPIRED", "expired: 2 address(es) held back, 2 block(s) of nodes whose agent is gone; first reusable",
		"c1/n1", "gone", keyspace.LeaseHex(w.blockL), "gone (expired block)", "leaseholdctl node forget"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("pool show does not say %q:\n%s", s, r.stdout)
		}
	}
	var show poolJSON
	jsonOf(t, ctlAt(w.ep, "pool", "show", "net", "-o", "json"), &show)
	if show.Expired != 2 || show.ExpiredBlocks != 2 || show.Sets[0].Expired != 1 || show.Sets[1].Expired != 1 || show.Sets[0].Free != "252" ||
		show.FirstReusable == nil || len(show.HeldBack) != 1 {
		t.Fatalf("pool show -o json: %+v", show)
	}
	hb := show.HeldBack[0]
	if hb.Cluster != "c1" || hb.Node != "n1" || hb.Agent != "gone" || hb.Addresses != 2 || hb.Blocks != 2 || hb.Lease != keyspace.LeaseHex(w.blockL) ||
		hb.TTL <= 800 || hb.ReusableAt == nil || hb.ReusableAt.Before(time.Now().Add(13*time.Minute)) || !hb.ReusableAt.Equal(*show.FirstReusable) {
		t.Errorf("held back: %+v", hb)
	}
	if len(show.Claims) != 2 || show.Claims[0].Agent != "gone" {
		t.Errorf("claims: %+v", show.Claims)
	}
	// pool list: the counts.
	var list []poolJSON
	jsonOf(t, ctlAt(w.ep, "pool", "list", "-o", "json"), &list)
	if len(list) != 1 || list[0].Expired != 2 || list[0].ExpiredBlocks != 2 || list[0].Sets[0].Expired != 1 || list[0].HeldBack != nil {
		t.Errorf("pool list -o json: %+v", list)
	}
	if r := ctlAt(w.ep, "pool", "list"); !strings.Contains(r.stdout, "EXPIRED BLOCKS") {
		t.Errorf("pool list:\n%s", r.stdout)
	}

	// alloc show: expired, for whom, until when, what to do; exit 4 (no allocation).
	r = ctlAt(w.ep, "alloc", "show", "10.96.0.10")
	for _, s := range []string{"EXPIRED", w.held4, "node c1/n1, owner u-web", "no agent", "when block lease " + keyspace.LeaseHex(w.blockL) + " expires",
		"(in 1", "leaseholdctl node forget n1 --cluster c1", "claimed by c1/n1"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("alloc show of an expired address does not say %q:\n%s", s, r.stdout)
		}
	}
	if r.code != exitNotFound || !strings.Contains(r.stderr, "expired") {
		t.Errorf("alloc show of an expired address: exit %d, stderr %s", r.code, r.stderr)
	}
	var d []allocDetail
	r = ctlAt(w.ep, "alloc", "show", "fd96::10", "-o", "json")
	jsonOf(t, r, &d)
	if r.code != exitNotFound || len(d) != 1 || !d[0].Expired || d[0].Key != "" || d[0].Held == nil || d[0].Held.Key != w.held6 ||
		d[0].Held.Owner != "u-web" || d[0].Held.Agent != "gone" || d[0].Held.ReusableAt == nil || d[0].Held.TTL <= 0 {
		t.Errorf("alloc show -o json of an expired address: exit %d %+v", r.code, d)
	}

	// doctor: information, not problems.
	r = ctlAt(w.ep, "doctor")
	for _, s := range []string{"[address-expired] (info)", "[block-claim-stale] (info)", "fix: leaseholdctl node forget n1 --cluster c1", "no problems found"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("doctor does not say %q:\n%s", s, r.stdout)
		}
	}
	if r.code != exitOK {
		t.Errorf("doctor on a cut-off node: exit %d", r.code)
	}

	// The node is gone for good: node forget frees everything it held back.
	r = ctlAt(w.ep, "node", "forget", "n1", "--cluster", "c1")
	if r.code != 0 || !strings.Contains(r.stdout, "forgot node c1/n1: freed 2 block(s) and 2 held address(es)") || !strings.Contains(r.stdout, "10.96.0.10") {
		t.Fatalf("node forget: %+v", r)
	}
	for _, k := range []string{w.claim4, w.claim6, w.held4, w.held6} {
		if w.exists(t, k) {
			t.Errorf("%s still exists", k)
		}
	}
	if r := ctlAt(w.ep, "alloc", "show", "10.96.0.10"); r.code != exitNotFound || strings.Contains(r.stdout+r.stderr, "expired") {
		t.Errorf("alloc show after node forget: %+v", r)
	}
	if r := ctlAt(w.ep, "pool", "show", "net"); !strings.Contains(r.stdout, "no expired addresses or blocks") {
		t.Errorf("pool show after node forget:\n%s", r.stdout)
	}
	if r := ctlAt(w.ep, "doctor"); r.code != exitOK || strings.Contains(r.stdout, "info finding") {
		t.Errorf("doctor after node forget: %+v", r)
	}
	// Idempotent.
	r = ctlAt(w.ep, "node", "forget", "n1", "--cluster", "c1")
	if r.code != 0 || !strings.Contains(r.stdout, "nothing is held back for node c1/n1") {
		t.Errorf("second node forget: %+v", r)
	}
	r = ctlAt(w.ep, "node", "forget", "n1", "-o", "json")
	jsonOf(t, r, &fj)
	if r.code != 0 || !fj.Nothing || fj.Refused || len(fj.Blocks) != 0 || fj.Held == nil {
		t.Errorf("node forget -o json with nothing held: exit %d %+v", r.code, fj)
	}
}

func TestNodeForgetUsage(t *testing.T) {
	w := newCutOffWorld(t)
	// The same node name holds keys in two clusters: which one must be said.
	if _, err := w.cli.Put(etcdtest.Ctx(t), keyspace.HeldKey("net", allocator.DefaultBlocks, mustIP("10.96.0.99")),
		keyspace.Encode(keyspace.HeldRecord{Cluster: "c2", Node: "n1", Owner: "u"}), clientv3.WithLease(w.blockL)); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"node", "forget", "n1"}, exitUsage, "clusters c1, c2: give --cluster C"},
		{[]string{"node", "forget"}, exitUsage, "NODE"},
		{[]string{"node", "forget", "a/b"}, exitUsage, "node name"},
		{[]string{"node", "forget", "n1", "--pool", "net"}, exitUsage, "does not take --pool"},
		{[]string{"node", "forget", "n9", "--cluster", "c1"}, exitOK, "nothing is held back for node c1/n9"},
	} {
		if r := ctlAt(w.ep, tt.args...); r.code != tt.code || !strings.Contains(r.stdout+r.stderr, tt.says) {
			t.Errorf("%v: exit %d (want %d), output does not say %q: %s %s", tt.args, r.code, tt.code, tt.says, r.stdout, r.stderr)
		}
	}
}
