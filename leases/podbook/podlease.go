package podbook

import (
	"net/netip"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// podLease is one pod's lease as the agent sees it. Its lifecycle:
//
//	none ──claim applied, lease adopted, or resumed at start──► held
//	held ──the keeper could not renew it in time──────────────► lost   (its keys are gone or going)
//	lost ──re-claimed: the old lease resumed if etcd still has it, else a new one──► held
//	held ──the pod's last attachment released──► given up: recycled as a spare when no key is
//	                                            left on it and no claim on it went unanswered,
//	                                            else revoked
//
// Only held leases are renewed, and only a held lease is ever written to: an ADD for a pod
// whose lease is lost claims as for a new pod, and the re-claim restores the rest.
type podLease struct {
	id    clientv3.LeaseID
	state leaseState
	// unanswered: a claim on the lease lost its answer, and etcd may apply it late, so the
	// lease is revoked when the pod goes, never recycled as a spare (Keeper.Recycle).
	unanswered bool
	// lostAt is when the lease was found lost (zero while it is not).
	lostAt time.Time
}

type leaseState uint8

const (
	leaseUnknown leaseState = iota // read from the journal; etcd not asked yet
	leaseHeld
	leaseLost
)

// hold records that id carries the pod's keys and the keeper renews it.
func (l *podLease) hold(id clientv3.LeaseID) { l.id, l.state, l.lostAt = id, leaseHeld, time.Time{} }

// lose records that the lease stopped being renewed; a re-claim is due.
func (l *podLease) lose() { l.state, l.lostAt = leaseLost, time.Now() }

// held returns the lease while it is held.
func (l podLease) held() (clientv3.LeaseID, bool) { return l.id, l.state == leaseHeld && l.id != 0 }

// lost tells whether a re-claim is due.
func (l podLease) lost() bool { return l.state == leaseLost }

// Attachment is one interface of a pod on one pool, as the agent remembers it.
type Attachment struct {
	IfName      string       `json:"ifName"`
	Pool        string       `json:"pool"`
	Network     string       `json:"network"`
	ContainerID string       `json:"containerID"`
	IPs         []netip.Addr `json:"ips"`
	Created     time.Time    `json:"created"`
	// OwnerRev is the owner index's ModRevision as this agent last wrote or read it (0:
	// unknown). A DEL that finds it current needs no read before its transaction.
	OwnerRev int64 `json:"ownerRev,omitempty"`
	// Claim is the attachment's sticky claim, kept on ClaimLease, which this agent renews
	// while the attachment holds it, and released with it for ClaimHold (leases/sticky).
	Claim      string           `json:"claim,omitempty"`
	ClaimLease clientv3.LeaseID `json:"claimLease,omitempty"`
	ClaimHold  time.Duration    `json:"claimHold,omitempty"`
	// ClaimMigratable: the claim allows a live migration (its record's migratable, from the
	// request that took it). A claim record put back or released from the attachment keeps it.
	ClaimMigratable bool `json:"claimMigratable,omitempty"`
	// Target: the attachment is a live migration's target (leases/sticky, migration.go). Its
	// addresses' keys are the claim's holder's, on the holder's leases, until the migration
	// completes: neither the audit nor the sticky claims' keep puts them back for it.
	Target bool `json:"target,omitempty"`
	// Source is a target's source: the owner the claim record named as holder when its
	// migration started. A record naming another holder (a restore brought back an older
	// one) is not the target's to take over (sticky.Claims.ReclaimTarget). "" for a journal
	// from before it: not compared.
	Source string `json:"source,omitempty"`
	// Released: the runtime's DEL of the attachment was answered while etcd could not be
	// reached. The DEL is final: the attachment is never re-claimed, and the agent releases
	// its keys once etcd answers (leases.Agent.releasePending).
	Released bool `json:"released,omitempty"`
	// ReleasedAt is when that DEL was answered.
	ReleasedAt time.Time `json:"releasedAt,omitzero"`
	// Conflicts are addresses of the attachment that another owner took while the pod's lease
	// was lost (a re-claim found them held). The agent watches them and takes each back for
	// the running pod as soon as its holder lets it go (leases/conflicts).
	Conflicts []netip.Addr `json:"conflicts,omitempty"`
}

// PodState is what the agent knows of one pod whose lease it holds. It is mirrored in the
// local journal, so that after a lease loss (or a restart after one) the agent can re-claim
// the addresses of the pods that still run.
type PodState struct {
	Owner       string           `json:"owner"`
	Pod         allocator.PodRef `json:"pod,omitzero"`
	Netns       string           `json:"netns,omitempty"`
	NodeUID     string           `json:"nodeUID"`
	LeaseID     string           `json:"leaseID"`
	Attachments []Attachment     `json:"attachments"`

	lease   podLease
	lastAdd time.Time // an ADD touched the pod; sandbox liveness leaves it alone for a grace
	// checked is what the audit last found right of the pod's keys (Audit).
	checked checkedKeys
}

// checkedKeys are the ModRevisions of a pod's keys when the audit last read them on lease
// and found them as the agent wrote them. Replaced whole, never changed in place.
type checkedKeys struct {
	lease clientv3.LeaseID
	revs  map[string]int64
}

// Lease is the pod's lease, held or not (0: none known): the one a re-claim tries to resume.
func (ps PodState) Lease() clientv3.LeaseID { return ps.lease.id }

// Held returns the pod's lease while it is held.
func (ps PodState) Held() (clientv3.LeaseID, bool) { return ps.lease.held() }

// hold is podLease.hold, keeping the journaled LeaseID in step.
func (ps *PodState) hold(id clientv3.LeaseID) {
	ps.lease.hold(id)
	ps.LeaseID = keyspace.LeaseHex(id)
}

// put records at as the pod's attachment of its interface and pool. The same container's
// attachment read again from etcd (a repeated ADD) keeps the conflicts the agent knows of
// for its addresses: the owner index does not list them. A re-claim, which finds them
// anew, gives them, none as an empty list.
func (ps *PodState) put(at Attachment) {
	for i, old := range ps.Attachments {
		if old.IfName == at.IfName && old.Pool == at.Pool {
			if at.Conflicts == nil && old.ContainerID == at.ContainerID {
				at.Conflicts = slices.DeleteFunc(slices.Clone(old.Conflicts), func(a netip.Addr) bool { return !slices.Contains(at.IPs, a) })
			}
			ps.Attachments[i] = at
			return
		}
	}
	ps.Attachments = append(ps.Attachments, at)
}

func (ps *PodState) drop(ifName, pool string) {
	ps.Attachments = slices.DeleteFunc(ps.Attachments, func(a Attachment) bool { return a.IfName == ifName && a.Pool == pool })
}

func (ps *PodState) clone() PodState {
	c := *ps
	c.Attachments = slices.Clone(ps.Attachments)
	for i := range c.Attachments {
		c.Attachments[i].Conflicts = slices.Clone(c.Attachments[i].Conflicts)
	}
	return c
}
