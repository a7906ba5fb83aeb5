package poolview

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// takenSet is a Taken of a fixed set of allocated addresses.
type takenSet map[netip.Addr]bool

func (t takenSet) Allocated(a netip.Addr) bool              { return t[a] }
func (t takenSet) Quarantined(netip.Addr) (time.Time, bool) { return time.Time{}, false }

// TestPickSpreadChoosesAmongTheFreeAddresses: near exhaustion the free addresses lie
// together, and borrowers must not all choose the first of them. Picks are free, never busy,
// and spread over the free addresses; with none free the pool is exhausted.
func TestPickSpreadChoosesAmongTheFreeAddresses(t *testing.T) {
	spec := allocator.PoolSpec{Name: "p", Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.1.0.0/22")}}}}
	if err := spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	// Every address taken but 10.1.3.100-10.1.3.139 (40 together); 10.1.3.100 is busy (pending).
	taken := takenSet{}
	for a := netip.MustParseAddr("10.1.0.0"); netip.MustParsePrefix("10.1.0.0/22").Contains(a); a = a.Next() {
		if a.Compare(netip.MustParseAddr("10.1.3.100")) < 0 || a.Compare(netip.MustParseAddr("10.1.3.139")) > 0 {
			taken[a] = true
		}
	}
	busy := func(a netip.Addr) bool { return a == netip.MustParseAddr("10.1.3.100") }
	seen := map[netip.Addr]int{}
	for range 400 {
		a, err := pickSpread(&spec, 0, taken, busy)
		if err != nil {
			t.Fatal(err)
		}
		if taken[a] || busy(a) {
			t.Fatalf("picked %s, taken or busy", a)
		}
		seen[a]++
	}
	if len(seen) < borrowSpread {
		t.Errorf("400 picks chose %d distinct addresses, want at least %d: %v", len(seen), borrowSpread, seen)
	}
	for a, n := range seen {
		// A walk to the first free address would choose 10.1.3.101 almost every time.
		if n > 100 {
			t.Errorf("%s chosen %d times of 400: borrowers would collide on it", a, n)
		}
	}
	for a := range taken {
		delete(taken, a)
	}
	for a := netip.MustParseAddr("10.1.0.0"); netip.MustParsePrefix("10.1.0.0/22").Contains(a); a = a.Next() {
		taken[a] = true
	}
	if _, err := pickSpread(&spec, 0, taken, busy); !errors.Is(err, allocator.ErrPoolExhausted) {
		t.Errorf("a full pool: %v, want ErrPoolExhausted", err)
	}
}
