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
	if _, err := cli.Delete(ctx, keyspace.PoolKey(name)); err != nil {
		t.Fatal(err)
	}
	etcdtest.Eventually(t, "gone", poolIs(selection.Pool{}, false))
	mu.Lock()
	defer mu.Unlock()
	if told[name] < 3 {
		t.Errorf("the agent was told of %d changes of pool %s, want 3", told[name], name)
	}
}
