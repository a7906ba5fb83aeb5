package main

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
)

func TestRangeSetsFromFlags(t *testing.T) {
	tests := []struct {
		name    string
		ranges  []string
		set     int
		want    string // the sets' String(), joined by " | "
		wantErr string
	}{
		// Without set=, each family forms one set in order of first appearance: dual-stack in two flags.
		{name: "by family", ranges: []string{"fd10::/64", "10.10.0.0/24", "10.11.0.0/24"}, set: -1,
			want: "fd10::/64 | 10.10.0.0/24, 10.11.0.0/24"},
		// set= puts ranges where the admin says, even two sets of one family.
		{name: "explicit sets", ranges: []string{"10.10.0.0/24,set=1", "10.11.0.0/24,set=0"}, set: -1,
			want: "10.11.0.0/24 | 10.10.0.0/24"},
		// --set is the default for ranges without set=.
		{name: "--set default", ranges: []string{"10.10.0.0/24", "10.11.0.0/24,set=1"}, set: 0,
			want: "10.10.0.0/24 | 10.11.0.0/24"},
		// Bounds and gateway are kept as given.
		{name: "start end gw", ranges: []string{"10.10.0.0/24,start=10.10.0.10,end=10.10.0.20,gw=10.10.0.254"}, set: -1,
			want: "10.10.0.0/24 [10.10.0.10-10.10.0.20] gw 10.10.0.254"},
		// Some ranges numbered and some not is ambiguous.
		{name: "mixed", ranges: []string{"10.10.0.0/24,set=0", "10.11.0.0/24"}, set: -1, wantErr: "set="},
		// A set index with no range would leave an empty set.
		{name: "gap", ranges: []string{"10.10.0.0/24,set=1"}, set: -1, wantErr: "range set 0 has no --range"},
		// Nothing to define.
		{name: "none", set: -1, wantErr: "at least one --range"},
		// A bound that is not an address.
		{name: "bad address", ranges: []string{"10.10.0.0/24,start=x"}, set: -1, wantErr: "start=\"x\""},
		// A key given twice.
		{name: "twice", ranges: []string{"10.10.0.0/24,gw=10.10.0.1,gw=10.10.0.2"}, set: -1, wantErr: "twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sets, err := rangeSets(tt.ranges, tt.set)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want one saying %q", err, tt.wantErr)
				}
				if exitCode(err) != exitUsage {
					t.Errorf("exit code %d, want usage", exitCode(err))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, s := range sets {
				got = append(got, s.String())
			}
			if g := strings.Join(got, " | "); g != tt.want {
				t.Errorf("sets %q, want %q", g, tt.want)
			}
		})
	}
}

func TestPoolLifecycle(t *testing.T) {
	ctx := etcdtest.Ctx(t)
	cluster, pool := etcdtest.Uniq("c"), etcdtest.Uniq("net")
	// 10.85.0.0/28 hands out .1-.14 less gateway .1 and excluded .5: 12 addresses.
	r := ctl("pool", "create", pool, "--range", "10.85.0.0/28", "--range", "fd85::/120", "--exclude", "10.85.0.5")
	if r.code != 0 || !strings.Contains(r.stdout, "created pool "+pool) {
		t.Fatalf("pool create: %+v", r)
	}
	if r := ctl("pool", "create", pool, "--exclude", "10.85.0.5/32", "--range", "10.85.0.0/28,start=10.85.0.1", "--range", "fd85::/120"); r.code != 0 || !strings.Contains(r.stdout, "unchanged") {
		t.Errorf("identical pool create: %+v", r)
	}
	a := agent(t, endpoint, cluster, "n1")
	attach(t, a, pool, "held", "10.85.0.7")
	attach(t, a, pool, "other")
	if _, err := admin.Release(ctx, etcdtest.ClientAt(t, endpoint), pool, netip.MustParseAddr("10.85.0.7"), admin.ReleaseOptions{Force: true, Quarantine: time.Minute}); err != nil {
		t.Fatal(err)
	}
	attach(t, a, pool, "held2", "10.85.0.8")

	var show poolJSON
	jsonOf(t, ctl("pool", "show", pool, "-o", "json"), &show)
	got := show.Sets[0].countsJSON
	if want := (countsJSON{Size: "12", Allocated: 2, Quarantined: 1, Free: "9"}); got != want {
		t.Errorf("set 0 counts %+v, want %+v", got, want)
	}
	if len(show.Holders) != 1 || show.Holders[0] != (holderJSON{Cluster: cluster, Nodes: 1, Allocated: 4}) {
		t.Errorf("holders %+v, want 4 allocations of cluster %s on 1 node", show.Holders, cluster)
	}

	// Growth: a second IPv4 range joins set 0 (picked by family); every allocation stays.
	before := ctl("alloc", "list", "--pool", pool).stdout
	if r := ctl("pool", "add-range", pool, "--range", "10.85.1.0/28"); r.code != 0 || !strings.Contains(r.stdout, "every allocation is kept") {
		t.Fatalf("add-range: %+v", r)
	}
	if after := ctl("alloc", "list", "--pool", pool).stdout; after != before {
		t.Errorf("allocations changed by add-range:\n%s\nwas:\n%s", after, before)
	}
	// An overlapping range is refused: the operation failed.
	if r := ctl("pool", "add-range", pool, "--range", "10.85.1.0/29", "--set", "0"); r.code != exitError || !strings.Contains(r.stderr, "overlaps") {
		t.Errorf("overlapping add-range: %+v", r)
	}

	// Shrinking: the new range has a holder (from an agent that read the grown definition),
	// listed with who it is; nothing changes.
	b := agent(t, endpoint, cluster, "n2")
	attach(t, b, pool, "late", "10.85.1.3")
	r = ctl("pool", "remove-range", pool, "--subnet", "10.85.1.0/28")
	if r.code != exitError || !strings.Contains(r.stdout, "10.85.1.3") || !strings.Contains(r.stdout, "u-late") ||
		!strings.Contains(r.stdout, "ns/pod-late") || !strings.Contains(r.stdout, cluster) || !strings.Contains(r.stdout, "n2") {
		t.Errorf("remove-range of a held range: %+v", r)
	}
	var refused struct {
		Refused bool                    `json:"refused"`
		Holders []admin.AllocationEntry `json:"holders"`
	}
	r = ctl("pool", "remove-range", pool, "--subnet", "10.85.1.0/28", "-o", "json")
	jsonOf(t, r, &refused)
	if r.code != exitError || !refused.Refused || len(refused.Holders) != 1 || refused.Holders[0].Owner != "u-late" {
		t.Errorf("remove-range -o json: exit %d, %+v", r.code, refused)
	}
	if err := b.Del(ctx, allocator.Request{Network: pool, Pool: allocator.PoolSpec{Name: pool}, ContainerID: "late", IfName: "eth0",
		Pod: allocator.PodRef{UID: "u-late"}}); err != nil {
		t.Fatal(err)
	}
	// Empty now: it goes, the other range stays.
	if r := ctl("pool", "remove-range", pool, "--subnet", "10.85.1.0/28"); r.code != 0 {
		t.Fatalf("remove-range of an empty range: %+v", r)
	}
	if r := ctl("pool", "remove-range", pool, "--subnet", "10.85.1.0/28"); r.code != exitNotFound {
		t.Errorf("remove-range of a range already gone: %+v", r)
	}
	if r := ctl("pool", "list"); !strings.Contains(r.stdout, pool) || strings.Contains(r.stdout, "10.85.1.0/28") {
		t.Errorf("pool list after remove-range:\n%s", r.stdout)
	}
}
