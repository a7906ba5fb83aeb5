package podbook

import (
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// AttachmentOf is the attachment an owner index describes, as held by container at rev.
func AttachmentOf(rec keyspace.OwnerRecord, ifName, pool, container string, rev int64) Attachment {
	at := Attachment{IfName: ifName, Pool: pool, Network: rec.Network, ContainerID: container, IPs: rec.IPs,
		Created: rec.Created, OwnerRev: rev, Claim: rec.Claim, ClaimHold: time.Duration(rec.ClaimHoldSeconds) * time.Second,
		ClaimMigratable: rec.ClaimMigratable}
	if rec.Claim != "" {
		at.ClaimLease, _ = keyspace.ParseLeaseHex(rec.ClaimLease)
	}
	return at
}

// OwnerIndexOf is the owner index of attachment at on lease, written by node: with its
// sticky claim, so that a re-claim after a lost lease keeps the attachment the claim's holder
// (a DEL or GC that reads the index back then releases the claim, not plain addresses).
func OwnerIndexOf(at Attachment, node, nodeUID string, lease clientv3.LeaseID) keyspace.OwnerRecord {
	rec := keyspace.OwnerRecord{IPs: at.IPs, ContainerID: at.ContainerID, Network: at.Network, Node: node,
		NodeUID: nodeUID, LeaseID: keyspace.LeaseHex(lease), Created: at.Created,
		Claim: at.Claim, ClaimHoldSeconds: int64(at.ClaimHold / time.Second), ClaimMigratable: at.ClaimMigratable}
	if at.ClaimLease != 0 {
		rec.ClaimLease = keyspace.LeaseHex(at.ClaimLease)
	}
	return rec
}
