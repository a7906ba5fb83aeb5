package admin

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// AllocationEntry is one allocation key as an admin sees it.
type AllocationEntry struct {
	Pool string     `json:"pool"`
	IP   netip.Addr `json:"ip"`
	// Block is the block the key names (the zero Prefix for a key in the flat layout); doctor
	// checks it is the block the pool's definition gives the address.
	Block netip.Prefix `json:"block,omitzero"`
	keyspace.Allocation
	// Lease is the lease the key is bound to, in etcdctl's hex form; "0" means none.
	Lease string `json:"lease"`
	Key   string `json:"key"`
	// Unreadable is set when the value is not an allocation record.
	Unreadable string `json:"unreadable,omitempty"`
	// BoundLease, CreateRevision and ModRevision are the key's metadata as etcd reports it.
	BoundLease     clientv3.LeaseID `json:"-"`
	CreateRevision int64            `json:"-"`
	ModRevision    int64            `json:"-"`
	Raw            []byte           `json:"-"` // the value as stored
}

// Record is one key of a leasehold record type T, decoded, with etcd's metadata.
type Record[T any] struct {
	Key   string `json:"key"`
	Value T      `json:"value"`
	// Lease is the lease the key is bound to; 0 means none.
	Lease          clientv3.LeaseID `json:"-"`
	CreateRevision int64            `json:"-"`
	ModRevision    int64            `json:"-"`
	// Unreadable is set (and Value is partial) when the value does not decode as T.
	Unreadable string `json:"unreadable,omitempty"`
	Raw        []byte `json:"-"` // the value as stored
}

// PoolEntry is a stored pool definition (keyspace.PoolRecord). Value is canonical unless
// Invalid is set; Value.Blocks is zero for a pool in the flat layout.
type PoolEntry struct {
	Record[allocator.PoolSpec]
	// Name is the pool name taken from the key.
	Name string
	// Invalid says why the definition cannot be used (it does not canonicalize, mixes the two
	// layouts, or names another pool than its key).
	Invalid string
	// Migrating is set while leaseholdctl pool migrate moves the pool to the block layout:
	// agents refuse its ADDs meanwhile.
	Migrating *keyspace.Migration
	// Access is who may get new addresses from the pool (pool close, pool lock).
	Access keyspace.PoolAccess
}

// Usable reports whether the definition can be read and used: not unreadable, not invalid.
func (p PoolEntry) Usable() bool { return p.Unreadable == "" && p.Invalid == "" }

// OwnerEntry is an owner index key owners/<cluster>/<owner>/<ifname>/<pool>.
type OwnerEntry struct {
	Record[keyspace.OwnerRecord]
	Cluster, Owner, IfName, Pool string
}

// NodeEntry is a node record nodes/<cluster>/<node>.
type NodeEntry struct {
	Record[keyspace.NodeRecord]
	Cluster, Node string
}

// PodEntry is a pod record nodes/<cluster>/<node>/pods/<owner>.
type PodEntry struct {
	Record[keyspace.PodRecord]
	Cluster, Node, Owner string
}

// QuarantineEntry is a quarantine key quarantine/<pool>/<block>/<ip> (flat layout:
// quarantine/<pool>/<ip>, Block zero).
type QuarantineEntry struct {
	Record[keyspace.QuarantineRecord]
	Pool  string
	Block netip.Prefix
	IP    netip.Addr
}

// BlockEntry is a block claim blocks/<pool>/<block>: the node that claimed the block, on that
// node's block lease (Record.Lease).
type BlockEntry struct {
	Record[keyspace.BlockRecord]
	Pool  string
	Block netip.Prefix
}

// HeldEntry is a held key held/<pool>/<block>/<ip> (flat layout: held/<pool>/<ip>, Block
// zero): the node and owner whose allocation of the address it stands for, on that node's
// block lease (Record.Lease). Beside the allocation it is normal; without one the address is
// expired (State.Expired): its pod's lease ran out without a release, and the address is held
// back for its node until the block lease expires. Unless its pod still runs: then etcd lost
// the pod's keys, and HeldFindings says so, as doctor does.
type HeldEntry struct {
	Record[keyspace.HeldRecord]
	Pool  string
	Block netip.Prefix
	IP    netip.Addr
}

// ClaimEntry is a sticky claim claims/<cluster>/<pool>/<claim> (issue 19): the addresses the
// next attachment naming the claim gets, and who holds them now, on the claim lease
// (Record.Lease) its holder's agent renews.
type ClaimEntry struct {
	Record[keyspace.ClaimRecord]
	Cluster, Pool, Name string
	// Migration is the claim's live migration key, when one exists and was read with the
	// claim (ListClaims, GetClaim, a State read of both families): its second holder.
	Migration *LiveMigrationEntry
}

// ConflictEntry is a conflict record conflicts/<cluster>/<owner>/<ifname>/<pool>.
type ConflictEntry struct {
	Record[keyspace.ConflictRecord]
	Cluster, Owner, IfName, Pool string
}

// HostIPEntry is a host address key hostips/<ip>/<cluster>/<node>.
type HostIPEntry struct {
	Key           string
	IP            netip.Addr
	Cluster, Node string
	Lease         clientv3.LeaseID
}

// BadKey is a key inside one of leasehold's key families whose name has not the family's shape.
type BadKey struct {
	Key    string
	Lease  clientv3.LeaseID
	Reason string
}

// State is every key under Prefix, read in one request (so at one revision) and sorted by
// family. Keys of families this version does not know are left out.
type State struct {
	Revision    int64
	Pools       []PoolEntry
	Allocations []AllocationEntry
	Owners      []OwnerEntry
	Nodes       []NodeEntry
	Pods        []PodEntry
	Quarantine  []QuarantineEntry
	Conflicts   []ConflictEntry
	HostIPs     []HostIPEntry
	Blocks      []BlockEntry
	Held        []HeldEntry
	Claims      []ClaimEntry
	// LiveMigrations are the live migration keys (issue 35), each also linked from its claim.
	LiveMigrations []LiveMigrationEntry
	// Rules are the selection rules (selection/), readable or not.
	Rules   []RuleEntry
	BadKeys []BadKey
	// prefixes are the key ranges read (nil: all of Prefix). A check relating two families
	// runs only where the state holds both, so a narrow read reports no false absence.
	prefixes []string
}

// Covers reports whether st read key's range: an absent key is then really absent.
func (st *State) Covers(key string) bool {
	if st.prefixes == nil {
		return true
	}
	return slices.ContainsFunc(st.prefixes, func(p string) bool { return strings.HasPrefix(key, p) })
}

// ReadState reads the whole state at one revision. It fails only when etcd does: values that
// do not decode are kept with Unreadable set, for doctor to report.
func ReadState(ctx context.Context, cli *clientv3.Client) (*State, error) {
	return ReadKeys(ctx, cli, keyspace.Prefix)
}

// ReadKeys reads every key under each of prefixes (a full key is its own prefix; prefixes must
// not overlap) in one transaction, so at one revision, and files them as ReadState does.
func ReadKeys(ctx context.Context, cli *clientv3.Client, prefixes ...string) (*State, error) {
	ops := make([]clientv3.Op, len(prefixes))
	for i, p := range prefixes {
		ops[i] = clientv3.OpGet(p, clientv3.WithPrefix())
	}
	resp, err := cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", strings.Join(prefixes, ", "), err)
	}
	st := &State{Revision: resp.Header.Revision, prefixes: slices.Clone(prefixes)}
	if slices.Contains(prefixes, keyspace.Prefix) {
		st.prefixes = nil
	}
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			st.add(kv)
		}
	}
	slices.SortFunc(st.Allocations, func(a, b AllocationEntry) int {
		return cmp.Or(strings.Compare(a.Pool, b.Pool), a.IP.Compare(b.IP))
	})
	st.linkMigrations()
	return st, nil
}

func record[T any](kv *mvccpb.KeyValue) Record[T] {
	r := Record[T]{Key: string(kv.Key), Lease: keyspace.LeaseOf(kv), CreateRevision: kv.CreateRevision,
		ModRevision: kv.ModRevision, Raw: kv.Value}
	if err := json.Unmarshal(kv.Value, &r.Value); err != nil {
		r.Unreadable = err.Error()
	}
	return r
}

// add files kv under its family. Etcd returns keys sorted, so every family stays sorted by key.
func (st *State) add(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	rest := strings.TrimPrefix(key, keyspace.Prefix)
	family, rest, _ := strings.Cut(rest, "/")
	parts := strings.Split(rest, "/")
	bad := func(reason string) {
		st.BadKeys = append(st.BadKeys, BadKey{Key: key, Lease: keyspace.LeaseOf(kv), Reason: reason})
	}
	switch family {
	case "pools":
		if len(parts) != 1 || parts[0] == "" {
			bad("want " + keyspace.PoolsPrefix() + "<pool>")
			return
		}
		st.Pools = append(st.Pools, poolEntry(kv, parts[0]))
	case "blocks":
		pool, block, err := keyspace.ParseBlockKey(key)
		if err != nil {
			bad(err.Error())
			return
		}
		st.Blocks = append(st.Blocks, BlockEntry{Record: record[keyspace.BlockRecord](kv), Pool: pool, Block: block})
	case "ips":
		e, err := allocationEntry(kv)
		if err != nil {
			bad(err.Error())
			return
		}
		st.Allocations = append(st.Allocations, e)
	case "owners":
		c, o, i, p, err := keyspace.ParseOwnerKey(key)
		if err != nil {
			bad(err.Error())
			return
		}
		st.Owners = append(st.Owners, OwnerEntry{Record: record[keyspace.OwnerRecord](kv), Cluster: c, Owner: o, IfName: i, Pool: p})
	case "nodes":
		switch {
		case len(parts) == 2:
			st.Nodes = append(st.Nodes, NodeEntry{Record: record[keyspace.NodeRecord](kv), Cluster: parts[0], Node: parts[1]})
		case len(parts) == 4 && parts[2] == "pods":
			st.Pods = append(st.Pods, PodEntry{Record: record[keyspace.PodRecord](kv), Cluster: parts[0], Node: parts[1], Owner: parts[3]})
		default:
			bad("want " + keyspace.NodesPrefix("") + "<cluster>/<node> or " + keyspace.NodesPrefix("") + "<cluster>/<node>/pods/<owner>")
		}
	case "quarantine":
		pool, block, ip, err := keyspace.ParseQuarantineKey(key)
		if err == nil {
			err = canonical(key, keyspace.QuarantinePrefix(pool), block, ip)
		}
		if err != nil {
			bad(err.Error())
			return
		}
		st.Quarantine = append(st.Quarantine, QuarantineEntry{Record: record[keyspace.QuarantineRecord](kv), Pool: pool, Block: block, IP: ip})
	case "held":
		pool, block, ip, err := keyspace.ParseHeldKey(key)
		if err == nil {
			err = canonical(key, keyspace.HeldPrefix(pool), block, ip)
		}
		if err != nil {
			bad(err.Error())
			return
		}
		st.Held = append(st.Held, HeldEntry{Record: record[keyspace.HeldRecord](kv), Pool: pool, Block: block, IP: ip})
	case "claims":
		c, p, n, err := keyspace.ParseClaimKey(key)
		if err == nil {
			err = keyspace.ValidateNames("cluster", c, "pool", p, "claim", n)
		}
		if err != nil {
			bad(err.Error())
			return
		}
		st.Claims = append(st.Claims, ClaimEntry{Record: record[keyspace.ClaimRecord](kv), Cluster: c, Pool: p, Name: n})
	case "livemigrations":
		c, p, n, err := keyspace.ParseLiveMigrationKey(key)
		if err == nil {
			err = keyspace.ValidateNames("cluster", c, "pool", p, "claim", n)
		}
		if err != nil {
			bad(err.Error())
			return
		}
		st.LiveMigrations = append(st.LiveMigrations, LiveMigrationEntry{Record: record[keyspace.LiveMigrationRecord](kv),
			Cluster: c, Pool: p, Claim: n})
	case "conflicts":
		if len(parts) != 4 {
			bad("want " + keyspace.ConflictsPrefix("") + "<cluster>/<owner>/<ifname>/<pool>")
			return
		}
		st.Conflicts = append(st.Conflicts, ConflictEntry{Record: record[keyspace.ConflictRecord](kv),
			Cluster: parts[0], Owner: parts[1], IfName: parts[2], Pool: parts[3]})
	case "selection":
		if _, _, _, _, err := keyspace.ParseSelectionKey(key); err != nil {
			bad(err.Error())
			return
		}
		st.Rules = append(st.Rules, ruleEntry(kv))
	case "hostips":
		ip, err := netip.ParseAddr(parts[0])
		if err != nil || len(parts) != 3 {
			bad("want " + keyspace.HostIPPrefix(netip.Addr{}) + "<ip>/<cluster>/<node>")
			return
		}
		st.HostIPs = append(st.HostIPs, HostIPEntry{Key: key, IP: ip, Cluster: parts[1], Node: parts[2], Lease: keyspace.LeaseOf(kv)})
	}
}

// poolEntry decodes a pool definition as keyspace.DecodePool does, telling an unreadable value
// (not JSON of a PoolRecord) from an invalid definition (one that does not canonicalize).
func poolEntry(kv *mvccpb.KeyValue, name string) PoolEntry {
	e := PoolEntry{Record: Record[allocator.PoolSpec]{Key: string(kv.Key), Lease: keyspace.LeaseOf(kv),
		CreateRevision: kv.CreateRevision, ModRevision: kv.ModRevision, Raw: kv.Value}, Name: name}
	var rec keyspace.PoolRecord
	if err := json.Unmarshal(kv.Value, &rec); err != nil {
		e.Unreadable = err.Error()
		return e
	}
	spec, err := rec.Spec()
	e.Value, e.Migrating, e.Access = spec, rec.Migrating, rec.PoolAccess
	switch {
	case err != nil:
		e.Invalid = err.Error()
	case spec.Name != name:
		e.Invalid = fmt.Sprintf("the definition names pool %q, not %q", spec.Name, name)
	}
	return e
}

// canonical checks that key, parsed into block and ip under dir (the pool's allocation,
// quarantine or held prefix), spells them as every writer does: the address in its plain form
// (no zone, IPv4 not mapped into IPv6), the block as BlockName. Whether the block is the one the
// pool's definition gives the address is for doctor to say: parsing does not know the pool.
func canonical(key, dir string, block netip.Prefix, ip netip.Addr) error {
	if spell(dir, block, ip) != key || ip.Is4In6() || ip.Zone() != "" {
		return fmt.Errorf("key %q does not spell the address in its canonical form %s", key, ip.Unmap().WithZone(""))
	}
	return nil
}

// spell is the key of ip in block under dir (a pool's allocation, quarantine or held
// prefix): dir + <block>/<ip>, or dir + <ip> for the zero block (the flat layout).
func spell(dir string, block netip.Prefix, ip netip.Addr) string {
	if block.IsValid() {
		return dir + keyspace.BlockName(block) + "/" + ip.String()
	}
	return dir + ip.String()
}

// allocationEntry decodes an allocation key; an error means the key itself is malformed.
func allocationEntry(kv *mvccpb.KeyValue) (AllocationEntry, error) {
	key := string(kv.Key)
	p, block, ip, err := keyspace.ParseIPKey(key)
	if err != nil {
		return AllocationEntry{}, err
	}
	if err := canonical(key, keyspace.IPsPrefix(p), block, ip); err != nil {
		return AllocationEntry{}, err
	}
	e := AllocationEntry{Pool: p, Block: block, IP: ip, Lease: keyspace.LeaseHex(keyspace.LeaseOf(kv)), Key: key,
		BoundLease: keyspace.LeaseOf(kv), CreateRevision: kv.CreateRevision, ModRevision: kv.ModRevision, Raw: kv.Value}
	if err := json.Unmarshal(kv.Value, &e.Allocation); err != nil {
		e.Unreadable = err.Error()
	}
	return e, nil
}

// Pool returns the stored definition of name, if the state has one.
func (st *State) Pool(name string) (PoolEntry, bool) {
	if i := slices.IndexFunc(st.Pools, func(p PoolEntry) bool { return p.Name == name }); i >= 0 {
		return st.Pools[i], true
	}
	return PoolEntry{}, false
}

// ListPools returns every stored pool definition, canonical, sorted by name; a pool in the
// block layout has its Blocks set. An unreadable or invalid definition fails the whole list,
// naming the key.
func ListPools(ctx context.Context, cli *clientv3.Client) ([]allocator.PoolSpec, error) {
	resp, err := cli.Get(ctx, keyspace.PoolsPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list pools: %w", err)
	}
	out := make([]allocator.PoolSpec, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		spec, _, err := keyspace.DecodePool(string(kv.Key), kv.Value)
		if err != nil {
			return nil, err
		}
		out = append(out, spec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// ListAllocations returns the allocations of pool (every pool when pool is ""), sorted by
// pool and address, in either layout (a pool being migrated has both). Keys that are not
// allocation keys are skipped.
func ListAllocations(ctx context.Context, cli *clientv3.Client, pool string) ([]AllocationEntry, error) {
	st, err := ReadKeys(ctx, cli, keyspace.IPsPrefix(pool))
	if err != nil {
		return nil, err
	}
	return st.Allocations, nil
}

// LeaseTTL is a lease's remaining and granted TTL in seconds. TTL is -1 when the key has no
// lease or etcd no longer has the lease.
type LeaseTTL struct {
	TTL        int64 `json:"ttl"`
	GrantedTTL int64 `json:"grantedTTL"`
}

// TimeToLive asks etcd how long lease has left; a lease etcd does not know is TTL -1, not an
// error. Lease 0 (no lease) is TTL -1 without a request.
func TimeToLive(ctx context.Context, cli *clientv3.Client, lease clientv3.LeaseID) (LeaseTTL, error) {
	if lease == 0 {
		return LeaseTTL{TTL: -1}, nil
	}
	resp, err := cli.TimeToLive(ctx, lease)
	if keyspace.IsLeaseNotFound(err) {
		return LeaseTTL{TTL: -1}, nil
	}
	if err != nil {
		return LeaseTTL{}, fmt.Errorf("look up lease %s: %w", keyspace.LeaseHex(lease), err)
	}
	return LeaseTTL{TTL: resp.TTL, GrantedTTL: resp.GrantedTTL}, nil
}

// readPool reads a pool's definition and every allocation of the pool (in either layout) in
// one transaction. The definition is usable; Migrating may be set.
func readPool(ctx context.Context, cli *clientv3.Client, pool string) (PoolEntry, []AllocationEntry, int64, error) {
	if err := allocator.ValidateName("pool", pool); err != nil {
		return PoolEntry{}, nil, 0, err
	}
	st, err := ReadKeys(ctx, cli, keyspace.PoolKey(pool), keyspace.IPsPrefix(pool))
	if err != nil {
		return PoolEntry{}, nil, 0, err
	}
	p, ok := st.Pool(pool)
	switch {
	case !ok:
		return PoolEntry{}, nil, 0, fmt.Errorf("%w: pool %s has no definition (%s); see leaseholdctl pool list", ErrNotFound, pool, keyspace.PoolKey(pool))
	case p.Unreadable != "":
		return PoolEntry{}, nil, 0, fmt.Errorf("pool definition %s is unreadable (%s); inspect it with: etcdctl get %s", p.Key, p.Unreadable, p.Key)
	case p.Invalid != "":
		return PoolEntry{}, nil, 0, fmt.Errorf("pool definition %s is invalid: %s", p.Key, p.Invalid)
	}
	return p, st.Allocations, st.Revision, nil
}

// podName is "namespace/name", or "-" when the runtime named no pod.
func podName(p allocator.PodRef) string {
	if p.Name == "" {
		return "-"
	}
	return p.Namespace + "/" + p.Name
}
