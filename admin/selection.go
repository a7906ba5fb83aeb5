package admin

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/selection"
)

// SetPoolAccess changes who may get new addresses from pool: set changes the access read,
// and the pool is written back compared unchanged, its definition untouched. changed is false
// when the access was already so (nothing is written). An ADD that chose the pool before the
// write compares the definition it read, so it is refused by etcd and chooses again.
//
// Errors wrap ErrNotFound (no such pool), ErrMigrating, ErrConcurrentChange, or the etcd error.
func SetPoolAccess(ctx context.Context, cli *clientv3.Client, pool string, set func(*keyspace.PoolAccess)) (old, now keyspace.PoolAccess, changed bool, err error) {
	for range adminAttempts {
		p, err := readDefinition(ctx, cli, pool)
		if err != nil {
			return old, now, false, err
		}
		if err := notMigrating(p); err != nil {
			return old, now, false, err
		}
		old, now = p.Access, p.Access
		now.Namespaces = slices.Clone(p.Access.Namespaces)
		set(&now)
		slices.Sort(now.Namespaces)
		now.Namespaces = slices.Compact(now.Namespaces)
		if now.Closed == old.Closed && slices.Equal(now.Namespaces, old.Namespaces) {
			return old, now, false, nil
		}
		resp, err := cli.Txn(ctx).If(keyspace.Unchanged(p.Key, p.ModRevision)).
			Then(clientv3.OpPut(p.Key, keyspace.EncodePoolWith(p.Value, now))).Commit()
		if err != nil {
			return old, now, false, fmt.Errorf("write pool %s: %w", pool, err)
		}
		if resp.Succeeded {
			return old, now, true, nil
		}
	}
	return old, now, false, fmt.Errorf("%w: pool %s kept changing while its access was set; retry", ErrConcurrentChange, pool)
}

// RuleEntry is one stored selection rule.
type RuleEntry struct {
	keyspace.Rule
	Key         string
	ModRevision int64
	// Unreadable says why the value cannot be used (agents pass the rule over).
	Unreadable string `json:",omitempty"`
}

// SetNamespaceRule stores the pools of namespace's pods on network of cluster, in order.
// Every pool must exist: the rule is written in one transaction with a compare that each
// definition does, so a rule never names a pool that did not exist when it was written.
// Errors wrap allocator.ErrInvalidConfig or ErrInvalidName (bad names, no pool, a pool
// twice), ErrNotFound (a pool without definition), or the etcd error.
func SetNamespaceRule(ctx context.Context, cli *clientv3.Client, cluster, network, namespace string, rule keyspace.NamespaceRule) error {
	if err := keyspace.ValidateNames("cluster", cluster, "network", network, "namespace", namespace); err != nil {
		return err
	}
	if err := keyspace.ValidatePools(rule.Pools); err != nil {
		return err
	}
	return putRule(ctx, cli, keyspace.NamespaceRuleKey(cluster, network, namespace), rule, rule.Pools)
}

// SetNodeRule stores node rule name on network of cluster: the pools of the nodes it matches,
// which serve only such nodes. As SetNamespaceRule, every pool must exist; the rule needs a
// match (name patterns, labels).
func SetNodeRule(ctx context.Context, cli *clientv3.Client, cluster, network, name string, rule keyspace.NodeRule) error {
	if err := keyspace.ValidateNames("cluster", cluster, "network", network, "rule", name); err != nil {
		return err
	}
	if err := rule.Validate(); err != nil {
		return err
	}
	return putRule(ctx, cli, keyspace.NodeRuleKey(cluster, network, name), rule, rule.Pools)
}

func putRule(ctx context.Context, cli *clientv3.Client, key string, rule any, pools []string) error {
	cmps := make([]clientv3.Cmp, len(pools))
	for i, p := range pools {
		cmps[i] = clientv3.Compare(clientv3.CreateRevision(keyspace.PoolKey(p)), ">", 0)
	}
	resp, err := cli.Txn(ctx).If(cmps...).Then(clientv3.OpPut(key, keyspace.Encode(rule))).Commit()
	if err != nil {
		return fmt.Errorf("write selection rule %s: %w", key, err)
	}
	if resp.Succeeded {
		return nil
	}
	var missing []string
	for _, p := range pools {
		r, err := cli.Get(ctx, keyspace.PoolKey(p), clientv3.WithCountOnly())
		if err != nil {
			return fmt.Errorf("read pool %s: %w", p, err)
		}
		if r.Count == 0 {
			missing = append(missing, p)
		}
	}
	return fmt.Errorf("%w: the rule names pools without a definition: %s; create them first (leaseholdctl pool create), "+
		"nothing was written", ErrNotFound, strings.Join(missing, ", "))
}

// DeleteRule deletes a selection rule; deleted is false when there was none.
func DeleteRule(ctx context.Context, cli *clientv3.Client, cluster, network, kind, name string) (deleted bool, err error) {
	if err := keyspace.ValidateNames("cluster", cluster, "network", network, "rule", name); err != nil {
		return false, err
	}
	key := keyspace.NodeRuleKey(cluster, network, name)
	switch kind {
	case keyspace.RuleNamespace:
		key = keyspace.NamespaceRuleKey(cluster, network, name)
	case keyspace.RuleNode:
	default:
		return false, fmt.Errorf("%w: a selection rule is of kind %s or %s, not %q", allocator.ErrInvalidConfig,
			keyspace.RuleNamespace, keyspace.RuleNode, kind)
	}
	resp, err := cli.Delete(ctx, key)
	if err != nil {
		return false, fmt.Errorf("delete selection rule %s: %w", key, err)
	}
	return resp.Deleted > 0, nil
}

// ListRules returns the selection rules of cluster (every cluster's when cluster is ""),
// sorted by key.
func ListRules(ctx context.Context, cli *clientv3.Client, cluster string) ([]RuleEntry, error) {
	resp, err := cli.Get(ctx, keyspace.SelectionPrefix(cluster, ""), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list selection rules: %w", err)
	}
	out := make([]RuleEntry, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out = append(out, ruleEntry(kv))
	}
	return out, nil
}

// ruleEntry decodes one stored selection rule; one that does not decode or validate is kept
// with Unreadable set.
func ruleEntry(kv *mvccpb.KeyValue) RuleEntry {
	r, err := keyspace.DecodeRule(string(kv.Key), kv.Value)
	e := RuleEntry{Rule: r, Key: string(kv.Key), ModRevision: kv.ModRevision}
	if err != nil {
		e.Unreadable = err.Error()
	}
	return e
}

// Rules gathers the readable rules of one cluster's network as package selection takes them.
func Rules(entries []RuleEntry, cluster, network string) selection.Rules {
	rs := make([]keyspace.Rule, 0, len(entries))
	for _, e := range entries {
		if e.Unreadable == "" {
			rs = append(rs, e.Rule)
		}
	}
	return selection.Gather(rs, cluster, network)
}

// Explain reads the rules of cluster's network and every pool, and says which pools an ADD
// of pod on node would try, per family, and why each other pool of its list is passed over
// (selection.Choose). dflt is the network configuration's pool; the families are its range
// sets' unless families are given (a pool not stored yet).
func Explain(ctx context.Context, cli *clientv3.Client, cluster, network, dflt string, families []int, node selection.Node, pod selection.Pod) (selection.Choice, error) {
	entries, err := ListRules(ctx, cli, cluster)
	if err != nil {
		return selection.Choice{}, err
	}
	st, err := ReadKeys(ctx, cli, keyspace.PoolsPrefix())
	if err != nil {
		return selection.Choice{}, err
	}
	pools := map[string]selection.Pool{}
	for _, p := range st.Pools {
		if p.Usable() {
			pools[p.Name] = selection.PoolOf(p.Value, p.Access)
		}
	}
	if d, ok := pools[dflt]; ok && len(families) == 0 {
		families = d.Families
	} else if !ok {
		if len(families) == 0 {
			return selection.Choice{}, fmt.Errorf("%w: pool %s (the network configuration's) is not stored yet: say which "+
				"address families the network needs (--family 4,6)", ErrNotFound, dflt)
		}
		pools[dflt] = selection.Pool{Families: families, Unstored: true}
	}
	return selection.Choose(Rules(entries, cluster, network), pools, node, pod, dflt, families)
}
