package leases

import (
	"log/slog"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
	"github.com/leasehold/leasehold/keyspace"
)

// TestATargetReclaimedAfterARestoreWaitsForItsSourcesClaim: etcd restored, during a live
// migration, from a backup older than the VM's claim, the source's agent down when the
// target's agent re-claims its pod: the claim record is missing, and the target waits for
// its source's agent to put the claim back rather than re-claim the addresses as any pod's
// (which took them from its own source, or split them between the two). Once the source's
// agent is back, the source holds every address of the claim again, the target's migration
// key is back, neither pod records a conflict, and the source's DEL completes the migration.
// Found by TestModelRandomHistories (issue 35).
func TestATargetReclaimedAfterARestoreWaitsForItsSourcesClaim(t *testing.T) {
	eachRestoreWay(t, "10.89.0.0/26", func(t *testing.T, rb restoreBed) {
		state := t.TempDir()
		acfg := func(c *Config) { c.StateDir = state }
		logs, blog := keptLog(t, "n2")
		a := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n1", "uid1", acfg)
		b := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n2", "uid2", auditFast, blog)
		// The backup has the pool's definition, which the recovery reads, and not the claim.
		if _, err := a.Add(rb.ctx, addReq(rb.pool, "c0", "eth0", "u0")); err != nil {
			t.Fatal(err)
		}
		backup := rb.backup(t)
		ips, started := startMigration(t, rb.cli, rb.cluster, a, b, rb.pool)
		a.Close() // its node down across the restore
		if err := rb.member.Restore(backup, rb.bump); err != nil {
			t.Fatal(err)
		}
		etcdtest.EventuallyTrue(t, "the target's agent re-claimed its pod, or waits for its source's", func() bool {
			if strings.Contains(logs.String(), "waits for its source's agent to put the claim back") {
				return true
			}
			resp, err := rb.cli.Get(rb.ctx, keyspace.OwnerKey(rb.cluster, "u2", "eth0", rb.pool.Name))
			return err == nil && len(resp.Kvs) > 0
		})
		a = startAgentAt(t, rb.member.ClientURL, rb.cluster, "n1", "uid1", acfg)
		rb.migrating(t, ips, started.mig.Source, started.mig.Target)
		if err := a.Del(rb.ctx, vmReq(rb.pool, "c1", "u1")); err != nil {
			t.Fatal(err)
		}
		readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips, "u2").heldBy("u2")
	})
}

// TestATargetReclaimedAfterARestoreWaitsForItsSourceToHoldTheClaimAgain: etcd restored from
// a backup taken during an earlier migration of the VM (u1 to u2), which completed since, while
// the next one runs (u2 to u3): the backup brings back the record naming u1, deleted since,
// and the migration key naming u2 as the target it was. u3's re-claim waits while the claim is
// not as u2's agent keeps it: u1's agent releases the stale record, u2's deletes the stale key
// and takes the claim back once u1's allocations expired. Then u2 holds every address of the
// claim, u3's migration key is back, neither records a conflict, and u2's DEL completes the
// migration.
func TestATargetReclaimedAfterARestoreWaitsForItsSourceToHoldTheClaimAgain(t *testing.T) {
	eachRestoreWay(t, "10.89.0.64/26", func(t *testing.T, rb restoreBed) {
		_, clog := keptLog(t, "n3")
		a := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n1", "uid1", auditFast)
		b := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n2", "uid2", auditFast)
		c := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n3", "uid3", auditFast, clog)
		ips, backup := rb.backedUpBeforeTheNextMigration(t, a, b, c)
		if err := rb.member.Restore(backup, rb.bump); err != nil {
			t.Fatal(err)
		}
		rb.migrating(t, ips, keyspace.LiveMigrationSource{Owner: "u2", Node: "n2"}, keyspace.ClaimHolder{Owner: "u3", Node: "n3"})
		if err := b.Del(rb.ctx, vmReq(rb.pool, "c2", "u2")); err != nil {
			t.Fatal(err)
		}
		readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips, "u3").heldBy("u3")
	})
}

// keptLog keeps the log of node's agent (warnings and errors) for the test to read, and shows
// it if the test fails: the Config change to start the agent with.
func keptLog(t *testing.T, node string) (*syncbuf.Buffer, func(*Config)) {
	logs := &syncbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s's log:\n%s", node, logs.String())
		}
	})
	return logs, func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
}

// backup saves the bed's etcd as `etcdctl snapshot save` does, into a file of the test's.
func (rb restoreBed) backup(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "backup.db")
	if err := rb.member.Snapshot(rb.ctx, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// migrating waits until the source holds every address of the claim again, its record naming
// it, the target's migration key is back on the target's pod lease, and neither records a
// conflict; then the key names source on its node and target on its node.
func (rb restoreBed) migrating(t *testing.T, ips []netip.Addr, source keyspace.LiveMigrationSource, target keyspace.ClaimHolder) {
	t.Helper()
	var m liveMig
	conflicts := func() (n int64) {
		for _, owner := range []string{source.Owner, target.Owner} {
			resp, err := rb.cli.Get(rb.ctx, keyspace.ConflictKey(rb.cluster, owner, "eth0", rb.pool.Name), clientv3.WithCountOnly())
			if err != nil {
				t.Fatal(err)
			}
			n += resp.Count
		}
		return n
	}
	etcdtest.EventuallyTrue(t, source.Owner+" holds the claim again, "+target.Owner+"'s migration key is back, no conflict", func() bool {
		m = readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips, source.Owner, target.Owner)
		return m.claim.Holder != nil && m.claim.Holder.Owner == source.Owner && m.mig.Target.Owner == target.Owner &&
			!slices.ContainsFunc(m.ipOwners, func(o string) bool { return o != source.Owner }) &&
			m.ownerLeases[target.Owner] == m.migLease && conflicts() == 0
	})
	if m.mig.Source.Owner != source.Owner || m.mig.Source.Node != source.Node || m.mig.Target.Node != target.Node {
		t.Errorf("the migration key after the restore: %+v, want from %s on %s to %s on %s", m.mig, source.Owner, source.Node,
			target.Owner, target.Node)
	}
}

// TestATargetReclaimedAfterARestoreDoesNotTakeTheClaimFromItsSource: etcd restored from a
// backup taken during an earlier migration of the VM (u1 to u2, completed since by u1's DEL)
// while the next one runs (u2 to u3), with u1's and u2's agents down: the record names u1
// again, whose allocations are gone (its lease expired, as a dead node's does), and no
// migration key is left (u2's agent deletes the one naming u2 as target). To u3's re-claim
// the claim then looks like its source expired (T4), but the holder is not its source: u3
// waits for u2's agent instead of taking u2's addresses (chaos seed 4 found it). Once u2's
// agent is back, u2 holds every address again, u3's migration key is back, and u2's DEL
// completes the migration.
func TestATargetReclaimedAfterARestoreDoesNotTakeTheClaimFromItsSource(t *testing.T) {
	eachRestoreWay(t, "10.89.0.128/26", func(t *testing.T, rb restoreBed) {
		state := t.TempDir()
		bcfg := func(c *Config) { c.StateDir = state }
		logs, clog := keptLog(t, "n3")
		a := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n1", "uid1", auditFast)
		b := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n2", "uid2", auditFast, bcfg)
		c := startAgentAt(t, rb.member.ClientURL, rb.cluster, "n3", "uid3", auditFast, clog)
		ips, backup := rb.backedUpBeforeTheNextMigration(t, a, b, c)
		a.Close()
		b.Close()
		if err := rb.member.Restore(backup, rb.bump); err != nil {
			t.Fatal(err)
		}
		old := readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips, "u1")
		if old.claim.Holder == nil || old.claim.Holder.Owner != "u1" || old.ipLeases[0] == 0 || old.migLease == 0 {
			t.Fatalf("after the restore: record %+v, allocation on %x, migration key on %x; want u1's, as backed up",
				old.claim.Holder, int64(old.ipLeases[0]), int64(old.migLease))
		}
		if _, err := rb.cli.Revoke(rb.ctx, old.ipLeases[0]); err != nil {
			t.Fatal(err)
		}
		if _, err := rb.cli.Delete(rb.ctx, old.migKey); err != nil {
			t.Fatal(err)
		}
		etcdtest.EventuallyTrue(t, "u3's re-claim waits for its source's agent, or takes the claim", func() bool {
			m := readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips)
			return strings.Contains(logs.String(), "not this target's source u2") || m.claim.Holder != nil && m.claim.Holder.Owner == "u3"
		})
		if m := readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips); m.claim.Holder == nil || m.claim.Holder.Owner != "u1" {
			t.Fatalf("while u2's agent is down, the record names %s; want u1's, left to u2's agent", holderName(m.claim))
		}
		b = startAgentAt(t, rb.member.ClientURL, rb.cluster, "n2", "uid2", auditFast, bcfg)
		rb.migrating(t, ips, keyspace.LiveMigrationSource{Owner: "u2", Node: "n2"}, keyspace.ClaimHolder{Owner: "u3", Node: "n3"})
		if err := b.Del(rb.ctx, vmReq(rb.pool, "c2", "u2")); err != nil {
			t.Fatal(err)
		}
		readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips, "u3").heldBy("u3")
	})
}

// backedUpBeforeTheNextMigration migrates the VM from u1 (on a) to u2 (on b), backs etcd up
// during that migration, completes it (u1's DEL), and starts the next one, to u3 on c: the
// claim's addresses and the backup.
func (rb restoreBed) backedUpBeforeTheNextMigration(t *testing.T, a, b, c *Agent) ([]netip.Addr, string) {
	t.Helper()
	ips, _ := startMigration(t, rb.cli, rb.cluster, a, b, rb.pool)
	backup := rb.backup(t)
	if err := a.Del(rb.ctx, vmReq(rb.pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	readLiveMig(t, rb.cli, rb.cluster, rb.pool, ips, "u2").heldBy("u2")
	if res, err := c.Add(rb.ctx, vmReq(rb.pool, "c3", "u3")); err != nil || !slices.Equal(resultAddrs(res), ips) {
		t.Fatalf("the next migration's target ADD: %v %v, want %v", res, err, ips)
	}
	return ips, backup
}
