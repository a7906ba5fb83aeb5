package cniplugin

import (
	"errors"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

// TestParseReleaseConfig: DEL and GC work from configurations that ParseConfig refuses, as
// long as the names the keys are made of can be read; names that cannot be key parts are
// still refused.
func TestParseReleaseConfig(t *testing.T) {
	tests := []struct {
		name     string
		conf     string
		args     string
		wantPool string
		wantSock string
		wantErr  error
	}{
		// Valid configuration: the full parse, ranges included.
		{"valid", `{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","ranges":[[{"subnet":"10.0.0.0/24"}]]}}`, "", "net1", DefaultSocket, nil},
		// A route refused since the ADD (off-link gateway): DEL still finds the pool by name.
		{"refused route", `{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","socket":"/run/x.sock","pool":"shared","ranges":[[{"subnet":"10.0.0.0/24"}]],"routes":[{"dst":"0.0.0.0/0","gw":"192.168.1.1"}]}}`, "", "shared", "/run/x.sock", nil},
		// Ranges that no longer parse and an unknown field: still released by name.
		{"broken ranges", `{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","ranges":"10.0.0.0/24","typo":1}}`, "K8S_POD_UID=abc", "net1", DefaultSocket, nil},
		// No name to build keys from: nothing can be found, refused.
		{"bad network name", `{"cniVersion":"1.1.0","name":"../x","ipam":{"ranges":"x"}}`, "", "", "", allocator.ErrInvalidName},
		// A pod UID that is not a key part stays refused.
		{"bad pod uid", `{"cniVersion":"1.1.0","name":"net1","ipam":{"ranges":"x"}}`, "K8S_POD_UID=a/b", "", "", allocator.ErrInvalidName},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := ParseReleaseConfig([]byte(tc.conf), tc.args, "ctr1", "eth0", "")
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("want %v, got %v", tc.wantErr, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Request.Pool.Name != tc.wantPool || cfg.IPAM.Socket != tc.wantSock || cfg.Request.ContainerID != "ctr1" {
				t.Errorf("pool %q socket %q container %q; want pool %q socket %q", cfg.Request.Pool.Name, cfg.IPAM.Socket,
					cfg.Request.ContainerID, tc.wantPool, tc.wantSock)
			}
		})
	}
}
