package cniplugin

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
)

func readFixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatalf("reading fixture: %v", err)
	}
	return b
}

// readTemplate reads a fixture with @SOCKET@ and @VERSION@ placeholders filled in.
func readTemplate(t *testing.T, name, socket, version string) []byte {
	t.Helper()
	return []byte(strings.NewReplacer("@SOCKET@", socket, "@VERSION@", version).Replace(string(readFixture(t, name))))
}

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }
func addr(s string) netip.Addr  { return netip.MustParseAddr(s) }

func TestParseConfigValid(t *testing.T) {
	tests := []struct {
		name    string
		fixture string
		cniArgs string
		check   func(t *testing.T, c *Config)
	}{
		// The design's example, a host-local config with only "type" changed, must
		// parse to the canonical pool host-local would have used, with defaults filled.
		{"host-local compatible", "hostlocal.json", "", func(t *testing.T, c *Config) {
			want := allocator.PoolSpec{
				Name: "net1",
				Ranges: []allocator.RangeSet{
					{{Subnet: pfx("10.10.0.0/16"), RangeStart: addr("10.10.1.0"), RangeEnd: addr("10.10.9.255"), Gateway: addr("10.10.0.1")}},
					{{Subnet: pfx("fd10::/64"), RangeStart: addr("fd10::1"), RangeEnd: addr("fd10::ffff:ffff:ffff:ffff"), Gateway: addr("fd10::1")}},
				},
				Exclude: []netip.Prefix{pfx("10.10.1.0/28")},
			}
			if !reflect.DeepEqual(c.Request.Pool, want) {
				t.Errorf("pool\n got %v\nwant %v", c.Request.Pool, want)
			}
			if c.CNIVersion != "1.1.0" || c.Name != "net1" || c.Request.Network != "net1" {
				t.Errorf("version %q name %q network %q", c.CNIVersion, c.Name, c.Request.Network)
			}
			if c.IPAM.Socket != DefaultSocket || c.IPAM.Timeout != DefaultTimeout {
				t.Errorf("socket %q timeout %s, want the defaults", c.IPAM.Socket, c.IPAM.Timeout)
			}
			wantDNS := types.DNS{Nameservers: []string{"10.10.0.10"}, Search: []string{"svc.cluster.local"}}
			if !reflect.DeepEqual(c.IPAM.DNS, wantDNS) {
				t.Errorf("dns %+v, want %+v", c.IPAM.DNS, wantDNS)
			}
			if len(c.Routes) != 2 || c.Routes[0].Priority != 0 || c.Routes[1].Priority != 0 {
				t.Errorf("routes %+v, want two routes with default priority", c.Routes)
			}
			// The ipam section keeps what was written; only the request is canonical.
			if c.IPAM.Ranges[1][0].RangeStart.IsValid() {
				t.Errorf("IPAM.Ranges was canonicalized in place: %v", c.IPAM.Ranges)
			}
		}},
		// host-local's legacy ipam-level subnet becomes its own range set, before "ranges";
		// pool and timeout are honoured.
		{"legacy single range", "legacy.json", "", func(t *testing.T, c *Config) {
			p := c.Request.Pool
			if p.Name != "legacy-pool" || len(p.Ranges) != 2 {
				t.Fatalf("pool %v, want legacy-pool with two range sets", p)
			}
			want := allocator.Range{Subnet: pfx("192.168.50.0/24"), RangeStart: addr("192.168.50.100"),
				RangeEnd: addr("192.168.50.200"), Gateway: addr("192.168.50.1")}
			if p.Ranges[0][0] != want || p.Ranges[1][0].Subnet != pfx("fd50::/64") {
				t.Errorf("ranges %v, want legacy range first", p.Ranges)
			}
			if c.IPAM.Timeout != 5*time.Second {
				t.Errorf("timeout %s, want 5s", c.IPAM.Timeout)
			}
		}},
		// A plain address excludes exactly itself (/32 or /128); a CIDR excludes its block.
		{"exclude address and cidr", "exclude.json", "", func(t *testing.T, c *Config) {
			wantRaw := []netip.Prefix{pfx("10.20.0.5/32"), pfx("10.20.0.64/26"), pfx("fd20::5/128")}
			if !reflect.DeepEqual(c.IPAM.Exclude, wantRaw) {
				t.Errorf("exclude %v, want %v", c.IPAM.Exclude, wantRaw)
			}
			if len(c.Request.Pool.Exclude) != 3 {
				t.Errorf("canonical exclude %v, want three entries", c.Request.Pool.Exclude)
			}
		}},
		// All three sources of requested IPs are read, in host-local's order, the prefix
		// length ignored and the repeat (10.30.0.7 twice) dropped; pod identity comes from
		// CNI_ARGS, unknown keys there are ignored.
		{"requested IPs from all sources", "requested_ips.json",
			"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_UID=0f4c2f3e-1b2a-4c3d-8e9f-a0b1c2d3e4f5;IP=10.30.0.9/24;K8S_POD_INFRA_CONTAINER_ID=abc",
			func(t *testing.T, c *Config) {
				want := []netip.Addr{addr("10.30.0.9"), addr("fd30::7"), addr("10.30.0.7")}
				if !reflect.DeepEqual(c.Request.RequestedIPs, want) {
					t.Errorf("requested %v, want %v", c.Request.RequestedIPs, want)
				}
				wantPod := allocator.PodRef{UID: "0f4c2f3e-1b2a-4c3d-8e9f-a0b1c2d3e4f5", Namespace: "default", Name: "web-0"}
				if c.Request.Pod != wantPod {
					t.Errorf("pod %+v, want %+v", c.Request.Pod, wantPod)
				}
				if c.Request.OwnerID() != wantPod.UID {
					t.Errorf("owner %q, want the pod UID", c.Request.OwnerID())
				}
			}},
		// GC's valid attachments are read from the netconf.
		{"valid attachments", "gc.json", "", func(t *testing.T, c *Config) {
			want := []allocator.Attachment{{ContainerID: "c1", IfName: "eth0"}, {ContainerID: "c2", IfName: "net1"}}
			if got, err := c.GCRequest(); err != nil || !reflect.DeepEqual(got.ValidAttachments, want) || got.Network != "plug" {
				t.Errorf("GC request %+v (%v), want attachments %v", got, err, want)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig(readTemplate(t, tt.fixture, "/run/lh.sock", "1.1.0"), tt.cniArgs, "c0ffee", "eth0", "/var/run/netns/x")
			if err != nil {
				t.Fatalf("ParseConfig: %v", err)
			}
			if c.Request.ContainerID != "c0ffee" || c.Request.IfName != "eth0" || c.Request.Netns != "/var/run/netns/x" {
				t.Errorf("attachment %q %q %q not carried into the request", c.Request.ContainerID, c.Request.IfName, c.Request.Netns)
			}
			tt.check(t, c)
		})
	}
}

func TestParseConfigInvalid(t *testing.T) {
	tests := []struct {
		fixture string
		want    string // the error must contain this
		is      error  // and wrap this
	}{
		// A typo in ipam must not be silently ignored: name the field.
		{"unknown_field.json", `unknown field "rnages"`, allocator.ErrInvalidConfig},
		// host-local's own settings get a specific hint.
		{"host_local_datadir.json", `"dataDir": it is a host-local setting`, allocator.ErrInvalidConfig},
		// Strictness reaches into range entries, too.
		{"unknown_range_field.json", `unknown field "rangestop"`, allocator.ErrInvalidConfig},
		{"unknown_route_field.json", `unknown field "via"`, allocator.ErrInvalidConfig},
		// Wrong JSON types name the field and what was expected.
		{"wrong_type_subnet.json", "ipam.ranges.subnet: got a JSON number, want a string", allocator.ErrInvalidConfig},
		{"wrong_type_mtu.json", "ipam.routes.mtu: got a JSON string, want an integer", allocator.ErrInvalidConfig},
		{"wrong_type_ipam.json", "ipam: got a JSON array, want an object", allocator.ErrInvalidConfig},
		{"wrong_type_args_ips.json", "args.cni.ips: got a JSON string, want a list", allocator.ErrInvalidConfig},
		// Unparsable addresses name their place in the config.
		{"bad_cidr.json", `ipam.ranges[0][0].subnet "10.0.0/24" is not a CIDR`, allocator.ErrInvalidConfig},
		{"bad_rangeend.json", `ipam.ranges[0][0].rangeEnd "ten" is not an IP address`, allocator.ErrInvalidConfig},
		{"bad_exclude.json", `ipam.exclude[0]: "10.0.0.x"`, allocator.ErrInvalidConfig},
		// Semantic range checks come from allocator's Canonicalize.
		{"host_bits.json", "host bits set", allocator.ErrInvalidConfig},
		{"rangestart_outside.json", "rangeStart 10.0.1.10 lies outside subnet 10.0.0.0/24", allocator.ErrInvalidConfig},
		{"overlap_in_set.json", "overlaps", allocator.ErrInvalidConfig},
		{"overlap_across_sets.json", "range sets must not share addresses", allocator.ErrInvalidConfig},
		// The pool name becomes an etcd key component.
		{"bad_pool_name.json", `pool name "team/a"`, allocator.ErrInvalidName},
		// Missing pieces say what to add.
		{"no_ipam.json", `no "ipam" object`, allocator.ErrInvalidConfig},
		{"no_ranges.json", "ipam has no ranges", allocator.ErrInvalidConfig},
		{"legacy_no_subnet.json", "but no subnet", allocator.ErrInvalidConfig},
		{"no_version.json", "no cniVersion", allocator.ErrInvalidConfig},
		// Plugin-side settings.
		{"bad_timeout.json", `ipam.timeout "30" is not a positive duration`, allocator.ErrInvalidConfig},
		{"relative_socket.json", "not an absolute path", allocator.ErrInvalidConfig},
		// A runtime-supplied range would silently differ from the stored pool.
		{"runtime_ipranges.json", "runtimeConfig.ipRanges is not supported", allocator.ErrInvalidConfig},
		// Not JSON at all: reported as undecodable (CNI code 6).
		{"not_json.json", "network configuration", ErrUndecodable},
		// Routes (see also TestResolveRoutes).
		{"route_dup_priority.json", "both go to ::/0 with priority 100", allocator.ErrInvalidConfig},
		{"route_auto_collides.json", "would get priority 1024", allocator.ErrInvalidConfig},
		{"route_gw_family.json", "different address families", allocator.ErrInvalidConfig},
		// A second router inside the range would one day be handed to a pod.
		{"route_gw_in_range.json", `gateway 10.0.0.2 lies inside a range of pool n, so the pool could hand the router's address to a pod; add "10.0.0.2" to "exclude"`, allocator.ErrInvalidConfig},
		{"route_gw_offlink.json", "gateway 192.168.1.1 is not on-link: it lies in no subnet of pool n; add the subnet or drop gw", allocator.ErrInvalidConfig},
		{"route_no_family.json", "pool n has no IPv6 range set", allocator.ErrInvalidConfig},
		{"route_bad_dst.json", `ipam.routes[0].dst "default" is not a CIDR`, allocator.ErrInvalidConfig},
		{"route_dst_host_bits.json", "did you mean 192.168.0.0/16?", allocator.ErrInvalidConfig},
	}
	for _, tt := range tests {
		t.Run(strings.TrimSuffix(tt.fixture, ".json"), func(t *testing.T) {
			_, err := ParseConfig(readFixture(t, filepath.Join("invalid", tt.fixture)), "", "c0ffee", "eth0", "")
			if err == nil {
				t.Fatalf("ParseConfig succeeded, want an error containing %q", tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not contain %q", err, tt.want)
			}
			if !errors.Is(err, tt.is) {
				t.Errorf("error %q does not wrap %v", err, tt.is)
			}
			if !errors.Is(err, allocator.ErrInvalidConfig) && !errors.Is(err, allocator.ErrInvalidName) {
				t.Errorf("error %q wraps neither ErrInvalidConfig nor ErrInvalidName", err)
			}
		})
	}
}

func TestParseConfigAttachment(t *testing.T) {
	conf := readFixture(t, "hostlocal.json")
	tests := []struct {
		name        string
		containerID string
		ifName      string
		cniArgs     string
		want        string
		is          error
	}{
		// A '/' would split the etcd key: refused before anything leaves the plugin.
		{"container ID with slash", "abc/def", "eth0", "", `container ID name "abc/def"`, allocator.ErrInvalidName},
		{"interface with slash", "abc", "eth0/1", "", `interface name "eth0/1"`, allocator.ErrInvalidName},
		{"pod UID with slash", "abc", "eth0", "K8S_POD_UID=../../x", "K8S_POD_UID", allocator.ErrInvalidName},
		// Malformed CNI_ARGS pairs are errors; unknown keys are not.
		{"malformed pair", "abc", "eth0", "IgnoreUnknown=1;garbage", `"garbage" is not a KEY=VALUE pair`, allocator.ErrInvalidConfig},
		// A bad requested address is named with its source.
		{"bad IP arg", "abc", "eth0", "IP=10.0.0.300", `CNI_ARGS IP: "10.0.0.300" is not an IP address`, allocator.ErrInvalidConfig},
		// Two different pod UIDs cannot both be the owner.
		{"conflicting UID", "abc", "eth0", "K8S_POD_UID=a;K8S_POD_UID=b", "gives K8S_POD_UID twice", allocator.ErrInvalidConfig},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig(conf, tt.cniArgs, tt.containerID, tt.ifName, "")
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, tt.is) {
				t.Errorf("error %v, want one containing %q wrapping %v", err, tt.want, tt.is)
			}
		})
	}
	// GC and STATUS have no attachment: empty names are fine.
	if _, err := ParseConfig(conf, "", "", "", ""); err != nil {
		t.Errorf("ParseConfig without attachment: %v", err)
	}
}

func TestParseCNIArgs(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want CNIArgs
	}{
		// Runtimes may pass nothing.
		{"empty", "", CNIArgs{}},
		// A trailing separator is harmless.
		{"trailing semicolon", "K8S_POD_NAME=a;", CNIArgs{Pod: allocator.PodRef{Name: "a"}}},
		// Several addresses, spaces and prefix lengths, as host-local accepts them.
		{"ip list", "IP=10.0.0.1, fd00::1/64", CNIArgs{IPs: []netip.Addr{addr("10.0.0.1"), addr("fd00::1")}}},
		// IPv4-mapped IPv6 is the IPv4 address.
		{"mapped", "IP=::ffff:10.0.0.1", CNIArgs{IPs: []netip.Addr{addr("10.0.0.1")}}},
		// Keys are case-sensitive, as in the CNI library: "ip" is some other plugin's key.
		{"lower-case key ignored", "ip=nonsense", CNIArgs{}},
		// An empty IP= requests nothing, as in host-local.
		{"empty IP", "IP=;K8S_POD_NAME=a", CNIArgs{Pod: allocator.PodRef{Name: "a"}}},
		// A value may contain '=' (some runtimes pass base64).
		{"equals in value", "FOO=a=b;K8S_POD_NAMESPACE=ns", CNIArgs{Pod: allocator.PodRef{Namespace: "ns"}}},
		// The runtime may name a sticky claim.
		{"claim", "K8S_POD_NAME=a;LEASEHOLD_CLAIM=vm-1", CNIArgs{Pod: allocator.PodRef{Name: "a"}, Claim: "vm-1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseCNIArgs(tt.in)
			if err != nil {
				t.Fatalf("ParseCNIArgs(%q): %v", tt.in, err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("ParseCNIArgs(%q) = %+v, want %+v", tt.in, got, tt.want)
			}
		})
	}
}
