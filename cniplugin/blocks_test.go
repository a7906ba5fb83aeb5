package cniplugin

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

// blocksConf is a network configuration whose ipam section has the given extra fields
// (`"blocks": ...`, or "" for none) after dual-stack ranges.
func blocksConf(extra string) []byte {
	ipam := `"type": "leasehold", "ranges": [[{"subnet": "10.10.0.0/16"}], [{"subnet": "fd10::/64"}]]`
	if extra != "" {
		ipam += ", " + extra
	}
	return []byte(`{"cniVersion": "1.1.0", "name": "net1", "ipam": {` + ipam + `}}`)
}

// ipam.blocks divides the pool into per-node blocks: it is carried into the request's pool,
// canonical (a family left out gets its default); absent or zero, the pool is sent without
// blocks and the agent takes the stored definition's (DefaultBlocks for a new pool).
func TestParseConfigBlocks(t *testing.T) {
	tests := []struct {
		name    string
		extra   string
		written allocator.Blocks // IPAM.Blocks: as written
		want    allocator.Blocks // Request.Pool.Blocks: canonical
	}{
		{"absent", "", allocator.Blocks{}, allocator.Blocks{}},
		{"empty object", `"blocks": {}`, allocator.Blocks{}, allocator.Blocks{}},
		{"zeros", `"blocks": {"ipv4": 0, "ipv6": 0}`, allocator.Blocks{}, allocator.Blocks{}},
		{"null", `"blocks": null`, allocator.Blocks{}, allocator.Blocks{}},
		{"both", `"blocks": {"ipv4": 26, "ipv6": 122}`, allocator.Blocks{IPv4: 26, IPv6: 122}, allocator.Blocks{IPv4: 26, IPv6: 122}},
		{"ipv4 only", `"blocks": {"ipv4": 28}`, allocator.Blocks{IPv4: 28}, allocator.Blocks{IPv4: 28, IPv6: 122}},
		{"ipv6 only", `"blocks": {"ipv6": 120}`, allocator.Blocks{IPv6: 120}, allocator.Blocks{IPv4: 26, IPv6: 120}},
		{"lower bounds", `"blocks": {"ipv4": 16, "ipv6": 112}`, allocator.Blocks{IPv4: 16, IPv6: 112}, allocator.Blocks{IPv4: 16, IPv6: 112}},
		{"upper bounds", `"blocks": {"ipv4": 30, "ipv6": 126}`, allocator.Blocks{IPv4: 30, IPv6: 126}, allocator.Blocks{IPv4: 30, IPv6: 126}},
		// An IPv4-only pool still has a valid IPv6 length: the pool may grow a set of it.
		{"single family pool", `"blocks": {"ipv4": 24}, "exclude": ["10.10.0.0/24"]`, allocator.Blocks{IPv4: 24}, allocator.Blocks{IPv4: 24, IPv6: 122}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig(blocksConf(tt.extra), "", "c0ffee", "eth0", "")
			if err != nil {
				t.Fatalf("ParseConfig: %v", err)
			}
			if c.IPAM.Blocks != tt.written {
				t.Errorf("IPAM.Blocks = %+v, want %+v as written", c.IPAM.Blocks, tt.written)
			}
			if c.Request.Pool.Blocks != tt.want {
				t.Errorf("Request.Pool.Blocks = %+v, want %+v", c.Request.Pool.Blocks, tt.want)
			}
			again := c.Request.Pool
			if err := again.Canonicalize(); err != nil || !again.Equal(c.Request.Pool) {
				t.Errorf("the request's pool is not canonical: %v, %v", again, err)
			}
			// The agent gets the blocks in the request, and no trace of them when absent.
			b, err := json.Marshal(c.Request)
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Contains(string(b), `"blocks"`); got != !tt.want.Flat() {
				t.Errorf("request JSON %s: has \"blocks\" %v, want %v", b, got, !tt.want.Flat())
			}
			var back allocator.Request
			if err := json.Unmarshal(b, &back); err != nil || back.Pool.Blocks != tt.want {
				t.Errorf("the agent reads blocks %+v (%v), want %+v", back.Pool.Blocks, err, tt.want)
			}
			// GC and STATUS carry the same pool.
			if c.StatusRequest().Pool.Blocks != tt.want {
				t.Errorf("STATUS pool blocks %+v", c.StatusRequest().Pool.Blocks)
			}
		})
	}

	// host-local's legacy single range takes blocks too.
	legacy := []byte(`{"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "leasehold", "subnet": "10.20.0.0/24", "blocks": {"ipv4": 27}}}`)
	if c, err := ParseConfig(legacy, "", "c0ffee", "eth0", ""); err != nil || c.Request.Pool.Blocks != (allocator.Blocks{IPv4: 27, IPv6: 122}) {
		t.Errorf("legacy range with blocks: %v, %v", c, err)
	}
}

func TestParseConfigBlocksInvalid(t *testing.T) {
	tests := []struct {
		name  string
		conf  []byte
		want  []string // the error contains each
		isNot string   // and not this
	}{
		// Out of bounds: named as ipam.blocks, with the family, the length and the bounds.
		{"ipv4 too short", blocksConf(`"blocks": {"ipv4": 15}`), []string{"ipam.blocks: ", "IPv4 block of /15 is out of bounds", "/16 to /30"}, ""},
		{"ipv4 too long", blocksConf(`"blocks": {"ipv4": 31, "ipv6": 122}`), []string{"ipam.blocks: ", "IPv4 block of /31 is out of bounds"}, ""},
		{"ipv4 /32", blocksConf(`"blocks": {"ipv4": 32}`), []string{"ipam.blocks: ", "IPv4 block of /32"}, ""},
		{"ipv4 negative", blocksConf(`"blocks": {"ipv4": -26}`), []string{"ipam.blocks: ", "IPv4 block of /-26"}, ""},
		{"ipv6 too long", blocksConf(`"blocks": {"ipv6": 127}`), []string{"ipam.blocks: ", "IPv6 block of /127 is out of bounds", "/112 to /126"}, ""},
		{"ipv6 a /64", blocksConf(`"blocks": {"ipv4": 26, "ipv6": 64}`), []string{"ipam.blocks: ", "IPv6 block of /64"}, ""},
		{"families swapped", blocksConf(`"blocks": {"ipv4": 122, "ipv6": 26}`), []string{"ipam.blocks: ", "IPv4 block of /122"}, ""},
		// Wrong JSON types and unknown fields name the field.
		{"length as string", blocksConf(`"blocks": {"ipv4": "26"}`), []string{"ipam.blocks.ipv4: got a JSON string, want an integer"}, ""},
		{"fractional length", blocksConf(`"blocks": {"ipv6": 122.5}`), []string{"ipam.blocks.ipv6: got a JSON number"}, ""},
		{"blocks as number", blocksConf(`"blocks": 26`), []string{"ipam.blocks: got a JSON number, want an object"}, ""},
		{"unknown family", blocksConf(`"blocks": {"ipv4": 26, "v6": 122}`), []string{`unknown field "v6"`, "blocks: ipv4, ipv6"}, ""},
		{"misspelt field", blocksConf(`"block": {"ipv4": 26}`), []string{`unknown field "block"`, "blocks"}, ""},
		// Blocks of a pool defined in etcd are its definition's.
		{"no ranges", []byte(`{"cniVersion": "1.1.0", "name": "net1", "ipam": {"type": "leasehold", "pool": "shared", "blocks": {"ipv4": 26}}}`),
			[]string{"ipam.blocks without ranges", `pool "shared"`}, ""},
		// A bad range is the range's fault, not the blocks', even with blocks present.
		{"bad range and blocks", []byte(`{"cniVersion": "1.1.0", "name": "net1", "ipam": {"type": "leasehold", "ranges": [[{"subnet": "10.10.0.1/16"}]], "blocks": {"ipv4": 8}}}`),
			[]string{"ipam: ", "host bits set"}, "ipam.blocks"},
		{"bad exclude and good blocks", blocksConf(`"blocks": {"ipv4": 26}, "exclude": ["fd20::/64", "192.168.0.0/24", "10.10.0.0/16"]`),
			[]string{"ipam: "}, "ipam.blocks"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig(tt.conf, "", "c0ffee", "eth0", "")
			if err == nil {
				t.Fatalf("ParseConfig succeeded with blocks %+v, want an error", c.Request.Pool.Blocks)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if tt.isNot != "" && strings.Contains(err.Error(), tt.isNot) {
				t.Errorf("error %q contains %q", err, tt.isNot)
			}
			if !errors.Is(err, allocator.ErrInvalidConfig) {
				t.Errorf("error %q does not wrap ErrInvalidConfig", err)
			}
			// A release still works: the runtime must be able to tear the sandbox down.
			rel, err := ParseReleaseConfig(tt.conf, "", "c0ffee", "eth0", "")
			if err != nil || rel.Request.Pool.Name == "" || len(rel.Request.Pool.Ranges) != 0 {
				t.Errorf("ParseReleaseConfig = %+v, %v; want the fallback with the pool's name alone", rel, err)
			}
		})
	}
}
