package node

import (
	"errors"
	"net/netip"
	"sort"
	"testing"

	"github.com/leasehold/leasehold/leases/kernel"
)

func kaddr(s string, mods ...func(*kernel.Addr)) kernel.Addr {
	a := kernel.Addr{Prefix: netip.MustParsePrefix(s), Link: "eth0"}
	for _, m := range mods {
		m(&a)
	}
	return a
}

func tentative(a *kernel.Addr) { a.Tentative = true }
func dadFailed(a *kernel.Addr) { a.DADFailed = true }

func publishedList(h *hostSet) []string {
	var out []string
	for ip := range h.published {
		out = append(out, ip.String())
	}
	sort.Strings(out)
	return out
}

// TestHostSetDecisions is the DAD flap's logic without a kernel: what a scan or an event may
// do to the published set.
func TestHostSetDecisions(t *testing.T) {
	type step struct {
		scan  []kernel.Addr
		err   error
		event *kernel.Event
	}
	scanOf := func(a ...kernel.Addr) step { return step{scan: a} }
	failed := step{err: errors.New("netlink: message truncated")}
	ev := func(a kernel.Addr, removed bool) step { return step{event: &kernel.Event{Addr: a, Removed: removed}} }
	cases := []struct {
		name  string
		steps []step
		want  []string
	}{
		// The OVN-Kubernetes bug: a scan that skipped tentative addresses dropped IPv6.
		{"tentative counts as present", []step{scanOf(kaddr("10.0.0.5/24"), kaddr("2001:db8::5/64", tentative))}, []string{"10.0.0.5", "2001:db8::5"}},
		// A DAD-failed address is still someone's address on the link: never hand it out.
		{"dad failed counts as present", []step{scanOf(kaddr("2001:db8::6/64", dadFailed))}, []string{"2001:db8::6"}},
		// Link-local and loopback are not addresses a pool could hand out anyway.
		{"link-local and loopback ignored", []step{scanOf(kaddr("fe80::1/64"), kaddr("169.254.3.4/16"), kaddr("127.0.0.1/8"), kaddr("::1/128"))}, nil},
		// The seed's second failure: a failed scan cleared the set.
		{"failed scan keeps everything", []step{scanOf(kaddr("2001:db8::5/64")), failed, failed}, []string{"2001:db8::5"}},
		// One scan missing an address (a partial read) does not remove it.
		{"single absence keeps it", []step{scanOf(kaddr("2001:db8::5/64")), scanOf(), scanOf()}, []string{"2001:db8::5"}},
		// Absent from three complete scans in a row: stable absence, removed.
		{"stable absence removes", []step{scanOf(kaddr("2001:db8::5/64")), scanOf(), scanOf(), scanOf()}, nil},
		// Absences that are not consecutive never add up to a removal.
		{"absence streak resets", []step{scanOf(kaddr("2001:db8::5/64")), scanOf(), scanOf(), scanOf(kaddr("2001:db8::5/64")), scanOf(), scanOf()}, []string{"2001:db8::5"}},
		// The kernel saying the address is gone is authoritative.
		{"kernel delete removes at once", []step{scanOf(kaddr("2001:db8::5/64")), ev(kaddr("2001:db8::5/64"), true)}, nil},
		// An address appears through an event before any scan sees it.
		{"event adds", []step{ev(kaddr("2001:db8::7/64", tentative), false)}, []string{"2001:db8::7"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostSet(3)
			for _, s := range tc.steps {
				if s.event != nil {
					h.event(*s.event)
				} else {
					h.scan(s.scan, s.err)
				}
			}
			if got := publishedList(h); len(got) != len(tc.want) || (len(got) > 0 && fmtList(got) != fmtList(tc.want)) {
				t.Errorf("published %v, want %v", got, tc.want)
			}
		})
	}
}

func fmtList(s []string) string {
	out := ""
	for _, x := range s {
		out += x + ","
	}
	return out
}
