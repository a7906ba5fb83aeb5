package leases

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

// The live migrations' metrics and the audits' duties (docs/proposals/live-migration.md,
// "Audits" and "Where it shows").

// liveCount is the value of a live migration counter of a, with how for the labelled ones.
func liveCount(t *testing.T, a *Agent, name, how string) float64 {
	t.Helper()
	mfs, err := a.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) == 0 && how == "" || len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == how {
				return m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no metric %s{how=%q}", name, how)
	return 0
}

// completesAfter checks that what taking the migration up again did (m, read after it) left
// the source's keys as they were when it started, and that the source's DEL (on a) then
// completes it to the target u2.
func completesAfter(t *testing.T, what string, a *Agent, cli *clientv3.Client, cluster string, pool allocator.PoolSpec,
	ips []netip.Addr, m, started liveMig) {
	t.Helper()
	if m.claimRev != started.claimRev || !slices.Equal(m.ipRevs, started.ipRevs) {
		t.Errorf("%s changed the source's keys: %+v, started %+v", what, m, started)
	}
	if err := a.Del(ctxT(t), vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	readLiveMig(t, cli, cluster, pool, ips, "u2").heldBy("u2")
}

// TestLiveMigrationsAreCountedOnBothNodes: each transition is counted by the agent the
// proposal names: a start (T1) and a failure by the target's DEL (T3) on the target's node, a
// third pod refused (T6) on its node (in the sticky refusals too), a target's death (T5) by
// the source's audit, a completion by the source's DEL (T2) on the source's node; both nodes'
// gauges show the migration in progress and its age, and none once it ended.
func TestLiveMigrationsAreCountedOnBothNodes(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.91.0.0/24", 26)
	a := startAgent(t, cluster, "n1", "uid1", auditFast)
	b := startAgent(t, cluster, "n2", "uid2", auditFast)
	c := startAgent(t, cluster, "n3", "uid3", auditFast)
	const (
		started    = "leasehold_live_migrations_started_total"
		completed  = "leasehold_live_migrations_completed_total"
		failed     = "leasehold_live_migrations_failed_total"
		refused    = "leasehold_live_migrations_refused_total"
		inProgress = "leasehold_live_migrations_in_progress"
		oldest     = "leasehold_live_migration_oldest_seconds"
	)
	want := func(x *Agent, node, name, how string, v float64) {
		t.Helper()
		etcdtest.EventuallyTrue(t, node+" "+name+" "+how, func() bool { return liveCount(t, x, name, how) == v })
	}
	ips, _ := startMigration(t, cli, cluster, a, b, pool)
	want(b, "n2", started, "", 1)
	want(b, "n2", inProgress, "", 1)
	want(a, "n1", inProgress, "", 1) // the source's audit read it
	if got := liveCount(t, a, started, ""); got != 0 {
		t.Errorf("the source's node counted %v starts, want 0 (the target's counts it)", got)
	}
	if age := liveCount(t, b, oldest, ""); age <= 0 || age > 600 {
		t.Errorf("%s on the target's node: %v, want the migration's age", oldest, age)
	}
	if got := liveCount(t, b, "leasehold_live_migrations_too_old", ""); got != 0 {
		t.Errorf("a migration of seconds counted too old within the default bound of an hour: %v", got)
	}
	// T6: refused on the third pod's node, in both counters.
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err := c.Add(short, vmReq(pool, "c9", "u9"))
	cancel()
	if !errors.Is(err, allocator.ErrUnavailable) {
		t.Fatalf("a third pod's ADD: %v", err)
	}
	want(c, "n3", refused, "", 1)
	want(c, "n3", "leasehold_claim_handovers_refused_total", "", 1)
	// T3: the target's DEL.
	if err := b.Del(ctx, vmReq(pool, "c2", "u2")); err != nil {
		t.Fatal(err)
	}
	want(b, "n2", failed, LiveMigrationTargetDeleted, 1)
	want(b, "n2", inProgress, "", 0)
	want(a, "n1", inProgress, "", 0)
	audits := metricValue(t, a, "leasehold_key_audits_total")
	etcdtest.EventuallyTrue(t, "two more audits on n1", func() bool { return metricValue(t, a, "leasehold_key_audits_total") >= audits+2 })
	if got := liveCount(t, a, failed, LiveMigrationTargetExpired); got != 0 {
		t.Errorf("the source's node counted the target's DEL as its death: %v", got)
	}
	// T5: a next target, on n3, dies (its pod and node leases expire: revoked here) once the
	// source's audit saw it.
	if _, err := c.Add(ctx, vmReq(pool, "c3", "u3")); err != nil {
		t.Fatal(err)
	}
	want(a, "n1", inProgress, "", 1)
	lc := readLiveMig(t, cli, cluster, pool, ips, "u3").ownerLeases["u3"]
	c.Close()
	nodeRec, err := cli.Get(ctx, keyspace.NodeKey(cluster, "n3"))
	if err != nil || len(nodeRec.Kvs) == 0 {
		t.Fatalf("n3's node record: %v %v", nodeRec, err)
	}
	for _, l := range []clientv3.LeaseID{lc, clientv3.LeaseID(nodeRec.Kvs[0].Lease)} {
		if _, err := cli.Revoke(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	want(a, "n1", failed, LiveMigrationTargetExpired, 1)
	want(a, "n1", inProgress, "", 0)
	if got := liveCount(t, a, failed, LiveMigrationTargetDeleted); got != 0 {
		t.Errorf("the source's node counted a target's DEL: %v", got)
	}
	// T2: a third target, on n2, and the source's DEL.
	if _, err := b.Add(ctx, vmReq(pool, "c4", "u4")); err != nil {
		t.Fatal(err)
	}
	want(b, "n2", started, "", 2)
	want(a, "n1", inProgress, "", 1)
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	want(a, "n1", completed, LiveMigrationSourceDeleted, 1)
	want(a, "n1", inProgress, "", 0)
	want(b, "n2", inProgress, "", 0)
	if got := liveCount(t, a, failed, LiveMigrationTargetExpired); got != 1 {
		t.Errorf("the completed migration counted as a target's death too: %v", got)
	}
}

// TestATargetsAuditWritesItsMissingMigrationKeyAgain: the target's migration key deleted by
// hand while its source runs is written again by the target's audit, on its pod lease, naming
// it and its source; the source's keys keep their revisions, and the source's DEL then
// completes the migration to the target.
func TestATargetsAuditWritesItsMissingMigrationKeyAgain(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.92.0.0/24", 26)
	hold := func(c *Config) { c.ReuseDelay = holdDelay }
	a := startAgent(t, cluster, "n1", "uid1", hold)
	b := startAgent(t, cluster, "n2", "uid2", hold, auditFast)
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	if _, err := cli.Delete(ctx, started.migKey); err != nil {
		t.Fatal(err)
	}
	etcdtest.EventuallyTrue(t, "the migration key written again", func() bool {
		return readLiveMig(t, cli, cluster, pool, ips).migLease != 0
	})
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	if m.migLease != started.migLease || m.mig.Target != started.mig.Target || m.mig.Source != started.mig.Source ||
		m.mig.ClaimLease != started.mig.ClaimLease || m.mig.BlockLease != started.mig.BlockLease || m.mig.BlockLease == "" {
		t.Errorf("migration key written again on %x as %+v, want on %x as %+v", int64(m.migLease), m.mig, int64(started.migLease), started.mig)
	}
	completesAfter(t, "writing the key again", a, cli, cluster, pool, ips, m, started)
}

// TestATargetsAuditPutsItsMigrationKeyBackOnItsPodLease: the target's migration key put
// again by hand with its own value but on no lease (etcdctl put) would outlive the target's
// pod: its audit puts it back on the target's pod lease, and the source's DEL then completes
// the migration to the target.
func TestATargetsAuditPutsItsMigrationKeyBackOnItsPodLease(t *testing.T) {
	cluster, cli, ctx, pool, a, _, ips, started := migratingPair(t, "10.99.0.0/24")
	resp, err := cli.Get(ctx, started.migKey)
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatalf("read %s: %v %v", started.migKey, resp, err)
	}
	if _, err := cli.Put(ctx, started.migKey, string(resp.Kvs[0].Value)); err != nil {
		t.Fatal(err)
	}
	etcdtest.EventuallyTrue(t, "the migration key back on the target's pod lease", func() bool {
		return readLiveMig(t, cli, cluster, pool, ips).migLease == started.migLease
	})
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	if m.mig != started.mig {
		t.Errorf("migration key put back as %+v, want %+v", m.mig, started.mig)
	}
	completesAfter(t, "putting the key back", a, cli, cluster, pool, ips, m, started)
}

// TestATargetCompletedBeforeItsOwnMigrationIsRecordedTheHolder: a migration completed by
// its source's DEL (T2) and, before the target's audit recorded that, a new migration from
// the target (now the holder) to a third node started: the target's audit records it the
// holder all the same, so that its keys are kept as a holder's and a re-claim of its pod does
// not take it for a target (of its own target).
func TestATargetCompletedBeforeItsOwnMigrationIsRecordedTheHolder(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.98.0.0/24", 26)
	a := startAgent(t, cluster, "n1", "uid1")
	b := startAgent(t, cluster, "n2", "uid2", func(c *Config) { c.AuditInterval = c.LeaseTTL }) // its audit, run below
	c := startAgent(t, cluster, "n3", "uid3")
	ips, _ := startMigration(t, cli, cluster, a, b, pool)
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	readLiveMig(t, cli, cluster, pool, ips, "u2").heldBy("u2")
	if _, err := c.Add(ctx, vmReq(pool, "c3", "u3")); err != nil {
		t.Fatalf("the ADD of a migration's target from the new holder: %v", err)
	}
	if err := b.sticky.KeepTargets(ctx, map[string]allocator.Blocks{pool.Name: pool.Blocks}); err != nil {
		t.Fatal(err)
	}
	ps, ok := b.pods.Snapshot("u2")
	if !ok || len(ps.Attachments) != 1 || ps.Attachments[0].Target {
		t.Errorf("the holder u2 in its node's pod book: %v %+v, want one attachment, not a target", ok, ps.Attachments)
	}
	if m := readLiveMig(t, cli, cluster, pool, ips, "u2", "u3"); m.mig.Target.Owner != "u3" || m.mig.Source.Owner != "u2" {
		t.Errorf("migration key %+v, want from u2 to u3", m.mig)
	}
}

// TestASourceItsTargetDisplacedIsDeletedDuringTheNextMigration: the source's node away
// longer than the TTL (its pod lease expired), its target is promoted (T4) and starts a
// migration of its own to a third node; the source, back, re-claims its pod in conflict. Its
// DEL, neither the claim's holder's nor the migration's target's, releases it and nothing of
// the claim, and leaves the migration as it was.
func TestASourceItsTargetDisplacedIsDeletedDuringTheNextMigration(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.97.0.0/24", 26)
	state := t.TempDir()
	acfg := func(c *Config) { c.StateDir = state }
	a := startAgent(t, cluster, "n1", "uid1", acfg)
	b := startAgent(t, cluster, "n2", "uid2", auditFast)
	c := startAgent(t, cluster, "n3", "uid3")
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	crash(a)
	if _, err := cli.Revoke(ctx, started.ownerLeases["u1"]); err != nil {
		t.Fatal(err)
	}
	etcdtest.EventuallyTrue(t, "the target promoted", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips)
		return m.claim.Holder != nil && m.claim.Holder.Owner == "u2" && m.migLease == 0
	})
	if _, err := c.Add(ctx, vmReq(pool, "c3", "u3")); err != nil {
		t.Fatalf("the ADD of the new holder's migration target: %v", err)
	}
	before := readLiveMig(t, cli, cluster, pool, ips, "u2", "u3")
	a = startAgent(t, cluster, "n1", "uid1", acfg)
	etcdtest.EventuallyTrue(t, "the source re-claimed in conflict", func() bool {
		resp, err := cli.Get(ctx, keyspace.ConflictKey(cluster, "u1", "eth0", pool.Name))
		return err == nil && len(resp.Kvs) > 0
	})
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatalf("the displaced source's DEL: %v", err)
	}
	after := readLiveMig(t, cli, cluster, pool, ips, "u2", "u3")
	if after.migRev != before.migRev || after.claimRev != before.claimRev || !slices.Equal(after.ipRevs, before.ipRevs) {
		t.Errorf("the displaced source's DEL changed the migration: %+v, before %+v", after, before)
	}
	if resp, err := cli.Get(ctx, keyspace.OwnerKey(cluster, "u1", "eth0", pool.Name)); err != nil || len(resp.Kvs) > 0 {
		t.Errorf("the displaced source's owner index after its DEL: %v %v", resp, err)
	}
}

// TestATargetWithoutItsMigrationKeyTakesTheClaimWhenItsSourceIsGone: the migration key gone
// (deleted by hand) and then the source's pod lease (its node died): the target's audit takes
// the claim over as a hand-over, every key onto its own leases, rather than leaving the
// claim's addresses to run out with the hold while its pod uses them.
func TestATargetWithoutItsMigrationKeyTakesTheClaimWhenItsSourceIsGone(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.93.0.0/24", 26)
	a := startAgent(t, cluster, "n1", "uid1")
	state := t.TempDir()
	bcfg := func(c *Config) { c.StateDir, c.LeaseTTL = state, 30*time.Second }
	b := startAgent(t, cluster, "n2", "uid2", bcfg, auditFast)
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	b.Close() // away while both go
	a.Close()
	if _, err := cli.Delete(ctx, started.migKey); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, started.ownerLeases["u1"]); err != nil {
		t.Fatal(err)
	}
	b = startAgent(t, cluster, "n2", "uid2", bcfg, auditFast)
	etcdtest.EventuallyTrue(t, "the target took the claim", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips)
		return len(m.ipOwners) > 0 && m.ipOwners[0] == "u2"
	})
	readLiveMig(t, cli, cluster, pool, ips, "u2").heldBy("u2")
	if got := liveCount(t, b, "leasehold_live_migrations_completed_total", LiveMigrationSourceExpired); got != 1 {
		t.Errorf("completed{source_expired} on the target's node: %v, want 1", got)
	}
}

// migratingPair starts a cluster of two agents, n1 holding a migratable claim in a new pool
// of subnet and n2 (auditing fast) its live migration's target, as most tests here begin;
// mod changes both agents' configuration.
func migratingPair(t *testing.T, subnet string, mod ...func(*Config)) (cluster string, cli *clientv3.Client, ctx context.Context,
	pool allocator.PoolSpec, a, b *Agent, ips []netip.Addr, started liveMig) {
	cluster, cli, ctx = etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool = v4Pool(etcdtest.Uniq("p"), subnet, 26)
	a = startAgent(t, cluster, "n1", "uid1", mod...)
	b = startAgent(t, cluster, "n2", "uid2", append(mod, auditFast)...)
	ips, started = startMigration(t, cli, cluster, a, b, pool)
	return cluster, cli, ctx, pool, a, b, ips, started
}

// TestATargetWhosePodLeaseIsLostTakesItsMigrationUpAgain: the target's pod lease revoked
// (its keys gone with it) while the source runs: the target's re-claim writes its migration
// key and owner index again on its new lease, records no conflict against its own source,
// leaves the source's keys as they were, and the source's DEL then completes the migration.
func TestATargetWhosePodLeaseIsLostTakesItsMigrationUpAgain(t *testing.T) {
	cluster, cli, ctx, pool, a, _, ips, started := migratingPair(t, "10.94.0.0/24")
	m := reclaimedAfterRevoking(t, cli, cluster, pool, ips, started.ownerLeases["u2"])
	if m.mig.Target.Owner != "u2" || m.mig.Target.LeaseID != keyspace.LeaseHex(m.migLease) || m.mig.Source != started.mig.Source {
		t.Errorf("migration key after the re-claim: %+v on %x", m.mig, int64(m.migLease))
	}
	if resp, err := cli.Get(ctx, keyspace.ConflictKey(cluster, "u2", "eth0", pool.Name)); err != nil || len(resp.Kvs) != 0 {
		t.Errorf("the re-claimed target recorded a conflict against its source: %v %v", resp, err)
	}
	completesAfter(t, "the target's re-claim", a, cli, cluster, pool, ips, m, started)
}

// TestATargetReclaimedAfterItsSourceWentTakesTheClaim: the source's node dies and the
// target's pod lease is lost too: the target's re-claim takes the claim over, every key on
// its own leases, rather than re-claiming the addresses as any pod's with the claim left
// naming the dead source.
func TestATargetReclaimedAfterItsSourceWentTakesTheClaim(t *testing.T) {
	cluster, cli, ctx, pool, a, _, ips, started := migratingPair(t, "10.95.0.0/24")
	a.Close()
	for _, l := range []clientv3.LeaseID{started.ownerLeases["u1"], started.ownerLeases["u2"]} {
		if _, err := cli.Revoke(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	etcdtest.EventuallyTrue(t, "the target re-claimed", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips, "u2")
		return m.ownerLeases["u2"] != 0 && len(m.ipOwners) > 0 && m.ipOwners[0] == "u2"
	})
	readLiveMig(t, cli, cluster, pool, ips, "u2").heldBy("u2")
	if resp, err := cli.Get(ctx, keyspace.ConflictKey(cluster, "u2", "eth0", pool.Name)); err != nil || len(resp.Kvs) != 0 {
		t.Errorf("the re-claimed target recorded a conflict: %v %v", resp, err)
	}
}

// TestAMigrationKeyARestoreBroughtBackForADeletedTargetIsDeleted: the target's DEL ended the
// migration (T3); a restore of a backup from before it brings the migration key back, on a
// lease nobody renews. The target's agent, told etcd went back, deletes it, so a next target
// starts at once rather than being refused as a third pod until that lease runs out.
func TestAMigrationKeyARestoreBroughtBackForADeletedTargetIsDeleted(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.96.0.0/24", 26)
	a := startAgent(t, cluster, "n1", "uid1")
	b := startAgent(t, cluster, "n2", "uid2", withHold(t.TempDir()), auditFast)
	c := startAgent(t, cluster, "n3", "uid3")
	ips, started := startMigration(t, cli, cluster, a, b, pool)
	before, err := cli.Get(ctx, started.migKey)
	if err != nil || len(before.Kvs) == 0 {
		t.Fatalf("migration key: %v %v", before, err)
	}
	if err := b.Del(ctx, vmReq(pool, "c2", "u2")); err != nil {
		t.Fatal(err)
	}
	g, err := cli.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, started.migKey, string(before.Kvs[0].Value), clientv3.WithLease(g.ID)); err != nil {
		t.Fatal(err)
	}
	b.notices.WentBack("a test's restore") // not told to the package's other agents (restorenotice/restored.go)
	etcdtest.EventuallyTrue(t, "the restored migration key deleted", func() bool {
		return readLiveMig(t, cli, cluster, pool, ips).migLease == 0
	})
	readLiveMig(t, cli, cluster, pool, ips, "u1").heldBy("u1")
	if res, err := c.Add(ctx, vmReq(pool, "c3", "u3")); err != nil || !slices.Equal(resultAddrs(res), ips) {
		t.Fatalf("a next target after the stale key went: %v %v", resultAddrs(res), err)
	}
}

// targetAt is owner's attachment on eth0 in a's pod book.
func targetAt(t *testing.T, a *Agent, owner string) podbook.Attachment {
	t.Helper()
	ps, ok := a.pods.Snapshot(owner)
	if !ok || len(ps.Attachments) != 1 {
		t.Fatalf("%s in the pod book: %+v (present %v)", owner, ps, ok)
	}
	return ps.Attachments[0]
}

// TestATargetReclaimedWithoutItsClaimLeaseNamesOneEtcdHas: a restore of a backup from before
// the migration's start takes the target's pod and claim leases (revoked here): the target's
// re-claim writes its migration key again naming a claim lease granted anew, not the lost
// one, so that the source's DEL (T2) moves the claim onto it rather than release it from
// under the running target (issue 35, chaos seed 4).
func TestATargetReclaimedWithoutItsClaimLeaseNamesOneEtcdHas(t *testing.T) {
	cluster, cli, ctx, pool, a, b, ips, started := migratingPair(t, "10.89.0.0/24")
	lc, err := keyspace.ParseLeaseHex(started.mig.ClaimLease)
	if err != nil {
		t.Fatal(err)
	}
	m := reclaimedAfterRevoking(t, cli, cluster, pool, ips, started.ownerLeases["u2"], lc)
	nc, err := keyspace.ParseLeaseHex(m.mig.ClaimLease)
	if err != nil || nc == lc || m.ownerClaimLeases["u2"] != m.mig.ClaimLease {
		t.Fatalf("migration key names claim lease %s (lost one %s, owner index's %s): %v", m.mig.ClaimLease,
			keyspace.LeaseHex(lc), m.ownerClaimLeases["u2"], err)
	}
	if ttl, err := cli.TimeToLive(ctx, nc); err != nil || ttl.TTL <= 0 {
		t.Fatalf("the claim lease the migration key names: %v %v, want one etcd has", ttl, err)
	}
	if at := targetAt(t, b, "u2"); at.ClaimLease != nc || !at.Target {
		t.Errorf("the target in the pod book: claim lease %s, target %v; want %s, a target", keyspace.LeaseHex(at.ClaimLease), at.Target,
			keyspace.LeaseHex(nc))
	}
	completesAfter(t, "the target's re-claim", a, cli, cluster, pool, ips, m, started)
	if got := liveCount(t, a, "leasehold_live_migrations_completed_total", LiveMigrationSourceDeleted); got != 1 {
		t.Errorf("completed{source_deleted} on the source's node: %v, want 1 (T2)", got)
	}
}

// TestATargetWhoseSourceReleasedTheClaimTakesIt: the target's claim lease lost (revoked
// here, as a restore takes it), the source's DEL cannot move the claim onto it and releases
// the claim as without a migration: no holder, its addresses resting under it. The target's
// audit takes it as a hand-over, every key onto its own leases (a new claim lease), rather
// than leave the running VM's addresses to any pod once the hold runs out (issue 35).
func TestATargetWhoseSourceReleasedTheClaimTakesIt(t *testing.T) {
	cluster, cli, ctx, pool, a, b, ips, started := migratingPair(t, "10.88.0.0/24")
	lc, err := keyspace.ParseLeaseHex(started.mig.ClaimLease)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, lc); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	etcdtest.EventuallyTrue(t, "the target took the claim", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips)
		return m.claim.Holder != nil && m.claim.Holder.Owner == "u2"
	})
	m := readLiveMig(t, cli, cluster, pool, ips, "u2")
	m.heldBy("u2")
	if m.claimLease == lc {
		t.Errorf("the claim taken on the lost lease %s", keyspace.LeaseHex(lc))
	}
	if at := targetAt(t, b, "u2"); at.Target || at.ClaimLease != m.claimLease {
		t.Errorf("the target in the pod book: target %v, claim lease %s; want promoted, on %s", at.Target,
			keyspace.LeaseHex(at.ClaimLease), keyspace.LeaseHex(m.claimLease))
	}
	if got := liveCount(t, b, "leasehold_live_migrations_completed_total", LiveMigrationSourceDeleted); got != 1 {
		t.Errorf("completed{source_deleted} on the target's node: %v, want 1", got)
	}
}

// TestATargetWhoseSourceReleasedTheClaimTakesItOnALiveBlockLease: the target node's block
// lease, the one its migration key names, revoked by hand with no block claim of the node on
// it (nothing the audit checks finds it gone, and the keeper renews it next a third of its
// TTL away), then the source's DEL at once: T2 refused (lease not found), the claim released.
// The target's audit takes it as a hand-over within an audit or two, its held keys on a block
// lease etcd has and its agent renews, rather than fail on the lost one until the keeper
// finds it gone (issue 35).
func TestATargetWhoseSourceReleasedTheClaimTakesItOnALiveBlockLease(t *testing.T) {
	hold := func(c *Config) { c.ReuseDelay = holdDelay } // a block lease renewed every 155 s
	cluster, cli, ctx, pool, a, b, ips, started := migratingPair(t, "10.84.0.0/24", hold)
	bl := lostLease(t, started.mig.BlockLease)
	if bl == 0 {
		t.Fatalf("the migration key names no block lease: %+v", started.mig)
	}
	if _, err := cli.Revoke(ctx, bl); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	if got := liveCount(t, a, "leasehold_live_migrations_completed_total", LiveMigrationSourceDeleted); got != 0 {
		t.Fatalf("completed{source_deleted} on the source's node: %v, want 0 (T2 refused: its block lease is gone)", got)
	}
	etcdtest.EventuallyTrue(t, "the target took the claim", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips)
		return m.claim.Holder != nil && m.claim.Holder.Owner == "u2"
	})
	m := readLiveMig(t, cli, cluster, pool, ips, "u2")
	m.heldBy("u2")
	for i, ip := range ips {
		l := m.heldLeases[i]
		if l == bl || l == 0 {
			t.Errorf("%s: held key on lease %s, want on the target node's live block lease", ip, keyspace.LeaseHex(l))
			continue
		}
		if ttl, err := cli.TimeToLive(ctx, l); err != nil || ttl.TTL <= 0 || !b.keeper.Holds(l) {
			t.Errorf("%s: held key on lease %s: %v %v, renewed by the target's agent %v; want one etcd has, renewed", ip,
				keyspace.LeaseHex(l), ttl, err, b.keeper.Holds(l))
		}
	}
	for _, l := range []clientv3.LeaseID{m.claimLease, m.ownerLeases["u2"]} {
		if ttl, err := cli.TimeToLive(ctx, l); err != nil || ttl.TTL <= 0 || !b.keeper.Holds(l) {
			t.Errorf("lease %s of the claim's keys: %v %v, renewed by the target's agent %v; want one etcd has, renewed",
				keyspace.LeaseHex(l), ttl, err, b.keeper.Holds(l))
		}
	}
	if got := liveCount(t, b, "leasehold_live_migrations_completed_total", LiveMigrationSourceDeleted); got != 1 {
		t.Errorf("completed{source_deleted} on the target's node: %v, want 1", got)
	}
}

// lostLease parses a lease a migration key names, in hex; 0 for none.
func lostLease(t *testing.T, hex string) clientv3.LeaseID {
	t.Helper()
	if hex == "" {
		return 0
	}
	id, err := keyspace.ParseLeaseHex(hex)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// reletThenCompleted waits until the target's audit (on b) wrote the migration key started
// again, changed as changed tells, and checks that it names claim and block leases etcd has
// and b's agent renews, the owner index and the pod book naming the same claim lease, the
// rest of the key and the source's keys as they were. Then the source's DEL (on a) completes
// the migration (T2) at its first attempt: counted by the source's node, not taken by the
// target's audit after a release, every key of the claim on the target's live leases.
func reletThenCompleted(t *testing.T, cli *clientv3.Client, cluster string, pool allocator.PoolSpec, ips []netip.Addr, a, b *Agent,
	started liveMig, changed func(keyspace.LiveMigrationRecord) bool) {
	t.Helper()
	ctx := ctxT(t)
	etcdtest.EventuallyTrue(t, "the migration key written again by the target's audit", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips)
		return m.migLease != 0 && changed(m.mig)
	})
	m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
	if m.migLease != started.migLease || m.mig.Target != started.mig.Target || m.mig.Source != started.mig.Source {
		t.Errorf("migration key written again on %x as %+v, want on %x as %+v but for its leases", int64(m.migLease), m.mig,
			int64(started.migLease), started.mig)
	}
	lc := lostLease(t, m.mig.ClaimLease)
	for _, l := range []clientv3.LeaseID{lc, lostLease(t, m.mig.BlockLease)} {
		if l == 0 {
			continue
		}
		if ttl, err := cli.TimeToLive(ctx, l); err != nil || ttl.TTL <= 0 || !b.keeper.Holds(l) {
			t.Errorf("lease %s the migration key names: %v %v, renewed by the target's agent %v; want one etcd has, renewed",
				keyspace.LeaseHex(l), ttl, err, b.keeper.Holds(l))
		}
	}
	if m.ownerClaimLeases["u2"] != m.mig.ClaimLease {
		t.Errorf("the target's owner index names claim lease %s, its migration key %s", m.ownerClaimLeases["u2"], m.mig.ClaimLease)
	}
	if at := targetAt(t, b, "u2"); at.ClaimLease != lc || !at.Target {
		t.Errorf("the target in the pod book: claim lease %s, target %v; want %s, a target", keyspace.LeaseHex(at.ClaimLease), at.Target,
			m.mig.ClaimLease)
	}
	etcdtest.EventuallyTrue(t, "the migration key counted in the target's node's keys lost", func() bool {
		return metricValue(t, b, "leasehold_pod_keys_lost_total") >= 1 // once its write is answered
	})
	completesAfter(t, "the target's audit", a, cli, cluster, pool, ips, m, started)
	done := readLiveMig(t, cli, cluster, pool, ips, "u2")
	if done.claimLease != lc {
		t.Errorf("the claim moved onto lease %s, want the migration key's %s", keyspace.LeaseHex(done.claimLease), m.mig.ClaimLease)
	}
	for i, ip := range ips {
		if bl := lostLease(t, m.mig.BlockLease); done.heldLeases[i] != bl {
			t.Errorf("%s: held key on lease %s, want the migration key's block lease %s", ip, keyspace.LeaseHex(done.heldLeases[i]),
				m.mig.BlockLease)
		}
	}
	if src, tgt := liveCount(t, a, "leasehold_live_migrations_completed_total", LiveMigrationSourceDeleted),
		liveCount(t, b, "leasehold_live_migrations_completed_total", LiveMigrationSourceDeleted); src != 1 || tgt != 0 {
		t.Errorf("completed{source_deleted}: %v on the source's node, %v on the target's; want 1 and 0 (T2 at its first attempt)", src, tgt)
	}
}

// TestATargetsAuditGivesItsMigrationKeyAClaimLeaseEtcdHas: the target's claim lease revoked
// by hand while its source runs, before any hand-over failed: the target's audit, told by
// its keeper, writes the migration key again naming a claim lease granted anew, so that the
// source's DEL moves the claim onto it rather than release it (issue 35).
func TestATargetsAuditGivesItsMigrationKeyAClaimLeaseEtcdHas(t *testing.T) {
	shortHold := func(c *Config) { c.ClaimHold = 2 * c.LeaseTTL } // renewed, and found gone, within a third of it
	cluster, cli, ctx, pool, a, b, ips, started := migratingPair(t, "10.87.0.0/24", shortHold)
	if _, err := cli.Revoke(ctx, lostLease(t, started.mig.ClaimLease)); err != nil {
		t.Fatal(err)
	}
	reletThenCompleted(t, cli, cluster, pool, ips, a, b, started, func(m keyspace.LiveMigrationRecord) bool {
		return m.ClaimLease != started.mig.ClaimLease
	})
}

// TestATargetsAuditGivesItsMigrationKeyABlockLeaseEtcdHas: the target node's block lease
// revoked by hand while the migration runs (its block claims go with it, which the target's
// audit finds): the target's audit writes the migration key again naming the node's new
// block lease, so that the source's DEL puts the claim's held keys on a lease etcd has.
func TestATargetsAuditGivesItsMigrationKeyABlockLeaseEtcdHas(t *testing.T) {
	hold := func(c *Config) { c.ReuseDelay = holdDelay }
	cluster, cli, ctx, pool, a, b, ips, started := migratingPair(t, "10.86.0.0/24", hold)
	bl := lostLease(t, started.mig.BlockLease)
	if bl == 0 {
		t.Fatalf("the migration key names no block lease: %+v", started.mig)
	}
	// A pod of the target's node claims a block on that lease: the audit checks its claim.
	if _, err := b.Add(ctx, addReq(pool, "c7", "eth0", "u7")); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, bl); err != nil {
		t.Fatal(err)
	}
	reletThenCompleted(t, cli, cluster, pool, ips, a, b, started, func(m keyspace.LiveMigrationRecord) bool {
		return m.BlockLease != started.mig.BlockLease && m.BlockLease != ""
	})
}

// TestATargetsAuditGivesItsMigrationKeyAClaimLeaseEtcdHasAfterARestore: the target's claim
// lease replaced after a backup (revoked by hand, the key written again naming a new one);
// the restore brings back the key naming the old lease, which etcd has again but no agent
// renews, and takes the new one: the target's audit writes the key again naming a lease its
// agent renews, so that the source's DEL moves the claim onto a lease that lives.
func TestATargetsAuditGivesItsMigrationKeyAClaimLeaseEtcdHasAfterARestore(t *testing.T) {
	eachRestoreWay(t, "10.85.0.0/26", func(t *testing.T, rb restoreBed) {
		shortHold := func(c *Config) { c.ClaimHold = 2 * c.LeaseTTL }
		a := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n1", "uid1", shortHold)
		b := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n2", "uid2", shortHold, auditFast)
		ips, started := startMigration(t, rb.cli, rb.cluster, a, b, rb.pool)
		backup := filepath.Join(t.TempDir(), "backup.db")
		if err := rb.member.Snapshot(rb.ctx, backup); err != nil {
			t.Fatal(err)
		}
		if _, err := rb.cli.Revoke(rb.ctx, lostLease(t, started.mig.ClaimLease)); err != nil {
			t.Fatal(err)
		}
		var replaced string
		etcdtest.EventuallyTrue(t, "the migration key names a new claim lease", func() bool {
			replaced = readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips).mig.ClaimLease
			return replaced != "" && replaced != started.mig.ClaimLease
		})
		if err := rb.member.Restore(backup, rb.bump); err != nil {
			t.Fatal(err)
		}
		reletThenCompleted(t, rb.cli, rb.cluster, rb.pool, ips, a, b, started, func(m keyspace.LiveMigrationRecord) bool {
			return m.ClaimLease != started.mig.ClaimLease && m.ClaimLease != replaced
		})
	})
}

// TestANodeWithoutAMigratableClaimDoesNotReadTheLiveMigrations: the audit reads the cluster's
// live migrations only on a node one of whose pods holds a migratable claim (or is a target,
// or knows of a migration): a node of plain pods and sticky claims sends no read of the
// prefix, however many audits run; one holding a VM's claim reads it (the source's count of a
// target's death, T5, rests on it, TestLiveMigrationsAreCountedOnBothNodes), and stops again
// once the VM's pod is deleted.
func TestANodeWithoutAMigratableClaimDoesNotReadTheLiveMigrations(t *testing.T) {
	cluster, ctx := etcdtest.Uniq("c"), ctxT(t)
	cli := etcdtest.Client(t)
	kv := &countingKV{KV: cli.KV, prefix: keyspace.LiveMigrationsPrefix(cluster)}
	cli.KV = kv
	cfg := Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", LeaseTTL: 10 * time.Second, Quarantine: -1, SpareLeases: 2,
		Logger: slog.New(slog.DiscardHandler)}
	auditFast(&cfg)
	a, err := Start(ctx, cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	pool := v4Pool(etcdtest.Uniq("p"), "10.90.0.0/24", 26)
	if _, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1")); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Add(ctx, stickyReq(pool, "c2", "u2", "default.web-0")); err != nil {
		t.Fatal(err)
	}
	// audits waits until n more audits than now have run to their end.
	audits := func(n float64) {
		t.Helper()
		from := counterValue(a.metrics.audits)
		etcdtest.EventuallyTrue(t, fmt.Sprintf("%v audits", n), func() bool { return counterValue(a.metrics.audits) >= from+n })
	}
	audits(4)
	if n := kv.under.Load(); n != 0 {
		t.Errorf("a node of plain pods and a sticky claim read the live migrations %d times in its audits, want none", n)
	}
	if _, err := a.Add(ctx, vmReq(pool, "c3", "u3")); err != nil {
		t.Fatal(err)
	}
	etcdtest.EventuallyTrue(t, "the live migrations read by the audit of a node holding a VM's claim", func() bool { return kv.under.Load() > 0 })
	if err := a.Del(ctx, vmReq(pool, "c3", "u3")); err != nil {
		t.Fatal(err)
	}
	audits(2) // any audit that began before the DEL has ended
	read := kv.under.Load()
	audits(4)
	if n := kv.under.Load() - read; n != 0 {
		t.Errorf("the live migrations read %d times by audits after the VM's pod was deleted, want none", n)
	}
}

// reclaimedAfterRevoking revokes the target u2's pod lease lb and the other leases named,
// waits until u2's agent re-claimed it (its migration key and owner index on one new pod
// lease), and returns the claim's keys as u1 and u2 then have them.
func reclaimedAfterRevoking(t *testing.T, cli *clientv3.Client, cluster string, pool allocator.PoolSpec, ips []netip.Addr,
	lb clientv3.LeaseID, also ...clientv3.LeaseID) liveMig {
	t.Helper()
	for _, l := range append([]clientv3.LeaseID{lb}, also...) {
		if _, err := cli.Revoke(ctxT(t), l); err != nil {
			t.Fatal(err)
		}
	}
	etcdtest.EventuallyTrue(t, "the target re-claimed", func() bool {
		m := readLiveMig(t, cli, cluster, pool, ips, "u2")
		return m.migLease != 0 && m.migLease != lb && m.ownerLeases["u2"] == m.migLease
	})
	return readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
}
