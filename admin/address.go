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

// FindAddress reads every allocation, quarantine and held key of ip in pool (in every pool when
// pool is ""), whatever the layout of the key: a pool being migrated has keys in both, and a
// key can only be found where it is, not where its pool's layout says it should be. With them
// it reads the definitions of those pools (and of pool), the claims of the blocks the keys
// name, and the node records of the nodes the held keys and those claims name. It lists the
// keys first (keys only), then reads the ones of ip by name; the state covers ip's allocation
// key beside each held key, so State.Expired tells an address without allocation. For each
// such held key it also reads what tells whether its pod still runs (issue 32): the pod's
// record on the held key's node, its owner indexes and its conflict records, so HeldFindings
// tells a running pod's address whose keys etcd lost from an expired one, as doctor does.
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
		clientv3.OpGet(keyspace.HeldPrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
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
		parse := []func(string) (string, netip.Prefix, netip.Addr, error){keyspace.ParseIPKey, keyspace.ParseQuarantineKey, keyspace.ParseHeldKey}[i]
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
			if i == 2 {
				add(spell(keyspace.IPsPrefix(p), block, a)) // absent for an expired address: read, so covered
			}
		}
	}
	st := &State{prefixes: keys}
	if err := st.readByName(ctx, cli, ip, keys); err != nil {
		return nil, err
	}
	var nodes []string
	for _, h := range st.Held {
		if h.Unreadable == "" && keyspace.ValidateNames("cluster", h.Value.Cluster, "node", h.Value.Node) == nil {
			nodes = append(nodes, keyspace.NodeKey(h.Value.Cluster, h.Value.Node))
		}
	}
	for _, b := range st.Blocks {
		if b.Unreadable == "" && keyspace.ValidateNames("cluster", b.Value.Cluster, "node", b.Value.Node) == nil {
			nodes = append(nodes, keyspace.NodeKey(b.Value.Cluster, b.Value.Node))
		}
	}
	slices.Sort(nodes)
	nodes = slices.Compact(nodes)
	st.prefixes = append(st.prefixes, nodes...)
	if err := st.readByName(ctx, cli, ip, nodes); err != nil {
		return nil, err
	}
	if err := st.readPods(ctx, cli, ip); err != nil {
		return nil, err
	}
	return st, nil
}

// readPods reads, for each readable held key of st without allocation, the keys of its pod
// that doctor looks at to tell whether the pod still runs: its pod record on the held key's
// node (by name), and its owner indexes and conflict records (by prefix). The listing above
// found every key of ip under each pool read, so st covers ip's allocation key in the pool's
// own layout too: an owner index naming ip without allocation is then a true absence.
func (st *State) readPods(ctx context.Context, cli *clientv3.Client, ip netip.Addr) error {
	var pods, prefixes []string
	for _, h := range st.Expired() {
		v := h.Value
		if h.Unreadable != "" || keyspace.ValidateNames("cluster", v.Cluster, "node", v.Node, "owner", v.Owner) != nil {
			continue
		}
		if p, ok := st.Pool(h.Pool); ok && p.Usable() {
			st.prefixes = append(st.prefixes, keyspace.IPKey(h.Pool, p.Value.Blocks, ip))
		}
		pods = append(pods, keyspace.PodKey(v.Cluster, v.Node, v.Owner))
		prefixes = append(prefixes, keyspace.OwnerPrefix(v.Cluster, v.Owner), keyspace.ConflictsPrefix(v.Cluster)+v.Owner+"/")
	}
	if len(pods) == 0 {
		return nil
	}
	slices.Sort(pods)
	pods = slices.Compact(pods)
	slices.Sort(prefixes)
	prefixes = slices.Compact(prefixes)
	st.prefixes = append(st.prefixes, pods...)
	if err := st.readByName(ctx, cli, ip, pods); err != nil {
		return err
	}
	ops := make([]clientv3.Op, len(prefixes))
	for i, p := range prefixes {
		ops[i] = clientv3.OpGet(p, clientv3.WithPrefix())
	}
	resp, err := cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return fmt.Errorf("read the owner indexes of the pods holding %s: %w", ip, err)
	}
	st.Revision = resp.Header.Revision
	st.prefixes = append(st.prefixes, prefixes...)
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			st.add(kv)
		}
	}
	return nil
}

// readByName reads keys by name (not as prefixes) in batches and files them into st.
func (st *State) readByName(ctx context.Context, cli *clientv3.Client, ip netip.Addr, keys []string) error {
	for len(keys) > 0 {
		n := min(len(keys), readBatch)
		ops := make([]clientv3.Op, n)
		for i, k := range keys[:n] {
			ops[i] = clientv3.OpGet(k)
		}
		resp, err := cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return fmt.Errorf("read the keys of %s: %w", ip, err)
		}
		st.Revision = resp.Header.Revision
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().Kvs {
				st.add(kv)
			}
		}
		keys = keys[n:]
	}
	return nil
}

// Claim returns the claim of block in pool, if the state has one.
func (st *State) Claim(pool string, block netip.Prefix) (BlockEntry, bool) {
	if i := slices.IndexFunc(st.Blocks, func(b BlockEntry) bool { return b.Pool == pool && b.Block == block }); i >= 0 {
		return st.Blocks[i], true
	}
	return BlockEntry{}, false
}
