// Package audit is the agent's check that the keys it keeps in etcd are as it wrote them,
// on the leases it holds them on (ARCHITECTURE.md, invariant 15); docs/agent.md, "The audit".
package audit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
)

// A live lease is not proof that the keys on it exist: an etcd restored from a backup has
// the leases the backup had, without what was written on them since, and an admin may delete
// or overwrite a key with etcdctl. So the agent checks what it wrote (audit) every
// Config.AuditInterval, and at once when etcd may have gone back in time (etcdgate): the node
// record, the block claims its views hold, and for each running pod its pod record, owner
// indexes and allocations. A key missing, on another lease or with a value this agent did not
// write is a lost key: the pod's lease is revoked and the pod re-claimed, exactly as after a
// lost lease (leases/reclaim), a conflict recorded for an address another owner holds meanwhile.
//
// The audit costs one compare per key: the ModRevision each key had when the agent last read
// it. Any write to the key changes it, and so does a delete (to 0), a put without the lease,
// or a restore of a backup older than the key; a key the agent has not read yet, or whose
// compare failed, is read and judged by its value and lease.

// Auditor is the agent's part that checks the keys the agent keeps (the audit, as the top of
// this file says): the pass the recovery loop runs when one is due (IfDue), the check of one
// pod whose keys the views saw changed (GoneLoop, fed by OwnKeys), and the give-up of a
// running pod's lease whose keys are lost (KeysLost, also from ADD). It owns whether an audit
// is due, whether etcd is suspected of going back in time, and the queue the views fill
// (OwnKeys). The agent calls it from the recovery loop (IfDue, MarkDue), the gate's suspicion
// (Suspect), ADD (KeysLost), the re-claim (DropCopies) and the sticky claims (LeaseAlive,
// MarkDue). What it needs of the agent is handed in when the agent makes it (Config); it
// signals up through Config.Wake (a pod's keys were lost: re-claim it) and Config.WentBack
// (etcd went back in time).
type Auditor struct {
	cfg   Config
	pools *poolview.Pools
	// keys hears from the views of this node's pods' keys changed by someone else.
	keys *OwnKeys

	// due asks for an audit at the recovery loop's next pass; suspected says that etcd may
	// have gone back in time (a compacted watch), so that keys found lost prove it.
	due       atomic.Bool
	suspected atomic.Bool
}

// Config is what the audit is handed of the agent.
type Config struct {
	Cluster, Node, NodeUID string
	OpTimeout              time.Duration

	Client *clientv3.Client // the gate's
	Keeper *keeper.Keeper
	Log    *slog.Logger
	Pods   Book
	Locks  *ownerlock.Locks
	// NodeLease is the node record's lease (0 before registration); BlockLeaseLost drops the
	// block claims on a lease etcd no longer has, and tells whether it was a block lease.
	NodeLease      func() clientv3.LeaseID
	BlockLeaseLost func(clientv3.LeaseID) bool
	// AuditClaims checks the sticky claims of the running attachments.
	AuditClaims func(ctx context.Context, layouts map[string]allocator.Blocks) error
	// Wake makes the recovery loop re-claim the pods whose keys were lost; WentBack tells the
	// agent that etcd went back in time, with what the pods held before the audit took the
	// pods whose keys went (nil: what they hold now); CheckNow makes a whole audit due at once
	// (the views' reports overflowed their queue).
	Wake     func()
	WentBack func(why string, heldBefore map[podbook.ConflictRef]bool)
	CheckNow func()
	// Audits counts the audits done; PodKeysLost the keys found missing or changed.
	Audits, PodKeysLost prometheus.Counter
}

// Book is what the audit asks of the pod book (podbook.Book): its audit view, the pools and
// owners of its pods' addresses, and the one change it makes without an owner lock (Lose, as
// after a lost lease).
type Book interface {
	Audit() podbook.Audit
	Pools() []string
	OwnsAddr(pool string, addr netip.Addr) bool
	OwnerOf(pool string, addr netip.Addr) (string, bool)
	HeldAddrs(lostSince time.Time) map[podbook.ConflictRef]bool
	Lose(id clientv3.LeaseID) []string
}

// New makes the audit. The views are handed in by SetPools once the agent has made them:
// they are made after the audit, with its OwnKeys as their hooks.
func New(cfg Config) *Auditor {
	return &Auditor{cfg: cfg, keys: newOwnKeys(cfg.Cluster, cfg.NodeUID, cfg.Pods.OwnsAddr, cfg.CheckNow)}
}

// SetPools hands in the views, made after the audit.
func (au *Auditor) SetPools(pools *poolview.Pools) { au.pools = pools }

// Keys is what the views report to (poolview.Hooks Put, Deleted and Listed).
func (au *Auditor) Keys() *OwnKeys { return au.keys }

// opCtx bounds one etcd request by the operation timeout.
func (au *Auditor) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, au.cfg.OpTimeout)
}

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (au *Auditor) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// MarkDue makes the recovery loop's next pass begin with an audit.
func (au *Auditor) MarkDue() { au.due.Store(true) }

// suspect records the gate's suspicion that etcd went back in time without a sign in its
// revisions: keys the next audit finds lost count as the proof. It tells whether etcd was
// suspected already.
func (au *Auditor) Suspect() (already bool) { return au.suspected.Swap(true) }

// errAuditFailed marks an audit that could not finish: it runs again on the next retry.
var errAuditFailed = errors.New("the check of this node's keys did not finish")

// IfDue runs the audit when one is due, and turns a suspicion into proof when it finds
// lost keys.
func (au *Auditor) IfDue(ctx context.Context) (lost int, err error) {
	if !au.due.Swap(false) {
		return 0, nil
	}
	suspected := au.suspected.Swap(false)
	var held map[podbook.ConflictRef]bool
	if suspected {
		held = au.cfg.Pods.HeldAddrs(time.Now()) // before the audit takes the pods whose keys went
	}
	lost, err = au.audit(ctx)
	if err != nil {
		au.due.Store(true)
		if suspected {
			au.suspected.Store(true)
		}
		return lost, fmt.Errorf("%w: %w", errAuditFailed, err)
	}
	if suspected && lost > 0 {
		au.cfg.WentBack(fmt.Sprintf("after a compacted watch, keys of %d running pods were missing or changed", lost), held)
	}
	return lost, nil
}

// audit checks every key the agent keeps against etcd, as the top of this file says, and
// reports how many pods it found with lost keys (each revoked and marked lost, for the
// re-claim that follows). A node record or block claim that is not the one the agent holds
// means etcd went back in time, and is reported as such.
func (au *Auditor) audit(ctx context.Context) (lost int, err error) {
	layouts, err := au.auditLayouts(ctx)
	if err != nil {
		return 0, err
	}
	if err := au.auditOwn(ctx); err != nil {
		return 0, err
	}
	octx, cancel := au.opCtx(ctx)
	err = au.cfg.Keeper.CheckRecycled(octx)
	cancel()
	if err != nil {
		return 0, au.unavailable("check the recycled spare leases", err)
	}
	all := au.keys.relisted.Swap(false)
	defer func() {
		if err != nil && all {
			au.keys.relisted.Store(true)
		}
	}()
	pods := au.cfg.Pods.Audit().Pods(au.cfg.Cluster, au.cfg.Node, layouts)
	au.markWatched(pods)
	var unverified []podbook.AuditPod
	var verified []podbook.AuditPod
	for _, p := range pods {
		if p.Verified() {
			verified = append(verified, p)
		} else {
			unverified = append(unverified, p)
		}
	}
	// The compares, pods whole in each transaction.
	compared := func(p podbook.AuditPod) int {
		n := 0
		for _, k := range p.Keys {
			if all || !k.Watched {
				n++
			}
		}
		return n
	}
	for len(verified) > 0 {
		n := keyspace.TxnChunk(verified, compared)
		chunk := verified[:n]
		verified = verified[n:]
		var cmps []clientv3.Cmp
		for _, p := range chunk {
			for _, k := range p.Keys {
				if all || !k.Watched {
					cmps = append(cmps, keyspace.Unchanged(k.Key, k.Rev))
				}
			}
		}
		octx, cancel := au.opCtx(ctx)
		resp, err := au.cfg.Client.Txn(octx).If(cmps...).Commit()
		cancel()
		if err != nil {
			return lost, au.unavailable("check the keys of this node's pods", err)
		}
		if !resp.Succeeded {
			unverified = append(unverified, chunk...)
		}
	}
	// The reads, for pods not verified yet and those whose compare failed.
	for len(unverified) > 0 {
		n := keyspace.TxnChunk(unverified, func(p podbook.AuditPod) int { return len(p.Keys) })
		chunk := unverified[:n]
		unverified = unverified[n:]
		kvs, err := au.readKeys(ctx, chunk)
		if err != nil {
			return lost, err
		}
		for i, p := range chunk {
			if problems, _ := au.judge(p, kvs[i]); len(problems) == 0 {
				au.cfg.Pods.Audit().Verified(p, kvs[i])
				continue
			}
			gone, err := au.recheckPod(ctx, p.Owner, layouts)
			if err != nil {
				return lost, err
			}
			if gone {
				lost++
			}
		}
	}
	if err := au.cfg.AuditClaims(ctx, layouts); err != nil {
		return lost, err
	}
	au.cfg.Audits.Inc()
	if lost > 0 {
		au.cfg.Wake()
	}
	return lost, nil
}

// markWatched marks the allocations in blocks a view of this node follows (podbook.AuditKey.Watched).
func (au *Auditor) markWatched(pods []podbook.AuditPod) {
	views := map[string]*poolview.View{}
	for _, p := range pods {
		for i := range p.Keys {
			k := &p.Keys[i]
			if k.Kind != podbook.AuditAllocation {
				continue
			}
			v, ok := views[k.Pool]
			if !ok {
				v = au.pools.ViewOf(k.Pool)
				views[k.Pool] = v
			}
			k.Watched = v != nil && v.FollowsAddr(k.Addr)
		}
	}
}

// auditLayouts is the layout of each pool this node's pods have attachments in, read from
// the definitions the agent serves (a pool it does not serve yet is served now). A pool being
// migrated is left out: its keys move under the migration's freeze.
func (au *Auditor) auditLayouts(ctx context.Context) (map[string]allocator.Blocks, error) {
	out := make(map[string]allocator.Blocks)
	for _, name := range au.cfg.Pods.Pools() {
		p, err := au.pools.Ensure(ctx, allocator.PoolSpec{Name: name})
		if errors.Is(err, allocator.ErrUnavailable) {
			return nil, err
		}
		if err != nil {
			// No readable definition: the pod records and owner indexes are still checked.
			au.cfg.Log.Warn("the keys of this pool's pods are checked without their allocations", "pool", name, "err", err)
			continue
		}
		if p.Migrating == nil {
			out[name] = p.Spec.Blocks
		}
	}
	return out, nil
}
