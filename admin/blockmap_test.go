package admin

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// pageKV runs after after each Get: a test's way to change etcd between the pages of a read.
type pageKV struct {
	clientv3.KV
	after func(gets int)
	gets  int
}

func (k *pageKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	resp, err := k.KV.Get(ctx, key, opts...)
	k.gets++
	if k.after != nil {
		k.after(k.gets)
	}
	return resp, err
}

// smallPages makes ReadBlockMap read 2 keys a page for the test.
func smallPages(t *testing.T) {
	old := mapPage
	mapPage = 2
	t.Cleanup(func() { mapPage = old })
}

// TestReadBlockMapIsOneRevisionInPages reads a pool of 16 blocks of /28 whose first block is
// excluded, with a real agent's block (6 pods), a node address and a wanted key in it, two keys a
// page and one block listed: the other 15 are summed up as not drawn. A pod added between two
// pages is not in the map: every page is read at the revision of the first read.
func TestReadBlockMapIsOneRevisionInPages(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	smallPages(t)
	cluster, pool := etcdtest.Uniq("c"), etcdtest.Uniq("bm")
	spec := adminPool(pool, allocator.RangeSet{adminRange("10.99.0.0/24")})
	spec.Exclude, spec.Blocks = []netip.Prefix{netip.MustParsePrefix("10.99.0.0/28")}, allocator.Blocks{IPv4: 28, IPv6: 122}
	if _, err := CreatePool(ctx, cli, spec); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, cluster, "n1", "uid-n1")
	var mine netip.Addr
	for _, c := range []string{"p1", "p2", "p3", "p4", "p5", "p6"} {
		res, err := a.Add(ctx, byName(pool, c, "u-"+c))
		if err != nil {
			t.Fatal(err)
		}
		mine = res.IPs[0].Address.Addr()
	}
	hostL := grant(t, cli)
	for _, node := range []string{"n1", "n2"} { // one address two nodes publish counts once
		put(t, cli, keyspace.HostIPKey(netip.MustParseAddr("10.99.0.250"), cluster, node), "", hostL)
	}
	put(t, cli, keyspace.WantedKey(pool, spec.Blocks, mine, cluster, "u-gone"), "{}", hostL)

	hc := etcdtest.Client(t)
	hooked := &pageKV{KV: hc.KV}
	hc.KV = hooked
	hooked.after = func(gets int) {
		if gets == 3 { // the pool, the claims, the first page of allocations
			if _, err := a.Add(ctx, byName(pool, "late", "u-late")); err != nil {
				t.Errorf("add between pages: %v", err)
			}
		}
	}
	m, err := ReadBlockMap(ctx, hc, pool, 1)
	if err != nil {
		t.Fatal(err)
	}
	if hooked.gets < 6 {
		t.Errorf("%d reads: want the allocations and held keys read in pages of 2", hooked.gets)
	}
	if len(m.Sets) != 1 || len(m.Sets[0].Blocks) != 1 {
		t.Fatalf("want one set with one block listed: %+v", m.Sets)
	}
	s := m.Sets[0]
	if b := s.Blocks[0]; b.Block != netip.MustParsePrefix("10.99.0.0/28") || b.State != BlockFree || b.Capacity != 0 || b.Claim != nil {
		t.Errorf("the excluded first block: %+v", b)
	}
	// 10.99.0.0/24 hands out .16-.254: 239 addresses in 15 blocks.
	want := MapTotals{Blocks: "16", ClaimedBlocks: 1, FreeBlocks: "15", Capacity: "239", Allocated: 6, Held: 6, Wanted: 1, Hosts: 1}
	if s.Totals != want {
		t.Errorf("totals %+v, want %+v", s.Totals, want)
	}
	want.Blocks, want.FreeBlocks = "15", "14"
	if s.NotDrawn == nil || *s.NotDrawn != want {
		t.Errorf("not drawn %+v, want %+v", s.NotDrawn, want)
	}

	again, err := ReadBlockMap(ctx, cli, pool, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := again.Sets[0].Totals.Allocated; got != 7 || again.Revision <= m.Revision || len(again.Sets[0].Blocks) != 16 || again.Sets[0].NotDrawn != nil {
		t.Errorf("read again: %d allocated at revision %d (first read %d), %d blocks listed; want the late pod's too, every block",
			got, again.Revision, m.Revision, len(again.Sets[0].Blocks))
	}
}

func TestReadBlockMapRefusals(t *testing.T) {
	ctx := etcdtest.Ctx(t)
	cli := privateEtcd(t)
	smallPages(t)
	storeFlat(t, cli, adminPool("flat", allocator.RangeSet{adminRange("10.98.0.0/24")}))
	if _, err := CreatePool(ctx, cli, adminPool("blocks", allocator.RangeSet{adminRange("10.97.0.0/24")})); err != nil {
		t.Fatal(err)
	}
	lease := grant(t, cli)
	for _, ip := range []string{"10.97.0.10", "10.97.0.11", "10.97.0.12"} {
		put(t, cli, keyspace.IPKey("blocks", allocator.DefaultBlocks, netip.MustParseAddr(ip)), allocValue("u-"+ip), lease)
	}
	tests := []struct {
		name    string
		pool    string
		compact bool // compact etcd after the first page of allocations
		is      error
		says    string
	}{
		// No such pool: not found, naming the key.
		{name: "unknown", pool: "nothing", is: ErrNotFound, says: keyspace.PoolKey("nothing")},
		// A pool stored before blocks has no map; the error says what to run instead.
		{name: "flat", pool: "flat", is: ErrNoBlocks, says: "leaseholdctl pool migrate flat"},
		// A name that cannot be a key component.
		{name: "bad name", pool: "a/b", is: allocator.ErrInvalidName, says: "pool"},
		// The revision the pages are pinned to was compacted between two of them: retry.
		{name: "compacted", pool: "blocks", compact: true, is: ErrConcurrentChange, says: "run the command again"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := etcdtest.ClientAt(t, cli.Endpoints()[0])
			hooked := &pageKV{KV: c.KV}
			c.KV = hooked
			hooked.after = func(gets int) {
				if tt.compact && gets == 3 {
					put(t, cli, keyspace.PoolKey("other"), "{}", 0)
					resp, err := cli.Get(ctx, keyspace.PoolKey("other"))
					if err == nil {
						_, err = cli.Compact(ctx, resp.Header.Revision)
					}
					if err != nil {
						t.Fatal(err)
					}
				}
			}
			_, err := ReadBlockMap(ctx, c, tt.pool, 0)
			if !errors.Is(err, tt.is) || !strings.Contains(err.Error(), tt.says) {
				t.Errorf("err %v, want %v saying %q", err, tt.is, tt.says)
			}
		})
	}
}
