package chaos

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"time"
)

// History is everything a run recorded: what the simulated runtime did and was answered,
// the faults injected, the periodic samples of etcd, the final snapshot and what the agents
// logged. Check judges it without any I/O, so it is also what a failed run leaves behind
// (history.json) to be judged again or read.
type History struct {
	Seed   int64  `json:"seed"`
	Params Params `json:"params"`
	// Start is when the runtime began, FaultsEnd when the last fault was reverted, End when
	// the final snapshot was taken.
	Start     time.Time `json:"start"`
	FaultsEnd time.Time `json:"faultsEnd"`
	End       time.Time `json:"end"`

	Pods   []*Pod   `json:"pods"`
	Faults []*Fault `json:"faults"`
	// Away are the stretches during which a node slot's agent could not reach etcd or was not
	// running: links down, SIGSTOP, kill -9 until it served again, a crash, a node death until
	// its replacement served.
	Away []Away `json:"away"`
	// Events are what happened outside the plan: an agent that exited on its own, a fault
	// that could not be applied.
	Events  []Event    `json:"events"`
	Samples []Sample   `json:"samples"`
	Logs    []LogEvent `json:"logs"`
	// LogStats counts the agents' WARN and ERROR lines by level and message.
	LogStats map[string]int `json:"logStats"`
	Final    *Final         `json:"final"`
}

// Params are the settings the checker needs to judge a history.
type Params struct {
	Nodes      int           `json:"nodes"`
	TTL        time.Duration `json:"ttl"`
	ReuseDelay time.Duration `json:"reuseDelay"`
	Quarantine time.Duration `json:"quarantine"`
	Pool       string        `json:"pool"`
	Subnet     string        `json:"subnet"`
	// PoolSize is how many addresses the pool hands out (the gateway excluded).
	PoolSize int  `json:"poolSize"`
	Tight    bool `json:"tight"`
	// Duration is the planned length of the fault phase.
	Duration time.Duration `json:"duration"`
}

// Pod is one pod sandbox of the simulated runtime, from its first ADD to its answered DEL.
// Its live interval is [AddAnswered, DelAnswered], or [AddAnswered, DiedAt] when its node
// died; a pod without AddAnswered was never live.
type Pod struct {
	UID       string       `json:"uid"`
	Container string       `json:"container"`
	Slot      int          `json:"slot"`
	Node      string       `json:"node"`
	NodeUID   string       `json:"nodeUID"`
	Addrs     []netip.Addr `json:"addrs,omitempty"`
	// Created is when the runtime sent its first ADD.
	Created     time.Time `json:"created"`
	AddAnswered time.Time `json:"addAnswered,omitzero"`
	// DelSent is when the first DEL was sent, DelAnswered when one answered success.
	DelSent     time.Time `json:"delSent,omitzero"`
	DelAnswered time.Time `json:"delAnswered,omitzero"`
	// DiedAt is when its node was killed for good while the pod was not yet deleted.
	DiedAt    time.Time `json:"diedAt,omitzero"`
	KeepAtEnd bool      `json:"keepAtEnd,omitempty"`
	// Claim is the migratable claim a VM's pod names (args.cni's ipam-claim-reference in the
	// pod's namespace: <namespace>.<reference>); empty for the other pods. Target is, for a
	// pod the runtime started as a live migration's target, its source's UID.
	Claim  string `json:"claim,omitempty"`
	Target string `json:"target,omitempty"`
	// Attempts are every ADD and DEL sent, successful or not.
	Attempts []Attempt `json:"attempts,omitempty"`
}

// Attempt is one plugin call.
type Attempt struct {
	Op       string    `json:"op"`
	Sent     time.Time `json:"sent"`
	Answered time.Time `json:"answered"`
	OK       bool      `json:"ok"`
	Code     uint      `json:"code,omitempty"`
	Msg      string    `json:"msg,omitempty"`
}

// Live reports whether the pod's ADD ever succeeded.
func (p *Pod) Live() bool { return !p.AddAnswered.IsZero() }

// LiveEnd is the end of the pod's live interval, or the zero time when it is still live.
func (p *Pod) LiveEnd() time.Time {
	if !p.DelAnswered.IsZero() {
		return p.DelAnswered
	}
	return p.DiedAt
}

// HoldEnd is when the pod stops holding its addresses as far as another pod is concerned: its
// first DEL sent (from then its release may apply at any moment, before the answer: a DEL
// whose answer a crash lost is sent again and answered later; the quarantine is what
// protects a sandbox being torn down), else the end of its live interval.
func (p *Pod) HoldEnd() time.Time {
	if !p.DelSent.IsZero() && (p.DelAnswered.IsZero() || p.DelSent.Before(p.DelAnswered)) {
		return p.DelSent
	}
	return p.LiveEnd()
}

// LiveAtEnd reports whether the pod is live when the run ends: its ADD answered, no DEL
// answered, its node alive.
func (p *Pod) LiveAtEnd() bool { return p.Live() && p.DelAnswered.IsZero() && p.DiedAt.IsZero() }

// liveAt reports whether t lies in the pod's live interval.
func (p *Pod) liveAt(t time.Time) bool {
	if !p.Live() || t.Before(p.AddAnswered) {
		return false
	}
	end := p.LiveEnd()
	return end.IsZero() || t.Before(end)
}

// hasAddr reports whether ip is one of the pod's addresses.
func (p *Pod) hasAddr(ip netip.Addr) bool {
	for _, a := range p.Addrs {
		if a == ip {
			return true
		}
	}
	return false
}

// Fault is one fault as injected: its real start and end.
type Fault struct {
	ID   int    `json:"id"`
	Kind string `json:"kind"`
	// Target names what it hit: n3 (node slot 3), e1 (etcd member 1), etcd (the cluster).
	Target string `json:"target"`
	Slot   int    `json:"slot"`
	Member int    `json:"member"`
	// Planned is the offset from the start of the run the schedule drew.
	Planned time.Duration `json:"planned"`
	Start   time.Time     `json:"start,omitzero"`
	End     time.Time     `json:"end,omitzero"`
	Skipped bool          `json:"skipped,omitempty"`
	Note    string        `json:"note,omitempty"`

	// An etcd-restore's: its way (RestorePlain, RestoreBump) and whether the cluster token,
	// and so the cluster ID, changed; the backup, sent at Start and saved at BackupDone, at
	// BackupRev; Lost, when every member was killed (etcd's data lost); the revision the
	// restored cluster answered at first; End, when its three members served again.
	Way         string    `json:"way,omitempty"`
	NewToken    bool      `json:"newToken,omitempty"`
	BackupDone  time.Time `json:"backupDone,omitzero"`
	BackupRev   int64     `json:"backupRev,omitempty"`
	Lost        time.Time `json:"lost,omitzero"`
	RestoredRev int64     `json:"restoredRev,omitempty"`
	// A key-edit's: which key of which pod (Key: KeyAllocation, ...; Path: the etcd key), Op
	// "del" or "put"; Start is when etcdctl changed it, Back when the run saw it again on a
	// lease with the pod's value (zero: not within keyWatch).
	Key  string    `json:"key,omitempty"`
	Op   string    `json:"op,omitempty"`
	Path string    `json:"path,omitempty"`
	Pod  string    `json:"pod,omitempty"`
	Back time.Time `json:"back,omitzero"`
}

// Away is a stretch during which a node slot's agent was cut off or not running. End is
// zero while it lasts.
type Away struct {
	Slot  int       `json:"slot"`
	Start time.Time `json:"start"`
	End   time.Time `json:"end,omitzero"`
	Cause string    `json:"cause"`
}

// Event is something worth reporting that is neither a fault nor a pod.
type Event struct {
	Time   time.Time `json:"time"`
	Kind   string    `json:"kind"`
	Slot   int       `json:"slot"`
	Detail string    `json:"detail"`
	// Fails marks an event that fails the run (an agent that exited on its own).
	Fails bool `json:"fails,omitempty"`
}

// Sample is one read of the allocations, sent at T0 and answered at T1.
type Sample struct {
	T0     time.Time `json:"t0"`
	T1     time.Time `json:"t1"`
	Rev    int64     `json:"rev"`
	Allocs []Alloc   `json:"allocs"`
	// HeldOnly counts the held keys (/leasehold/v1/held/) of addresses without an allocation:
	// addresses whose holder expired, held back from reuse. For the report only: the checker
	// judges fullness from the history, not from etcd.
	HeldOnly int `json:"heldOnly,omitempty"`
	// Quarantined counts the quarantine keys (addresses resting after a release).
	Quarantined int `json:"quarantined,omitempty"`
}

// Alloc is one allocation key: /leasehold/v1/ips/<pool>/<block>/<ip> and its owner.
type Alloc struct {
	IP    netip.Addr `json:"ip"`
	Owner string     `json:"owner"`
	Node  string     `json:"node,omitempty"`
	Lease int64      `json:"lease,omitempty"`
}

// Final is the state after the faults stopped, the runtime's DELs ran and the state
// settled, read at one revision.
type Final struct {
	Time      time.Time         `json:"time"`
	Rev       int64             `json:"rev"`
	Allocs    []Alloc           `json:"allocs"`
	Owners    map[string]string `json:"owners"`
	Conflicts map[string]string `json:"conflicts"`
	Held      map[string]string `json:"held"`
	// AllReady says every agent's /readyz answered 200 at the snapshot.
	AllReady bool `json:"allReady"`
	// Settled says the state matched the runtime's before the settle deadline.
	Settled    bool   `json:"settled"`
	SettleTook string `json:"settleTook"`
	// SettleNote is what the last look before the snapshot found.
	SettleNote   string `json:"settleNote"`
	DoctorExit   int    `json:"doctorExit"`
	DoctorOutput string `json:"doctorOutput"`
}

// LogEvent is an agent log line the checker reads.
type LogEvent struct {
	Time time.Time `json:"time"`
	Slot int       `json:"slot"`
	Node string    `json:"node"`
	// Kind is conflict (msg "CONFLICT..."), resolved ("conflict resolved..."), reuse
	// ("reusing an address whose holder expired..."), wentback ("etcd went back in time..."),
	// keyslost ("keys of a running pod were deleted or changed..."), reclaimed ("pod
	// re-claimed after its lease was lost": its keys are in etcd again), leaselost ("pod lease
	// lost", "the lease a claim applied on had stopped being renewed") or unknown ("...
	// etcd's history no longer tells whether another pod had its address meanwhile").
	Kind   string     `json:"kind"`
	Owner  string     `json:"owner,omitempty"`
	IfName string     `json:"ifname,omitempty"`
	Pool   string     `json:"pool,omitempty"`
	IP     netip.Addr `json:"ip,omitzero"`
	Taken  []Taken    `json:"taken,omitempty"`
	Msg    string     `json:"msg"`
}

// Taken is one address of a conflict and who holds it now.
type Taken struct {
	IP     netip.Addr `json:"ip"`
	Holder string     `json:"holder"`
}

// LoadHistory reads a history.json a run left, to judge it again.
func LoadHistory(path string) (*History, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var h History
	if err := json.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &h, nil
}
