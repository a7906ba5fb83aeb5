package leases

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/restorehold"
	"github.com/leasehold/leasehold/leases/restorenotice"
)

// Issue 32: a live lease is not proof. The agent checks what it wrote and puts back what an
// admin deleted or overwrote, as after a lost lease. With real processes, etcdctl and a
// restored backup: integration/restore_test.go.

// auditFast is an audit interval the tests wait for: a lost key is put back within it.
func auditFast(c *Config) {
	c.AuditInterval = 300 * time.Millisecond
	c.LivenessInterval, c.GCGrace = -1, -1
}

// podKeys are the keys of a pod with one attachment on eth0 in pool.
type podKeys struct {
	pod, owner, alloc string
}

func keysOf(cluster, node, owner string, pool allocator.PoolSpec, ip netip.Addr) podKeys {
	return podKeys{pod: keyspace.PodKey(cluster, node, owner), owner: keyspace.OwnerKey(cluster, owner, "eth0", pool.Name),
		alloc: keyspace.IPKey(pool.Name, pool.Blocks, ip)}
}

// heldFor waits until every key of k exists on the lease the agent holds for owner, with the
// values of owner's attachment of ip, and returns that lease; a bound far above the audit
// interval, so that only a missing repair fails it.
func heldFor(t *testing.T, cli *clientv3.Client, a *Agent, owner string, k podKeys, ip netip.Addr) clientv3.LeaseID {
	t.Helper()
	var lease clientv3.LeaseID
	var last string
	etcdtest.EventuallyTrue(t, "the pod's keys back on its lease", func() bool {
		var ok bool
		if lease, ok = a.pods.Lease(owner); !ok {
			last = "the agent holds no lease for the pod"
			return false
		}
		for _, key := range []string{k.pod, k.owner, k.alloc} {
			resp, err := cli.Get(context.Background(), key)
			if err != nil || len(resp.Kvs) == 0 {
				last = key + " missing"
				return false
			}
			kv := resp.Kvs[0]
			if keyspace.LeaseOf(kv) != lease {
				last = fmt.Sprintf("%s on lease %s, not %s", key, keyspace.LeaseHex(keyspace.LeaseOf(kv)), keyspace.LeaseHex(lease))
				return false
			}
			if key == k.alloc {
				if rec, err := keyspace.Decode[keyspace.Allocation](key, kv.Value); err != nil || rec.Owner != owner {
					last = fmt.Sprintf("%s held by %q", key, rec.Owner)
					return false
				}
			}
			if key == k.owner {
				if rec, err := keyspace.Decode[keyspace.OwnerRecord](key, kv.Value); err != nil || len(rec.IPs) != 1 || rec.IPs[0] != ip {
					last = fmt.Sprintf("%s lists %v, want [%s]", key, rec.IPs, ip)
					return false
				}
			}
		}
		return true
	})
	if t.Failed() {
		t.Logf("last seen: %s", last)
	}
	return lease
}

// runningPod adds pod u1 (container c1, eth0) in pool on a, and waits until its keys are on
// the lease the agent holds for it: its address, keys and lease.
func runningPod(t *testing.T, ctx context.Context, cli *clientv3.Client, a *Agent, cluster string, pool allocator.PoolSpec) (netip.Addr, podKeys, clientv3.LeaseID) {
	t.Helper()
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	k := keysOf(cluster, "n1", "u1", pool, ip)
	return ip, k, heldFor(t, cli, a, "u1", k, ip)
}

// intruderKeeps waits for the conflict record of pod u1 (eth0) in pool, and checks that the
// owner "intruder" an admin put over its address ip still holds it.
func intruderKeeps(t *testing.T, ctx context.Context, cli *clientv3.Client, cluster string, pool allocator.PoolSpec, ip netip.Addr) {
	t.Helper()
	conflict := keyspace.ConflictKey(cluster, "u1", "eth0", pool.Name)
	etcdtest.EventuallyTrue(t, "a conflict recorded for the running pod", func() bool {
		resp, err := cli.Get(ctx, conflict)
		return err == nil && len(resp.Kvs) > 0
	})
	if owner := allocOwner(t, cli, pool, ip); owner != "intruder" {
		t.Fatalf("the address is held by %q, want the other owner left alone", owner)
	}
}

// TestAKeyOfARunningPodDeletedByHandIsPutBack: each kind of key of a running pod (allocation,
// owner index, pod record), deleted as an admin would with etcdctl del, is put back on the
// pod's lease with the pod's own address; a key overwritten with the pod's own value without
// its lease too. No ADD of the node is ever given the address meanwhile.
func TestAKeyOfARunningPodDeletedByHandIsPutBack(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.71.0.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
	ip, k, lease := runningPod(t, ctx, cli, a, cluster, pool)
	lostBefore := counterValue(a.metrics.podKeysLost)

	for _, c := range []struct {
		name string
		key  string
		// change is what the admin does to the key.
		change func(kv *clientv3.GetResponse) error
	}{
		// The address's key: without it another pod could be given the address.
		{"allocation deleted", k.alloc, func(*clientv3.GetResponse) error { _, err := cli.Delete(ctx, k.alloc); return err }},
		// The owner index: DEL, CHECK and a repeated ADD read it.
		{"owner index deleted", k.owner, func(*clientv3.GetResponse) error { _, err := cli.Delete(ctx, k.owner); return err }},
		// The pod record: a restart resumes the pod from it.
		{"pod record deleted", k.pod, func(*clientv3.GetResponse) error { _, err := cli.Delete(ctx, k.pod); return err }},
		// The pod's own value without its lease: it would never expire, and a re-claim that
		// creates keys only if absent would find the address taken by the pod itself.
		{"allocation rewritten without its lease", k.alloc, func(r *clientv3.GetResponse) error {
			_, err := cli.Put(ctx, k.alloc, string(r.Kvs[0].Value))
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			before, err := cli.Get(ctx, c.key)
			if err != nil || len(before.Kvs) == 0 {
				t.Fatalf("%s before the change: %v %v", c.key, before, err)
			}
			if err := c.change(before); err != nil {
				t.Fatal(err)
			}
			// Meanwhile no ADD of the node gets the address.
			for i := range 5 {
				other := fmt.Sprintf("x-%s-%d", strings.ReplaceAll(c.name, " ", "-"), i)
				if res, err := a.Add(ctx, addReq(pool, other, "eth0", other)); err == nil && addrs(res)[0] == ip {
					t.Fatalf("ADD %s was given %s, the running pod's address", other, ip)
				}
			}
			next := heldFor(t, cli, a, "u1", k, ip)
			if next == lease {
				t.Errorf("the pod is still on lease %s: its keys were not re-claimed", keyspace.LeaseHex(lease))
			}
			lease = next
			if after := counterValue(a.metrics.podKeysLost); after <= lostBefore {
				t.Errorf("leasehold_pod_keys_lost_total stayed %v", after)
			} else {
				lostBefore = after
			}
			// The old lease went with the repair: nothing of the pod is left on it.
			if ttl, err := cli.TimeToLive(ctx, clientv3.LeaseID(before.Kvs[0].Lease)); err == nil && ttl.TTL > 0 && before.Kvs[0].Lease != int64(lease) {
				t.Errorf("lease %x the key was on is still alive", before.Kvs[0].Lease)
			}
		})
	}
}

// TestAnAddressOverwrittenByAnotherOwnerIsAConflict: an admin puts another owner's allocation
// over a running pod's. The agent does not take it back: the re-claim records a conflict for
// the pod, and once the other holder goes, the address is the running pod's again.
func TestAnAddressOverwrittenByAnotherOwnerIsAConflict(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.72.0.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	k := keysOf(cluster, "n1", "u1", pool, ip)
	heldFor(t, cli, a, "u1", k, ip)
	foreign := keyspace.Allocation{Owner: "intruder", Cluster: cluster, Node: "elsewhere", NodeUID: "uid-x", ContainerID: "cx", IfName: "eth0"}
	if _, err := cli.Put(ctx, k.alloc, keyspace.Encode(foreign)); err != nil {
		t.Fatal(err)
	}
	intruderKeeps(t, ctx, cli, cluster, pool, ip)
	if _, err := cli.Delete(ctx, k.alloc); err != nil {
		t.Fatal(err)
	}
	heldFor(t, cli, a, "u1", k, ip)
}

// TestAReleaseFreesTheHeldKeyOfAnAddressAnotherOwnerTook: an admin puts another owner's
// allocation over a running pod's, a conflict; the pod is deleted (DEL, or GC), then the other
// owner lets the address go. The pod's held key of that address goes with the pod: nothing
// else would free it (the other owner's release or expiry leaves it, and settleHeld runs only
// when the recovery is woken), and on the node's block lease it would hold the address back
// for as long as the node runs. Found by the model (LEASEHOLD_MODEL_SEED=833926263).
func TestAReleaseFreesTheHeldKeyOfAnAddressAnotherOwnerTook(t *testing.T) {
	for _, how := range []string{"DEL", "GC"} {
		t.Run(how, func(t *testing.T) {
			cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
			pool := v4Pool(etcdtest.Uniq("p"), "10.72.1.0/24", 28)
			a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast)
			req := addReq(pool, "c1", "eth0", "u1")
			res, err := a.Add(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			ip := addrs(res)[0]
			k := keysOf(cluster, "n1", "u1", pool, ip)
			heldFor(t, cli, a, "u1", k, ip)
			heldKey := keyspace.HeldKey(pool.Name, pool.Blocks, ip)
			etcdtest.Eventually(t, "u1's held key of "+ip.String(), etcdtest.Keys(t, cli, heldKey, 1))
			other, err := cli.Grant(ctx, 600)
			if err != nil {
				t.Fatal(err)
			}
			foreign := keyspace.Allocation{Owner: "intruder", Cluster: cluster + "-other", Node: "elsewhere", NodeUID: "uid-x",
				ContainerID: "cx", IfName: "eth0"}
			if _, err := cli.Put(ctx, k.alloc, keyspace.Encode(foreign), clientv3.WithLease(other.ID)); err != nil {
				t.Fatal(err)
			}
			etcdtest.Eventually(t, "u1's conflict over "+ip.String(), func() error {
				at, _, _ := a.pods.Attachment("u1", "eth0", pool.Name)
				return etcdtest.Saw(slices.Contains(at.Conflicts, ip), "u1 lists conflicts %v", at.Conflicts)
			})
			if how == "DEL" {
				err = a.Del(ctx, req)
			} else {
				err = a.GC(ctx, allocator.GCRequest{Network: pool.Name, Pool: pool})
			}
			if err != nil {
				t.Fatal(err)
			}
			if n := len(etcdtest.Dump(t, cli, keyspace.OwnerPrefix(cluster, "u1"))); n != 0 {
				t.Fatalf("%s left %d owner indexes of u1", how, n)
			}
			if open := gaugeValue(a.metrics.conflictsOpen); open != 0 {
				t.Errorf("after the %s, the conflict watch still follows %v addresses", how, open)
			}
			if _, err := cli.Revoke(ctx, other.ID); err != nil { // the other owner lets the address go
				t.Fatal(err)
			}
			if left := etcdtest.Dump(t, cli, heldKey); len(left) != 0 {
				t.Errorf("u1 was deleted (%s) and the other owner let %s go; held key left: %v", how, ip, left)
			}
			if o := allocOwner(t, cli, pool, ip); o != "" {
				t.Errorf("%s is held by %q", ip, o)
			}
		})
	}
}

// gaugeValue is the value g is set to.
func gaugeValue(g prometheus.Gauge) float64 {
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		panic(err)
	}
	return m.GetGauge().GetValue()
}

// TestAPodsOwnAllocationWithoutItsLeaseIsNoConflictAtItsReclaim: the pod's own allocation
// put by hand without its lease (etcdctl put of the value read), then the pod's lease lost
// before any check of the agent saw the put: the re-claim finds the address held with the
// pod's own value. That is the pod's, not another owner's: the copy goes and the address is
// re-claimed on the pod's new lease, with no conflict, and the pod's DEL frees it. Found by
// the fault run: the re-claim recorded a conflict of the pod with itself, and the copy, on no
// lease, outlived the pod.
func TestAPodsOwnAllocationWithoutItsLeaseIsNoConflictAtItsReclaim(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.75.0.0/24", 28)
	// The audit as seldom as allowed: the lost lease's re-claim meets the copy first.
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), func(c *Config) { c.AuditInterval = c.LeaseTTL })
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	k := keysOf(cluster, "n1", "u1", pool, ip)
	lease := heldFor(t, cli, a, "u1", k, ip)
	before, err := cli.Get(ctx, k.alloc)
	if err != nil || len(before.Kvs) == 0 {
		t.Fatalf("%s: %v %v", k.alloc, before, err)
	}
	if _, err := cli.Put(ctx, k.alloc, string(before.Kvs[0].Value)); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	// What the keeper does when a renewal finds the lease gone, without waiting for one.
	a.keeper.Forget(lease)
	a.leaseLost(lease)
	if next := heldFor(t, cli, a, "u1", k, ip); next == lease {
		t.Fatalf("the pod is still on lease %s", keyspace.LeaseHex(lease))
	}
	if resp, err := cli.Get(ctx, keyspace.ConflictKey(cluster, "u1", "eth0", pool.Name)); err != nil || len(resp.Kvs) > 0 {
		t.Errorf("a conflict recorded for the pod with its own address: %v %v", resp.Kvs, err)
	}
	if err := a.Del(ctx, addReq(pool, "c1", "eth0", "u1")); err != nil {
		t.Fatal(err)
	}
	if resp, err := cli.Get(ctx, k.alloc); err != nil || len(resp.Kvs) > 0 {
		t.Errorf("%s after the pod's DEL: %v %v", k.alloc, resp.Kvs, err)
	}
}

// TestAPodRecordPutByHandJustBeforeTheDelGoesWithThePod: the pod record put by hand without
// its lease (etcdctl put of the value read) just before the pod's DEL, before any check of
// the agent saw it: the release of the pod's last attachment deletes it too. Found by the
// fault run: the copy, on no lease, outlived the pod, and doctor reported it.
func TestAPodRecordPutByHandJustBeforeTheDelGoesWithThePod(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.0.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), func(c *Config) { c.AuditInterval = c.LeaseTTL })
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	k := keysOf(cluster, "n1", "u1", pool, addrs(res)[0])
	before, err := cli.Get(ctx, k.pod)
	if err != nil || len(before.Kvs) == 0 {
		t.Fatalf("%s: %v %v", k.pod, before, err)
	}
	if _, err := cli.Put(ctx, k.pod, string(before.Kvs[0].Value)); err != nil {
		t.Fatal(err)
	}
	if err := a.Del(ctx, addReq(pool, "c1", "eth0", "u1")); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{k.pod, k.owner, k.alloc} {
		if resp, err := cli.Get(ctx, key); err != nil || len(resp.Kvs) > 0 {
			t.Errorf("%s after the pod's DEL: %v %v", key, resp.Kvs, err)
		}
	}
}

// TestAnOwnerThatHadTheAddressBeforeItsHolderIsLogged: a running pod's lease lost; while it
// was, one owner took its address and let it go, and another holds it at the re-claim. The
// re-claim records the conflict with the holder, which the address comes back from, and logs
// the one before from etcd's history: it ran with the address too. Found by the fault run: a
// node away across a restore came back to a second holder, and the first went unreported.
func TestAnOwnerThatHadTheAddressBeforeItsHolderIsLogged(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.83.0.0/24", 28)
	var logs syncbuf.Buffer
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), func(c *Config) {
		c.AuditInterval = c.LeaseTTL
		c.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	lease, ok := a.pods.Lease("u1")
	if !ok {
		t.Fatal("the agent holds no lease for the pod")
	}
	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	key := keyspace.IPKey(pool.Name, pool.Blocks, ip)
	other := func(owner string) string {
		return keyspace.Encode(keyspace.Allocation{Owner: owner, Cluster: cluster, Node: "n2", NodeUID: "uid-n2",
			ContainerID: "c-" + owner, IfName: "eth0", Network: pool.Name})
	}
	for _, op := range []clientv3.Op{clientv3.OpPut(key, other("u-before")), clientv3.OpDelete(key), clientv3.OpPut(key, other("u-now"))} {
		if _, err := cli.Do(ctx, op); err != nil {
			t.Fatal(err)
		}
	}
	// What the keeper does when a renewal finds the lease gone, without waiting for one.
	a.keeper.Forget(lease)
	a.leaseLost(lease)
	etcdtest.Eventually(t, "a CONFLICT logged for each owner that had the address", func() error {
		var holders []string
		for line := range strings.Lines(logs.String()) {
			var l struct {
				Msg   string `json:"msg"`
				Owner string `json:"owner"`
				Taken []struct {
					Holder string `json:"holder"`
				} `json:"taken"`
			}
			if json.Unmarshal([]byte(line), &l) != nil || !strings.HasPrefix(l.Msg, "CONFLICT") || l.Owner != "u1" {
				continue
			}
			for _, tk := range l.Taken {
				holders = append(holders, tk.Holder)
			}
		}
		slices.Sort(holders)
		return etcdtest.Saw(slices.Equal(holders, []string{"u-before", "u-now"}), "the CONFLICT lines name %v", holders)
	})
}

// TestADeletedAllocationInTheNodesBlockIsPutBackAtOnce: an allocation of a running pod
// deleted in its node's own block is put back without waiting for the audit: the node's view
// sees the delete, which no release explains (audit.OwnKeys). In a full pool, another node could
// otherwise take the address while its key is missing.
func TestADeletedAllocationInTheNodesBlockIsPutBackAtOnce(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.73.0.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), func(c *Config) {
		c.LeaseTTL, c.AuditInterval = time.Minute, time.Minute
	})
	res, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	k := keysOf(cluster, "n1", "u1", pool, ip)
	etcdtest.EventuallyTrue(t, "the audit at start done", func() bool { return counterValue(a.metrics.audits) >= 1 })
	audits := counterValue(a.metrics.audits)
	lease := heldFor(t, cli, a, "u1", k, ip)
	if _, err := cli.Delete(ctx, k.alloc); err != nil {
		t.Fatal(err)
	}
	if next := heldFor(t, cli, a, "u1", k, ip); next == lease {
		t.Errorf("the pod is still on lease %s: its keys were not re-claimed", keyspace.LeaseHex(lease))
	}
	if n := counterValue(a.metrics.audits); n != audits {
		t.Errorf("%v audits ran meanwhile: the put-back waited for one, not for the view", n-audits)
	}
}

// TestAnAllocationOverwrittenBeforeItsBlockIsClaimedIsNoticed: a running pod's address in a
// block no node claims (its node was cut off longer than the reuse delay, and its block
// claims went with the block lease) is overwritten with another owner's value; then the node
// claims the block again and follows it, from after the overwrite. The audit leaves out the
// allocations a view follows (the view reports their changes), but no watch saw this one:
// the audit compares it, and the pod has a conflict. Found by the model (seed 559924571):
// the overwrite was never noticed.
func TestAnAllocationOverwrittenBeforeItsBlockIsClaimedIsNoticed(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.2.0/24", 28)
	// No periodic audit during the test: each runs when the test asks for it (auditNow).
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), func(c *Config) {
		c.LeaseTTL, c.AuditInterval, c.ReuseDelay = time.Minute, time.Minute, time.Hour
		c.LivenessInterval, c.GCGrace = -1, -1
	})
	auditNow := func() {
		t.Helper()
		n := counterValue(a.metrics.audits)
		a.audit.MarkDue()
		a.recovery.Wake()
		etcdtest.EventuallyTrue(t, "an audit done", func() bool { return counterValue(a.metrics.audits) > n })
	}
	etcdtest.EventuallyTrue(t, "the audit at start done", func() bool { return counterValue(a.metrics.audits) >= 1 })
	ip, k, lease := runningPod(t, ctx, cli, a, cluster, pool)
	v := a.pools.ViewOf(pool.Name)
	block := pool.Blocks.Of(ip)
	// The block's claim goes with its lease; the audit lets the block go, and checks the
	// pod's allocation, which no view follows now, by its ModRevision.
	if _, err := cli.Revoke(ctx, v.Claims().Held()[block]); err != nil {
		t.Fatal(err)
	}
	auditNow()
	if v.FollowsAddr(ip) || len(blockClaims(t, cli, pool.Name)) > 0 {
		t.Fatalf("the view still follows %s (%v) after its claim went: %v", block, v.FollowsAddr(ip), blockClaims(t, cli, pool.Name))
	}
	if p, ok := a.pods.Audit().One("u1", cluster, "n1", map[string]allocator.Blocks{pool.Name: pool.Blocks}); !ok || !p.Verified() {
		t.Fatalf("the audit did not check the pod's keys: %+v %v", p, ok)
	}
	other, err := cli.Grant(ctx, 3600)
	if err != nil {
		t.Fatal(err)
	}
	foreign := keyspace.Allocation{Owner: "intruder", Cluster: cluster + "-other", Node: "elsewhere", NodeUID: "uid-x", ContainerID: "cx", IfName: "eth0"}
	if _, err := cli.Put(ctx, k.alloc, keyspace.Encode(foreign), clientv3.WithLease(other.ID)); err != nil {
		t.Fatal(err)
	}
	// What the recovery does with a block of its running pods no node claims after a restore
	// (reclaimBlocks), and an ADD when its blocks are full.
	if claimed, err := v.Claims().Claim(ctx, block); err != nil || !claimed {
		t.Fatalf("claim %s: %v %v", block, claimed, err)
	}
	auditNow()
	if held, ok := a.pods.Lease("u1"); ok && held == lease {
		t.Fatalf("after an audit the pod is still on lease %s, its address %s held by another owner", keyspace.LeaseHex(lease), ip)
	}
	intruderKeeps(t, ctx, cli, cluster, pool, ip)
}

// TestARepeatedAddOfAPodBeingReclaimedGetsNoNewAddresses: a running pod whose lease is lost
// (here revoked; in the model, its keys lost to a restore) and not re-claimed yet, whose
// runtime repeats its ADD: the ADD asks to try again, never claims as for a new pod (new
// addresses while the sandbox uses the old ones); once re-claimed, the ADD returns the pod's
// address. Found by the model (seed 559924571, step 100): the hold after a restore opens a
// TTL after the notice, and an ADD of a pod still waiting for its re-claim got new addresses.
func TestARepeatedAddOfAPodBeingReclaimedGetsNoNewAddresses(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.3.0/24", 28)
	// Nothing notices the revoke by itself during the test: no audit, no renewal.
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), func(c *Config) {
		c.LeaseTTL, c.AuditInterval = time.Minute, time.Minute
		c.LivenessInterval, c.GCGrace = -1, -1
	})
	ip, k, lease := runningPod(t, ctx, cli, a, cluster, pool)
	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	// What the keeper does when a renewal finds the lease gone, but the recovery's wake.
	a.keeper.Forget(lease)
	a.pods.Lose(lease)
	req := addReq(pool, "c1", "eth0", "u1")
	res, err := a.Add(ctx, req)
	if err == nil && !slices.Equal(addrs(res), []netip.Addr{ip}) {
		t.Fatalf("the repeated ADD of the pod being re-claimed got %v, not its address %s", addrs(res), ip)
	}
	if err != nil && !errors.Is(err, allocator.ErrUnavailable) {
		t.Fatalf("the repeated ADD of the pod being re-claimed: %v, want a retry", err)
	}
	a.recovery.Wake()
	heldFor(t, cli, a, "u1", k, ip)
	if res, err := a.Add(ctx, req); err != nil || !slices.Equal(addrs(res), []netip.Addr{ip}) {
		t.Errorf("the ADD after the re-claim: %v %v, want [%s]", addrs(res), err, ip)
	}
}

// TestABlockLeaseRevokedWhileRenewedIsLetGoAtTheAudit: the node's block lease, which its
// keeper renews, is revoked from outside (an admin; or, in the model, a lease a restore
// brought back that the agent took up again and that went again at once): its claims go with
// it, and any node may claim those blocks. The agent lets them go at its next audit, not at
// the keeper's next renewal of the lease, a third of its TTL away: with the reuse delay of a
// real node that is minutes, during which its view would hold blocks that are not its.
func TestABlockLeaseRevokedWhileRenewedIsLetGoAtTheAudit(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.0.0/24", 28)
	// A reuse delay that puts the block lease's next renewal far beyond etcdtest.Patience.
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast, func(c *Config) { c.ReuseDelay = time.Hour })
	res, err := a.Add(ctx, addReq(pool, "c0", "eth0", "u0"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	v := a.pools.ViewOf(pool.Name)
	block := pool.Blocks.Of(ip)
	old := v.Claims().Held()[block]
	if old == 0 || !a.keeper.Holds(old) || !a.blockLeases.mine(old) {
		t.Fatalf("the view holds %s on %s, renewed by the keeper: %v, a block lease of the node: %v",
			block, keyspace.LeaseHex(old), a.keeper.Holds(old), a.blockLeases.mine(old))
	}
	if _, err := cli.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "every claim the view holds in etcd as held", func() error {
		if a.blockLeases.mine(old) || a.keeper.Holds(old) {
			return fmt.Errorf("the agent still takes %s for its block lease (renewed: %v)", keyspace.LeaseHex(old), a.keeper.Holds(old))
		}
		return claimsAsHeld(ctx, cli, pool, v)
	})
	if got := allocOwner(t, cli, pool, ip); got != "u0" {
		t.Errorf("%s allocated to %q after its block's claim went; the pod keeps it on its own lease", ip, got)
	}
	// The next ADD claims a block again, on a new block lease.
	if _, err := a.Add(ctx, addReq(pool, "c1", "eth0", "u1")); err != nil {
		t.Fatal(err)
	}
	for b, lease := range v.Claims().Held() {
		if lease == old {
			t.Errorf("block %s claimed again on the revoked lease %s", b, keyspace.LeaseHex(old))
		}
	}
	if len(blockClaims(t, cli, pool.Name)) == 0 {
		t.Errorf("no block claimed after the ADD")
	}
}

// TestAHeldKeyGoneWithARevokedBlockLeaseIsPutBack: the block lease a running pod's held key
// is on goes from outside while the agent renews it (as in
// TestABlockLeaseRevokedWhileRenewedIsLetGoAtTheAudit; in the model, a lease a restore brought
// back that a re-claim had just put the pod's held key on). The pod's lease lives, so no
// re-claim writes the key again: the agent puts it back on a block lease it renews, naming the
// pod, or a cut-off of the node would free the address with its pod's lease, not the reuse
// delay after.
func TestAHeldKeyGoneWithARevokedBlockLeaseIsPutBack(t *testing.T) {
	cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.1.0/24", 28)
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()), auditFast, func(c *Config) { c.ReuseDelay = time.Hour })
	res, err := a.Add(ctx, addReq(pool, "c0", "eth0", "u0"))
	if err != nil {
		t.Fatal(err)
	}
	ip := addrs(res)[0]
	key := keyspace.HeldKey(pool.Name, pool.Blocks, ip)
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("no held key for %s after the ADD: %v", ip, err)
	}
	old := keyspace.LeaseOf(resp.Kvs[0])
	if _, err := cli.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "the pod's held key back on a block lease the agent renews", func() error {
		resp, err := cli.Get(ctx, key)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			return fmt.Errorf("%s has no held key", ip)
		}
		rec, err := keyspace.Decode[keyspace.HeldRecord](key, resp.Kvs[0].Value)
		on := keyspace.LeaseOf(resp.Kvs[0])
		switch {
		case err != nil:
			return err
		case rec != keyspace.HeldRecord{Cluster: cluster, Node: "n1", Owner: "u0"}:
			return fmt.Errorf("the held key of %s names %+v", ip, rec)
		case on == old || !a.blockLeases.mine(on) || !a.keeper.Holds(on):
			return fmt.Errorf("the held key of %s is on lease %s (revoked: %s), a block lease of the node: %v, renewed: %v",
				ip, keyspace.LeaseHex(on), keyspace.LeaseHex(old), a.blockLeases.mine(on), a.keeper.Holds(on))
		}
		return nil
	})
	if got := allocOwner(t, cli, pool, ip); got != "u0" {
		t.Errorf("%s allocated to %q; the pod keeps it on its own lease", ip, got)
	}
}

// TestASettleTimeSurvivesARestart: an agent restarted within the settle time after etcd went
// back in time goes on passing over what its earlier process kept (restorenotice.SaveSettle): an address
// another node's pod may hold with its key gone with the backup is not handed out, and no new
// block is claimed; an ADD that finds no other room says why.
func TestASettleTimeSurvivesARestart(t *testing.T) {
	cluster, ctx := etcdtest.Uniq("c"), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.74.0.0/27", 28) // two blocks of 16
	dir := t.TempDir()
	first := startAgent(t, cluster, "n1", "uid-n1", withHold(dir))
	res, err := first.Add(ctx, addReq(pool, "c-first", "eth0", "u-first"))
	if err != nil {
		t.Fatal(err)
	}
	got := addrs(res)
	crash(first) // its pod, its block and its block lease stay
	block := netip.PrefixFrom(got[0], 28).Masked()
	kept := got[0].Next() // in the block the restarted agent adopts
	if err := restorenotice.SaveSettle(dir, restorenotice.SettleState{Noticed: time.Now(), Until: time.Now().Add(time.Hour), Why: "a test",
		Kept: map[string][]netip.Addr{pool.Name: {kept}}}); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, cluster, "n1", "uid-n1", withHold(dir))
	var last error
	for i := range 32 {
		res, err := a.Add(ctx, addReq(pool, fmt.Sprintf("c%d", i), "eth0", fmt.Sprintf("u%d", i)))
		if err != nil {
			last = err
			break
		}
		got = append(got, addrs(res)...)
	}
	for _, g := range got {
		if g == kept {
			t.Errorf("the restarted agent handed out %s, kept for the settle time", g)
		}
	}
	// Only the block the node held: the other is not claimed during the settle time.
	for _, g := range got {
		if !block.Contains(g) {
			t.Errorf("the restarted agent handed out %s, outside its block %s", g, block)
		}
	}
	if len(got) < 2 {
		t.Errorf("%d addresses handed out: %v, want those of its block but the kept one", len(got), got)
	}
	if !errors.Is(last, allocator.ErrUnavailable) || !strings.Contains(fmt.Sprint(last), "etcd went back in time") {
		t.Errorf("the ADD that found no room: %v, want code 11 naming the settle time", last)
	}
}

// TestAnAgentToldOfARestoreSettles: an agent that saw no sign of a restore (its last answers
// were at revisions the restored etcd passed) learns it from the agent that found it, and
// settles as if it had: no new block for it during the settle time.
func TestAnAgentToldOfARestoreSettles(t *testing.T) {
	cluster, ctx := etcdtest.Uniq("c"), ctxT(t)
	pool := v4Pool(etcdtest.Uniq("p"), "10.75.0.0/26", 28)
	found := startAgent(t, cluster, "n1", "uid-n1", withHold(t.TempDir()))
	told := startAgent(t, cluster, "n2", "uid-n2", withHold(t.TempDir()))
	if _, err := found.Add(ctx, addReq(pool, "c1", "eth0", "u1")); err != nil {
		t.Fatal(err)
	}
	// The word is for every agent on this etcd: the package's other tests must not hear it,
	// so the test takes it back before it ends.
	cli := etcdtest.Client(t)
	defer func() {
		etcdtest.EventuallyTrue(t, "the word taken back", func() bool {
			_, err := cli.Delete(context.Background(), keyspace.RestoredKey)
			resp, gerr := cli.Get(context.Background(), keyspace.RestoredKey)
			return err == nil && gerr == nil && len(resp.Kvs) == 0
		})
	}()
	found.notices.EtcdWentBack("a test's restore")
	// The told agent starts settling (wentBack) from the word its watch brought, and counts it
	// only after: wait for the count too.
	etcdtest.Eventually(t, "the other agent settling", func() error {
		settling, n := told.hold.Settling(), counterValue(told.metrics.wentBack)
		return etcdtest.Saw(settling != nil && n == 1, "settling: %v; the told agent counted etcd going back %v times, want 1", settling, n)
	})
	_, err := told.Add(ctx, addReq(pool, "c2", "eth0", "u2")) // it holds no block: it needs one
	if !errors.Is(err, restorehold.ErrSettling) {
		t.Errorf("an ADD needing a new block on the told agent: %v, want refused for the settle time", err)
	}
	// Its own word does not start a second repair of the agent that found it.
	if n := counterValue(found.metrics.wentBack); n != 1 {
		t.Errorf("the agent that found it counted etcd going back %v times, want 1", n)
	}
	// An agent started during the settle time (a node replaced, an agent restarted) settles
	// too, before it answers its first ADD.
	late := startAgent(t, cluster, "n3", "uid-n3", withHold(t.TempDir()))
	if _, err := late.Add(ctx, addReq(pool, "c3", "eth0", "u3")); !errors.Is(err, restorehold.ErrSettling) {
		t.Errorf("the first ADD needing a new block on an agent started during the settle time: %v, want refused for it", err)
	}
}
