package leases

import (
	"path/filepath"
	"slices"
	"testing"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestRulesAreReadAgainAfterARestore: once an agent finds etcd went back to a backup, its
// ADDs choose by the selection rules the backup holds, either way etcd is restored. A plain
// restore takes the revision back below the rules' watch, which then never tells that a rule
// written since the backup is gone (found by TestModelRandomHistories, with the rule of a
// dual-stack network changed after the backup).
func TestRulesAreReadAgainAfterARestore(t *testing.T) {
	eachRestoreWay(t, "10.83.0.0/28", func(t *testing.T, b restoreBed) {
		member, cli, cluster, ctx, pool := b.member, b.cli, b.cluster, b.ctx, b.pool
		network := etcdtest.Uniq("net")
		rule := func(pools ...string) {
			t.Helper()
			if _, err := cli.Put(ctx, keyspace.NamespaceRuleKey(cluster, network, "tenant"),
				keyspace.Encode(keyspace.NamespaceRule{Pools: pools})); err != nil {
				t.Fatal(err)
			}
		}
		a := startAgentAt(t, member.ClientURL, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
		seen := func(want ...string) func() error {
			return func() error {
				rules, _, _, err := a.rules.Choice(ctx, network)
				if err != nil {
					return err
				}
				got := rules.Namespaces["tenant"].Pools
				return etcdtest.Saw(slices.Equal(got, want), "the agent chooses by rule %v, want %v", got, want)
			}
		}
		rule("before")
		etcdtest.Eventually(t, "the rule written", seen("before"))
		if _, err := a.Add(ctx, addReq(pool, "c0", "eth0", "u0")); err != nil {
			t.Fatal(err) // a pod whose keys the audit finds gone or changed: the restore is noticed
		}
		backup := filepath.Join(t.TempDir(), "backup.db")
		if err := member.Snapshot(ctx, backup); err != nil {
			t.Fatal(err)
		}
		rule("after")
		etcdtest.Eventually(t, "the rule changed", seen("after"))
		if err := member.Restore(backup, b.bump); err != nil {
			t.Fatal(err)
		}
		etcdtest.Eventually(t, "the agent noticing the restore", func() error {
			n := metricValue(t, a, "leasehold_etcd_went_back_total")
			return etcdtest.Saw(n > 0, "etcd went back %v times", n)
		})
		etcdtest.Eventually(t, "the backup's rule", seen("before"))
	})
}
