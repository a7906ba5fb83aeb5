package admin

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// migrationWorld is a claim world whose claim "ns.web" is migratable and being migrated: its
// holder u-web on node n1 owns the addresses, and the target u-tgt on node n2 uses them too,
// named by the live migration key on its pod lease, with its owner index and pod record there.
type migrationWorld struct {
	*claimWorld
	tgtL                  clientv3.LeaseID
	mig, tgtOwner, tgtPod string
}

const wNode2, wUID2 = "n2", "uid-n2"

// targetRecord is the live migration record of the world's target, started since.
func targetRecord(node string, since time.Time) keyspace.LiveMigrationRecord {
	return keyspace.LiveMigrationRecord{
		Target: keyspace.ClaimHolder{Owner: "u-tgt", Pod: allocator.PodRef{UID: "u-tgt", Namespace: "ns", Name: "virt-launcher-web-b"},
			Node: node, NodeUID: wUID2, ContainerID: "ctr-tgt", IfName: "eth0", LeaseID: "def"},
		ClaimLease: "1", BlockLease: "2", Source: keyspace.LiveMigrationSource{Owner: "u-web", Node: wNode, LeaseID: "abc"}, Since: since}
}

func newMigrationWorld(t *testing.T, cli *clientv3.Client) *migrationWorld {
	t.Helper()
	w := &migrationWorld{claimWorld: newClaimWorld(t, cli)}
	w.tgtL = grant(t, cli)
	w.setMigratable(t, true)
	now := time.Now().UTC()
	nodeL := grant(t, cli)
	put(t, cli, keyspace.NodeKey(wCluster, wNode2), keyspace.Encode(keyspace.NodeRecord{UID: wUID2, Host: "h2", Version: "v", Blocks: true, LiveMigration: true,
		Started: now, LeaseID: keyspace.LeaseHex(nodeL), BlockLease: keyspace.LeaseHex(w.blockL)}), nodeL)
	ips := []netip.Addr{netip.MustParseAddr("10.77.0.10"), netip.MustParseAddr("fd77::10")}
	w.tgtOwner, w.tgtPod = keyspace.OwnerKey(wCluster, "u-tgt", "eth0", wPool), keyspace.PodKey(wCluster, wNode2, "u-tgt")
	put(t, cli, w.tgtOwner, keyspace.Encode(keyspace.OwnerRecord{IPs: ips, ContainerID: "ctr-tgt", Network: wPool, Node: wNode2, NodeUID: wUID2,
		LeaseID: keyspace.LeaseHex(w.tgtL), Created: now, Claim: "ns.web", ClaimLease: "1", ClaimHoldSeconds: 600}), w.tgtL)
	put(t, cli, w.tgtPod, keyspace.Encode(keyspace.PodRecord{Owner: "u-tgt", Pod: allocator.PodRef{UID: "u-tgt", Namespace: "ns",
		Name: "virt-launcher-web-b"}, NodeUID: wUID2, LeaseID: keyspace.LeaseHex(w.tgtL), ContainerID: "ctr-tgt", Created: now}), w.tgtL)
	w.mig = keyspace.LiveMigrationKey(wCluster, wPool, "ns.web")
	put(t, cli, w.mig, keyspace.Encode(targetRecord(wNode2, now.Add(-time.Minute))), w.tgtL)
	return w
}

// setMigratable rewrites the claim record of ns.web with its migratable mark set or not.
func (w *migrationWorld) setMigratable(t *testing.T, on bool) {
	t.Helper()
	rec := claimOf("u-web", "10.77.0.10", "fd77::10")
	rec.Holder.Node, rec.Holder.NodeUID, rec.Holder.ContainerID, rec.Migratable = wNode, wUID, "ctr", on
	put(t, w.cli, w.web, keyspace.Encode(rec), w.claimL)
}

// TestDoctorLiveMigrations: a healthy migration is one info finding and nothing else (the
// target's owner index names addresses the holder's allocation keys hold: accepted); each row
// seeds one problem of live migrations and checks doctor reports it with its severity and fix.
func TestDoctorLiveMigrations(t *testing.T) {
	cli := privateEtcd(t)
	ip4 := netip.MustParseAddr("10.77.0.10")
	tests := []struct {
		name     string
		seed     func(t *testing.T, w *migrationWorld)
		opt      CheckOptions
		kind     string
		severity string
		key      func(w *migrationWorld) string
		fix      string // the finding's fix exactly; "*" for any
		// clean: the seeded state has no other error or warning than this finding.
		clean bool
	}{
		// A migration started two hours ago, past the default bound of an hour.
		{name: "too old", kind: KindLiveMigrationTooOld, severity: SeverityWarning, clean: true,
			seed: func(t *testing.T, w *migrationWorld) {
				put(t, w.cli, w.mig, keyspace.Encode(targetRecord(wNode2, time.Now().Add(-2*time.Hour))), w.tgtL)
			},
			key: func(w *migrationWorld) string { return w.mig },
			fix: "kubectl get virtualmachineinstancemigrations.kubevirt.io -A"},
		// The same migration with a bound of three hours: still an information.
		{name: "old, within a longer bound", kind: KindLiveMigration, severity: SeverityInfo, clean: true,
			opt: CheckOptions{LiveMigrationBound: 3 * time.Hour},
			seed: func(t *testing.T, w *migrationWorld) {
				put(t, w.cli, w.mig, keyspace.Encode(targetRecord(wNode2, time.Now().Add(-2*time.Hour))), w.tgtL)
			},
			key: func(w *migrationWorld) string { return w.mig },
			fix: ""},
		// A target on the holder's node: written by hand.
		{name: "same node", kind: KindLiveMigrationSameNode, severity: SeverityError,
			seed: func(t *testing.T, w *migrationWorld) {
				put(t, w.cli, w.mig, keyspace.Encode(targetRecord(wNode, time.Now())), w.tgtL)
			},
			key: func(w *migrationWorld) string { return w.mig },
			fix: "kubectl delete pod -n ns virt-launcher-web-b"},
		// A migration of a claim that is not migratable.
		{name: "not allowed", kind: KindLiveMigrationNotAllowed, severity: SeverityError,
			seed: func(t *testing.T, w *migrationWorld) { w.setMigratable(t, false) },
			key:  func(w *migrationWorld) string { return w.mig },
			fix:  "kubectl delete pod -n ns virt-launcher-web-b"},
		// The holder's node died: its pod lease expired (allocations, owner index, pod record
		// gone) and the target's agent has not promoted it yet. The target's owner index naming
		// addresses no key holds is accepted meanwhile.
		{name: "holder expired", kind: KindLiveMigrationOrphan, severity: SeverityWarning, clean: true,
			seed: func(t *testing.T, w *migrationWorld) {
				if _, err := w.cli.Revoke(etcdtest.Ctx(t), w.pod); err != nil {
					t.Fatal(err)
				}
			},
			key: func(w *migrationWorld) string { return w.mig },
			fix: "kubectl delete pod -n ns virt-launcher-web-b"},
		// No claim record at all.
		{name: "no claim record", kind: KindLiveMigrationOrphan, severity: SeverityWarning,
			seed: func(t *testing.T, w *migrationWorld) { w.del(t, w.web) },
			key:  func(w *migrationWorld) string { return w.mig },
			fix:  "kubectl delete pod -n ns virt-launcher-web-b"},
		// A third owner's allocation of a claim address.
		{name: "foreign owner", kind: KindClaimForeignOwner, severity: SeverityError,
			seed: func(t *testing.T, w *migrationWorld) {
				put(t, w.cli, w.ip4, keyspace.Encode(keyspace.Allocation{Owner: "u-x", Cluster: wCluster, Node: "n3", IfName: "eth0",
					Pod: allocator.PodRef{UID: "u-x", Namespace: "other", Name: "x"}}), w.pod)
			},
			key: func(w *migrationWorld) string { return w.ip4 },
			fix: "kubectl delete pod -n other x"},
		// A migration key without lease outlives its target.
		{name: "no lease", kind: KindNoLease, severity: SeverityError,
			seed: func(t *testing.T, w *migrationWorld) { put(t, w.cli, w.mig, w.value(t, w.mig), 0) },
			key:  func(w *migrationWorld) string { return w.mig },
			fix:  "*"},
		// A migration key that does not decode.
		{name: "unreadable", kind: KindUnreadable, severity: SeverityError,
			seed: func(t *testing.T, w *migrationWorld) { put(t, w.cli, w.mig, "garbage", w.tgtL) },
			key:  func(w *migrationWorld) string { return w.mig },
			fix:  "etcdctl del " + keyspace.LiveMigrationKey(wCluster, wPool, "ns.web")},
		// A migration key with a part too many.
		{name: "malformed key", kind: KindBadKey, severity: SeverityError,
			seed: func(t *testing.T, w *migrationWorld) { put(t, w.cli, w.mig+"/x", "{}", w.tgtL) },
			key:  func(w *migrationWorld) string { return w.mig + "/x" },
			fix:  "etcdctl del " + keyspace.LiveMigrationKey(wCluster, wPool, "ns.web") + "/x"},
	}
	checkWith := func(t *testing.T, w *migrationWorld, opt CheckOptions) []Finding {
		t.Helper()
		st, err := ReadState(etcdtest.Ctx(t), w.cli)
		if err != nil {
			t.Fatal(err)
		}
		return CheckWith(st, opt)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newMigrationWorld(t, cli)
			fs := checkWith(t, w, CheckOptions{})
			if len(fs) != 1 || fs[0].Kind != KindLiveMigration || fs[0].Severity != SeverityInfo || fs[0].Keys[0] != w.mig ||
				!strings.Contains(fs[0].Message, "virt-launcher-web-b") || !strings.Contains(fs[0].Message, "node n2") {
				t.Fatalf("findings of a healthy migration: %+v, want one %s info naming the target", fs, KindLiveMigration)
			}
			tt.seed(t, w)
			fs = checkWith(t, w, tt.opt)
			f := findingOf(fs, tt.kind, tt.key(w))
			if f == nil {
				t.Fatalf("no %s finding for %s in %+v", tt.kind, tt.key(w), fs)
			}
			if f.Severity != tt.severity || f.Message == "" || (tt.fix != "*" && f.Fix != tt.fix) || (f.Kind != KindBadKey && f.Cluster != wCluster) {
				t.Errorf("finding %+v: want severity %s, fix %q, cluster %s", *f, tt.severity, tt.fix, wCluster)
			}
			for _, g := range fs {
				if tt.clean && g.Problem() && g.Kind != tt.kind {
					t.Errorf("another problem besides %s: %+v", tt.kind, g)
				}
			}
		})
	}
	// Without a migration, an address of a held claim allocated to another owner is reported
	// besides the holder's owner index naming another holder.
	t.Run("foreign owner of a held claim", func(t *testing.T) {
		w := newClaimWorld(t, cli)
		put(t, w.cli, w.ip4, keyspace.Encode(keyspace.Allocation{Owner: "u-x", Cluster: wCluster, Node: "n3", IfName: "eth0"}), w.pod)
		fs := w.check(t)
		f := findingOf(fs, KindClaimForeignOwner, w.ip4)
		if f == nil || f.Fix != releaseFix(ip4, wPool, w.pod) || !strings.Contains(f.Message, "u-x") {
			t.Errorf("finding %+v in %+v: want a %s naming u-x, fixed by releasing it", f, fs, KindClaimForeignOwner)
		}
	})
}

// TestAdminClaimReleaseDuringMigration: claim release refuses a claim being migrated, naming
// the target, and changes nothing; with Force it deletes the migration key with the claim,
// compared: a migration key rewritten between the read and the write is read again, and one
// started between them refuses a release without Force.
func TestAdminClaimReleaseDuringMigration(t *testing.T) {
	cli := privateEtcd(t)
	ctx := etcdtest.Ctx(t)

	t.Run("refused", func(t *testing.T) {
		w := newMigrationWorld(t, cli)
		before := dumpKVs(t, cli, keyspace.Prefix)
		_, err := ReleaseClaim(ctx, cli, wCluster, wPool, "ns.web", ClaimReleaseOptions{})
		var mip *MigrationInProgressError
		if !errors.Is(err, ErrMigrationInProgress) || !errors.As(err, &mip) || !strings.Contains(err.Error(), "virt-launcher-web-b") ||
			!strings.Contains(err.Error(), "node n2") || !strings.Contains(err.Error(), "--force") {
			t.Fatalf("release of a migrating claim: %v, want ErrMigrationInProgress naming the target and --force", err)
		}
		if after := dumpKVs(t, cli, keyspace.Prefix); len(after) != len(before) || after[w.web] != before[w.web] || after[w.mig] != before[w.mig] {
			t.Errorf("a refused release changed keys")
		}
	})

	t.Run("forced", func(t *testing.T) {
		w := newMigrationWorld(t, cli)
		res, err := ReleaseClaim(ctx, cli, wCluster, wPool, "ns.web", ClaimReleaseOptions{Force: true})
		if err != nil {
			t.Fatal(err)
		}
		if res.MigrationDeleted == nil || res.MigrationDeleted.Key != w.mig || res.HolderKeeps == "" {
			t.Errorf("release %+v: want the migration key %s deleted, the holder told it keeps its addresses", res, w.mig)
		}
		got := dumpKVs(t, cli, keyspace.Prefix)
		if _, ok := got[w.mig]; ok {
			t.Errorf("migration key %s still exists", w.mig)
		}
		if _, ok := got[w.web]; ok {
			t.Errorf("claim %s still exists", w.web)
		}
		if _, ok := got[w.tgtOwner]; !ok {
			t.Errorf("the target's owner index %s went: it is its agent's", w.tgtOwner)
		}
	})

	t.Run("forced, migration rewritten meanwhile", func(t *testing.T) {
		w := newMigrationWorld(t, cli)
		hc := etcdtest.ClientAt(t, cli.Endpoints()[0])
		hooked := &hookKV{KV: hc.KV}
		hc.KV = hooked
		var rewrote int64
		hooked.before = func() {
			if hooked.conds != 1 {
				return
			}
			r, err := cli.Put(ctx, w.mig, keyspace.Encode(targetRecord(wNode2, time.Now().UTC())), clientv3.WithLease(w.tgtL))
			if err != nil {
				t.Error(err)
				return
			}
			rewrote = r.Header.Revision
		}
		res, err := ReleaseClaim(ctx, hc, wCluster, wPool, "ns.web", ClaimReleaseOptions{Force: true})
		if err != nil {
			t.Fatal(err)
		}
		if hooked.conds != 2 || res.MigrationDeleted == nil || res.MigrationDeleted.ModRevision != rewrote {
			t.Errorf("transactions %d, deleted %+v: want a second one, deleting the migration key as rewritten at %d", hooked.conds, res.MigrationDeleted, rewrote)
		}
		if _, ok := dumpKVs(t, cli, w.mig)[w.mig]; ok {
			t.Errorf("migration key %s still exists", w.mig)
		}
	})

	t.Run("migration started meanwhile", func(t *testing.T) {
		w := newMigrationWorld(t, cli)
		w.del(t, w.mig)
		hc := etcdtest.ClientAt(t, cli.Endpoints()[0])
		hooked := &hookKV{KV: hc.KV}
		hc.KV = hooked
		hooked.before = func() {
			if hooked.conds == 1 {
				put(t, cli, w.mig, keyspace.Encode(targetRecord(wNode2, time.Now().UTC())), w.tgtL)
			}
		}
		_, err := ReleaseClaim(ctx, hc, wCluster, wPool, "ns.web", ClaimReleaseOptions{})
		if !errors.Is(err, ErrMigrationInProgress) {
			t.Fatalf("release while a migration started: %v, want ErrMigrationInProgress", err)
		}
		if _, ok := dumpKVs(t, cli, w.web)[w.web]; !ok {
			t.Errorf("claim %s deleted under a migration that started before the write", w.web)
		}
	})
}

// TestAdminClaimsCarryTheirMigration: ListClaims and GetClaim give each claim its live
// migration key, and only its own (claim "ns.web" is a prefix of claim "ns.web-2").
func TestAdminClaimsCarryTheirMigration(t *testing.T) {
	cli := privateEtcd(t)
	ctx := etcdtest.Ctx(t)
	w := newMigrationWorld(t, cli)
	put(t, cli, keyspace.ClaimKey(wCluster, wPool, "ns.web-2"), keyspace.Encode(claimOf("", "10.77.0.50")), w.claimL)
	c, err := GetClaim(ctx, cli, wCluster, wPool, "ns.web")
	if err != nil {
		t.Fatal(err)
	}
	if c.Migration == nil || c.Migration.Value.Target.Owner != "u-tgt" || c.Migration.Lease != w.tgtL {
		t.Errorf("GetClaim migration %+v, want u-tgt's on its lease", c.Migration)
	}
	c2, err := GetClaim(ctx, cli, wCluster, wPool, "ns.web-2")
	if err != nil || c2.Migration != nil {
		t.Errorf("GetClaim ns.web-2: %v, migration %+v; want none", err, c2.Migration)
	}
	list, err := ListClaims(ctx, cli, wCluster)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range list {
		if want := c.Name == "ns.web"; (c.Migration != nil) != want {
			t.Errorf("ListClaims %s migration %+v, want one: %v", c.Name, c.Migration, want)
		}
	}
}

// TestDoctorLiveMigrationOldAgent: a live agent whose node record has no liveMigration mark
// (an agent from before live migrations) is a warning naming the node, its version and the
// upgrade, once its cluster has a migratable claim or a live migration key; without either,
// or with every agent current, nothing is reported.
func TestDoctorLiveMigrationOldAgent(t *testing.T) {
	cli := privateEtcd(t)
	nodeKey := keyspace.NodeKey(wCluster, wNode)
	// agentOf writes n1's node record in cluster as an agent of version v0.9 does: without
	// the liveMigration mark, or, with current, with it, as this version's agent does.
	agentOf := func(t *testing.T, w *claimWorld, cluster string, current bool) {
		t.Helper()
		put(t, cli, keyspace.NodeKey(cluster, wNode), keyspace.Encode(keyspace.NodeRecord{UID: wUID, Host: "h1", Version: "v0.9", Blocks: true,
			LiveMigration: current, Started: time.Now().UTC(), LeaseID: keyspace.LeaseHex(w.nodeLease), BlockLease: keyspace.LeaseHex(w.blockL)}),
			w.nodeLease)
	}
	migratable := func(t *testing.T, w *claimWorld) {
		t.Helper()
		(&migrationWorld{claimWorld: w}).setMigratable(t, true)
	}
	tests := []struct {
		name string
		seed func(t *testing.T, w *claimWorld)
		want bool // a live-migration-old-agent finding for n1
	}{
		// The claim ns.web is migratable: n1's old agent would release it under a target.
		{name: "old agent, migratable claim", want: true, seed: func(t *testing.T, w *claimWorld) {
			migratable(t, w)
			agentOf(t, w, wCluster, false)
		}},
		// A migration key of a claim not (any more) migratable: a migration is what is at
		// stake. The migration world replaces the claim world's keys.
		{name: "old agent, live migration key", want: true, seed: func(t *testing.T, w *claimWorld) {
			mw := newMigrationWorld(t, cli)
			mw.setMigratable(t, false)
			agentOf(t, mw.claimWorld, wCluster, false)
		}},
		// No claim is migratable and no migration runs: an old agent does what it always did.
		{name: "old agent, no migratable claim", seed: func(t *testing.T, w *claimWorld) {
			agentOf(t, w, wCluster, false)
		}},
		// Every agent is of this version.
		{name: "current agent, migratable claim", seed: func(t *testing.T, w *claimWorld) {
			migratable(t, w)
			agentOf(t, w, wCluster, true)
		}},
		// The old agent is another cluster's, whose claims are none migratable.
		{name: "old agent of another cluster", seed: func(t *testing.T, w *claimWorld) {
			migratable(t, w)
			agentOf(t, w, "c2", false)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newClaimWorld(t, cli)
			tt.seed(t, w)
			fs := w.check(t)
			f := findingOf(fs, KindLiveMigrationOldAgent, "")
			if !tt.want {
				if f != nil {
					t.Errorf("reported %+v, want no %s", *f, KindLiveMigrationOldAgent)
				}
				return
			}
			if f == nil {
				t.Fatalf("no %s finding in %+v", KindLiveMigrationOldAgent, fs)
			}
			if f.Severity != SeverityWarning || f.Cluster != wCluster || f.Keys[0] != nodeKey || f.Fix != "leaseholdctl node list --cluster "+wCluster {
				t.Errorf("finding %+v: want a warning of cluster %s on %s, fixed by looking at node list", *f, wCluster, nodeKey)
			}
			for _, w := range []string{"node n1", "v0.9", "Upgrade the agent of node n1"} {
				if !strings.Contains(f.Message, w) {
					t.Errorf("message %q does not say %q", f.Message, w)
				}
			}
			for _, g := range fs {
				if g.Problem() && g.Kind != KindLiveMigrationOldAgent && g.Kind != KindLiveMigrationNotAllowed {
					t.Errorf("another problem besides %s: %+v", KindLiveMigrationOldAgent, g)
				}
			}
		})
	}
}
