package allocator_test

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

// designPool is the design brief's dual-stack example, plus a second IPv4 range with
// its own gateway.
func designPool(t *testing.T) allocator.PoolSpec {
	return pool(t, "net1", [][]allocator.Range{
		{rng("10.10.0.0/16", "10.10.1.0", "10.10.9.255", "10.10.0.1"), rng("10.9.0.0/24", "", "", "")},
		{rng("fd10::/64", "", "", "")},
	}, "10.10.1.0/28")
}

func TestAllocatable(t *testing.T) {
	p := designPool(t)
	tests := []struct {
		name    string
		addr    string
		wantSet int    // -1: in no set
		wantErr string // empty: allocatable
	}{
		{"plain v4", "10.10.2.7", 0, ""},      // an ordinary member
		{"second range", "10.9.0.7", 0, ""},   // ranges of one set form one set
		{"v6", "fd10::abcd", 1, ""},           // the IPv6 set
		{"mapped", "::ffff:10.10.2.7", 0, ""}, // IPv4-mapped form is the same address
		{"gateway", "10.9.0.1", 0, "10.9.0.1 is the gateway of range 10.9.0.0/24 [10.9.0.1-10.9.0.254] gw 10.9.0.1"},  // gateways are never handed out
		{"v6 gateway", "fd10::1", 1, "fd10::1 is the gateway of range fd10::/64"},                                     // nor IPv6 ones
		{"excluded", "10.10.1.3", 0, "10.10.1.3 is excluded by 10.10.1.0/28"},                                         // excludes are honoured
		{"before start", "10.10.0.200", -1, "10.10.0.200 lies in no range of pool net1 (ranges: set 0: 10.10.0.0/16"}, // in the subnet, outside the range
		{"foreign", "192.168.1.1", -1, "lies in no range of pool net1"},                                               // nowhere near the pool
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set, ok := p.SetOf(addr(tt.addr))
			if ok != (tt.wantSet >= 0) || ok && set != tt.wantSet {
				t.Errorf("SetOf(%s) = %d, %v; want set %d", tt.addr, set, ok, tt.wantSet)
			}
			err := p.Allocatable(addr(tt.addr))
			if tt.wantErr == "" {
				if err != nil {
					t.Errorf("Allocatable(%s) = %v, want nil", tt.addr, err)
				}
				return
			}
			if !errors.Is(err, allocator.ErrNotInRange) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("Allocatable(%s) = %v, want ErrNotInRange containing %q", tt.addr, err, tt.wantErr)
			}
		})
	}
	if err := p.Allocatable(netip.Addr{}); !errors.Is(err, allocator.ErrNotInRange) {
		t.Errorf("Allocatable(zero) = %v, want ErrNotInRange", err) // the zero Addr is never allocatable
	}
}

func TestIPConfig(t *testing.T) {
	p := designPool(t)
	tests := []struct {
		addr, wantAddr, wantGW string
	}{
		{"10.10.2.7", "10.10.2.7/16", "10.10.0.1"}, // prefix length of the range's subnet, its gateway
		{"10.9.0.7", "10.9.0.7/24", "10.9.0.1"},    // the second range has its own subnet and gateway
		{"fd10::7", "fd10::7/64", "fd10::1"},       // IPv6
		{"10.10.1.3", "10.10.1.3/16", "10.10.0.1"}, // an excluded address still describes (existing allocations)
	}
	for _, tt := range tests {
		got, err := p.IPConfig(addr(tt.addr))
		if err != nil {
			t.Errorf("IPConfig(%s): %v", tt.addr, err)
			continue
		}
		want := allocator.IPConfig{Address: netip.MustParsePrefix(tt.wantAddr), Gateway: addr(tt.wantGW)}
		if got != want {
			t.Errorf("IPConfig(%s) = %+v, want %+v", tt.addr, got, want)
		}
	}
	if _, err := p.IPConfig(addr("192.168.0.1")); !errors.Is(err, allocator.ErrNotInRange) {
		t.Errorf("IPConfig(foreign) = %v, want ErrNotInRange", err) // no range, no prefix length
	}
}

func TestMatchRequested(t *testing.T) {
	p := designPool(t)
	tests := []struct {
		name    string
		ips     []string
		want    []string // "" for the zero Addr
		wantErr string
	}{
		{"none", nil, []string{"", ""}, ""},                                                                       // nothing requested: Next picks both
		{"one v4", []string{"10.10.2.7"}, []string{"10.10.2.7", ""}, ""},                                          // the other set stays open
		{"v6 first", []string{"fd10::7", "10.9.0.9"}, []string{"10.9.0.9", "fd10::7"}, ""},                        // result follows set order, not input order
		{"mapped", []string{"::ffff:10.10.2.7"}, []string{"10.10.2.7", ""}, ""},                                   // mapped input is unmapped
		{"same set", []string{"10.10.2.7", "10.9.0.9"}, nil, "10.10.2.7 and 10.9.0.9 both fall into range set 0"}, // one address per set
		{"duplicate", []string{"fd10::7", "fd10::7"}, nil, "fd10::7 is requested twice"},                          // a duplicate is not two addresses
		{"duplicate mapped", []string{"10.10.2.7", "::ffff:10.10.2.7"}, nil, "requested twice"},                   // duplicates across spellings
		{"gateway", []string{"10.9.0.1"}, nil, "gateway"},                                                         // requested addresses must be allocatable
		{"excluded", []string{"10.10.1.1"}, nil, "excluded by 10.10.1.0/28"},                                      // same
		{"foreign", []string{"192.168.0.1"}, nil, "lies in no range"},                                             // same
		{"zero", []string{""}, nil, "empty"},                                                                      // an unparsed address
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ips []netip.Addr
			for _, s := range tt.ips {
				var a netip.Addr
				if s != "" {
					a = addr(s)
				}
				ips = append(ips, a)
			}
			got, err := p.MatchRequested(ips)
			if tt.wantErr != "" {
				if !errors.Is(err, allocator.ErrNotInRange) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("MatchRequested(%v) = %v, want ErrNotInRange containing %q", tt.ips, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("MatchRequested(%v): %v", tt.ips, err)
			}
			var gotS []string
			for _, a := range got {
				if a.IsValid() {
					gotS = append(gotS, a.String())
				} else {
					gotS = append(gotS, "")
				}
			}
			if !slices.Equal(gotS, tt.want) {
				t.Errorf("MatchRequested(%v) = %q, want %q", tt.ips, gotS, tt.want)
			}
		})
	}
}
