package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// TestTwoClustersShareOnePool: two clusters' agents, with the same node names, the same
// container IDs and the same pod UIDs, hammer one pool in one etcd at once. Afterwards every
// invariant holds across the keys, and no cluster's DEL or GC touches the other's owners.
func TestTwoClustersShareOnePool(t *testing.T) {
	f := newFixture(t, withoutAgent())
	type node struct {
		cluster, name string
		agent         *agentProc
		conf          []byte
	}
	pool := f.Pool
	ranges := dualStackIPAM("10.50.0.0/24", "fd50::/64")
	ranges["pool"] = pool
	var nodes []*node
	for _, cluster := range []string{"cluster-a", "cluster-b"} {
		for _, name := range []string{"node-1", "node-2"} {
			n := &node{cluster: cluster, name: name}
			n.agent = f.startAgent("--cluster", cluster, "--node", name, "--node-uid", cluster+"."+name, "--gc-grace", "0s")
			ipam := map[string]any{"pool": pool} // cluster-b refers to the pool by name
			if cluster == "cluster-a" {
				ipam = map[string]any{"pool": pool, "ranges": ranges["ranges"]}
			}
			n.conf = netconf("net-"+cluster, n.agent.Socket, ipam)
			nodes = append(nodes, n)
		}
	}
	// cluster-a defines the pool first; cluster-b's configurations only name it.
	if _, err := f.add(nodes[0].conf, "warmup", "eth0", ""); err != nil {
		t.Fatal(err)
	}
	if err := f.del(nodes[0].conf, "warmup", "eth0", ""); err != nil {
		t.Fatal(err)
	}

	const perNode = 40
	type got struct {
		node *node
		ctr  string
		ips  []netip.Addr
	}
	var mu sync.Mutex
	var held []got
	var wg sync.WaitGroup
	errs := make(chan error, len(nodes)*perNode)
	sem := make(chan struct{}, 32)
	for _, n := range nodes {
		for i := range perNode {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				ctr := fmt.Sprintf("%s-ctr-%02d", strings.TrimPrefix(n.name, "node-"), i) // same IDs in both clusters
				args := fmt.Sprintf("K8S_POD_UID=uid-%s;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p%d", ctr, i)
				res, err := f.add(n.conf, ctr, "eth0", args)
				if err != nil {
					errs <- fmt.Errorf("%s/%s ADD %s: %w", n.cluster, n.name, ctr, err)
					return
				}
				if i%5 == 0 { // churn: some pods go away right after
					if err := f.del(n.conf, ctr, "eth0", args); err != nil {
						errs <- fmt.Errorf("%s/%s DEL %s: %w", n.cluster, n.name, ctr, err)
					}
					return
				}
				g := got{node: n, ctr: ctr}
				for _, ip := range res.IPs {
					a, _ := netip.AddrFromSlice(ip.Address.IP)
					g.ips = append(g.ips, a.Unmap())
				}
				mu.Lock()
				held = append(held, g)
				mu.Unlock()
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	owner := map[netip.Addr]string{}
	for _, g := range held {
		for _, ip := range g.ips {
			who := g.node.cluster + "/" + g.node.name + "/" + g.ctr
			if prev, dup := owner[ip]; dup {
				t.Errorf("address %s handed to %s and %s", ip, prev, who)
			}
			owner[ip] = who
		}
	}
	checkInvariants(t, f.Cli, pool, len(held), 2)

	// cluster-a node-1 GCs with an empty attachment list: only cluster-a node-1's go.
	gcConf := withValidAttachments(t, nodes[0].conf, nil)
	if err := f.run("GC", gcConf); err != nil {
		t.Fatalf("GC: %v", err)
	}
	// cluster-b node-1 receives a DEL for a container ID that exists in both clusters.
	if err := f.del(nodes[2].conf, "1-ctr-03", "eth0", "K8S_POD_UID=uid-1-ctr-03"); err != nil {
		t.Fatal(err)
	}
	allocs := allocationsByNode(t, f.Cli, pool)
	if n := allocs["cluster-a/node-1"]; n != 0 {
		t.Errorf("cluster-a node-1 still holds %d addresses after its GC with no valid attachment", n)
	}
	want := 2 * (perNode - perNode/5) // two families
	if n := allocs["cluster-a/node-2"]; n != want {
		t.Errorf("cluster-a node-2 holds %d addresses, want %d: node-1's GC touched it", n, want)
	}
	if n := allocs["cluster-b/node-1"]; n != want-2 {
		t.Errorf("cluster-b node-1 holds %d addresses, want %d (all but the one DEL'd): cluster-a's GC touched it", n, want-2)
	}
	if n := allocs["cluster-b/node-2"]; n != want {
		t.Errorf("cluster-b node-2 holds %d addresses, want %d", n, want)
	}

	// A configuration of cluster-b that defines the same pool differently is refused with
	// both definitions; the stored one stays.
	other := netconf("net-cluster-b", nodes[2].agent.Socket, map[string]any{"pool": pool, "ranges": dualStackIPAM("10.51.0.0/24", "fd50::/64")["ranges"]})
	_, err := f.add(other, "conflicting", "eth0", "")
	if cniCode(err) != 7 || !strings.Contains(err.Error(), "10.50.0.0/24") || !strings.Contains(err.Error(), "10.51.0.0/24") {
		t.Errorf("conflicting pool definition: want code 7 showing both, got %v", err)
	}
	// ... and reported to the cluster already using the pool: a record under the pool, and
	// an error in the logs of cluster-a's agents, which serve the pool.
	if !exists(t, f.Cli, keyspace.PoolConflictKey(pool, "cluster-b", "node-1")) {
		t.Errorf("no pool conflict record %s", keyspace.PoolConflictKey(pool, "cluster-b", "node-1"))
	}
	eventually(t, "cluster-a's agent logs the conflict", func() error {
		return saw(strings.Contains(nodes[1].agent.logs.String(), "another node defines this pool differently"), "not in its log")
	})
	out, err := exec.CommandContext(f.Ctx, filepath.Join(binDir(t), "leaseholdctl"), "--endpoints", f.Endpoint,
		"pool", "conflicts", "--pool", pool, "-o", "json").Output()
	if err != nil {
		t.Fatalf("leaseholdctl pool conflicts: %v", err)
	}
	var listed []struct{ Pool, Cluster, Node, Wanted, Stored string }
	if err := json.Unmarshal(out, &listed); err != nil || len(listed) != 1 || listed[0].Cluster != "cluster-b" ||
		!strings.Contains(listed[0].Wanted, "10.51.0.0/24") || !strings.Contains(listed[0].Stored, "10.50.0.0/24") {
		t.Errorf("leaseholdctl pool conflicts should list cluster-b's conflicting definition: %s (%v)", out, err)
	}
	// Hostile input never becomes a wider key prefix.
	if err := exec.CommandContext(f.Ctx, filepath.Join(binDir(t), "leaseholdctl"), "--endpoints", f.Endpoint,
		"pool", "conflicts", "--pool", "../x").Run(); err == nil {
		t.Errorf("pool conflicts --pool ../x must be refused")
	}
}

func withValidAttachments(t *testing.T, conf []byte, valid []map[string]string) []byte {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		t.Fatal(err)
	}
	if valid == nil {
		valid = []map[string]string{}
	}
	m["cni.dev/valid-attachments"] = valid
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func allocationsByNode(t *testing.T, cli *clientv3.Client, pool string) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	list, err := admin.ListAllocations(ctx, cli, pool)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, a := range list {
		out[a.Cluster+"/"+a.Node]++
	}
	return out
}

// checkInvariants reads every key of the pool and its owners and checks the design's
// invariants: each allocation has an owner index in its own cluster naming it, on the same
// lease, with a pod record on that lease; every such key has a lease; counts match.
func checkInvariants(t *testing.T, cli *clientv3.Client, pool string, attachments, families int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	resp, err := cli.Get(ctx, keyspace.Prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	kvs := map[string]int64{}
	values := map[string][]byte{}
	for _, kv := range resp.Kvs {
		kvs[string(kv.Key)] = kv.Lease
		values[string(kv.Key)] = kv.Value
	}
	allocs, owners := 0, 0
	for key, lease := range kvs {
		switch {
		case strings.HasPrefix(key, keyspace.IPsPrefix(pool)):
			allocs++
			var a keyspace.Allocation
			if err := json.Unmarshal(values[key], &a); err != nil {
				t.Fatalf("%s: %v", key, err)
			}
			ok := keyspace.OwnerKey(a.Cluster, a.Owner, a.IfName, pool)
			var rec keyspace.OwnerRecord
			if err := json.Unmarshal(values[ok], &rec); err != nil {
				t.Errorf("allocation %s: owner index %s missing or unreadable", key, ok)
				continue
			}
			_, _, ip, _ := keyspace.ParseIPKey(key)
			named := false
			for _, x := range rec.IPs {
				named = named || x == ip
			}
			if !named || kvs[ok] != lease || rec.ContainerID != a.ContainerID {
				t.Errorf("allocation %s (lease %x) and its owner index %s (lease %x, ips %v, container %s) disagree", key, lease, ok, kvs[ok], rec.IPs, rec.ContainerID)
			}
			if pod := keyspace.PodKey(a.Cluster, a.Node, a.Owner); kvs[pod] != lease {
				t.Errorf("allocation %s: pod record %s on lease %x, want %x", key, pod, kvs[pod], lease)
			}
			if lease == 0 {
				t.Errorf("allocation %s has no lease", key)
			}
		case strings.HasPrefix(key, keyspace.OwnersPrefix("")) && strings.HasSuffix(key, "/"+pool):
			owners++
			if lease == 0 {
				t.Errorf("owner index %s has no lease", key)
			}
		}
	}
	if allocs != families*attachments || owners != attachments {
		t.Errorf("etcd holds %d allocations and %d owner indexes; %d live attachments of %d families need %d and %d",
			allocs, owners, attachments, families, families*attachments, attachments)
	}
}
