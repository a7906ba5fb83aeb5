package main

import (
	"encoding/json"
	"net/netip"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// stickyRecord is a claim record of ips; with holder set, held by pod ns/<holder> on node n1.
func stickyRecord(holder string, ips ...string) string {
	rec := keyspace.ClaimRecord{HoldSeconds: 600, Since: time.Now().UTC().Add(-time.Hour)}
	for _, ip := range ips {
		rec.IPs = append(rec.IPs, netip.MustParseAddr(ip))
	}
	if holder == "" {
		rec.Released = time.Now().UTC().Add(-time.Minute)
	} else {
		rec.Holder = &keyspace.ClaimHolder{Owner: "u-" + holder, Pod: allocator.PodRef{UID: "u-" + holder, Namespace: "ns", Name: holder},
			Node: "n1", NodeUID: "uid-n1", ContainerID: "ctr-" + holder, IfName: "eth0", LeaseID: "1234"}
	}
	return keyspace.Encode(rec)
}

func restingUnder(claim string) string {
	return keyspace.Encode(keyspace.QuarantineRecord{ReleasedBy: "n1", Until: time.Now().UTC().Add(11 * time.Minute), Claim: claim})
}

// leasesAndPuts grants leases of 120s on cli and puts keys on them, failing t on an error.
func leasesAndPuts(t *testing.T, cli *clientv3.Client) (func() clientv3.LeaseID, func(key, value string, l clientv3.LeaseID)) {
	ctx := etcdtest.Ctx(t)
	lease := func() clientv3.LeaseID {
		g, err := cli.Grant(ctx, 120)
		if err != nil {
			t.Fatal(err)
		}
		return g.ID
	}
	put := func(key, value string, l clientv3.LeaseID) {
		t.Helper()
		if _, err := cli.Put(ctx, key, value, clientv3.WithLease(l)); err != nil {
			t.Fatal(err)
		}
	}
	return lease, put
}

func TestClaimCommands(t *testing.T) {
	cli := etcdtest.ClientAt(t, endpoint)
	cluster, cluster2, pool := etcdtest.Uniq("c"), etcdtest.Uniq("c"), etcdtest.Uniq("net")
	if r := ctl("pool", "create", pool, "--range", "10.88.0.0/24", "--range", "fd88::/120"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	lease, put := leasesAndPuts(t, cli)
	claimL, restL, podL := lease(), lease(), lease()
	q := func(ip string) string { return keyspace.QuarantineKey(pool, allocator.DefaultBlocks, mustIP(ip)) }
	// ns.web-0: released, both addresses resting under it; the same name in cluster2 too.
	put(keyspace.ClaimKey(cluster, pool, "ns.web-0"), stickyRecord("", "10.88.0.5", "fd88::5"), claimL)
	put(q("10.88.0.5"), restingUnder("ns.web-0"), restL)
	put(q("fd88::5"), restingUnder("ns.web-0"), restL)
	put(keyspace.ClaimKey(cluster2, pool, "ns.web-0"), stickyRecord("", "10.88.0.50"), claimL)
	// ns.db-0: held by pod ns/db-0, whose allocation holds its address.
	put(keyspace.ClaimKey(cluster, pool, "ns.db-0"), stickyRecord("db-0", "10.88.0.6"), claimL)
	put(keyspace.IPKey(pool, allocator.DefaultBlocks, mustIP("10.88.0.6")),
		keyspace.Encode(keyspace.Allocation{Owner: "u-db-0", Cluster: cluster, Node: "n1", IfName: "eth0"}), podL)

	t.Run("list", func(t *testing.T) {
		r := ctl("claim", "list", "--cluster", cluster)
		for _, s := range []string{"CLUSTER", "POOL", "CLAIM", "IPS", "HOLDER", "HOLD", "TTL LEFT", "ns.web-0", "10.88.0.5,fd88::5",
			"released 20", "ns.db-0", "ns/db-0 on n1", "10m0s", "/120s"} {
			if !strings.Contains(r.stdout, s) {
				t.Errorf("claim list does not say %q:\n%s", s, r.stdout)
			}
		}
		if r.code != 0 || strings.Count(r.stdout, "\n") != 3 || strings.Contains(r.stdout, cluster2) {
			t.Errorf("claim list --cluster: exit %d, want the header and two claims of %s:\n%s", r.code, cluster, r.stdout)
		}
		if r := ctl("claim", "list", "--pool", pool); strings.Count(r.stdout, "\n") != 4 {
			t.Errorf("claim list --pool: want both clusters' three claims:\n%s", r.stdout)
		}
		var rows []map[string]any
		jsonOf(t, ctl("claim", "list", "--cluster", cluster, "-o", "json"), &rows)
		if len(rows) != 2 {
			t.Fatalf("claim list -o json: %d rows", len(rows))
		}
		for _, k := range []string{"key", "cluster", "pool", "claim", "ips", "holder", "holdSeconds", "since", "released", "leaseID", "ttl", "grantedTTL"} {
			for _, row := range rows {
				if _, ok := row[k]; !ok {
					t.Errorf("field %q missing in %v", k, row)
				}
			}
		}
		// Sorted by key: ns.db-0 (held: a holder, no release time) before ns.web-0.
		if h, _ := rows[0]["holder"].(map[string]any); h == nil || h["node"] != "n1" || rows[0]["released"] != nil || rows[1]["holder"] != nil {
			t.Errorf("claim list -o json: %v", rows)
		}
		var empty []any
		if jsonOf(t, ctl("claim", "list", "--pool", etcdtest.Uniq("net"), "-o", "json"), &empty); empty == nil || len(empty) != 0 {
			t.Errorf("claim list of a pool without claims: want [], got %v", empty)
		}
	})
	t.Run("show", func(t *testing.T) {
		r := ctl("claim", "show", "ns.web-0", "--cluster", cluster)
		for _, s := range []string{"claim:", "ns.web-0", "key:", keyspace.ClaimKey(cluster, pool, "ns.web-0"), "holder:", "none: released",
			"10.88.0.5 resting in quarantine under the claim until", q("fd88::5"), "hold:", "10m0s", "TTL"} {
			if !strings.Contains(r.stdout, s) {
				t.Errorf("claim show does not say %q:\n%s", s, r.stdout)
			}
		}
		r = ctl("claim", "show", "ns.db-0", "--pool", pool)
		for _, s := range []string{"owner u-db-0, pod ns/db-0", "node:", "n1", "ctr-db-0", "pod lease:", "1234", "10.88.0.6 allocated to owner u-db-0"} {
			if !strings.Contains(r.stdout, s) {
				t.Errorf("claim show of a held claim does not say %q:\n%s", s, r.stdout)
			}
		}
		var both []stickyJSON
		jsonOf(t, ctl("claim", "show", "ns.web-0", "-o", "json"), &both)
		if len(both) != 2 || len(both[0].Addresses) == 0 {
			t.Fatalf("claim show of a name two clusters have: %+v", both)
		}
		for _, c := range both {
			if c.Cluster == cluster && (len(c.Addresses) != 2 || c.Addresses[0].State != admin.ClaimAddrResting || c.Addresses[0].Claim != "ns.web-0" ||
				c.Addresses[0].Key != q("10.88.0.5") || c.Addresses[0].Until == nil) {
				t.Errorf("addresses %+v", c.Addresses)
			}
		}
		var raw []map[string]any
		jsonOf(t, ctl("claim", "show", "ns.db-0", "-o", "json"), &raw)
		addrs, _ := raw[0]["addresses"].([]any)
		if len(addrs) != 1 {
			t.Fatalf("claim show -o json: %s", ctl("claim", "show", "ns.db-0", "-o", "json").stdout)
		}
		for _, k := range []string{"ip", "state", "key", "owner", "cluster", "node"} {
			if _, ok := addrs[0].(map[string]any)[k]; !ok {
				t.Errorf("address field %q missing in %v", k, addrs[0])
			}
		}
	})
	t.Run("release needs an unambiguous claim", func(t *testing.T) {
		for _, tt := range []struct {
			args []string
			want int
			says string
		}{
			{[]string{"claim", "release", "ns.web-0"}, exitUsage, "--pool"},
			{[]string{"claim", "release", "ns.web-0", "--pool", pool}, exitUsage, cluster2},
			{[]string{"claim", "release", "nobody", "--pool", pool}, exitNotFound, "no claim nobody"},
			{[]string{"claim", "release", "nobody", "--pool", pool, "--cluster", cluster}, exitNotFound, "no claim nobody"},
			{[]string{"claim", "show", "nobody"}, exitNotFound, "no claim nobody"},
			{[]string{"claim", "show", "a/b"}, exitUsage, "claim name"},
			{[]string{"claim", "release", "ns.web-0", "--pool", pool, "--quarantine", "-1s"}, exitUsage, "--quarantine"},
			{[]string{"claim", "list", "--force"}, exitUsage, "does not take --force"},
			{[]string{"claim", "show"}, exitUsage, "NAME"},
		} {
			if r := ctl(tt.args...); r.code != tt.want || !strings.Contains(r.stderr, tt.says) {
				t.Errorf("%v: exit %d, want %d saying %q: %s", tt.args, r.code, tt.want, tt.says, r.stderr)
			}
		}
		if len(keys(t, cli, keyspace.ClaimKey(cluster, pool, "ns.web-0"))) != 1 {
			t.Errorf("a refused release deleted the claim")
		}
	})
	t.Run("release of a released claim", func(t *testing.T) {
		r := ctl("claim", "release", "ns.web-0", "--pool", pool, "--cluster", cluster)
		for _, s := range []string{"released claim ns.web-0", "deleted " + keyspace.ClaimKey(cluster, pool, "ns.web-0"),
			"10.88.0.5,fd88::5: moved from the claim to ordinary quarantine until"} {
			if !strings.Contains(r.stdout, s) {
				t.Errorf("claim release does not say %q:\n%s", s, r.stdout)
			}
		}
		if r.code != 0 || len(keys(t, cli, keyspace.ClaimKey(cluster, pool, "ns.web-0"))) != 0 || len(keys(t, cli, keyspace.ClaimKey(cluster2, pool, "ns.web-0"))) != 1 {
			t.Errorf("exit %d, or the wrong claim went: %s", r.code, r.stderr)
		}
		var rec keyspace.QuarantineRecord
		if err := json.Unmarshal([]byte(keys(t, cli, q("10.88.0.5"))[q("10.88.0.5")]), &rec); err != nil || rec.Claim != "" {
			t.Errorf("quarantine record %+v (%v): want an ordinary one", rec, err)
		}
		// Now the name is only cluster2's: no --cluster needed; --quarantine 0s frees at once.
		var out map[string]any
		r = ctl("claim", "release", "ns.web-0", "--pool", pool, "--quarantine", "0s", "-o", "json")
		jsonOf(t, r, &out)
		for _, k := range []string{"key", "cluster", "pool", "claim", "ips", "held", "holder", "addresses", "quarantined", "freed"} {
			if _, ok := out[k]; !ok {
				t.Errorf("field %q missing in %s", k, r.stdout)
			}
		}
		if r.code != 0 || out["cluster"] != cluster2 || out["held"] != false {
			t.Errorf("release -o json: exit %d: %s", r.code, r.stdout)
		}
		if r := ctl("claim", "release", "ns.web-0", "--pool", pool, "--cluster", cluster); r.code != exitNotFound {
			t.Errorf("second release: exit %d, want not found: %s", r.code, r.stderr)
		}
	})
	t.Run("release of a held claim", func(t *testing.T) {
		var out stickyReleaseJSON
		r := ctl("claim", "release", "ns.db-0", "--pool", pool, "-o", "json")
		jsonOf(t, r, &out)
		if r.code != 0 || !out.Held || out.Holder == nil || !strings.Contains(out.HolderKeeps, "keeps 10.88.0.6") || len(out.Quarantined) != 0 {
			t.Errorf("release of a held claim: exit %d %+v", r.code, out)
		}
		if len(keys(t, cli, keyspace.IPKey(pool, allocator.DefaultBlocks, mustIP("10.88.0.6")))) != 1 {
			t.Errorf("the holder's allocation was touched")
		}
		put(keyspace.ClaimKey(cluster, pool, "ns.db-0"), stickyRecord("db-0", "10.88.0.6"), claimL)
		r = ctl("claim", "release", "ns.db-0", "--pool", pool)
		for _, s := range []string{"left alone: 10.88.0.6 allocated to owner u-db-0", "pod ns/db-0", "only the stickiness goes"} {
			if !strings.Contains(r.stdout, s) {
				t.Errorf("claim release of a held claim does not say %q:\n%s", s, r.stdout)
			}
		}
	})
}

// TestClaimLiveMigration: a claim being migrated shows its target in claim list (MIGRATION)
// and claim show, over the bound or not as --live-migration-bound says; claim release refuses
// it naming the target, and --force deletes the migration key with the claim; doctor tells it.
func TestClaimLiveMigration(t *testing.T) {
	cli := etcdtest.ClientAt(t, endpoint)
	cluster, pool := etcdtest.Uniq("c"), etcdtest.Uniq("net")
	if r := ctl("pool", "create", pool, "--range", "10.89.0.0/24"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	lease, put := leasesAndPuts(t, cli)
	claimL, srcL, tgtL := lease(), lease(), lease()
	var rec keyspace.ClaimRecord
	if err := json.Unmarshal([]byte(stickyRecord("virt-launcher-vm-a", "10.89.0.7")), &rec); err != nil {
		t.Fatal(err)
	}
	rec.Migratable = true
	ck, mk := keyspace.ClaimKey(cluster, pool, "ns.vm-a"), keyspace.LiveMigrationKey(cluster, pool, "ns.vm-a")
	put(ck, keyspace.Encode(rec), claimL)
	put(keyspace.IPKey(pool, allocator.DefaultBlocks, mustIP("10.89.0.7")),
		keyspace.Encode(keyspace.Allocation{Owner: "u-virt-launcher-vm-a", Cluster: cluster, Node: "n1", IfName: "eth0"}), srcL)
	put(keyspace.OwnerKey(cluster, "u-virt-launcher-vm-a", "eth0", pool), keyspace.Encode(keyspace.OwnerRecord{IPs: rec.IPs,
		ContainerID: "ctr-virt-launcher-vm-a", Node: "n1", NodeUID: "uid-n1", Claim: "ns.vm-a"}), srcL)
	mig := keyspace.LiveMigrationRecord{Target: keyspace.ClaimHolder{Owner: "u-b", Pod: allocator.PodRef{UID: "u-b", Namespace: "ns",
		Name: "virt-launcher-vm-b"}, Node: "n2", NodeUID: "uid-n2", ContainerID: "ctr-b", IfName: "eth0", LeaseID: keyspace.LeaseHex(tgtL)},
		Source: keyspace.LiveMigrationSource{Owner: "u-virt-launcher-vm-a", Node: "n1"}, Since: time.Now().UTC().Add(-2 * time.Hour)}
	put(mk, keyspace.Encode(mig), tgtL)

	r := ctl("claim", "list", "--cluster", cluster)
	for _, s := range []string{"MIGRATION", "to ns/virt-launcher-vm-b on n2, 2h", "over the bound"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("claim list does not say %q:\n%s", s, r.stdout)
		}
	}
	if r := ctl("claim", "list", "--cluster", cluster, "--live-migration-bound", "3h"); r.code != 0 || strings.Contains(r.stdout, "over the bound") {
		t.Errorf("claim list --live-migration-bound 3h: exit %d, a migration of 2h over it:\n%s", r.code, r.stdout)
	}
	r = ctl("claim", "show", "ns.vm-a", "--cluster", cluster)
	for _, s := range []string{"migration:", "migrating to ns/virt-launcher-vm-b on n2 since", "bound 1h0m0s, over the bound", "target:",
		"ctr-b", "migration key:", mk} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("claim show does not say %q:\n%s", s, r.stdout)
		}
	}
	var shown []stickyJSON
	jsonOf(t, ctl("claim", "show", "ns.vm-a", "--cluster", cluster, "-o", "json"), &shown)
	if len(shown) != 1 || shown[0].Migration == nil || shown[0].Migration.Target.Owner != "u-b" || !shown[0].Migration.OverBound ||
		shown[0].Migration.BoundSeconds != 3600 || shown[0].Migration.LeaseID != keyspace.LeaseHex(tgtL) {
		t.Errorf("claim show -o json: %+v", shown)
	}
	if r := ctl("claim", "list", "--live-migration-bound", "0s"); r.code != exitUsage {
		t.Errorf("claim list --live-migration-bound 0s: exit %d, want usage", r.code)
	}

	var doc doctorJSON
	r = ctl("doctor", "--cluster", cluster, "-o", "json")
	jsonOf(t, r, &doc)
	kinds := map[string]bool{}
	for _, f := range doc.Findings {
		if f.Cluster == cluster {
			kinds[f.Kind] = true
		}
	}
	if !kinds[admin.KindLiveMigrationTooOld] {
		t.Errorf("doctor: no %s in %+v", admin.KindLiveMigrationTooOld, doc.Findings)
	}
	jsonOf(t, ctl("doctor", "--cluster", cluster, "--live-migration-bound", "3h", "-o", "json"), &doc)
	kinds = map[string]bool{}
	for _, f := range doc.Findings {
		if f.Cluster == cluster {
			kinds[f.Kind] = true
		}
	}
	if !kinds[admin.KindLiveMigration] || kinds[admin.KindLiveMigrationTooOld] {
		t.Errorf("doctor --live-migration-bound 3h: want %s, not %s: %+v", admin.KindLiveMigration, admin.KindLiveMigrationTooOld, doc.Findings)
	}

	r = ctl("claim", "release", "ns.vm-a", "--pool", pool, "--cluster", cluster)
	if r.code != 1 || !strings.Contains(r.stderr, "ns/virt-launcher-vm-b on node n2") || !strings.Contains(r.stderr, "--force") {
		t.Errorf("claim release of a migrating claim: exit %d, want 1 naming the target and --force: %s", r.code, r.stderr)
	}
	if len(keys(t, cli, ck)) != 1 || len(keys(t, cli, mk)) != 1 {
		t.Fatalf("a refused release deleted keys")
	}
	var out stickyReleaseJSON
	r = ctl("claim", "release", "ns.vm-a", "--pool", pool, "--cluster", cluster, "--force", "-o", "json")
	jsonOf(t, r, &out)
	if r.code != 0 || out.MigrationDeleted == nil || out.MigrationDeleted.Key != mk || !out.Held {
		t.Errorf("claim release --force: exit %d %+v", r.code, out)
	}
	if len(keys(t, cli, ck)) != 0 || len(keys(t, cli, mk)) != 0 {
		t.Errorf("claim release --force left the claim or its migration key")
	}
}
