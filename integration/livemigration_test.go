package integration

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Live migrations (issue 35, docs/proposals/live-migration.md) on real agents (leaseholdd
// processes, one per node), the real plugin binary and etcd, each pod in a network namespace
// of its own. The VM's virt-launcher pods name its claim as Multus gives it, in cni-args
// (args.cni["ipam-claim-reference"]), on a network with "allowPersistentIPs": true.

// vmRef is the VM's IPAMClaim as ipam-extensions names it (<vm>.<network>); in the pods'
// namespace it is the claim default.vm-a.tenantred.
const vmRef, vmNamespace = "vm-a.tenantred", "default"

// vmPod is a virt-launcher pod of the VM on a node.
type vmPod struct {
	node                 *agentProc
	name, uid, container string
	migratable           bool // its network has allowPersistentIPs
}

// vmNet is a dual-stack network whose pods run the VM, with its fixture.
type vmNet struct {
	t *testing.T
	f *fixture
}

// pod is a new virt-launcher pod of the VM on node, with its own network namespace.
func (v vmNet) pod(node *agentProc, migratable bool) *vmPod {
	name := uniq("virt-launcher-vm-a-")
	return &vmPod{node: node, name: name, uid: uniq("uid-"), container: v.f.sandbox("lh-vm-"), migratable: migratable}
}

// conf is p's network configuration as Multus hands it to the plugin: the claim reference
// from the network-selection element's cni-args in args.cni, allowPersistentIPs at the top
// level when migratable. timeout bounds the ADD (a refused one waits until shortly before).
func (v vmNet) conf(p *vmPod, timeout string) []byte {
	ipam := dualStackIPAM("10.95.0.0/24", "fd95::/64")
	ipam["type"], ipam["socket"], ipam["timeout"] = "leasehold", p.node.Socket, timeout
	conf := map[string]any{"cniVersion": "1.1.0", "name": v.f.Pool, "type": "leasehold", "ipam": ipam,
		"args": map[string]any{"cni": map[string]any{"ipam-claim-reference": vmRef}}}
	if p.migratable {
		conf["allowPersistentIPs"] = true
	}
	b, err := json.Marshal(conf)
	if err != nil {
		v.t.Fatal(err)
	}
	return b
}

func (p *vmPod) args() string {
	return fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_UID=%s", vmNamespace, p.name, p.uid)
}

// add runs p's ADD and returns its addresses, or the plugin's error.
func (v vmNet) add(p *vmPod, timeout string) ([]netip.Addr, error) {
	res, err := v.f.add(v.conf(p, timeout), p.container, "eth0", p.args())
	if err != nil {
		return nil, err
	}
	return resultAddrs(res), nil
}

// mustAdd is add with the claim's addresses expected (want nil: any, as the first holder's).
func (v vmNet) mustAdd(p *vmPod, want []netip.Addr) []netip.Addr {
	v.t.Helper()
	got, err := v.add(p, "60s")
	if err != nil {
		v.t.Fatalf("ADD of %s on %s: %v", p.name, p.node.Node, err)
	}
	if len(got) != 2 || want != nil && !slices.Equal(got, want) {
		v.t.Fatalf("ADD of %s on %s got %v, want the claim's %v (IPv4 and IPv6)", p.name, p.node.Node, got, want)
	}
	return got
}

func (v vmNet) del(p *vmPod) {
	v.t.Helper()
	if err := v.f.del(v.conf(p, "60s"), p.container, "eth0", p.args()); err != nil {
		v.t.Fatalf("DEL of %s on %s: %v", p.name, p.node.Node, err)
	}
}

// refused runs p's ADD, which must wait and fail with code 11 saying each of want.
func (v vmNet) refused(p *vmPod, why string, want ...string) {
	v.t.Helper()
	got, err := v.add(p, "3s")
	if err == nil || cniCode(err) != 11 {
		v.t.Fatalf("%s: ADD of %s on %s got %v, %v; want code 11", why, p.name, p.node.Node, got, err)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			v.t.Errorf("%s: the refusal %q does not say %q", why, err, w)
		}
	}
}

// claimKeys is where the VM's claim and its addresses are in etcd, read with a client.
type claimKeys struct {
	claim      keyspace.ClaimRecord
	claimLease clientv3.LeaseID
	migration  *keyspace.LiveMigrationRecord
	migLease   clientv3.LeaseID
	allocs     map[netip.Addr]admin.AllocationEntry
	// quarantine is the lease of each address's quarantine key (absent: none), which
	// keeps it the claim's between holders.
	quarantine map[netip.Addr]clientv3.LeaseID
}

func (v vmNet) read(ips []netip.Addr) claimKeys {
	v.t.Helper()
	f, ctx := v.f, v.f.Ctx
	var k claimKeys
	claim := vmNamespace + "." + vmRef
	ckey, mkey := keyspace.ClaimKey(f.Cluster, f.Pool, claim), keyspace.LiveMigrationKey(f.Cluster, f.Pool, claim)
	if resp, err := f.Cli.Get(ctx, ckey); err != nil {
		v.t.Fatal(err)
	} else if len(resp.Kvs) > 0 {
		k.claimLease = clientv3.LeaseID(resp.Kvs[0].Lease)
		if k.claim, err = keyspace.Decode[keyspace.ClaimRecord](ckey, resp.Kvs[0].Value); err != nil {
			v.t.Fatal(err)
		}
	}
	if resp, err := f.Cli.Get(ctx, mkey); err != nil {
		v.t.Fatal(err)
	} else if len(resp.Kvs) > 0 {
		k.migLease = clientv3.LeaseID(resp.Kvs[0].Lease)
		m, err := keyspace.Decode[keyspace.LiveMigrationRecord](mkey, resp.Kvs[0].Value)
		if err != nil {
			v.t.Fatal(err)
		}
		k.migration = &m
	}
	list, err := admin.ListAllocations(ctx, f.Cli, f.Pool)
	if err != nil {
		v.t.Fatal(err)
	}
	k.allocs = map[netip.Addr]admin.AllocationEntry{}
	for _, a := range list {
		if slices.Contains(ips, a.IP) {
			k.allocs[a.IP] = a
		}
	}
	pools, err := admin.ListPools(ctx, f.Cli)
	if err != nil {
		v.t.Fatal(err)
	}
	at := slices.IndexFunc(pools, func(p allocator.PoolSpec) bool { return p.Name == f.Pool })
	if at < 0 {
		v.t.Fatalf("no pool %s", f.Pool)
	}
	k.quarantine = map[netip.Addr]clientv3.LeaseID{}
	for _, ip := range ips {
		resp, err := f.Cli.Get(ctx, keyspace.QuarantineKey(f.Pool, pools[at].Blocks, ip))
		if err != nil {
			v.t.Fatal(err)
		}
		if len(resp.Kvs) > 0 {
			k.quarantine[ip] = clientv3.LeaseID(resp.Kvs[0].Lease)
		}
	}
	return k
}

// leasesOf returns p's pod lease and claim lease, from its owner index; ok false when it has
// none.
func (v vmNet) leasesOf(p *vmPod) (pod, claim clientv3.LeaseID, ok bool) {
	v.t.Helper()
	key := keyspace.OwnerKey(v.f.Cluster, p.uid, "eth0", v.f.Pool)
	resp, err := v.f.Cli.Get(v.f.Ctx, key)
	if err != nil {
		v.t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return 0, 0, false
	}
	rec, err := keyspace.Decode[keyspace.OwnerRecord](key, resp.Kvs[0].Value)
	if err != nil {
		v.t.Fatal(err)
	}
	cl, err := keyspace.ParseLeaseHex(rec.ClaimLease)
	if err != nil {
		v.t.Fatalf("owner index of %s: claimLease %q: %v", p.name, rec.ClaimLease, err)
	}
	return clientv3.LeaseID(resp.Kvs[0].Lease), cl, true
}

// soleHolder says why p is not the claim's only holder (nil: it is): the record names it
// and is on p's claim lease, every address is allocated to it on its pod lease and rests
// under the claim on its claim lease, no migration is in progress, and none of others has
// an owner index left.
func (v vmNet) soleHolder(p *vmPod, ips []netip.Addr, others ...*vmPod) error {
	v.t.Helper()
	pod, claim, ok := v.leasesOf(p)
	if !ok {
		return fmt.Errorf("%s has no owner index", p.name)
	}
	k := v.read(ips)
	switch {
	case k.claim.Holder == nil || k.claim.Holder.Owner != p.uid || k.claim.Holder.Node != p.node.Node:
		return fmt.Errorf("claim record names %+v, want %s on %s", k.claim.Holder, p.uid, p.node.Node)
	case k.claimLease != claim:
		return fmt.Errorf("claim record on lease %x, want %s's claim lease %x", int64(k.claimLease), p.name, int64(claim))
	case k.migration != nil:
		return fmt.Errorf("a live migration key on lease %x: %+v", int64(k.migLease), *k.migration)
	}
	for _, ip := range ips {
		if a, ok := k.allocs[ip]; !ok || a.Owner != p.uid || a.BoundLease != pod {
			return fmt.Errorf("%s: allocation %+v (present %v), want %s's on its pod lease %x", ip, a.Allocation, ok, p.uid, int64(pod))
		}
		if q, ok := k.quarantine[ip]; !ok || q != claim {
			return fmt.Errorf("%s: quarantine key on lease %x (present %v), want on %s's claim lease %x",
				ip, int64(q), ok, p.name, int64(claim))
		}
	}
	for _, o := range others {
		if _, _, ok := v.leasesOf(o); ok {
			return fmt.Errorf("%s on %s still has an owner index", o.name, o.node.Node)
		}
	}
	return nil
}

// migrating checks that source holds the claim and target is its live migration's target:
// the addresses allocated to the source on its pod lease, the migration key on the target's.
func (v vmNet) migrating(source, target *vmPod, ips []netip.Addr) {
	v.t.Helper()
	spod, sclaim, ok := v.leasesOf(source)
	tpod, _, tok := v.leasesOf(target)
	if !ok || !tok {
		v.t.Fatalf("owner index of the source: %v, of the target: %v", ok, tok)
	}
	k := v.read(ips)
	if k.claim.Holder == nil || k.claim.Holder.Owner != source.uid || k.claimLease != sclaim || !k.claim.Migratable {
		v.t.Errorf("claim record %+v on lease %x, want held by %s on its claim lease %x, migratable",
			k.claim, int64(k.claimLease), source.uid, int64(sclaim))
	}
	if k.migration == nil || k.migLease != tpod || k.migration.Target.Owner != target.uid || k.migration.Target.Node != target.node.Node ||
		k.migration.Source.Owner != source.uid || k.migration.Source.Node != source.node.Node {
		v.t.Errorf("live migration key %+v on lease %x, want %s on %s from %s on %s, on the target's pod lease %x",
			k.migration, int64(k.migLease), target.uid, target.node.Node, source.uid, source.node.Node, int64(tpod))
	}
	for _, ip := range ips {
		if a := k.allocs[ip]; a.Owner != source.uid || a.BoundLease != spod {
			v.t.Errorf("%s: allocation of %q on lease %x during the migration, want the source's on %x",
				ip, a.Owner, int64(a.BoundLease), int64(spod))
		}
		if q := k.quarantine[ip]; q != sclaim {
			v.t.Errorf("%s: quarantine key on lease %x during the migration, want the source's claim lease %x", ip, int64(q), int64(sclaim))
		}
	}
}

// doctorClean runs leaseholdctl doctor, which must exit 0.
func (v vmNet) doctorClean(when string) {
	v.t.Helper()
	if code, out := doctor(v.t, v.f.Endpoint); code != 0 {
		v.t.Errorf("leaseholdctl doctor %s exits %d:\n%s", when, code, out)
	}
}

// startVMMigration starts the VM on a's node and its live migration to b's: the target's ADD,
// while the source runs, is answered the source's addresses at once.
func startVMMigration(v vmNet, a, b *agentProc) (source, target *vmPod, ips []netip.Addr) {
	v.t.Helper()
	source = v.pod(a, true)
	ips = v.mustAdd(source, nil)
	if err := v.soleHolder(source, ips); err != nil {
		v.t.Fatalf("after the VM's first ADD: %v", err)
	}
	target = v.pod(b, true)
	v.mustAdd(target, ips)
	v.migrating(source, target, ips)
	return source, target, ips
}

// TestALiveMigrationOnRealAgents: the VM's pod on node A; a pod naming the claim on a network
// without allowPersistentIPs, and a migratable one on A's own node, wait and fail as a sticky
// claim's ADD does (code 11, naming the holder); the target's ADD on node B while A's pod
// runs gets the same addresses; a third pod of the claim, on node C, is refused naming both
// holders; doctor, during the migration, names it and finds nothing wrong; the source's DEL
// leaves B the sole holder, the keys on B's leases, and doctor finds nothing wrong; its
// repeated ADD answers the same addresses.
func TestALiveMigrationOnRealAgents(t *testing.T) {
	f := newFixture(t, withAgents(3), withNetns())
	v := vmNet{t, f}
	a, b, c := f.Agents[0], f.Agents[1], f.Agents[2]
	source := v.pod(a, true)
	ips := v.mustAdd(source, nil)
	v.refused(v.pod(b, false), "a pod without migration rights", "still held by owner "+source.uid)
	v.refused(v.pod(a, true), "a second pod on the holder's node", "still held by owner "+source.uid)
	if err := v.soleHolder(source, ips); err != nil {
		t.Fatalf("after the refused ADDs: %v", err)
	}

	target := v.pod(b, true)
	v.mustAdd(target, ips)
	v.migrating(source, target, ips)
	v.refused(v.pod(c, true), "a third pod during the migration",
		source.name+" on node "+a.Node, "migrating to pod "+vmNamespace+"/"+target.name+" on node "+b.Node)
	v.migrating(source, target, ips)
	code, out := doctor(t, f.Endpoint)
	if code != 0 || !strings.Contains(out, "[live-migration]") || !strings.Contains(out, target.name) {
		t.Errorf("leaseholdctl doctor during the migration: exit %d, want 0 and a live-migration finding naming %s:\n%s", code, target.name, out)
	}

	v.del(source)
	if err := v.soleHolder(target, ips, source); err != nil {
		t.Fatalf("after the source's DEL: %v", err)
	}
	v.doctorClean("after the migration completed")
	v.mustAdd(target, ips)
}

// TestAFailedLiveMigrationOnRealAgents: the target's DEL (the migration failed) leaves the
// source on node A the sole holder, with doctor finding nothing wrong; a next migration to B
// starts at once.
func TestAFailedLiveMigrationOnRealAgents(t *testing.T) {
	f := newFixture(t, withAgents(2), withNetns())
	v := vmNet{t, f}
	a, b := f.Agents[0], f.Agents[1]
	source, target, ips := startVMMigration(v, a, b)
	v.del(target)
	if err := v.soleHolder(source, ips, target); err != nil {
		t.Fatalf("after the target's DEL: %v", err)
	}
	v.doctorClean("after the migration failed")
	next := v.pod(b, true)
	v.mustAdd(next, ips)
	v.migrating(source, next, ips)
}

// TestALiveMigrationsSourceNodeKilledOnRealAgents: node A's agent is killed (SIGKILL) during
// the migration; leases are short but B's (whose agent is frozen meanwhile, so that it cannot
// take the claim over yet). Until A's pod lease has expired, and after, before B's agent
// runs again, a pod on node C asking for the VM's addresses without the claim, and one naming
// the claim, get nothing. Thawed, B's agent takes the claim over: B holds every key on its own
// leases, the two pods of C still get nothing, and doctor finds nothing wrong.
func TestALiveMigrationsSourceNodeKilledOnRealAgents(t *testing.T) {
	f := newFixture(t, withoutAgent(), withShortLeases(), withNetns())
	v := vmNet{t, f}
	// B's pod lease outlives its agent's freeze by far; its audit, which takes the claim
	// over, runs every half of it.
	a, b, c := f.startAgent(), f.startAgent("--lease-ttl", "45s"), f.startAgent()
	source, target, ips := startVMMigration(v, a, b)
	sourceLease, _, _ := v.leasesOf(source)

	// A pod of node C asking for the VM's addresses (CNI_ARGS IP=) without the claim.
	ipam := dualStackIPAM("10.95.0.0/24", "fd95::/64")
	ipam["timeout"] = "3s"
	conf := netconf(f.Pool, c.Socket, ipam)
	// And a third pod naming the claim: migratable while the migration runs (refused naming
	// both), not migratable once B holds the claim alone (a migratable one would start B's
	// migration to C).
	nobodyElse := func(when string, third *vmPod, want string) {
		t.Helper()
		ctr, uid := f.sandbox("lh-other-"), uniq("uid-")
		res, err := f.add(conf, ctr, "eth0", fmt.Sprintf("IgnoreUnknown=1;K8S_POD_UID=%s;IP=%s,%s", uid, ips[0], ips[1]))
		if cniCode(err) != 101 { // the address is in use
			t.Errorf("%s: a pod asking for %v without the claim got %v, %v; want code 101", when, ips, res, err)
		}
		for ip, al := range v.read(ips).allocs {
			if al.Owner == uid {
				t.Errorf("%s: %s allocated to the refused pod %s", when, ip, uid)
			}
		}
		v.refused(third, when+": a third pod", want)
	}
	b.freeze(t)
	a.kill()
	migratingTo := "migrating to pod " + vmNamespace + "/" + target.name + " on node " + b.Node
	nobodyElse("node A killed", v.pod(c, true), migratingTo)
	eventually(t, "node A's pod lease expired", func() error {
		ttl, err := f.Cli.TimeToLive(f.Ctx, sourceLease)
		if err != nil {
			return err
		}
		return saw(ttl.TTL == -1, "the source's pod lease %x has %ds left", int64(sourceLease), ttl.TTL)
	})
	nobodyElse("node A's lease expired, B's agent frozen", v.pod(c, true), migratingTo)
	b.thaw(t)
	eventually(t, "B holds the claim", func() error { return v.soleHolder(target, ips, source) })
	nobodyElse("B holds the claim", v.pod(c, false), "still held by owner "+target.uid)
	v.doctorClean("after B took the claim")
	v.mustAdd(target, ips)
}
