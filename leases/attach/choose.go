package attach

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/selection"
)

// Add is an ADD (the agent's Add, whose doc names its errors): it validates req, chooses the
// pools it may try (choosePools) and passes the ADD from a full one to the next of the list.
// When a pool of the list lacks a family the network needs, each family comes from its own
// list (addSplit), in one transaction.
func (x *Attachments) Add(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	owner, err := x.cfg.Validate(&req)
	if err != nil {
		return allocator.Result{}, err
	}
	ch, err := x.choosePools(ctx, req, owner)
	if err != nil {
		return allocator.Result{}, err
	}
	if len(ch.split) > 0 {
		return x.addSplit(ctx, req, ch)
	}
	pools, passed := ch.pools, ch.passed
	var full []string
	for i, spec := range pools {
		r := req
		r.Pool = spec
		res, err := x.addIn(ctx, r)
		x.cfg.Metrics.Tried(pools, i, err)
		if !errors.Is(err, allocator.ErrPoolExhausted) || len(pools) == 1 && len(passed) == 0 {
			return res, err
		}
		full = append(full, spec.Name+": "+err.Error())
	}
	return allocator.Result{}, exhausted(full, passed)
}

// exhausted is the answer of an ADD that found every pool it tried full (full: each with
// why) and passed over the others.
func exhausted(full []string, passed []selection.Passed) error {
	for _, p := range passed {
		full = append(full, p.String())
	}
	return fmt.Errorf("%w: no pool the pod may use has a free address; tried in order: %s", allocator.ErrPoolExhausted,
		strings.Join(full, "; "))
}

// chosen is the pools an ADD tries: pools, each giving every family the network needs, in
// order; or, when a pool of the list lacks one, split: per family of the network, in the
// network's order, the pools giving it, in order, families[i] being the families split[i]
// gives (nil: every family of its pools). passed are the pools of the list passed over.
type chosen struct {
	pools    []allocator.PoolSpec
	split    [][]allocator.PoolSpec
	families [][]int
	passed   []selection.Passed
}

// choosePools returns the pools an ADD tries. An interface that has attachments on this
// network already (an imported one's under its container ID) keeps their pools, whatever the rules say now: a repeated ADD returns its
// addresses. Otherwise the selection rules, the pod's request and the pools' access decide
// (package selection); with no rule, no request and the configuration's pool open to all,
// that pool alone, as before rules existed.
//
// A list whose pools each have range sets of every family the network needs is tried pool
// by pool; a list with a pool lacking one, per family (addSplit: an attachment per pool, in
// one transaction). A sticky claim made per family, in two pools, is found in both; a family
// whose record is gone takes its pool by the rules, as a new claim does.
func (x *Attachments) choosePools(ctx context.Context, req allocator.Request, owner string) (chosen, error) {
	specOf := func(name string) allocator.PoolSpec {
		if name == req.Pool.Name {
			return req.Pool
		}
		return allocator.PoolSpec{Name: name}
	}
	// An imported container's attachments are kept under its container ID (as begin finds
	// them): its repeated ADD keeps the pool the import put them in.
	if ps, ok := x.pods.Snapshot(x.cfg.AttachmentOwner(req, owner)); ok {
		var mine chosen
		for _, at := range ps.Attachments {
			if at.IfName == req.IfName && at.Network == req.Network && !at.Released {
				mine.split = append(mine.split, []allocator.PoolSpec{specOf(at.Pool)})
				mine.families = append(mine.families, familiesOf(at.IPs))
			}
		}
		if len(mine.split) == 1 {
			return chosen{pools: mine.split[0]}, nil
		}
		if len(mine.split) > 1 {
			return mine, nil
		}
	}
	one := func(spec allocator.PoolSpec) (chosen, error) { return chosen{pools: []allocator.PoolSpec{spec}}, nil }
	octx, cancel := x.opCtx(ctx)
	rules, any, pools, err := x.rules.Choice(octx, req.Network)
	cancel()
	if err != nil {
		return chosen{}, fmt.Errorf("%w: the selection rules are not read yet: %w", allocator.ErrUnavailable, err)
	}
	dflt, stored := pools[req.Pool.Name]
	families := dflt.Families
	if !stored {
		families = selection.PoolOf(req.Pool, keyspace.PoolAccess{}).Families
	}
	var claimed map[int]string // a family's pool where the sticky claim was made
	if req.Claim != "" && (any || len(pools) > 1 || stored && (dflt.Closed || len(dflt.Namespaces) > 0)) {
		// A sticky claim is found where it was made, as an attachment is: the rules of
		// that time chose its pool, and a claim with addresses gets them back there,
		// closed or locked (its addresses are not new: the ADD's claim checks that).
		found, err := x.claimedPools(ctx, req, pools)
		if err != nil {
			return chosen{}, err
		}
		var whole string
		whole, claimed = claimedFamilies(found, families)
		if whole != "" {
			return one(specOf(whole))
		}
		if len(claimed) > 0 && len(claimed) == len(families) {
			var out chosen
			for _, f := range families {
				out.split = append(out.split, []allocator.PoolSpec{specOf(claimed[f])})
				out.families = append(out.families, []int{f})
			}
			return out, nil
		}
	}
	if !any && len(req.Pools) == 0 && (!stored || !dflt.Closed && len(dflt.Namespaces) == 0) && len(claimed) == 0 {
		return one(req.Pool)
	}
	if !stored {
		if len(req.Pool.Ranges) == 0 {
			return one(req.Pool) // the ADD says the pool is not defined
		}
		dflt = selection.PoolOf(req.Pool, keyspace.PoolAccess{})
		dflt.Unstored = true
		pools = maps.Clone(pools) // the follower's, shared with other ADDs
		pools[req.Pool.Name] = dflt
	}
	node := selection.Node{Name: x.cfg.Node, Labels: x.cfg.NodeLabels}
	pod := selection.Pod{Namespace: req.Pod.Namespace, Name: req.Pod.Name, Asked: req.Pools}
	c, err := selection.Choose(rules, pools, node, pod, req.Pool.Name, dflt.Families)
	if limited := accessLimited(pools); (err != nil || len(c.Passed) > 0) && len(limited) > 0 {
		// A refusal, or a pool passed over, by a closed or locked pool is judged by what
		// etcd says now: one opened a moment ago is open to this ADD.
		octx, cancel := x.opCtx(ctx)
		fresh, rerr := x.rules.Reread(octx, limited)
		cancel()
		if rerr != nil {
			return chosen{}, unavailable("read pools "+strings.Join(limited, ", "), rerr)
		}
		if stored {
			pools = maps.Clone(pools) // else cloned above
		}
		for _, name := range limited {
			if p, ok := fresh[name]; ok {
				pools[name] = p
			} else if name != req.Pool.Name || !dflt.Unstored {
				delete(pools, name)
			}
		}
		c, err = selection.Choose(rules, pools, node, pod, req.Pool.Name, dflt.Families)
	}
	if err != nil {
		return chosen{}, err
	}
	// A list of pools that each give every family is tried pool by pool. A list with a
	// pool that lacks one (selection's Split), and a claim found for some families only, are
	// tried per family: each family takes the first pool of its list, a pool heading several
	// families' lists giving them in one attachment.
	out := chosen{passed: c.Passed}
	if !c.Split && len(claimed) == 0 {
		for _, name := range c.Pools {
			if servesAll(pools[name], dflt.Families) {
				out.pools = append(out.pools, specOf(name))
			}
		}
		return out, nil
	}
	for _, f := range dflt.Families {
		var list []allocator.PoolSpec
		if name, ok := claimed[f]; ok {
			list = []allocator.PoolSpec{specOf(name)} // the claim's family stays where it was made
		} else {
			for _, name := range c.PerFamily[f] {
				list = append(list, specOf(name))
			}
		}
		out.split = append(out.split, list)
		out.families = append(out.families, []int{f})
	}
	return out, nil
}

// familiesOf are the address families of addrs, in order.
func familiesOf(addrs []netip.Addr) []int {
	var out []int
	for _, a := range addrs {
		f := 4
		if a.Is6() && !a.Is4In6() {
			f = 6
		}
		if !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

// claim is a sticky claim's record found in pool: families are those of its addresses
// (nil: it has none).
type claim struct {
	pool     string
	families []int
}

// claimedPools returns the pools where the sticky claim req names was made, in order: the
// pool configured, then the others the agent knows by name (a claim is made in one pool, or
// one per family when the interface's families came from two pools; more are the work of
// rules changed between two incarnations that both found none). Its claim keys are read in
// one transaction per keyspace.MaxTxnOps pools.
func (x *Attachments) claimedPools(ctx context.Context, req allocator.Request, pools map[string]selection.Pool) ([]claim, error) {
	names := []string{req.Pool.Name}
	for _, name := range slices.Sorted(maps.Keys(pools)) {
		if name != req.Pool.Name {
			names = append(names, name)
		}
	}
	var found []claim
	for chunk := range slices.Chunk(names, keyspace.MaxTxnOps) {
		ops := make([]clientv3.Op, len(chunk))
		for i, name := range chunk {
			ops[i] = clientv3.OpGet(keyspace.ClaimKey(x.cfg.Cluster, name, req.Claim))
		}
		octx, cancel := x.opCtx(ctx)
		resp, err := x.cli.Txn(octx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return nil, unavailable("read where claim "+req.Claim+" was made", err)
		}
		for i, r := range resp.Responses {
			if kvs := r.GetResponseRange().Kvs; len(kvs) > 0 {
				rec, _ := keyspace.Decode[keyspace.ClaimRecord](string(kvs[0].Key), kvs[0].Value)
				found = append(found, claim{pool: chunk[i], families: familiesOf(rec.IPs)})
			}
		}
	}
	return found, nil
}

// claimedFamilies says where the claims found give the families a network needs: whole, the
// first pool whose claim gives them all (or, for one family, the first found); else, per
// family, the first pool whose claim gives it. A family no claim gives (its record deleted
// by hand, or never made) is missing from the map: its pool is chosen as for a new claim.
func claimedFamilies(found []claim, families []int) (whole string, byFamily map[int]string) {
	if len(found) > 0 && len(families) < 2 {
		return found[0].pool, nil
	}
	for _, c := range found {
		if c.families == nil || !slices.ContainsFunc(families, func(f int) bool { return !slices.Contains(c.families, f) }) {
			return c.pool, nil
		}
	}
	byFamily = map[int]string{}
	for _, f := range families {
		for _, c := range found {
			if slices.Contains(c.families, f) {
				byFamily[f] = c.pool
				break
			}
		}
	}
	return "", byFamily
}

// accessLimited names the pools closed, or locked to some namespaces, in pools, in order.
func accessLimited(pools map[string]selection.Pool) []string {
	var out []string
	for _, name := range slices.Sorted(maps.Keys(pools)) {
		if p := pools[name]; p.Closed || len(p.Namespaces) > 0 {
			out = append(out, name)
		}
	}
	return out
}

// servesAll tells whether pool p has a range set of every family.
func servesAll(p selection.Pool, families []int) bool {
	for _, f := range families {
		if !slices.Contains(p.Families, f) {
			return false
		}
	}
	return true
}

// closedTo refuses new addresses from a pool closed, or locked to other namespaces, since
// the ADD chose it: the claim compares the definition read, so one closed after that read is
// read again and refused here. The attachment's own addresses are not new: a repeated ADD
// (the pod book lists the attachment) and a sticky claim returning its addresses go on.
func (x *Attachments) closedTo(p *poolview.Pool, st *addState) error {
	acc := p.Access
	locked := len(acc.Namespaces) > 0 && !slices.Contains(acc.Namespaces, st.req.Pod.Namespace)
	if !acc.Closed && !locked {
		return nil
	}
	if x.pods.Lists(st.owner, st.req.IfName, p.Spec.Name, st.req.ContainerID) || st.sticky != nil && st.sticky.Returning() {
		return nil
	}
	why := "is closed to new addresses (leaseholdctl pool open " + p.Spec.Name + " opens it)"
	if !acc.Closed {
		why = fmt.Sprintf("is locked to namespaces %s, not %q", strings.Join(acc.Namespaces, ", "), st.req.Pod.Namespace)
	}
	return fmt.Errorf("%w: pool %s %s", allocator.ErrInvalidConfig, p.Spec.Name, why)
}
