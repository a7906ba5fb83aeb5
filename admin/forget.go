package admin

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Forgetting a node that is really gone (issue 23). A node cut off from etcd or dead keeps its
// block claims and its pods' held keys for the reuse delay after its pods' leases expired, so
// that, back in time, it gets its addresses and blocks back. Once an admin knows it will not
// come back, ForgetNode frees them at once.

// forgetBatch is how many keys one delete transaction carries: a compare and a delete each,
// plus the node record's compare, within etcd's default limit of 128 operations.
const forgetBatch = 100

// ForgottenKey is one key ForgetNode deleted or left.
type ForgottenKey struct {
	Key   string       `json:"key"`
	Pool  string       `json:"pool"`
	Block netip.Prefix `json:"block,omitzero"`
	// IP is the address of a held key; zero for a block claim.
	IP netip.Addr `json:"ip,omitzero"`
	// Owner is the owner a held key names.
	Owner string `json:"owner,omitempty"`
	// Lease is the lease the key was on, in etcdctl's hex form.
	Lease string `json:"lease"`
	// Reason says why a key was left (ForgetReport.Kept).
	Reason string `json:"reason,omitempty"`
}

// ForgetReport is what ForgetNode did.
type ForgetReport struct {
	Cluster string `json:"cluster"`
	Node    string `json:"node"`
	// Blocks are the block claims deleted: the blocks are free to claim. Held are the held keys
	// deleted: their addresses are no longer held back.
	Blocks []ForgottenKey `json:"blocks"`
	Held   []ForgottenKey `json:"held"`
	// Leases are the leases the deleted keys were on. The keys are deleted one by one, so that a
	// key another node wrote meanwhile is never touched; a lease left without keys expires by
	// itself.
	Leases []string `json:"leases"`
	// Kept are keys that named the node when read but were changed before they could be
	// deleted: a held key an agent's claim took over. They were left alone.
	Kept []ForgottenKey `json:"kept"`
	// Gone counts keys that expired or were deleted by someone else meanwhile.
	Gone int `json:"gone"`
	// Revision is the revision of the last delete; 0 when nothing was deleted.
	Revision int64 `json:"revision"`
}

// Nothing reports whether the node held nothing back: a second run.
func (r ForgetReport) Nothing() bool { return len(r.Blocks)+len(r.Held)+len(r.Kept)+r.Gone == 0 }

// NodeInUseError refuses to forget a node that may still be alive: its node record exists (its
// agent runs, or its node lease has not expired yet), or pod records on live leases do (its
// agent stopped less than a lease TTL ago, or is restarting, and may resume them).
type NodeInUseError struct {
	Cluster, Node string
	// Record is the node record, when it exists; LeaseTTL is then its lease's TTL left, else
	// the longest TTL left of the pod leases.
	Record *NodeEntry
	// Pods counts the pod records on a lease.
	Pods int
	LeaseTTL
}

// Error names the node record and its lease with the TTL left, or the pod records, and what to do.
func (e *NodeInUseError) Error() string {
	if r := e.Record; r != nil {
		who := "unreadable record: " + r.Unreadable
		if r.Unreadable == "" {
			who = fmt.Sprintf("node UID %s, host %s, version %s", dash(r.Value.UID), dash(r.Value.Host), dash(r.Value.Version))
		}
		lease := fmt.Sprintf("on node lease %s with %ds of %ds left", keyspace.LeaseHex(r.Lease), e.TTL, e.GrantedTTL)
		switch {
		case r.Lease == 0:
			lease = "without a lease (written by hand? leaseholdctl doctor reports it; delete it if no agent runs)"
		case e.TTL < 0:
			lease = fmt.Sprintf("on node lease %s, which etcd is just expiring", keyspace.LeaseHex(r.Lease))
		}
		return fmt.Sprintf("%v: node %s/%s has an agent: its node record %s exists (%s), %s. While it exists the agent renews its "+
			"block lease, and its blocks and held addresses are its own. If the node is really gone, stop its agent and wait "+
			"for the lease to expire (%ds; an agent stopped with pods leaves it for its restart, one with none revokes it), then "+
			"run node forget again",
			ErrNodeAlive, e.Cluster, e.Node, keyspace.NodeKey(e.Cluster, e.Node), who, lease, max(e.TTL, 0))
	}
	return fmt.Sprintf("%v: node %s/%s has no agent, but %d pod record(s) under %s on live leases (up to %ds left): its agent stopped "+
		"less than a lease TTL ago or is restarting, and resumes them if it comes back. Wait for those leases to expire, then run "+
		"node forget again", ErrNodeAlive, e.Cluster, e.Node, e.Pods, keyspace.PodsPrefix(e.Cluster, e.Node), max(e.TTL, 0))
}

// Unwrap makes errors.Is(err, ErrNodeAlive) true.
func (e *NodeInUseError) Unwrap() error { return ErrNodeAlive }

// NodeClustersError: no cluster was given, and keys of several clusters name the node.
type NodeClustersError struct {
	Node     string
	Clusters []string
}

// Error names the clusters.
func (e *NodeClustersError) Error() string {
	return fmt.Sprintf("%v: block claims or held keys of node %s are in clusters %s: name one", ErrAmbiguousNode, e.Node, strings.Join(e.Clusters, ", "))
}

// Unwrap makes errors.Is(err, ErrAmbiguousNode) true.
func (e *NodeClustersError) Unwrap() error { return ErrAmbiguousNode }

// ForgetNode frees at once what node node of cluster still holds back: it deletes the block
// claims (BlockRecord.Cluster and Node) and the held keys (HeldRecord.Cluster and Node) naming
// the node, in transactions that compare each key unchanged since it was read and the node
// record absent: a held key another node's claim took over meanwhile is left (Kept), and an
// agent registering meanwhile stops the run. Allocations are never touched.
//
// It refuses (a *NodeInUseError, wrapping ErrNodeAlive) while the node record exists, or pod
// records of the node on a lease do. With cluster "", the node's cluster is the one whose block
// claims or held keys name it (a *NodeClustersError, wrapping ErrAmbiguousNode, when several
// do; nothing to do when none does). It is idempotent: a run with nothing left returns a
// report whose Nothing is true. Unreadable claims and held keys are left to doctor. Errors wrap
// ErrNodeAlive, ErrAmbiguousNode, allocator.ErrInvalidName, ErrConcurrentChange (a key kept
// changing; run again), or the etcd error; the report says what was done before it.
func ForgetNode(ctx context.Context, cli *clientv3.Client, cluster, node string) (ForgetReport, error) {
	rep := ForgetReport{Cluster: cluster, Node: node, Blocks: []ForgottenKey{}, Held: []ForgottenKey{}, Leases: []string{}, Kept: []ForgottenKey{}}
	if err := allocator.ValidateName("node", node); err != nil {
		return rep, err
	}
	if cluster != "" {
		if err := allocator.ValidateName("cluster", cluster); err != nil {
			return rep, err
		}
	}
	st, err := ReadKeys(ctx, cli, keyspace.BlocksPrefix(""), keyspace.HeldPrefix(""))
	if err != nil {
		return rep, err
	}
	if cluster == "" {
		clusters := map[string]bool{}
		for _, b := range st.Blocks {
			if b.Unreadable == "" && b.Value.Node == node {
				clusters[b.Value.Cluster] = true
			}
		}
		for _, h := range st.Held {
			if h.Unreadable == "" && h.Value.Node == node {
				clusters[h.Value.Cluster] = true
			}
		}
		switch cs := slices.Sorted(maps.Keys(clusters)); len(cs) {
		case 0:
			return rep, nil
		case 1:
			cluster, rep.Cluster = cs[0], cs[0]
			if err := allocator.ValidateName("cluster", cluster); err != nil {
				return rep, err
			}
		default:
			return rep, &NodeClustersError{Node: node, Clusters: cs}
		}
	}
	if err := checkNodeGone(ctx, cli, cluster, node); err != nil {
		return rep, err
	}
	f := &forgetter{cli: cli, cluster: cluster, node: node, rep: &rep, nodeKey: keyspace.NodeKey(cluster, node), leases: map[string]bool{}}
	var targets []forgetTarget
	for _, b := range st.Blocks {
		if b.Unreadable == "" && b.Value.Cluster == cluster && b.Value.Node == node {
			targets = append(targets, forgetTarget{ForgottenKey{Key: b.Key, Pool: b.Pool, Block: b.Block, Lease: keyspace.LeaseHex(b.Lease)}, b.ModRevision, false})
		}
	}
	for _, h := range st.Held {
		if h.Unreadable == "" && h.Value.Cluster == cluster && h.Value.Node == node {
			targets = append(targets, forgetTarget{ForgottenKey{Key: h.Key, Pool: h.Pool, Block: h.Block, IP: h.IP, Owner: h.Value.Owner,
				Lease: keyspace.LeaseHex(h.Lease)}, h.ModRevision, true})
		}
	}
	for len(targets) > 0 {
		n := min(len(targets), forgetBatch)
		if err := f.batch(ctx, targets[:n]); err != nil {
			return rep, err
		}
		targets = targets[n:]
	}
	rep.Leases = slices.Sorted(maps.Keys(f.leases))
	return rep, nil
}

// checkNodeGone refuses while the node record of cluster/node exists, or pod records of the
// node on a lease do.
func checkNodeGone(ctx context.Context, cli *clientv3.Client, cluster, node string) error {
	nk := keyspace.NodeKey(cluster, node)
	resp, err := cli.Txn(ctx).Then(clientv3.OpGet(nk), clientv3.OpGet(keyspace.PodsPrefix(cluster, node), clientv3.WithPrefix(), clientv3.WithKeysOnly())).Commit()
	if err != nil {
		return fmt.Errorf("read %s: %w", nk, err)
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		e := NodeEntry{Record: record[keyspace.NodeRecord](kvs[0]), Cluster: cluster, Node: node}
		ttl, err := TimeToLive(ctx, cli, e.Lease)
		if err != nil {
			return err
		}
		return &NodeInUseError{Cluster: cluster, Node: node, Record: &e, LeaseTTL: ttl}
	}
	var leases []clientv3.LeaseID
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		if l := keyspace.LeaseOf(kv); l != 0 {
			leases = append(leases, l)
		}
	}
	if len(leases) == 0 {
		return nil
	}
	ttls, err := LeaseTTLs(ctx, cli, leases...)
	if err != nil {
		return err
	}
	e := &NodeInUseError{Cluster: cluster, Node: node, LeaseTTL: LeaseTTL{TTL: -1}}
	for _, l := range leases {
		if t := ttls[l]; t.TTL > 0 {
			e.Pods++
			if t.TTL > e.TTL {
				e.LeaseTTL = t
			}
		}
	}
	if e.Pods == 0 {
		return nil // their leases expired since the read: etcd is deleting them
	}
	return e
}

// forgetTarget is one key to delete, with the revision it was read at.
type forgetTarget struct {
	ForgottenKey
	modRev int64
	held   bool
}

type forgetter struct {
	cli           *clientv3.Client
	cluster, node string
	nodeKey       string
	rep           *ForgetReport
	leases        map[string]bool
}

// batch deletes ts in one transaction; when a key changed (or the node record appeared), it
// deletes them one at a time to learn which.
func (f *forgetter) batch(ctx context.Context, ts []forgetTarget) error {
	cmps := []clientv3.Cmp{keyspace.Absent(f.nodeKey)}
	ops := make([]clientv3.Op, 0, len(ts))
	for _, t := range ts {
		cmps = append(cmps, keyspace.Unchanged(t.Key, t.modRev))
		ops = append(ops, clientv3.OpDelete(t.Key))
	}
	resp, err := f.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return fmt.Errorf("delete the keys of node %s/%s: %w", f.cluster, f.node, err)
	}
	if resp.Succeeded {
		for _, t := range ts {
			f.deleted(t, resp.Header.Revision)
		}
		return nil
	}
	for _, t := range ts {
		if err := f.one(ctx, t); err != nil {
			return err
		}
	}
	return nil
}

// one deletes t if it is unchanged, or still names the node after a change; a key gone is
// counted, a key now naming another node is kept.
func (f *forgetter) one(ctx context.Context, t forgetTarget) error {
	for range adminAttempts {
		resp, err := f.cli.Txn(ctx).If(keyspace.Absent(f.nodeKey), keyspace.Unchanged(t.Key, t.modRev)).Then(clientv3.OpDelete(t.Key)).
			Else(clientv3.OpGet(f.nodeKey), clientv3.OpGet(t.Key)).Commit()
		if err != nil {
			return fmt.Errorf("delete %s: %w", t.Key, err)
		}
		if resp.Succeeded {
			f.deleted(t, resp.Header.Revision)
			return nil
		}
		if len(resp.Responses[0].GetResponseRange().Kvs) > 0 {
			return checkNodeGone(ctx, f.cli, f.cluster, f.node) // an agent registered meanwhile: the refusal names it
		}
		kvs := resp.Responses[1].GetResponseRange().Kvs
		if len(kvs) == 0 {
			f.rep.Gone++
			return nil
		}
		if who := f.namesOther(t, kvs[0]); who != "" {
			t.Reason = "changed since it was read: " + who
			t.Lease = keyspace.LeaseHex(keyspace.LeaseOf(kvs[0]))
			f.rep.Kept = append(f.rep.Kept, t.ForgottenKey)
			return nil
		}
		t.modRev, t.Lease = kvs[0].ModRevision, keyspace.LeaseHex(keyspace.LeaseOf(kvs[0]))
	}
	return fmt.Errorf("%w: %s kept changing while node %s/%s was forgotten; run again", ErrConcurrentChange, t.Key, f.cluster, f.node)
}

// namesOther says whom kv, t's key as read again, names when that is not the node ("" when it
// still names the node).
func (f *forgetter) namesOther(t forgetTarget, kv *mvccpb.KeyValue) string {
	if t.held {
		r := record[keyspace.HeldRecord](kv)
		switch {
		case r.Unreadable != "":
			return "its value is unreadable now"
		case r.Value.Cluster != f.cluster || r.Value.Node != f.node:
			return fmt.Sprintf("it is held for node %s/%s (owner %s) now", dash(r.Value.Cluster), dash(r.Value.Node), dash(r.Value.Owner))
		}
		return ""
	}
	r := record[keyspace.BlockRecord](kv)
	switch {
	case r.Unreadable != "":
		return "its value is unreadable now"
	case r.Value.Cluster != f.cluster || r.Value.Node != f.node:
		return fmt.Sprintf("node %s/%s claims it now", dash(r.Value.Cluster), dash(r.Value.Node))
	}
	return ""
}

func (f *forgetter) deleted(t forgetTarget, rev int64) {
	if t.held {
		f.rep.Held = append(f.rep.Held, t.ForgottenKey)
	} else {
		f.rep.Blocks = append(f.rep.Blocks, t.ForgottenKey)
	}
	f.leases[t.Lease] = true
	f.rep.Revision = max(f.rep.Revision, rev)
}
