package leases

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/selection"
)

// Add allocates one address from every range set of a pool for the attachment (container ID
// + interface), or returns the addresses it already has. The pool is the one the selection
// rules, the pod's request or the network configuration give (choosePools); a full one
// passes the ADD to the next of the list. All addresses, the owner index and the pod record
// are created in one transaction on the pod's lease, guarded by create-if-absent on every
// address, its quarantine key and the owner index.
//
// Errors wrap allocator.ErrInvalidConfig or ErrInvalidName (bad request, or no pool the pod
// may use), ErrPoolMismatch, ErrNotInRange or ErrAddressInUse (requested addresses),
// ErrPoolExhausted (no free address in any pool of the list; also ErrOnlyQuarantined when
// only resting addresses are free), or ErrUnavailable (etcd unreachable, or the owner's keys
// are held by another node identity until they expire).
func (a *Agent) Add(ctx context.Context, req allocator.Request) (_ allocator.Result, err error) {
	defer a.metrics.observe("add", time.Now(), &err)
	owner, err := a.validate(&req)
	if err != nil {
		return allocator.Result{}, err
	}
	pools, passed, err := a.choosePools(ctx, req, owner)
	if err != nil {
		return allocator.Result{}, err
	}
	var full []string
	for i, spec := range pools {
		r := req
		r.Pool = spec
		res, err := a.addIn(ctx, r)
		a.metrics.tried(pools, i, err)
		if !errors.Is(err, allocator.ErrPoolExhausted) || len(pools) == 1 && len(passed) == 0 {
			return res, err
		}
		full = append(full, spec.Name+": "+err.Error())
	}
	for _, p := range passed {
		full = append(full, p.String())
	}
	return allocator.Result{}, fmt.Errorf("%w: no pool the pod may use has a free address; tried in order: %s", allocator.ErrPoolExhausted,
		strings.Join(full, "; "))
}

// choosePools returns the pools an ADD tries, in order. An interface that has an attachment
// on this network already keeps its pool, whatever the rules say now: a repeated ADD returns
// its addresses. Otherwise the selection rules, the pod's request and the pools' access
// decide (package selection); with no rule, no request and the configuration's pool open to
// all, that pool alone, as before rules existed.
//
// Each pool tried gives every address family the network needs: an interface's IPv4 and
// IPv6 from two pools (two attachments in one transaction) is not built yet, and is refused
// naming the pools.
func (a *Agent) choosePools(ctx context.Context, req allocator.Request, owner string) ([]allocator.PoolSpec, []selection.Passed, error) {
	if ps, ok := a.pods.Snapshot(owner); ok {
		for _, at := range ps.Attachments {
			if at.IfName == req.IfName && at.Network == req.Network && !at.Released {
				if at.Pool == req.Pool.Name {
					return []allocator.PoolSpec{req.Pool}, nil, nil
				}
				return []allocator.PoolSpec{{Name: at.Pool}}, nil, nil
			}
		}
	}
	octx, cancel := a.opCtx(ctx)
	rules, any, pools, err := a.rules.Choice(octx, req.Network)
	cancel()
	if err != nil {
		return nil, nil, fmt.Errorf("%w: the selection rules are not read yet: %w", allocator.ErrUnavailable, err)
	}
	dflt, stored := pools[req.Pool.Name]
	if !any && len(req.Pools) == 0 && (!stored || !dflt.Closed && len(dflt.Namespaces) == 0) {
		return []allocator.PoolSpec{req.Pool}, nil, nil
	}
	if !stored {
		if len(req.Pool.Ranges) == 0 {
			return []allocator.PoolSpec{req.Pool}, nil, nil // the ADD says the pool is not defined
		}
		dflt = selection.PoolOf(req.Pool, keyspace.PoolAccess{})
		dflt.Unstored = true
		pools[req.Pool.Name] = dflt
	}
	c, err := selection.Choose(rules, pools, selection.Node{Name: a.cfg.Node, Labels: a.cfg.NodeLabels},
		selection.Pod{Namespace: req.Pod.Namespace, Name: req.Pod.Name, Asked: req.Pools}, req.Pool.Name, dflt.Families)
	if err != nil {
		return nil, nil, err
	}
	var out []allocator.PoolSpec
	for _, name := range c.Pools {
		if !servesAll(pools[name], dflt.Families) {
			continue
		}
		if name == req.Pool.Name {
			out = append(out, req.Pool)
		} else {
			out = append(out, allocator.PoolSpec{Name: name})
		}
	}
	if len(out) == 0 {
		return nil, nil, fmt.Errorf("%w: %s gives IPv%d and IPv%d from different pools (%v); one interface's addresses from two "+
			"pools are not supported yet: give the rule a pool with ranges of both families", allocator.ErrInvalidConfig,
			c.Source, dflt.Families[0], dflt.Families[len(dflt.Families)-1], c.PerFamily)
	}
	return out, c.Passed, nil
}

// attachedPool is the pool of the interface's attachment on req's network as the pod book
// has it, for a DEL or CHECK: selection may have put it in another pool than the
// configuration names, and a rule changed since never moves it. Unknown to the book: the
// configuration's pool.
func (a *Agent) attachedPool(owner string, req allocator.Request) allocator.PoolSpec {
	if ps, ok := a.pods.Snapshot(owner); ok {
		for _, at := range ps.Attachments {
			if at.IfName == req.IfName && at.Network == req.Network && at.Pool != req.Pool.Name {
				if slices.ContainsFunc(ps.Attachments, func(o attachment) bool { return o.IfName == req.IfName && o.Pool == req.Pool.Name }) {
					break // the configuration's pool has one too
				}
				return allocator.PoolSpec{Name: at.Pool}
			}
		}
	}
	return req.Pool
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
func (a *Agent) closedTo(p *poolview.Pool, st *addState) error {
	acc := p.Access
	locked := len(acc.Namespaces) > 0 && !slices.Contains(acc.Namespaces, st.req.Pod.Namespace)
	if !acc.Closed && !locked {
		return nil
	}
	if a.pods.Lists(st.owner, st.req.IfName, p.Spec.Name, st.req.ContainerID) || st.sticky != nil && st.sticky.rev > 0 {
		return nil
	}
	why := "is closed to new addresses (leaseholdctl pool open " + p.Spec.Name + " opens it)"
	if !acc.Closed {
		why = fmt.Sprintf("is locked to namespaces %s, not %q", strings.Join(acc.Namespaces, ", "), st.req.Pod.Namespace)
	}
	return fmt.Errorf("%w: pool %s %s", allocator.ErrInvalidConfig, p.Spec.Name, why)
}
