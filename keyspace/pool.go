package keyspace

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// PoolRecord is the value of /leasehold/v1/pools/<pool>: the pool's definition as stored.
//
// A pool in the flat layout (stored before blocks) keeps its range sets under "ranges". A
// pool in the block layout keeps them under "rangeSets": an agent from before blocks reads
// "ranges", finds none and refuses the pool's ADDs, instead of writing allocation keys in the
// flat layout beside the block layout's keys of the same addresses (two keys, two holders).
// That refusal is what makes the cutover of `leaseholdctl pool migrate` enforced.
type PoolRecord struct {
	Name string `json:"name"`
	// Layout is "blocks" in the block layout; empty in the flat one.
	Layout    string               `json:"layout,omitempty"`
	Ranges    []allocator.RangeSet `json:"ranges,omitempty"`
	RangeSets []allocator.RangeSet `json:"rangeSets,omitempty"`
	Exclude   []netip.Prefix       `json:"exclude,omitempty"`
	Blocks    allocator.Blocks     `json:"blocks,omitzero"`
	// Migrating is set while `leaseholdctl pool migrate` moves the pool's keys from the flat
	// layout to blocks: agents refuse its ADDs until the tool clears it.
	Migrating *Migration `json:"migrating,omitempty"`
	// Access is who may get new addresses from the pool, kept apart from its definition:
	// a change of ranges or layout keeps it.
	PoolAccess
}

// PoolAccess is who may get new addresses from a pool (package selection). An agent that
// predates it ignores it.
type PoolAccess struct {
	// Closed: no new address comes from the pool (`leaseholdctl pool close`); its allocations
	// stay valid and renewable, and re-claims and sticky claims still take their own addresses
	// from it.
	Closed bool `json:"closed,omitempty"`
	// Namespaces are the only namespaces whose pods may get new addresses from the pool
	// (`leaseholdctl pool lock`); empty: any.
	Namespaces []string `json:"namespaces,omitempty"`
}

// Migration says who moves a pool to the block layout, and since when.
type Migration struct {
	By    string    `json:"by"`
	Since time.Time `json:"since"`
}

// LayoutBlocks is PoolRecord.Layout of a pool divided into blocks.
const LayoutBlocks = "blocks"

// NewPoolRecord is the stored form of spec: the block layout unless spec.Blocks is flat.
func NewPoolRecord(spec allocator.PoolSpec) PoolRecord {
	r := PoolRecord{Name: spec.Name, Exclude: spec.Exclude}
	if spec.Blocks.Flat() {
		r.Ranges = spec.Ranges
		return r
	}
	r.Layout, r.RangeSets, r.Blocks = LayoutBlocks, spec.Ranges, spec.Blocks
	return r
}

// Spec is the definition r stores, canonicalized. The error names what is wrong with r.
func (r PoolRecord) Spec() (allocator.PoolSpec, error) {
	spec := allocator.PoolSpec{Name: r.Name, Exclude: r.Exclude}
	switch {
	case r.Layout == "" && len(r.RangeSets) == 0 && r.Blocks.Flat():
		spec.Ranges = r.Ranges
	case r.Layout == LayoutBlocks && len(r.Ranges) == 0 && !r.Blocks.Flat():
		spec.Ranges, spec.Blocks = r.RangeSets, r.Blocks
	default:
		return spec, fmt.Errorf("%w: pool %s: the definition mixes the flat layout (\"ranges\") and the block layout "+
			"(\"layout\": %q, \"rangeSets\", \"blocks\"); store one of them", allocator.ErrInvalidConfig, r.Name, r.Layout)
	}
	if err := spec.Canonicalize(); err != nil {
		return spec, err
	}
	return spec, nil
}

// EncodePool is the stored value of spec (see PoolRecord).
func EncodePool(spec allocator.PoolSpec) string { return Encode(NewPoolRecord(spec)) }

// EncodePoolWith is EncodePool for a pool whose access is set: a writer that changes a stored
// pool's definition keeps what it read of its access.
func EncodePoolWith(spec allocator.PoolSpec, access PoolAccess) string {
	r := NewPoolRecord(spec)
	r.PoolAccess = access
	return Encode(r)
}

// DecodePoolAccess reads the access of the pool stored as value; ok is false when value is
// unreadable (DecodePool says why).
func DecodePoolAccess(value []byte) (PoolAccess, bool) {
	var r PoolRecord
	if err := json.Unmarshal(value, &r); err != nil {
		return PoolAccess{}, false
	}
	return r.PoolAccess, true
}

// DecodePool reads the definition stored at key, canonicalized, with its migration state.
// The error names the key and the etcdctl command that shows it.
func DecodePool(key string, value []byte) (allocator.PoolSpec, *Migration, error) {
	var r PoolRecord
	if err := json.Unmarshal(value, &r); err != nil {
		return allocator.PoolSpec{}, nil, fmt.Errorf("%w: pool definition at %s is unreadable (%v); inspect it with: etcdctl get %s",
			allocator.ErrInvalidConfig, key, err, key)
	}
	spec, err := r.Spec()
	if err != nil {
		return spec, r.Migrating, fmt.Errorf("pool definition at %s is invalid: %w", key, err)
	}
	return spec, r.Migrating, nil
}
