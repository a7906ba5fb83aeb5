package cniplugin

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

// TestParseConfigAskedPools: the pools a pod asks for (CNI_ARGS LEASEHOLD_POOL, args.cni.pool
// where Multus puts a pod's cni-args), in order, checked as names; a DEL ignores them.
func TestParseConfigAskedPools(t *testing.T) {
	for _, tt := range []struct {
		name, top, args string
		want            []string
		wantErr         string
	}{
		{name: "none", args: podArgs},
		{name: "CNI_ARGS one", args: podArgs + ";LEASEHOLD_POOL=gold", want: []string{"gold"}},
		{name: "CNI_ARGS list", args: "LEASEHOLD_POOL=gold, silver,", want: []string{"gold", "silver"}},
		{name: "args.cni.pool string", top: `,"args":{"cni":{"pool":"gold,silver"}}`, want: []string{"gold", "silver"}},
		{name: "args.cni.pool list", top: `,"args":{"cni":{"pool":["gold","silver"]}}`, want: []string{"gold", "silver"}},
		{name: "both agree", top: `,"args":{"cni":{"pool":["gold"]}}`, args: "LEASEHOLD_POOL=gold", want: []string{"gold"}},
		{name: "both differ", top: `,"args":{"cni":{"pool":"silver"}}`, args: "LEASEHOLD_POOL=gold",
			wantErr: `CNI_ARGS LEASEHOLD_POOL "gold" and args.cni.pool "silver" ask for different pools`},
		{name: "CNI_ARGS twice", args: "LEASEHOLD_POOL=gold;LEASEHOLD_POOL=silver", wantErr: "gives LEASEHOLD_POOL twice"},
		{name: "a bad name", args: "LEASEHOLD_POOL=a/b", wantErr: `CNI_ARGS LEASEHOLD_POOL: invalid name: pool name "a/b"`},
		{name: "a pool twice", top: `,"args":{"cni":{"pool":["gold","gold"]}}`, wantErr: `args.cni.pool asks for pool "gold" twice`},
		{name: "wrong type", top: `,"args":{"cni":{"pool":7}}`, wantErr: "args.cni.pool: want a pool name"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := ParseConfig(stickyConf("", tt.top), tt.args, "c0ffee", "eth0", "")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.Is(err, allocator.ErrInvalidConfig) {
					t.Fatalf("want an invalid configuration saying %q, got %v", tt.wantErr, err)
				}
				// A DEL needs no pool: whatever was asked, it still runs.
				if _, err := ParseReleaseConfig(stickyConf("", tt.top), tt.args, "c0ffee", "eth0", ""); err != nil &&
					strings.Contains(err.Error(), "pool") {
					t.Errorf("a DEL is refused for the pools asked: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(cfg.Request.Pools, tt.want) {
				t.Errorf("pools %q, want %q", cfg.Request.Pools, tt.want)
			}
		})
	}
}
