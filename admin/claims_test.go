package admin

import (
	"context"
	"encoding/json"
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

// claimOf is a claim record of ips; with holder set, held by that owner's eth0 on node n1.
func claimOf(holder string, ips ...string) keyspace.ClaimRecord {
	rec := keyspace.ClaimRecord{HoldSeconds: 600, Since: time.Now().UTC().Add(-time.Hour)}
	for _, ip := range ips {
		rec.IPs = append(rec.IPs, netip.MustParseAddr(ip))
	}
	if holder == "" {
		rec.Released = time.Now().UTC().Add(-time.Minute)
		return rec
	}
	rec.Holder = &keyspace.ClaimHolder{Owner: holder, Pod: allocator.PodRef{UID: holder, Namespace: "ns", Name: "pod-" + holder},
		Node: "n1", NodeUID: "uid-n1", ContainerID: "ctr-" + holder, IfName: "eth0", LeaseID: "abc"}
	return rec
}

// resting is a quarantine record of an address resting under claim (claim "" : an ordinary one).
func resting(claim string) string {
	return keyspace.Encode(keyspace.QuarantineRecord{ReleasedBy: "n1", Until: time.Now().UTC().Add(11 * time.Minute), Claim: claim})
}

func quarantineOf(t *testing.T, cli *clientv3.Client, key string) (keyspace.QuarantineRecord, int64) {
	t.Helper()
	got, ok := dumpKVs(t, cli, key)[key]
	if !ok {
		t.Fatalf("%s does not exist", key)
	}
	var rec keyspace.QuarantineRecord
	if err := json.Unmarshal([]byte(got.value), &rec); err != nil {
		t.Fatalf("%s: %v", key, err)
	}
	return rec, got.lease
}

// hookKV runs before ahead of each conditional transaction's commit: a test's way to change
// keys between an admin operation's read and its write.
type hookKV struct {
	clientv3.KV
	before func()
	conds  int // conditional transactions committed
}

func (k *hookKV) Txn(ctx context.Context) clientv3.Txn { return &hookTxn{Txn: k.KV.Txn(ctx), kv: k} }

type hookTxn struct {
	clientv3.Txn
	kv   *hookKV
	cond bool
}

func (t *hookTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	t.cond, t.Txn = len(cs) > 0, t.Txn.If(cs...)
	return t
}

func (t *hookTxn) Then(ops ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Then(ops...); return t }

func (t *hookTxn) Else(ops ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Else(ops...); return t }

func (t *hookTxn) Commit() (*clientv3.TxnResponse, error) {
	if t.cond {
		t.kv.conds++
		if t.kv.before != nil {
			t.kv.before()
		}
	}
	return t.Txn.Commit()
}

func TestAdminClaims(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	cluster, cluster2, pool, other := etcdtest.Uniq("c"), etcdtest.Uniq("c"), etcdtest.Uniq("ap"), etcdtest.Uniq("ap")
	for _, p := range []string{pool, other} {
		if _, err := CreatePool(ctx, cli, adminPool(p, allocator.RangeSet{adminRange("10.71.0.0/24")}, allocator.RangeSet{adminRange("fd71::/120")})); err != nil {
			t.Fatal(err)
		}
	}
	ip := netip.MustParseAddr
	qkey := func(p, a string) string { return keyspace.QuarantineKey(p, allocator.DefaultBlocks, ip(a)) }
	claimL, restL, podL := grant(t, cli), grant(t, cli), grant(t, cli)
	putClaim := func(c, name string, rec keyspace.ClaimRecord) string {
		k := keyspace.ClaimKey(c, pool, name)
		put(t, cli, k, keyspace.Encode(rec), claimL)
		return k
	}
	// web-2 is released: both addresses rest under it. The other pool has a key of the same
	// address resting under a claim of the same name, and cluster2 a claim of the same name.
	web := putClaim(cluster, "web-2", claimOf("", "10.71.0.5", "fd71::5"))
	put(t, cli, qkey(pool, "10.71.0.5"), resting("web-2"), restL)
	put(t, cli, qkey(pool, "fd71::5"), resting("web-2"), restL)
	put(t, cli, qkey(other, "10.71.0.5"), resting("web-2"), restL)
	web2 := putClaim(cluster2, "web-2", claimOf("", "10.71.0.55"))
	// db-0 is held: its address is allocated to the holder, on the pod's lease.
	db := putClaim(cluster, "db-0", claimOf("u-db", "10.71.0.6"))
	alloc := keyspace.IPKey(pool, allocator.DefaultBlocks, ip("10.71.0.6"))
	put(t, cli, alloc, keyspace.Encode(keyspace.Allocation{Owner: "u-db", Cluster: cluster, Node: "n1", IfName: "eth0"}), podL)
	dbIndex := keyspace.OwnerKey(cluster, "u-db", "eth0", pool)
	put(t, cli, dbIndex, keyspace.Encode(keyspace.OwnerRecord{IPs: []netip.Addr{ip("10.71.0.6")}, ContainerID: "ctr-u-db", Node: "n1",
		NodeUID: "uid-n1", LeaseID: "abc", Claim: "db-0", ClaimLease: keyspace.LeaseHex(claimL), ClaimHoldSeconds: 600}), podL)
	// mixed: one address in ordinary quarantine (not under the claim), one free.
	putClaim(cluster, "mixed", claimOf("", "10.71.0.7", "10.71.0.8"))
	put(t, cli, qkey(pool, "10.71.0.7"), resting(""), restL)
	// gone-now: released with no quarantine at all.
	putClaim(cluster, "gone-now", claimOf("", "10.71.0.9"))
	put(t, cli, qkey(pool, "10.71.0.9"), resting("gone-now"), restL)
	untouched := func(keys ...string) map[string]kv {
		m := map[string]kv{}
		for _, k := range keys {
			m[k] = dumpKVs(t, cli, k)[k]
		}
		return m
	}
	before := untouched(qkey(other, "10.71.0.5"), qkey(pool, "10.71.0.7"), alloc, web2)

	t.Run("list", func(t *testing.T) {
		got, err := ListClaims(ctx, cli, cluster)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, c := range got {
			names = append(names, c.Name)
			if c.Cluster != cluster || c.Pool != pool || c.Lease != claimL || c.ModRevision == 0 || c.Unreadable != "" {
				t.Errorf("claim %+v", c)
			}
		}
		if !slices.Equal(names, []string{"db-0", "gone-now", "mixed", "web-2"}) {
			t.Errorf("claims %v, want db-0, gone-now, mixed, web-2 in order", names)
		}
		if got[0].Value.Holder == nil || got[0].Value.Holder.Pod.Name != "pod-u-db" || got[3].Value.Holder != nil || len(got[3].Value.IPs) != 2 {
			t.Errorf("records %+v", got)
		}
		all, err := ListClaims(ctx, cli, "")
		if err != nil || !slices.ContainsFunc(all, func(c ClaimEntry) bool { return c.Key == web2 }) {
			t.Errorf("ListClaims of every cluster: %v, %d claims, none of %s", err, len(all), cluster2)
		}
		if _, err := ListClaims(ctx, cli, "a/b"); !errors.Is(err, allocator.ErrInvalidName) {
			t.Errorf("ListClaims(a/b): %v, want an invalid name", err)
		}
	})
	t.Run("addresses", func(t *testing.T) {
		for name, want := range map[string][]string{
			"web-2": {ClaimAddrResting, ClaimAddrResting},
			"db-0":  {ClaimAddrAllocated},
			"mixed": {ClaimAddrQuarantined, ClaimAddrFree},
		} {
			c, err := GetClaim(ctx, cli, cluster, pool, name)
			if err != nil {
				t.Fatal(err)
			}
			addrs, err := ClaimAddresses(ctx, cli, c)
			if err != nil {
				t.Fatal(err)
			}
			var states []string
			for _, a := range addrs {
				states = append(states, a.State)
			}
			if !slices.Equal(states, want) {
				t.Errorf("%s: states %v, want %v", name, states, want)
			}
		}
	})
	t.Run("released claim: its addresses go to ordinary quarantine on a fresh lease", func(t *testing.T) {
		res, err := ReleaseClaim(ctx, cli, cluster, pool, "web-2", ClaimReleaseOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if leaseOf(t, cli, web) != -1 {
			t.Errorf("%s still exists", web)
		}
		if !slices.Equal(res.Quarantined, []netip.Addr{ip("10.71.0.5"), ip("fd71::5")}) || len(res.Freed) != 0 || res.HolderKeeps != "" ||
			res.QuarantineLease == 0 || res.QuarantineLease == restL {
			t.Errorf("result %+v", res)
		}
		for _, a := range []string{"10.71.0.5", "fd71::5"} {
			rec, lease := quarantineOf(t, cli, qkey(pool, a))
			if rec.Claim != "" || lease != int64(res.QuarantineLease) || rec.ReleasedBy != "n1" || time.Until(rec.Until) > 31*time.Second {
				t.Errorf("%s: %+v on lease %x, want an ordinary record on the fresh lease %x", a, rec, lease, res.QuarantineLease)
			}
		}
		ttl, err := TimeToLive(ctx, cli, res.QuarantineLease)
		if err != nil || ttl.GrantedTTL != 30 {
			t.Errorf("quarantine lease %+v, %v: want 30 s", ttl, err)
		}
	})
	t.Run("held claim: the pod keeps its addresses", func(t *testing.T) {
		res, err := ReleaseClaim(ctx, cli, cluster, pool, "db-0", ClaimReleaseOptions{Quarantine: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		if leaseOf(t, cli, db) != -1 || len(res.Quarantined) != 0 || res.QuarantineLease != 0 {
			t.Errorf("result %+v", res)
		}
		for _, s := range []string{"u-db", "ns/pod-u-db", "keeps 10.71.0.6", "pod lease", "stickiness"} {
			if !strings.Contains(res.HolderKeeps, s) {
				t.Errorf("HolderKeeps %q does not say %q", res.HolderKeeps, s)
			}
		}
		// The holder's owner index no longer names the claim, so that its agent does not put
		// the claim back; the rest of it stays, on the pod's lease.
		resp, err := cli.Get(ctx, dbIndex)
		if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease != int64(podL) {
			t.Fatalf("owner index of the holder: %v %v", resp, err)
		}
		rec, err := keyspace.Decode[keyspace.OwnerRecord](dbIndex, resp.Kvs[0].Value)
		if err != nil || rec.Claim != "" || rec.ClaimLease != "" || rec.ClaimHoldSeconds != 0 || rec.ContainerID != "ctr-u-db" ||
			!slices.Equal(rec.IPs, []netip.Addr{ip("10.71.0.6")}) {
			t.Errorf("owner index of the holder after the release: %+v, %v: want it without the claim, otherwise as it was", rec, err)
		}
	})
	t.Run("an address not resting under the claim is left alone", func(t *testing.T) {
		res, err := ReleaseClaim(ctx, cli, cluster, pool, "mixed", ClaimReleaseOptions{})
		if err != nil || len(res.Quarantined) != 0 || len(res.Addresses) != 2 {
			t.Errorf("ReleaseClaim: %+v, %v", res, err)
		}
	})
	t.Run("no quarantine: free at once", func(t *testing.T) {
		res, err := ReleaseClaim(ctx, cli, cluster, pool, "gone-now", ClaimReleaseOptions{Quarantine: -1})
		if err != nil || !slices.Equal(res.Freed, []netip.Addr{ip("10.71.0.9")}) || res.QuarantineLease != 0 {
			t.Errorf("ReleaseClaim: %+v, %v", res, err)
		}
		if leaseOf(t, cli, qkey(pool, "10.71.0.9")) != -1 {
			t.Errorf("the quarantine key is still there")
		}
	})
	t.Run("other pools, other clusters and other keys untouched", func(t *testing.T) {
		for k, was := range before {
			if now := dumpKVs(t, cli, k)[k]; now != was {
				t.Errorf("%s changed: %+v, was %+v", k, now, was)
			}
		}
	})
	t.Run("unknown claim", func(t *testing.T) {
		for _, name := range []string{"web-2", "nobody", "web"} { // web-2: already released; web: a prefix of web-2
			if _, err := ReleaseClaim(ctx, cli, cluster, pool, name, ClaimReleaseOptions{}); !errors.Is(err, ErrNotFound) {
				t.Errorf("ReleaseClaim(%s): %v, want not found", name, err)
			}
		}
		if _, err := ReleaseClaim(ctx, cli, cluster, pool, "a/b", ClaimReleaseOptions{}); !errors.Is(err, allocator.ErrInvalidName) {
			t.Errorf("ReleaseClaim(a/b): %v, want an invalid name", err)
		}
	})
}

// TestAdminReleaseClaimRace: the claim's next holder takes it between the release's read and
// its write. The release reads again and releases the claim as now held: it must not put the
// quarantine keys the hand-over deleted back. A claim that keeps changing is given up.
func TestAdminReleaseClaimRace(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	cluster, pool := etcdtest.Uniq("c"), etcdtest.Uniq("ap")
	if _, err := CreatePool(ctx, cli, adminPool(pool, allocator.RangeSet{adminRange("10.72.0.0/24")})); err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr("10.72.0.5")
	q, ck := keyspace.QuarantineKey(pool, allocator.DefaultBlocks, ip), keyspace.ClaimKey(cluster, pool, "web-2")
	claimL, restL := grant(t, cli), grant(t, cli)
	put(t, cli, ck, keyspace.Encode(claimOf("", ip.String())), claimL)
	put(t, cli, q, resting("web-2"), restL)

	hc := etcdtest.Client(t)
	hooked := &hookKV{KV: hc.KV}
	hc.KV = hooked
	hooked.before = func() {
		if hooked.conds != 1 {
			return
		}
		// The hand-over: the quarantine key goes, the record names the new holder.
		if _, err := cli.Txn(ctx).Then(clientv3.OpDelete(q), clientv3.OpPut(ck, keyspace.Encode(claimOf("u-new", ip.String())),
			clientv3.WithLease(claimL))).Commit(); err != nil {
			t.Error(err)
		}
	}
	res, err := ReleaseClaim(ctx, hc, cluster, pool, "web-2", ClaimReleaseOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if hooked.conds != 2 || res.HolderKeeps == "" || len(res.Quarantined) != 0 || res.Claim.Value.Holder == nil {
		t.Errorf("%d write attempts, result %+v: want a second attempt releasing the claim as held", hooked.conds, res)
	}
	if leaseOf(t, cli, ck) != -1 || leaseOf(t, cli, q) != -1 {
		t.Errorf("claim %s or quarantine key %s exists after the release", ck, q)
	}

	// A held claim handed over to another holder meanwhile (no quarantine key involved): the
	// record's own compare makes the release read again, and it reports the new holder.
	put(t, cli, ck, keyspace.Encode(claimOf("u-old", ip.String())), claimL)
	hooked.conds, hooked.before = 0, func() {
		if hooked.conds == 1 {
			put(t, cli, ck, keyspace.Encode(claimOf("u-next", ip.String())), claimL)
		}
	}
	res, err = ReleaseClaim(ctx, hc, cluster, pool, "web-2", ClaimReleaseOptions{})
	if err != nil || hooked.conds != 2 || !strings.Contains(res.HolderKeeps, "u-next") || leaseOf(t, cli, ck) != -1 {
		t.Errorf("release of a claim handed over meanwhile: %v, %d write attempts, %q: want 2 attempts naming u-next", err, hooked.conds, res.HolderKeeps)
	}

	put(t, cli, ck, keyspace.Encode(claimOf("", ip.String())), claimL)
	put(t, cli, q, resting("web-2"), restL)
	hooked.conds, hooked.before = 0, func() { put(t, cli, q, resting("web-2"), restL) } // the key changes every time
	if _, err := ReleaseClaim(ctx, hc, cluster, pool, "web-2", ClaimReleaseOptions{}); !errors.Is(err, ErrConcurrentChange) {
		t.Errorf("ReleaseClaim of a claim that keeps changing: %v, want a concurrent change", err)
	}
	if hooked.conds != adminAttempts || leaseOf(t, cli, ck) != int64(claimL) {
		t.Errorf("%d attempts, claim lease %x: want %d attempts and the claim kept", hooked.conds, leaseOf(t, cli, ck), adminAttempts)
	}
	if rec, lease := quarantineOf(t, cli, q); rec.Claim != "web-2" || lease != int64(restL) {
		t.Errorf("quarantine key %+v on %x: want it still resting under the claim", rec, lease)
	}
}

func TestAdminReadStateFilesClaims(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	st0, err := ReadState(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	cluster := etcdtest.Uniq("c")
	good, garbage := keyspace.ClaimKey(cluster, "net", "ns.web-0"), keyspace.ClaimKey(cluster, "net", "garbage")
	puts := map[string]string{
		good:    keyspace.Encode(claimOf("u1", "10.73.0.5")),
		garbage: "garbage",
		keyspace.ClaimsPrefix(cluster) + "net/a/b":    `{}`, // one part too many
		keyspace.ClaimsPrefix(cluster) + "net":        `{}`, // no claim name
		keyspace.ClaimsPrefix(cluster) + "net/":       `{}`, // an empty one
		keyspace.ClaimsPrefix(cluster) + "net/bad!na": `{}`, // a name ValidateName refuses
	}
	for k, v := range puts {
		put(t, cli, k, v, 0)
	}
	st, err := ReadState(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Claims) != len(st0.Claims)+2 || len(st.BadKeys) != len(st0.BadKeys)+4 {
		t.Errorf("claims %d->%d (want +2), bad keys %d->%d (want +4)", len(st0.Claims), len(st.Claims), len(st0.BadKeys), len(st.BadKeys))
	}
	for _, c := range st.Claims {
		switch c.Key {
		case good:
			if c.Cluster != cluster || c.Pool != "net" || c.Name != "ns.web-0" || c.Unreadable != "" || c.Value.Holder.Owner != "u1" || c.ModRevision == 0 {
				t.Errorf("claim %+v", c)
			}
		case garbage:
			if c.Unreadable == "" {
				t.Errorf("claim %s with a garbage value is not unreadable", c.Key)
			}
		}
	}
}

// claimWorld adds healthy claims to a block world: "web" held by the world's attachment (its
// owner index exists) and "db" released, its address 10.77.0.30 resting under it.
type claimWorld struct {
	*blockWorld
	claimL, restL clientv3.LeaseID
	web, db       string
}

func newClaimWorld(t *testing.T, cli *clientv3.Client) *claimWorld {
	t.Helper()
	w := &claimWorld{blockWorld: newBlockWorld(t, cli), claimL: grant(t, cli), restL: grant(t, cli)}
	web := claimOf("u-web", "10.77.0.10", "fd77::10")
	web.Holder.Node, web.Holder.NodeUID, web.Holder.ContainerID = wNode, wUID, "ctr"
	w.web, w.db = keyspace.ClaimKey(wCluster, wPool, "ns.web"), keyspace.ClaimKey(wCluster, wPool, "db")
	put(t, cli, w.web, keyspace.Encode(web), w.claimL)
	put(t, cli, w.db, keyspace.Encode(claimOf("", "10.77.0.30")), w.claimL)
	put(t, cli, keyspace.QuarantineKey(wPool, allocator.DefaultBlocks, netip.MustParseAddr("10.77.0.30")), resting("db"), w.restL)
	return w
}

// TestDoctorClaims seeds one problem of sticky claims per row into a healthy state and checks
// doctor reports it with its severity and fix; the healthy claims have no finding at all.
func TestDoctorClaims(t *testing.T) {
	cli := privateEtcd(t)
	tests := []struct {
		name     string
		seed     func(t *testing.T, w *claimWorld)
		kind     string
		severity string
		key      func(w *claimWorld) string
		fix      string // the finding's fix exactly
	}{
		// A claim key with a part too many: no agent reads it.
		{name: "claim key malformed", kind: KindBadKey, severity: SeverityError,
			seed: func(t *testing.T, w *claimWorld) { put(t, w.cli, w.db+"/extra", "{}", w.claimL) },
			key:  func(w *claimWorld) string { return w.db + "/extra" },
			fix:  "etcdctl del " + keyspace.ClaimKey(wCluster, wPool, "db") + "/extra"},
		// A claim record that is no ClaimRecord.
		{name: "claim unreadable", kind: KindUnreadable, severity: SeverityError,
			seed: func(t *testing.T, w *claimWorld) { put(t, w.cli, w.db, "garbage", w.claimL) },
			key:  func(w *claimWorld) string { return w.db },
			fix:  "etcdctl del " + keyspace.ClaimKey(wCluster, wPool, "db")},
		// A claim written without lease never goes: released with the admin command.
		{name: "claim without lease", kind: KindNoLease, severity: SeverityError,
			seed: func(t *testing.T, w *claimWorld) { put(t, w.cli, w.db, w.value(t, w.db), 0) },
			key:  func(w *claimWorld) string { return w.db },
			fix:  "leaseholdctl claim release db --pool net --cluster c1"},
		// A claim of a pool that has no definition.
		{name: "claim of an undefined pool", kind: KindClaimPoolUndefined, severity: SeverityWarning,
			seed: func(t *testing.T, w *claimWorld) {
				put(t, w.cli, keyspace.ClaimKey(wCluster, "gone", "db"), w.value(t, w.db), w.claimL)
			},
			key: func(*claimWorld) string { return keyspace.ClaimKey(wCluster, "gone", "db") },
			fix: "leaseholdctl claim release db --pool gone --cluster c1"},
		// The holder's attachment went without releasing the claim (its node died): it runs out by itself.
		{name: "claim whose holder is gone", kind: KindClaimHolderGone, severity: SeverityInfo,
			seed: func(t *testing.T, w *claimWorld) {
				put(t, w.cli, keyspace.ClaimKey(wCluster, wPool, "old"), keyspace.Encode(claimOf("u-gone", "10.77.0.40")), w.claimL)
			},
			key: func(*claimWorld) string { return keyspace.ClaimKey(wCluster, wPool, "old") },
			fix: ""},
		// The same when the holder's owner index was deleted under a held claim.
		{name: "held claim whose owner index was deleted", kind: KindClaimHolderGone, severity: SeverityInfo,
			seed: func(t *testing.T, w *claimWorld) { w.del(t, w.owner) },
			key:  func(w *claimWorld) string { return w.web },
			fix:  ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newClaimWorld(t, cli)
			if fs := w.check(t); len(fs) != 0 {
				t.Fatalf("findings on healthy claims: %+v", fs)
			}
			tt.seed(t, w)
			fs := w.check(t)
			f := findingOf(fs, tt.kind, tt.key(w))
			if f == nil {
				t.Fatalf("no %s finding for %s in %+v", tt.kind, tt.key(w), fs)
			}
			if f.Severity != tt.severity || f.Message == "" || f.Fix != tt.fix || (f.Kind != KindBadKey && f.Cluster != wCluster) {
				t.Errorf("finding %+v: want severity %s, fix %q, cluster %s", *f, tt.severity, tt.fix, wCluster)
			}
		})
	}
	// A narrow read of the claims alone knows nothing of pools and owner indexes: no finding.
	t.Run("narrow read", func(t *testing.T) {
		w := newClaimWorld(t, cli)
		put(t, w.cli, keyspace.ClaimKey(wCluster, "gone", "old"), keyspace.Encode(claimOf("u-gone", "10.77.0.40")), w.claimL)
		st, err := ReadKeys(etcdtest.Ctx(t), w.cli, keyspace.ClaimsPrefix(wCluster))
		if err != nil {
			t.Fatal(err)
		}
		if fs := Check(st); len(fs) != 0 {
			t.Errorf("findings: %+v", fs)
		}
	})
}
