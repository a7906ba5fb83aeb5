package attach

import (
	"context"
	"errors"
	"fmt"
	"maps"
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
// When no pool gives every family the network needs, each family comes from its own list
// (addSplit), in one transaction.
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
// order; or, when none does, split: per family of the network, in the network's order, the
// pools giving it, in order. passed are the pools of the list passed over.
type chosen struct {
	pools  []allocator.PoolSpec
	split  [][]allocator.PoolSpec
	passed []selection.Passed
}

// choosePools returns the pools an ADD tries. An interface that has attachments on this
// network already (an imported one's under its container ID) keeps their pools, whatever the rules say now: a repeated ADD returns its
// addresses. Otherwise the selection rules, the pod's request and the pools' access decide
// (package selection); with no rule, no request and the configuration's pool open to all,
// that pool alone, as before rules existed.
//
// A pool with range sets of every family the network needs is preferred; only when the list
// has none does each family take its own pool (two attachments in one transaction).
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
		var mine [][]allocator.PoolSpec
		for _, at := range ps.Attachments {
			if at.IfName == req.IfName && at.Network == req.Network && !at.Released {
				mine = append(mine, []allocator.PoolSpec{specOf(at.Pool)})
			}
		}
		if len(mine) == 1 {
			return chosen{pools: mine[0]}, nil
		}
		if len(mine) > 1 {
			return chosen{split: mine}, nil
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
	if req.Claim != "" && (any || len(pools) > 1 || stored && (dflt.Closed || len(dflt.Namespaces) > 0)) {
		// A sticky claim is found where it was made, as an attachment is: the rules of
		// that time chose its pool, and a claim with addresses gets them back there,
		// closed or locked (its addresses are not new: the ADD's claim checks that).
		name, err := x.claimedPool(ctx, req, pools)
		if err != nil {
			return chosen{}, err
		}
		if name != "" {
			return one(specOf(name))
		}
	}
	if !any && len(req.Pools) == 0 && (!stored || !dflt.Closed && len(dflt.Namespaces) == 0) {
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
	out := chosen{passed: c.Passed}
	for _, name := range c.Pools {
		if servesAll(pools[name], dflt.Families) {
			out.pools = append(out.pools, specOf(name))
		}
	}
	if len(out.pools) == 0 {
		for _, f := range dflt.Families {
			var list []allocator.PoolSpec
			for _, name := range c.PerFamily[f] {
				list = append(list, specOf(name))
			}
			out.split = append(out.split, list)
		}
	}
	return out, nil
}

// claimedPool returns the pool where the sticky claim req names was made, "" if none: the
// pool configured, else the first by name among the others the agent knows (a claim is made
// in one pool; two are the work of rules changed between two incarnations that both found
// none). Its claim keys are read in one transaction per keyspace.MaxTxnOps pools.
func (x *Attachments) claimedPool(ctx context.Context, req allocator.Request, pools map[string]selection.Pool) (string, error) {
	names := []string{req.Pool.Name}
	for _, name := range slices.Sorted(maps.Keys(pools)) {
		if name != req.Pool.Name {
			names = append(names, name)
		}
	}
	for chunk := range slices.Chunk(names, keyspace.MaxTxnOps) {
		ops := make([]clientv3.Op, len(chunk))
		for i, name := range chunk {
			ops[i] = clientv3.OpGet(keyspace.ClaimKey(x.cfg.Cluster, name, req.Claim), clientv3.WithCountOnly())
		}
		octx, cancel := x.opCtx(ctx)
		resp, err := x.cli.Txn(octx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return "", unavailable("read where claim "+req.Claim+" was made", err)
		}
		for i, r := range resp.Responses {
			if r.GetResponseRange().Count > 0 {
				return chunk[i], nil
			}
		}
	}
	return "", nil
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
