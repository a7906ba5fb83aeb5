package cniplugin

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
)

func TestPrintResultVersions(t *testing.T) {
	alloc := allocator.Result{IPs: []allocator.IPConfig{
		{Address: pfx("10.40.3.7/16"), Gateway: addr("10.40.0.1")},
		{Address: pfx("fd40::7/64"), Gateway: addr("fd40::1")},
	}}
	routes := []Route{
		{Dst: pfx("0.0.0.0/0"), GW: addr("10.40.0.1"), Priority: 1024},
		{Dst: pfx("0.0.0.0/0"), GW: addr("10.40.0.2"), Priority: 1025, Table: intp(100)},
	}
	res := NewResult(alloc, routes, types.DNS{Nameservers: []string{"10.40.0.10"}})
	tests := []struct {
		version   string
		ipVersion bool // 0.3.x and 0.4.0 results tag each address with "version"
	}{
		// Each version the plugin advertises must print; the 0.x ones through types/040.
		{"0.3.0", true},
		{"0.3.1", true},
		{"0.4.0", true},
		{"1.0.0", false},
		{"1.1.0", false},
	}
	for _, tt := range tests {
		t.Run(tt.version, func(t *testing.T) {
			var buf bytes.Buffer
			if err := PrintResult(&buf, res, tt.version); err != nil {
				t.Fatalf("PrintResult: %v", err)
			}
			var got struct {
				CNIVersion string           `json:"cniVersion"`
				IPs        []map[string]any `json:"ips"`
				Routes     []map[string]any `json:"routes"`
				DNS        types.DNS        `json:"dns"`
			}
			if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
				t.Fatalf("output is not JSON: %v\n%s", err, buf.String())
			}
			if got.CNIVersion != tt.version {
				t.Errorf("cniVersion %q, want %q", got.CNIVersion, tt.version)
			}
			if len(got.IPs) != 2 || got.IPs[0]["address"] != "10.40.3.7/16" || got.IPs[0]["gateway"] != "10.40.0.1" ||
				got.IPs[1]["address"] != "fd40::7/64" {
				t.Errorf("ips %v", got.IPs)
			}
			for _, ip := range got.IPs {
				if _, ok := ip["interface"]; ok {
					t.Errorf("ip %v has an interface index; an IPAM plugin creates no interface", ip)
				}
				if _, ok := ip["version"]; ok != tt.ipVersion {
					t.Errorf("ip %v: version field present %v, want %v", ip, ok, tt.ipVersion)
				}
			}
			if tt.ipVersion && (got.IPs[0]["version"] != "4" || got.IPs[1]["version"] != "6") {
				t.Errorf("ip versions %v %v, want 4 and 6", got.IPs[0]["version"], got.IPs[1]["version"])
			}
			if len(got.Routes) != 2 || got.Routes[0]["priority"] != float64(1024) || got.Routes[1]["priority"] != float64(1025) ||
				got.Routes[1]["table"] != float64(100) {
				t.Errorf("routes %v lost their priorities or table", got.Routes)
			}
			if len(got.DNS.Nameservers) != 1 {
				t.Errorf("dns %+v", got.DNS)
			}
		})
	}
}

func TestNewResultWithoutGatewayOrDNS(t *testing.T) {
	// A range set may have no gateway in the agent's answer; the result must then omit
	// "gateway" and "dns" rather than print empty values.
	res := NewResult(allocator.Result{IPs: []allocator.IPConfig{{Address: pfx("fd40::7/64")}}}, nil, types.DNS{})
	var buf bytes.Buffer
	if err := PrintResult(&buf, res, "1.1.0"); err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if _, ok := got["dns"]; ok {
		t.Errorf("empty dns printed: %s", buf.String())
	}
	if ip := got["ips"].([]any)[0].(map[string]any); ip["gateway"] != nil {
		t.Errorf("zero gateway printed: %s", buf.String())
	}
}
