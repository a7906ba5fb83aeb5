package leases

import (
	"fmt"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestClaimsOnALeaseAdoptedLaterAreFollowedInEveryPool: a node's block lease that it takes up
// only when it lists a pool after its start (its claims are on a lease its node record does
// not name: etcd went back to a backup, or the record was lost) carries its claims in other
// pools too. Those are followed, and an empty block there is given back, instead of being
// renewed with the lease unseen for as long as the node runs (found by
// TestModelRandomHistories with two pools, after a restore).
func TestClaimsOnALeaseAdoptedLaterAreFollowedInEveryPool(t *testing.T) {
	cluster, ctx, cli := etcdtest.Uniq("c"), ctxT(t), etcdtest.Client(t)
	a4 := v4Pool(etcdtest.Uniq("pa"), "10.69.0.0/24", 26)
	b4 := v4Pool(etcdtest.Uniq("pb"), "10.70.0.0/24", 26)
	a := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.BlockIdle = time.Hour })
	// A pod in each pool, deleted: their blocks empty and kept (BlockIdle). Then the agent
	// killed, and its node record gone, so that the restart takes a new block lease and adopts
	// the old one only when an ADD lists pool a4.
	for i, p := range []allocator.PoolSpec{a4, b4} {
		req := addReq(p, fmt.Sprintf("c%d", i), "eth0", fmt.Sprintf("u%d", i))
		if _, err := a.Add(ctx, req); err != nil {
			t.Fatalf("ADD in %s: %v", p.Name, err)
		}
		if err := a.Del(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	if len(blockClaims(t, cli, b4.Name)) != 1 {
		t.Fatalf("pool %s: claims %v, want the empty block kept", b4.Name, blockClaims(t, cli, b4.Name))
	}
	crash(a)
	if _, err := cli.Delete(ctx, keyspace.NodeKey(cluster, "n1")); err != nil {
		t.Fatal(err)
	}
	b := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.BlockIdle = 300 * time.Millisecond })
	if _, err := b.Add(ctx, addReq(a4, "c3", "eth0", "u3")); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "the empty block of the other pool given back", func() error {
		c := blockClaims(t, cli, b4.Name)
		return etcdtest.Saw(len(c) == 0, "pool %s: claims %v on a lease the agent renews; want the empty block given back", b4.Name, c)
	})
	if c := blockClaims(t, cli, a4.Name); len(c) != 1 {
		t.Fatalf("pool %s: claims %v, want the block of pod u3", a4.Name, c)
	}
}
