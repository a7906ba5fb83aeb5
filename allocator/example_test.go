package allocator_test

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// exampleTaken is a tiny in-memory Taken for the example.
type exampleTaken map[netip.Addr]bool

func (m exampleTaken) Allocated(a netip.Addr) bool              { return m[a] }
func (m exampleTaken) Quarantined(netip.Addr) (time.Time, bool) { return time.Time{}, false }

// ExamplePoolSpec_Next allocates round-robin from the design brief's dual-stack pool:
// one address per range set, skipping the excluded 10.10.1.0/28.
func ExamplePoolSpec_Next() {
	p := allocator.PoolSpec{
		Name: "net1",
		Ranges: []allocator.RangeSet{
			{{Subnet: netip.MustParsePrefix("10.10.0.0/16"),
				RangeStart: netip.MustParseAddr("10.10.1.0"),
				RangeEnd:   netip.MustParseAddr("10.10.9.255"),
				Gateway:    netip.MustParseAddr("10.10.0.1")}},
			{{Subnet: netip.MustParsePrefix("fd10::/64")}},
		},
		Exclude: []netip.Prefix{netip.MustParsePrefix("10.10.1.0/28")},
	}
	if err := p.Canonicalize(); err != nil {
		fmt.Println(err)
		return
	}
	taken := exampleTaken{}
	last := make([]netip.Addr, len(p.Ranges)) // the agent remembers the last address per set
	for range 2 {
		for set := range p.Ranges {
			a, err := p.Next(set, p.Ranges[set].After(last[set]), taken, nil)
			if errors.Is(err, allocator.ErrPoolExhausted) {
				fmt.Println("full:", err)
				return
			}
			if err != nil {
				fmt.Println(err)
				return
			}
			cfg, err := p.IPConfig(a)
			if err != nil {
				fmt.Println(err)
				return
			}
			fmt.Printf("set %d: %s via %s\n", set, cfg.Address, cfg.Gateway)
			taken[a] = true
			last[set] = a
		}
	}
	fmt.Println(p.Size())
	// Output:
	// set 0: 10.10.1.16/16 via 10.10.0.1
	// set 1: fd10::2/64 via fd10::1
	// set 0: 10.10.1.17/16 via 10.10.0.1
	// set 1: fd10::3/64 via fd10::1
	// [2288 18446744073709551614]
}
