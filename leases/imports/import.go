package imports

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/pause"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases/adopt"
	"github.com/leasehold/leasehold/leases/claimloop"
	"github.com/leasehold/leasehold/leases/keeper"
	"github.com/leasehold/leasehold/leases/ownerlock"
	"github.com/leasehold/leasehold/leases/podbook"
	"github.com/leasehold/leasehold/leases/poolview"
	"github.com/leasehold/leasehold/leases/txn"
)

// Import is what one import claims: the attachments another IPAM plugin (host-local,
// whereabouts) recorded for this node's running containers on one network.
type Import struct {
	// Network is the CNI network name of the attachments. GC collects by it, so it must be the
	// name in the network's configuration.
	Network string
	// Pool is the leasehold pool the network's configuration names; default Network. It must
	// be defined in etcd already (leaseholdctl pool create, or a node's first ADD).
	Pool string
	// Source names what was read, for the log ("host-local /var/lib/cni/networks/net1").
	Source      string
	Attachments []adopt.Attachment
}

// ImportedAddr is one address of an import and what became of it.
type ImportedAddr struct {
	IP          netip.Addr `json:"ip"`
	Owner       string     `json:"owner"`
	ContainerID string     `json:"containerID"`
	IfName      string     `json:"ifName"`
	// Detail says why, for the addresses not imported.
	Detail string `json:"detail,omitempty"`
}

// ImportReport says what an import did with each address it was given.
type ImportReport struct {
	// Imported were claimed now, for their containers, on pod leases this agent renews.
	Imported []ImportedAddr `json:"imported"`
	// Already were held by this agent for the same attachment (an earlier import).
	Already []ImportedAddr `json:"already"`
	// Released were imported before and released since (a DEL, GC): not claimed again.
	Released []ImportedAddr `json:"released"`
	// Conflicts are held in etcd by another owner, or leasehold's record of the attachment
	// disagrees: never taken. Two containers may use one such address.
	Conflicts []ImportedAddr `json:"conflicts"`
	// OutsidePool are addresses the pool never hands out (no range, gateway, excluded): not
	// claimed, and no ADD can be given them.
	OutsidePool []ImportedAddr `json:"outsidePool"`
}

// maxImportAttempts bounds the claims of one attachment's import, as maxAddAttempts an ADD's;
// maxUnanswered the claims sent again after losing their answers, as an ADD's.
const (
	maxImportAttempts = 16
	maxUnanswered     = 5
)

// Importer is the agent's part that imports: it claims for running containers the addresses
// another IPAM plugin gave them (Run), one import at a time, keeps the ledger of what imports
// did in the state directory, and records the DEL of a container whose address an import
// left to another owner (ConflictDeleted). It owns importMu and the conflicts imports left.
// It claims through the agent's claim loop and records what it claimed in the pod book; what
// it needs of the agent is handed in when the agent makes it (Config).
type Importer struct {
	cfg Config

	importMu sync.Mutex // one Run at a time; taken before an owner lock
	// importConflicts lists the addresses imports left to another owner, by attachment, until
	// its container's DEL (ledger.go).
	icmu            sync.Mutex
	importConflicts map[importConflictRef][]netip.Addr
}

// Config is what the import is handed of the agent.
type Config struct {
	Cluster, Node, NodeUID string
	OpTimeout              time.Duration
	WallClock              func() time.Time
	// StateDir keeps the ledger (ledgerFile); "" keeps none.
	StateDir string

	Client *clientv3.Client // the gate's
	Log    *slog.Logger
	Pods   Book
	Locks  *ownerlock.Locks
	Pools  *poolview.Pools
	Keeper *keeper.Keeper // renews the pod leases, hands out spares
	// Loops makes the claim loop for one attachment, with the import's policy, and records
	// what a claim applied (leases/claimloop).
	Loops *claimloop.Claims
	// Stopped is why the agent stopped itself, nil while it serves (Agent.Err).
	Stopped func() error
	// HeldFor, ResumePod, Allocation, OwnerRecord and PodRecord are the agent's ADD's: what an
	// ADD records and writes for an attachment.
	HeldFor     func(ctx context.Context, owner string) (clientv3.LeaseID, keyspace.HeldRecord, error)
	ResumePod   func(ctx context.Context, own *ownerlock.Owned, podKV *mvccpb.KeyValue) error
	Allocation  func(req allocator.Request, owner string, lease clientv3.LeaseID, now time.Time) keyspace.Allocation
	OwnerRecord func(req allocator.Request, addrs []netip.Addr, lease clientv3.LeaseID, now time.Time) keyspace.OwnerRecord
	PodRecord   func(req allocator.Request, owner string, lease clientv3.LeaseID, now time.Time) keyspace.PodRecord
	// Imported counts the addresses of imports by what became of them.
	Imported *prometheus.CounterVec
}

// Book is what the import asks of the pod book (podbook.Book): whether an owner's
// attachment holds an address, an owner's lease, and of a change Drop.
type Book interface {
	HoldsAddr(owner, ifName, pool string, addr netip.Addr) bool
	Lease(owner string) (clientv3.LeaseID, bool)
	Change(o *ownerlock.Owned) podbook.Change
}

var _ Book = (*podbook.Book)(nil)

// New makes the import.
func New(cfg Config) *Importer {
	return &Importer{cfg: cfg, importConflicts: map[importConflictRef][]netip.Addr{}}
}

// opCtx bounds one etcd request by the operation timeout.
func (im *Importer) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, im.cfg.OpTimeout)
}

// wall is the time written into records; see Config.WallClock.
func (im *Importer) wall() time.Time { return im.cfg.WallClock().UTC() }

// unavailable wraps an etcd error so that the runtime retries (as Agent.unavailable).
func (im *Importer) unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", allocator.ErrUnavailable, what, err)
}

// Run claims, for each attachment, the addresses another IPAM plugin gave a container that
// still runs on this node (Agent.Import, which says how).
func (im *Importer) Run(ctx context.Context, imp Import) (rep ImportReport, err error) {
	if err := im.cfg.Stopped(); err != nil {
		return rep, fmt.Errorf("%w: the agent has stopped: %w", allocator.ErrUnavailable, err)
	}
	if imp.Pool == "" {
		imp.Pool = imp.Network
	}
	if err := keyspace.ValidateNames("network", imp.Network, "pool", imp.Pool); err != nil {
		return rep, err
	}
	im.importMu.Lock()
	defer im.importMu.Unlock()
	p, err := im.cfg.Pools.Ensure(ctx, allocator.PoolSpec{Name: imp.Pool})
	if errors.Is(err, allocator.ErrInvalidConfig) {
		return rep, fmt.Errorf("import %s into pool %q: the pool is not defined in etcd, and the import needs its ranges to tell "+
			"which addresses are its own: create it with leaseholdctl pool create %s --range ... with the ranges of network %s's "+
			"configuration, then start leaseholdd again: %w", imp.Source, imp.Pool, imp.Pool, imp.Network, err)
	}
	if err != nil {
		return rep, fmt.Errorf("import %s into pool %q: %w", imp.Source, imp.Pool, err)
	}
	if p.Migrating != nil {
		return rep, fmt.Errorf("%w: import %s: pool %q is being moved to the block layout; run leaseholdctl pool migrate %s to its end first",
			allocator.ErrUnavailable, imp.Source, imp.Pool, imp.Pool)
	}
	ledger, lerr := im.loadLedger()
	if lerr != nil {
		im.cfg.Log.Warn("the import ledger is unreadable; addresses released since an earlier import may be imported again", "err", lerr)
	}
	defer im.cfg.Keeper.Refill()
	defer func() { im.reportImport(imp, rep, ledger) }()
	for _, at := range imp.Attachments {
		owner := at.Owner()
		if err := keyspace.ValidateNames("container ID", at.ContainerID, "interface name", at.IfName, "owner", owner); err != nil {
			return rep, fmt.Errorf("import %s: %v: %w", imp.Source, at.Where, err)
		}
		var claim []netip.Addr
		for _, ip := range at.IPs {
			e := ImportedAddr{IP: ip, Owner: owner, ContainerID: at.ContainerID, IfName: at.IfName}
			switch err := p.Spec.Allocatable(ip); {
			case err != nil:
				e.Detail = err.Error()
				rep.OutsidePool = append(rep.OutsidePool, e)
			case im.cfg.Pods.HoldsAddr(owner, at.IfName, imp.Pool, ip):
				rep.Already = append(rep.Already, e)
			case ledger[ledgerEntry{imp.Pool, at.ContainerID, at.IfName, ip}].imported:
				e.Detail = "imported before and released since (DEL or GC)"
				rep.Released = append(rep.Released, e)
			case ledger[ledgerEntry{imp.Pool, at.ContainerID, at.IfName, ip}].deleted:
				e.Detail = "left to another owner by an earlier import, and its container was deleted since"
				rep.Released = append(rep.Released, e)
			default:
				claim = append(claim, ip)
			}
		}
		if len(claim) > 0 {
			if err := im.importAttachment(ctx, p, imp, at, claim, &rep); err != nil {
				return rep, err
			}
		}
	}
	return rep, nil
}

// importAttachment claims addrs for one attachment, as an ADD claims (add.go's tryAdd and
// learn) but with the import's addresses: a claim whose answer was lost keeps its lease with
// the owner and is sent again; an address found held is reported and dropped.
func (im *Importer) importAttachment(ctx context.Context, p *poolview.Pool, imp Import, at adopt.Attachment, addrs []netip.Addr, rep *ImportReport) error {
	owner := at.Owner()
	own := im.cfg.Locks.Lock(owner)
	defer own.Unlock()
	req := allocator.Request{Network: imp.Network, Pool: allocator.PoolSpec{Name: imp.Pool}, ContainerID: at.ContainerID,
		IfName: at.IfName, Pod: at.Pod}
	ownerKey := keyspace.OwnerKey(im.cfg.Cluster, owner, at.IfName, imp.Pool)
	entry := func(ip netip.Addr, detail string) ImportedAddr {
		return ImportedAddr{IP: ip, Owner: owner, ContainerID: at.ContainerID, IfName: at.IfName, Detail: detail}
	}
	unanswered := 0
	claims := im.cfg.Loops.For(own, req, claimloop.Policy{
		// A refusal, of the owner's own lease gone too, is the import's answer.
		Refused: func(err error) error {
			return fmt.Errorf("%w: import %s: etcd refused the claim: %w", allocator.ErrUnavailable, ownerKey, err)
		},
		Unanswered: func(ctx context.Context, err error) error {
			if unanswered++; unanswered > maxUnanswered || !pause.For(ctx, 50*time.Millisecond<<(unanswered-1)) {
				return im.unavailable("import "+ownerKey, err)
			}
			return nil
		},
	})
	defer claims.Done()
	for range maxImportAttempts {
		octx, cancel := im.opCtx(ctx)
		lease, known := im.cfg.Pods.Lease(owner)
		if !known {
			id, err := claims.Spare(octx)
			if err != nil {
				cancel()
				return im.unavailable("grant a pod lease for the import of "+ownerKey, err)
			}
			lease = id
		}
		heldLease, held, err := im.cfg.HeldFor(octx, owner)
		if err != nil {
			cancel()
			return err
		}
		now := im.wall()
		c := &txn.Claim{Lease: lease, Pool: p.Spec.Name, Blocks: p.Spec.Blocks, Addrs: slices.Clone(addrs), OwnerKey: ownerKey,
			HeldLease: heldLease, Held: held,
			Alloc: im.cfg.Allocation(req, owner, lease, now), Index: im.cfg.OwnerRecord(req, addrs, lease, now),
			PodKey: keyspace.PodKey(im.cfg.Cluster, im.cfg.Node, owner), NewPod: !known, Pod: im.cfg.PodRecord(req, owner, lease, now)}
		out, again, err := claims.Commit(ctx, c, func() (txn.ClaimOutcome, error) { return c.Commit(octx, im.cfg.Client) })
		cancel()
		if err != nil {
			return err
		}
		if again {
			continue
		}
		if out.Applied {
			for _, ip := range addrs {
				p.View.MarkAllocated(ip, out.Revision)
				rep.Imported = append(rep.Imported, entry(ip, ""))
			}
			im.cfg.Loops.ClaimedOn(ctx, req, own, lease, podbook.Attachment{IfName: at.IfName, Pool: imp.Pool, Network: imp.Network,
				ContainerID: at.ContainerID, IPs: addrs, Created: now, OwnerRev: out.Revision})
			claims.Bound()
			im.cfg.Log.Info("imported", "source", imp.Source, "owner", owner, "container", at.ContainerID, "ifname", at.IfName,
				"pool", imp.Pool, "ips", addrs, "lease", keyspace.LeaseHex(lease))
			return nil
		}
		if out.Existing != nil {
			return im.importFound(ctx, req, own, addrs, out.Existing, rep, entry)
		}
		switch out.Pod {
		case txn.PodExists:
			if rec, derr := keyspace.Decode[keyspace.PodRecord](string(out.PodKV.Key), out.PodKV.Value); derr == nil && rec.NodeUID != im.cfg.NodeUID {
				for _, ip := range addrs {
					rep.Conflicts = append(rep.Conflicts, entry(ip, fmt.Sprintf("owner %s has a pod record of node identity %s, not this agent's %s",
						owner, rec.NodeUID, im.cfg.NodeUID)))
				}
				return nil
			}
			if err := im.cfg.ResumePod(ctx, own, out.PodKV); err != nil {
				return err
			}
			continue
		case txn.PodGone, txn.PodMoved:
			im.cfg.Pods.Change(own).Drop()
			if out.Pod == txn.PodGone {
				claims.Reuse(lease)
			}
			continue
		}
		var still []netip.Addr
		for _, f := range out.Addrs {
			if f.Holder == nil {
				still = append(still, f.Addr)
				continue
			}
			h, _ := keyspace.Decode[keyspace.Allocation](string(f.Holder.Key), f.Holder.Value)
			if h.NodeUID == im.cfg.NodeUID && h.ContainerID == at.ContainerID && h.IfName == at.IfName {
				rep.Already = append(rep.Already, entry(f.Addr, "held for the same container by owner "+h.Owner))
				continue
			}
			rep.Conflicts = append(rep.Conflicts, entry(f.Addr, holderOf(f.Holder)))
		}
		if addrs = still; len(addrs) == 0 {
			return nil
		}
	}
	return fmt.Errorf("%w: import %s: its keys kept changing", allocator.ErrUnavailable, ownerKey)
}

// importFound handles an owner index that exists already: of this node identity and
// container, the import was done before and its lease is renewed here; anything else is
// another attachment's, and the addresses are conflicts.
func (im *Importer) importFound(ctx context.Context, req allocator.Request, own *ownerlock.Owned, addrs []netip.Addr, kv *mvccpb.KeyValue,
	rep *ImportReport, entry func(netip.Addr, string) ImportedAddr) error {
	rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
	if err != nil {
		return err
	}
	if rec.NodeUID != im.cfg.NodeUID || rec.ContainerID != req.ContainerID {
		for _, ip := range addrs {
			rep.Conflicts = append(rep.Conflicts, entry(ip, fmt.Sprintf("owner index %s names container %s of node %s (identity %s)",
				kv.Key, rec.ContainerID, rec.Node, rec.NodeUID)))
		}
		return nil
	}
	lease := keyspace.LeaseOf(kv)
	if !im.cfg.Keeper.Holds(lease) {
		octx, cancel := im.opCtx(ctx)
		defer cancel()
		if err := im.cfg.Keeper.Adopt(octx, lease); err != nil {
			return im.unavailable("resume the pod lease of "+string(kv.Key), err)
		}
	}
	im.cfg.Loops.ClaimedOn(ctx, req, own, lease, podbook.Attachment{IfName: req.IfName, Pool: req.Pool.Name, Network: rec.Network,
		ContainerID: rec.ContainerID, IPs: rec.IPs, Created: rec.Created, OwnerRev: kv.ModRevision})
	var missing []netip.Addr
	for _, ip := range addrs {
		if slices.Contains(rec.IPs, ip) {
			rep.Already = append(rep.Already, entry(ip, ""))
		} else {
			missing = append(missing, ip)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	// Imported before without them (they were held by another owner then): say who holds
	// them now. The attachment is not changed; its DEL or GC ends it.
	p, err := im.cfg.Pools.Ensure(ctx, req.Pool)
	if err != nil {
		return err
	}
	ops := make([]clientv3.Op, len(missing))
	for i, ip := range missing {
		ops[i] = clientv3.OpGet(keyspace.IPKey(p.Spec.Name, p.Spec.Blocks, ip))
	}
	octx, cancel := im.opCtx(ctx)
	defer cancel()
	resp, err := im.cfg.Client.Txn(octx).Then(ops...).Commit()
	if err != nil {
		return im.unavailable("read the addresses of "+string(kv.Key), err)
	}
	for i, ip := range missing {
		detail := "free now"
		if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
			detail = holderOf(kvs[0])
		}
		rep.Conflicts = append(rep.Conflicts, entry(ip, fmt.Sprintf("%s, but the attachment was imported before without it (%s lists %v): "+
			"it is not claimed for the attachment until its DEL or GC releases it", detail, kv.Key, rec.IPs)))
	}
	return nil
}

// holderOf describes the holder of an allocation key.
func holderOf(kv *mvccpb.KeyValue) string {
	h, _ := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
	return fmt.Sprintf("held by owner %s (pod %s/%s, cluster %s, node %s, container %s, interface %s): %s",
		h.Owner, h.Pod.Namespace, h.Pod.Name, h.Cluster, h.Node, h.ContainerID, h.IfName, kv.Key)
}
