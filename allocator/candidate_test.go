package allocator_test

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

func TestNext(t *testing.T) {
	t0 := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	v24 := pool(t, "net1", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}})
	v24x := pool(t, "net1", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}}, "10.0.0.0/28", "10.0.0.32/27")
	two := pool(t, "net1", [][]allocator.Range{{rng("10.0.0.0/24", "10.0.0.10", "10.0.0.19", ""), rng("10.0.5.0/24", "10.0.5.100", "10.0.5.109", "")}})
	dual := pool(t, "net1", [][]allocator.Range{{rng("10.0.0.0/24", "", "", "")}, {rng("fd10::/64", "", "", "")}})
	v64x := pool(t, "net1", [][]allocator.Range{{rng("fd10::/64", "", "", "")}}, "fd10::/65")
	top := pool(t, "net1", [][]allocator.Range{{rng("ffff:ffff:ffff:ffff::/64", "", "", "")}}, "ffff:ffff:ffff:ffff:8000::/65")
	skipSet := func(addrs ...string) func(netip.Addr) bool {
		return func(a netip.Addr) bool {
			for _, s := range addrs {
				if a == addr(s) {
					return true
				}
			}
			return false
		}
	}

	tests := []struct {
		name     string
		p        allocator.PoolSpec
		set      int
		from     string // "" for the zero Addr
		taken    *fakeTaken
		skip     func(netip.Addr) bool
		want     string
		wantErrs []error
		wantMsg  string
		maxCalls int // bound on Allocated calls; 0 means unchecked
	}{
		// No history: the first address after the gateway.
		{name: "empty from zero", p: v24, taken: newTaken(), want: "10.0.0.2", maxCalls: 1},
		// from is inclusive.
		{name: "from is free", p: v24, from: "10.0.0.77", taken: newTaken(), want: "10.0.0.77", maxCalls: 1},
		// A taken from moves on.
		{name: "from taken", p: v24, from: "10.0.0.77", taken: newTaken("10.0.0.77", "10.0.0.78"), want: "10.0.0.79", maxCalls: 3},
		// The tail is full: wrap to the start of the range, skipping the gateway.
		{name: "wraps around", p: v24, from: "10.0.0.250", taken: newTaken().takeRange("10.0.0.250", "10.0.0.254"), want: "10.0.0.2"},
		// Excluded prefixes are jumped over, not walked.
		{name: "skips excluded", p: v24x, taken: newTaken(), want: "10.0.0.16", maxCalls: 1},
		// A jump can land in the next exclude.
		{name: "skips excluded from inside", p: v24x, from: "10.0.0.31", taken: newTaken("10.0.0.31"), want: "10.0.0.64", maxCalls: 2},
		// Quarantined addresses rest: the next one is chosen.
		{name: "skips quarantined", p: v24, from: "10.0.0.5", taken: newTaken().quarantine("10.0.0.5", t0), want: "10.0.0.6"},
		// Addresses the caller lost a race on in this attempt are skipped.
		{name: "skips skip", p: v24, from: "10.0.0.5", taken: newTaken(), skip: skipSet("10.0.0.5", "10.0.0.6"), want: "10.0.0.7"},
		// A nil Taken means nothing is taken.
		{name: "nil taken", p: v24, from: "10.0.0.9", want: "10.0.0.9"},
		// The end of one range continues at the start of the next.
		{name: "next range", p: two, from: "10.0.0.19", taken: newTaken("10.0.0.19"), want: "10.0.5.100"},
		// The last range wraps to the first one.
		{name: "last range wraps", p: two, from: "10.0.5.109", taken: newTaken("10.0.5.109"), want: "10.0.0.10"},
		// A from outside the set starts at the first range.
		{name: "from outside", p: two, from: "192.168.0.1", taken: newTaken(), want: "10.0.0.10"},
		// A mapped from is the same address.
		{name: "mapped from", p: v24, from: "::ffff:10.0.0.40", taken: newTaken(), want: "10.0.0.40"},
		// The second set is searched on its own.
		{name: "v6 set", p: dual, set: 1, from: "10.0.0.40", taken: newTaken(), want: "fd10::2", maxCalls: 1},
		// Half a /64 excluded: one jump, one question, done.
		{name: "v64 with /65 excluded", p: v64x, taken: newTaken(), want: "fd10::8000:0:0:0", maxCalls: 1},
		// An exclude reaching the last address of the address space must not overflow the walk.
		{name: "exclude at top of space", p: top, from: "ffff:ffff:ffff:ffff:7fff:ffff:ffff:ffff", taken: newTaken("ffff:ffff:ffff:ffff:7fff:ffff:ffff:ffff"), want: "ffff:ffff:ffff:ffff::2", maxCalls: 2},
		// A full /24 stops after one lap, asking once per allocatable address.
		{name: "exhausted", p: v24, from: "10.0.0.100", taken: newTaken().takeRange("10.0.0.0", "10.0.0.255"),
			wantErrs: []error{allocator.ErrPoolExhausted}, wantMsg: "pool net1 range set 0 (10.0.0.0/24 [10.0.0.1-10.0.0.254] gw 10.0.0.1) has no free address: all 253 allocatable addresses are taken", maxCalls: 253},
		// Only quarantine stands in the way: both sentinels, and when the first frees up.
		{name: "only quarantined", p: v24, taken: newTaken().takeRange("10.0.0.2", "10.0.0.200").quarantine("10.0.0.201", t0.Add(time.Hour)).quarantine("10.0.0.250", t0).takeRange("10.0.0.202", "10.0.0.249").takeRange("10.0.0.251", "10.0.0.254").quarantine("10.0.0.2", t0.Add(-time.Hour)),
			wantErrs: []error{allocator.ErrPoolExhausted, allocator.ErrOnlyQuarantined}, wantMsg: "2 of its 253 allocatable addresses rest in quarantine after a release and the first frees up at 2030-01-02T03:04:05Z"},
		// Addresses lost to races are not quarantine: plain exhaustion, worth a retry.
		{name: "exhausted by skip", p: pool(t, "tiny", [][]allocator.Range{{rng("10.0.0.0/30", "", "", "")}}), taken: newTaken(), skip: skipSet("10.0.0.2"),
			wantErrs: []error{allocator.ErrPoolExhausted}, wantMsg: "all 1 allocatable addresses are taken (0 allocated, 1 lost to concurrent allocations in this attempt)"},
		// Asking for a set the pool lacks is a caller bug.
		{name: "bad set", p: v24, set: 1, taken: newTaken(), wantErrs: []error{allocator.ErrInvalidConfig}, wantMsg: "has no range set 1"},
		// A spec that skipped Canonicalize is refused, not walked.
		{name: "not canonical", p: allocator.PoolSpec{Name: "raw", Ranges: []allocator.RangeSet{{rng("10.0.0.0/24", "", "", "")}}}, taken: newTaken(), wantErrs: []error{allocator.ErrInvalidConfig}, wantMsg: "call Canonicalize first"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var from netip.Addr
			if tt.from != "" {
				from = addr(tt.from)
			}
			var taken allocator.Taken
			if tt.taken != nil {
				taken = tt.taken
			}
			got, err := tt.p.Next(tt.set, from, taken, tt.skip)
			if tt.maxCalls > 0 && tt.taken != nil && tt.taken.calls > tt.maxCalls {
				t.Errorf("Next asked Allocated %d times, want at most %d", tt.taken.calls, tt.maxCalls)
			}
			if tt.wantErrs != nil {
				for _, want := range tt.wantErrs {
					if !errors.Is(err, want) {
						t.Errorf("Next = %v, %v; want an error wrapping %v", got, err, want)
					}
				}
				if err != nil && !strings.Contains(err.Error(), tt.wantMsg) {
					t.Errorf("Next error %q does not contain %q", err, tt.wantMsg)
				}
				if errors.Is(err, allocator.ErrPoolExhausted) && len(tt.wantErrs) == 1 && errors.Is(err, allocator.ErrOnlyQuarantined) {
					t.Errorf("Next error %q claims only quarantine blocks", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Next: %v", err)
			}
			if got != addr(tt.want) {
				t.Errorf("Next = %s, want %s", got, tt.want)
			}
		})
	}
}

// TestNextRoundRobin hands out a whole set through After and Next, as the agent does,
// and checks every allocatable address comes out exactly once before exhaustion.
func TestNextRoundRobin(t *testing.T) {
	p := pool(t, "rr", [][]allocator.Range{{rng("10.0.0.0/27", "", "", ""), rng("10.0.1.0/28", "10.0.1.4", "", "10.0.1.9")}}, "10.0.0.8/30")
	taken := newTaken()
	var last netip.Addr
	n := 0
	for {
		a, err := p.Next(0, p.Ranges[0].After(last), taken, nil)
		if errors.Is(err, allocator.ErrPoolExhausted) {
			break
		}
		if err != nil {
			t.Fatalf("Next after %d addresses: %v", n, err)
		}
		if taken.allocated[a] || p.Allocatable(a) != nil {
			t.Fatalf("Next handed out %s twice or unallocatable (%v)", a, p.Allocatable(a))
		}
		if last.IsValid() && !last.Less(a) {
			// Nothing is ever freed, so round-robin order only moves forward.
			t.Errorf("Next went back from %s to %s", last, a)
		}
		taken.allocated[a] = true
		last = a
		n++
	}
	if want := p.SetSize(0).Int64(); int64(n) != want {
		t.Errorf("handed out %d addresses, SetSize says %d", n, want)
	}
}

// TestNextNear: the first free address from a place, looking at no more addresses than
// asked and not past the end of the range; it says how many it looked at.
func TestNextNear(t *testing.T) {
	p := allocator.PoolSpec{Name: "near", Ranges: []allocator.RangeSet{{
		{Subnet: netip.MustParsePrefix("10.1.0.0/24"), RangeStart: netip.MustParseAddr("10.1.0.10"), RangeEnd: netip.MustParseAddr("10.1.0.99")},
		{Subnet: netip.MustParsePrefix("10.2.0.0/24")},
	}}, Exclude: []netip.Prefix{netip.MustParsePrefix("10.1.0.20/30")}}
	if err := p.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	taken := exampleTaken{}
	for a := netip.MustParseAddr("10.1.0.10"); a.Compare(netip.MustParseAddr("10.1.0.50")) < 0; a = a.Next() {
		taken[a] = true
	}
	for _, tc := range []struct {
		from   string
		n      int
		want   string // "" none
		looked int
	}{
		{"10.1.0.10", 100, "10.1.0.50", 38}, // 10-19 and 24-49 taken, 20-23 excluded (one jump)
		{"10.1.0.10", 37, "", 37},           // one short of it
		{"10.1.0.60", 1, "10.1.0.60", 1},
		{"10.1.0.99", 5, "10.1.0.99", 1},
		{"10.1.0.100", 5, "", 0}, // in no range of the set
		{"10.1.0.45", 0, "", 0},
	} {
		a, looked, ok := p.NextNear(0, netip.MustParseAddr(tc.from), tc.n, taken, nil)
		got := ""
		if ok {
			got = a.String()
		}
		if got != tc.want || looked != tc.looked {
			t.Errorf("NextNear(%s, %d) = %q after %d, want %q after %d", tc.from, tc.n, got, looked, tc.want, tc.looked)
		}
	}
	// It stops at the end of from's range, not going on into the next one.
	for a := netip.MustParseAddr("10.1.0.50"); a.Compare(netip.MustParseAddr("10.1.0.99")) <= 0; a = a.Next() {
		taken[a] = true
	}
	if a, looked, ok := p.NextNear(0, netip.MustParseAddr("10.1.0.90"), 1000, taken, nil); ok || looked != 10 {
		t.Errorf("NextNear past its range's end: %s after %d (ok %v), want none after 10", a, looked, ok)
	}
}
