package attach

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/claimloop"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/txn"
)

// undoClaim gives back what a claim took when etcd went back in time between the choice of
// its addresses and its answer: they were chosen from what the agent knew of the history the
// restore undid, where a block or an address another node's pod holds (its key gone with the
// backup) looked free. A new pod's lease is revoked with every key on it; an attachment of a
// known pod is released. The ADD fails with code 11, and is tried again once the agent has
// repaired (leases/restorehold).
func (x *Attachments) undoClaim(ctx context.Context, st *addState, known bool, lease clientv3.LeaseID, pool string) error {
	var err error
	if known {
		req := st.req
		req.Pool = allocator.PoolSpec{Name: pool}
		_, err = x.cfg.ReleaseAttachment(ctx, req, st.own)
	} else {
		err = x.keeper.Revoke(lease)
		st.claims.Bound() // revoked: neither the owner's nor a spare
	}
	x.log.Warn("etcd went back in time while an ADD chose its addresses; what it claimed is given back",
		"owner", st.owner, "container", st.req.ContainerID, "pool", pool, "err", err)
	if err != nil {
		return unavailable("give back a claim made across etcd going back in time", err)
	}
	return fmt.Errorf("%w: etcd went back in time while this ADD chose its addresses; retry once this node has "+
		"re-claimed its pods", allocator.ErrUnavailable)
}

// waitUnanswered waits before the next attempt of an ADD whose etcd request went unanswered
// (err), 50 ms doubling; after maxUnanswered of them, or when ctx ends, it returns err.
func (x *Attachments) waitUnanswered(ctx context.Context, st *addState, owner string, err error) error {
	st.unanswered++
	if st.unanswered > maxUnanswered || ctx.Err() != nil {
		return err
	}
	if x.gate.SilentFor() > x.cfg.ProbeAfter && x.cfg.Reachable(ctx) != nil {
		return err // not an election but a cut-off: say so now, not after the plugin's timeout
	}
	x.log.Warn("etcd did not answer; trying again", "owner", owner, "attempt", st.unanswered, "err", err)
	select {
	case <-ctx.Done():
		return err
	case <-time.After(50 * time.Millisecond << (st.unanswered - 1)):
	}
	return nil
}

// addPolicy is what a claim etcd refused or did not answer means to the ADD st (the claim
// loop, leases/claimloop). A known pod's lease that is gone takes the pod's keys with it: the pod
// is queued for re-claim, and the runtime's retry finds it re-claimed. Any other refusal (the
// NOSPACE alarm, a missing permission, too many requests) is the ADD's answer, naming the
// cause. An unanswered claim is sent again after a wait (waitUnanswered).
func (x *Attachments) addPolicy(st *addState) claimloop.Policy {
	return claimloop.Policy{
		OwnLeaseGone: func(lease clientv3.LeaseID, _ error) error {
			x.keeper.Forget(lease)
			x.cfg.LeaseLost(lease)
			return fmt.Errorf("%w: the lease %s of owner %s is gone from etcd, and its addresses with it; "+
				"they are being re-claimed: retry", allocator.ErrUnavailable, keyspace.LeaseHex(lease), st.owner)
		},
		Refused: func(err error) error {
			if txn.NoSpace(err) {
				return fmt.Errorf("%w: etcd is out of space (its NOSPACE alarm is raised) and takes no new "+
					"allocation until an operator frees space (etcdctl compact, defrag, alarm disarm): %w", allocator.ErrUnavailable, err)
			}
			return unavailable("etcd refused the claim", err)
		},
		Unanswered: func(ctx context.Context, err error) error {
			return x.waitUnanswered(ctx, st, st.owner, unavailable("claim addresses", err))
		},
	}
}

// learn acts on what a failed claim found: the attachment may exist already (an idempotent
// ADD), the pool definition may have changed, the pod record may not be where the agent
// thought, or some addresses were taken. It returns done=false for the caller to try again.
func (x *Attachments) learn(ctx context.Context, p *poolview.Pool, st *addState, requested []netip.Addr,
	lease clientv3.LeaseID, out txn.ClaimOutcome) (allocator.Result, bool, error) {
	if out.Existing != nil {
		return x.existing(ctx, p, st, out.Existing)
	}
	if out.PoolChanged {
		x.pools.Invalidate(p.Spec.Name)
		return allocator.Result{}, false, nil
	}
	if s := st.sticky; s != nil && s.Found(out) {
		// The claim moved, or its addresses were taken, since the ADD read it: read it again
		// (and wait, if another holder has them). A new claim's addresses are the view's
		// choice: taken ones are learned below as for any ADD, or the view chooses them again.
		return allocator.Result{}, false, nil
	}
	switch out.Pod {
	case txn.PodExists:
		// The pod has keys on another interface already, from before this agent's memory.
		if err := x.ResumePod(ctx, st.own, out.PodKV); err != nil {
			return allocator.Result{}, false, err
		}
		return allocator.Result{}, false, nil
	case txn.PodGone, txn.PodMoved:
		// The lease this agent holds for the pod no longer carries its pod record: deleted or
		// changed by hand, or lost with a restored backup. The pod's other attachments run:
		// they are re-claimed, as the audit would, before this ADD adds to them.
		p := podbook.AuditPod{Owner: st.owner, Lease: lease}
		if err := x.cfg.KeysLost(ctx, p, []string{keyspace.PodKey(x.cfg.Cluster, x.cfg.Node, st.owner) + ": missing or on another lease"}); err != nil {
			return allocator.Result{}, false, err
		}
		x.cfg.Wake()
		return allocator.Result{}, false, fmt.Errorf("%w: the pod record of %s was gone from etcd; its addresses are being "+
			"re-claimed: retry", allocator.ErrUnavailable, st.owner)
	}
	for i, f := range out.Addrs {
		if !f.Taken() {
			continue
		}
		st.lost[f.Addr] = true
		wanted := requested[i] == f.Addr
		if f.Host != nil {
			p.View.MarkHost(string(f.Host.Key), f.Addr)
			if wanted {
				return allocator.Result{}, false, fmt.Errorf("%w: %s is a host address: %s publishes it as its own, so no pool hands it out",
					allocator.ErrAddressInUse, f.Addr, f.Host.Key)
			}
		}
		if f.Holder != nil {
			if p.View.MarkAllocated(f.Addr, f.Holder.CreateRevision) {
				// Borrowed from a snapshot that others' ADDs have made stale: near
				// exhaustion each of its addresses may be taken, so read the pool again
				// rather than try them one by one; again after rereadEvery more losses,
				// when every node's borrowers compete for the last addresses.
				if st.borrowLost%rereadEvery == 0 {
					p.View.StaleSnapshot()
				}
				st.borrowLost++
			}
			if !wanted {
				p.View.Scatter(&p.Spec, i)
			} else {
				holder, _ := keyspace.Decode[keyspace.Allocation](string(f.Holder.Key), f.Holder.Value)
				return allocator.Result{}, false, fmt.Errorf("%w: %s in pool %q is held by owner %s (pod %s/%s, cluster %s, node %s, container %s)",
					allocator.ErrAddressInUse, f.Addr, p.Spec.Name, holder.Owner, holder.Pod.Namespace, holder.Pod.Name,
					holder.Cluster, holder.Node, holder.ContainerID)
			}
		}
		if f.Held != nil && f.Holder == nil {
			// Held back for a holder that expired without a release, though the view or
			// snapshot took it for free: the search passes it over from now on.
			p.View.MarkHeld(f.Addr, clientv3.LeaseID(f.Held.Lease))
			if x.cfg.MineBlockLease(clientv3.LeaseID(f.Held.Lease)) {
				x.cfg.Wake() // this node's own held key no pod of it lists: settleHeld frees it
			}
		}
		if f.Wanted != nil && f.Holder == nil {
			// A running pod wants it back: in use, as far as this view goes, until an event
			// or a listing says otherwise.
			p.View.MarkAllocated(f.Addr, f.Wanted.CreateRevision)
			if wanted {
				return allocator.Result{}, false, fmt.Errorf("%w: %s in pool %q is wanted back by the running pod %s, whose "+
					"address another owner took while its lease was lost", allocator.ErrAddressInUse, f.Addr, p.Spec.Name, f.Wanted.Key)
			}
		}
		if f.Quarantine != nil {
			rec, _ := keyspace.Decode[keyspace.QuarantineRecord](string(f.Quarantine.Key), f.Quarantine.Value)
			p.View.MarkQuarantined(f.Addr, rec.Until)
			if wanted && rec.Claim != "" {
				// A claim's address rests under it while its holder runs, and for the hold after.
				return allocator.Result{}, false, fmt.Errorf("%w: %s in pool %q is sticky claim %q's: only an ADD naming that "+
					"claim takes it before the claim's hold runs out (leaseholdctl claim show %s)",
					allocator.ErrAddressInUse, f.Addr, p.Spec.Name, rec.Claim, rec.Claim)
			}
			if wanted {
				return allocator.Result{}, false, fmt.Errorf("%w: %s in pool %q rests in quarantine until %s after its release by %s",
					allocator.ErrAddressInUse, f.Addr, p.Spec.Name, rec.Until.Format(time.RFC3339), rec.ReleasedBy)
			}
		}
	}
	return allocator.Result{}, false, nil
}

func ownerKeyOf(x *Attachments, st *addState, p *poolview.Pool) string {
	return keyspace.OwnerKey(x.cfg.Cluster, st.owner, st.req.IfName, p.Spec.Name)
}

// recheck reads, in one transaction, an attachment's owner index (nil when there is none),
// whether the pool's stored definition changed since p was read, and whether p's view holds
// more allocated or resting addresses than etcd does: then the view is stale in a way its
// watches did not report (etcd's data replaced), and must be listed again before the ADD may
// say that no address is free.
func (x *Attachments) recheck(ctx context.Context, ownerKey string, p *poolview.Pool) (kv *mvccpb.KeyValue, changed, stale bool, err error) {
	allocated, quarantined, ipPrefixes, qPrefixes := p.View.Counts()
	ops := []clientv3.Op{clientv3.OpGet(ownerKey), clientv3.OpGet(keyspace.PoolKey(p.Spec.Name), clientv3.WithKeysOnly())}
	for _, prefix := range append(ipPrefixes, qPrefixes...) {
		ops = append(ops, clientv3.OpGet(prefix, clientv3.WithPrefix(), clientv3.WithCountOnly()))
	}
	resps, _, err := poolview.ReadChunked(ctx, x.cli, ops)
	if err != nil {
		return nil, false, false, unavailable("read "+ownerKey, err)
	}
	if kvs := resps[0].GetResponseRange().Kvs; len(kvs) > 0 {
		kv = kvs[0]
	}
	pools := resps[1].GetResponseRange().Kvs
	changed = len(pools) == 0 || pools[0].ModRevision != p.Rev
	var inEtcd [2]int64
	for i := range ipPrefixes {
		inEtcd[0] += resps[2+i].GetResponseRange().Count
		inEtcd[1] += resps[2+len(ipPrefixes)+i].GetResponseRange().Count
	}
	stale = inEtcd[0] < int64(allocated) || inEtcd[1] < int64(quarantined)
	return kv, changed, stale, nil
}
