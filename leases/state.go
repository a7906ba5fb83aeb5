package leases

import (
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// attachment is one interface of a pod on one pool, as the agent remembers it.
type attachment struct {
	IfName      string       `json:"ifName"`
	Pool        string       `json:"pool"`
	Network     string       `json:"network"`
	ContainerID string       `json:"containerID"`
	IPs         []netip.Addr `json:"ips"`
	Created     time.Time    `json:"created"`
	// OwnerRev is the owner index's ModRevision as this agent last wrote or read it (0:
	// unknown). A DEL that finds it current needs no read before its transaction.
	OwnerRev int64 `json:"ownerRev,omitempty"`
}

// podState is what the agent knows of one pod whose lease it holds. It is mirrored in the
// local journal, so that after a lease loss (or a restart after one) the agent can re-claim
// the addresses of the pods that still run.
type podState struct {
	Owner       string           `json:"owner"`
	Pod         allocator.PodRef `json:"pod,omitzero"`
	Netns       string           `json:"netns,omitempty"`
	NodeUID     string           `json:"nodeUID"`
	LeaseID     string           `json:"leaseID"`
	Attachments []attachment     `json:"attachments"`

	lease   clientv3.LeaseID
	lastAdd time.Time // an ADD touched the pod; sandbox liveness leaves it alone for a grace
	lost    bool      // the lease stopped being renewed; re-claim pending
	// unanswered: a claim on the lease lost its answer, and etcd may apply it late, so the
	// lease is revoked when the pod goes, never recycled as a spare (Keeper.Recycle).
	unanswered bool
}

func (ps *podState) setLease(id clientv3.LeaseID) {
	ps.lease = id
	ps.LeaseID = keyspace.LeaseHex(id)
}

func (ps *podState) put(at attachment) {
	for i, old := range ps.Attachments {
		if old.IfName == at.IfName && old.Pool == at.Pool {
			ps.Attachments[i] = at
			return
		}
	}
	ps.Attachments = append(ps.Attachments, at)
}

func (ps *podState) drop(ifName, pool string) {
	ps.Attachments = slices.DeleteFunc(ps.Attachments, func(a attachment) bool { return a.IfName == ifName && a.Pool == pool })
}

func (ps *podState) clone() podState {
	c := *ps
	c.Attachments = slices.Clone(ps.Attachments)
	return c
}

// sandboxGone reports whether the sandbox behind netns certainly no longer exists: its
// network namespace path is gone. Any other answer (no path, a read error) counts as alive,
// so a failed look never releases a running pod's addresses.
func sandboxGone(netns string) bool {
	if netns == "" {
		return false
	}
	_, err := os.Stat(netns)
	return errors.Is(err, fs.ErrNotExist)
}
