package leases

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestLiveMigrationMetrics: each method counts its own series; the outcomes are exported at 0
// before the first; the gauges read the func given to Watch: none before it, then how many
// migrations, the age of the oldest, and how many are older than the bound.
func TestLiveMigrationMetrics(t *testing.T) {
	l := newLiveMigrationMetrics(time.Hour)
	reg := prometheus.NewRegistry()
	reg.MustRegister(l.collectors()...)
	values := func() map[string]float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				name := mf.GetName()
				for _, lp := range m.GetLabel() {
					name += "{" + lp.GetName() + "=" + lp.GetValue() + "}"
				}
				switch {
				case m.GetCounter() != nil:
					out[name] = m.GetCounter().GetValue()
				case m.GetGauge() != nil:
					out[name] = m.GetGauge().GetValue()
				}
			}
		}
		return out
	}
	const (
		started    = "leasehold_live_migrations_started_total"
		refused    = "leasehold_live_migrations_refused_total"
		inProgress = "leasehold_live_migrations_in_progress"
		oldest     = "leasehold_live_migration_oldest_seconds"
		tooOld     = "leasehold_live_migrations_too_old"
	)
	completed := func(how string) string { return "leasehold_live_migrations_completed_total{how=" + how + "}" }
	failed := func(how string) string { return "leasehold_live_migrations_failed_total{how=" + how + "}" }
	v := values()
	for _, name := range []string{started, refused, inProgress, oldest, tooOld, completed(LiveMigrationSourceDeleted), completed(LiveMigrationSourceExpired),
		failed(LiveMigrationTargetDeleted), failed(LiveMigrationTargetExpired)} {
		if got, ok := v[name]; !ok || got != 0 {
			t.Errorf("%s = %v (exported: %v) before anything happened, want 0", name, got, ok)
		}
	}
	l.Started()
	l.Started()
	l.Refused()
	l.Completed(LiveMigrationSourceExpired)
	l.Failed(LiveMigrationTargetDeleted)
	now := time.Now()
	l.Watch(func() []time.Time {
		return []time.Time{now.Add(-time.Minute), now.Add(-2 * time.Hour), now.Add(-time.Second)}
	})
	v = values()
	for name, want := range map[string]float64{started: 2, refused: 1, inProgress: 3, tooOld: 1, completed(LiveMigrationSourceExpired): 1,
		completed(LiveMigrationSourceDeleted): 0, failed(LiveMigrationTargetDeleted): 1, failed(LiveMigrationTargetExpired): 0} {
		if v[name] != want {
			t.Errorf("%s = %v, want %v", name, v[name], want)
		}
	}
	if got := v[oldest]; got < 7200 || got > 7200+600 {
		t.Errorf("%s = %v, want the oldest's age, 2h", oldest, got)
	}
}
