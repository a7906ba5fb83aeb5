package attach

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/txn"
)

// addSplit is an ADD whose address families come from different pools: split[i] are the
// pools of the network's i-th family, in order. The first of each list is tried, all claimed
// in one transaction (addJoint); a full one passes its family, and only its family, to the
// next pool of its list.
func (x *Attachments) addSplit(ctx context.Context, req allocator.Request, ch chosen) (allocator.Result, error) {
	idx := make([]int, len(ch.split))
	var full []string
	for {
		parts := make([]allocator.PoolSpec, len(ch.split))
		for i, list := range ch.split {
			parts[i] = list[idx[i]]
		}
		res, failed, err := x.addJoint(ctx, req, parts)
		if failed < 0 || !errors.Is(err, allocator.ErrPoolExhausted) {
			for i, list := range ch.split {
				x.cfg.Metrics.Tried(list, idx[i], err)
			}
			return res, err
		}
		x.cfg.Metrics.Tried(ch.split[failed], idx[failed], err)
		full = append(full, parts[failed].Name+": "+err.Error())
		if idx[failed]++; idx[failed] == len(ch.split[failed]) {
			return allocator.Result{}, exhausted(full, ch.passed)
		}
	}
}

// addJoint is an ADD of one interface with an attachment in each of parts, pools of one
// family each: both or neither are claimed. failed is the index of the part whose pool
// refused the ADD as full, -1 for any other outcome.
func (x *Attachments) addJoint(ctx context.Context, req allocator.Request, parts []allocator.PoolSpec) (_ allocator.Result, failed int, _ error) {
	if req.Claim != "" || len(req.RequestedIPs) > 0 {
		return allocator.Result{}, -1, fmt.Errorf("%w: interface %s gets its addresses from pools %s: a sticky claim or requested "+
			"addresses with two pools for one interface are not supported; give the rule a pool with ranges of every family",
			allocator.ErrInvalidConfig, req.IfName, poolNames(parts))
	}
	st, end, err := x.begin(ctx, req)
	if err != nil {
		return allocator.Result{}, -1, err
	}
	defer end()
	for attempt := range maxAddAttempts {
		if attempt > 0 {
			x.cfg.Metrics.Retried()
		}
		ps := make([]*poolview.Pool, len(parts))
		for i, spec := range parts {
			if ps[i], err = x.ready(ctx, spec, st); err != nil {
				return allocator.Result{}, -1, err
			}
		}
		res, failed, done, err := x.tryJoint(ctx, ps, st)
		if done && err == nil {
			_ = x.journal.Sync(ctx) // as addIn's
		}
		if failed >= 0 && errors.Is(err, allocator.ErrPoolExhausted) {
			ps[failed].View.NoteExhausted()
			return res, failed, err
		}
		if done || err != nil {
			return res, -1, err
		}
	}
	return allocator.Result{}, -1, fmt.Errorf("%w: pools %s: gave up after %d transactions because other owners kept taking the "+
		"chosen addresses first; retry", allocator.ErrUnavailable, poolNames(parts), maxAddAttempts)
}

// tryJoint runs one claim transaction of the parts ps, as tryAdd does one: the addresses of
// every part are chosen, then claimed as one queued claim (txn.Batcher.CommitJoint), whose
// refusal each part learns from. failed is the part whose choice failed, else -1.
func (x *Attachments) tryJoint(ctx context.Context, ps []*poolview.Pool, st *addState) (_ allocator.Result, failed int, done bool, _ error) {
	req, owner := st.req, st.owner
	octx, cancel := x.opCtx(ctx)
	defer cancel()
	epoch := x.gate.Epoch()

	lease, known := x.pods.Lease(owner)
	if known && x.listsAll(ps, st) {
		return x.eachPart(ps, func(_ int, p *poolview.Pool) (allocator.Result, bool, error) { return x.repeated(ctx, p, st, lease) })
	}
	if !known {
		id, err := st.claims.Spare(octx)
		if err != nil {
			return allocator.Result{}, -1, false, unavailable("grant pod lease", err)
		}
		lease = id
	}
	picks := make([]picked, len(ps))
	settle := func() {
		for i, p := range ps {
			p.View.Settle(picks[i].reserved, 0)
		}
	}
	for i, p := range ps {
		pk, stop, err := x.pick(ctx, octx, p, st, make([]netip.Addr, len(p.Spec.Ranges)))
		if stop || pk.existing != nil {
			settle()
			if pk.existing != nil {
				return allocator.Result{}, -1, false, x.halfAttached(ps, st, p)
			}
			return allocator.Result{}, i, false, err
		}
		picks[i] = pk
	}
	heldLease, held, err := x.HeldFor(octx, owner)
	if err != nil {
		settle()
		return allocator.Result{}, -1, false, err
	}
	now := x.wall()
	claims := make([]*txn.Claim, len(ps))
	for i, p := range ps {
		addrs := picks[i].addrs
		claims[i] = &txn.Claim{Add: true, Lease: lease, Pool: p.Spec.Name, Blocks: p.Spec.Blocks, PoolRev: p.Rev, Addrs: addrs,
			HeldLease: heldLease, Held: held, NotHeld: picks[i].notHeld,
			OwnerKey: keyspace.OwnerKey(x.cfg.Cluster, owner, req.IfName, p.Spec.Name),
			Alloc:    x.Allocation(req, owner, lease, now), Index: x.OwnerRecord(req, addrs, lease, now)}
	}
	// The pod record goes with the first part: a transaction puts a key once.
	claims[0].PodKey, claims[0].NewPod = keyspace.PodKey(x.cfg.Cluster, x.cfg.Node, owner), !known
	claims[0].Pod = x.PodRecord(req, owner, lease, now)
	var outs []txn.ClaimOutcome
	_, again, err := st.claims.Commit(ctx, claims[0], func() (txn.ClaimOutcome, error) {
		start := time.Now()
		defer x.cfg.Metrics.RTT("claim", start)
		var err error
		if outs, err = x.batcher.CommitJoint(octx, claims); err != nil {
			return txn.ClaimOutcome{}, err
		}
		return outs[0], nil
	})
	if err != nil || again {
		settle()
		return allocator.Result{}, -1, false, err
	}
	if outs[0].Applied && x.gate.Epoch() != epoch {
		settle()
		for _, p := range ps {
			if err = x.undoClaim(ctx, st, known, lease, p.Spec.Name); !known {
				break // the lease revoked took every part
			}
		}
		return allocator.Result{}, -1, false, err
	}
	if outs[0].Applied {
		var res allocator.Result
		ats := make([]podbook.Attachment, len(ps))
		for i, p := range ps {
			addrs := picks[i].addrs
			p.View.Settle(addrs, outs[i].Revision)
			ats[i] = podbook.Attachment{IfName: req.IfName, Pool: p.Spec.Name, Network: req.Network,
				ContainerID: req.ContainerID, IPs: addrs, Created: now, OwnerRev: outs[i].Revision}
			r, err := Result(&p.Spec, addrs)
			if err != nil {
				return allocator.Result{}, -1, false, err
			}
			res.IPs = append(res.IPs, r.IPs...)
		}
		x.loops.ClaimedOn(ctx, req, st.own, lease, ats...)
		st.claims.Bound()
		x.log.Debug("allocated from pools", "owner", owner, "container", req.ContainerID, "ifname", req.IfName,
			"pools", poolNames(specsOf(ps)), "ips", res.IPs)
		return res, -1, true, nil
	}
	settle()
	found := 0
	for _, out := range outs {
		if out.Existing != nil {
			found++
		}
	}
	switch {
	case found == len(outs):
		return x.eachPart(ps, func(i int, p *poolview.Pool) (allocator.Result, bool, error) {
			return x.existing(ctx, p, st, outs[i].Existing)
		})
	case found > 0:
		for i, out := range outs {
			if out.Existing != nil {
				return allocator.Result{}, -1, false, x.halfAttached(ps, st, ps[i])
			}
		}
	}
	for i, p := range ps {
		if _, _, err := x.learn(ctx, p, st, make([]netip.Addr, len(p.Spec.Ranges)), lease, outs[i]); err != nil {
			return allocator.Result{}, -1, false, err
		}
	}
	return allocator.Result{}, -1, false, nil
}

// listsAll tells whether the pod book lists st's attachment in every pool of ps, for st's
// container: a repeated ADD.
func (x *Attachments) listsAll(ps []*poolview.Pool, st *addState) bool {
	for _, p := range ps {
		if at, _, ok := x.pods.Attachment(st.owner, st.req.IfName, p.Spec.Name); !ok || at.ContainerID != st.req.ContainerID {
			return false
		}
	}
	return true
}

// eachPart answers an ADD with what one of the answers (a repeated ADD's, an existing
// attachment's) gives in every part, merged in order.
func (x *Attachments) eachPart(ps []*poolview.Pool, answer func(i int, p *poolview.Pool) (allocator.Result, bool, error)) (allocator.Result, int, bool, error) {
	var res allocator.Result
	for i, p := range ps {
		r, done, err := answer(i, p)
		if !done || err != nil {
			return allocator.Result{}, -1, done, err
		}
		res.IPs = append(res.IPs, r.IPs...)
	}
	return res, -1, true, nil
}

// halfAttached is the error of an interface that has an attachment in pool p but not in all
// of ps: written by hand, or left by a DEL that released only one part.
func (x *Attachments) halfAttached(ps []*poolview.Pool, st *addState, p *poolview.Pool) error {
	return fmt.Errorf("%w: interface %s of owner %s has addresses in pool %s but not in all of %s; a DEL of the interface "+
		"releases them, and the ADD then claims every pool anew", allocator.ErrUnavailable, st.req.IfName, st.owner,
		p.Spec.Name, poolNames(specsOf(ps)))
}

func specsOf(ps []*poolview.Pool) []allocator.PoolSpec {
	out := make([]allocator.PoolSpec, len(ps))
	for i, p := range ps {
		out[i] = p.Spec
	}
	return out
}

func poolNames(specs []allocator.PoolSpec) string {
	names := make([]string, len(specs))
	for i, s := range specs {
		names[i] = s.Name
	}
	return strings.Join(names, " and ")
}
