package poolview

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"testing"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// The benchmarks below measure the agent's watch-fed view without etcd: its memory per
// allocated address, the cost of applying a watch event, and candidate choice over the
// real view (a Go map) rather than the allocator benchmark's bitmap. Sub-benchmark names
// are stable, so the output is benchstat-friendly:
//
//	go test -run '^$' -bench View -benchmem -count 6 ./leases/ | tee new.txt; benchstat old.txt new.txt

// benchPool is a canonical one-range /16 pool and its allocatable addresses in a fixed
// pseudo-random order (allocations of many nodes are spread over a pool, not packed).
func benchPool(b *testing.B) (allocator.PoolSpec, []netip.Addr) {
	b.Helper()
	spec := allocator.PoolSpec{Name: "bench", Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.0.0.0/16")}}}}
	if err := spec.Canonicalize(); err != nil {
		b.Fatal(err)
	}
	var all []netip.Addr
	r := spec.Ranges[0][0]
	for a := r.RangeStart; a.IsValid() && a.Compare(r.RangeEnd) <= 0; a = a.Next() {
		if spec.Allocatable(a) == nil {
			all = append(all, a)
		}
	}
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	return spec, all
}

func benchView() *View {
	return newView("bench", allocator.Blocks{}, nil, slog.New(slog.DiscardHandler), 1, nil, Hooks{})
}

// putEvents is a watch response creating an allocation key for each address, as etcd
// sends it to the view's watch.
func putEvents(addrs []netip.Addr) clientv3.WatchResponse {
	evs := make([]*clientv3.Event, len(addrs))
	for i, a := range addrs {
		evs[i] = &clientv3.Event{Type: clientv3.EventTypePut, Kv: &mvccpb.KeyValue{
			Key: []byte(keyspace.IPKey("bench", allocator.Blocks{}, a)), CreateRevision: int64(i + 2), ModRevision: int64(i + 2), Version: 1}}
	}
	return clientv3.WatchResponse{Header: etcdserverpb.ResponseHeader{Revision: int64(len(addrs) + 1)}, Events: evs}
}

// heapInUse returns the live heap after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkViewMemory reports the view's heap per allocated address (bytes/alloc), for a
// view built the two ways an agent builds it: from a listing (list() sizes the map to the
// listing) and from watch events (the map grows one put at a time).
func BenchmarkViewMemory(b *testing.B) {
	_, all := benchPool(b)
	for _, n := range []int{1000, 10000, len(all)} {
		addrs := all[:n]
		b.Run(fmt.Sprintf("from=list/allocated=%d", n), func(b *testing.B) {
			var perAlloc float64
			for b.Loop() {
				before := heapInUse()
				v := benchView()
				m := make(map[netip.Addr]int64, len(addrs))
				for i, a := range addrs {
					m[a] = int64(i + 2)
				}
				v.allocated = m
				after := heapInUse()
				perAlloc = float64(int64(after)-int64(before)) / float64(n)
				runtime.KeepAlive(v)
			}
			b.ReportMetric(perAlloc, "bytes/alloc")
		})
		b.Run(fmt.Sprintf("from=watch/allocated=%d", n), func(b *testing.B) {
			resp := putEvents(addrs)
			var perAlloc float64
			for b.Loop() {
				before := heapInUse()
				v := benchView()
				v.sync.apply(resp)
				after := heapInUse()
				perAlloc = float64(int64(after)-int64(before)) / float64(n)
				runtime.KeepAlive(v)
			}
			runtime.KeepAlive(resp)
			b.ReportMetric(perAlloc, "bytes/alloc")
		})
	}
}

// BenchmarkViewApply is the agent's cost of one watch event (an allocation created
// somewhere in the cluster): every agent serving the pool pays it for every ADD and DEL.
func BenchmarkViewApply(b *testing.B) {
	_, all := benchPool(b)
	// Batches of 1,000 puts, each creating a new allocation; once the whole /16 has been
	// applied, a new view starts over (map growth included).
	const batch = 1000
	var resps []clientv3.WatchResponse
	for i := 0; i+batch <= len(all); i += batch {
		resps = append(resps, putEvents(all[i:i+batch]))
	}
	v := benchView()
	k := 0
	for b.Loop() {
		v.sync.apply(resps[k])
		if k++; k == len(resps) {
			k, v = 0, benchView()
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/event")
}

// BenchmarkViewReserve is one candidate choice by the agent (reserve, then settle as a
// failed claim would, so the occupancy stays put) at several occupancies of a /16. Each
// search starts after the previous choice, as the agent's round-robin does, so at 99.9%
// it walks about a thousand allocated addresses through the view's map.
func BenchmarkViewReserve(b *testing.B) {
	spec, all := benchPool(b)
	for _, bc := range []struct {
		name     string
		occupied float64
	}{
		{"occupancy=0%", 0},
		{"occupancy=50%", 0.5},
		{"occupancy=99.9%", 0.999},
	} {
		b.Run(bc.name, func(b *testing.B) {
			v := benchView()
			for i, a := range all[:int(bc.occupied*float64(len(all)))] {
				v.allocated[a] = int64(i + 2)
			}
			b.ReportAllocs()
			for b.Loop() {
				a, err := v.reserve(&spec, 0, nil)
				if err != nil {
					b.Fatal(err)
				}
				v.Settle([]netip.Addr{a}, 0)
			}
		})
	}
}
