package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// stickyKeysOf are the keys of a running sticky attachment on eth0: its claim record and the
// claim-marked quarantine key of each address, and its owner index.
type stickyKeysOf struct {
	pool, claim, owner string
	q                  []string
}

// claimHeldFor waits until k's claim record names owner's container with ips, on the claim
// lease the agent renews and the owner index names, and each address's quarantine key is
// marked with the claim on that lease, and until each of also holds; it returns that lease.
func claimHeldFor(t *testing.T, cli *clientv3.Client, a *Agent, owner, container, claim string, k stickyKeysOf, ips []netip.Addr,
	also ...func() error) clientv3.LeaseID {
	t.Helper()
	var lease clientv3.LeaseID
	var last string
	etcdtest.EventuallyTrue(t, "the claim's keys back on its claim lease", func() bool {
		ix, err := cli.Get(context.Background(), k.owner)
		if err != nil || len(ix.Kvs) == 0 {
			last = "no owner index"
			return false
		}
		oi, _ := keyspace.Decode[keyspace.OwnerRecord](k.owner, ix.Kvs[0].Value)
		if oi.Claim != claim {
			last = fmt.Sprintf("the owner index names claim %q", oi.Claim)
			return false
		}
		if lease, err = keyspace.ParseLeaseHex(oi.ClaimLease); err != nil || !a.keeper.Holds(lease) {
			last = fmt.Sprintf("the owner index names claim lease %q, which the agent does not renew", oi.ClaimLease)
			return false
		}
		if at, _, ok := a.pods.Attachment(owner, "eth0", k.pool); !ok || at.ClaimLease != lease {
			last = fmt.Sprintf("the agent remembers claim lease %s", keyspace.LeaseHex(at.ClaimLease))
			return false
		}
		resp, err := cli.Get(context.Background(), k.claim)
		if err != nil || len(resp.Kvs) == 0 {
			last = k.claim + " missing"
			return false
		}
		rec, _ := keyspace.Decode[keyspace.ClaimRecord](k.claim, resp.Kvs[0].Value)
		if h := rec.Holder; h == nil || h.Owner != owner || h.ContainerID != container || h.IfName != "eth0" || h.NodeUID != a.cfg.NodeUID ||
			!slices.Equal(rec.IPs, ips) || keyspace.LeaseOf(resp.Kvs[0]) != lease || rec.HoldSeconds <= 0 {
			last = fmt.Sprintf("%s: %+v holder %+v on lease %s, want held by %s/%s with %v on %s", k.claim, rec, rec.Holder,
				keyspace.LeaseHex(keyspace.LeaseOf(resp.Kvs[0])), owner, container, ips, keyspace.LeaseHex(lease))
			return false
		}
		for _, q := range k.q {
			resp, err := cli.Get(context.Background(), q)
			if err != nil || len(resp.Kvs) == 0 {
				last = q + " missing"
				return false
			}
			rec, _ := keyspace.Decode[keyspace.QuarantineRecord](q, resp.Kvs[0].Value)
			if rec.Claim != claim || keyspace.LeaseOf(resp.Kvs[0]) != lease {
				last = fmt.Sprintf("%s: %+v on lease %s", q, rec, keyspace.LeaseHex(keyspace.LeaseOf(resp.Kvs[0])))
				return false
			}
		}
		for _, f := range also {
			if err := f(); err != nil {
				last = err.Error()
				return false
			}
		}
		return true
	})
	if t.Failed() {
		t.Fatalf("last seen: %s", last)
	}
	return lease
}

// TestTheStickyClaimOfARunningPodIsPutBack: the claim record and the claim-marked quarantine
// keys of a running StatefulSet pod, deleted by hand, overwritten to name a holder that holds
// none of its addresses, or gone with their claim lease (revoked: as after a restore of a
// backup older than the lease), are put back as the agent wrote them, on the claim lease the
// agent renews; a new one if that is gone, which the owner index and the agent then name.
// Another ADD naming the claim stays refused throughout, and the pod's DEL still hands the
// claim on.
func TestTheStickyClaimOfARunningPodIsPutBack(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.0.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
	const claim = "default.web-2"
	res, err := a.Add(ctx, stickyReq(pool, "c1", "u1", claim))
	if err != nil {
		t.Fatal(err)
	}
	ips := resultAddrs(res)
	k := stickyKeysOf{pool: pool.Name, claim: keyspace.ClaimKey(cluster, pool.Name, claim), owner: keyspace.OwnerKey(cluster, "u1", "eth0", pool.Name)}
	for _, ip := range ips {
		k.q = append(k.q, keyspace.QuarantineKey(pool.Name, pool.Blocks, ip))
	}
	lease := claimHeldFor(t, cli, a, "u1", "c1", claim, k, ips)
	podLease, _ := a.pods.Lease("u1")
	lostBefore := counterValue(a.metrics.podKeysLost)

	del := func(keys ...string) func() error {
		return func() error {
			for _, key := range keys {
				if _, err := cli.Delete(ctx, key); err != nil {
					return err
				}
			}
			return nil
		}
	}
	for _, c := range []struct {
		name   string
		change func() error
		// newLease: the claim goes on a new claim lease.
		newLease bool
	}{
		{"claim record deleted", del(k.claim), false},
		{"quarantine keys deleted", del(k.q...), false},
		{"claim record and quarantine keys deleted", del(append([]string{k.claim}, k.q...)...), false},
		{"claim record names a holder that holds none of its addresses", func() error {
			rec := keyspace.ClaimRecord{IPs: ips, HoldSeconds: 600, Since: time.Now(),
				Holder: &keyspace.ClaimHolder{Owner: "u0", Node: "gone", NodeUID: "uid-gone", ContainerID: "c0", IfName: "eth0"}}
			_, err := cli.Put(ctx, k.claim, keyspace.Encode(rec), clientv3.WithLease(lease))
			return err
		}, false},
		{"claim lease revoked", func() error { _, err := cli.Revoke(ctx, lease); return err }, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := c.change(); err != nil {
				t.Fatal(err)
			}
			// The keys are back in etcd before the agent has read the answer of its repair, and it
			// counts what it put back only after: wait for the count too.
			next := claimHeldFor(t, cli, a, "u1", "c1", claim, k, ips, func() error {
				after := counterValue(a.metrics.podKeysLost)
				return etcdtest.Saw(after > lostBefore, "leasehold_pod_keys_lost_total stayed %v", after)
			})
			if c.newLease == (next == lease) {
				t.Errorf("claim lease %s after the repair, was %s: want a new one %v", keyspace.LeaseHex(next), keyspace.LeaseHex(lease), c.newLease)
			}
			lease = next
			lostBefore = counterValue(a.metrics.podKeysLost)
			if now, _ := a.pods.Lease("u1"); now != podLease {
				t.Errorf("the pod went from lease %s to %s: its own keys were fine", keyspace.LeaseHex(podLease), keyspace.LeaseHex(now))
			}
		})
	}

	// Another pod naming the claim is refused while u1 runs, and gets it after u1's DEL, from
	// the lease the repair put it on.
	short, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	_, err = a.Add(short, stickyReq(pool, "c9", "u9", claim))
	cancel()
	if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), "u1") {
		t.Fatalf("ADD of another pod naming %s while u1 runs: %v, want refused naming u1", claim, err)
	}
	if err := a.Del(ctx, stickyReq(pool, "c1", "u1", claim)); err != nil {
		t.Fatal(err)
	}
	rec, ok := readClaimRecord(t, cli, k.claim)
	if !ok || rec.Holder != nil || rec.Released.IsZero() {
		t.Fatalf("claim after the DEL: %+v (present %v), want released", rec, ok)
	}
	next, err := a.Add(ctx, stickyReq(pool, "c2", "u2", claim))
	if err != nil || !slices.Equal(resultAddrs(next), ips) {
		t.Fatalf("the next pod naming %s: %v %v, want %v", claim, resultAddrs(next), err, ips)
	}
}

// TestAClaimReleasedByAnAdminIsNotPutBack: leaseholdctl claim release of a running pod's
// claim drops only the stickiness; the agent does not put the claim back, and the pod's DEL
// quarantines its addresses as any DEL does.
func TestAClaimReleasedByAnAdminIsNotPutBack(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.75.0.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
	const claim = "default.web-2"
	if _, err := a.Add(ctx, stickyReq(pool, "c1", "u1", claim)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.ReleaseClaim(ctx, cli, cluster, pool.Name, claim, admin.ClaimReleaseOptions{}); err != nil {
		t.Fatal(err)
	}
	etcdtest.EventuallyTrue(t, "the agent forgets the claim", func() bool {
		at, _, ok := a.pods.Attachment("u1", "eth0", pool.Name)
		return ok && at.Claim == "" && at.ClaimLease == 0
	})
	audits := counterValue(a.metrics.audits)
	etcdtest.EventuallyTrue(t, "two more audits", func() bool { return counterValue(a.metrics.audits) >= audits+2 })
	if _, ok := readClaimRecord(t, cli, keyspace.ClaimKey(cluster, pool.Name, claim)); ok {
		t.Fatalf("the claim an admin released is back")
	}
	if err := a.Del(ctx, stickyReq(pool, "c1", "u1", claim)); err != nil {
		t.Fatal(err)
	}
	if _, ok := readClaimRecord(t, cli, keyspace.ClaimKey(cluster, pool.Name, claim)); ok {
		t.Fatalf("the DEL made a claim an admin released")
	}
}

// TestAClaimOfADeletedPodBroughtBackByARestoreIsReleased: after etcd went back in time, a
// claim record naming an attachment of the node deleted since (the backup had it before the
// DEL) is released as the DEL did: no holder, its quarantine keys with it on a lease of the
// hold. One naming a running attachment of the node is that attachment's, not released.
func TestAClaimOfADeletedPodBroughtBackByARestoreIsReleased(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.76.0.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
	gone, kept := "default.web-0", "default.web-1"
	res, err := a.Add(ctx, stickyReq(pool, "c0", "u0", gone))
	if err != nil {
		t.Fatal(err)
	}
	ips := resultAddrs(res)
	if _, err := a.Add(ctx, stickyReq(pool, "c1", "u1", kept)); err != nil {
		t.Fatal(err)
	}
	key := keyspace.ClaimKey(cluster, pool.Name, gone)
	before, err := cli.Get(ctx, key)
	if err != nil || len(before.Kvs) == 0 {
		t.Fatalf("claim %s: %v %v", key, before, err)
	}
	if err := a.Del(ctx, stickyReq(pool, "c0", "u0", gone)); err != nil {
		t.Fatal(err)
	}
	// What a restore of a backup from before the DEL brings back: the record naming u0 and
	// its quarantine keys, on a lease nobody renews.
	g, err := cli.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	ops := []clientv3.Op{clientv3.OpPut(key, string(before.Kvs[0].Value), clientv3.WithLease(g.ID))}
	for _, ip := range ips {
		ops = append(ops, clientv3.OpPut(keyspace.QuarantineKey(pool.Name, pool.Blocks, ip),
			keyspace.Encode(keyspace.QuarantineRecord{Claim: gone}), clientv3.WithLease(g.ID)))
	}
	if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
		t.Fatal(err)
	}
	a.notices.WentBack("a test's restore") // not told to the package's other agents (restorenotice/restored.go)
	etcdtest.EventuallyTrue(t, "the claim of the deleted pod released", func() bool {
		rec, ok := readClaimRecord(t, cli, key)
		return ok && rec.Holder == nil && !rec.Released.IsZero()
	})
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 || keyspace.LeaseOf(resp.Kvs[0]) == g.ID {
		t.Fatalf("the released claim: %v %v, want off lease %s", resp, err, keyspace.LeaseHex(g.ID))
	}
	for _, ip := range ips {
		q := keyspace.QuarantineKey(pool.Name, pool.Blocks, ip)
		qr, err := cli.Get(ctx, q)
		if err != nil || len(qr.Kvs) == 0 || qr.Kvs[0].Lease != resp.Kvs[0].Lease {
			t.Errorf("%s: %v %v, want on the released claim's lease %x", q, qr, err, resp.Kvs[0].Lease)
		}
	}
	if rec, ok := readClaimRecord(t, cli, keyspace.ClaimKey(cluster, pool.Name, kept)); !ok || rec.Holder == nil || rec.Holder.Owner != "u1" {
		t.Errorf("the claim of the running pod: %+v (present %v), want held by u1", rec, ok)
	}
	// The next pod naming the released claim gets its addresses.
	next, err := a.Add(ctx, stickyReq(pool, "c2", "u2", gone))
	if err != nil || !slices.Equal(resultAddrs(next), ips) {
		t.Fatalf("the next pod naming %s: %v %v, want %v", gone, resultAddrs(next), err, ips)
	}
}

// TestAReleasedClaimARestoreTookIsPutBack: a claim the node released, which a restore of a
// backup older than the claim took from etcd, is put back as released for the rest of its
// hold: the next pod naming it gets its addresses. Also by the agent restarted since the
// release, which reads it from its state directory (found by the model,
// LEASEHOLD_MODEL_SEED=1795803430334405080: a node crashed right after the DEL).
func TestAReleasedClaimARestoreTookIsPutBack(t *testing.T) {
	for _, restarted := range []bool{false, true} {
		t.Run(map[bool]string{false: "running", true: "restarted"}[restarted], func(t *testing.T) {
			testAReleasedClaimARestoreTookIsPutBack(t, restarted)
		})
	}
}

func testAReleasedClaimARestoreTookIsPutBack(t *testing.T, restarted bool) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.77.0.0/24", 28)
	state := t.TempDir()
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(state), auditFast)
	const claim = "default.web-3"
	res, err := a.Add(ctx, stickyReq(pool, "c3", "u3", claim))
	if err != nil {
		t.Fatal(err)
	}
	ips := resultAddrs(res)
	if err := a.Del(ctx, stickyReq(pool, "c3", "u3", claim)); err != nil {
		t.Fatal(err)
	}
	key := keyspace.ClaimKey(cluster, pool.Name, claim)
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatalf("claim %s after the DEL: %v %v", key, resp, err)
	}
	released := clientv3.LeaseID(resp.Kvs[0].Lease)
	if restarted {
		a.Close()
		a = startAgent(t, cluster, "n1", "uid-n1", withHold(state), auditFast)
	}
	// What a restore of a backup older than the claim does: the claim, its quarantine keys
	// and its lease are gone.
	if _, err := cli.Revoke(ctx, released); err != nil {
		t.Fatal(err)
	}
	a.notices.WentBack("a test's restore") // not told to the package's other agents (restorenotice/restored.go)
	etcdtest.EventuallyTrue(t, "the released claim put back", func() bool {
		rec, ok := readClaimRecord(t, cli, key)
		return ok && rec.Holder == nil && !rec.Released.IsZero() && slices.Equal(rec.IPs, ips)
	})
	resp, err = cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatal(resp, err)
	}
	ttl, err := cli.TimeToLive(ctx, clientv3.LeaseID(resp.Kvs[0].Lease))
	if err != nil || ttl.TTL <= 0 || time.Duration(ttl.TTL)*time.Second > a.cfg.ClaimHold {
		t.Errorf("the claim put back is on a lease of TTL %v (%v), want the hold left, at most %s", ttl, err, a.cfg.ClaimHold)
	}
	for _, ip := range ips {
		q := keyspace.QuarantineKey(pool.Name, pool.Blocks, ip)
		qr, err := cli.Get(ctx, q)
		if err != nil || len(qr.Kvs) == 0 || qr.Kvs[0].Lease != resp.Kvs[0].Lease {
			t.Fatalf("%s: %v %v, want on the claim's lease %x", q, qr, err, resp.Kvs[0].Lease)
		}
		if rec, _ := keyspace.Decode[keyspace.QuarantineRecord](q, qr.Kvs[0].Value); rec.Claim != claim || rec.ReleasedBy != "u3" {
			t.Errorf("%s: %+v, want resting under %s, released by u3", q, rec, claim)
		}
	}
	next, err := a.Add(ctx, stickyReq(pool, "c4", "u4", claim))
	if err != nil || !slices.Equal(resultAddrs(next), ips) {
		t.Fatalf("the next pod naming %s: %v %v, want %v", claim, resultAddrs(next), err, ips)
	}
}

// TestARestoredEarlierHolderOfAClaimDoesNotKeepItsAddressesFromTheRunningPod: a restore of a
// backup from when another pod held a StatefulSet pod's claim, on a node gone since, brings
// back that pod's keys: its allocations, on its pod lease, which nobody renews; its claim's
// quarantine keys, on its claim lease; its held keys, on its node's block lease, which stands
// for the reuse delay. The running pod that holds the claim now is in conflict while the old
// allocations stand, then gets its addresses back, with held keys of its own, and its claim's
// record and quarantine keys on its claim lease: the old held keys hold nothing back from the
// claim's own pod, as from an ADD naming it. Found by the model (LEASEHOLD_MODEL_SEED
// 1795798955580404457): the running pod waited for the old block lease to run out.
func TestARestoredEarlierHolderOfAClaimDoesNotKeepItsAddressesFromTheRunningPod(t *testing.T) {
	eachRestoreWay(t, "10.84.0.0/28", func(t *testing.T, b restoreBed) {
		member, cli, cluster, ctx, pool := b.member, b.cli, b.cluster, b.ctx, b.pool
		const claim = "default.web-2"
		a0 := startAgentAt(t, member.ClientURL, cluster, "n0", "uid-n0", withHold(t.TempDir()), auditFast)
		first, err := a0.Add(ctx, stickyReq(pool, "c0", "u0", claim))
		if err != nil {
			t.Fatal(err)
		}
		ips := resultAddrs(first)
		backup := filepath.Join(t.TempDir(), "backup.db")
		if err := member.Snapshot(ctx, backup); err != nil {
			t.Fatal(err)
		}
		// The pod's DEL, its node gone, and the claim's next pod on another node.
		if err := a0.Del(ctx, stickyReq(pool, "c0", "u0", claim)); err != nil {
			t.Fatal(err)
		}
		a0.Close()
		a1 := startAgentAt(t, member.ClientURL, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
		next, err := a1.Add(ctx, stickyReq(pool, "c1", "u1", claim))
		if err != nil || !slices.Equal(resultAddrs(next), ips) {
			t.Fatalf("the claim's next pod: %v %v, want %v", resultAddrs(next), err, ips)
		}
		if err := member.Restore(backup, b.bump); err != nil {
			t.Fatal(err)
		}
		// The backup's allocations and held keys of u0; the allocations go with u0's pod
		// lease, as etcd expires it a TTL after the restore.
		var old clientv3.LeaseID
		etcdtest.Eventually(t, "u0's keys back with the restore", func() error {
			for _, ip := range ips {
				al, err := cli.Get(ctx, keyspace.IPKey(pool.Name, pool.Blocks, ip))
				if err != nil {
					return err
				}
				held, err := cli.Get(ctx, keyspace.HeldKey(pool.Name, pool.Blocks, ip))
				if err != nil {
					return err
				}
				if len(al.Kvs) == 0 || len(held.Kvs) == 0 {
					return fmt.Errorf("%s: allocation %v, held key %v", ip, al.Kvs, held.Kvs)
				}
				rec, _ := keyspace.Decode[keyspace.Allocation](string(al.Kvs[0].Key), al.Kvs[0].Value)
				h, _ := keyspace.Decode[keyspace.HeldRecord](string(held.Kvs[0].Key), held.Kvs[0].Value)
				if rec.Owner != "u0" || h.Owner != "u0" {
					return fmt.Errorf("%s: allocated to %s, held for %s, want u0's keys", ip, rec.Owner, h.Owner)
				}
				old = keyspace.LeaseOf(al.Kvs[0])
			}
			return nil
		})
		if _, err := cli.Revoke(ctx, old); err != nil && !keyspace.IsLeaseNotFound(err) {
			t.Fatal(err)
		}
		k := stickyKeysOf{pool: pool.Name, claim: keyspace.ClaimKey(cluster, pool.Name, claim),
			owner: keyspace.OwnerKey(cluster, "u1", "eth0", pool.Name)}
		for _, ip := range ips {
			k.q = append(k.q, keyspace.QuarantineKey(pool.Name, pool.Blocks, ip))
		}
		claimHeldFor(t, cli, a1, "u1", "c1", claim, k, ips, func() error {
			lease, _ := a1.pods.Lease("u1")
			for _, ip := range ips {
				al, err := cli.Get(ctx, keyspace.IPKey(pool.Name, pool.Blocks, ip))
				if err != nil || len(al.Kvs) == 0 || keyspace.LeaseOf(al.Kvs[0]) != lease {
					return fmt.Errorf("%s: allocation %v (%v), want on u1's lease %s", ip, al, err, keyspace.LeaseHex(lease))
				}
				held, err := cli.Get(ctx, keyspace.HeldKey(pool.Name, pool.Blocks, ip))
				if err != nil || len(held.Kvs) == 0 {
					return fmt.Errorf("%s: no held key (%v)", ip, err)
				}
				if h, _ := keyspace.Decode[keyspace.HeldRecord](string(held.Kvs[0].Key), held.Kvs[0].Value); h.Owner != "u1" {
					return fmt.Errorf("%s: held for %s, want u1", ip, h.Owner)
				}
			}
			if n := len(etcdtest.Dump(t, cli, keyspace.ConflictKey(cluster, "u1", "eth0", pool.Name))); n != 0 {
				return fmt.Errorf("u1's conflict record is still there")
			}
			if at, _, _ := a1.pods.Attachment("u1", "eth0", pool.Name); len(at.Conflicts) > 0 {
				return fmt.Errorf("the agent lists conflicts %v", at.Conflicts)
			}
			return nil
		})
	})
}
