package admin

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestDoctorOnAnInterfaceFromTwoPools runs a real agent whose namespace rule gives IPv4 from
// one pool and IPv6 from another (issue 34): a pod's interface has an owner index in each,
// and doctor finds nothing wrong (no allocation without owner index, no duplicate, no pod
// outside its selection). With one family's owner index deleted by hand, doctor names the
// half-attached interface, both its pools and the fix, which writes that owner index back as
// the agent had written it; doctor is clean again. In the mixed list the IPv6 comes from a
// dual-stack pool, whose attachment takes that one family.
func TestDoctorOnAnInterfaceFromTwoPools(t *testing.T) {
	for _, tc := range []struct {
		name, v4, v6 string
		rule         []string
	}{
		{"two single-family pools", "v4", "v6", []string{"v4", "v6"}},
		{"a mixed list", "v4", "dual", []string{"v4", "dual"}},
	} {
		t.Run(tc.name, func(t *testing.T) { checkHalfAttached(t, tc.rule, tc.v4, tc.v6) })
	}
}

func checkHalfAttached(t *testing.T, rule []string, v4Pool, v6Pool string) {
	ctx, cli := etcdtest.Ctx(t), privateEtcd(t)
	for _, p := range []allocator.PoolSpec{
		adminPool("net", allocator.RangeSet{adminRange("10.83.0.0/24")}, allocator.RangeSet{adminRange("fd83::/120")}),
		adminPool("v4", allocator.RangeSet{adminRange("10.84.0.0/24")}),
		adminPool("v6", allocator.RangeSet{adminRange("fd84::/120")}),
		adminPool("dual", allocator.RangeSet{adminRange("10.85.0.0/24")}, allocator.RangeSet{adminRange("fd85::/120")}),
	} {
		if _, err := CreatePool(ctx, cli, p); err != nil {
			t.Fatal(err)
		}
	}
	if err := SetNamespaceRule(ctx, cli, "c1", "net", "ns", keyspace.NamespaceRule{Pools: rule}); err != nil {
		t.Fatal(err)
	}
	// A long TTL: the agent's audit, which puts a deleted key back too, runs every half TTL.
	a := startAgentOn(t, cli, "c1", "n1", "uid-n1", 2*time.Minute)
	var ips []string
	for _, uid := range []string{"u-web", "u-db"} {
		res, err := a.Add(ctx, byName("net", "ctr-"+uid, uid))
		if err != nil {
			t.Fatal(err)
		}
		if len(res.IPs) != 2 {
			t.Fatalf("ADD of %s: %v, want an address of each family", uid, res.IPs)
		}
		ips = append(ips, res.IPs[0].Address.Addr().String(), res.IPs[1].Address.Addr().String())
	}
	v4Prefix := map[string]string{"v4": "10.84.", "dual": "10.85."}[v4Pool]
	v6Prefix := map[string]string{"v6": "fd84::", "dual": "fd85::"}[v6Pool]
	if !strings.HasPrefix(ips[0], v4Prefix) || !strings.HasPrefix(ips[1], v6Prefix) {
		t.Fatalf("addresses %v: want IPv4 from %s and IPv6 from %s", ips, v4Pool, v6Pool)
	}
	if fs := Check(readState(t, cli)); len(fs) != 0 {
		t.Fatalf("findings for pods whose interface has an attachment in each of two pools: %+v", fs)
	}

	v4Owner, v6Owner := keyspace.OwnerKey("c1", "u-web", "eth0", v4Pool), keyspace.OwnerKey("c1", "u-web", "eth0", v6Pool)
	before := dumpKVs(t, cli, v6Owner)[v6Owner]
	if _, err := cli.Delete(ctx, v6Owner); err != nil {
		t.Fatal(err)
	}
	fs := Check(readState(t, cli))
	if len(fs) != 1 {
		t.Fatalf("findings with u-web's IPv6 owner index deleted: %+v; want one", fs)
	}
	f := fs[0]
	if f.Kind != KindOrphan || f.Severity != SeverityError || !reflect.DeepEqual(f.Keys, []string{
		keyspace.IPKey(v6Pool, allocator.DefaultBlocks, netip.MustParseAddr(ips[1])), v4Owner}) {
		t.Fatalf("finding %+v: want %s naming the IPv6 allocation and the interface's IPv4 owner index", f, KindOrphan)
	}
	for _, s := range []string{"half-attached", "interface eth0", "pod ns/pod-ctr-u-web", "pool " + v4Pool + " (" + ips[0] + ")", v6Owner,
		"still runs", "CHECK of the interface fails", "half a lease TTL", "restore the owner index"} {
		if !strings.Contains(f.Message, s) {
			t.Errorf("message %q does not say %q", f.Message, s)
		}
	}
	if _, err := a.Check(ctx, byName("net", "ctr-u-web", "u-web")); err == nil {
		t.Errorf("CHECK of u-web with its IPv6 owner index deleted passed; the finding says it fails")
	}
	if want := `'create("` + v6Owner + `") = "0"'`; !strings.Contains(f.Fix, want) {
		t.Errorf("fix %q: want it guarded by %s", f.Fix, want)
	}
	runFix(t, cli, f.Fix)
	after, ok := dumpKVs(t, cli, v6Owner)[v6Owner]
	if !ok || after.lease != before.lease {
		t.Fatalf("after the fix %s is %+v, want it on lease %x", v6Owner, after, before.lease)
	}
	var was, now keyspace.OwnerRecord
	was, _ = keyspace.Decode[keyspace.OwnerRecord](v6Owner, []byte(before.value))
	now, err := keyspace.Decode[keyspace.OwnerRecord](v6Owner, []byte(after.value))
	if err != nil || !reflect.DeepEqual(now, was) {
		t.Fatalf("owner index written back: %+v, %v; want it as the agent wrote it: %+v", now, err, was)
	}
	if fs := Check(readState(t, cli)); len(fs) != 0 {
		t.Fatalf("findings after the fix: %+v", fs)
	}
	if res, err := a.Check(ctx, byName("net", "ctr-u-web", "u-web")); err != nil || len(res.IPs) != 2 {
		t.Fatalf("CHECK of u-web after the fix: %v, %v", res, err)
	}
}
