package admin

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// checker holds one state read, indexed by key, and the findings so far. Every check reads
// the same revision, so a finding is never an ADD or DEL seen half-way: each writes all its
// keys in one transaction.
type checker struct {
	st        *State
	pools     map[string]PoolEntry
	allocs    map[string]*AllocationEntry   // by key
	byAddr    map[poolAddr]*AllocationEntry // by pool and address, the key in the pool's layout first
	pods      map[string]*PodEntry
	conflicts map[string]*ConflictEntry
	podSeen   map[string]bool
	// ownerMissing are the addresses owner-index-without-allocation reported, with the owner
	// whose index names them, and the index in out of that finding: their held keys are not
	// expired.
	ownerMissing map[ownerAddr]int
	// heldTold is, by held key without allocation, the index in out of the finding that tells
	// of its address (heldKeys); byHeld the same findings once all are in (HeldFindings).
	heldTold map[string]int
	byHeld   map[string]Finding
	// leasedOwners are the readable owner indexes on a lease by the pod record key of their
	// owner and node (the first of each), built when first needed (podRuns).
	leasedOwners map[string]*OwnerEntry
	// heldAt are the readable held keys by address, built when first needed (heldFor).
	heldAt map[poolAddr][]*HeldEntry
	// ownerKeys are the owner index keys the state read.
	ownerKeys map[string]bool
	// now and bound are the time the migrations' ages are taken at and the age above which
	// one is too old (CheckOptions).
	now   time.Time
	bound time.Duration
	out   []Finding
}

// ownerAddr is one address of one pool as named by one owner.
type ownerAddr struct {
	poolAddr
	cluster, owner string
}

// poolAddr is one address of one pool, whatever the layout of its key.
type poolAddr struct {
	pool string
	ip   netip.Addr
}

// Check runs every invariant check of ARCHITECTURE.md over st, one state read at one revision,
// and returns each finding with its severity and the command that fixes it, sorted by kind and
// key. Errors and warnings are problems (Finding.Problem); info findings describe a state that
// passes by itself or a step to take. A check relating two key families runs only where st
// read both (State.Covers), so a narrow ReadKeys reports nothing absent that it did not read.
func Check(st *State) []Finding { return check(st, CheckOptions{}).out }

// CheckOptions tune CheckWith.
type CheckOptions struct {
	// LiveMigrationBound is the age above which a live migration is reported as too old
	// (live-migration-too-old); 0 is DefaultLiveMigrationBound.
	LiveMigrationBound time.Duration
	// Now is the time ages are taken at; zero is time.Now().
	Now time.Time
}

// CheckWith is Check with options: leaseholdctl doctor --live-migration-bound.
func CheckWith(st *State, opt CheckOptions) []Finding { return check(st, opt).out }

// HeldFindings runs Check over st and returns, by held key, the finding that tells of the
// address of each held key without allocation (State.Expired): owner-index-without-allocation
// or running-pod-address-missing, errors, when its pod still runs, so etcd lost the pod's keys
// (Finding.KeysLost); address-expired, information, when no key of the pod is left. Held keys
// without lease or unreadable are left out (Check reports them as such). leaseholdctl alloc
// show and pool show tell an address the way doctor does with it.
func HeldFindings(st *State) map[string]Finding { return check(st, CheckOptions{}).byHeld }

// KeysLost reports whether f tells of addresses a running pod uses that etcd no longer holds
// for it: the pod's agent puts them back (AgentPutsBack), they are not expired.
func (f Finding) KeysLost() bool { return f.Kind == KindOwnerNoAlloc || f.Kind == KindPodAddrMissing }

func check(st *State, opt CheckOptions) *checker {
	if opt.LiveMigrationBound <= 0 {
		opt.LiveMigrationBound = DefaultLiveMigrationBound
	}
	if opt.Now.IsZero() {
		opt.Now = time.Now()
	}
	c := &checker{st: st, pools: map[string]PoolEntry{}, allocs: map[string]*AllocationEntry{}, byAddr: map[poolAddr]*AllocationEntry{},
		pods: map[string]*PodEntry{}, conflicts: map[string]*ConflictEntry{}, podSeen: map[string]bool{},
		ownerMissing: map[ownerAddr]int{}, heldTold: map[string]int{}, byHeld: map[string]Finding{}, ownerKeys: map[string]bool{},
		now: opt.Now, bound: opt.LiveMigrationBound}
	for _, o := range st.Owners {
		c.ownerKeys[o.Key] = true
	}
	for _, p := range st.Pools {
		c.pools[p.Name] = p
	}
	for i := range st.Allocations {
		a := &st.Allocations[i]
		c.allocs[a.Key] = a
		k := poolAddr{a.Pool, a.IP}
		if prev := c.byAddr[k]; prev == nil || prev.Block != c.blocksOf(a.Pool).Of(a.IP) {
			c.byAddr[k] = a
		}
	}
	for i := range st.Pods {
		c.pods[st.Pods[i].Key] = &st.Pods[i]
	}
	for i := range st.Conflicts {
		c.conflicts[st.Conflicts[i].Key] = &st.Conflicts[i]
	}
	for _, b := range st.BadKeys {
		c.add(KindBadKey, "", "malformed key: "+b.Reason+"; no leasehold component reads it", delFix(b.Key), b.Key)
	}
	c.poolDefs()
	c.allocations()
	for i := range st.Owners {
		c.owner(&st.Owners[i])
	}
	c.podRecords()
	c.leasedRecords()
	c.duplicates()
	c.poolLayouts()
	c.blockClaims()
	c.keyLayouts()
	c.unclaimedBlocks()
	c.heldKeys()
	c.claims()
	c.liveMigrations()
	c.selectionRules()
	for k, i := range c.heldTold {
		c.byHeld[k] = c.out[i]
	}
	sortFindings(c.out)
	return c
}

// add reports an error: a broken invariant.
func (c *checker) add(kind, cluster, msg, fix string, keys ...string) {
	c.note(SeverityError, kind, cluster, msg, fix, keys...)
}

func (c *checker) note(severity, kind, cluster, msg, fix string, keys ...string) {
	c.out = append(c.out, Finding{Kind: kind, Severity: severity, Keys: keys, Cluster: cluster, Message: msg, Fix: fix})
}

// blocksOf is the layout pool's keys must have: its stored definition's, or, without a usable
// one, allocator.DefaultBlocks (what the pool-undefined fix, leaseholdctl pool create, stores).
func (c *checker) blocksOf(pool string) allocator.Blocks {
	if p, ok := c.pools[pool]; ok && p.Usable() {
		return p.Value.Blocks
	}
	return allocator.DefaultBlocks
}

// allocAt is the allocation of ip in pool, in whichever layout its key is.
func (c *checker) allocAt(pool string, ip netip.Addr) *AllocationEntry {
	return c.byAddr[poolAddr{pool, ip}]
}

// ipKey is the key ip's allocation in pool belongs at.
func (c *checker) ipKey(pool string, ip netip.Addr) string {
	return keyspace.IPKey(pool, c.blocksOf(pool), ip)
}

const recreatePool = "; the next ADD of a network whose configuration lists the pool's ranges stores them again, or define it with leaseholdctl pool create"

func (c *checker) poolDefs() {
	for _, p := range c.st.Pools {
		switch {
		case p.Unreadable != "":
			c.add(KindUnreadable, "", "pool definition is unreadable ("+p.Unreadable+"): every ADD of the pool fails. Delete it"+recreatePool, delFix(p.Key), p.Key)
		case p.Invalid != "":
			c.add(KindPoolInvalid, "", "pool definition is invalid ("+p.Invalid+"): every ADD of the pool fails. Delete it"+recreatePool, delFix(p.Key), p.Key)
		case p.Lease != 0:
			c.add(KindPoolOnLease, "", fmt.Sprintf("pool definition is bound to lease %s: when the lease ends the definition goes with it. Write it again without a lease",
				keyspace.LeaseHex(p.Lease)), putFix(p.Key, p.Raw, 0, modGuard(p.Key, p.ModRevision)), p.Key)
		}
	}
}

// ownerKeyOf returns the owner index key of a's attachment, or "" when a names no valid one.
func (c *checker) ownerKeyOf(a *AllocationEntry) string {
	for _, n := range []string{a.Cluster, a.Owner, a.IfName} {
		if allocator.ValidateName("name", n) != nil {
			return ""
		}
	}
	return keyspace.OwnerKey(a.Cluster, a.Owner, a.IfName, a.Pool)
}

func (c *checker) allocations() {
	owners := map[string]*OwnerEntry{}
	for i := range c.st.Owners {
		owners[c.st.Owners[i].Key] = &c.st.Owners[i]
	}
	undefined := map[string][]*AllocationEntry{}
	for i := range c.st.Allocations {
		a := &c.st.Allocations[i]
		if a.Unreadable != "" {
			c.add(KindUnreadable, "", fmt.Sprintf("allocation value is unreadable (%s): nobody can tell who holds %s, and no DEL releases it",
				a.Unreadable, a.IP), releaseFix(a.IP, a.Pool, a.BoundLease), a.Key)
			continue
		}
		ok := c.ownerKeyOf(a)
		o := owners[ok]
		names := o != nil && o.Unreadable == "" && slices.Contains(o.Value.IPs, a.IP)
		who := fmt.Sprintf("%s in pool %s (owner %s, pod %s, node %s)", a.IP, a.Pool, dash(a.Owner), podName(a.Pod), dash(a.Node))
		var other *OwnerEntry // the interface's owner index in another pool, when this pool's is gone
		if o == nil && ok != "" {
			other = c.otherHalf(a)
		}
		switch {
		case a.BoundLease == 0 && names && o.Lease != 0:
			c.add(KindNoLease, a.Cluster, fmt.Sprintf("allocation of %s has no lease (written with a plain etcdctl put?), so it never expires; "+
				"its owner index is on lease %s: put it back on that lease", who, keyspace.LeaseHex(o.Lease)),
				putFix(a.Key, a.Raw, o.Lease, modGuard(a.Key, a.ModRevision)), a.Key, o.Key)
		case a.BoundLease == 0:
			c.add(KindNoLease, a.Cluster, fmt.Sprintf("allocation of %s has no lease (written with a plain etcdctl put?) and no owner index on a "+
				"lease names it: it never expires and no DEL releases it", who), releaseFix(a.IP, a.Pool, 0), a.Key)
		case other != nil:
			c.halfAttached(a, ok, other)
		case !names:
			why := "there is no owner index " + ok
			if ok == "" {
				why = "its cluster, owner or interface is not a valid name"
			} else if o != nil {
				why = "owner index " + ok + " does not name it"
			}
			c.add(KindOrphan, a.Cluster, fmt.Sprintf("%s is named by no owner index (%s), so the pod's DEL never releases it; it leaves only "+
				"with lease %s, which the agent renews while the pod runs. Release it once the pod is gone", who, why, a.Lease),
				releaseFix(a.IP, a.Pool, a.BoundLease), a.Key)
		case o.Lease != 0 && o.Lease != a.BoundLease:
			c.add(KindLeaseMismatch, a.Cluster, fmt.Sprintf("allocation of %s is on lease %s but its owner index on lease %s: when one lease "+
				"ends, half the attachment stays. Put the allocation on the owner index's lease", who, a.Lease, keyspace.LeaseHex(o.Lease)),
				putFix(a.Key, a.Raw, o.Lease, modGuard(a.Key, a.ModRevision)), a.Key, o.Key)
		}
		p, defined := c.pools[a.Pool]
		switch {
		case !defined:
			undefined[a.Pool] = append(undefined[a.Pool], a)
		case p.Unreadable == "" && p.Invalid == "" && p.Value.Allocatable(a.IP) != nil:
			c.add(KindOutOfRange, a.Cluster, fmt.Sprintf("%s: %s, so the pool would never hand it out. Release it and recreate the pod "+
				"(or, if a range was removed by mistake, add it back with leaseholdctl pool add-range)", who, rangeProblem(p.Value, a.IP)),
				releaseFix(a.IP, a.Pool, a.BoundLease), a.Key)
		}
	}
	for _, pool := range slices.Sorted(maps.Keys(undefined)) {
		list := undefined[pool]
		keys := make([]string, len(list))
		cover := map[int][2]netip.Addr{}
		for i, a := range list {
			keys[i] = a.Key
			b, ok := cover[a.IP.BitLen()]
			if !ok || a.IP.Less(b[0]) {
				b[0] = a.IP
			}
			if !ok || b[1].Less(a.IP) {
				b[1] = a.IP
			}
			cover[a.IP.BitLen()] = b
		}
		fix := "leaseholdctl pool create " + pool
		for _, bits := range []int{32, 128} {
			if b, ok := cover[bits]; ok {
				fix += " --range " + covering(b[0], b[1]).String()
			}
		}
		fix += blockFlags(list)
		c.add(KindPoolUndefined, "", fmt.Sprintf("%d allocation(s) of pool %s, which has no definition (%s): an ADD naming the pool without "+
			"ranges fails. Define it with the ranges of the network's CNI configuration; the fix uses the smallest prefixes covering "+
			"the held addresses", len(list), pool, keyspace.PoolKey(pool)), fix, keys...)
	}
}

// rangeProblem says why spec does not hand out ip.
func rangeProblem(spec allocator.PoolSpec, ip netip.Addr) string {
	if r, ok := spec.GatewayOf(ip); ok {
		return "it is the gateway of range " + r.String()
	}
	if x, ok := spec.ExcludedBy(ip); ok {
		return "it is excluded by " + x.String()
	}
	return "it lies in no range of the pool (" + spec.String() + ")"
}

// covering is the smallest prefix holding lo and hi, at most /24 (IPv4) or /64 (IPv6): the
// subnet most networks use, a starting point for the configuration's real ranges.
func covering(lo, hi netip.Addr) netip.Prefix {
	bits := 24
	if lo.Is6() {
		bits = 64
	}
	for ; bits > 0; bits-- {
		if p := netip.PrefixFrom(lo, bits).Masked(); p.Contains(hi) {
			return p
		}
	}
	return netip.PrefixFrom(lo, 0).Masked()
}

// sameAttachment reports whether a names o's attachment.
func sameAttachment(a *AllocationEntry, o *OwnerEntry) bool {
	return a.Unreadable == "" && a.Cluster == o.Cluster && a.Owner == o.Owner && a.IfName == o.IfName
}

// podRef is the pod behind o, from its pod record or one of its allocations.
func (c *checker) podRef(o *OwnerEntry) allocator.PodRef {
	if allocator.ValidateName("node", o.Value.Node) == nil {
		if p := c.pods[keyspace.PodKey(o.Cluster, o.Value.Node, o.Owner)]; p != nil && p.Unreadable == "" && p.Value.Pod.Name != "" {
			return p.Value.Pod
		}
	}
	for _, ip := range o.Value.IPs {
		if a := c.allocAt(o.Pool, ip); a != nil && sameAttachment(a, o) && a.Pod.Name != "" {
			return a.Pod
		}
	}
	return allocator.PodRef{}
}
