package leases

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// Live migrations (docs/proposals/live-migration.md): a VM's claim, migratable, held by its
// source pod on one node while a target pod on another holds its addresses too. Each test
// asserts which lease every key of the claim is on after a transition, and the answers.

const vmClaim = "default.vm-a.tenantred"

// vmReq is the ADD (or DEL) of a virt-launcher pod naming the VM's migratable claim.
func vmReq(pool allocator.PoolSpec, container, uid string) allocator.Request {
	r := stickyReq(pool, container, uid, vmClaim)
	r.Pod.Name = "virt-launcher-vm-a-" + container
	r.Migratable = true
	return r
}

// liveMig is a claim's keys as a test reads them: the leases they are on (0: absent) and
// the owners of the allocations.
type liveMig struct {
	t                    *testing.T
	cli                  *clientv3.Client
	cluster, pool        string
	blocks               allocator.Blocks
	ips                  []netip.Addr
	claimKey, migKey     string
	migRev, claimRev     int64
	claimLease, migLease clientv3.LeaseID
	claim                keyspace.ClaimRecord
	mig                  keyspace.LiveMigrationRecord
	ipLeases, qLeases    []clientv3.LeaseID
	ipOwners             []string
	ipRevs               []int64
	heldLeases           []clientv3.LeaseID
	ownerLeases          map[string]clientv3.LeaseID // owner -> lease of its owner index on eth0
	ownerClaimLeases     map[string]string           // owner -> its owner index's claimLease
}

func readLiveMig(t *testing.T, cli *clientv3.Client, cluster string, pool allocator.PoolSpec, ips []netip.Addr, owners ...string) liveMig {
	t.Helper()
	ctx := ctxT(t)
	m := liveMig{t: t, cli: cli, cluster: cluster, pool: pool.Name, blocks: pool.Blocks, ips: ips,
		claimKey: keyspace.ClaimKey(cluster, pool.Name, vmClaim), migKey: keyspace.LiveMigrationKey(cluster, pool.Name, vmClaim),
		ownerLeases: map[string]clientv3.LeaseID{}, ownerClaimLeases: map[string]string{}}
	get := func(key string) (*clientv3.GetResponse, bool) {
		resp, err := cli.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return resp, len(resp.Kvs) > 0
	}
	if resp, ok := get(m.claimKey); ok {
		m.claimLease, m.claimRev = clientv3.LeaseID(resp.Kvs[0].Lease), resp.Kvs[0].ModRevision
		m.claim, _ = keyspace.Decode[keyspace.ClaimRecord](m.claimKey, resp.Kvs[0].Value)
	}
	if resp, ok := get(m.migKey); ok {
		m.migLease, m.migRev = clientv3.LeaseID(resp.Kvs[0].Lease), resp.Kvs[0].ModRevision
		m.mig, _ = keyspace.Decode[keyspace.LiveMigrationRecord](m.migKey, resp.Kvs[0].Value)
	}
	for _, ip := range ips {
		var lease, ql, hl clientv3.LeaseID
		var owner string
		var rev int64
		if resp, ok := get(keyspace.IPKey(pool.Name, pool.Blocks, ip)); ok {
			lease, rev = clientv3.LeaseID(resp.Kvs[0].Lease), resp.Kvs[0].ModRevision
			al, _ := keyspace.Decode[keyspace.Allocation]("", resp.Kvs[0].Value)
			owner = al.Owner
		}
		if resp, ok := get(keyspace.QuarantineKey(pool.Name, pool.Blocks, ip)); ok {
			ql = clientv3.LeaseID(resp.Kvs[0].Lease)
		}
		if resp, ok := get(keyspace.HeldKey(pool.Name, pool.Blocks, ip)); ok {
			hl = clientv3.LeaseID(resp.Kvs[0].Lease)
		}
		m.ipLeases, m.ipOwners, m.ipRevs = append(m.ipLeases, lease), append(m.ipOwners, owner), append(m.ipRevs, rev)
		m.qLeases, m.heldLeases = append(m.qLeases, ql), append(m.heldLeases, hl)
	}
	for _, o := range owners {
		key := keyspace.OwnerKey(cluster, o, "eth0", pool.Name)
		if resp, ok := get(key); ok {
			m.ownerLeases[o] = clientv3.LeaseID(resp.Kvs[0].Lease)
			rec, _ := keyspace.Decode[keyspace.OwnerRecord](key, resp.Kvs[0].Value)
			m.ownerClaimLeases[o] = rec.ClaimLease
		}
	}
	return m
}

// heldBy checks that owner holds every address of the claim alone: allocations on its pod
// lease, quarantine keys and the record on its claim lease, the record naming it, no
// migration key.
func (m liveMig) heldBy(owner string) {
	m.t.Helper()
	lease, ok := m.ownerLeases[owner]
	if !ok {
		m.t.Fatalf("%s has no owner index", owner)
	}
	if m.claim.Holder == nil || m.claim.Holder.Owner != owner || !m.claim.Migratable {
		m.t.Errorf("claim record %+v, want held by %s, migratable", m.claim, owner)
	}
	if m.claimLease == 0 || keyspace.LeaseHex(m.claimLease) != m.ownerClaimLeases[owner] {
		m.t.Errorf("claim record on lease %x, want %s's claim lease %s", int64(m.claimLease), owner, m.ownerClaimLeases[owner])
	}
	if m.migLease != 0 {
		m.t.Errorf("migration key on lease %x, want none", int64(m.migLease))
	}
	for i, ip := range m.ips {
		if m.ipLeases[i] != lease || m.ipOwners[i] != owner {
			m.t.Errorf("%s: allocation of %q on lease %x, want %s on its pod lease %x", ip, m.ipOwners[i], int64(m.ipLeases[i]), owner, int64(lease))
		}
		if m.qLeases[i] != m.claimLease {
			m.t.Errorf("%s: quarantine key on lease %x, want the claim's %x", ip, int64(m.qLeases[i]), int64(m.claimLease))
		}
	}
}

// startMigration makes the VM's source on a (pod u1) and its target on b (u2), and checks T1:
// the target answered the claim's addresses; its migration key, owner index and pod record on
// its pod lease; the source's keys untouched.
func startMigration(t *testing.T, cli *clientv3.Client, cluster string, a, b *Agent, pool allocator.PoolSpec) ([]netip.Addr, liveMig) {
	t.Helper()
	ctx := ctxT(t)
	src, err := a.Add(ctx, vmReq(pool, "c1", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	ips := resultAddrs(src)
	before := readLiveMig(t, cli, cluster, pool, ips, "u1")
	before.heldBy("u1")
	tgt, err := b.Add(ctx, vmReq(pool, "c2", "u2"))
	if err != nil {
		t.Fatalf("the target's ADD while the source runs: %v", err)
	}
	if got := resultAddrs(tgt); !slices.Equal(got, ips) {
		t.Fatalf("the target got %v, want the claim's %v", got, ips)
	}
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	lb := m.ownerLeases["u2"]
	if lb == 0 || lb == m.ownerLeases["u1"] {
		t.Fatalf("target's owner index on lease %x (source's %x)", int64(lb), int64(m.ownerLeases["u1"]))
	}
	if m.migLease != lb || m.mig.Target.Owner != "u2" || m.mig.Target.Node != "n2" || m.mig.Source.Owner != "u1" || m.mig.Source.Node != "n1" {
		t.Errorf("migration key on lease %x: %+v, want on the target's pod lease %x naming u2 on n2 from u1 on n1", int64(m.migLease), m.mig, int64(lb))
	}
	if m.ownerClaimLeases["u2"] == "" || m.ownerClaimLeases["u2"] != m.mig.ClaimLease || m.mig.ClaimLease == m.ownerClaimLeases["u1"] {
		t.Errorf("target's claim lease %q, migration key's %q, source's %q", m.ownerClaimLeases["u2"], m.mig.ClaimLease, m.ownerClaimLeases["u1"])
	}
	if pod, err := cli.Get(ctx, keyspace.PodKey(cluster, "n2", "u2")); err != nil || len(pod.Kvs) == 0 || clientv3.LeaseID(pod.Kvs[0].Lease) != lb {
		t.Errorf("target's pod record: %v %v, want on %x", pod, err, int64(lb))
	}
	// The source's keys keep their revisions.
	if m.claimRev != before.claimRev || !slices.Equal(m.ipRevs, before.ipRevs) {
		t.Errorf("the start changed the source's keys: claim rev %d->%d, allocations %v->%v", before.claimRev, m.claimRev, before.ipRevs, m.ipRevs)
	}
	m.ownerLeases = map[string]clientv3.LeaseID{"u1": m.ownerLeases["u1"], "u2": lb}
	before.ownerLeases, before.ownerClaimLeases = m.ownerLeases, m.ownerClaimLeases
	before.heldBy("u1")
	return ips, m
}

// TestALiveMigrationCompletesWithTheSourcesDel: T1 then T2. The source's DEL moves every key
// of the claim onto the target's leases in one transaction; the target holds the claim alone.
func TestALiveMigrationCompletesWithTheSourcesDel(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := dualStack(etcdtest.Uniq("p"), "10.81.0.0/24", "fd81::/64")
	pool.Blocks = allocator.Blocks{IPv4: 26, IPv6: 122}
	hold := func(c *Config) { c.ReuseDelay = holdDelay }
	a, b := startAgent(t, cluster, "n1", "uid1", hold), startAgent(t, cluster, "n2", "uid2", hold)
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	if _, ok := m.ownerLeases["u1"]; ok {
		t.Errorf("the source's owner index outlived its DEL")
	}
	m.heldBy("u2")
	for i, ip := range ips {
		if bb := keyspace.LeaseHex(m.heldLeases[i]); bb != started.mig.BlockLease || bb == "" {
			t.Errorf("%s: held key on lease %s, want the target node's block lease %s", ip, bb, started.mig.BlockLease)
		}
	}
	if pod, err := cli.Get(ctx, keyspace.PodKey(cluster, "n1", "u1")); err != nil || len(pod.Kvs) != 0 {
		t.Errorf("the source's pod record outlived its last attachment: %v %v", pod, err)
	}
	// The target, sole holder now, is a holder like any: its DEL releases the claim with a hold.
	if err := b.Del(ctx, vmReq(pool, "c2", "u2")); err != nil {
		t.Fatal(err)
	}
	if rec, ok := readClaimRecord(t, cli, m.claimKey); !ok || rec.Holder != nil || !slices.Equal(rec.IPs, ips) {
		t.Errorf("claim after the target's DEL: %+v %v, want released with its addresses", rec, ok)
	}
}

// TestALiveMigrationFailsWithTheTargetsDel: T1 then T3. The target's DEL deletes its own keys
// only; the source's keep their revisions.
func TestALiveMigrationFailsWithTheTargetsDel(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.82.0.0/24", 26)
	a, b := startAgent(t, cluster, "n1", "uid1"), startAgent(t, cluster, "n2", "uid2")
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	if err := b.Del(ctx, vmReq(pool, "c2", "u2")); err != nil {
		t.Fatal(err)
	}
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	if _, ok := m.ownerLeases["u2"]; ok {
		t.Errorf("the target's owner index outlived its DEL")
	}
	m.heldBy("u1")
	if m.claimRev != started.claimRev || !slices.Equal(m.ipRevs, started.ipRevs) {
		t.Errorf("the failed migration changed the source's keys: claim rev %d->%d, allocations %v->%v",
			started.claimRev, m.claimRev, started.ipRevs, m.ipRevs)
	}
	if pod, err := cli.Get(ctx, keyspace.PodKey(cluster, "n2", "u2")); err != nil || len(pod.Kvs) != 0 {
		t.Errorf("the target's pod record outlived its DEL: %v %v", pod, err)
	}
	// A next migration may start at once.
	if res, err := b.Add(ctx, vmReq(pool, "c3", "u3")); err != nil || !slices.Equal(resultAddrs(res), ips) {
		t.Fatalf("a new target after a failed migration: %v %v", res, err)
	}
}

// TestAThirdPodOfAMigratingClaimIsRefusedNamingBoth: T6. While the migration runs a third pod
// naming the claim, on a third node, waits, then fails naming the holder and the target; and
// the migration's keys are untouched.
func TestAThirdPodOfAMigratingClaimIsRefusedNamingBoth(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.83.0.0/24", 26)
	a, b, c := startAgent(t, cluster, "n1", "uid1"), startAgent(t, cluster, "n2", "uid2"), startAgent(t, cluster, "n3", "uid3")
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err := c.Add(short, vmReq(pool, "c3", "u3"))
	cancel()
	if !errors.Is(err, allocator.ErrUnavailable) {
		t.Fatalf("a third pod's ADD: %v, want ErrUnavailable", err)
	}
	for _, want := range []string{"virt-launcher-vm-a-c1 on node n1", "migrating to pod default/virt-launcher-vm-a-c2 on node n2", "a third attachment"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("a third pod's refusal %q does not say %q", err, want)
		}
	}
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2", "u3")
	if _, ok := m.ownerLeases["u3"]; ok || m.migRev != started.migRev || !slices.Equal(m.ipRevs, started.ipRevs) {
		t.Errorf("the refused ADD changed the migration: %+v", m)
	}
}

// TestAnAddOnTheHoldersNodeOrNotMigratableWaitsAsToday: a second pod of the claim on the
// holder's own node, and one on another node whose configuration is not migratable, are no
// migration's target: each waits, then fails naming the holder, as a sticky claim's ADD does.
// So is one whose claim was made without migratable, however the request is configured.
func TestAnAddOnTheHoldersNodeOrNotMigratableWaitsAsToday(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.84.0.0/24", 26)
	a, b := startAgent(t, cluster, "n1", "uid1"), startAgent(t, cluster, "n2", "uid2")
	if _, err := a.Add(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	plain := vmReq(pool, "c3", "u3")
	plain.Migratable = false
	for _, tc := range []struct {
		name string
		on   *Agent
		req  allocator.Request
	}{
		{"same node", a, vmReq(pool, "c2", "u2")},
		{"not migratable", b, plain},
	} {
		short, cancel := context.WithTimeout(ctx, 3*time.Second)
		_, err := tc.on.Add(short, tc.req)
		cancel()
		if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), "still held by owner u1") {
			t.Errorf("%s: %v, want ErrUnavailable naming u1 as the holder", tc.name, err)
		}
	}
	if resp, err := cli.Get(ctx, keyspace.LiveMigrationKey(cluster, pool.Name, vmClaim)); err != nil || len(resp.Kvs) != 0 {
		t.Errorf("a migration key after refused ADDs: %v %v", resp, err)
	}
	// A claim made without migratable is migrated by no request.
	first := stickyReq(pool, "c4", "u4", "default.vm-b")
	if _, err := a.Add(ctx, first); err != nil {
		t.Fatal(err)
	}
	next := stickyReq(pool, "c5", "u5", "default.vm-b")
	next.Migratable = true
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err := b.Add(short, next)
	cancel()
	if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), "still held by owner u4") {
		t.Errorf("a migratable ADD of a claim made without migratable: %v, want it to wait as today", err)
	}
}

// TestARepeatedTargetAddAndARestartKeepTheMigration: the target's ADD repeated, and repeated
// again after its agent restarted (its journal marks the attachment a target), answers the
// same addresses and writes nothing; its CHECK accepts addresses held on its source's lease;
// and the restarted agent's audit leaves the source's keys alone.
func TestARepeatedTargetAddAndARestartKeepTheMigration(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.86.0.0/24", 26)
	state := t.TempDir()
	withState := func(c *Config) { c.StateDir = state }
	a := startAgent(t, cluster, "n1", "uid1")
	b := startAgent(t, cluster, "n2", "uid2", withState, auditFast)
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	check := func(b *Agent, when string) {
		t.Helper()
		again, err := b.Add(ctx, vmReq(pool, "c2", "u2"))
		if err != nil || !slices.Equal(resultAddrs(again), ips) {
			t.Fatalf("%s: repeated target ADD: %v %v, want %v", when, resultAddrs(again), err, ips)
		}
		if res, err := b.Check(ctx, vmReq(pool, "c2", "u2")); err != nil || !slices.Equal(resultAddrs(res), ips) {
			t.Errorf("%s: the target's CHECK: %v %v", when, res, err)
		}
		m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
		if m.migRev != started.migRev || m.claimRev != started.claimRev || !slices.Equal(m.ipRevs, started.ipRevs) {
			t.Errorf("%s: the repeated ADD changed keys: %+v, started %+v", when, m, started)
		}
	}
	check(b, "running")
	// The source's ADD repeated is answered its addresses as before.
	if res, err := a.Add(ctx, vmReq(pool, "c1", "u1")); err != nil || !slices.Equal(resultAddrs(res), ips) {
		t.Fatalf("the source's repeated ADD during the migration: %v %v, want %v", res, err, ips)
	}
	b.Close()
	b = startAgent(t, cluster, "n2", "uid2", withState, auditFast)
	check(b, "restarted")
	// Audits of the restarted agent run; none touches the source's keys, and the target's stay.
	etcdtest.EventuallyTrue(t, "two audits of the restarted agent", func() bool { return metricValue(t, b, "leasehold_key_audits_total") >= 2 })
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	if m.migRev != started.migRev || !slices.Equal(m.ipRevs, started.ipRevs) || m.claimRev != started.claimRev {
		t.Errorf("after the restarted agent's audits: %+v, started %+v", m, started)
	}
	// The restarted target completes the migration as before.
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	readLiveMig(t, cli, cluster, pool, ips, "u2").heldBy("u2")
}

// TestAMigratableClaimsHoldMustCoverTwoPodTTLs: a migratable claim whose hold is shorter than
// twice the pod TTL is refused (code 7), naming both; the same hold without migratable is not.
func TestAMigratableClaimsHoldMustCoverTwoPodTTLs(t *testing.T) {
	cluster, ctx := etcdtest.Uniq("c"), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.87.0.0/24", 26)
	a := startAgent(t, cluster, "n1", "uid1")
	req := vmReq(pool, "c1", "u1")
	req.ClaimHold = 15 * time.Second // the agents' lease TTL is 10 s
	_, err := a.Add(ctx, req)
	if !errors.Is(err, allocator.ErrInvalidConfig) || !strings.Contains(err.Error(), "stickyHold 15s") || !strings.Contains(err.Error(), "lease TTL 10s") {
		t.Errorf("ADD of a migratable claim held 15 s: %v, want ErrInvalidConfig naming 15s and 10s", err)
	}
	req.Migratable = false
	if _, err := a.Add(ctx, req); err != nil {
		t.Errorf("the same hold, not migratable: %v", err)
	}
}

// TestATargetTakesTheClaimWhenItsSourcesNodeDies: T4. The source's agent stops and its pod
// lease expires (revoked here, as etcd does a TTL later) while the target's agent is away
// (restarting, its journal marking the attachment a target): meanwhile a third pod naming the
// claim, and one asking for the address without it, get nothing. Back, the target's agent
// moves every key of the claim onto its own leases before the claim's hold runs out; a pod
// naming the claim without migratable, or asking for the address, still gets nothing.
func TestATargetTakesTheClaimWhenItsSourcesNodeDies(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.88.0.0/24", 26)
	state := t.TempDir()
	// The target's pod lease outlives its agent's restart by far.
	bcfg := func(c *Config) { c.StateDir, c.LeaseTTL = state, 30*time.Second }
	a := startAgent(t, cluster, "n1", "uid1")
	b := startAgent(t, cluster, "n2", "uid2", bcfg, auditFast)
	c := startAgent(t, cluster, "n3", "uid3")
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	b.Close()
	a.Close()
	if _, err := cli.Revoke(ctx, started.ownerLeases["u1"]); err != nil {
		t.Fatal(err)
	}
	third := func(when string, req allocator.Request) {
		t.Helper()
		short, cancel := context.WithTimeout(ctx, 3*time.Second)
		res, err := c.Add(short, req)
		cancel()
		if !errors.Is(err, allocator.ErrUnavailable) {
			t.Errorf("%s: a third pod's ADD: %v %v, want ErrUnavailable", when, resultAddrs(res), err)
		}
		other := addReq(pool, "c4", "eth0", "u4")
		other.RequestedIPs = ips
		if res, err := c.Add(ctx, other); err == nil {
			t.Errorf("%s: another pod got the claim's address %v", when, resultAddrs(res))
		}
	}
	third("the source expired", vmReq(pool, "c3", "u3"))
	if m := readLiveMig(t, cli, cluster, pool, ips); m.migRev != started.migRev || m.claimRev != started.claimRev {
		t.Fatalf("the migration changed while its target's agent was away: %+v", m)
	}
	b = startAgent(t, cluster, "n2", "uid2", bcfg, auditFast)
	etcdtest.EventuallyTrue(t, "the target promoted", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips, "u2")
		return m.migLease == 0 && len(m.ipOwners) > 0 && m.ipOwners[0] == "u2"
	})
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	if _, ok := m.ownerLeases["u1"]; ok {
		t.Errorf("the source's owner index outlived its lease")
	}
	m.heldBy("u2")
	if got := liveCount(t, b, "leasehold_live_migrations_completed_total", LiveMigrationSourceExpired); got != 1 {
		t.Errorf("completed{source_expired} on the target's node: %v, want 1", got)
	}
	plain := vmReq(pool, "c3", "u3")
	plain.Migratable = false
	third("the target promoted", plain)
	// The target holds the claim as any holder: its audit finds its keys right (nothing put
	// back), and its DEL releases the claim with a hold.
	before := metricValue(t, b, "leasehold_pod_keys_lost_total")
	audits := metricValue(t, b, "leasehold_key_audits_total")
	etcdtest.EventuallyTrue(t, "two more audits", func() bool { return metricValue(t, b, "leasehold_key_audits_total") >= audits+2 })
	if lost := metricValue(t, b, "leasehold_pod_keys_lost_total"); lost != before {
		t.Errorf("the promoted target's audits found %v keys lost", lost-before)
	}
	if err := b.Del(ctx, vmReq(pool, "c2", "u2")); err != nil {
		t.Fatal(err)
	}
	if rec, ok := readClaimRecord(t, cli, m.claimKey); !ok || rec.Holder != nil {
		t.Errorf("claim after the promoted target's DEL: %+v %v, want released", rec, ok)
	}
}

// TestATargetsNodeDyingLeavesTheSourceHoldingTheClaim: T5. The target's agent stops and its
// pod lease expires (revoked here): its migration key, owner index and pod record go with it,
// the source's keys are untouched, the next target on a third node starts at once, and the
// source's DEL then completes the migration to that one.
func TestATargetsNodeDyingLeavesTheSourceHoldingTheClaim(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.89.0.0/24", 26)
	a, b, c := startAgent(t, cluster, "n1", "uid1"), startAgent(t, cluster, "n2", "uid2"), startAgent(t, cluster, "n3", "uid3")
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	b.Close()
	if _, err := cli.Revoke(ctx, started.ownerLeases["u2"]); err != nil {
		t.Fatal(err)
	}
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	m.heldBy("u1")
	if m.claimRev != started.claimRev || !slices.Equal(m.ipRevs, started.ipRevs) {
		t.Errorf("the target's death changed the source's keys: %+v, started %+v", m, started)
	}
	if res, err := c.Add(ctx, vmReq(pool, "c3", "u3")); err != nil || !slices.Equal(resultAddrs(res), ips) {
		t.Fatalf("the next target after the first one's death: %v %v", res, err)
	}
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	readLiveMig(t, cli, cluster, pool, ips, "u1", "u3").heldBy("u3")
}
