package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
)

// Record writes the node record. Its lease calls are handed in: a spare lease from the
// keeper for the record, and the node's block lease, whose ID the record names so that a
// restart adopts the node's block claims.
type Record struct {
	KV clientv3.KV
	ID Identity
	// Take, Return and Refill are the keeper's spare leases.
	Take   func(context.Context) (clientv3.LeaseID, error)
	Return func(clientv3.LeaseID)
	Refill func()
	// AdoptBlockLease takes up the block lease an earlier record of this identity names;
	// BlockLease is the node's block lease, granted if it has none.
	AdoptBlockLease func(context.Context, clientv3.LeaseID) error
	BlockLease      func(context.Context) (clientv3.LeaseID, error)
	OpTimeout       time.Duration
	Wall            func() time.Time // the time written into records
	Log             *slog.Logger
}

// Register writes the node record on a fresh node lease and returns that lease. The record
// is this node identity's claim: it is created if absent, and replaced (compared by revision)
// only when it names another node UID (the same-name replacement of docs/field-failures.md)
// or this very host (this agent's own previous process, dead since this one holds the
// host-wide lock on the identity). A live record with this node UID from another host means
// two machines run one node identity: both would renew, adopt and release the same pods, so
// the agent refuses with ErrAgentRunning.
func (r Record) Register(ctx context.Context) (clientv3.LeaseID, error) {
	octx, cancel := context.WithTimeout(ctx, r.OpTimeout)
	defer cancel()
	defer r.Refill()
	id, err := r.Take(octx)
	if err != nil {
		return 0, fmt.Errorf("%w: register node %s in etcd: %w", allocator.ErrUnavailable, r.ID.Node, err)
	}
	key := keyspace.NodeKey(r.ID.Cluster, r.ID.Node)
	rec := keyspace.NodeRecord{UID: r.ID.UID, Host: r.ID.Host, PID: os.Getpid(), Version: r.ID.Version, Blocks: true,
		LiveMigration: true, Started: r.Wall(), LeaseID: keyspace.LeaseHex(id)}
	for attempt := 0; ; attempt++ {
		cur, err := r.KV.Get(octx, key)
		if err != nil {
			r.Return(id)
			return 0, fmt.Errorf("%w: read node record %s: %w", allocator.ErrUnavailable, key, err)
		}
		cmp := keyspace.Absent(key)
		if len(cur.Kvs) > 0 {
			kv := cur.Kvs[0]
			var old keyspace.NodeRecord
			// A record without a host is an earlier version's: its host is unknown, and refusing
			// would keep a restarted node down for a TTL after an upgrade.
			if json.Unmarshal(kv.Value, &old) == nil && old.UID == r.ID.UID && old.Host != "" && old.Host != r.ID.Host && kv.Lease != 0 {
				r.Return(id)
				return 0, fmt.Errorf("%w: node %q of cluster %q with node UID %q is already served by an agent on host %q "+
					"(pid %d, started %s, lease %s), and this agent runs on host %q; stop one of them or give them "+
					"different --node-uid values (the record expires within the lease TTL once that agent stops)",
					ErrAgentRunning, r.ID.Node, r.ID.Cluster, r.ID.UID, old.Host, old.PID,
					old.Started.Format(time.RFC3339), old.LeaseID, r.ID.Host)
			}
			if old.UID != r.ID.UID && old.UID != "" {
				r.Log.Warn("node record of another node UID replaced (a same-name replacement)", "previous_uid", old.UID,
					"previous_host", old.Host)
			}
			if bl, err := keyspace.ParseLeaseHex(old.BlockLease); err == nil && bl != 0 && old.UID == r.ID.UID {
				// This identity's block lease from before a restart or a lost node lease: its
				// claims and held keys are this node's.
				if err := r.AdoptBlockLease(octx, bl); err != nil && !errors.Is(err, keeper.ErrLeaseLost) {
					r.Log.Warn("resuming this node's block lease failed; its claims go with it", "lease", old.BlockLease, "err", err)
				}
			}
			cmp = keyspace.Unchanged(key, kv.ModRevision)
		}
		bl, err := r.BlockLease(octx)
		if err != nil {
			r.Return(id)
			return 0, fmt.Errorf("%w: grant this node's block lease: %w", allocator.ErrUnavailable, err)
		}
		rec.BlockLease = keyspace.LeaseHex(bl)
		resp, err := r.KV.Txn(octx).If(cmp).Then(clientv3.OpPut(key, keyspace.Encode(rec), clientv3.WithLease(id))).Commit()
		if err != nil {
			r.Return(id)
			return 0, fmt.Errorf("%w: write node record %s: %w", allocator.ErrUnavailable, key, err)
		}
		if resp.Succeeded {
			break
		}
		if attempt == 4 {
			r.Return(id)
			return 0, fmt.Errorf("%w: node record %s changed under every one of 5 attempts", ErrAgentRunning, key)
		}
	}
	r.Log.Info("node registered", "uid", r.ID.UID, "host", r.ID.Host, "lease", keyspace.LeaseHex(id))
	return id, nil
}

// Self is this agent's node: its record, registered again whenever its lease is lost, and the
// lease of the record registered last.
type Self struct {
	Record Record
	lease  atomic.Int64
}

// Register writes the node record on a fresh node lease (Record.Register) and keeps it.
func (s *Self) Register(ctx context.Context) error {
	id, err := s.Record.Register(ctx)
	if err != nil {
		return err
	}
	s.lease.Store(int64(id))
	return nil
}

// Lease is the node record's lease; 0 before the node is registered.
func (s *Self) Lease() clientv3.LeaseID { return clientv3.LeaseID(s.lease.Load()) }
