package allocator_test

import (
	"encoding/binary"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// bitTaken is a bitmap allocator.Taken over one IPv4 /16, so that BenchmarkNext
// measures Next rather than map hashing (16-byte map keys cost ~200 ns a lookup on the
// benchmark machine, 10x Next's own work per step).
type bitTaken struct {
	base uint32
	bits []uint64
}

func (t *bitTaken) index(a netip.Addr) (uint32, bool) {
	if !a.Is4() {
		return 0, false
	}
	b := a.As4()
	off := binary.BigEndian.Uint32(b[:]) - t.base
	return off, off < uint32(len(t.bits))*64
}

func (t *bitTaken) set(a netip.Addr) {
	if i, ok := t.index(a); ok {
		t.bits[i/64] |= 1 << (i % 64)
	}
}

func (t *bitTaken) Allocated(a netip.Addr) bool {
	i, ok := t.index(a)
	return ok && t.bits[i/64]&(1<<(i%64)) != 0
}

func (t *bitTaken) Quarantined(netip.Addr) (time.Time, bool) { return time.Time{}, false }

// BenchmarkNext measures one candidate choice in a /16 at several occupancies. Taken
// addresses are scattered by a fixed-seed generator and the iterations cycle through
// fixed starting points, so a result is the average cost of a round-robin choice and
// is stable across runs (benchstat-friendly sub-benchmark names).
func BenchmarkNext(b *testing.B) {
	p := pool(b, "bench", [][]allocator.Range{{rng("10.0.0.0/16", "", "", "")}})
	var all []netip.Addr
	for a := p.Ranges[0][0].RangeStart; p.Ranges[0].Contains(a); a = a.Next() {
		if p.Allocatable(a) == nil {
			all = append(all, a)
		}
	}
	for _, bc := range []struct {
		name     string
		occupied float64
	}{
		{"occupancy=0%", 0},
		{"occupancy=50%", 0.5},
		{"occupancy=99.9%", 0.999},
	} {
		b.Run(bc.name, func(b *testing.B) {
			r := rand.New(rand.NewPCG(1, 2))
			taken := &bitTaken{base: 10 << 24, bits: make([]uint64, 1<<16/64)}
			for _, i := range r.Perm(len(all))[:int(bc.occupied*float64(len(all)))] {
				taken.set(all[i])
			}
			froms := make([]netip.Addr, 1024)
			for i := range froms {
				froms[i] = all[r.IntN(len(all))]
			}
			i := 0
			b.ReportAllocs()
			for b.Loop() {
				if _, err := p.Next(0, froms[i%len(froms)], taken, nil); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}
