package audit

import (
	"context"
	"net/netip"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/leasehold/leasehold/internal/pause"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/poolview"
)

// OwnKeys hears from the views of changes to this node's pods' allocations in its own blocks
// that the agent did not make: a delete no release explains (after the view's own check of
// releases it knows of), or a put without a lease or with another node identity's value.
// The audit would find them within its interval; a view sees them at once, and in a full
// pool another node may take an address whose key is missing (the reuse order) within that
// interval. Its methods run under the view's lock: they never block, and a queue that is full
// makes a whole audit due instead.
type OwnKeys struct {
	cluster, nodeUID string
	owns             func(pool string, a netip.Addr) bool
	overflow         func()
	gone             chan goneAddr
	// relisted is set when a view listed its pool (its watches start anew) or started
	// following a block it claimed: what happened before may not have been reported, so the
	// next audit compares every allocation too.
	relisted atomic.Bool
}

// goneAddr is an allocation of one of this node's pods changed by someone else, seen at at.
type goneAddr struct {
	pool string
	addr netip.Addr
	at   time.Time
}

func newOwnKeys(cluster, nodeUID string, owns func(string, netip.Addr) bool, overflow func()) *OwnKeys {
	return &OwnKeys{cluster: cluster, nodeUID: nodeUID, owns: owns, overflow: overflow, gone: make(chan goneAddr, 256)}
}

// Deleted notes that a's allocation in pool was deleted, by no release the view knows of.
func (k *OwnKeys) Deleted(pool string, a netip.Addr) {
	if k != nil && k.owns(pool, a) {
		k.queue(pool, a)
	}
}

// Listed notes that a view listed its pool, or a block it claimed.
func (k *OwnKeys) Listed() {
	if k != nil {
		k.relisted.Store(true)
	}
}

// Put notes that a's allocation in pool was written as kv.
func (k *OwnKeys) Put(pool string, a netip.Addr, kv *mvccpb.KeyValue) {
	if k == nil || !k.owns(pool, a) {
		return
	}
	rec, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
	if kv.Lease == 0 || err != nil || rec.Cluster != k.cluster || rec.NodeUID != k.nodeUID {
		k.queue(pool, a)
	}
}

func (k *OwnKeys) queue(pool string, a netip.Addr) {
	select {
	case k.gone <- goneAddr{pool: pool, addr: a, at: time.Now()}:
	default:
		k.overflow()
	}
}

// GoneLoop checks the pod that lists each address the views reported (OwnKeys), once a
// release in flight had the time to change what the agent knows (poolview.SuspectGrace): the check of
// one pod under its lock (recheckPod), re-claimed at once if its keys are lost. It runs until
// ctx ends.
func (au *Auditor) GoneLoop(ctx context.Context) {
	for {
		var g goneAddr
		select {
		case <-ctx.Done():
			return
		case g = <-au.keys.gone:
		}
		if !pause.For(ctx, time.Until(g.at.Add(poolview.SuspectGrace))) {
			return
		}
		owner, ok := au.cfg.Pods.OwnerOf(g.pool, g.addr)
		if !ok {
			continue // released meanwhile
		}
		layouts, err := au.auditLayouts(ctx)
		if err == nil {
			var lost bool
			if lost, err = au.recheckPod(ctx, owner, layouts); lost {
				au.cfg.Wake()
			}
		}
		if err != nil {
			au.cfg.Log.Warn("checking a pod whose address changed in etcd failed; the next audit checks it", "owner", owner, "err", err)
			au.MarkDue()
		}
	}
}
