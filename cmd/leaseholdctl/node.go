package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// nodeJSON is one row of node list (-o json: an array of these). A node with pod records but
// no agent record has Agent false: its agent is gone and its pods' leases run out.
type nodeJSON struct {
	Cluster string `json:"cluster"`
	Node    string `json:"node"`
	Agent   bool   `json:"agent"`
	UID     string `json:"uid"`
	Host    string `json:"host"`
	Version string `json:"version"`
	// Blocks says the agent serves the block layout; pool migrate refuses while one does not.
	Blocks  bool       `json:"blocks"`
	Started *time.Time `json:"started"` // null without an agent record
	LeaseID string     `json:"leaseID"`
	admin.LeaseTTL
	// LastRenewedSecondsAgo is the lease's granted TTL minus what is left: how long ago the
	// agent last renewed it (its keep-alive runs every TTL/3); -1 without a live lease.
	LastRenewedSecondsAgo int64  `json:"lastRenewedSecondsAgo"`
	Pods                  int    `json:"pods"`
	Unreadable            string `json:"unreadable,omitempty"`
}

// nodeStatuses lists the nodes of st (of cluster only, unless it is ""), asking etcd for the
// TTL left on each agent's node lease.
func nodeStatuses(ctx context.Context, cli *clientv3.Client, st *admin.State, cluster string) ([]nodeJSON, error) {
	byKey := map[string]*nodeJSON{}
	get := func(c, n string) *nodeJSON {
		k := c + "/" + n
		if s, ok := byKey[k]; ok {
			return s
		}
		s := &nodeJSON{Cluster: c, Node: n, LeaseTTL: admin.LeaseTTL{TTL: -1}, LastRenewedSecondsAgo: -1}
		byKey[k] = s
		return s
	}
	for _, e := range st.Nodes {
		if cluster != "" && e.Cluster != cluster {
			continue
		}
		s := get(e.Cluster, e.Node)
		s.Agent, s.Unreadable = true, e.Unreadable
		started := e.Value.Started
		s.UID, s.Host, s.Version, s.Started, s.LeaseID = e.Value.UID, e.Value.Host, e.Value.Version, &started, keyspace.LeaseHex(e.Lease)
		s.Blocks = e.Value.Blocks
		ttl, err := admin.TimeToLive(ctx, cli, e.Lease)
		if err != nil {
			return nil, err
		}
		s.LeaseTTL = ttl
		if ttl.TTL >= 0 {
			s.LastRenewedSecondsAgo = ttl.GrantedTTL - ttl.TTL
		}
	}
	for _, p := range st.Pods {
		if cluster == "" || p.Cluster == cluster {
			get(p.Cluster, p.Node).Pods++
		}
	}
	out := make([]nodeJSON, 0, len(byKey))
	for _, k := range sortedKeys(byKey) {
		out = append(out, *byKey[k])
	}
	return out, nil
}

func nodeList(ctx context.Context, e *env) error {
	st, err := admin.ReadKeys(ctx, e.cli, keyspace.NodesPrefix(e.cluster))
	if err != nil {
		return err
	}
	rows, err := nodeStatuses(ctx, e.cli, st, e.cluster)
	if err != nil {
		return err
	}
	if e.output == "json" {
		return writeJSON(e.stdout, rows)
	}
	now := time.Now()
	t := newTable(e.stdout, "CLUSTER", "NODE", "AGENT", "NODE UID", "HOST", "VERSION", "BLOCKS", "STARTED", "LEASE", "TTL LEFT", "LAST RENEWED", "PODS")
	for _, n := range rows {
		agent, renewed := "yes", "-"
		switch {
		case !n.Agent:
			agent = "gone"
		case n.Unreadable != "":
			agent = "unreadable record"
		}
		if n.LastRenewedSecondsAgo >= 0 {
			renewed = ago(time.Duration(n.LastRenewedSecondsAgo) * time.Second)
		}
		started := "-"
		if n.Started != nil {
			started = timeText(*n.Started, now)
		}
		blocks := "no"
		switch {
		case !n.Agent:
			blocks = "-"
		case n.Blocks:
			blocks = "yes"
		}
		t.row(n.Cluster, n.Node, agent, dash(n.UID), dash(n.Host), dash(n.Version), blocks, started, dash(n.LeaseID), ttlText(n.TTL, n.GrantedTTL),
			renewed, strconv.Itoa(n.Pods))
	}
	return t.flush()
}

// conflictJSON is one conflict record as conflicts prints it (-o json: an array of these).
type conflictJSON struct {
	Key         string                  `json:"key"`
	Cluster     string                  `json:"cluster"`
	Owner       string                  `json:"owner"`
	IfName      string                  `json:"ifName"`
	Pool        string                  `json:"pool"`
	Node        string                  `json:"node"`
	NodeUID     string                  `json:"nodeUID"`
	ContainerID string                  `json:"containerID"`
	Taken       []keyspace.TakenByOther `json:"taken"`
	Detected    time.Time               `json:"detected"`
	Unreadable  string                  `json:"unreadable,omitempty"`
}

func conflictList(ctx context.Context, e *env) error {
	st, err := admin.ReadKeys(ctx, e.cli, keyspace.ConflictsPrefix(e.cluster))
	if err != nil {
		return err
	}
	rows := []conflictJSON{}
	for _, c := range st.Conflicts {
		if e.cluster != "" && c.Cluster != e.cluster {
			continue
		}
		rows = append(rows, conflictJSON{Key: c.Key, Cluster: c.Cluster, Owner: c.Owner, IfName: c.IfName, Pool: c.Pool,
			Node: c.Value.Node, NodeUID: c.Value.NodeUID, ContainerID: c.Value.ContainerID, Taken: c.Value.Taken,
			Detected: c.Value.Detected, Unreadable: c.Unreadable})
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].Key < rows[j].Key })
	if e.output == "json" {
		return writeJSON(e.stdout, rows)
	}
	if len(rows) == 0 {
		fmt.Fprintln(e.stdout, "no conflicts")
		return nil
	}
	now := time.Now()
	t := newTable(e.stdout, "CLUSTER", "OWNER", "IFNAME", "POOL", "NODE", "CONTAINER", "DETECTED", "TAKEN (ADDRESS: NOW HELD BY)")
	for _, c := range rows {
		if c.Unreadable != "" {
			t.row(c.Cluster, c.Owner, c.IfName, c.Pool, "?", "?", "?", "(unreadable: "+c.Unreadable+")")
			continue
		}
		var taken []string
		for _, tk := range c.Taken {
			taken = append(taken, takenText(tk))
		}
		t.row(c.Cluster, c.Owner, c.IfName, c.Pool, c.Node, short(c.ContainerID), timeText(c.Detected, now), strings.Join(taken, "; "))
	}
	return t.flush()
}

func takenText(tk keyspace.TakenByOther) string {
	if tk.Quarantined {
		return tk.IP.String() + ": quarantined"
	}
	return fmt.Sprintf("%s: owner %s (cluster %s, node %s, container %s)", tk.IP, dash(tk.Holder), dash(tk.Cluster), dash(tk.Node), short(tk.ContainerID))
}

// poolConflictJSON is one pool definition conflict as pool conflicts prints it (-o json: an
// array of these).
type poolConflictJSON struct {
	Key      string    `json:"key"`
	Pool     string    `json:"pool"`
	Cluster  string    `json:"cluster"`
	Node     string    `json:"node"`
	Wanted   string    `json:"wanted"`
	Stored   string    `json:"stored"`
	Detected time.Time `json:"detected"`
}

// poolConflictList lists /leasehold/v1/poolconflicts/: nodes whose configuration defines a
// pool differently from the stored definition (their ADDs are refused until they agree).
func poolConflictList(ctx context.Context, e *env) error {
	if e.pool != "" {
		if _, err := poolArg(e.pool); err != nil {
			return err
		}
	}
	resp, err := e.cli.Get(ctx, keyspace.PoolConflictsPrefix(e.pool), clientv3.WithPrefix())
	if err != nil {
		return fmt.Errorf("list pool conflicts: %w", err)
	}
	rows := []poolConflictJSON{}
	for _, kv := range resp.Kvs {
		var rec keyspace.PoolConflictRecord
		row := poolConflictJSON{Key: string(kv.Key)}
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			row.Wanted = "(unreadable: " + err.Error() + ")"
		} else {
			row.Pool, row.Cluster, row.Node = rec.Stored.Name, rec.Cluster, rec.Node
			row.Wanted, row.Stored, row.Detected = rec.Wanted.String(), rec.Stored.String(), rec.Detected
		}
		rows = append(rows, row)
	}
	if e.output == "json" {
		return writeJSON(e.stdout, rows)
	}
	if len(rows) == 0 {
		fmt.Fprintln(e.stdout, "no pool conflicts")
		return nil
	}
	now := time.Now()
	t := newTable(e.stdout, "POOL", "CLUSTER", "NODE", "DETECTED", "THE NODE WANTS", "ETCD HOLDS")
	for _, r := range rows {
		t.row(r.Pool, r.Cluster, r.Node, timeText(r.Detected, now), r.Wanted, r.Stored)
	}
	return t.flush()
}

// forgetJSON is the -o json output of node forget: the report, whether the node held nothing
// back (a second run), and, when the run was refused or failed, the error (the report then
// says what was done before it).
type forgetJSON struct {
	admin.ForgetReport
	Nothing bool   `json:"nothing"`
	Refused bool   `json:"refused"`
	Error   string `json:"error,omitempty"`
}

// nodeForget frees at once what a node that is really gone still holds back (issue 23): its
// block claims and its pods' held keys.
func nodeForget(ctx context.Context, e *env) error {
	node := e.args[0]
	if err := allocator.ValidateName("node", node); err != nil {
		return usageError{err.Error()}
	}
	rep, err := admin.ForgetNode(ctx, e.cli, e.cluster, node)
	var amb *admin.NodeClustersError
	if errors.As(err, &amb) {
		return usagef("block claims or held keys of node %s are in clusters %s: give --cluster C", node, strings.Join(amb.Clusters, ", "))
	}
	if e.output == "json" {
		out := forgetJSON{ForgetReport: rep, Nothing: err == nil && rep.Nothing(), Refused: errors.Is(err, admin.ErrNodeAlive)}
		if err != nil {
			out.Error = err.Error()
		}
		if werr := writeJSON(e.stdout, out); werr != nil {
			return werr
		}
		return err
	}
	if err == nil || !rep.Nothing() {
		printForget(e, rep)
	}
	return err
}

func printForget(e *env, rep admin.ForgetReport) {
	who := "node " + rep.Node + " in any cluster"
	if rep.Cluster != "" {
		who = "node " + rep.Cluster + "/" + rep.Node
	}
	if rep.Nothing() {
		if len(rep.Blocks)+len(rep.Held) == 0 && rep.Revision == 0 {
			fmt.Fprintf(e.stdout, "nothing is held back for %s: no block claim or held key names it\n", who)
		}
		return
	}
	if n := len(rep.Blocks) + len(rep.Held); n > 0 {
		fmt.Fprintf(e.stdout, "forgot %s: freed %d block(s) and %d held address(es) (they were on lease(s) %s)\n",
			who, len(rep.Blocks), len(rep.Held), strings.Join(rep.Leases, ", "))
		t := newTable(e.stdout, "KIND", "POOL", "BLOCK OR ADDRESS", "OWNER", "LEASE", "KEY")
		for _, k := range rep.Blocks {
			t.row("block", k.Pool, k.Block.String(), "-", k.Lease, k.Key)
		}
		for _, k := range rep.Held {
			t.row("held", k.Pool, k.IP.String(), dash(k.Owner), k.Lease, k.Key)
		}
		_ = t.flush()
	}
	for _, k := range rep.Kept {
		fmt.Fprintf(e.stdout, "left alone: %s: %s\n", k.Key, k.Reason)
	}
	if rep.Gone > 0 {
		fmt.Fprintf(e.stdout, "%d key(s) expired or were deleted meanwhile\n", rep.Gone)
	}
}
