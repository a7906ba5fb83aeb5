package leases

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
// lost lease (reclaim.go), a conflict recorded for an address another owner holds meanwhile.
//
// The audit costs one compare per key: the ModRevision each key had when the agent last read
// it. Any write to the key changes it, and so does a delete (to 0), a put without the lease,
// or a restore of a backup older than the key; a key the agent has not read yet, or whose
// compare failed, is read and judged by its value and lease.

// auditor is the agent's part that checks the keys the agent keeps (the audit, as the top of
// this file says): the pass the recovery loop runs when one is due (ifDue), the check of one
// pod whose keys the views saw changed (goneLoop, fed by ownKeys), and the give-up of a
// running pod's lease whose keys are lost (keysLost, also from ADD). It owns whether an audit
// is due, whether etcd is suspected of going back in time, and the queue the views fill
// (ownKeys). The agent calls it from the recovery loop (ifDue, markDue), the gate's suspicion
// (suspect), ADD (keysLost), the re-claim (dropCopies) and the sticky claims (leaseAlive,
// markDue). What it needs of the agent is handed in when Start makes it (newAuditor); it
// signals up through wake (a pod's keys were lost: re-claim it) and wentBack (etcd went back
// in time).
type auditor struct {
	cfg    auditConfig
	cli    *clientv3.Client // the gate's
	keeper *keeper.Keeper
	log    *slog.Logger
	pods   auditBook
	pools  *poolview.Pools
	locks  *ownerlock.Locks
	// keys hears from the views of this node's pods' keys changed by someone else.
	keys *ownKeys
	// nodeLease is the node record's lease (0 before registration); blockLeaseLost drops the
	// block claims on a lease etcd no longer has, and tells whether it was a block lease.
	nodeLease      func() clientv3.LeaseID
	blockLeaseLost func(clientv3.LeaseID) bool
	// auditClaims checks the sticky claims of the running attachments (stickyClaims.auditClaims).
	auditClaims func(ctx context.Context, layouts map[string]allocator.Blocks) error
	// wake makes the recovery loop re-claim the pods whose keys were lost; wentBack tells the
	// agent that etcd went back in time, with what the pods held before the audit took the
	// pods whose keys went (nil: what they hold now).
	wake     func()
	wentBack func(why string, heldBefore map[conflictRef]bool)
	// audits counts the audits done; podKeysLost the keys found missing or changed.
	audits, podKeysLost prometheus.Counter

	// due asks for an audit at the recovery loop's next pass; suspected says that etcd may
	// have gone back in time (a compacted watch), so that keys found lost prove it.
	due       atomic.Bool
	suspected atomic.Bool
}

// auditConfig is what the audit uses of the agent's Config.
type auditConfig struct {
	Cluster, Node, NodeUID string
	OpTimeout              time.Duration
}

// auditBook is what the audit asks of the pod book (podbook.Book): its audit view, the
// pools and owners of its pods' addresses, and the one change it makes without an owner lock
// (Lose, as after a lost lease).
type auditBook interface {
	Audit() podbook.Audit
	Pools() []string
	OwnerOf(pool string, addr netip.Addr) (string, bool)
	HeldAddrs(lostSince time.Time) map[conflictRef]bool
	Lose(id clientv3.LeaseID) []string
}

// newAuditor makes the audit, handing in what it uses of the agent. The views are handed in
// once Start has made them: they are made after the audit, with its ownKeys as their hooks.
// The recovery, the restore notices and the sticky claims it signals are reached through
// the agent's fields, set before the first audit runs.
func (a *Agent) newAuditor() *auditor {
	cfg := a.cfg
	return &auditor{cfg: auditConfig{Cluster: cfg.Cluster, Node: cfg.Node, NodeUID: cfg.NodeUID, OpTimeout: cfg.OpTimeout},
		cli: a.cli, keeper: a.keeper, log: a.log, pods: a.pods, locks: &a.locks,
		keys:      newOwnKeys(cfg.Cluster, cfg.NodeUID, a.pods.OwnsAddr, func() { a.recovery.checkNow() }),
		nodeLease: a.nodeLease, blockLeaseLost: a.blockLeaseLost,
		auditClaims: func(ctx context.Context, layouts map[string]allocator.Blocks) error {
			return a.sticky.auditClaims(ctx, layouts)
		},
		wake: func() { a.recovery.wake() },
		wentBack: func(why string, heldBefore map[conflictRef]bool) {
			a.notices.etcdWentBack(why)
			a.cwatch.heldAlso(heldBefore)
		},
		audits: a.metrics.audits, podKeysLost: a.metrics.podKeysLost}
}

// opCtx bounds one etcd request by the operation timeout.
func (au *auditor) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, au.cfg.OpTimeout)
}

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (au *auditor) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// markDue makes the recovery loop's next pass begin with an audit.
func (au *auditor) markDue() { au.due.Store(true) }

// suspect records the gate's suspicion that etcd went back in time without a sign in its
// revisions: keys the next audit finds lost count as the proof. It tells whether etcd was
// suspected already.
func (au *auditor) suspect() (already bool) { return au.suspected.Swap(true) }

// errAuditFailed marks an audit that could not finish: it runs again on the next retry.
var errAuditFailed = errors.New("the check of this node's keys did not finish")

// ifDue runs the audit when one is due, and turns a suspicion into proof when it finds
// lost keys.
func (au *auditor) ifDue(ctx context.Context) (lost int, err error) {
	if !au.due.Swap(false) {
		return 0, nil
	}
	suspected := au.suspected.Swap(false)
	var held map[conflictRef]bool
	if suspected {
		held = au.pods.HeldAddrs(time.Now()) // before the audit takes the pods whose keys went
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
		au.wentBack(fmt.Sprintf("after a compacted watch, keys of %d running pods were missing or changed", lost), held)
	}
	return lost, nil
}

// audit checks every key the agent keeps against etcd, as the top of this file says, and
// reports how many pods it found with lost keys (each revoked and marked lost, for the
// re-claim that follows). A node record or block claim that is not the one the agent holds
// means etcd went back in time, and is reported as such.
func (au *auditor) audit(ctx context.Context) (lost int, err error) {
	layouts, err := au.auditLayouts(ctx)
	if err != nil {
		return 0, err
	}
	if err := au.auditOwn(ctx); err != nil {
		return 0, err
	}
	octx, cancel := au.opCtx(ctx)
	err = au.keeper.CheckRecycled(octx)
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
	pods := au.pods.Audit().Pods(au.cfg.Cluster, au.cfg.Node, layouts)
	au.markWatched(pods)
	var unverified []auditPod
	var verified []auditPod
	for _, p := range pods {
		if p.Verified() {
			verified = append(verified, p)
		} else {
			unverified = append(unverified, p)
		}
	}
	// The compares, pods whole in each transaction.
	compared := func(p auditPod) int {
		n := 0
		for _, k := range p.Keys {
			if all || !k.Watched {
				n++
			}
		}
		return n
	}
	for len(verified) > 0 {
		n := nextChunk(verified, compared)
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
		resp, err := au.cli.Txn(octx).If(cmps...).Commit()
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
		n := nextChunk(unverified, func(p auditPod) int { return len(p.Keys) })
		chunk := unverified[:n]
		unverified = unverified[n:]
		kvs, err := au.readKeys(ctx, chunk)
		if err != nil {
			return lost, err
		}
		for i, p := range chunk {
			if problems, _ := au.judge(p, kvs[i]); len(problems) == 0 {
				au.pods.Audit().Verified(p, kvs[i])
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
	if err := au.auditClaims(ctx, layouts); err != nil {
		return lost, err
	}
	au.audits.Inc()
	if lost > 0 {
		au.wake()
	}
	return lost, nil
}

// markWatched marks the allocations in blocks a view of this node follows (podbook.AuditKey.Watched).
func (au *auditor) markWatched(pods []auditPod) {
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

// nextChunk is how many of items, taken from the front, one transaction carries: as many as
// fit keyspace.MaxTxnOps by size, and always the first.
func nextChunk[T any](items []T, size func(T) int) int {
	n, total := 0, 0
	for n < len(items) && (n == 0 || total+size(items[n]) <= keyspace.MaxTxnOps) {
		total += size(items[n])
		n++
	}
	return n
}

// auditLayouts is the layout of each pool this node's pods have attachments in, read from
// the definitions the agent serves (a pool it does not serve yet is served now). A pool being
// migrated is left out: its keys move under the migration's freeze.
func (au *auditor) auditLayouts(ctx context.Context) (map[string]allocator.Blocks, error) {
	out := make(map[string]allocator.Blocks)
	for _, name := range au.pods.Pools() {
		p, err := au.pools.Ensure(ctx, allocator.PoolSpec{Name: name})
		if errors.Is(err, allocator.ErrUnavailable) {
			return nil, err
		}
		if err != nil {
			// No readable definition: the pod records and owner indexes are still checked.
			au.log.Warn("the keys of this pool's pods are checked without their allocations", "pool", name, "err", err)
			continue
		}
		if p.Migrating == nil {
			out[name] = p.Spec.Blocks
		}
	}
	return out, nil
}
