package main

import (
	"slices"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

func TestAllocShowAndRelease(t *testing.T) {
	ctx := etcdtest.Ctx(t)
	cli := etcdtest.ClientAt(t, endpoint)
	cluster, pool, pool2 := etcdtest.Uniq("c"), etcdtest.Uniq("net"), etcdtest.Uniq("net")
	for _, p := range []string{pool, pool2} {
		if r := ctl("pool", "create", p, "--range", "10.87.0.0/24", "--range", "fd87::/120"); r.code != 0 {
			t.Fatalf("pool create: %+v", r)
		}
	}
	a := agent(t, endpoint, cluster, "n1")
	attach(t, a, pool, "web", "10.87.0.10", "fd87::10")
	attach(t, a, pool2, "db", "10.87.0.10") // the same address in a second pool over the same subnet

	t.Run("show names every holder", func(t *testing.T) {
		r := ctl("alloc", "show", "10.87.0.10")
		for _, s := range []string{pool, pool2, "u-web", "ns/pod-web", "u-db", "node:", "n1", "container:", "interface:", "eth0",
			"network:", "TTL", "etcdctl lease timetolive", "created:"} {
			if !strings.Contains(r.stdout, s) {
				t.Errorf("alloc show does not say %q:\n%s", s, r.stdout)
			}
		}
		var d []allocDetail
		jsonOf(t, ctl("alloc", "show", "10.87.0.10", "--pool", pool, "-o", "json"), &d)
		if len(d) != 1 || d[0].Owner != "u-web" || d[0].TTL <= 0 || d[0].GrantedTTL != 20 {
			t.Errorf("alloc show --pool -o json: %+v", d)
		}
	})
	t.Run("list filters", func(t *testing.T) {
		for _, args := range [][]string{{"--cluster", cluster}, {"--node", "n1"}, {"--owner", "u-web"}, {"--namespace", "ns"}} {
			r := ctl(append([]string{"alloc", "list", "--pool", pool}, args...)...)
			if r.code != 0 || strings.Count(r.stdout, "u-web") != 2 {
				t.Errorf("alloc list %v: want both addresses of u-web:\n%s", args, r.stdout)
			}
		}
		if r := ctl("alloc", "list", "--pool", pool, "--owner", "nobody"); strings.Count(r.stdout, "\n") != 1 {
			t.Errorf("alloc list of nobody: want the header only:\n%s", r.stdout)
		}
	})
	t.Run("live lease refused without force", func(t *testing.T) {
		r := ctl("alloc", "release", "10.87.0.10", "--pool", pool)
		for _, s := range []string{"ns/pod-web", "node n1", "keeps renewing", "--force"} {
			if !strings.Contains(r.stderr, s) {
				t.Errorf("refusal does not say %q: %s", s, r.stderr)
			}
		}
		if r.code != exitError || len(keys(t, cli, keyspace.IPKey(pool, allocator.DefaultBlocks, mustIP("10.87.0.10")))) != 1 {
			t.Errorf("exit %d, or the key was touched", r.code)
		}
	})
	t.Run("forced release takes the attachment, not the other pool's", func(t *testing.T) {
		// The address's held key (issue 23), here in the flat layout beside the block one, goes with it.
		held := keyspace.HeldKey(pool, allocator.Blocks{}, mustIP("10.87.0.10"))
		if _, err := cli.Put(ctx, held, `{"cluster":"`+cluster+`","node":"n1","owner":"u-web"}`); err != nil {
			t.Fatal(err)
		}
		var out releaseJSON
		r := ctl("alloc", "release", "10.87.0.10", "--pool", pool, "--force", "-o", "json")
		jsonOf(t, r, &out)
		if r.code != 0 || len(out.Released) != 2 || !out.Forced || out.OwnerIndex != keyspace.OwnerKey(cluster, "u-web", "eth0", pool) || out.QuarantineUntil == nil {
			t.Fatalf("release: exit %d %+v (%s)", r.code, out, r.stderr)
		}
		if !slices.Contains(out.HeldKeys, held) {
			t.Errorf("held keys released %v, want %s among them", out.HeldKeys, held)
		}
		for _, k := range []string{keyspace.IPKey(pool, allocator.DefaultBlocks, mustIP("10.87.0.10")), keyspace.IPKey(pool, allocator.DefaultBlocks, mustIP("fd87::10")), out.OwnerIndex, held} {
			if len(keys(t, cli, k)) != 0 {
				t.Errorf("%s still exists", k)
			}
		}
		if len(keys(t, cli, keyspace.IPKey(pool2, allocator.DefaultBlocks, mustIP("10.87.0.10")))) != 1 {
			t.Errorf("the other pool's allocation of the same address was touched")
		}
		if r := ctl("alloc", "show", "10.87.0.10", "--pool", pool); r.code != exitNotFound || !strings.Contains(r.stderr, "quarantine") {
			t.Errorf("alloc show after release: %+v", r)
		}
	})
	t.Run("leaseless key released without force, owner index on a lease kept", func(t *testing.T) {
		ip := "10.87.0.10"
		own := keyspace.OwnerKey(cluster, "u-db", "eth0", pool2)
		// A hand edit drops the allocation's lease: it no longer shares one with its owner index.
		v := keys(t, cli, keyspace.IPKey(pool2, allocator.DefaultBlocks, mustIP(ip)))[keyspace.IPKey(pool2, allocator.DefaultBlocks, mustIP(ip))]
		if _, err := cli.Put(ctx, keyspace.IPKey(pool2, allocator.DefaultBlocks, mustIP(ip)), v); err != nil {
			t.Fatal(err)
		}
		r := ctl("alloc", "release", ip, "--pool", pool2, "--quarantine", "0s")
		if r.code != 0 || !strings.Contains(r.stdout, "owner index left alone") {
			t.Errorf("release: %+v", r)
		}
		if len(keys(t, cli, own)) != 1 {
			t.Errorf("the owner index on another lease was deleted")
		}
		if len(keys(t, cli, keyspace.QuarantineKey(pool2, allocator.DefaultBlocks, mustIP(ip)))) != 0 {
			t.Errorf("--quarantine 0s still quarantined the address")
		}
	})
}

// keys returns key with its value when it exists (a one-entry map), else an empty map.
func keys(t *testing.T, cli *clientv3.Client, prefix string) map[string]string {
	t.Helper()
	resp, err := cli.Get(etcdtest.Ctx(t), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, kv := range resp.Kvs {
		if string(kv.Key) == prefix {
			out[string(kv.Key)] = string(kv.Value)
		}
	}
	return out
}
