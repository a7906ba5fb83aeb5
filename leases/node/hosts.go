package node

import (
	"context"
	"log/slog"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/kernel"
)

// hostSet decides which of the node's own addresses are published (against the DAD flap, docs/field-failures.md). It is pure
// logic, fed by netlink events and periodic scans:
//   - tentative IPv6 addresses (DAD still running) and DAD-failed ones count as present;
//   - link-local, loopback, multicast and host-scope addresses are never published;
//   - a failed scan changes nothing, and an address missing from a complete scan is removed
//     only after it was missing from removeAfter scans in a row;
//   - an address the kernel reports deleted is removed at once.
type hostSet struct {
	removeAfter int
	published   map[netip.Addr]string // address -> interface
	absent      map[netip.Addr]int    // complete scans in a row without the address
}

func newHostSet(removeAfter int) *hostSet {
	return &hostSet{removeAfter: max(removeAfter, 1), published: map[netip.Addr]string{}, absent: map[netip.Addr]int{}}
}

func publishable(a kernel.Addr) bool {
	ip := a.Prefix.Addr()
	const hostScope = 254
	return ip.IsValid() && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() && !ip.IsMulticast() &&
		!ip.IsUnspecified() && a.Scope != hostScope
}

// event applies one kernel notification and reports whether the published set changed.
func (h *hostSet) event(ev kernel.Event) bool {
	if !publishable(ev.Addr) {
		return false
	}
	ip := ev.Addr.Prefix.Addr()
	delete(h.absent, ip)
	if ev.Removed {
		if _, ok := h.published[ip]; ok {
			delete(h.published, ip)
			return true
		}
		return false
	}
	if _, ok := h.published[ip]; ok {
		return false
	}
	h.published[ip] = ev.Addr.Link
	return true
}

// scan applies a complete listing (or its failure) and reports whether the set changed.
func (h *hostSet) scan(addrs []kernel.Addr, err error) bool {
	if err != nil {
		return false // a failed scan never shrinks, nor grows, what is published
	}
	changed := false
	seen := make(map[netip.Addr]bool, len(addrs))
	for _, a := range addrs {
		if !publishable(a) {
			continue
		}
		ip := a.Prefix.Addr()
		seen[ip] = true
		delete(h.absent, ip)
		if _, ok := h.published[ip]; !ok {
			h.published[ip] = a.Link
			changed = true
		}
	}
	for ip := range h.published {
		if seen[ip] {
			continue
		}
		h.absent[ip]++
		if h.absent[ip] >= h.removeAfter {
			delete(h.published, ip)
			delete(h.absent, ip)
			changed = true
		}
	}
	return changed
}

// hostRecord is the value of a host address key.
type hostRecord struct {
	Interface string    `json:"interface,omitempty"`
	Since     time.Time `json:"since"`
}

// Hosts publishes the node's own addresses: the addresses of the network namespace Netns,
// each under /leasehold/v1/hostips/<ip>/<cluster>/<node> on the node lease, where every
// claim compares them absent (ARCHITECTURE.md, "Routes and host addresses").
type Hosts struct {
	KV clientv3.KV
	ID Identity
	// Netns is the network namespace whose addresses are the node's ("": the agent's own);
	// Resync how often they are listed again besides following netlink events.
	Netns     string
	Resync    time.Duration
	OpTimeout time.Duration
	// Lease is the node record's lease, which the keys go on; a new one puts them all again.
	Lease func() clientv3.LeaseID
	Wall  func() time.Time
	Log   *slog.Logger
}

// Publish keeps /leasehold/v1/hostips/<ip>/<cluster>/<node> equal to the node's published
// host addresses, on the node lease, until ctx ends.
func (h Hosts) Publish(ctx context.Context) {
	set := newHostSet(3)
	written := map[netip.Addr]bool{}
	var writtenLease clientv3.LeaseID
	resync := time.NewTicker(h.Resync)
	defer resync.Stop()
	var events <-chan kernel.Event
	var done chan struct{}
	subscribe := func() {
		if done != nil {
			close(done)
		}
		done = make(chan struct{})
		ch, err := kernel.Watch(h.Netns, done, func(err error) { h.Log.Warn("host address events", "err", err) })
		if err != nil {
			h.Log.Warn("cannot follow host address events; relying on scans", "err", err)
			events = nil
			return
		}
		events = ch
	}
	subscribe()
	defer func() { close(done) }()
	set.scan(kernel.AllAddrs(h.Netns))
	dirty := true
	for {
		if dirty {
			lease := h.Lease()
			if err := h.write(ctx, set, written, writtenLease != lease, lease); err != nil {
				h.Log.Warn("publishing host addresses failed; retrying", "err", err)
			} else {
				writtenLease, dirty = lease, false
			}
		}
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				subscribe()
				dirty = set.scan(kernel.AllAddrs(h.Netns)) || dirty
				continue
			}
			dirty = set.event(ev) || dirty
		case <-resync.C:
			if events == nil {
				subscribe()
			}
			dirty = set.scan(kernel.AllAddrs(h.Netns)) || dirty
			dirty = dirty || h.Lease() != writtenLease
		}
	}
}

// writeHosts puts added addresses and deletes removed ones in one transaction; with all it
// puts every published address again (after the node lease changed).
func (h Hosts) write(ctx context.Context, set *hostSet, written map[netip.Addr]bool, all bool, lease clientv3.LeaseID) error {
	var ops []clientv3.Op
	var added, removed []netip.Addr
	for ip, link := range set.published {
		if all || !written[ip] {
			ops = append(ops, clientv3.OpPut(keyspace.HostIPKey(ip, h.ID.Cluster, h.ID.Node),
				keyspace.Encode(hostRecord{Interface: link, Since: h.Wall()}), clientv3.WithLease(lease)))
			added = append(added, ip)
		}
	}
	for ip := range written {
		if _, ok := set.published[ip]; !ok {
			ops = append(ops, clientv3.OpDelete(keyspace.HostIPKey(ip, h.ID.Cluster, h.ID.Node)))
			removed = append(removed, ip)
		}
	}
	if len(ops) == 0 {
		return nil
	}
	octx, cancel := context.WithTimeout(ctx, h.OpTimeout)
	defer cancel()
	if _, err := h.KV.Txn(octx).Then(ops...).Commit(); err != nil {
		return err
	}
	for _, ip := range added {
		written[ip] = true
	}
	for _, ip := range removed {
		delete(written, ip)
	}
	h.Log.Info("host addresses published", "added", added, "removed", removed)
	return nil
}
