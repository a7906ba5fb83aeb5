package etcdgate

import (
	"context"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The client the gate hands out (Gate.Client): etcd's own, its KV, Lease and Watcher wrapped
// so that every answer reaches the gate (Gate.seen, Heard, watched) before the caller.

// gatedKV is the client's KV with every answer seen by the gate. Every request but a
// serializable read is linearizable.
type gatedKV struct {
	clientv3.KV
	g *Gate
}

func (k gatedKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	f := k.g.floor()
	resp, err := k.KV.Put(ctx, key, val, opts...)
	if err == nil {
		k.g.seen(resp.Header, f, true)
	}
	return resp, err
}

func (k gatedKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	f := k.g.floor()
	resp, err := k.KV.Get(ctx, key, opts...)
	if err == nil {
		k.g.seen(resp.Header, f, !clientv3.OpGet(key, opts...).IsSerializable())
	}
	return resp, err
}

func (k gatedKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	f := k.g.floor()
	resp, err := k.KV.Delete(ctx, key, opts...)
	if err == nil {
		k.g.seen(resp.Header, f, true)
	}
	return resp, err
}

func (k gatedKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	f := k.g.floor()
	resp, err := k.KV.Do(ctx, op)
	if err == nil {
		var h *pb.ResponseHeader
		switch {
		case resp.Get() != nil:
			h = resp.Get().Header
		case resp.Put() != nil:
			h = resp.Put().Header
		case resp.Del() != nil:
			h = resp.Del().Header
		case resp.Txn() != nil:
			h = resp.Txn().Header
		}
		k.g.seen(h, f, !op.IsSerializable())
	}
	return resp, err
}

func (k gatedKV) Txn(ctx context.Context) clientv3.Txn { return &gatedTxn{Txn: k.KV.Txn(ctx), g: k.g} }

// gatedTxn is a transaction whose answer the gate sees. Its floor is taken at Commit, when
// the request is sent.
type gatedTxn struct {
	clientv3.Txn
	g *Gate
}

func (t *gatedTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	t.Txn = t.Txn.If(cs...)
	return t
}

func (t *gatedTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *gatedTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *gatedTxn) Commit() (*clientv3.TxnResponse, error) {
	f := t.g.floor()
	resp, err := t.Txn.Commit()
	if err == nil {
		t.g.seen(resp.Header, f, true)
	}
	return resp, err
}

// gatedLease is the client's Lease with every answer seen by the gate, as a suspicion: a
// lease request is served by the leader, whose header may come from a member behind another
// that answered before. KeepAlive's answers reach the gate through the keeper (heard).
type gatedLease struct {
	clientv3.Lease
	g *Gate
}

func (l gatedLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	resp, err := l.Lease.Grant(ctx, ttl)
	if err == nil {
		l.g.Heard(resp.ResponseHeader)
	}
	return resp, err
}

func (l gatedLease) Revoke(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseRevokeResponse, error) {
	resp, err := l.Lease.Revoke(ctx, id)
	if err == nil {
		l.g.Heard(resp.Header)
	}
	return resp, err
}

func (l gatedLease) TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error) {
	resp, err := l.Lease.TimeToLive(ctx, id, opts...)
	if err == nil {
		l.g.Heard(resp.ResponseHeader)
	}
	return resp, err
}

func (l gatedLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	resp, err := l.Lease.KeepAliveOnce(ctx, id)
	if err == nil {
		l.g.Heard(resp.ResponseHeader)
	}
	return resp, err
}

// gatedWatcher is the client's Watcher with every answer seen by the gate, on the way to the
// caller.
type gatedWatcher struct {
	clientv3.Watcher
	g *Gate
}

func (w gatedWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	in := w.Watcher.Watch(ctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		for resp := range in {
			w.g.watched(&resp)
			select {
			case out <- resp:
			case <-ctx.Done():
				for range in { // the client closes in once it has seen ctx end
				}
				return
			}
		}
	}()
	return out
}
