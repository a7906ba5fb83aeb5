// Package adopt reads what another IPAM plugin recorded about the addresses it handed out,
// so that leaseholdd can claim them for their running containers when a node switches a
// network to leasehold (Agent.Import): host-local's data directory (HostLocal) and
// whereabouts' IPPool resources as kubectl prints them (Whereabouts, with Pods to keep the
// allocations of this node's pods). It reads and checks; it writes nothing.
package adopt

import (
	"cmp"
	"net/netip"
	"slices"

	"github.com/leasehold/leasehold/allocator"
)

// DefaultIfName is the interface of a record that names none: host-local's files before
// it wrote the interface name, and whereabouts allocations before it recorded one.
const DefaultIfName = "eth0"

// Record is one address another plugin recorded as held by a container's interface.
type Record struct {
	Addr        netip.Addr
	ContainerID string
	// IfName is "" when the record names no interface.
	IfName string
	// Pod is the pod behind the container as far as the record knows it: whereabouts'
	// podref gives the namespace and name, and Pods the UID. host-local knows none.
	Pod allocator.PodRef
	// Where names the record for messages: the file, and the key inside it.
	Where string
}

// Attachment is one container interface with the addresses recorded for it, the unit
// leasehold claims (one owner index, one pod lease per owner).
type Attachment struct {
	ContainerID string
	IfName      string
	Pod         allocator.PodRef
	IPs         []netip.Addr
	// Where are the records it was made of.
	Where []string
}

// Owner is who holds the attachment in leasehold, as for a CNI request: the pod UID when it
// is known, else the container ID.
func (a Attachment) Owner() string {
	return allocator.Request{ContainerID: a.ContainerID, Pod: a.Pod}.OwnerID()
}

// Group gathers records into attachments by container ID and interface (defaultIfName for
// records that name none; DefaultIfName when that is empty), each address once, sorted by
// container, interface and address, so that every run claims in the same order.
func Group(recs []Record, defaultIfName string) []Attachment {
	if defaultIfName == "" {
		defaultIfName = DefaultIfName
	}
	type key struct{ container, ifName string }
	byKey := map[key]*Attachment{}
	for _, r := range recs {
		ifName := r.IfName
		if ifName == "" {
			ifName = defaultIfName
		}
		k := key{r.ContainerID, ifName}
		at, ok := byKey[k]
		if !ok {
			at = &Attachment{ContainerID: r.ContainerID, IfName: ifName}
			byKey[k] = at
		}
		if at.Pod == (allocator.PodRef{}) {
			at.Pod = r.Pod
		}
		if !slices.Contains(at.IPs, r.Addr) {
			at.IPs = append(at.IPs, r.Addr)
		}
		at.Where = append(at.Where, r.Where)
	}
	out := make([]Attachment, 0, len(byKey))
	for _, at := range byKey {
		slices.SortFunc(at.IPs, netip.Addr.Compare)
		slices.Sort(at.Where)
		out = append(out, *at)
	}
	slices.SortFunc(out, func(a, b Attachment) int {
		return cmp.Or(cmp.Compare(a.ContainerID, b.ContainerID), cmp.Compare(a.IfName, b.IfName))
	})
	return out
}
