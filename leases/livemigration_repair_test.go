package leases

import (
	"context"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestAVMsClaimReclaimedStaysMigratable: after a VM's pod lease is lost and the pod
// re-claimed on a new lease, or its claim record names an earlier holder (as a restored
// backup's does), the record its agent puts back names the pod's lease and stays
// migratable, so that a migration still starts at once from the holder. Found by TestModelRandomHistories: the
// record kept naming the lost lease (the claim's keep did not compare it), on which T1 found
// no allocation, so every later migration of the VM waited for the holder and was refused;
// and a record the repair rewrote (a restore's) lost migratable.
func TestAVMsClaimReclaimedStaysMigratable(t *testing.T) {
	for _, c := range []struct {
		name   string
		breaks func(t *testing.T, a *Agent, key string)
	}{
		{"claim record naming an earlier holder (a restore)", func(t *testing.T, a *Agent, key string) {
			cli := etcdtest.Client(t)
			resp, err := cli.Get(ctxT(t), key)
			if err != nil || len(resp.Kvs) == 0 {
				t.Fatalf("claim record: %v %v", resp, err)
			}
			rec, err := keyspace.Decode[keyspace.ClaimRecord](key, resp.Kvs[0].Value)
			if err != nil {
				t.Fatal(err)
			}
			rec.Holder = &keyspace.ClaimHolder{Owner: "u0", Node: "gone", NodeUID: "uid-gone", ContainerID: "c0", IfName: "eth0"}
			if _, err := cli.Put(ctxT(t), key, keyspace.Encode(rec), clientv3.WithLease(clientv3.LeaseID(resp.Kvs[0].Lease))); err != nil {
				t.Fatal(err)
			}
		}},
		{"pod lease lost", func(t *testing.T, a *Agent, key string) {
			lease, ok := a.pods.Lease("u1")
			if !ok {
				t.Fatal("no pod lease of u1")
			}
			if _, err := etcdtest.Client(t).Revoke(ctxT(t), lease); err != nil {
				t.Fatal(err)
			}
			a.keeper.MarkLost(lease)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cluster, cli, ctx := etcdtest.Uniq("c"), etcdtest.Client(t), ctxT(t)
			pool := dualStack(etcdtest.Uniq("p"), "10.82.0.0/24", "fd82::/64")
			pool.Blocks = allocator.Blocks{IPv4: 26, IPv6: 122}
			hold := func(c *Config) { c.ReuseDelay = holdDelay }
			a, b := startAgent(t, cluster, "n1", "uid1", hold, auditFast), startAgent(t, cluster, "n2", "uid2", hold, auditFast)
			src, err := a.Add(ctx, vmReq(pool, "c1", "u1"))
			if err != nil {
				t.Fatal(err)
			}
			ips := resultAddrs(src)
			key := keyspace.ClaimKey(cluster, pool.Name, vmClaim)
			before, _ := a.pods.Lease("u1")
			c.breaks(t, a, key)
			notOn := clientv3.LeaseID(0)
			if c.name == "pod lease lost" {
				notOn = before
			}
			heldAgain(t, cli, cluster, pool, a, "u1", ips, notOn)
			migratesAtOnce(t, cli, cluster, pool, b, "u1", "c2", "u2", ips)
		})
	}
}

// heldAgain waits until a holds owner's VM claim again: the record naming it, every
// allocation of ips on its pod lease, which is not notOn (0: any).
func heldAgain(t *testing.T, cli *clientv3.Client, cluster string, pool allocator.PoolSpec, a *Agent, owner string, ips []netip.Addr,
	notOn clientv3.LeaseID) {
	t.Helper()
	key := keyspace.ClaimKey(cluster, pool.Name, vmClaim)
	deadline := time.Now().Add(etcdtest.Patience)
	for {
		lease, _ := a.pods.Lease(owner)
		rec, ok := readClaimRecord(t, cli, key)
		m := readLiveMig(t, cli, cluster, pool, ips, owner)
		if ok && rec.Holder != nil && rec.Holder.Owner == owner && lease != 0 && lease != notOn &&
			!slices.ContainsFunc(m.ipLeases, func(l clientv3.LeaseID) bool { return l != lease }) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is not held again within %s: record %+v (%v), allocations on %v, pod lease %x", owner, etcdtest.Patience, rec, ok,
				m.ipLeases, int64(lease))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// migratesAtOnce has b start a live migration of the VM claim holder holds, to a new pod
// (container, uid): its ADD is answered with the claim's addresses ips before it would have
// waited for the holder, and the migration key names it, under a migratable record.
func migratesAtOnce(t *testing.T, cli *clientv3.Client, cluster string, pool allocator.PoolSpec, b *Agent, holder, container, uid string,
	ips []netip.Addr) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctxT(t), 10*time.Second)
	defer cancel()
	tgt, err := b.Add(sctx, vmReq(pool, container, uid))
	if err != nil {
		rec, _ := readClaimRecord(t, cli, keyspace.ClaimKey(cluster, pool.Name, vmClaim))
		t.Fatalf("the target's ADD after the claim was put back: %v (claim record %+v)", err, rec)
	}
	if got := resultAddrs(tgt); !slices.Equal(got, ips) {
		t.Fatalf("the target got %v, want the claim's %v", got, ips)
	}
	m := readLiveMig(t, cli, cluster, pool, ips, holder, uid)
	if m.mig.Target.Owner != uid || !m.claim.Migratable || m.claim.Holder == nil || m.claim.Holder.Owner != holder {
		t.Errorf("after the target's ADD: migration key %+v, claim %+v", m.mig, m.claim)
	}
}

// TestAVMsClaimKeepsMigratableThroughARestore: etcd restored to a backup older than a VM's
// claim ("created"), or than its release by its pod's DEL and its take-over by the VM's next
// pod on another node ("released": the restore brings the record back naming the pod deleted
// since, which its node's agent releases again), loses the claim record the holder's agent
// then puts back. It stays migratable, so a live migration starts at once from the holder:
// the pod book and the owner index keep the claim's mark, and so do the released record and
// the released claims' file. Found by TestModelRandomHistories: the record came back without
// migratable ("KNOWN BUG" in the model until then), and every migration of the VM waited for
// its holder and was refused.
func TestAVMsClaimKeepsMigratableThroughARestore(t *testing.T) {
	for _, released := range []bool{false, true} {
		t.Run(map[bool]string{false: "created", true: "released"}[released], func(t *testing.T) {
			eachRestoreWay(t, "10.88.0.0/28", func(t *testing.T, b restoreBed) {
				testAVMsClaimKeepsMigratableThroughARestore(t, b, released)
			})
		})
	}
}

func testAVMsClaimKeepsMigratableThroughARestore(t *testing.T, b restoreBed, released bool) {
	member, cli, cluster, ctx, pool := b.member, b.cli, b.cluster, b.ctx, b.pool
	start := func(node string) *Agent {
		return startAgentAt(t, member.ClientURL, cluster, node, "uid-"+node, withHold(t.TempDir()), auditFast)
	}
	holder, target := start("n1"), start("n2")
	// The backup has the pool's definition, which the recovery reads: a pod in it first, the
	// VM's when its claim is released after the backup.
	first := addReq(pool, "c0", "eth0", "u0")
	if released {
		first = vmReq(pool, "c0", "u0")
	}
	res, err := holder.Add(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	ips := resultAddrs(res)
	backup := filepath.Join(t.TempDir(), "backup.db")
	if err := member.Snapshot(ctx, backup); err != nil {
		t.Fatal(err)
	}
	if released {
		if err := holder.Del(ctx, first); err != nil {
			t.Fatal(err)
		}
		if rec, ok := readClaimRecord(t, cli, keyspace.ClaimKey(cluster, pool.Name, vmClaim)); !ok || rec.Holder != nil || !rec.Migratable {
			t.Errorf("the claim released by its pod's DEL: %+v (present %v), want without a holder, migratable", rec, ok)
		}
		holder, target = target, holder
	}
	res, err = holder.Add(ctx, vmReq(pool, "c1", "u1"))
	if err != nil {
		t.Fatal(err)
	}
	if !released {
		ips = resultAddrs(res)
	} else if !slices.Equal(resultAddrs(res), ips) {
		t.Fatalf("the VM's next pod got %v, want the claim's %v", resultAddrs(res), ips)
	}
	if err := member.Restore(backup, b.bump); err != nil {
		t.Fatal(err)
	}
	heldAgain(t, cli, cluster, pool, holder, "u1", ips, 0)
	migratesAtOnce(t, cli, cluster, pool, target, "u1", "c2", "u2", ips)
}
