package cniplugin

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

// FuzzParseConfig feeds arbitrary network configurations and runtime arguments to the
// parser the plugin runs before anything reaches the agent. Properties:
//
//   - ParseConfig and ParseReleaseConfig never panic;
//   - an error wraps allocator.ErrInvalidConfig or allocator.ErrInvalidName (an
//     undecodable configuration also ErrUndecodable), so the plugin reports code 6 or 7
//     and nothing else leaks; its message carries no raw NUL or newline (it ends up in
//     the runtime's events and logs);
//   - on success, every name that becomes a key part passes allocator.ValidateName:
//     network, pool, and container ID, interface and pod UID when given;
//   - on success with ranges, the pool is canonical: canonicalizing a copy again gives an
//     Equal spec, and the IPAM ranges as written are not the pool's (no aliasing);
//   - requested addresses are valid, unzoned, IPv4 unmapped, without repeats, and the
//     agent's own check (MatchRequested) answers for them with nil or ErrNotInRange;
//     ParseConfig does not promise that they lie in the pool (the agent refuses those
//     with code 100, naming the address);
//   - routes of one same-destination group (destination, table, scope) of two or more
//     carry distinct non-zero priorities (the rule against the route family split,
//     docs/field-failures.md);
//   - a claim is valid (ValidateName) and only given to an invocation that names an
//     attachment, its hold is never negative, and a hold comes only with a claim;
//   - ParseReleaseConfig returns exactly ParseConfig's configuration when ParseConfig
//     succeeds; when it falls back, its names still pass ValidateName, its pool has no
//     ranges and its request no claim.
//
// Seeds: testdata/fuzz/FuzzParseConfig (host-local configurations, legacy single range,
// dual stack, /8 and ::/0, hostile names, deep nesting, long strings, NUL, duplicate keys).
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","ranges":[[{"subnet":"10.10.0.0/16"}],[{"subnet":"fd10::/64"}]]}}`),
		"K8S_POD_UID=uid-1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", "c0ffee", "eth0", "/var/run/netns/x")
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","ranges":[[{"subnet":"10.10.0.0/16"}],[{"subnet":"fd10::/64"}]],"blocks":{"ipv4":28}}}`),
		"", "c0ffee", "eth0", "")
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","ranges":[[{"subnet":"10.10.0.0/16"}]],"sticky":true,"stickyHold":"10m"}}`),
		"K8S_POD_UID=uid-1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", "c0ffee", "eth0", "")
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"net1","args":{"cni":{"claim":"vm-a"}},"ipam":{"type":"leasehold","pool":"shared","sticky":true}}`),
		"LEASEHOLD_CLAIM=vm-a", "c0ffee", "eth0", "")
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","pool":"shared","sticky":true,"stickyHold":"-1s"}}`),
		"LEASEHOLD_CLAIM=a;LEASEHOLD_CLAIM=b", "c0ffee", "eth0", "")
	f.Fuzz(func(t *testing.T, stdin []byte, cniArgs, containerID, ifName, netns string) {
		cfg, err := ParseConfig(stdin, cniArgs, containerID, ifName, netns)
		rel, relErr := ParseReleaseConfig(stdin, cniArgs, containerID, ifName, netns)
		if err != nil {
			checkParseError(t, "ParseConfig", err)
			if relErr != nil {
				checkParseError(t, "ParseReleaseConfig", relErr)
				return
			}
			checkNames(t, "ParseReleaseConfig fallback", rel)
			if len(rel.Request.Pool.Ranges) != 0 || rel.Request.Pool.Name != rel.IPAM.Pool {
				t.Errorf("ParseReleaseConfig fallback pool %+v, want only the name %q", rel.Request.Pool, rel.IPAM.Pool)
			}
			if rel.Request.Claim != "" || rel.Request.ClaimHold != 0 {
				t.Errorf("ParseReleaseConfig fallback has claim %q hold %s, want none", rel.Request.Claim, rel.Request.ClaimHold)
			}
			return
		}
		if relErr != nil || !reflect.DeepEqual(rel, cfg) {
			t.Fatalf("ParseConfig succeeded with %+v but ParseReleaseConfig gave %+v, %v", cfg, rel, relErr)
		}
		checkNames(t, "ParseConfig", cfg)
		if r := cfg.Request; r.ClaimHold < 0 || r.ClaimHold != 0 && r.Claim == "" ||
			r.Claim != "" && containerID == "" && ifName == "" {
			t.Errorf("claim %q hold %s for attachment %q %q: a hold without a claim, a negative hold, or a claim without attachment",
				r.Claim, r.ClaimHold, containerID, ifName)
		}
		if cfg.Request.Netns != netns || cfg.Request.ContainerID != containerID || cfg.Request.IfName != ifName {
			t.Errorf("attachment %q %q %q, want %q %q %q", cfg.Request.ContainerID, cfg.Request.IfName, cfg.Request.Netns,
				containerID, ifName, netns)
		}

		pool := cfg.Request.Pool
		if len(pool.Ranges) > 0 {
			again := pool
			if err := again.Canonicalize(); err != nil || !again.Equal(pool) {
				t.Errorf("pool is not canonical: canonicalizing %s again gives %s, %v", pool, again, err)
			}
			if len(cfg.IPAM.Ranges) > 0 && len(cfg.IPAM.Ranges[0]) > 0 && &cfg.IPAM.Ranges[0][0] == &pool.Ranges[0][0] {
				t.Errorf("the request's pool shares its ranges with IPAM.Ranges")
			}
		}

		seen := map[netip.Addr]bool{}
		for _, a := range cfg.Request.RequestedIPs {
			if !a.IsValid() || a.Zone() != "" || a.Is4In6() || seen[a] {
				t.Errorf("requested address %v (zone %q) is invalid, zoned, IPv4-mapped or repeated in %v", a, a.Zone(), cfg.Request.RequestedIPs)
			}
			seen[a] = true
		}
		if len(pool.Ranges) > 0 {
			if _, err := pool.MatchRequested(cfg.Request.RequestedIPs); err != nil && !errors.Is(err, allocator.ErrNotInRange) {
				t.Errorf("MatchRequested(%v): %v does not wrap ErrNotInRange", cfg.Request.RequestedIPs, err)
			}
		}

		type group struct {
			dst          netip.Prefix
			table, scope int
		}
		groups := map[group][]int{}
		for i, r := range cfg.Routes {
			g := group{r.Dst, 254, 0}
			if r.Table != nil {
				g.table = *r.Table
			}
			if r.Scope != nil {
				g.scope = *r.Scope
			}
			groups[g] = append(groups[g], i)
		}
		for g, members := range groups {
			if len(members) < 2 {
				continue
			}
			prio := map[int]int{}
			for _, i := range members {
				p := cfg.Routes[i].Priority
				if j, dup := prio[p]; dup || p == 0 {
					t.Errorf("routes %d and %d to %s share priority %d (or it is 0)", j, i, g.dst, p)
				}
				prio[p] = i
			}
		}
	})
}

// checkParseError asserts that err is one of the kinds the plugin maps to code 6 or 7.
func checkParseError(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, allocator.ErrInvalidConfig) && !errors.Is(err, allocator.ErrInvalidName) {
		t.Errorf("%s: error %q (%T) wraps neither ErrInvalidConfig nor ErrInvalidName", what, err, err)
	}
	if errors.Is(err, ErrUndecodable) && !errors.Is(err, allocator.ErrInvalidConfig) {
		t.Errorf("%s: undecodable error %q does not also wrap ErrInvalidConfig", what, err)
	}
	if msg := err.Error(); msg == "" || strings.ContainsAny(msg, "\x00\n") {
		t.Errorf("%s: error message %q is empty or carries a raw NUL or newline", what, msg)
	}
}

// checkNames asserts that every name of cfg that becomes a key part is valid.
func checkNames(t *testing.T, what string, cfg *Config) {
	t.Helper()
	r := cfg.Request
	names := []struct{ kind, v string }{{"network", r.Network}, {"pool", r.Pool.Name}}
	for _, opt := range []struct{ kind, v string }{{"container ID", r.ContainerID}, {"interface", r.IfName}, {"pod UID", r.Pod.UID}, {"claim", r.Claim}} {
		if opt.v != "" {
			names = append(names, opt)
		}
	}
	for _, n := range names {
		if err := allocator.ValidateName(n.kind, n.v); err != nil {
			t.Errorf("%s accepted a key part that ValidateName refuses: %v", what, err)
		}
	}
	if r.Network != cfg.Name {
		t.Errorf("%s: request network %q, configuration name %q", what, r.Network, cfg.Name)
	}
}

// FuzzParseCNIArgs checks the CNI_ARGS parser. Properties:
//
//   - it never panics, and gives the same answer for the same input;
//   - an error wraps allocator.ErrInvalidConfig;
//   - on success, the K8S_POD_* and LEASEHOLD_CLAIM values contain no ';', the addresses are valid, unzoned
//     and IPv4 unmapped, and writing the result back as CNI_ARGS parses to the same
//     result;
//   - the runtime's framing does not change the meaning: a trailing ';' and an
//     IgnoreUnknown=1 (or any unknown key) in front give the same result.
//
// Seeds: testdata/fuzz/FuzzParseCNIArgs.
func FuzzParseCNIArgs(f *testing.F) {
	f.Add("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=uid-1")
	f.Add("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;LEASEHOLD_CLAIM=ns.p;LEASEHOLD_CLAIM=x")
	f.Fuzz(func(t *testing.T, s string) {
		got, err := ParseCNIArgs(s)
		got2, err2 := ParseCNIArgs(s)
		if !reflect.DeepEqual(got, got2) || (err == nil) != (err2 == nil) || err != nil && err.Error() != err2.Error() {
			t.Fatalf("ParseCNIArgs(%q) is not deterministic: %+v, %v then %+v, %v", s, got, err, got2, err2)
		}
		if err != nil {
			if !errors.Is(err, allocator.ErrInvalidConfig) {
				t.Errorf("error %v does not wrap ErrInvalidConfig", err)
			}
			return
		}
		for _, v := range []string{got.Pod.UID, got.Pod.Namespace, got.Pod.Name, got.Claim} {
			if strings.Contains(v, ";") {
				t.Errorf("value %q contains ';'", v)
			}
		}
		var ips []string
		for _, a := range got.IPs {
			if !a.IsValid() || a.Zone() != "" || a.Is4In6() {
				t.Errorf("address %v is invalid, zoned or IPv4-mapped", a)
			}
			ips = append(ips, a.String())
		}
		var parts []string
		if len(ips) > 0 {
			parts = append(parts, "IP="+strings.Join(ips, ","))
		}
		for _, kv := range []struct{ k, v string }{{"K8S_POD_UID", got.Pod.UID}, {"K8S_POD_NAMESPACE", got.Pod.Namespace}, {"K8S_POD_NAME", got.Pod.Name}, {"LEASEHOLD_CLAIM", got.Claim}} {
			if kv.v != "" {
				parts = append(parts, kv.k+"="+kv.v)
			}
		}
		rebuilt := strings.Join(parts, ";")
		if back, err := ParseCNIArgs(rebuilt); err != nil || !sameArgs(back, got) {
			t.Errorf("%q parsed to %+v; written back as %q it parses to %+v, %v", s, got, rebuilt, back, err)
		}
		for _, framed := range []string{s + ";", "IgnoreUnknown=1;" + s, "K8S_POD_INFRA_CONTAINER_ID=x;" + s} {
			if back, err := ParseCNIArgs(framed); err != nil || !sameArgs(back, got) {
				t.Errorf("%q parsed to %+v but %q to %+v, %v", s, got, framed, back, err)
			}
		}
	})
}

// sameArgs compares two parses, treating a nil and an empty address list alike.
func sameArgs(a, b CNIArgs) bool {
	return a.Pod == b.Pod && a.Claim == b.Claim && fmt.Sprint(a.IPs) == fmt.Sprint(b.IPs)
}
