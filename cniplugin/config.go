package cniplugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// DefaultSocket is the agent socket used when ipam.socket is not set.
const DefaultSocket = agentapi.DefaultSocket

// DefaultTimeout bounds the plugin's conversation with the agent when ipam.timeout is
// not set.
const DefaultTimeout = 30 * time.Second

// ErrUndecodable: the network configuration is not JSON at all. Errors wrapping it also
// wrap allocator.ErrInvalidConfig; the plugin reports them with CNI code 6 instead of 7.
var ErrUndecodable = errors.New("network configuration is not valid JSON")

// Config is a parsed and checked network configuration plus the runtime's arguments.
type Config struct {
	// CNIVersion is the configuration's cniVersion; results are printed in it.
	CNIVersion string
	// Name is the network name.
	Name string
	// IPAM is the ipam object as written.
	IPAM IPAMConfig
	// Routes are IPAM.Routes checked against the pool and with same-destination
	// priorities assigned (see ResolveRoutes); they go into the result as they are.
	Routes []Route
	// Request is the agent request for ADD, DEL and CHECK: network, canonical pool,
	// attachment, pod, requested addresses and sticky claim.
	Request allocator.Request
	// ValidAttachments is the netconf's "cni.dev/valid-attachments" (GC only): nil when
	// the key is absent, empty when it is an empty list.
	ValidAttachments []allocator.Attachment
	// PrevResult is the parsed "prevResult", or nil.
	PrevResult types.Result
}

// rawNetConf is the part of the network configuration leasehold reads. Everything
// else at the top level belongs to other plugins and is ignored.
type rawNetConf struct {
	CNIVersion string          `json:"cniVersion"`
	Name       string          `json:"name"`
	IPAM       json.RawMessage `json:"ipam"`
	// AllowPersistentIPs is the network's top-level knob that kubevirt/ipam-extensions and
	// OVN-Kubernetes read: a claim of this network is migratable (docs/proposals/live-migration.md).
	AllowPersistentIPs bool `json:"allowPersistentIPs"`
	Args               *struct {
		CNI *struct {
			IPs []string `json:"ips"`
			// Claim is decoded by ParseConfig: of a wrong type, it must not stop
			// ParseReleaseConfig's own decoding (a DEL needs no claim).
			Claim json.RawMessage `json:"claim"`
			// ClaimRef is the multi-network spec's ipam-claim-reference (an IPAMClaim's name,
			// in the pod's namespace), which an element's cni-args carries here; decoded as
			// Claim.
			ClaimRef json.RawMessage `json:"ipam-claim-reference"`
			// Pool is decoded by ParseConfig, as Claim: the pools the pod asks for, a
			// string (one pool, or a comma-separated list) or a list of strings.
			Pool json.RawMessage `json:"pool"`
		} `json:"cni"`
	} `json:"args"`
	RuntimeConfig *struct {
		IPs      []string          `json:"ips"`
		IPRanges []json.RawMessage `json:"ipRanges"`
	} `json:"runtimeConfig"`
	PrevResult       map[string]any         `json:"prevResult"`
	ValidAttachments []allocator.Attachment `json:"cni.dev/valid-attachments"`
}

// ParseConfig parses the network configuration given on stdin together with the
// runtime's CNI_ARGS, CNI_CONTAINERID, CNI_IFNAME and CNI_NETNS, and checks all of it
// before anything is sent to the agent:
//
//   - the top level may carry any fields (they belong to other plugins); leasehold
//     reads cniVersion, name, allowPersistentIPs, ipam, args.cni.ips, args.cni.claim,
//     args.cni["ipam-claim-reference"], runtimeConfig.ips, prevResult and
//     cni.dev/valid-attachments;
//   - the ipam object is leasehold's: an unknown field or a value of the wrong type is
//     an error naming the field;
//   - the pool (ranges, exclude, blocks, name) is canonicalized with allocator's
//     PoolSpec.Canonicalize; routes are checked against it (ResolveRoutes). Block lengths
//     out of bounds are an error naming ipam.blocks;
//   - containerID, ifName and the pod UID, when not empty, must pass
//     allocator.ValidateName (they become parts of etcd keys). Empty ones are allowed
//     here because GC and STATUS have none; the handlers require them where needed;
//   - requested addresses come from CNI_ARGS IP=, args.cni.ips and runtimeConfig.ips;
//   - the sticky claim (Request.Claim, Request.ClaimHold) is resolved only for an
//     invocation that names an attachment (ADD, DEL, CHECK; GC and STATUS have no
//     claim): CNI_ARGS LEASEHOLD_CLAIM or args.cni.claim names it explicitly, with or
//     without ipam.sticky (both may be given only if equal); then
//     args.cni["ipam-claim-reference"] names it <K8S_POD_NAMESPACE>.<reference> (an
//     IPAMClaim is namespaced; K8S_POD_NAMESPACE is then required, and an explicit claim
//     naming another is refused); otherwise ipam.sticky names
//     it <namespace>.<name> from CNI_ARGS K8S_POD_NAMESPACE and K8S_POD_NAME, both then
//     required. The name must pass allocator.ValidateName. ipam.stickyHold becomes
//     ClaimHold and needs a claim: without one it would be ignored, so it is refused.
//     ipam.migratable or the top-level allowPersistentIPs makes the claim migratable
//     (Request.Migratable); without a claim the agent ignores it (and logs that once).
//     These errors wrap allocator.ErrInvalidConfig (an invalid name also ErrInvalidName),
//     so that ParseReleaseConfig falls back and a DEL still runs, without a claim.
//
// Errors wrap allocator.ErrInvalidConfig or allocator.ErrInvalidName and say what to
// fix; an input that is not JSON also wraps ErrUndecodable.
func ParseConfig(stdin []byte, cniArgs, containerID, ifName, netns string) (*Config, error) {
	var nc rawNetConf
	if err := json.Unmarshal(stdin, &nc); err != nil {
		return nil, jsonError("", err)
	}
	if nc.CNIVersion == "" {
		return nil, fmt.Errorf("%w: network configuration has no cniVersion; set it, for example \"cniVersion\": \"1.1.0\"",
			allocator.ErrInvalidConfig)
	}
	if err := allocator.ValidateName("network", nc.Name); err != nil {
		return nil, fmt.Errorf("network configuration \"name\": %w", err)
	}
	ipam, err := parseIPAM(nc.IPAM)
	if err != nil {
		return nil, err
	}
	if ipam.Pool == "" {
		ipam.Pool = nc.Name
	}
	pool := allocator.PoolSpec{Name: ipam.Pool, Ranges: cloneRanges(ipam.Ranges), Exclude: slices.Clone(ipam.Exclude), Blocks: ipam.Blocks}
	if len(pool.Ranges) == 0 {
		// A reference to a pool defined in etcd (leaseholdctl pool create): the agent uses
		// the stored definition.
		if err := allocator.ValidateName("pool", pool.Name); err != nil {
			return nil, fmt.Errorf("ipam.pool: %w", err)
		}
	} else if err := pool.Canonicalize(); err != nil {
		return nil, poolError(ipam, err)
	}
	routes, err := ResolveRoutes(ipam.Routes, pool)
	if err != nil {
		return nil, err
	}

	args, err := attachmentArgs(cniArgs, containerID, ifName)
	if err != nil {
		return nil, err
	}
	var argsIPs, runtimeIPs []string
	var argsClaim, argsRef, argsPool json.RawMessage
	if nc.Args != nil && nc.Args.CNI != nil {
		argsIPs, argsClaim, argsRef, argsPool = nc.Args.CNI.IPs, nc.Args.CNI.Claim, nc.Args.CNI.ClaimRef, nc.Args.CNI.Pool
	}
	if nc.RuntimeConfig != nil {
		runtimeIPs = nc.RuntimeConfig.IPs
		if len(nc.RuntimeConfig.IPRanges) > 0 {
			return nil, fmt.Errorf("%w: runtimeConfig.ipRanges is not supported: a leasehold pool is defined once, "+
				"in ipam.ranges; remove the \"ipRanges\" capability from the network configuration",
				allocator.ErrInvalidConfig)
		}
	}
	ips, err := requestedIPs(args.IPs, argsIPs, runtimeIPs)
	if err != nil {
		return nil, err
	}
	var claim string
	var hold time.Duration
	var asked []string
	if containerID != "" || ifName != "" {
		if claim, hold, err = resolveClaim(ipam, args, argsClaim, argsRef); err != nil {
			return nil, err
		}
		if asked, err = askedPools(args, argsPool); err != nil {
			return nil, err
		}
	}

	cfg := &Config{
		CNIVersion: nc.CNIVersion,
		Name:       nc.Name,
		IPAM:       *ipam,
		Routes:     routes,
		Request: allocator.Request{
			Network:      nc.Name,
			Pool:         pool,
			ContainerID:  containerID,
			IfName:       ifName,
			Netns:        netns,
			Pod:          args.Pod,
			RequestedIPs: ips,
			Claim:        claim,
			ClaimHold:    hold,
			Migratable:   ipam.Migratable || nc.AllowPersistentIPs,
			Pools:        asked,
		},
		ValidAttachments: nc.ValidAttachments,
	}
	if nc.PrevResult != nil {
		pc := types.PluginConf{CNIVersion: nc.CNIVersion, RawPrevResult: nc.PrevResult}
		if err := version.ParsePrevResult(&pc); err != nil {
			return nil, fmt.Errorf("%w: prevResult: %v; the runtime passed a result leasehold cannot read",
				allocator.ErrInvalidConfig, err)
		}
		cfg.PrevResult = pc.PrevResult
	}
	return cfg, nil
}

// poolError names the part of the ipam section at fault in err, Canonicalize's error for
// the pool it describes: ipam.blocks when the same pool without blocks is valid (the block
// lengths alone are wrong), else the ipam section as a whole.
func poolError(ipam *IPAMConfig, err error) error {
	if !ipam.Blocks.Flat() {
		flat := allocator.PoolSpec{Name: ipam.Pool, Ranges: cloneRanges(ipam.Ranges), Exclude: slices.Clone(ipam.Exclude)}
		if flat.Canonicalize() == nil {
			return fmt.Errorf("ipam.blocks: %w", err)
		}
	}
	return fmt.Errorf("ipam: %w", err)
}

// GCRequest is the agent request for CNI GC: this network and pool, and the runtime's
// valid attachments. Because GC releases every allocation not listed, a configuration
// without "cni.dev/valid-attachments" is refused (an error wrapping
// allocator.ErrInvalidConfig) rather than read as "nothing is valid"; an explicit empty
// list is passed on as it is. The returned ValidAttachments is never nil.
func (c *Config) GCRequest() (allocator.GCRequest, error) {
	if c.ValidAttachments == nil {
		return allocator.GCRequest{}, fmt.Errorf("%w: GC without \"cni.dev/valid-attachments\": refusing to release "+
			"every allocation of network %s; the runtime must list the attachments that are still valid",
			allocator.ErrInvalidConfig, c.Name)
	}
	return allocator.GCRequest{Network: c.Name, Pool: c.Request.Pool, ValidAttachments: c.ValidAttachments}, nil
}

// StatusRequest is the agent request for CNI STATUS.
func (c *Config) StatusRequest() allocator.StatusRequest {
	return allocator.StatusRequest{Network: c.Name, Pool: c.Request.Pool}
}

// askedPools returns the pools the pod asks for, in order: CNI_ARGS LEASEHOLD_POOL, else
// args.cni.pool (where Multus puts a pod's cni-args), each a valid pool name. rawArgsPool is
// args.cni.pool as written (nil when absent): a string, one pool or a comma-separated list,
// or a list of strings. The two given differently is refused, as for a claim. Errors wrap
// allocator.ErrInvalidConfig or allocator.ErrInvalidName.
func askedPools(args CNIArgs, rawArgsPool json.RawMessage) ([]string, error) {
	if args.poolErr != nil {
		return nil, args.poolErr
	}
	var fromArgs []string
	if rawArgsPool != nil {
		var one string
		if err := json.Unmarshal(rawArgsPool, &one); err == nil {
			fromArgs = splitList(one)
		} else if err := json.Unmarshal(rawArgsPool, &fromArgs); err != nil {
			return nil, fmt.Errorf("%w: args.cni.pool: want a pool name, a comma-separated list of them or a JSON list of "+
				"them, got %s", allocator.ErrInvalidConfig, rawArgsPool)
		}
		fromArgs = slices.DeleteFunc(fromArgs, func(s string) bool { return strings.TrimSpace(s) == "" })
	}
	pools, source := args.Pools, "CNI_ARGS LEASEHOLD_POOL"
	switch {
	case len(pools) > 0 && len(fromArgs) > 0 && !slices.Equal(pools, fromArgs):
		return nil, fmt.Errorf("%w: CNI_ARGS LEASEHOLD_POOL %q and args.cni.pool %q ask for different pools; ask once, "+
			"or for the same pools in both", allocator.ErrInvalidConfig, strings.Join(pools, ","), strings.Join(fromArgs, ","))
	case len(pools) == 0:
		pools, source = fromArgs, "args.cni.pool"
	}
	for i, p := range pools {
		if err := allocator.ValidateName("pool", p); err != nil {
			return nil, fmt.Errorf("%w: %s: %w", allocator.ErrInvalidConfig, source, err)
		}
		if slices.Contains(pools[:i], p) {
			return nil, fmt.Errorf("%w: %s asks for pool %q twice; name each pool once, in the order to try them",
				allocator.ErrInvalidConfig, source, p)
		}
	}
	return pools, nil
}

// claimHint tells how to name a claim explicitly.
const claimHint = `name the claim explicitly with CNI_ARGS LEASEHOLD_CLAIM=<name> or "args": {"cni": {"claim": "<name>"}}`

// resolveClaim returns the attachment's sticky claim and its hold (see ParseConfig):
// explicit (CNI_ARGS LEASEHOLD_CLAIM, args.cni.claim), then args.cni's
// ipam-claim-reference in the pod's namespace, before ipam.sticky's pod name.
// rawArgsClaim and rawRef are args.cni.claim and args.cni["ipam-claim-reference"] as
// written (nil when absent). Errors wrap allocator.ErrInvalidConfig.
func resolveClaim(ipam *IPAMConfig, args CNIArgs, rawArgsClaim, rawRef json.RawMessage) (string, time.Duration, error) {
	var argsClaim, ref string
	if rawArgsClaim != nil {
		if err := json.Unmarshal(rawArgsClaim, &argsClaim); err != nil { // null leaves it empty
			return "", 0, jsonError("args.cni.claim", err)
		}
	}
	if rawRef != nil {
		if err := json.Unmarshal(rawRef, &ref); err != nil {
			return "", 0, jsonError(`args.cni["ipam-claim-reference"]`, err)
		}
	}
	if args.claimErr != nil {
		return "", 0, args.claimErr
	}
	claim, source, hint := args.Claim, "CNI_ARGS LEASEHOLD_CLAIM", ""
	switch {
	case claim != "" && argsClaim != "" && claim != argsClaim:
		return "", 0, fmt.Errorf("%w: CNI_ARGS LEASEHOLD_CLAIM %q and args.cni.claim %q name different claims; "+
			"give the claim once, or the same name in both", allocator.ErrInvalidConfig, claim, argsClaim)
	case claim == "" && argsClaim != "":
		claim, source = argsClaim, "args.cni.claim"
	}
	if ref != "" {
		if args.Pod.Namespace == "" {
			return "", 0, fmt.Errorf("%w: args.cni[\"ipam-claim-reference\"] %q names an IPAMClaim of the pod's namespace, but CNI_ARGS "+
				"has no K8S_POD_NAMESPACE; have the runtime pass it, or %s", allocator.ErrInvalidConfig, ref, claimHint)
		}
		named := args.Pod.Namespace + "." + ref
		if claim != "" && claim != named {
			return "", 0, fmt.Errorf("%w: %s %q and args.cni[\"ipam-claim-reference\"] (claim %q) name different claims; "+
				"give the claim once, or the same name in both", allocator.ErrInvalidConfig, source, claim, named)
		}
		claim, source = named, `args.cni["ipam-claim-reference"] in the pod's namespace (K8S_POD_NAMESPACE.<reference>)`
	}
	if claim == "" && ipam.Sticky {
		var missing []string
		if args.Pod.Namespace == "" {
			missing = append(missing, "K8S_POD_NAMESPACE")
		}
		if args.Pod.Name == "" {
			missing = append(missing, "K8S_POD_NAME")
		}
		if len(missing) > 0 {
			return "", 0, fmt.Errorf("%w: ipam.sticky names the claim after the pod, <namespace>.<name>, but CNI_ARGS "+
				"has no %s; have the runtime pass K8S_POD_NAMESPACE and K8S_POD_NAME, or %s",
				allocator.ErrInvalidConfig, strings.Join(missing, " and no "), claimHint)
		}
		claim = args.Pod.Namespace + "." + args.Pod.Name
		source = "ipam.sticky: the claim named after the pod (K8S_POD_NAMESPACE.K8S_POD_NAME)"
		hint = "; or " + claimHint
	}
	if claim == "" {
		if ipam.StickyHold != 0 {
			return "", 0, fmt.Errorf("%w: ipam.stickyHold %s without a claim would be ignored; set \"sticky\": true, "+
				"or %s, or remove stickyHold", allocator.ErrInvalidConfig, ipam.StickyHold, claimHint)
		}
		return "", 0, nil
	}
	if err := allocator.ValidateName("claim", claim); err != nil {
		return "", 0, fmt.Errorf("%w: %s: %w%s", allocator.ErrInvalidConfig, source, err, hint)
	}
	return claim, ipam.StickyHold, nil
}

// attachmentArgs validates the names an attachment's keys are made of and parses CNI_ARGS.
// A LEASEHOLD_CLAIM given twice with different values is left for resolveClaim to refuse
// (see parseCNIArgs), so that DEL's fallback (ParseReleaseConfig) is not refused for it.
func attachmentArgs(cniArgs, containerID, ifName string) (CNIArgs, error) {
	for _, n := range []struct{ kind, val string }{{"container ID", containerID}, {"interface", ifName}} {
		if n.val != "" {
			if err := allocator.ValidateName(n.kind, n.val); err != nil {
				return CNIArgs{}, err
			}
		}
	}
	args, err := parseCNIArgs(cniArgs)
	if err != nil {
		return CNIArgs{}, err
	}
	if args.Pod.UID != "" {
		if err := allocator.ValidateName("pod UID", args.Pod.UID); err != nil {
			return CNIArgs{}, fmt.Errorf("CNI_ARGS K8S_POD_UID: %w", err)
		}
	}
	return args, nil
}
