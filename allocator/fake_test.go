package allocator_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// fakeTaken is a map-based allocator.Taken: the pure-domain tests need no I/O.
// It counts the questions Next asks so tests can bound its work.
type fakeTaken struct {
	allocated   map[netip.Addr]bool
	quarantined map[netip.Addr]time.Time
	calls       int
}

var _ allocator.Taken = (*fakeTaken)(nil)

func newTaken(allocated ...string) *fakeTaken {
	f := &fakeTaken{allocated: map[netip.Addr]bool{}, quarantined: map[netip.Addr]time.Time{}}
	for _, a := range allocated {
		f.allocated[netip.MustParseAddr(a)] = true
	}
	return f
}

// quarantine marks addr as resting until the given time.
func (f *fakeTaken) quarantine(addr string, until time.Time) *fakeTaken {
	f.quarantined[netip.MustParseAddr(addr)] = until
	return f
}

func (f *fakeTaken) Allocated(addr netip.Addr) bool {
	f.calls++
	return f.allocated[addr]
}

func (f *fakeTaken) Quarantined(addr netip.Addr) (time.Time, bool) {
	until, ok := f.quarantined[addr]
	return until, ok
}

// takeRange marks every address from lo to hi inclusive as allocated.
func (f *fakeTaken) takeRange(lo, hi string) *fakeTaken {
	end := netip.MustParseAddr(hi)
	for a := netip.MustParseAddr(lo); a.IsValid() && a.Compare(end) <= 0; a = a.Next() {
		f.allocated[a] = true
	}
	return f
}

// pool returns a canonical pool named name with the given range sets and excludes.
func pool(t testing.TB, name string, sets [][]allocator.Range, exclude ...string) allocator.PoolSpec {
	t.Helper()
	p := allocator.PoolSpec{Name: name}
	for _, s := range sets {
		p.Ranges = append(p.Ranges, allocator.RangeSet(s))
	}
	for _, x := range exclude {
		p.Exclude = append(p.Exclude, netip.MustParsePrefix(x))
	}
	if err := p.Canonicalize(); err != nil {
		t.Fatalf("Canonicalize(%v): %v", p, err)
	}
	return p
}

// rng builds a Range from text; empty strings leave a field unset.
func rng(subnet, start, end, gw string) allocator.Range {
	r := allocator.Range{Subnet: netip.MustParsePrefix(subnet)}
	if start != "" {
		r.RangeStart = netip.MustParseAddr(start)
	}
	if end != "" {
		r.RangeEnd = netip.MustParseAddr(end)
	}
	if gw != "" {
		r.Gateway = netip.MustParseAddr(gw)
	}
	return r
}

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }
