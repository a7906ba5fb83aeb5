package leases

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
	"github.com/leasehold/leasehold/keyspace"
)

// TestLiveMigrationsOverTheBound: with a tiny --live-migration-bound, both agents of a
// migration count it in leasehold_live_migrations_too_old (the source's from its audit's read)
// and log it once, however many audits find it again; once the source's DEL completes it,
// neither counts it. Both agents' node records carry the liveMigration mark (doctor's
// live-migration-old-agent looks for it).
func TestLiveMigrationsOverTheBound(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.96.0.0/24", 26)
	const (
		tooOld     = "leasehold_live_migrations_too_old"
		inProgress = "leasehold_live_migrations_in_progress"
		logged     = "has run longer than --live-migration-bound"
	)
	var logA, logB syncbuf.Log
	tiny := func(l *syncbuf.Log) func(*Config) {
		return func(c *Config) { c.LiveMigrationBound, c.Logger = time.Millisecond, l.Logger(slog.LevelWarn) }
	}
	a := startAgent(t, cluster, "n1", "uid1", tiny(&logA), auditFast)
	b := startAgent(t, cluster, "n2", "uid2", tiny(&logB), auditFast)
	for _, node := range []string{"n1", "n2"} {
		key := keyspace.NodeKey(cluster, node)
		resp, err := cli.Get(ctx, key)
		if err != nil || len(resp.Kvs) == 0 {
			t.Fatalf("node record %s: %v %v", key, resp, err)
		}
		if rec, err := keyspace.Decode[keyspace.NodeRecord](key, resp.Kvs[0].Value); err != nil || !rec.LiveMigration {
			t.Errorf("node record %s: %+v, %v; want the liveMigration mark", key, rec, err)
		}
	}
	startMigration(t, cli, cluster, a, b, pool)
	for _, x := range []struct {
		node string
		a    *Agent
		logs *syncbuf.Log
	}{{"n1", a, &logA}, {"n2", b, &logB}} {
		etcdtest.EventuallyTrue(t, x.node+" counts the migration too old", func() bool { return liveCount(t, x.a, tooOld, "") == 1 })
		if got := liveCount(t, x.a, inProgress, ""); got != 1 {
			t.Errorf("%s: %s = %v, want 1", x.node, inProgress, got)
		}
		etcdtest.EventuallyTrue(t, x.node+" logs it", func() bool { return strings.Contains(x.logs.String(), logged) })
		audits := metricValue(t, x.a, "leasehold_key_audits_total")
		etcdtest.EventuallyTrue(t, "three more audits on "+x.node, func() bool {
			return metricValue(t, x.a, "leasehold_key_audits_total") >= audits+3
		})
		out := x.logs.String()
		if n := strings.Count(out, logged); n != 1 || !strings.Contains(out, "claim="+vmClaim) {
			t.Errorf("%s logged the migration of claim %s over the bound %d times, want once:\n%s", x.node, vmClaim, n, out)
		}
	}
	if err := a.Del(ctx, vmReq(pool, "c1", "u1")); err != nil {
		t.Fatal(err)
	}
	for node, x := range map[string]*Agent{"n1": a, "n2": b} {
		etcdtest.EventuallyTrue(t, node+" counts no migration too old once it completed", func() bool { return liveCount(t, x, tooOld, "") == 0 })
	}
}
