package leases

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/etcdtest"
)

// TestABlockClaimARestoreBringsBackIsFollowed: a block of pool b, claimed when the backup
// was taken, is given back; the agent restarts and serves only pool a; etcd goes back to the
// backup, whose claim in pool b is on the block lease the agent still renews. The agent
// follows pool b again and gives the empty block back, instead of renewing it unseen for as
// long as it runs (found by TestModelRandomHistories with two pools, seed
// 1795841293438470220).
func TestABlockClaimARestoreBringsBackIsFollowed(t *testing.T) {
	eachRestoreWay(t, "10.84.0.0/28", func(t *testing.T, b restoreBed) {
		member, cli, cluster, ctx, pa := b.member, b.cli, b.cluster, b.ctx, b.pool
		pb := v4Pool(etcdtest.Uniq("pb"), "10.85.0.0/28", 28)
		dir := t.TempDir()
		idle := func(c *Config) { c.BlockIdle = 300 * time.Millisecond }
		a := startAgentAt(t, member.ClientURL, cluster, "n1", "uid-n1", withHold(dir), auditFast, idle)
		if _, err := a.Add(ctx, addReq(pa, "c0", "eth0", "u0")); err != nil {
			t.Fatal(err)
		}
		other := addReq(pb, "c1", "eth0", "u1")
		if _, err := a.Add(ctx, other); err != nil {
			t.Fatal(err)
		}
		backup := filepath.Join(t.TempDir(), "backup.db")
		if err := member.Snapshot(ctx, backup); err != nil {
			t.Fatal(err)
		}
		if err := a.Del(ctx, other); err != nil {
			t.Fatal(err)
		}
		etcdtest.Eventually(t, "the empty block of pool b given back", func() error {
			c := blockClaims(t, cli, pb.Name)
			return etcdtest.Saw(len(c) == 0, "pool %s: claims %v", pb.Name, c)
		})
		crash(a)
		a = startAgentAt(t, member.ClientURL, cluster, "n1", "uid-n1", withHold(dir), auditFast, idle)
		if a.pools.ViewOf(pb.Name) != nil {
			t.Fatalf("the restarted agent serves pool %s, which it has no claim in", pb.Name)
		}
		if err := member.Restore(backup, b.bump); err != nil {
			t.Fatal(err)
		}
		etcdtest.Eventually(t, "the agent noticing the restore", func() error {
			n := metricValue(t, a, "leasehold_etcd_went_back_total")
			return etcdtest.Saw(n > 0, "etcd went back %v times", n)
		})
		etcdtest.Eventually(t, "the block of pool b the backup brought back given back", func() error {
			c := blockClaims(t, cli, pb.Name)
			return etcdtest.Saw(len(c) == 0, "pool %s: claims %v on a lease the agent renews (serves pool b: %v)",
				pb.Name, c, a.pools.ViewOf(pb.Name) != nil)
		})
	})
}
