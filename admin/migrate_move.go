package admin

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The move step of MigratePool (migrate.go): list, move in batches, unfreeze.

// mover moves one pool's flat keys to their blocks.
type mover struct {
	cli    *clientv3.Client
	pool   string
	access keyspace.PoolAccess // kept through the move
	blocks allocator.Blocks
	rep    *MigrateReport
	seen   map[string]bool // conflicts already reported, by old key
	// conflicts counts the conflicts of the current round.
	conflicts int
}

// run moves the flat keys of a frozen pool and unfreezes it.
func (m *mover) run(ctx context.Context, poolKey string, spec allocator.PoolSpec) error {
	for range migrateRounds {
		keys, rev, err := m.flatKeys(ctx)
		if err != nil {
			return err
		}
		if len(keys) == 0 {
			done, err := m.unfreeze(ctx, poolKey, spec, rev)
			if done || err != nil {
				return err
			}
			continue // a key appeared since the listing: list again
		}
		m.conflicts = 0
		if err := m.moveAll(ctx, keys); err != nil {
			return err
		}
		if m.conflicts == len(keys) {
			return m.conflictError()
		}
	}
	return fmt.Errorf("%w: keys of pool %s kept appearing while it was frozen; run leaseholdctl pool migrate %s again",
		ErrConcurrentChange, m.pool, m.pool)
}

// leftovers moves the flat keys found in a migrated pool, if any.
func (m *mover) leftovers(ctx context.Context) error {
	keys, _, err := m.flatKeys(ctx)
	if err != nil || len(keys) == 0 {
		m.rep.AlreadyDone = err == nil
		return err
	}
	if err := m.moveAll(ctx, keys); err != nil {
		return err
	}
	if m.conflicts > 0 {
		return m.conflictError()
	}
	return nil
}

func (m *mover) conflictError() error {
	var b strings.Builder
	fmt.Fprintf(&b, "pool %s: %d key(s) of the flat layout stay because their block key exists too (two keys for one "+
		"address); delete the stale one once you know which holder is real (leaseholdctl doctor and alloc show say who holds each), "+
		"then run leaseholdctl pool migrate %s again:", m.pool, len(m.rep.Conflicts), m.pool)
	for _, c := range m.rep.Conflicts {
		fmt.Fprintf(&b, "\n  %s: %s and %s", c.IP, c.Old, c.New)
	}
	return fmt.Errorf("%w: %s", ErrMigrateConflicts, b.String())
}

// Families of keys a migration moves: each address's allocation, quarantine and held key
// (issue 23: the held key goes with its allocation, same value and lease; one without an
// allocation, an expired address, goes too).
type moveFamily int

const (
	famAllocation moveFamily = iota
	famQuarantine
	famHeld
)

// dir is the family's prefix in the pool; parse reads one of its keys.
func (f moveFamily) dir(pool string) string {
	switch f {
	case famQuarantine:
		return keyspace.QuarantinePrefix(pool)
	case famHeld:
		return keyspace.HeldPrefix(pool)
	}
	return keyspace.IPsPrefix(pool)
}

func (f moveFamily) parse(key string) (string, netip.Prefix, netip.Addr, error) {
	switch f {
	case famQuarantine:
		return keyspace.ParseQuarantineKey(key)
	case famHeld:
		return keyspace.ParseHeldKey(key)
	}
	return keyspace.ParseIPKey(key)
}

var moveFamilies = []moveFamily{famAllocation, famQuarantine, famHeld}

// flatKeys lists the pool's allocation, quarantine and held keys in the flat layout (keys
// only), with the revision of the listing.
func (m *mover) flatKeys(ctx context.Context) ([]string, int64, error) {
	ops := make([]clientv3.Op, len(moveFamilies))
	for i, f := range moveFamilies {
		ops[i] = clientv3.OpGet(f.dir(m.pool), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	}
	resp, err := m.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, 0, fmt.Errorf("list the keys of pool %s: %w", m.pool, err)
	}
	var keys []string
	for i, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			if _, block, _, ok := m.parse(moveFamilies[i], string(kv.Key)); ok && !block.IsValid() {
				keys = append(keys, string(kv.Key))
			}
		}
	}
	// By address, then family: the keys of one address side by side, for moveAll.
	slices.SortStableFunc(keys, func(a, b string) int { return m.addrOf(a).Compare(m.addrOf(b)) })
	return keys, resp.Header.Revision, nil
}

// addrOf is the address of one of the pool's keys (the zero Addr for one that does not parse).
func (m *mover) addrOf(key string) netip.Addr {
	_, _, ip, _ := m.parse(m.family(key), key)
	return ip
}

// parse reads a key of family f of the pool; malformed keys are doctor's.
func (m *mover) parse(f moveFamily, key string) (newKey string, block netip.Prefix, ip netip.Addr, ok bool) {
	dir := f.dir(m.pool)
	pool, block, ip, err := f.parse(key)
	if err != nil || pool != m.pool || canonical(key, dir, block, ip) != nil {
		return "", netip.Prefix{}, netip.Addr{}, false
	}
	return spell(dir, m.blocks.Of(ip), ip), block, ip, true
}

// moveAll moves keys in batches; a batch that fails moves its keys one at a time. The keys of
// one address (its allocation, quarantine and held key) are moved in one batch: flatKeys lists
// them side by side, and a batch ends only between two addresses (at most migrateBatch+2 keys).
func (m *mover) moveAll(ctx context.Context, keys []string) error {
	for len(keys) > 0 {
		n := min(len(keys), migrateBatch)
		for n < len(keys) && m.addrOf(keys[n]) == m.addrOf(keys[n-1]) {
			n++
		}
		if err := m.moveBatch(ctx, keys[:n]); err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

func (m *mover) moveBatch(ctx context.Context, keys []string) error {
	gets := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		gets[i] = clientv3.OpGet(k)
	}
	resp, err := m.cli.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return fmt.Errorf("read the flat keys of pool %s: %w", m.pool, err)
	}
	var kvs []*mvccpb.KeyValue
	var cmps []clientv3.Cmp
	var ops []clientv3.Op
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			newKey, _, _, _ := m.parse(m.family(string(kv.Key)), string(kv.Key))
			kvs = append(kvs, kv)
			cmps = append(cmps, keyspace.Unchanged(string(kv.Key), kv.ModRevision), keyspace.Absent(newKey))
			ops = append(ops, putAs(newKey, kv), clientv3.OpDelete(string(kv.Key)))
		}
	}
	m.rep.Gone += len(keys) - len(kvs)
	if len(kvs) == 0 {
		return nil
	}
	tresp, err := m.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err == nil && tresp.Succeeded {
		for _, kv := range kvs {
			m.count(string(kv.Key))
		}
		return nil
	}
	if err != nil && !leaseGone(err) {
		return fmt.Errorf("move keys of pool %s: %w", m.pool, err)
	}
	for _, kv := range kvs { // a key changed, a block key exists, or a lease ended: one at a time
		if err := m.moveOne(ctx, string(kv.Key)); err != nil {
			return err
		}
	}
	return nil
}

// moveOne moves one key, reading it again: gone is skipped, a block key that exists is a
// conflict, a key whose lease ended meanwhile is read again (and is then gone).
func (m *mover) moveOne(ctx context.Context, key string) error {
	f := m.family(key)
	newKey, _, ip, _ := m.parse(f, key)
	for range adminAttempts {
		resp, err := m.cli.Get(ctx, key)
		if err != nil {
			return fmt.Errorf("read %s: %w", key, err)
		}
		if len(resp.Kvs) == 0 {
			m.rep.Gone++
			return nil
		}
		kv := resp.Kvs[0]
		tresp, err := m.cli.Txn(ctx).If(keyspace.Unchanged(key, kv.ModRevision), keyspace.Absent(newKey)).
			Then(putAs(newKey, kv), clientv3.OpDelete(key)).Else(clientv3.OpGet(newKey, clientv3.WithKeysOnly())).Commit()
		switch {
		case err != nil && leaseGone(err):
			continue // the key expires with its lease: read again
		case err != nil:
			return fmt.Errorf("move %s to %s: %w", key, newKey, err)
		case tresp.Succeeded:
			m.count(key)
			return nil
		case len(tresp.Responses[0].GetResponseRange().Kvs) > 0:
			m.conflicts++
			if !m.seen[key] {
				m.seen[key] = true
				m.rep.Conflicts = append(m.rep.Conflicts, MigrateConflict{IP: ip, Quarantine: f == famQuarantine, Held: f == famHeld, Old: key, New: newKey})
			}
			return nil
		}
	}
	return nil // kept changing: the next round lists it again
}

// family is the family of one of the pool's keys.
func (m *mover) family(key string) moveFamily {
	for _, f := range moveFamilies {
		if strings.HasPrefix(key, f.dir(m.pool)) {
			return f
		}
	}
	return famAllocation
}

func (m *mover) count(key string) {
	switch m.family(key) {
	case famQuarantine:
		m.rep.MovedQuarantine++
	case famHeld:
		m.rep.MovedHeld++
	default:
		m.rep.MovedAllocations++
	}
}

// unfreeze writes the definition without Migrating, if it is still the frozen one and no key
// of the pool was created after rev (the listing that found no flat key).
func (m *mover) unfreeze(ctx context.Context, poolKey string, spec allocator.PoolSpec, rev int64) (bool, error) {
	created := func(prefix string) clientv3.Cmp {
		return clientv3.Compare(clientv3.CreateRevision(prefix), "<", rev+1).WithPrefix()
	}
	resp, err := m.cli.Txn(ctx).If(keyspace.Unchanged(poolKey, m.rep.FrozenRevision),
		created(keyspace.IPsPrefix(m.pool)), created(keyspace.QuarantinePrefix(m.pool)), created(keyspace.HeldPrefix(m.pool))).
		Then(clientv3.OpPut(poolKey, keyspace.EncodePoolWith(spec, m.access))).Else(clientv3.OpGet(poolKey)).Commit()
	if err != nil {
		return false, fmt.Errorf("unfreeze pool %s: %w", m.pool, err)
	}
	if resp.Succeeded {
		m.rep.Revision = resp.Header.Revision
		return true, nil
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) == 0 || kvs[0].ModRevision != m.rep.FrozenRevision {
		return false, fmt.Errorf("%w: the definition of pool %s was changed or deleted while it was frozen (by hand?); inspect it "+
			"with etcdctl get %s, then run leaseholdctl pool migrate %s again", ErrConcurrentChange, m.pool, poolKey, m.pool)
	}
	return false, nil
}

// putAs puts kv's value at key on kv's lease (none when kv has none).
func putAs(key string, kv *mvccpb.KeyValue) clientv3.Op {
	if kv.Lease == 0 {
		return clientv3.OpPut(key, string(kv.Value))
	}
	return clientv3.OpPut(key, string(kv.Value), clientv3.WithLease(clientv3.LeaseID(kv.Lease)))
}

// leaseGone tells whether err is etcd refusing a put on a lease that no longer exists.
func leaseGone(err error) bool {
	return keyspace.IsLeaseNotFound(err) || strings.Contains(err.Error(), "requested lease not found")
}
