package reclaim

import (
	"context"
	"net/netip"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/txn"
)

// heldByOthers reads the held keys of c's addresses and takes out of c those held back for
// another node's pod (its lease expired without a release, while it may run): a re-claim no
// more takes such an address than an ADD does; it is a conflict until that holder lets it go.
// It also returns the ModRevisions of those held keys, and the addresses with no held key at
// all: their hold ran out (the node was away longer than the reuse delay), and another pod
// may have had them meanwhile.
func (r *Reclaimer) heldByOthers(ctx context.Context, c *txn.Claim) (taken []keyspace.TakenByOther, holds map[netip.Addr]int64, unheld []netip.Addr, _ error) {
	ops := make([]clientv3.Op, len(c.Addrs))
	for i, ip := range c.Addrs {
		ops[i] = clientv3.OpGet(keyspace.HeldKey(c.Pool, c.Blocks, ip))
	}
	resp, err := r.cfg.Client.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, nil, nil, r.unavailable("read the held keys of "+c.OwnerKey, err)
	}
	holds = map[netip.Addr]int64{}
	var still []netip.Addr
	for i, ip := range c.Addrs {
		kvs := resp.Responses[i].GetResponseRange().Kvs
		if len(kvs) == 0 {
			still, unheld = append(still, ip), append(unheld, ip)
			continue
		}
		if r.cfg.MineBlockLease(clientv3.LeaseID(kvs[0].Lease)) {
			still = append(still, ip)
			continue
		}
		rec, _ := keyspace.Decode[keyspace.HeldRecord](string(kvs[0].Key), kvs[0].Value)
		if rec.Owner == c.Alloc.Owner && rec.Cluster == c.Alloc.Cluster && rec.Node == c.Alloc.Node {
			still = append(still, ip) // this pod's own, on a block lease of before a restart
			continue
		}
		taken = append(taken, keyspace.TakenByOther{IP: ip, Holder: rec.Owner, Cluster: rec.Cluster, Node: rec.Node})
		holds[ip] = kvs[0].ModRevision
	}
	c.Addrs = still
	return taken, holds, unheld, nil
}

// usedMeanwhile looks, for the addresses just re-claimed whose hold had run out (unheld),
// in etcd's history of their allocation keys between the attachment's last write and the
// re-claim (at rev): another owner that held one meanwhile, and let it go before the
// re-claim, ran with the same address as this pod. Nothing is to be done; it is logged as
// the conflict it was.
func (r *Reclaimer) usedMeanwhile(ctx context.Context, owner string, at podbook.Attachment, c *txn.Claim, unheld []netip.Addr, rev int64) {
	var look []netip.Addr
	for _, ip := range unheld {
		if slices.Contains(c.Addrs, ip) {
			look = append(look, ip)
		}
	}
	if taken, had := r.holdersBetween(ctx, owner, at, c, look, nil, rev); had > 0 {
		r.cfg.ConflictsFound(int64(had))
		r.logHeldMeanwhile(owner, at, c, taken)
	}
}

// heldBefore is usedMeanwhile for the addresses the re-claim found another owner holding
// (taken), in the background: an owner other than the one holding it now that had it and let
// it go meanwhile ran with this pod's address too (a node away across a restore, its hold
// gone). The record names only the holder now, which the address comes back from, and the
// address is counted once, as that conflict.
func (r *Reclaimer) heldBefore(owner string, at podbook.Attachment, c *txn.Claim, taken []keyspace.TakenByOther, rev int64) {
	if at.OwnerRev <= 0 || r.ctx.Err() != nil {
		return
	}
	look := make([]netip.Addr, 0, len(taken))
	now := make(map[netip.Addr]keyspace.TakenByOther, len(taken))
	for _, t := range taken {
		look, now[t.IP] = append(look, t.IP), t
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		if before, _ := r.holdersBetween(r.ctx, owner, at, c, look, now, rev); len(before) > 0 {
			r.logHeldMeanwhile(owner, at, c, before)
		}
	}()
}

// holdersBetween reads etcd's history of the allocation key of each of addrs between the
// attachment's last write and rev: the owners other than owner that held it, less the one
// holding it now (now, if named there). had counts the addresses with any such owner. A
// history etcd no longer has is logged.
func (r *Reclaimer) holdersBetween(ctx context.Context, owner string, at podbook.Attachment, c *txn.Claim, addrs []netip.Addr,
	now map[netip.Addr]keyspace.TakenByOther, rev int64) (taken []keyspace.TakenByOther, had int) {
	if at.OwnerRev <= 0 {
		return nil, 0
	}
	for _, ip := range addrs {
		others, known := r.OthersSince(ctx, owner, keyspace.IPKey(c.Pool, c.Blocks, ip), ip, at.OwnerRev, rev, time.Time{})
		if !known {
			r.cfg.Log.Warn("the hold of an address ran out while this node was away, and etcd's history no longer tells "+
				"whether another pod had it meanwhile", "owner", owner, "ip", ip, "pool", c.Pool)
		}
		n := len(taken)
		for _, o := range others {
			if t, ok := now[ip]; !ok || o.Holder != t.Holder || o.Cluster != t.Cluster {
				taken = append(taken, o)
			}
		}
		if len(taken) > n {
			had++
		}
	}
	return taken, had
}

// logHeldMeanwhile logs owners that held this pod's addresses and let them go before the
// re-claim.
func (r *Reclaimer) logHeldMeanwhile(owner string, at podbook.Attachment, c *txn.Claim, taken []keyspace.TakenByOther) {
	r.cfg.Log.Error("CONFLICT: addresses of a running pod were held by another owner while its node was away longer than "+
		"the reuse delay; they were let go before the re-claim", "owner", owner, "ifname", at.IfName, "pool", c.Pool, "taken", taken)
}

// historyIdle is how long OthersSince waits, once a watch of a key's history is created,
// for an event after the last: etcd sends a watch's past events at once (its sync loop runs
// every 100 ms), so a quiet second means the history is all there. A miss costs a conflict
// not logged, never an address.
const historyIdle = time.Second

// OthersSince reads etcd's history of the allocation key of ip from revision from+1 up to to
// (exclusive; 0: up to now), or up to its last event before a quiet historyIdle: the owners other than owner that held the address, since owner
// last did (an owner writing it again resets the list: who had it before was dealt with
// then). known is false when the history was compacted away or could not be read.
func (r *Reclaimer) OthersSince(ctx context.Context, owner, key string, ip netip.Addr, from, to int64, before time.Time) (taken []keyspace.TakenByOther, known bool) {
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	// Past the gate: a history compacted away is an answer here, not a sign of a restore.
	wch := r.cfg.Gate.History(clientv3.WithRequireLeader(octx), key, clientv3.WithRev(from+1), clientv3.WithFilterDelete(),
		clientv3.WithCreatedNotify())
	idle := time.NewTimer(historyIdle)
	defer idle.Stop()
	created := false
	for {
		var resp clientv3.WatchResponse
		var ok bool
		select {
		case resp, ok = <-wch:
		case <-idle.C:
			if created {
				return taken, true
			}
			idle.Reset(historyIdle)
			continue
		}
		if !ok || resp.CompactRevision != 0 || resp.Err() != nil {
			return nil, false
		}
		created = created || resp.Created
		idle.Reset(historyIdle)
		for _, ev := range resp.Events {
			if to > 0 && ev.Kv.ModRevision >= to {
				return taken, true
			}
			holder, err := keyspace.Decode[keyspace.Allocation](key, ev.Kv.Value)
			switch {
			case err != nil:
			case holder.Owner == owner:
				taken = taken[:0]
			case !before.IsZero() && !holder.Created.Before(before):
			default:
				taken = append(taken, keyspace.TakenByOther{IP: ip, Holder: holder.Owner, Cluster: holder.Cluster,
					Node: holder.Node, ContainerID: holder.ContainerID})
			}
		}
	}
}

// keepHeld puts back the held keys a block lease of this node took with it when etcd no
// longer had it (HeldLost, from the agent's blockLeaseLost: a lease a restore brought back, taken up again, that
// expired or was revoked; one revoked by hand). Only a claim writes a held key, and a pod
// whose lease is held is not claimed again: without this, its addresses would be free for
// any ADD as soon as its lease expires in a cut-off, not the reuse delay after (invariants 12
// and 14). Each address of a pod whose lease the agent holds, but its conflicts and the
// attachments being released, gets a held key on the current block lease if it has none and
// its allocation is still on the pod's lease (a DEL since deletes both).
func (r *Reclaimer) keepHeld(ctx context.Context) error {
	if r.cfg.ReuseDelay <= 0 {
		return nil
	}
	type addrKeys struct{ owner, ipKey, heldKey string }
	var all []addrKeys
	leases := map[string]clientv3.LeaseID{}
	for lease, owner := range r.cfg.Pods.LeaseOwners() {
		ps, ok := r.cfg.Pods.Snapshot(owner)
		if !ok {
			continue
		}
		leases[owner] = lease
		for _, at := range ps.Attachments {
			if at.Released {
				continue
			}
			p, err := r.cfg.Pools.Ensure(ctx, allocator.PoolSpec{Name: at.Pool})
			if err != nil {
				return err
			}
			for _, ip := range at.IPs {
				if !slices.Contains(at.Conflicts, ip) {
					all = append(all, addrKeys{owner, keyspace.IPKey(at.Pool, p.Spec.Blocks, ip), keyspace.HeldKey(at.Pool, p.Spec.Blocks, ip)})
				}
			}
		}
	}
	var ops []clientv3.Op
	var put []string
	for len(all) > 0 {
		chunk := all[:min(len(all), keyspace.MaxTxnOps)]
		all = all[len(chunk):]
		gets := make([]clientv3.Op, len(chunk))
		for i, a := range chunk {
			gets[i] = clientv3.OpGet(a.heldKey, clientv3.WithKeysOnly())
		}
		octx, cancel := r.opCtx(ctx)
		resp, err := r.cfg.Client.Txn(octx).Then(gets...).Commit()
		cancel()
		if err != nil {
			return r.unavailable("read the held keys of this node's pods", err)
		}
		for i, a := range chunk {
			if len(resp.Responses[i].GetResponseRange().Kvs) > 0 {
				continue
			}
			heldLease, held, err := r.cfg.HeldFor(ctx, a.owner)
			if err != nil {
				return err
			}
			ops = append(ops, clientv3.OpTxn(
				[]clientv3.Cmp{keyspace.OnLease(a.ipKey, leases[a.owner]), keyspace.Absent(a.heldKey)},
				[]clientv3.Op{clientv3.OpPut(a.heldKey, keyspace.Encode(held), clientv3.WithLease(heldLease))}, nil))
			put = append(put, a.heldKey)
		}
	}
	var back []string
	for len(ops) > 0 {
		n := min(len(ops), keyspace.MaxTxnOps/2)
		octx, cancel := r.opCtx(ctx)
		resp, err := r.cfg.Client.Txn(octx).Then(ops[:n]...).Commit()
		cancel()
		if err != nil {
			return r.unavailable("put back the held keys of this node's pods", err)
		}
		for i, rr := range resp.Responses {
			if rr.GetResponseTxn().GetSucceeded() {
				back = append(back, put[i])
			}
		}
		ops, put = ops[n:], put[n:]
	}
	if len(back) > 0 {
		r.cfg.Log.Warn("held keys of running pods were gone with a block lease of this node; put back", "keys", back)
	}
	return nil
}
