package allocator

import (
	"net/netip"
	"time"
)

// Range is one contiguous block of addresses inside a subnet, in host-local's format.
// RangeStart, RangeEnd and Gateway are optional; Canonicalize fills their defaults.
type Range struct {
	Subnet     netip.Prefix `json:"subnet"`
	RangeStart netip.Addr   `json:"rangeStart,omitzero"`
	RangeEnd   netip.Addr   `json:"rangeEnd,omitzero"`
	Gateway    netip.Addr   `json:"gateway,omitzero"`
}

// RangeSet is an ordered list of ranges of one address family. An allocation takes
// exactly one address from each range set of a pool.
type RangeSet []Range

// PoolSpec is a pool's definition: its name, its range sets (one address each per
// attachment) and the addresses it never hands out. It is stored in etcd as JSON and
// compared after Canonicalize, so two definitions are equal exactly when they allocate
// the same addresses.
type PoolSpec struct {
	Name    string         `json:"name"`
	Ranges  []RangeSet     `json:"ranges"`
	Exclude []netip.Prefix `json:"exclude,omitempty"`
	// Blocks divides the pool among nodes (see Blocks); fixed once the pool is stored.
	Blocks Blocks `json:"blocks,omitzero"`
}

// PodRef names the Kubernetes pod behind an attachment, when the runtime says so
// (K8S_POD_UID, K8S_POD_NAMESPACE, K8S_POD_NAME in CNI_ARGS). All fields may be empty.
type PodRef struct {
	UID       string `json:"uid,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
}

// Request asks the agent for the addresses of one attachment (one container's one
// interface on one network). The same type serves ADD, DEL and CHECK.
type Request struct {
	// Network is the CNI network name.
	Network string `json:"network"`
	// Pool is the pool definition from the network configuration. Pool.Name defaults
	// to Network.
	Pool        PoolSpec `json:"pool"`
	ContainerID string   `json:"containerID"`
	IfName      string   `json:"ifName"`
	// Netns is the sandbox's network namespace path, as given to the plugin.
	Netns string `json:"netns,omitempty"`
	Pod   PodRef `json:"pod,omitzero"`
	// RequestedIPs are addresses the runtime asks for (CNI_ARGS IP=, args.cni.ips,
	// runtimeConfig.ips). Each must fall into a different range set of the pool.
	RequestedIPs []netip.Addr `json:"requestedIPs,omitempty"`
	// Claim names a sticky claim for the attachment (ipam "sticky", CNI_ARGS LEASEHOLD_CLAIM,
	// args.cni.claim): a later attachment naming the same claim gets the same addresses once
	// no live pod holds them. Empty: not sticky.
	Claim string `json:"claim,omitempty"`
	// ClaimHold is how long a claim outlives its holder's release (ipam "stickyHold"); zero
	// uses the agent's default.
	ClaimHold time.Duration `json:"claimHold,omitempty"`
	// Migratable lets the claim's addresses be held, during a live migration, by a second pod
	// of the claim on another node (ipam "migratable", the network's "allowPersistentIPs";
	// docs/proposals/live-migration.md). Without a claim it means nothing.
	Migratable bool `json:"migratable,omitempty"`
	// Pools are the pools the pod asks for, in order (CNI_ARGS LEASEHOLD_POOL, args.cni.pool):
	// among those its namespace may use (package selection). Empty: the selection rules, or
	// the network configuration's pool, decide. Only an ADD reads them.
	Pools []string `json:"pools,omitempty"`
}

// OwnerID is the identity that holds the attachment's addresses and lease: the pod UID
// when the runtime gave one, else the container ID.
func (r Request) OwnerID() string {
	if r.Pod.UID != "" {
		return r.Pod.UID
	}
	return r.ContainerID
}

// IPConfig is one allocated address.
type IPConfig struct {
	// Address is the allocated address with its subnet's prefix length (10.10.1.7/16).
	Address netip.Prefix `json:"address"`
	// Gateway is the gateway of the range the address came from; may be zero.
	Gateway netip.Addr `json:"gateway,omitzero"`
}

// Result is what an ADD returns: one IPConfig per range set of the pool, in range-set order.
type Result struct {
	IPs []IPConfig `json:"ips"`
}

// Attachment names one container interface, as in CNI GC's cni.dev/valid-attachments.
type Attachment struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifname"`
}

// GCRequest asks the agent to release every allocation of Network made on this node
// whose attachment is not in ValidAttachments (CNI 1.1 GC).
type GCRequest struct {
	Network          string       `json:"network"`
	Pool             PoolSpec     `json:"pool"`
	ValidAttachments []Attachment `json:"validAttachments"`
}

// StatusRequest asks whether the agent can serve ADDs for Pool right now (CNI 1.1 STATUS).
type StatusRequest struct {
	Network string   `json:"network"`
	Pool    PoolSpec `json:"pool"`
}

// Taken is what candidate choice needs to know about a pool's current state. The
// agent's watch-fed view implements it.
type Taken interface {
	// Allocated reports whether addr is held by any owner.
	Allocated(addr netip.Addr) bool
	// Quarantined reports whether addr is resting after a release and, if so, until when.
	Quarantined(addr netip.Addr) (until time.Time, ok bool)
}
