package keyspace

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
)

// Allocation is the value of /leasehold/v1/ips/<pool>/<block>/<ip>: who holds the address.
type Allocation struct {
	Owner       string           `json:"owner"`
	Cluster     string           `json:"cluster"`
	Node        string           `json:"node"`
	NodeUID     string           `json:"nodeUID"`
	Pod         allocator.PodRef `json:"pod,omitzero"`
	ContainerID string           `json:"containerID"`
	IfName      string           `json:"ifName"`
	Network     string           `json:"network"`
	// LeaseID is the pod lease, in etcdctl's hex form.
	LeaseID string    `json:"leaseID"`
	Created time.Time `json:"created"`
}

// OwnerRecord is the value of /leasehold/v1/owners/<cluster>/<owner>/<ifname>/<pool>:
// the addresses of one attachment, in range-set order.
type OwnerRecord struct {
	IPs         []netip.Addr `json:"ips"`
	ContainerID string       `json:"containerID"`
	Network     string       `json:"network"`
	Node        string       `json:"node"`
	NodeUID     string       `json:"nodeUID"`
	LeaseID     string       `json:"leaseID"`
	Created     time.Time    `json:"created"`
	// Claim names the attachment's sticky claim, if any; ClaimLease is the claim lease the
	// agent renews while the attachment holds it.
	Claim      string `json:"claim,omitempty"`
	ClaimLease string `json:"claimLease,omitempty"`
	// ClaimHoldSeconds is how long the claim outlives the attachment's release.
	ClaimHoldSeconds int64 `json:"claimHoldSeconds,omitempty"`
	// ClaimMigratable: the claim allows a live migration (ClaimRecord.Migratable), kept here
	// so that an agent that puts the claim back after etcd went back in time, or releases it,
	// keeps the mark the claim record had.
	ClaimMigratable bool `json:"claimMigratable,omitempty"`
}

// PodRecord is the value of /leasehold/v1/nodes/<cluster>/<node>/pods/<owner>: the pod
// lease and what the node needs to decide whether the sandbox still exists.
type PodRecord struct {
	Owner       string           `json:"owner"`
	Pod         allocator.PodRef `json:"pod,omitzero"`
	NodeUID     string           `json:"nodeUID"`
	LeaseID     string           `json:"leaseID"`
	Netns       string           `json:"netns,omitempty"`
	ContainerID string           `json:"containerID"`
	Created     time.Time        `json:"created"`
}

// NodeRecord is the value of /leasehold/v1/nodes/<cluster>/<node>: the agent now serving
// the node, on the agent's own lease.
type NodeRecord struct {
	UID string `json:"uid"`
	// Host and PID say where the agent runs (Config.Host); a second host with the same UID
	// is refused.
	Host    string `json:"host,omitempty"`
	PID     int    `json:"pid,omitempty"`
	Version string `json:"version"`
	// Blocks says the agent serves pools in the block layout (allocator.Blocks); `leaseholdctl
	// pool migrate` refuses while a live agent without it could still claim in the flat one.
	Blocks bool `json:"blocks,omitempty"`
	// LiveMigration says the agent takes part in live migrations (LiveMigrationKey): its DEL
	// of a claim's holder compares the claim's migration key. doctor warns of a live agent
	// without it while its cluster has a migratable claim (live-migration-old-agent).
	LiveMigration bool      `json:"liveMigration,omitempty"`
	Started       time.Time `json:"started"`
	LeaseID       string    `json:"leaseID"`
	// BlockLease is the lease the agent's block claims and held keys go on (HeldKey): it
	// outlives the pod leases by the reuse delay. A restart with the same UID adopts it.
	BlockLease string `json:"blockLease,omitempty"`
}

// HeldRecord is the value of /leasehold/v1/held/<pool>/<block>/<ip>: the node and owner whose
// allocation of the address the key stands for (HeldKey).
type HeldRecord struct {
	Cluster string `json:"cluster"`
	Node    string `json:"node"`
	Owner   string `json:"owner"`
}

// ConflictRecord is the value of /leasehold/v1/conflicts/<cluster>/<owner>/<ifname>/<pool>.
type ConflictRecord struct {
	ContainerID string         `json:"containerID"`
	Node        string         `json:"node"`
	NodeUID     string         `json:"nodeUID"`
	Taken       []TakenByOther `json:"taken"`
	Detected    time.Time      `json:"detected"`
}

// TakenByOther names an address of a conflict and who holds it now.
type TakenByOther struct {
	IP          netip.Addr `json:"ip"`
	Holder      string     `json:"holder"`
	Cluster     string     `json:"cluster,omitempty"`
	Node        string     `json:"node,omitempty"`
	ContainerID string     `json:"containerID,omitempty"`
	Quarantined bool       `json:"quarantined,omitempty"`
}

// PoolConflictRecord is the value of /leasehold/v1/poolconflicts/<pool>/<cluster>/<node>.
type PoolConflictRecord struct {
	Cluster  string             `json:"cluster"`
	Node     string             `json:"node"`
	Wanted   allocator.PoolSpec `json:"wanted"`
	Stored   allocator.PoolSpec `json:"stored"`
	Detected time.Time          `json:"detected"`
}

// RestoredRecord is the value of /leasehold/v1/restored: the agent that found etcd gone back
// in time, when, why, and the end of its settle time.
type RestoredRecord struct {
	Cluster string    `json:"cluster"`
	Node    string    `json:"node"`
	Noticed time.Time `json:"noticed"`
	Until   time.Time `json:"until"`
	Why     string    `json:"why"`
}

// QuarantineRecord is the value of /leasehold/v1/quarantine/<pool>/<block>/<ip>.
type QuarantineRecord struct {
	ReleasedBy string    `json:"releasedBy"`
	Until      time.Time `json:"until"`
	// Claim names the sticky claim the address rests under: only the claim's next holder may
	// take it before it ends (see ClaimRecord).
	Claim string `json:"claim,omitempty"`
}

// LeaseHex renders a lease ID as etcdctl prints it (etcdctl lease timetolive <hex>).
func LeaseHex(id clientv3.LeaseID) string { return fmt.Sprintf("%x", int64(id)) }

// ParseLeaseHex reads a lease ID in etcdctl's hex form.
func ParseLeaseHex(s string) (clientv3.LeaseID, error) {
	var v int64
	if _, err := fmt.Sscanf(s, "%x", &v); err != nil {
		return 0, fmt.Errorf("lease ID %q is not hex: %w", s, err)
	}
	return clientv3.LeaseID(v), nil
}

// Encode is the JSON value stored for a record. Records are plain structs of strings,
// addresses and times, which always marshal; anything else is a programming error.
func Encode(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("leasehold: marshal %T: %v", v, err))
	}
	return string(b)
}

// Decode reads the record stored at key. The error names the key and the etcdctl command
// that shows it.
func Decode[T any](key string, value []byte) (T, error) {
	var v T
	if err := json.Unmarshal(value, &v); err != nil {
		return v, fmt.Errorf("key %s holds a value leasehold cannot read (%w); inspect it with: etcdctl get %s", key, err, key)
	}
	return v, nil
}
