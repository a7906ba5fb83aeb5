// Package kernel is leasehold's only contact with the kernel's networking: it lists and
// follows interface addresses over netlink, in the agent's own network namespace or inside a
// sandbox's. Nothing else in leasehold imports netlink.
package kernel

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Addr is one address on one interface, with the flags leasehold cares about.
type Addr struct {
	Prefix netip.Prefix
	// Link is the interface name ("" when only the index is known).
	Link      string
	LinkIndex int
	// Tentative: IPv6 duplicate address detection is still running.
	Tentative bool
	// DADFailed: duplicate address detection found another node using the address.
	DADFailed bool
	// Scope is the kernel's address scope (0 universe, 253 link, 254 host).
	Scope int
}

// Errors returned by this package.
var (
	// ErrNoNetns: the network namespace path does not exist (the sandbox is gone).
	ErrNoNetns = errors.New("network namespace not found")
	// ErrNoLink: the interface does not exist in the namespace.
	ErrNoLink = errors.New("interface not found")
)

// handle opens a netlink handle in the namespace at path ("" for the current one).
func handle(path string) (*netlink.Handle, func(), error) {
	if path == "" {
		h, err := netlink.NewHandle()
		if err != nil {
			return nil, nil, fmt.Errorf("netlink: %w", err)
		}
		return h, h.Close, nil
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, nil, fmt.Errorf("%w: %s", ErrNoNetns, path)
		}
		return nil, nil, fmt.Errorf("open network namespace %s: %w", path, err)
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		return nil, nil, fmt.Errorf("netlink in %s: %w", path, err)
	}
	return h, func() { h.Close(); ns.Close() }, nil
}

// LinkAddrs lists the addresses of interface ifName in the namespace at nsPath ("" for the
// current namespace). Errors wrap ErrNoNetns or ErrNoLink when those are missing.
func LinkAddrs(nsPath, ifName string) ([]Addr, error) {
	h, closeFn, err := handle(nsPath)
	if err != nil {
		return nil, err
	}
	defer closeFn()
	link, err := h.LinkByName(ifName)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil, fmt.Errorf("%w: %s in %s", ErrNoLink, ifName, nsPathOrCurrent(nsPath))
		}
		return nil, fmt.Errorf("look up %s in %s: %w", ifName, nsPathOrCurrent(nsPath), err)
	}
	list, err := h.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses of %s in %s: %w", ifName, nsPathOrCurrent(nsPath), err)
	}
	out := make([]Addr, 0, len(list))
	for _, a := range list {
		if ad, ok := fromNetlink(a.IPNet, a.Flags, a.Scope, link.Attrs().Index); ok {
			ad.Link = ifName
			out = append(out, ad)
		}
	}
	return out, nil
}

// AllAddrs lists every address of every interface in the namespace at nsPath ("" for the
// current namespace). It either returns the complete list or an error, never a part.
func AllAddrs(nsPath string) ([]Addr, error) {
	h, closeFn, err := handle(nsPath)
	if err != nil {
		return nil, err
	}
	defer closeFn()
	links, err := h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links in %s: %w", nsPathOrCurrent(nsPath), err)
	}
	names := make(map[int]string, len(links))
	for _, l := range links {
		names[l.Attrs().Index] = l.Attrs().Name
	}
	list, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses in %s: %w", nsPathOrCurrent(nsPath), err)
	}
	out := make([]Addr, 0, len(list))
	for _, a := range list {
		if ad, ok := fromNetlink(a.IPNet, a.Flags, a.Scope, a.LinkIndex); ok {
			ad.Link = names[a.LinkIndex]
			out = append(out, ad)
		}
	}
	return out, nil
}

// Event is one address appearing, changing or disappearing.
type Event struct {
	Addr Addr
	// Removed: the kernel deleted the address (RTM_DELADDR).
	Removed bool
}

// Watch follows address changes in the namespace at nsPath ("" for the current one) until
// done is closed. The channel closes when the subscription ends for any reason; errs
// receives why, if there was an error.
func Watch(nsPath string, done <-chan struct{}, errs func(error)) (<-chan Event, error) {
	opts := netlink.AddrSubscribeOptions{ErrorCallback: errs}
	if nsPath != "" {
		ns, err := netns.GetFromPath(nsPath)
		if err != nil {
			return nil, fmt.Errorf("open network namespace %s: %w", nsPath, err)
		}
		defer ns.Close()
		opts.Namespace = &ns
	}
	raw := make(chan netlink.AddrUpdate, 64)
	if err := netlink.AddrSubscribeWithOptions(raw, done, opts); err != nil {
		return nil, fmt.Errorf("subscribe to address changes in %s: %w", nsPathOrCurrent(nsPath), err)
	}
	out := make(chan Event, 64)
	go func() {
		defer close(out)
		for u := range raw {
			ad, ok := fromNetlink(&u.LinkAddress, u.Flags, u.Scope, u.LinkIndex)
			if !ok {
				continue
			}
			select {
			case out <- Event{Addr: ad, Removed: !u.NewAddr}:
			case <-done:
				return
			}
		}
	}()
	return out, nil
}

func fromNetlink(ipn *net.IPNet, flags, scope, index int) (Addr, bool) {
	if ipn == nil {
		return Addr{}, false
	}
	ip, ok := netip.AddrFromSlice(ipn.IP)
	if !ok {
		return Addr{}, false
	}
	ip = ip.Unmap()
	ones, _ := ipn.Mask.Size()
	return Addr{
		Prefix:    netip.PrefixFrom(ip, ones),
		LinkIndex: index,
		Tentative: flags&unix.IFA_F_TENTATIVE != 0,
		DADFailed: flags&unix.IFA_F_DADFAILED != 0,
		Scope:     scope,
	}, true
}

func nsPathOrCurrent(p string) string {
	if p == "" {
		return "the agent's network namespace"
	}
	return p
}
