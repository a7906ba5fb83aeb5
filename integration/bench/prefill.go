package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// prefillCluster is the cluster of every pre-filled pod; they run on prefillNodes nodes
// that are not the node under test.
const (
	prefillCluster = "default"
	prefillNodes   = 100
	prefillTTL     = 3600 // s: the pre-filled pods' agents are not simulated; nothing expires during a run
	// podsPerTxn keeps a batch of 3 puts per pod under etcd's default --max-txn-ops of 128.
	podsPerTxn = 42
)

// prefillLeasehold writes, for each address, the three keys an ADD of another node writes
// (allocation, owner index, pod record), with values as leasehold encodes them, each pod
// on its own lease (or leaseGroup pods per lease), in batched transactions from 8 workers.
func prefillLeasehold(ctx context.Context, cli *clientv3.Client, pool string, addrs []netip.Addr, leaseGroup int) error {
	if len(addrs) == 0 {
		return nil
	}
	leaseGroup = max(leaseGroup, 1)
	type batch struct{ addrs []netip.Addr }
	batches := make(chan batch)
	errs := make(chan error, 8)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for b := range batches {
				if err := prefillBatch(ctx, cli, pool, b.addrs, leaseGroup); err != nil {
					errs <- err
					for range batches {
					}
					return
				}
			}
		})
	}
	for i := 0; i < len(addrs); i += podsPerTxn {
		select {
		case batches <- batch{addrs[i:min(i+podsPerTxn, len(addrs))]}:
		case err := <-errs:
			close(batches)
			wg.Wait()
			return err
		}
	}
	close(batches)
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}

func prefillBatch(ctx context.Context, cli *clientv3.Client, pool string, addrs []netip.Addr, leaseGroup int) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var ops []clientv3.Op
	var lease clientv3.LeaseID
	now := time.Now().UTC()
	for i, addr := range addrs {
		if i%leaseGroup == 0 {
			g, err := cli.Grant(ctx, prefillTTL)
			if err != nil {
				return fmt.Errorf("prefill: grant lease: %w", err)
			}
			lease = g.ID
		}
		owner, container := ids.podUID(), ids.containerID()
		n := int(addr.As4()[3]) + int(addr.As4()[2])*256
		node := fmt.Sprintf("node-%03d", n%prefillNodes)
		nodeUID := fmt.Sprintf("%032x.%s", n%prefillNodes, "5f0c6a1e-3c2b-4b8e-9a51-2d8f1f6b7c3a")
		pod := allocator.PodRef{UID: owner, Namespace: "bench", Name: "pod-" + container[:10]}
		with := clientv3.WithLease(lease)
		ops = append(ops,
			clientv3.OpPut(keyspace.IPKey(pool, allocator.DefaultBlocks, addr), string(mustJSON(keyspace.Allocation{
				Owner: owner, Cluster: prefillCluster, Node: node, NodeUID: nodeUID, Pod: pod, ContainerID: container,
				IfName: "eth0", Network: pool, LeaseID: keyspace.LeaseHex(lease), Created: now,
			})), with),
			clientv3.OpPut(keyspace.OwnerKey(prefillCluster, owner, "eth0", pool), string(mustJSON(keyspace.OwnerRecord{
				IPs: []netip.Addr{addr}, ContainerID: container, Network: pool, Node: node, NodeUID: nodeUID,
				LeaseID: keyspace.LeaseHex(lease), Created: now,
			})), with),
			clientv3.OpPut(keyspace.PodKey(prefillCluster, node, owner), string(mustJSON(keyspace.PodRecord{
				Owner: owner, Pod: pod, NodeUID: nodeUID, LeaseID: keyspace.LeaseHex(lease),
				Netns: "/var/run/netns/cni-" + container[:36], ContainerID: container, Created: now,
			})), with),
		)
	}
	if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
		return fmt.Errorf("prefill: write %d allocations: %w", len(addrs), err)
	}
	return nil
}

// prefillHostLocal writes host-local's disk store as host-local itself would have: one file
// per address named by the address and holding "<container ID>\r\n<ifname>", and the
// last_reserved_ip.0 file of range set 0 (plugins v1.9.1, backend/disk).
func prefillHostLocal(dataDir, network string, addrs []netip.Addr) error {
	if len(addrs) == 0 {
		return nil
	}
	dir := filepath.Join(dataDir, network)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, a := range addrs {
		f := filepath.Join(dir, a.String())
		if err := os.WriteFile(f, []byte(ids.containerID()+"\r\n"+"eth0"), 0o600); err != nil {
			return fmt.Errorf("prefill host-local: %w", err)
		}
	}
	return os.WriteFile(filepath.Join(dir, "last_reserved_ip.0"), []byte(addrs[len(addrs)-1].String()), 0o600)
}
