package poolview

import (
	"net/netip"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Hooks are what the agent hands each view at start: its restore hold (Settling,
// Generation), its ear for this node's pods' keys (Put, Deleted: changes to the allocations
// of this node's pods the agent did not make; Listed: keys read with no report of how they
// changed before, by a listing of the pool or a block claim), and what an earlier process of
// the agent kept for the settle time (Settled). Any may be nil (tests, benchmarks). Put and
// Deleted are called under the view's lock: none of them may block.
type Hooks struct {
	// Settling returns, during the settle time after etcd went back in time, why a new
	// block or a borrowed address is refused; nil after it.
	Settling func() error
	// Generation counts the times etcd was found gone back: a read answered in an earlier
	// generation is of a history since replaced.
	Generation func() uint64
	Put        func(pool string, a netip.Addr, kv *mvccpb.KeyValue)
	Deleted    func(pool string, a netip.Addr)
	Listed     func()
	Settled    *Settled
}

// Settled is what an earlier process of the agent kept for the settle time after etcd went
// back in time: its end, and per pool the addresses kept and the blocks marked restored.
type Settled struct {
	Until    time.Time
	Kept     map[string][]netip.Addr
	Restored map[string][]netip.Prefix
}

func (h Hooks) settling() error {
	if h.Settling == nil {
		return nil
	}
	return h.Settling()
}

func (h Hooks) generation() uint64 {
	if h.Generation == nil {
		return 0
	}
	return h.Generation()
}

func (h Hooks) put(pool string, a netip.Addr, kv *mvccpb.KeyValue) {
	if h.Put != nil {
		h.Put(pool, a, kv)
	}
}

func (h Hooks) deleted(pool string, a netip.Addr) {
	if h.Deleted != nil {
		h.Deleted(pool, a)
	}
}

func (h Hooks) listed() {
	if h.Listed != nil {
		h.Listed()
	}
}
