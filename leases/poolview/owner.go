package poolview

import (
	"context"
	"log/slog"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// Owner is what a view needs to claim, keep and give back blocks for its node: the node's
// identity, and its block leases, which the agent keeps (they also carry its pods' held keys).
type Owner struct {
	Cluster, Node, NodeUID string
	// Lease returns the lease new block claims go on, granting one if there is none.
	Lease func(ctx context.Context) (clientv3.LeaseID, error)
	// Adopt resumes renewing a block lease this node identity granted earlier (a claim
	// found by a listing after a restart).
	Adopt func(ctx context.Context, id clientv3.LeaseID) error
	// Mine reports whether a lease is one of this node's block leases.
	Mine func(clientv3.LeaseID) bool
	// Idle is how long a block stays empty before it is given back; zero: never.
	Idle      time.Duration
	OpTimeout time.Duration
	// HoldBack: the node has a reuse delay, and its views apply the reuse order (reuse.go).
	HoldBack bool
	Wall     func() time.Time
	Metrics  Metrics
	// LostLease drops the claims on a block lease etcd no longer has, in every pool (a
	// claim's transaction found it gone).
	LostLease func(clientv3.LeaseID)
}

// Metrics are the counters the views add to (nil counters are not allowed).
type Metrics struct {
	// BlockClaims, BlocksGivenBack and Borrowed: blocks claimed, empty blocks given back,
	// addresses borrowed from others' blocks.
	BlockClaims, BlocksGivenBack, Borrowed prometheus.Counter
	// ExpiredReused: addresses reused whose holder expired without a release.
	ExpiredReused prometheus.Counter
}

// sortClaims reads a listing of a pool's block claims into who claimed each block, and the
// blocks that are this node's: claimed by its identity, on a lease it holds or adopts now.
func (o *Owner) sortClaims(ctx context.Context, log *slog.Logger, kvs []*mvccpb.KeyValue) (map[netip.Prefix]string, map[netip.Prefix]clientv3.LeaseID) {
	claims := make(map[netip.Prefix]string, len(kvs))
	mine := make(map[netip.Prefix]clientv3.LeaseID)
	for _, kv := range kvs {
		_, block, err := keyspace.ParseBlockKey(string(kv.Key))
		if err != nil {
			continue
		}
		rec, err := keyspace.Decode[keyspace.BlockRecord](string(kv.Key), kv.Value)
		claims[block] = rec.Cluster + "/" + rec.Node
		if err != nil || rec.Cluster != o.Cluster || rec.Node != o.Node || rec.NodeUID != o.NodeUID || kv.Lease == 0 {
			continue
		}
		lease := keyspace.LeaseOf(kv)
		if err := o.Adopt(ctx, lease); err != nil {
			log.Warn("a block claim of this node is on a lease that cannot be adopted; it goes with that lease",
				"block", block, "lease", keyspace.LeaseHex(lease), "err", err)
			continue
		}
		mine[block] = lease
	}
	return claims, mine
}
