package leases

import (
	"context"
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
			// Wait until the agent holds u1 again: the record naming it, every allocation on
			// its pod lease.
			deadline := time.Now().Add(etcdtest.Patience)
			for {
				lease, _ := a.pods.Lease("u1")
				rec, ok := readClaimRecord(t, cli, key)
				m := readLiveMig(t, cli, cluster, pool, ips, "u1")
				if ok && rec.Holder != nil && rec.Holder.Owner == "u1" && lease != 0 && (c.name != "pod lease lost" || lease != before) &&
					!slices.ContainsFunc(m.ipLeases, func(l clientv3.LeaseID) bool { return l != lease }) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("u1 is not held again within %s: record %+v (%v), allocations on %v, pod lease %x", etcdtest.Patience, rec, ok, m.ipLeases, int64(lease))
				}
				time.Sleep(50 * time.Millisecond)
			}
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			tgt, err := b.Add(sctx, vmReq(pool, "c2", "u2"))
			if err != nil {
				rec, _ := readClaimRecord(t, cli, key)
				t.Fatalf("the target's ADD after the claim was put back: %v (claim record %+v)", err, rec)
			}
			if got := resultAddrs(tgt); !slices.Equal(got, ips) {
				t.Fatalf("the target got %v, want the claim's %v", got, ips)
			}
			m := readLiveMig(t, cli, cluster, pool, ips, "u1", "u2")
			if m.mig.Target.Owner != "u2" || !m.claim.Migratable {
				t.Errorf("after the target's ADD: migration key %+v, claim %+v", m.mig, m.claim)
			}
		})
	}
}
