package keyspace

import "testing"

// TestClaimKeyFamilies: the claim and live migration keys share one shape,
// <dir><cluster>/<pool>/<claim>, and each parser keeps its own answer to empty names: a claim
// key's pass (its callers validate them), a live migration key's are refused.
func TestClaimKeyFamilies(t *testing.T) {
	families := []struct {
		name     string
		key      func(c, p, n string) string
		prefix   func(c string) string
		parse    func(key string) (string, string, string, error)
		dir      string
		nonEmpty bool
	}{
		{"claims", ClaimKey, ClaimsPrefix, ParseClaimKey, Prefix + "claims/", false},
		{"livemigrations", LiveMigrationKey, LiveMigrationsPrefix, ParseLiveMigrationKey, Prefix + "livemigrations/", true},
	}
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			if got, want := f.key("c1", "net", "ns.web"), f.dir+"c1/net/ns.web"; got != want {
				t.Errorf("key %q, want %q", got, want)
			}
			if got := f.prefix(""); got != f.dir {
				t.Errorf("prefix of every cluster %q, want %q", got, f.dir)
			}
			if got, want := f.prefix("c1"), f.dir+"c1/"; got != want {
				t.Errorf("prefix of c1 %q, want %q", got, want)
			}
			tests := []struct {
				key     string
				ok      bool
				c, p, n string
			}{
				{f.dir + "c1/net/ns.web", true, "c1", "net", "ns.web"},  // a key as built
				{Prefix + "other/c1/net/ns.web", false, "", "", ""},     // another family
				{f.dir + "c1/net", false, "", "", ""},                   // a part missing
				{f.dir + "c1/net/ns.web/x", false, "", "", ""},          // a part too many
				{f.dir + "c1//ns.web", !f.nonEmpty, "c1", "", "ns.web"}, // an empty pool: as the family says
				{f.dir + "/net/", !f.nonEmpty, "", "net", ""},           // empty cluster and claim
			}
			for _, tt := range tests {
				c, p, n, err := f.parse(tt.key)
				if (err == nil) != tt.ok {
					t.Errorf("parse %q: %v, want ok %v", tt.key, err, tt.ok)
					continue
				}
				if tt.ok && (c != tt.c || p != tt.p || n != tt.n) {
					t.Errorf("parse %q = %q %q %q, want %q %q %q", tt.key, c, p, n, tt.c, tt.p, tt.n)
				}
			}
		})
	}
}
