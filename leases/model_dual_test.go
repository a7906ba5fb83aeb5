package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// The two-pool part of TestModelRandomHistories (issue 34, items 3 and 6). Besides the
// model's pool, a dual-stack network serves every pod's interface net2: a namespace rule for
// the model's namespace gives it IPv4 from a list of IPv4-only pools, a small one first, and
// IPv6 from an IPv6-only pool, so that each net2 attachment is two, one per pool (an owner
// index each), claimed in one transaction, and a full small pool passes IPv4 alone to the
// next. Every step of the history hits them as it hits the model's pool: ADDs, repeated ADDs,
// DELs, CHECKs, GC (of the network), restarts, lost leases, drains, deaths, cut-offs, crashes
// after a DEL, DELs racing a re-claim, keys deleted or overwritten by hand, restores; and the
// access steps close the small IPv4 pool or the IPv6 pool, or change the rule to leave the
// small pool out (model_access_test.go).
//
//   - an ADD of net2 gets both families or neither: a served one answers one IPv4 address of
//     an IPv4 pool the rule names and that is open, and one IPv6 address, and etcd has an
//     owner index in each of those pools listing its address; a refused one leaves no owner
//     index and no allocation of the interface in any of the three pools, and is refused only
//     for exhaustion, or, while the IPv6 pool is closed, naming it;
//   - the checks of every other step hold address by address, in whatever pool the address
//     is: no address to two live attachments, the owner index of its pool names it, held
//     keys, conflicts (a conflict record per pool), the reuse order (per pool), re-claims
//     and repairs bring back both attachments, a DEL releases both, and nothing is left at
//     the end in any pool;
//   - a rule changed or a pool closed since never moves or strands an attachment: DEL, CHECK,
//     GC and re-claim find it where it was allocated.

// modelDualIf is the interface the dual-stack network serves.
const modelDualIf = "net2"

// modelIfNames are the interfaces of the model's pods: two on the model's pool, one on the
// dual-stack network.
var modelIfNames = []string{"eth0", "net1", modelDualIf}

// modelDual is the dual-stack network: its configuration's pool (both families, never
// stored: the rule decides) and the pools its rule names, canonical and stored.
type modelDual struct {
	net           allocator.PoolSpec
	v4a, v4b, v6  allocator.PoolSpec
	v4aDropped    bool // the rule as written leaves v4a out (model_access_test.go)
	v4aOff, v6Off bool // closed
}

// modelDualPools returns the network and its pools: 2 IPv4 addresses in one /30 block, 13
// in two /29 blocks (for 24 owners: the first is full most of the time, both now and then),
// and 126 IPv6 addresses in 32 /126 blocks.
func modelDualPools() (net, v4a, v4b, v6 allocator.PoolSpec) {
	net = dualStack(etcdtest.Uniq("dn"), "10.78.9.0/24", "fd78:9::/64")
	v4a = rangePool(etcdtest.Uniq("d4a"), "10.78.0.0/24", "10.78.0.10", "10.78.0.11")
	v4a.Blocks = allocator.Blocks{IPv4: 30}
	v4b = rangePool(etcdtest.Uniq("d4b"), "10.78.1.0/24", "10.78.1.10", "10.78.1.22")
	v4b.Blocks = allocator.Blocks{IPv4: 29}
	v6 = allocator.PoolSpec{Name: etcdtest.Uniq("d6"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("fd78::/121")}}},
		Blocks: allocator.Blocks{IPv6: 126}}
	return net, v4a, v4b, v6
}

// startDual stores the dual network's pools and writes its rule: before any backup, so that
// every restore brings them back.
func (m *model) startDual() {
	net, v4a, v4b, v6 := modelDualPools()
	for _, p := range []*allocator.PoolSpec{&v4a, &v4b, &v6} {
		if err := p.Canonicalize(); err != nil {
			m.t.Fatal(err)
		}
		storePool(m.t, m.cli, *p, keyspace.PoolAccess{})
	}
	m.dual = modelDual{net: net, v4a: v4a, v4b: v4b, v6: v6}
	m.pools = append(m.pools, v4a, v4b, v6)
	if err := m.writeDualRule(context.Background(), false); err != nil {
		m.t.Fatal(err)
	}
}

// dualRule is the pools the dual network's rule names: the small IPv4 pool first, unless
// dropped.
func (m *model) dualRule(dropped bool) []string {
	if dropped {
		return []string{m.dual.v6.Name, m.dual.v4b.Name}
	}
	return []string{m.dual.v4a.Name, m.dual.v6.Name, m.dual.v4b.Name}
}

func (m *model) writeDualRule(ctx context.Context, dropped bool) error {
	return admin.SetNamespaceRule(ctx, m.cli, m.cluster, m.dual.net.Name, "ns", keyspace.NamespaceRule{Pools: m.dualRule(dropped)})
}

// isDual tells whether k is an attachment of the dual-stack network.
func isDual(k attKey) bool { return k.ifName == modelDualIf }

// netOf is the network k is on, and its configuration's pool.
func (m *model) netOf(k attKey) allocator.PoolSpec {
	if isDual(k) {
		return m.dual.net
	}
	return m.pool
}

// poolOf is the pool, canonical, whose ranges hold a: the pools' ranges do not overlap. An
// address of an attachment or key lies in one.
func (m *model) poolOf(a netip.Addr) allocator.PoolSpec {
	p, ok := m.poolHolding(a)
	if !ok {
		m.t.Errorf("%s lies in no pool of the model", a)
	}
	return p
}

// poolHolding is poolOf for any address: ok is false for one in no pool's ranges (m.spec).
func (m *model) poolHolding(a netip.Addr) (allocator.PoolSpec, bool) {
	for _, p := range m.pools {
		if _, ok := p.SetOf(a); ok {
			return p, true
		}
	}
	return m.spec, false
}

// poolOps reads, in one transaction, what prefix names in every pool of the model.
func (m *model) poolOps(prefix func(p allocator.PoolSpec) string, opts ...clientv3.OpOption) []clientv3.Op {
	ops := make([]clientv3.Op, len(m.pools))
	for i, p := range m.pools {
		ops[i] = clientv3.OpGet(prefix(p), append([]clientv3.OpOption{clientv3.WithPrefix()}, opts...)...)
	}
	return ops
}

// ownerKeyAt is the owner index of k's attachment in a's pool.
func (m *model) ownerKeyAt(k attKey, a netip.Addr) string {
	return keyspace.OwnerKey(m.cluster, k.owner, k.ifName, m.poolOf(a).Name)
}

// modelPart is the part of an attachment's addresses in one pool: one owner index, one
// conflict record.
type modelPart struct {
	pool               string
	ownerKey, conflict string
	ips                []netip.Addr
}

// partsOf splits k's addresses ips by pool, in the order of their first address.
func (m *model) partsOf(k attKey, ips []netip.Addr) []modelPart {
	var out []modelPart
	for _, a := range ips {
		name := m.poolOf(a).Name
		i := slices.IndexFunc(out, func(p modelPart) bool { return p.pool == name })
		if i < 0 {
			out = append(out, modelPart{pool: name, ownerKey: keyspace.OwnerKey(m.cluster, k.owner, k.ifName, name),
				conflict: keyspace.ConflictKey(m.cluster, k.owner, k.ifName, name)})
			i = len(out) - 1
		}
		out[i].ips = append(out[i].ips, a)
	}
	return out
}

// inPart keeps of as those in part's pool.
func (m *model) inPart(part modelPart, as []netip.Addr) []netip.Addr {
	return slices.DeleteFunc(slices.Clone(as), func(a netip.Addr) bool { return m.poolOf(a).Name != part.pool })
}

// poolNamesOf names the pools k may have attachments in: every pool of its network.
func (m *model) poolNamesOf(k attKey) []string {
	if isDual(k) {
		return []string{m.dual.v4a.Name, m.dual.v4b.Name, m.dual.v6.Name}
	}
	return []string{m.pool.Name}
}

// dualClosedToNew tells whether a new net2 attachment may get no address: its IPv6 pool is
// closed (the IPv4 list always has an open pool).
func (m *model) dualClosedToNew() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.dual.v6Off
}

// checkDualAdd checks the answer of an ADD of net2 attachment k (new unless have): served,
// one address of each family, each from a pool the rule names and that is open to new
// addresses (a new one), each listed by its pool's owner index; refused, no owner index or
// allocation of k in any pool, unless it had them. Right after a restore (repairing) etcd
// may hold what the backup brought back of an earlier k, and the owner indexes are being put
// back: the answer alone is checked then.
func (m *model) checkDualAdd(ctx context.Context, i int, k attKey, have bool, got []netip.Addr, err error) {
	m.mu.Lock()
	d, repairing := m.dual, m.repairing
	m.mu.Unlock()
	st := m.readState(ctx)
	if err != nil {
		if have || repairing {
			return // a repeated ADD refused: do says so
		}
		var left []string
		for _, pool := range m.poolNamesOf(k) {
			key := keyspace.OwnerKey(m.cluster, k.owner, k.ifName, pool)
			if ix, ok := st.owners[key]; ok {
				left = append(left, fmt.Sprintf("owner index %s %v", key, ix.rec.IPs))
			}
		}
		for a, al := range st.allocs {
			if al.rec.Owner == k.owner && al.rec.IfName == k.ifName {
				left = append(left, fmt.Sprintf("allocation %s in pool %s", a, m.poolOf(a).Name))
			}
		}
		if len(left) > 0 {
			m.t.Errorf("step %d: ADD of new %v was refused (%v), and etcd has %s: half an interface", i, k, err, strings.Join(left, ", "))
		}
		m.inc("dual refused")
		return
	}
	if len(got) != 2 || !got[0].Is4() || !got[1].Is6() {
		m.t.Errorf("step %d: ADD of %v answered %v, want an IPv4 and an IPv6 address, in that order", i, k, got)
		return
	}
	p4, p6 := m.poolOf(got[0]).Name, m.poolOf(got[1]).Name
	switch {
	case p6 != d.v6.Name || p4 != d.v4a.Name && p4 != d.v4b.Name:
		m.t.Errorf("step %d: ADD of %v got %v from pools %s and %s, not the rule's", i, k, got, p4, p6)
	case !have && !repairing && p4 == d.v4a.Name && (d.v4aOff || d.v4aDropped):
		m.t.Errorf("step %d: ADD of new %v got %s from pool %s, which is closed (%v) or left out of the rule (%v)",
			i, k, got[0], p4, d.v4aOff, d.v4aDropped)
	}
	if !have {
		m.inc("dual add")
		if p4 == d.v4b.Name && !d.v4aOff && !d.v4aDropped {
			m.inc("dual fallback") // the small pool was full
		}
	}
	for _, a := range got {
		key := m.ownerKeyAt(k, a)
		if ix, ok := st.owners[key]; !repairing && (!ok || !slices.Equal(ix.rec.IPs, []netip.Addr{a})) {
			m.t.Errorf("step %d: ADD of %v answered %v, and the owner index %s lists %v (present %v), want %s", i, k, got, key, ix.rec.IPs, ok, a)
		}
	}
}

// awaitRulesSeen waits until every live agent chooses by the dual network's rule and pools'
// access as last written: a change reaches the next ADD within one watch round-trip.
func (m *model) awaitRulesSeen(i int) {
	m.mu.Lock()
	d := m.dual
	m.mu.Unlock()
	want := m.dualRule(d.v4aDropped)
	deadline := time.Now().Add(etcdtest.Patience)
	for {
		var behind []string
		for _, n := range m.nodes {
			if n.agent == nil {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
			rules, _, pools, err := n.agent.rules.Choice(ctx, d.net.Name)
			cancel()
			switch {
			case err != nil:
				behind = append(behind, fmt.Sprintf("%s: %v", n.name, err))
			case !slices.Equal(rules.Namespaces["ns"].Pools, want) || pools[d.v4a.Name].Closed != d.v4aOff || pools[d.v6.Name].Closed != d.v6Off:
				behind = append(behind, fmt.Sprintf("%s: rule %v, %s closed %v, %s closed %v", n.name, rules.Namespaces["ns"].Pools,
					d.v4a.Name, pools[d.v4a.Name].Closed, d.v6.Name, pools[d.v6.Name].Closed))
			}
		}
		if len(behind) == 0 {
			return
		}
		if time.Now().After(deadline) {
			m.t.Errorf("step %d: %s after the dual network's rule (%v) or pools changed (v4a closed %v, v6 closed %v), agents choose by "+
				"older ones: %v", i, etcdtest.Patience, want, d.v4aOff, d.v6Off, behind)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// changeDual changes the dual network: its rule leaves the small IPv4 pool out or names it
// again, or the small IPv4 pool or the IPv6 pool is closed (reopen opens it). Chosen by the
// step number, as changeAccess's changes are.
func (m *model) changeDual(ctx context.Context, i int) (changed bool) {
	m.mu.Lock()
	was := m.dual
	m.mu.Unlock()
	now := was
	var err error
	switch (i / 4) % 3 {
	case 0:
		now.v4aDropped = !was.v4aDropped
		err = m.writeDualRule(ctx, now.v4aDropped)
	case 1:
		now.v4aOff = true
	default:
		now.v6Off = true
	}
	if now.v4aOff != was.v4aOff {
		_, _, _, err = admin.SetPoolAccess(ctx, m.cli, now.v4a.Name, func(a *keyspace.PoolAccess) { a.Closed = true })
	}
	if now.v6Off != was.v6Off {
		_, _, _, err = admin.SetPoolAccess(ctx, m.cli, now.v6.Name, func(a *keyspace.PoolAccess) { a.Closed = true })
	}
	if err != nil {
		m.t.Fatalf("step %d: change the dual network's rule or pools: %v", i, err)
	}
	if now.v4aDropped == was.v4aDropped && now.v4aOff == was.v4aOff && now.v6Off == was.v6Off {
		return false
	}
	m.mu.Lock()
	m.dual = now
	m.mu.Unlock()
	m.log("%d DUAL rule without %s: %v -> %v, %s closed: %v -> %v, %s closed: %v -> %v", i, was.v4a.Name, was.v4aDropped, now.v4aDropped,
		was.v4a.Name, was.v4aOff, now.v4aOff, was.v6.Name, was.v6Off, now.v6Off)
	return true
}

// reopenDual opens the dual network's closed pools.
func (m *model) reopenDual(ctx context.Context, i int) {
	m.mu.Lock()
	d := m.dual
	m.mu.Unlock()
	if !d.v4aOff && !d.v6Off {
		return
	}
	for _, p := range []allocator.PoolSpec{d.v4a, d.v6} {
		if _, _, _, err := admin.SetPoolAccess(ctx, m.cli, p.Name, func(a *keyspace.PoolAccess) { *a = keyspace.PoolAccess{} }); err != nil {
			m.t.Fatalf("step %d: open pool %s: %v", i, p.Name, err)
		}
	}
	m.mu.Lock()
	m.dual.v4aOff, m.dual.v6Off = false, false
	m.mu.Unlock()
	m.log("%d DUAL pools open", i)
}

// refusedDualClosed tells whether err is the refusal of a new net2 attachment while its IPv6
// pool is closed, naming it, and counts it.
func (m *model) refusedDualClosed(err error) bool {
	if !errors.Is(err, allocator.ErrInvalidConfig) || !m.dualClosedToNew() || !strings.Contains(err.Error(), m.dual.v6.Name) {
		return false
	}
	m.inc("add refused: pool closed")
	return true
}
