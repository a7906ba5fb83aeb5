package leases

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
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

// audit checks every key the agent keeps against etcd, as the top of this file says, and
// reports how many pods it found with lost keys (each revoked and marked lost, for the
// re-claim that follows). A node record or block claim that is not the one the agent holds
// means etcd went back in time, and is reported as such.
func (a *Agent) audit(ctx context.Context) (lost int, err error) {
	layouts, err := a.auditLayouts(ctx)
	if err != nil {
		return 0, err
	}
	if err := a.auditOwn(ctx); err != nil {
		return 0, err
	}
	octx, cancel := a.opCtx(ctx)
	err = a.keeper.CheckRecycled(octx)
	cancel()
	if err != nil {
		return 0, a.unavailable("check the recycled spare leases", err)
	}
	all := a.keys.relisted.Swap(false)
	defer func() {
		if err != nil && all {
			a.keys.relisted.Store(true)
		}
	}()
	pods := a.pods.Audit().Pods(a.cfg.Cluster, a.cfg.Node, layouts)
	a.markWatched(pods)
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
		octx, cancel := a.opCtx(ctx)
		resp, err := a.cli.Txn(octx).If(cmps...).Commit()
		cancel()
		if err != nil {
			return lost, a.unavailable("check the keys of this node's pods", err)
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
		kvs, err := a.readKeys(ctx, chunk)
		if err != nil {
			return lost, err
		}
		for i, p := range chunk {
			if problems, _ := a.judge(p, kvs[i]); len(problems) == 0 {
				a.pods.Audit().Verified(p, kvs[i])
				continue
			}
			gone, err := a.recheckPod(ctx, p.Owner, layouts)
			if err != nil {
				return lost, err
			}
			if gone {
				lost++
			}
		}
	}
	if err := a.sticky.auditClaims(ctx, layouts); err != nil {
		return lost, err
	}
	a.metrics.audits.Inc()
	if lost > 0 {
		a.recovery.wake()
	}
	return lost, nil
}

// markWatched marks the allocations in blocks a view of this node follows (podbook.AuditKey.Watched).
func (a *Agent) markWatched(pods []auditPod) {
	views := map[string]*poolview.View{}
	for _, p := range pods {
		for i := range p.Keys {
			k := &p.Keys[i]
			if k.Kind != podbook.AuditAllocation {
				continue
			}
			v, ok := views[k.Pool]
			if !ok {
				v = a.pools.ViewOf(k.Pool)
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
func (a *Agent) auditLayouts(ctx context.Context) (map[string]allocator.Blocks, error) {
	out := make(map[string]allocator.Blocks)
	for _, name := range a.pods.Pools() {
		p, err := a.pools.Ensure(ctx, allocator.PoolSpec{Name: name})
		if errors.Is(err, allocator.ErrUnavailable) {
			return nil, err
		}
		if err != nil {
			// No readable definition: the pod records and owner indexes are still checked.
			a.log.Warn("the keys of this pool's pods are checked without their allocations", "pool", name, "err", err)
			continue
		}
		if p.Migrating == nil {
			out[name] = p.Spec.Blocks
		}
	}
	return out, nil
}

// readKeys reads the keys of pods in one transaction: per pod, one answer per key (nil: no
// such key).
func (a *Agent) readKeys(ctx context.Context, pods []auditPod) ([][]*mvccpb.KeyValue, error) {
	var ops []clientv3.Op
	for _, p := range pods {
		for _, k := range p.Keys {
			ops = append(ops, clientv3.OpGet(k.Key))
		}
	}
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	resp, err := a.cli.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return nil, a.unavailable("read the keys of this node's pods", err)
	}
	out := make([][]*mvccpb.KeyValue, len(pods))
	i := 0
	for j, p := range pods {
		out[j] = make([]*mvccpb.KeyValue, len(p.Keys))
		for k := range p.Keys {
			if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
				out[j][k] = kvs[0]
			}
			i++
		}
	}
	return out, nil
}

// judge says what is wrong with the keys read for p (kvs, in p.Keys' order): one line per
// key; and which keys hold a value this agent wrote for p but sit on another lease or none
// (an admin's copy): they must go before the re-claim, which creates each key only if absent.
func (a *Agent) judge(p auditPod, kvs []*mvccpb.KeyValue) (problems []string, copies []*mvccpb.KeyValue) {
	for i, k := range p.Keys {
		kv := kvs[i]
		if kv == nil {
			problems = append(problems, k.Key+": missing")
			continue
		}
		ours := a.writtenFor(p.Owner, k, kv)
		on := keyspace.LeaseOf(kv)
		switch {
		case on != p.Lease && ours:
			problems = append(problems, fmt.Sprintf("%s: on lease %s, not the pod's %s", k.Key, keyspace.LeaseHex(on), keyspace.LeaseHex(p.Lease)))
			copies = append(copies, kv)
		case on != p.Lease:
			problems = append(problems, fmt.Sprintf("%s: overwritten with another owner's value on lease %s", k.Key, keyspace.LeaseHex(on)))
		case !ours:
			problems = append(problems, k.Key+": overwritten with a value this agent did not write")
		}
	}
	return problems, copies
}

// writtenFor tells whether kv's value is one this agent writes for owner at key k.
func (a *Agent) writtenFor(owner string, k podbook.AuditKey, kv *mvccpb.KeyValue) bool {
	switch k.Kind {
	case podbook.AuditPodRecord:
		rec, err := keyspace.Decode[keyspace.PodRecord](k.Key, kv.Value)
		return err == nil && rec.Owner == owner && rec.NodeUID == a.cfg.NodeUID
	case podbook.AuditOwnerIndex:
		rec, err := keyspace.Decode[keyspace.OwnerRecord](k.Key, kv.Value)
		return err == nil && rec.NodeUID == a.cfg.NodeUID && rec.ContainerID == k.Container
	default:
		rec, err := keyspace.Decode[keyspace.Allocation](k.Key, kv.Value)
		return err == nil && rec.Owner == owner && rec.Cluster == a.cfg.Cluster && rec.NodeUID == a.cfg.NodeUID
	}
}

// recheckPod judges owner's keys again under its lock, from what the agent knows of it now
// (a DEL or ADD may have changed it since the audit's read), and, if they are still wrong,
// gives its lease up for the re-claim. It reports whether it did.
func (a *Agent) recheckPod(ctx context.Context, owner string, layouts map[string]allocator.Blocks) (bool, error) {
	own := a.locks.Lock(owner)
	defer own.Unlock()
	p, ok := a.pods.Audit().One(owner, a.cfg.Cluster, a.cfg.Node, layouts)
	if !ok {
		return false, nil
	}
	kvs, err := a.readKeys(ctx, []auditPod{p})
	if err != nil {
		return false, err
	}
	problems, copies := a.judge(p, kvs[0])
	if len(problems) == 0 {
		a.pods.Audit().Verified(p, kvs[0])
		return false, nil
	}
	return true, a.keysLost(ctx, p, problems, copies)
}

// keysLost gives up the lease of a running pod whose keys are not as the agent wrote them,
// so that the re-claim restores them on a new lease as after a lost lease. Its copies on
// other leases go first, each only if unchanged since read; the revoke deletes the rest. Until
// the re-claim, the pod's addresses are held back by their held keys, as after any lost
// lease. The caller holds the owner lock.
func (a *Agent) keysLost(ctx context.Context, p auditPod, problems []string, copies []*mvccpb.KeyValue) error {
	a.metrics.podKeysLost.Add(float64(len(problems)))
	a.log.Error("keys of a running pod were deleted or changed in etcd; re-claiming its addresses",
		"owner", p.Owner, "lease", keyspace.LeaseHex(p.Lease), "keys", problems)
	if err := a.dropCopies(ctx, copies); err != nil {
		return err
	}
	if err := a.keeper.Revoke(p.Lease); err != nil {
		return a.unavailable("revoke the lease of a pod whose keys were lost", err)
	}
	a.pods.Lose(p.Lease)
	return nil
}

// dropCopies deletes keys of a running pod that carry its own value on a lease not its own
// (or none), each only if unchanged since read: left, one would outlive the pod.
func (a *Agent) dropCopies(ctx context.Context, copies []*mvccpb.KeyValue) error {
	if len(copies) == 0 {
		return nil
	}
	ops := make([]clientv3.Op, 0, len(copies))
	for _, kv := range copies {
		ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{keyspace.Unchanged(string(kv.Key), kv.ModRevision)},
			[]clientv3.Op{clientv3.OpDelete(string(kv.Key))}, nil))
	}
	octx, cancel := a.opCtx(ctx)
	_, err := a.cli.Txn(octx).Then(ops...).Commit()
	cancel()
	if err != nil {
		return a.unavailable("delete the copies of a pod's keys on other leases", err)
	}
	return nil
}

// auditOwn checks the node record and the block claims of the views: each on the lease the
// agent holds it on. One that is not means etcd went back in time (or an admin deleted it):
// the node registers again, every view lists its pool again, and the pods are checked.
func (a *Agent) auditOwn(ctx context.Context) error {
	type own struct {
		key   string
		lease clientv3.LeaseID
		what  string
		still func() bool // whether the agent still holds it as read
		gone  func()      // what to do once its lease is gone, before the keeper says it, if it ever does
	}
	var owns []own
	if node := a.nodeLease(); node != 0 && a.keeper.Holds(node) {
		owns = append(owns, own{keyspace.NodeKey(a.cfg.Cluster, a.cfg.Node), node, "the node record",
			func() bool { return a.nodeLease() == node && a.keeper.Holds(node) }, nil})
	}
	a.pools.ForEachView(func(v *poolview.View) {
		for b, lease := range v.Claims().Held() {
			owns = append(owns, own{keyspace.BlockKey(v.Pool(), b), lease, fmt.Sprintf("the claim of block %s of pool %s", b, v.Pool()),
				func() bool { return v.Claims().Holds(b, lease) },
				func() {
					// The claim went with its lease. The keeper would say so only at the
					// lease's next renewal, a third of the block lease's TTL away (a TTL that
					// outlives the reuse delay), and never for a lease it does not renew (a
					// claim a restore brought back, on a block lease of this node the agent
					// never took up again); meanwhile the view would hold blocks any node may
					// claim. So the lease is lost now, as the keeper would report it.
					a.keeper.Forget(lease)
					if a.blockLeaseLost(lease) {
						a.log.Warn("this node's block lease is gone from etcd, and its block claims and held keys with it",
							"lease", keyspace.LeaseHex(lease))
						return
					}
					v.Claims().LeaseLost(lease)
				}})
		}
	})
	for len(owns) > 0 {
		n := min(len(owns), keyspace.MaxTxnOps)
		chunk := owns[:n]
		owns = owns[n:]
		cmps := make([]clientv3.Cmp, 0, n)
		gets := make([]clientv3.Op, 0, n)
		for _, o := range chunk {
			cmps = append(cmps, keyspace.OnLease(o.key, o.lease))
			gets = append(gets, clientv3.OpGet(o.key, clientv3.WithKeysOnly()))
		}
		octx, cancel := a.opCtx(ctx)
		resp, err := a.cli.Txn(octx).If(cmps...).Else(gets...).Commit()
		cancel()
		if err != nil {
			return a.unavailable("check the node record and the block claims", err)
		}
		if resp.Succeeded {
			continue
		}
		for i, o := range chunk {
			kvs := resp.Responses[i].GetResponseRange().Kvs
			if len(kvs) > 0 && keyspace.LeaseOf(kvs[0]) == o.lease || !o.still() {
				continue // as the agent holds it, or let go meanwhile
			}
			if alive, known := a.leaseState(ctx, o.lease); !alive {
				if known && o.gone != nil {
					o.gone()
				}
				continue // gone with its lease (the node lease the keeper reports lost of its own), or unknown
			}
			found := "missing"
			if len(kvs) > 0 {
				found = "on lease " + keyspace.LeaseHex(keyspace.LeaseOf(kvs[0]))
			}
			a.notices.etcdWentBack(fmt.Sprintf("%s (%s) is %s, not on lease %s as this agent wrote it", o.what, o.key, found, keyspace.LeaseHex(o.lease)))
			return nil
		}
	}
	return nil
}

// leaseAlive tells whether etcd answers that it still has lease id; without an answer the
// next audit looks again.
func (a *Agent) leaseAlive(ctx context.Context, id clientv3.LeaseID) bool {
	alive, _ := a.leaseState(ctx, id)
	return alive
}

// leaseState is leaseAlive, and whether etcd answered.
func (a *Agent) leaseState(ctx context.Context, id clientv3.LeaseID) (alive, known bool) {
	octx, cancel := a.opCtx(ctx)
	defer cancel()
	ttl, err := a.cli.TimeToLive(octx, id)
	return err == nil && ttl.TTL > 0, err == nil
}

// errAuditFailed marks an audit that could not finish: it runs again on the next retry.
var errAuditFailed = errors.New("the check of this node's keys did not finish")

// auditIfDue runs the audit when one is due, and turns a suspicion into proof when it finds
// lost keys.
func (a *Agent) auditIfDue(ctx context.Context) (lost int, err error) {
	if !a.auditDue.Swap(false) {
		return 0, nil
	}
	suspected := a.suspect.Swap(false)
	var held map[conflictRef]bool
	if suspected {
		held = a.pods.HeldAddrs(time.Now()) // before the audit takes the pods whose keys went
	}
	lost, err = a.audit(ctx)
	if err != nil {
		a.auditDue.Store(true)
		if suspected {
			a.suspect.Store(true)
		}
		return lost, fmt.Errorf("%w: %w", errAuditFailed, err)
	}
	if suspected && lost > 0 {
		a.notices.etcdWentBack(fmt.Sprintf("after a compacted watch, keys of %d running pods were missing or changed", lost))
		a.cwatch.heldAlso(held)
	}
	return lost, nil
}

// ownKeys hears from the views of changes to this node's pods' allocations in its own blocks
// that the agent did not make: a delete no release explains (after the view's own check of
// releases it knows of), or a put without a lease or with another node identity's value.
// The audit would find them within its interval; a view sees them at once, and in a full
// pool another node may take an address whose key is missing (the reuse order) within that
// interval. Its methods run under the view's lock: they never block, and a queue that is full
// makes a whole audit due instead.
type ownKeys struct {
	cluster, nodeUID string
	owns             func(pool string, a netip.Addr) bool
	overflow         func()
	gone             chan goneAddr
	// relisted is set when a view listed its pool (its watches start anew): what happened
	// before may not have been reported, so the next audit compares every allocation too.
	relisted atomic.Bool
}

// goneAddr is an allocation of one of this node's pods changed by someone else, seen at at.
type goneAddr struct {
	pool string
	addr netip.Addr
	at   time.Time
}

func newOwnKeys(cluster, nodeUID string, owns func(string, netip.Addr) bool, overflow func()) *ownKeys {
	return &ownKeys{cluster: cluster, nodeUID: nodeUID, owns: owns, overflow: overflow, gone: make(chan goneAddr, 256)}
}

// deleted notes that a's allocation in pool was deleted, by no release the view knows of.
func (k *ownKeys) deleted(pool string, a netip.Addr) {
	if k != nil && k.owns(pool, a) {
		k.queue(pool, a)
	}
}

// listed notes that a view listed its pool.
func (k *ownKeys) listed() {
	if k != nil {
		k.relisted.Store(true)
	}
}

// put notes that a's allocation in pool was written as kv.
func (k *ownKeys) put(pool string, a netip.Addr, kv *mvccpb.KeyValue) {
	if k == nil || !k.owns(pool, a) {
		return
	}
	rec, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
	if kv.Lease == 0 || err != nil || rec.Cluster != k.cluster || rec.NodeUID != k.nodeUID {
		k.queue(pool, a)
	}
}

func (k *ownKeys) queue(pool string, a netip.Addr) {
	select {
	case k.gone <- goneAddr{pool: pool, addr: a, at: time.Now()}:
	default:
		k.overflow()
	}
}

// goneLoop checks the pod that lists each address the views reported (ownKeys), once a
// release in flight had the time to change what the agent knows (poolview.SuspectGrace): the check of
// one pod under its lock (recheckPod), re-claimed at once if its keys are lost.
func (a *Agent) goneLoop() {
	defer a.wg.Done()
	for {
		var g goneAddr
		select {
		case <-a.ctx.Done():
			return
		case g = <-a.keys.gone:
		}
		if !sleepCtx(a.ctx, time.Until(g.at.Add(poolview.SuspectGrace))) {
			return
		}
		owner, ok := a.pods.OwnerOf(g.pool, g.addr)
		if !ok {
			continue // released meanwhile
		}
		layouts, err := a.auditLayouts(a.ctx)
		if err == nil {
			var lost bool
			if lost, err = a.recheckPod(a.ctx, owner, layouts); lost {
				a.recovery.wake()
			}
		}
		if err != nil {
			a.log.Warn("checking a pod whose address changed in etcd failed; the next audit checks it", "owner", owner, "err", err)
			a.auditDue.Store(true)
		}
	}
}
