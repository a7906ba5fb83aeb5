package release

import (
	"context"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/podbook"
)

// ReportTakenAtDel logs, as a conflict, the addresses of a deleted attachment that another
// owner held since the attachment was last written (etcd's history): its lease was lost, and another pod got them while this one still
// ran (the window ARCHITECTURE.md names). The DEL ends the overlap; the record says it
// happened. It runs in the background: reading a history takes a second, which neither the
// DEL nor the recovery of the node's other pods waits for.
// Only owners that had an address before the DEL count: the history is read up to the
// revision of this call (after it, a conflict resolution or this node's next pods may take
// the address), and of those, for a DEL answered while etcd was away, only allocations
// created before its answer.
func (r *Releaser) ReportTakenAtDel(ctx context.Context, owner string, at podbook.Attachment) {
	if len(at.IPs) == 0 || at.OwnerRev <= 0 || r.Ctx.Err() != nil {
		return
	}
	if at.ReleasedAt.IsZero() {
		at.ReleasedAt = time.Now()
	}
	octx, cancel := r.opCtx(ctx)
	resp, err := r.Cli.Get(octx, keyspace.PoolKey(at.Pool), clientv3.WithKeysOnly())
	cancel()
	if err != nil {
		return
	}
	upTo := resp.Header.Revision + 1
	r.Go(func() { r.takenAtDel(r.Ctx, owner, at, upTo) })
}

// takenAtDel is ReportTakenAtDel's history read, up to revision upTo.
func (r *Releaser) takenAtDel(ctx context.Context, owner string, at podbook.Attachment, upTo int64) {
	blocks, err := r.Pools.BlocksOf(ctx, at.Pool)
	if err != nil {
		return
	}
	var taken []keyspace.TakenByOther
	for _, ip := range at.IPs {
		key := keyspace.IPKey(at.Pool, blocks, ip)
		others, known := r.OthersSince(ctx, owner, key, ip, at.OwnerRev, upTo, at.ReleasedAt)
		if !known {
			// A compaction (or a restore marked compacted) took the history, not the key: one
			// that holds the address now and got it before the release had it while this pod ran.
			others = r.holderBefore(ctx, owner, key, ip, at.ReleasedAt)
			r.Log.Warn("a pod whose lease was lost is deleted, and etcd's history no longer tells whether another pod had "+
				"its address meanwhile", "owner", owner, "ip", ip, "pool", at.Pool, "holder_now", len(others) > 0)
		}
		taken = append(taken, others...)
	}
	if len(taken) == 0 {
		return
	}
	r.Metrics.Conflicts(int64(len(taken)))
	r.Log.Error("CONFLICT: addresses of a pod were taken by another owner while its lease was lost; found at its DEL",
		"owner", owner, "ifname", at.IfName, "pool", at.Pool, "taken", taken)
}

// holderBefore reads the allocation key of ip as it is now: another owner holding it that
// got it before the time before (its allocation's Created) held it at that time. A failed
// read reports nobody: a miss costs a conflict not logged, never an address.
func (r *Releaser) holderBefore(ctx context.Context, owner, key string, ip netip.Addr, before time.Time) []keyspace.TakenByOther {
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	resp, err := r.Cli.Get(octx, key)
	if err != nil || len(resp.Kvs) == 0 {
		return nil
	}
	holder, err := keyspace.Decode[keyspace.Allocation](key, resp.Kvs[0].Value)
	if err != nil || holder.Owner == owner || !holder.Created.Before(before) {
		return nil
	}
	return []keyspace.TakenByOther{{IP: ip, Holder: holder.Owner, Cluster: holder.Cluster, Node: holder.Node, ContainerID: holder.ContainerID}}
}
