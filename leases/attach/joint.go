package attach

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/txn"
)

// part is one attachment of an interface whose families come from several pools: its pool,
// and the families it gives the interface (nil: every family of the pool).
type part struct {
	spec     allocator.PoolSpec
	families []int
}

// heads are the parts of an ADD that tries the idx[i]-th pool of each list of ch.split: a
// pool heading several lists is one attachment giving all their families.
func heads(ch chosen, idx []int) []part {
	var parts []part
	for i, list := range ch.split {
		spec := list[idx[i]]
		j := slices.IndexFunc(parts, func(p part) bool { return p.spec.Name == spec.Name })
		if j < 0 {
			parts = append(parts, part{spec: spec, families: []int{}})
			j = len(parts) - 1
		}
		if fams := ch.families[i]; fams == nil || parts[j].families == nil {
			parts[j].families = nil
		} else {
			parts[j].families = append(parts[j].families, fams...)
		}
	}
	return parts
}

// addSplit is an ADD whose address families come from different pools: ch.split[i] are the
// pools of the network's i-th family, in order. The first of each list is tried, all claimed
// in one transaction (addJoint); a full one passes its family, and only its family, to the
// next pool of its list.
func (x *Attachments) addSplit(ctx context.Context, req allocator.Request, ch chosen) (allocator.Result, error) {
	idx := make([]int, len(ch.split))
	var full []string
	for {
		parts := heads(ch, idx)
		res, failed, family, err := x.addJoint(ctx, req, parts)
		if failed < 0 || !errors.Is(err, allocator.ErrPoolExhausted) {
			for i, list := range ch.split {
				x.cfg.Metrics.Tried(list, idx[i], err)
			}
			return res, err
		}
		// The list whose family the full pool was to give passes it on.
		i := -1
		for j, list := range ch.split {
			if list[idx[j]].Name != parts[failed].spec.Name {
				continue
			}
			if ch.families[j] == nil || slices.Contains(ch.families[j], family) {
				i = j
				break
			}
			if i < 0 {
				i = j
			}
		}
		x.cfg.Metrics.Tried(ch.split[i], idx[i], err)
		full = append(full, parts[failed].spec.Name+": "+err.Error())
		if idx[i]++; idx[i] == len(ch.split[i]) {
			return allocator.Result{}, exhausted(full, ch.passed)
		}
	}
}

// addJoint is an ADD of one interface with an attachment in each of parts, giving each its
// families: all or none are claimed. failed is the index of the part whose pool refused the
// ADD as full, for want of an address of family, -1 for any other outcome. Requested
// addresses go to the part whose pool gives them (share); an ADD naming a sticky claim reads
// and takes it in every part's pool, a record per pool.
func (x *Attachments) addJoint(ctx context.Context, req allocator.Request, parts []part) (_ allocator.Result, failed, family int, _ error) {
	asked, err := x.share(ctx, req, parts)
	if err != nil {
		return allocator.Result{}, -1, 0, err
	}
	st, end, err := x.begin(ctx, req)
	if err != nil {
		return allocator.Result{}, -1, 0, err
	}
	defer end()
	// Each part's own state: its requested addresses, its claim, its view's lessons.
	sts := make([]*addState, len(parts))
	for i, pt := range parts {
		ps := *st
		ps.req.RequestedIPs, ps.families, ps.lost, ps.sticky = asked[i], pt.families, make(map[netip.Addr]bool), nil
		if req.Claim != "" {
			ps.sticky = x.cfg.Sticky(ps.req, st.owner)
			defer ps.sticky.Drop()
		}
		sts[i] = &ps
	}
	for attempt := range maxAddAttempts {
		if attempt > 0 {
			x.cfg.Metrics.Retried()
		}
		ps := make([]*poolview.Pool, len(parts))
		requested := make([][]netip.Addr, len(parts))
		for i, pt := range parts {
			if ps[i], err = x.ready(ctx, pt.spec, sts[i]); err != nil {
				return allocator.Result{}, -1, 0, err
			}
			if requested[i], err = ps[i].Spec.MatchRequested(sts[i].req.RequestedIPs); err != nil {
				return allocator.Result{}, -1, 0, err
			}
		}
		res, failed, family, done, err := x.tryJoint(ctx, ps, st, sts, requested)
		if done && err == nil {
			_ = x.journal.Sync(ctx) // as addIn's
		}
		if failed >= 0 && errors.Is(err, allocator.ErrPoolExhausted) {
			ps[failed].View.NoteExhausted()
			return res, failed, family, err
		}
		if done || err != nil {
			return res, -1, 0, err
		}
	}
	return allocator.Result{}, -1, 0, fmt.Errorf("%w: pools %s: gave up after %d transactions because other owners kept taking the "+
		"chosen addresses first; retry", allocator.ErrUnavailable, partNames(parts), maxAddAttempts)
}

// share gives each part the addresses req asks for that its pool has a range set of its
// families for. An address that no part's pool gives is refused (code 7), naming it.
func (x *Attachments) share(ctx context.Context, req allocator.Request, parts []part) ([][]netip.Addr, error) {
	asked := make([][]netip.Addr, len(parts))
	for _, ip := range req.RequestedIPs {
		in := -1
		for i, pt := range parts {
			p, err := x.pools.Ensure(ctx, pt.spec)
			if err != nil {
				return nil, err
			}
			if set, ok := p.Spec.SetOf(ip); ok && (pt.families == nil || slices.Contains(pt.families, p.Spec.Ranges[set].Family())) {
				in = i
				break
			}
		}
		if in < 0 {
			return nil, fmt.Errorf("%w: requested address %s is in none of the pools interface %s gets its addresses from (%s); "+
				"ask for an address of the pool that gives its family", allocator.ErrInvalidConfig, ip, req.IfName, partNames(parts))
		}
		asked[in] = append(asked[in], ip)
	}
	return asked, nil
}

// tryJoint runs one claim transaction of the parts ps (sts[i] the state of ps[i], requested[i]
// its addresses asked for, per range set), as tryAdd does one: the addresses of every part
// are chosen, then claimed as one queued claim (txn.Batcher.CommitJoint; with a sticky claim,
// alone: txn.CommitParts), whose refusal each part learns from. failed is the part whose
// choice failed, for want of an address of family, else -1.
func (x *Attachments) tryJoint(ctx context.Context, ps []*poolview.Pool, st *addState, sts []*addState,
	requested [][]netip.Addr) (_ allocator.Result, failed, family int, done bool, _ error) {
	req, owner := st.req, st.owner
	octx, cancel := x.opCtx(ctx)
	defer cancel()
	epoch := x.gate.Epoch()
	sticky := sts[0].sticky != nil

	lease, known := x.pods.Lease(owner)
	if known && !sticky && x.listsAll(ps, st) {
		return x.eachPart(ps, func(i int, p *poolview.Pool) (allocator.Result, bool, error) {
			return x.repeated(ctx, p, sts[i], lease)
		})
	}
	if !known {
		id, err := st.claims.Spare(octx)
		if err != nil {
			return allocator.Result{}, -1, 0, false, unavailable("grant pod lease", err)
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
		pk, stop, err := x.pick(ctx, octx, p, sts[i], requested[i])
		if stop || pk.existing != nil {
			settle()
			if pk.existing != nil {
				return allocator.Result{}, -1, 0, false, x.halfAttached(ps, st, p)
			}
			return allocator.Result{}, i, pk.full, false, err
		}
		picks[i] = pk
	}
	heldLease, held, err := x.HeldFor(octx, owner)
	if err != nil {
		settle()
		return allocator.Result{}, -1, 0, false, err
	}
	now := x.wall()
	claims := make([]*txn.Claim, len(ps))
	for i, p := range ps {
		addrs := picks[i].addrs
		claims[i] = &txn.Claim{Add: true, Lease: lease, Pool: p.Spec.Name, Blocks: p.Spec.Blocks, PoolRev: p.Rev, Addrs: addrs,
			HeldLease: heldLease, Held: held, NotHeld: picks[i].notHeld,
			OwnerKey: keyspace.OwnerKey(x.cfg.Cluster, owner, req.IfName, p.Spec.Name),
			Alloc:    x.Allocation(req, owner, lease, now), Index: x.OwnerRecord(req, addrs, lease, now)}
		if s := sts[i].sticky; s != nil {
			if s.Target() {
				// One transaction per migration, in one pool: an interface with addresses from
				// two pools is never a live migration's target.
				settle()
				return allocator.Result{}, -1, 0, false, fmt.Errorf("%w: claim %q is held by a live pod on another node; "+
					"an interface whose addresses come from two pools cannot be a live migration's target; give it one pool "+
					"with both families", allocator.ErrInvalidConfig, req.Claim)
			}
			if err := s.Claim(octx, claims[i], now); err != nil {
				settle()
				return allocator.Result{}, -1, 0, false, err
			}
		}
	}
	// The pod record goes with the first part: a transaction puts a key once.
	claims[0].PodKey, claims[0].NewPod = keyspace.PodKey(x.cfg.Cluster, x.cfg.Node, owner), !known
	claims[0].Pod = x.PodRecord(req, owner, lease, now)
	var outs []txn.ClaimOutcome
	_, again, err := st.claims.Commit(ctx, claims[0], func() (txn.ClaimOutcome, error) {
		start := time.Now()
		defer x.cfg.Metrics.RTT("claim", start)
		var err error
		if sticky {
			outs, err = txn.CommitParts(octx, x.cli, claims) // as tryAdd's sticky claim: alone
		} else {
			outs, err = x.batcher.CommitJoint(octx, claims)
		}
		if err != nil {
			return txn.ClaimOutcome{}, err
		}
		return outs[0], nil
	})
	if err != nil || again {
		settle()
		return allocator.Result{}, -1, 0, false, err
	}
	if outs[0].Applied && !sticky && x.gate.Epoch() != epoch {
		settle()
		for _, p := range ps {
			if err = x.undoClaim(ctx, st, known, lease, p.Spec.Name); !known {
				break // the lease revoked took every part
			}
		}
		return allocator.Result{}, -1, 0, false, err
	}
	if outs[0].Applied {
		var res allocator.Result
		ats := make([]podbook.Attachment, len(ps))
		for i, p := range ps {
			addrs := picks[i].addrs
			p.View.Settle(addrs, outs[i].Revision)
			ats[i] = podbook.Attachment{IfName: req.IfName, Pool: p.Spec.Name, Network: req.Network,
				ContainerID: req.ContainerID, IPs: addrs, Created: now, OwnerRev: outs[i].Revision}
			if s := sts[i].sticky; s != nil && s.Bound(&ats[i]) {
				x.cfg.Metrics.Handover()
				x.log.Info("claim handed over", "claim", ats[i].Claim, "owner", owner, "pool", p.Spec.Name, "ips", addrs)
			}
			r, err := Result(&p.Spec, addrs)
			if err != nil {
				return allocator.Result{}, -1, 0, false, err
			}
			res.IPs = append(res.IPs, r.IPs...)
		}
		x.loops.ClaimedOn(ctx, req, st.own, lease, ats...)
		st.claims.Bound()
		x.log.Debug("allocated from pools", "owner", owner, "container", req.ContainerID, "ifname", req.IfName,
			"pools", poolNames(specsOf(ps)), "ips", res.IPs)
		return res, -1, 0, true, nil
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
			return x.existing(ctx, p, sts[i], outs[i].Existing)
		})
	case found > 0:
		for i, out := range outs {
			if out.Existing != nil {
				return allocator.Result{}, -1, 0, false, x.halfAttached(ps, st, ps[i])
			}
		}
	}
	for i, p := range ps {
		if _, _, err := x.learn(ctx, p, sts[i], requested[i], lease, outs[i]); err != nil {
			return allocator.Result{}, -1, 0, false, err
		}
	}
	return allocator.Result{}, -1, 0, false, nil
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
func (x *Attachments) eachPart(ps []*poolview.Pool, answer func(i int, p *poolview.Pool) (allocator.Result, bool, error)) (allocator.Result, int, int, bool, error) {
	var res allocator.Result
	for i, p := range ps {
		r, done, err := answer(i, p)
		if !done || err != nil {
			return allocator.Result{}, -1, 0, done, err
		}
		res.IPs = append(res.IPs, r.IPs...)
	}
	return res, -1, 0, true, nil
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

func partNames(parts []part) string {
	specs := make([]allocator.PoolSpec, len(parts))
	for i, pt := range parts {
		specs[i] = pt.spec
	}
	return poolNames(specs)
}

func poolNames(specs []allocator.PoolSpec) string {
	names := make([]string, len(specs))
	for i, s := range specs {
		names[i] = s.Name
	}
	return strings.Join(names, " and ")
}
