package rules

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/selection"
)

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m)) }

// TestFollowerSeesEveryChange: rules written, changed, made unreadable and deleted reach the
// follower, per network and only of its cluster.
func TestFollowerSeesEveryChange(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	cluster := etcdtest.Uniq("c")
	f := New(cli, Config{Cluster: cluster, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { f.Run(rctx); close(done) }()
	t.Cleanup(func() { stop(); <-done })

	put := func(key string, v any) {
		t.Helper()
		if _, err := cli.Put(ctx, key, keyspace.Encode(v)); err != nil {
			t.Fatal(err)
		}
	}
	want := func(network string, wantNS map[string][]string, wantNodes []string) func() error {
		return func() error {
			r, _, _, err := f.Choice(ctx, network)
			if err != nil {
				return err
			}
			ns := map[string][]string{}
			for k, v := range r.Namespaces {
				ns[k] = v.Pools
			}
			var nodes []string
			for k := range r.Nodes {
				nodes = append(nodes, k)
			}
			if !reflect.DeepEqual(ns, wantNS) || len(nodes) != len(wantNodes) || (len(nodes) > 0 && nodes[0] != wantNodes[0]) {
				return fmt.Errorf("namespaces %v, nodes %v; want %v, %v", ns, nodes, wantNS, wantNodes)
			}
			return nil
		}
	}

	if r, any, _, err := f.Choice(ctx, "net"); err != nil || any || len(r.Namespaces) != 0 {
		t.Fatalf("no rule yet: %+v %v %v", r, any, err)
	}
	put(keyspace.NamespaceRuleKey(cluster, "net", "a"), keyspace.NamespaceRule{Pools: []string{"p1", "p2"}})
	put(keyspace.NamespaceRuleKey(cluster, "other", "a"), keyspace.NamespaceRule{Pools: []string{"p9"}})
	put(keyspace.NodeRuleKey(cluster, "net", "rack1"), keyspace.NodeRule{Names: []string{"rack1-*"}, Pools: []string{"p3"}})
	put(keyspace.NamespaceRuleKey(etcdtest.Uniq("c"), "net", "a"), keyspace.NamespaceRule{Pools: []string{"not-this-cluster"}})
	etcdtest.Eventually(t, "rules written", want("net", map[string][]string{"a": {"p1", "p2"}}, []string{"rack1"}))
	etcdtest.Eventually(t, "another network's", want("other", map[string][]string{"a": {"p9"}}, nil))

	put(keyspace.NamespaceRuleKey(cluster, "net", "a"), keyspace.NamespaceRule{Pools: []string{"p2"}})
	if _, err := cli.Put(ctx, keyspace.NamespaceRuleKey(cluster, "net", "b"), "{not json"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Delete(ctx, keyspace.NodeRuleKey(cluster, "net", "rack1")); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "changed, unreadable and deleted", want("net", map[string][]string{"a": {"p2"}}, nil))

}

// TestRulesWaitForTheFirstListing: an ADD never chooses by rules not read yet.
func TestRulesWaitForTheFirstListing(t *testing.T) {
	f := New(etcdtest.Client(t), Config{Cluster: etcdtest.Uniq("c"), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, _, _, err := f.Choice(ctx, "net"); err == nil {
		t.Fatal("Rules answered before any listing")
	}
}

// TestFollowerSeesPoolsClosedAndOpened: a pool's access and families, as stored, reach the
// follower, and each change is told to the agent.
func TestFollowerSeesPoolsClosedAndOpened(t *testing.T) {
	ctx, cli := etcdtest.Ctx(t), etcdtest.Client(t)
	name := etcdtest.Uniq("rp")
	var mu sync.Mutex
	told := map[string]int{}
	f := New(cli, Config{Cluster: etcdtest.Uniq("c"), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		PoolChanged: func(p string) { mu.Lock(); told[p]++; mu.Unlock() }})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { f.Run(rctx); close(done) }()
	t.Cleanup(func() { stop(); <-done })
	spec := allocator.PoolSpec{Name: name, Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.99.0.0/24")}},
		{{Subnet: netip.MustParsePrefix("fd99::/120")}}}}
	if err := spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	put := func(access keyspace.PoolAccess) {
		t.Helper()
		if _, err := cli.Put(ctx, keyspace.PoolKey(name), keyspace.EncodePoolWith(spec, access)); err != nil {
			t.Fatal(err)
		}
	}
	poolIs := func(want selection.Pool, present bool) func() error {
		return func() error {
			_, _, pools, err := f.Choice(ctx, "net")
			if err != nil {
				return err
			}
			got, ok := pools[name]
			return etcdtest.Saw(ok == present && reflect.DeepEqual(got, want), "pool %s: %+v (present %v), want %+v", name, got, ok, want)
		}
	}
	put(keyspace.PoolAccess{})
	etcdtest.Eventually(t, "the pool", poolIs(selection.Pool{Families: []int{4, 6}}, true))
	put(keyspace.PoolAccess{Closed: true, Namespaces: []string{"a"}})
	etcdtest.Eventually(t, "closed and locked", poolIs(selection.Pool{Families: []int{4, 6}, Closed: true, Namespaces: []string{"a"}}, true))
	_, _, before, err := f.Choice(ctx, "net")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Delete(ctx, keyspace.PoolKey(name)); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "gone", poolIs(selection.Pool{}, false))
	// An answer is shared by ADDs until the next change, and a change never alters it.
	if got := before[name]; !got.Closed {
		t.Errorf("an answer handed out before the pool went changed under its holder: %+v", got)
	}
	// The agent is told after the follower's lock is let go, so after Choice may see the change.
	etcdtest.Eventually(t, "the agent told of 3 changes", func() error {
		mu.Lock()
		defer mu.Unlock()
		return etcdtest.Saw(told[name] >= 3, "the agent was told of %d changes of pool %s, want 3", told[name], name)
	})
}

// BenchmarkChoiceWithManyPools is an ADD's read of the rules and pools with 500 pools and
// 50 rules stored: what every ADD pays once a cluster has rules.
func BenchmarkChoiceWithManyPools(b *testing.B) {
	ctx, cli := etcdtest.Ctx(b), etcdtest.Client(b)
	cluster := etcdtest.Uniq("c")
	f := New(cli, Config{Cluster: cluster, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { f.Run(rctx); close(done) }()
	b.Cleanup(func() { stop(); <-done })
	prefix := etcdtest.Uniq("bp")
	for i := range 500 {
		spec := allocator.PoolSpec{Name: fmt.Sprintf("%s-%d", prefix, i),
			Ranges: []allocator.RangeSet{{{Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i / 256), byte(i), 0}), 24)}}}}
		if err := spec.Canonicalize(); err != nil {
			b.Fatal(err)
		}
		if _, err := cli.Put(ctx, keyspace.PoolKey(spec.Name), keyspace.EncodePoolWith(spec, keyspace.PoolAccess{})); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 50 {
		r := keyspace.NamespaceRule{Pools: []string{fmt.Sprintf("%s-%d", prefix, i)}}
		if _, err := cli.Put(ctx, keyspace.NamespaceRuleKey(cluster, "net", fmt.Sprintf("ns%d", i)), keyspace.Encode(r)); err != nil {
			b.Fatal(err)
		}
	}
	etcdtest.Eventually(b, "every pool and rule", func() error {
		r, _, pools, err := f.Choice(ctx, "net")
		if err != nil {
			return err
		}
		return etcdtest.Saw(len(pools) >= 500 && len(r.Namespaces) == 50, "%d pools, %d rules", len(pools), len(r.Namespaces))
	})
	b.ResetTimer()
	for b.Loop() {
		if _, _, _, err := f.Choice(ctx, "net"); err != nil {
			b.Fatal(err)
		}
	}
}
