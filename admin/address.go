package admin

import (
	"context"
	"fmt"
	"net/netip"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// readBatch bounds the gets of one read transaction, within etcd's default of 128 operations.
const readBatch = 100

// FindAddress reads every allocation and quarantine key of ip in pool (in every pool when pool
// is ""), whatever the layout of the key: a pool being migrated has keys in both, and a key
// can only be found where it is, not where its pool's layout says it should be. With them it
// reads the definitions of those pools (and of pool) and the claims of the blocks the keys
// name. It lists the keys first (keys only), then reads the ones of ip by name.
func FindAddress(ctx context.Context, cli *clientv3.Client, pool string, ip netip.Addr) (*State, error) {
	if pool != "" {
		if err := allocator.ValidateName("pool", pool); err != nil {
			return nil, err
		}
	}
	ip = ip.Unmap()
	resp, err := cli.Txn(ctx).Then(
		clientv3.OpGet(keyspace.IPsPrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.QuarantinePrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	).Commit()
	if err != nil {
		return nil, fmt.Errorf("list the keys of %s: %w", ip, err)
	}
	var keys []string
	if pool != "" {
		keys = append(keys, keyspace.PoolKey(pool))
	}
	add := func(k string) {
		if !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
	}
	for i, r := range resp.Responses {
		parse := keyspace.ParseIPKey
		if i == 1 {
			parse = keyspace.ParseQuarantineKey
		}
		for _, kv := range r.GetResponseRange().Kvs {
			p, block, a, err := parse(string(kv.Key))
			if err != nil || a != ip {
				continue
			}
			add(string(kv.Key))
			add(keyspace.PoolKey(p))
			if block.IsValid() {
				add(keyspace.BlockKey(p, block))
			}
		}
	}
	st := &State{prefixes: keys}
	for len(keys) > 0 {
		n := min(len(keys), readBatch)
		ops := make([]clientv3.Op, n)
		for i, k := range keys[:n] {
			ops[i] = clientv3.OpGet(k)
		}
		resp, err := cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, fmt.Errorf("read the keys of %s: %w", ip, err)
		}
		st.Revision = resp.Header.Revision
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().Kvs {
				st.add(kv)
			}
		}
		keys = keys[n:]
	}
	return st, nil
}

// Claim returns the claim of block in pool, if the state has one.
func (st *State) Claim(pool string, block netip.Prefix) (BlockEntry, bool) {
	if i := slices.IndexFunc(st.Blocks, func(b BlockEntry) bool { return b.Pool == pool && b.Block == block }); i >= 0 {
		return st.Blocks[i], true
	}
	return BlockEntry{}, false
}
