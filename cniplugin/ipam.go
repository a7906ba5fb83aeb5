package cniplugin

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
)

// IPAMConfig is the "ipam" object of the network configuration, as written (defaults
// filled, nothing canonicalized). Its format follows host-local's:
//
//	"ipam": {
//	  "type": "leasehold",
//	  "socket": "/run/leasehold/leaseholdd.sock",
//	  "timeout": "30s",
//	  "pool": "net1",
//	  "ranges": [[{"subnet": "10.10.0.0/16", "rangeStart": "10.10.1.0", "rangeEnd": "10.10.9.255", "gateway": "10.10.0.1"}],
//	             [{"subnet": "fd10::/64"}]],
//	  "subnet": "...", "rangeStart": "...", "rangeEnd": "...", "gateway": "...",
//	  "exclude": ["10.10.1.0/28", "10.10.2.1"],
//	  "blocks": {"ipv4": 26, "ipv6": 122},
//	  "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
//	  "dns": {"nameservers": ["10.10.0.10"], "search": ["svc.cluster.local"]},
//	  "sticky": true,
//	  "stickyHold": "10m",
//	  "migratable": true
//	}
//
// The top-level subnet/rangeStart/rangeEnd/gateway is host-local's legacy single-range
// form; as in host-local it becomes a range set of its own, placed before "ranges".
//
// "blocks" divides the pool into per-node blocks of the given prefix lengths (see
// allocator.Blocks); a family left out gets its default. Absent (or all zero) leaves the
// layout to the agent: the stored definition's, and allocator.DefaultBlocks for a new pool.
// It needs "ranges": the blocks of a pool defined in etcd are part of that definition.
//
// "sticky" names each attachment's claim after its pod, <namespace>.<name> from CNI_ARGS
// K8S_POD_NAMESPACE and K8S_POD_NAME (docs/proposals/sticky.md); a claim named by the
// runtime (CNI_ARGS LEASEHOLD_CLAIM, args.cni.claim) takes precedence and needs no
// "sticky". "stickyHold" is how long a released claim keeps its addresses, a positive
// duration; absent, the agent's default. It needs a claim (see ParseConfig). "migratable"
// lets a live migration's target, on another node, hold the claim's addresses while its
// source runs (docs/proposals/live-migration.md); the network's top-level
// "allowPersistentIPs": true does the same.
type IPAMConfig struct {
	// Type is the plugin type ("leasehold"); not checked.
	Type string
	// Socket is the agent's unix socket, DefaultSocket when unset.
	Socket string
	// Timeout bounds the whole conversation with the agent, DefaultTimeout when unset.
	Timeout time.Duration
	// Pool is the pool name; the network name when unset.
	Pool string
	// Ranges are the range sets, legacy single range first.
	Ranges []allocator.RangeSet
	// Exclude are addresses never handed out; a plain address became a /32 or /128.
	Exclude []netip.Prefix
	// Blocks are the block prefix lengths as written, zero when absent (defaults are
	// filled in the request's pool, not here).
	Blocks allocator.Blocks
	// Routes are the routes as written (see ResolveRoutes for what is returned).
	Routes []Route
	// DNS is copied into the result.
	DNS types.DNS
	// Sticky names the attachment's claim after its pod (see ParseConfig).
	Sticky bool
	// StickyHold is ipam.stickyHold, zero when absent (the agent's default).
	StickyHold time.Duration
	// Migratable is ipam.migratable.
	Migratable bool
}

// rawIPAM is the ipam object; every field is ours, so unknown ones are refused.
type rawIPAM struct {
	Type       string       `json:"type"`
	Socket     string       `json:"socket"`
	Timeout    string       `json:"timeout"`
	Pool       string       `json:"pool"`
	Ranges     [][]rawRange `json:"ranges"`
	Subnet     string       `json:"subnet"`
	RangeStart string       `json:"rangeStart"`
	RangeEnd   string       `json:"rangeEnd"`
	Gateway    string       `json:"gateway"`
	Exclude    []string     `json:"exclude"`
	Blocks     *rawBlocks   `json:"blocks"`
	Routes     []rawRoute   `json:"routes"`
	DNS        types.DNS    `json:"dns"`
	Sticky     bool         `json:"sticky"`
	StickyHold string       `json:"stickyHold"`
	Migratable bool         `json:"migratable"`
}

// rawBlocks is ipam.blocks: a block prefix length per family, 0 when not given.
type rawBlocks struct {
	IPv4 int `json:"ipv4"`
	IPv6 int `json:"ipv6"`
}

type rawRange struct {
	Subnet     string `json:"subnet"`
	RangeStart string `json:"rangeStart"`
	RangeEnd   string `json:"rangeEnd"`
	Gateway    string `json:"gateway"`
}

// parseIPAM decodes and checks the ipam object; errors wrap allocator.ErrInvalidConfig.
func parseIPAM(data json.RawMessage) (*IPAMConfig, error) {
	if len(bytes.TrimSpace(data)) == 0 || string(bytes.TrimSpace(data)) == "null" {
		return nil, fmt.Errorf("%w: network configuration has no \"ipam\" object; add "+
			"\"ipam\": {\"type\": \"leasehold\", \"ranges\": [[{\"subnet\": \"10.10.0.0/16\"}]]}",
			allocator.ErrInvalidConfig)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var raw rawIPAM
	if err := dec.Decode(&raw); err != nil {
		return nil, jsonError("ipam", err)
	}
	out := &IPAMConfig{Type: raw.Type, Socket: raw.Socket, Pool: raw.Pool, DNS: raw.DNS, Timeout: DefaultTimeout, Sticky: raw.Sticky,
		Migratable: raw.Migratable}
	if out.Socket == "" {
		out.Socket = DefaultSocket
	} else if !filepath.IsAbs(out.Socket) {
		return nil, fmt.Errorf("%w: ipam.socket %q is not an absolute path; give the full path of leaseholdd's socket",
			allocator.ErrInvalidConfig, out.Socket)
	}
	if raw.Timeout != "" {
		d, err := time.ParseDuration(raw.Timeout)
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("%w: ipam.timeout %q is not a positive duration; write it like \"30s\" or \"1m\"",
				allocator.ErrInvalidConfig, raw.Timeout)
		}
		out.Timeout = d
	}
	if raw.StickyHold != "" {
		d, err := time.ParseDuration(raw.StickyHold)
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("%w: ipam.stickyHold %q is not a positive duration; write it like \"10m\" or \"1h\", "+
				"or leave it out for the agent's default", allocator.ErrInvalidConfig, raw.StickyHold)
		}
		out.StickyHold = d
	}

	legacy := rawRange{Subnet: raw.Subnet, RangeStart: raw.RangeStart, RangeEnd: raw.RangeEnd, Gateway: raw.Gateway}
	if legacy != (rawRange{}) {
		if legacy.Subnet == "" {
			return nil, fmt.Errorf("%w: ipam has rangeStart, rangeEnd or gateway but no subnet; "+
				"add ipam.subnet or move them into ipam.ranges", allocator.ErrInvalidConfig)
		}
		r, err := parseRange("ipam", legacy)
		if err != nil {
			return nil, err
		}
		out.Ranges = append(out.Ranges, allocator.RangeSet{r})
	}
	for i, set := range raw.Ranges {
		rs := make(allocator.RangeSet, 0, len(set))
		for j, rr := range set {
			r, err := parseRange(fmt.Sprintf("ipam.ranges[%d][%d]", i, j), rr)
			if err != nil {
				return nil, err
			}
			rs = append(rs, r)
		}
		out.Ranges = append(out.Ranges, rs)
	}
	if len(out.Ranges) == 0 && raw.Pool == "" {
		return nil, fmt.Errorf("%w: ipam has no ranges; add \"ranges\": [[{\"subnet\": \"10.10.0.0/16\"}]] "+
			"(or host-local's single \"subnet\"), or name a pool defined in etcd with \"pool\"", allocator.ErrInvalidConfig)
	}
	if len(out.Ranges) == 0 && len(raw.Exclude) > 0 {
		return nil, fmt.Errorf("%w: ipam.exclude without ranges: excluded addresses belong to the definition of pool %q "+
			"in etcd; give them with leaseholdctl pool create --exclude, or give the ranges here too",
			allocator.ErrInvalidConfig, raw.Pool)
	}
	if raw.Blocks != nil {
		out.Blocks = allocator.Blocks{IPv4: raw.Blocks.IPv4, IPv6: raw.Blocks.IPv6}
	}
	if len(out.Ranges) == 0 && !out.Blocks.Flat() {
		return nil, fmt.Errorf("%w: ipam.blocks without ranges: the blocks of pool %q belong to its definition in etcd, "+
			"fixed when the pool was created; remove \"blocks\", or give the ranges here too",
			allocator.ErrInvalidConfig, raw.Pool)
	}
	for i, s := range raw.Exclude {
		p, err := parseExclude(s)
		if err != nil {
			return nil, fmt.Errorf("%w: ipam.exclude[%d]: %q is neither a CIDR (10.10.1.0/28) nor an address (10.10.1.5)",
				allocator.ErrInvalidConfig, i, s)
		}
		out.Exclude = append(out.Exclude, p)
	}
	routes, err := parseRoutes(raw.Routes)
	if err != nil {
		return nil, err
	}
	out.Routes = routes
	return out, nil
}

// parseRange parses one range's text fields; where names it for errors.
func parseRange(where string, rr rawRange) (allocator.Range, error) {
	var r allocator.Range
	if rr.Subnet == "" {
		return r, fmt.Errorf("%w: %s has no subnet; set \"subnet\" to a CIDR such as 10.10.0.0/16",
			allocator.ErrInvalidConfig, where)
	}
	p, err := netip.ParsePrefix(rr.Subnet)
	if err != nil {
		return r, fmt.Errorf("%w: %s.subnet %q is not a CIDR; write it like 10.10.0.0/16 or fd10::/64",
			allocator.ErrInvalidConfig, where, rr.Subnet)
	}
	r.Subnet = p
	for _, f := range []struct {
		name string
		text string
		dst  *netip.Addr
	}{{"rangeStart", rr.RangeStart, &r.RangeStart}, {"rangeEnd", rr.RangeEnd, &r.RangeEnd}, {"gateway", rr.Gateway, &r.Gateway}} {
		if f.text == "" {
			continue
		}
		a, err := netip.ParseAddr(f.text)
		if err != nil {
			return r, fmt.Errorf("%w: %s.%s %q is not an IP address; write a plain address such as 10.10.1.0",
				allocator.ErrInvalidConfig, where, f.name, f.text)
		}
		*f.dst = a
	}
	return r, nil
}

// parseExclude accepts a CIDR or a plain address (a /32 or /128).
func parseExclude(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		return netip.ParsePrefix(s)
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

func cloneRanges(in []allocator.RangeSet) []allocator.RangeSet {
	out := make([]allocator.RangeSet, len(in))
	for i, s := range in {
		out[i] = slices.Clone(s)
	}
	return out
}

// hostLocalOnly are ipam fields of host-local that have no meaning for leasehold.
var hostLocalOnly = map[string]string{
	"dataDir":    "leasehold keeps its state in etcd, not on disk",
	"resolvConf": "give DNS settings in ipam.dns instead",
}

// jsonError turns a decoding error into one that names the field and wraps
// allocator.ErrInvalidConfig (and ErrUndecodable for syntax errors). where is the
// object decoded ("ipam"), empty for the whole configuration.
func jsonError(where string, err error) error {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syn):
		return fmt.Errorf("%w: %w: %s at byte %d: %v", ErrUndecodable, allocator.ErrInvalidConfig,
			cmp.Or(where, "network configuration"), syn.Offset, err)
	case errors.As(err, &typ):
		field := where
		if typ.Field != "" {
			field = strings.TrimPrefix(where+"."+typ.Field, ".")
		}
		return fmt.Errorf("%w: %s: got a JSON %s, want %s; fix its value",
			allocator.ErrInvalidConfig, cmp.Or(field, "network configuration"), typ.Value, jsonKind(typ.Type.String()))
	}
	if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		name = strings.Trim(name, `"`)
		hint := "leasehold's ipam accepts type, socket, timeout, pool, ranges, subnet, rangeStart, rangeEnd, gateway, " +
			"exclude, blocks, routes, dns, sticky, stickyHold and migratable (a range: subnet, rangeStart, rangeEnd, gateway; " +
			"blocks: ipv4, ipv6; a route: dst, gw, mtu, advmss, priority, table, scope; dns: nameservers, domain, search, options); " +
			"fix the spelling or remove it"
		if why, ok := hostLocalOnly[name]; ok {
			hint = "it is a host-local setting and " + why + "; remove it"
		}
		return fmt.Errorf("%w: %s: unknown field %q: %s", allocator.ErrInvalidConfig, where, name, hint)
	}
	return fmt.Errorf("%w: %s: %v", allocator.ErrInvalidConfig, cmp.Or(where, "network configuration"), err)
}

// jsonKind describes a Go type as the JSON a user should write.
func jsonKind(goType string) string {
	switch {
	case goType == "string":
		return "a string"
	case strings.HasPrefix(goType, "[]"):
		return "a list"
	case strings.HasPrefix(goType, "int"), strings.HasPrefix(goType, "*int"):
		return "an integer"
	case goType == "bool":
		return "true or false"
	}
	return "an object"
}
