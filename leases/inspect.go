package leases

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"sort"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
)

// AllocationEntry is one allocation key as an admin sees it.
type AllocationEntry struct {
	Pool string     `json:"pool"`
	IP   netip.Addr `json:"ip"`
	Allocation
	// Lease is the lease the key is bound to, in etcdctl's hex form; "0" means none.
	Lease string `json:"lease"`
	Key   string `json:"key"`
	// Unreadable is set when the value is not an allocation record.
	Unreadable string `json:"unreadable,omitempty"`
}

// ListPools returns every stored pool definition, sorted by name.
func ListPools(ctx context.Context, cli *clientv3.Client) ([]allocator.PoolSpec, error) {
	resp, err := cli.Get(ctx, PoolsPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list pools: %w", err)
	}
	out := make([]allocator.PoolSpec, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var spec allocator.PoolSpec
		if err := json.Unmarshal(kv.Value, &spec); err != nil {
			return nil, fmt.Errorf("pool definition %s is unreadable (%w); inspect it with: etcdctl get %s", kv.Key, err, kv.Key)
		}
		out = append(out, spec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// ListAllocations returns the allocations of pool (every pool when pool is ""), sorted by
// pool and address.
func ListAllocations(ctx context.Context, cli *clientv3.Client, pool string) ([]AllocationEntry, error) {
	resp, err := cli.Get(ctx, IPsPrefix(pool), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list allocations: %w", err)
	}
	out := make([]AllocationEntry, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		p, ip, err := ParseIPKey(string(kv.Key))
		if err != nil {
			continue
		}
		e := AllocationEntry{Pool: p, IP: ip, Lease: fmt.Sprintf("%x", kv.Lease), Key: string(kv.Key)}
		if err := json.Unmarshal(kv.Value, &e.Allocation); err != nil {
			e.Unreadable = err.Error()
		}
		out = append(out, e)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Pool != out[j].Pool {
			return out[i].Pool < out[j].Pool
		}
		return out[i].IP.Less(out[j].IP)
	})
	return out, nil
}
