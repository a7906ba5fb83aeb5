package restorenotice

import (
	"context"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/pause"
	"github.com/leasehold/leasehold/keyspace"
)

// An agent that finds etcd gone back in time says so under keyspace.RestoredKey, on a lease
// of its settle time, and every agent follows that key. One that saw no sign of the restore
// itself (its last answers were at revisions the restored etcd had passed, or it was away)
// would hand out the addresses other nodes' pods lost with the backup: told, it repairs and
// settles as if it had noticed. An agent told of a restore does not tell again.

// announceRestore writes the restored key for the other agents: what this agent found, and
// the end of its settle time, which the key's lease ends with.
func (w *Notices) announceRestore(until time.Time, why string) {
	ctx, cancel := w.opCtx(w.ctx)
	defer cancel()
	left := time.Until(until)
	lease, err := w.cfg.Client.Grant(ctx, int64((left+time.Second-1)/time.Second))
	if err == nil {
		now := time.Now()
		rec := keyspace.RestoredRecord{Cluster: w.cfg.Cluster, Node: w.cfg.Node, Noticed: now.UTC(), Until: now.Add(left).UTC(), Why: why}
		_, err = w.cfg.Client.Put(ctx, keyspace.RestoredKey, keyspace.Encode(rec), clientv3.WithLease(lease.ID))
	}
	if err != nil && w.ctx.Err() == nil {
		w.cfg.Log.Warn("could not tell the other agents that etcd went back in time; each finds it by itself", "err", err)
	}
}

// ReadRestored reads the restored key and acts on it; it returns the revision read at, or 0
// when etcd did not answer.
func (w *Notices) ReadRestored(ctx context.Context) int64 {
	octx, cancel := w.opCtx(ctx)
	defer cancel()
	resp, err := w.cfg.Client.Get(octx, keyspace.RestoredKey)
	if err != nil {
		return 0
	}
	if len(resp.Kvs) > 0 {
		w.toldOfRestore(resp.Kvs[0])
	}
	return resp.Header.Revision
}

// restoredLoop follows the restored key from rev, the revision the agent's start read it at
// (0: read it first), watching it and reading it again whenever the watch breaks.
func (w *Notices) restoredLoop(rev int64) {
	backoff := w.cfg.RetryFirst
	for w.ctx.Err() == nil {
		if rev == 0 {
			rev = w.ReadRestored(w.ctx)
		}
		if rev != 0 {
			wctx, stop := context.WithCancel(clientv3.WithRequireLeader(w.ctx))
			for wr := range w.cfg.Client.Watch(wctx, keyspace.RestoredKey, clientv3.WithRev(rev+1), clientv3.WithFilterDelete()) {
				if wr.Err() != nil {
					break
				}
				for _, ev := range wr.Events {
					w.toldOfRestore(ev.Kv)
				}
				backoff = w.cfg.RetryFirst
			}
			stop()
			rev = 0
		}
		if !pause.For(w.ctx, backoff) {
			return
		}
		backoff = min(2*backoff, w.cfg.RetryMax)
	}
}

// toldOfRestore acts on another agent's word that etcd went back in time, unless this agent
// is settling after it already.
func (w *Notices) toldOfRestore(kv *mvccpb.KeyValue) {
	rec, err := keyspace.Decode[keyspace.RestoredRecord](string(kv.Key), kv.Value)
	if err != nil || rec.Cluster == w.cfg.Cluster && rec.Node == w.cfg.Node || !time.Now().Before(rec.Until) {
		return
	}
	if _, until, _ := w.cfg.Hold.SettleTimes(); !until.IsZero() && until.Add(w.cfg.LeaseTTL).After(rec.Until) {
		return // this agent noticed it too, or was told already
	}
	// The key was created in the new history, after the restore, unless the restore brought
	// it back (lower still).
	w.wentBackFrom(fmt.Sprintf("node %s of cluster %s found etcd gone back in time at %s (%s)",
		rec.Node, rec.Cluster, rec.Noticed.Format(time.RFC3339), rec.Why), time.Now(), kv.CreateRevision)
}
