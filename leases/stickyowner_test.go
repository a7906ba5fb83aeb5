package leases

import (
	"errors"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestAStickyPodsRepeatedADDWithoutItsOwnerIndexGetsItsAddresses: the owner index of a
// running sticky pod is deleted by hand. Its repeated ADD is answered as any pod's is (the
// owner index was gone, re-claimed: retry), not by retrying the claim against its own
// addresses until it gives up; once re-claimed, the ADD gets the pod's addresses again.
func TestAStickyPodsRepeatedADDWithoutItsOwnerIndexGetsItsAddresses(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	a := startAgent(t, cluster, "n1", "uid1")
	pool := dualStack(etcdtest.Uniq("p"), "10.67.0.0/24", "fd67::/64")
	ctx := ctxT(t)
	req := stickyReq(pool, "c1", "pod-uid-1", "default.web-2")
	first, err := a.Add(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	owner := keyspace.OwnerKey(cluster, "pod-uid-1", "eth0", pool.Name)
	if _, err := cli.Delete(ctx, owner); err != nil {
		t.Fatal(err)
	}
	var got allocator.Result
	for i := range 20 {
		got, err = a.Add(ctx, req)
		if err == nil {
			break
		}
		t.Logf("repeated ADD %d: %v", i, err)
		if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), "owner index") {
			t.Fatalf("repeated ADD without the owner index: %v, want ErrUnavailable saying the owner index was gone", err)
		}
		etcdtest.EventuallyTrue(t, "the owner index re-claimed", func() bool {
			resp, err := cli.Get(ctx, owner)
			return err == nil && len(resp.Kvs) > 0
		})
	}
	if err != nil {
		t.Fatalf("repeated ADD never answered: %v", err)
	}
	if g, w := resultAddrs(got), resultAddrs(first); len(g) != 2 || g[0] != w[0] || g[1] != w[1] {
		t.Fatalf("repeated ADD got %v, want the pod's %v", g, w)
	}
}
