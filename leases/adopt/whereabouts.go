package adopt

import (
	"encoding/json"
	"fmt"
	"math/big"
	"net/netip"
	"slices"
	"strings"

	"github.com/leasehold/leasehold/allocator"
)

// k8sObject is the part of a Kubernetes object, or of a List of them, that is read here:
// kubectl get ... -o json prints either one object or {"kind": "List", "items": [...]}.
type k8sObject struct {
	Kind     string            `json:"kind"`
	Items    []json.RawMessage `json:"items"`
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
		UID       string `json:"uid"`
	} `json:"metadata"`
	// Spec.NodeName is a Pod's node.
	Spec struct {
		NodeName string `json:"nodeName"`
	} `json:"spec"`
}

// ipPoolSpec is whereabouts' IPPool spec (whereabouts.cni.cncf.io/v1alpha1): the range as a
// CIDR, and the allocations keyed by their offset from the range's address, in decimal.
type ipPoolSpec struct {
	Range       string `json:"range"`
	Allocations map[string]struct {
		ID     string `json:"id"`
		PodRef string `json:"podref"`
		IfName string `json:"ifname"`
	} `json:"allocations"`
}

// objects returns the objects of data, a List's items or the one object, with the kind
// each must have (an item's empty kind counts as that kind).
func objects(data []byte, kind string) ([]json.RawMessage, error) {
	var top k8sObject
	if err := json.Unmarshal(data, &top); err != nil {
		return nil, fmt.Errorf("not JSON as kubectl get -o json prints it: %w", err)
	}
	if top.Kind == kind {
		return []json.RawMessage{data}, nil
	}
	if top.Kind != "" && !strings.HasSuffix(top.Kind, "List") {
		return nil, fmt.Errorf("a %s, not a %s or a List of them", top.Kind, kind)
	}
	for i, item := range top.Items {
		var o k8sObject
		if err := json.Unmarshal(item, &o); err != nil {
			return nil, fmt.Errorf("item %d: %w", i, err)
		}
		if o.Kind != "" && o.Kind != kind {
			return nil, fmt.Errorf("item %d (%s) is a %s, not a %s", i, o.Metadata.Name, o.Kind, kind)
		}
	}
	return top.Items, nil
}

// Whereabouts reads whereabouts IPPools as `kubectl get ippools.whereabouts.cni.cncf.io -A
// -o json` prints them (a List, or one IPPool). Each allocation becomes a record: its
// address is the range's address (spec.range as written, as whereabouts reads it) plus the
// offset, its container the allocation's id, its pod the podref's namespace and name, its
// interface ifname (empty when whereabouts did not record one). where names the file.
//
// An IPPool records no node: keep only this node's allocations with OnNode. Errors name the
// pool and the offset: a range that is not a CIDR, an offset that is not a non-negative
// decimal number or lands outside the range, an allocation without a container ID.
func Whereabouts(data []byte, where string) ([]Record, error) {
	items, err := objects(data, "IPPool")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	var recs []Record
	for _, item := range items {
		var pool struct {
			k8sObject
			Spec ipPoolSpec `json:"spec"`
		}
		if err := json.Unmarshal(item, &pool); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		name := pool.Metadata.Namespace + "/" + pool.Metadata.Name
		prefix, err := netip.ParsePrefix(strings.TrimSpace(pool.Spec.Range))
		if err != nil {
			return nil, fmt.Errorf("%s: IPPool %s: spec.range %q is not a CIDR: %w", where, name, pool.Spec.Range, err)
		}
		offsets := make([]string, 0, len(pool.Spec.Allocations))
		for off := range pool.Spec.Allocations {
			offsets = append(offsets, off)
		}
		slices.Sort(offsets)
		for _, off := range offsets {
			a := pool.Spec.Allocations[off]
			at := fmt.Sprintf("%s: IPPool %s allocation %s", where, name, off)
			addr, err := addOffset(prefix, off)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", at, err)
			}
			if err := allocator.ValidateName("container ID", a.ID); err != nil {
				return nil, fmt.Errorf("%s: id: %w", at, err)
			}
			if a.IfName != "" {
				if err := allocator.ValidateName("interface", a.IfName); err != nil {
					return nil, fmt.Errorf("%s: ifname: %w", at, err)
				}
			}
			rec := Record{Addr: addr, ContainerID: a.ID, IfName: a.IfName, Where: at}
			if ns, pod, ok := strings.Cut(a.PodRef, "/"); ok {
				rec.Pod = allocator.PodRef{Namespace: ns, Name: pod}
			}
			recs = append(recs, rec)
		}
	}
	return recs, nil
}

// addOffset is the address off (decimal, from 0) after prefix's address as written; it must
// lie inside the prefix.
func addOffset(prefix netip.Prefix, off string) (netip.Addr, error) {
	n, ok := new(big.Int).SetString(off, 10)
	if !ok || n.Sign() < 0 || strings.TrimSpace(off) != off || strings.HasPrefix(off, "+") {
		return netip.Addr{}, fmt.Errorf("the offset %q is not a non-negative decimal number", off)
	}
	base := prefix.Addr().Unmap()
	sum := new(big.Int).Add(new(big.Int).SetBytes(base.AsSlice()), n)
	b := sum.Bytes()
	size := base.BitLen() / 8
	if len(b) > size {
		return netip.Addr{}, fmt.Errorf("offset %s from %s is past the end of the address space", off, base)
	}
	buf := make([]byte, size)
	copy(buf[size-len(b):], b)
	addr, _ := netip.AddrFromSlice(buf)
	if !prefix.Masked().Contains(addr) {
		return netip.Addr{}, fmt.Errorf("offset %s from %s is %s, outside the range %s", off, base, addr, prefix)
	}
	return addr, nil
}

// Pods reads pods as `kubectl get pods -A -o json` prints them (a List, or one Pod) and
// returns those whose spec.nodeName is node (all of them when node is ""), by
// "namespace/name", with their UIDs, and every node name the pods have (sorted): a node
// registered under another name (its FQDN) matches no pod, and the caller says so.
func Pods(data []byte, where, node string) (map[string]allocator.PodRef, []string, error) {
	items, err := objects(data, "Pod")
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", where, err)
	}
	pods := make(map[string]allocator.PodRef, len(items))
	var nodes []string
	for i, item := range items {
		var o k8sObject
		if err := json.Unmarshal(item, &o); err != nil {
			return nil, nil, fmt.Errorf("%s: item %d: %w", where, i, err)
		}
		m := o.Metadata
		if m.Namespace == "" || m.Name == "" {
			return nil, nil, fmt.Errorf("%s: item %d has no metadata.namespace and metadata.name", where, i)
		}
		if err := allocator.ValidateName("pod UID", m.UID); err != nil {
			return nil, nil, fmt.Errorf("%s: pod %s/%s: metadata.uid: %w", where, m.Namespace, m.Name, err)
		}
		if n := o.Spec.NodeName; n != "" && !slices.Contains(nodes, n) {
			nodes = append(nodes, n)
		}
		if node != "" && o.Spec.NodeName != node {
			continue
		}
		pods[m.Namespace+"/"+m.Name] = allocator.PodRef{UID: m.UID, Namespace: m.Namespace, Name: m.Name}
	}
	slices.Sort(nodes)
	return pods, nodes, nil
}

// OnNode keeps the records of pods: it gives each record whose podref names one of them that
// pod's UID (so leasehold keeps it under the owner a kubelet's DEL names), and returns the
// others apart: an IPPool is shared by every node, and only the node running a pod may hold
// its address.
func OnNode(recs []Record, pods map[string]allocator.PodRef) (here, elsewhere []Record) {
	for _, r := range recs {
		p, ok := pods[r.Pod.Namespace+"/"+r.Pod.Name]
		if !ok || r.Pod.Name == "" {
			elsewhere = append(elsewhere, r)
			continue
		}
		r.Pod = p
		here = append(here, r)
	}
	return here, elsewhere
}
