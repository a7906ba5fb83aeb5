package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// figThroughput: ADDs per second through the agent socket (sent as the plugin sends them,
// no process exec), 64 at a time, against the floor of the same work: etcd
// create-if-absent Txns with a lease, 64 at a time, on the same etcd, over one client as
// the agent has. Rounds alternate, so
// that load from elsewhere on the machine hits all alike. A third kind of round grants a
// lease per key before its Txn: the least etcd work a lease per pod takes, reported
// beside the target's ratio.
func figThroughput(ctx context.Context, env *env, res *results) error {
	cfg := env.cfg
	e, err := startEtcd(ctx, env, "tput")
	if err != nil {
		return err
	}
	defer e.stop()
	ag, err := startInproc(ctx, env, e, "tput-node", "", nil)
	if err != nil {
		return err
	}
	defer ag.close()
	raw, err := e.client()
	if err != nil {
		return err
	}
	defer raw.Close()
	g, err := raw.Grant(ctx, 3600)
	if err != nil {
		return err
	}
	// The raw Txn writes a value as large as the allocation record an ADD writes.
	value := string(mustJSON(keyspace.Allocation{Owner: ids.podUID(), Cluster: "default", Node: "tput-node", NodeUID: "uid-tput-node",
		Pod: allocator.PodRef{UID: ids.podUID(), Namespace: "bench", Name: "pod-0123456789"}, ContainerID: ids.containerID(),
		IfName: "eth0", Network: "tput", LeaseID: keyspace.LeaseHex(g.ID), Created: time.Now().UTC()}))
	var seq atomic.Int64
	// create is the raw create-if-absent Txn: a new key under prefix, put on lease.
	create := func(ctx context.Context, prefix string, lease clientv3.LeaseID) error {
		key := fmt.Sprintf("%s/%d", prefix, seq.Add(1))
		resp, err := raw.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, value, clientv3.WithLease(lease))).Commit()
		if err == nil && !resp.Succeeded {
			err = fmt.Errorf("raw txn on %s did not succeed", key)
		}
		return err
	}
	rawOp := func(ctx context.Context) error {
		c, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return create(c, "/bench/raw", g.ID)
	}
	// The least etcd work a lease per pod takes: a lease, then the create-if-absent Txn on it.
	leasedOp := func(ctx context.Context) error {
		c, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l, err := raw.Grant(c, 600)
		if err != nil {
			return err
		}
		return create(c, "/bench/leased", l.ID)
	}
	conf := ag.conf("tput", netip.MustParsePrefix("10.60.0.0/14"))
	cl := ag.client()
	agentOp := func(ctx context.Context) error {
		inv, _ := podAdd(conf, env.netns)
		_, err := invoke(ctx, cl, inv)
		return err
	}
	if err := agentOp(ctx); err != nil { // defines the pool and lists it into the view
		return err
	}
	time.Sleep(200 * time.Millisecond)
	var rawAll, agAll, leasedAll loadResult
	var rawCPU, agCPU, leasedCPU cpuSplit
	for round := range cfg.tputRounds {
		c0 := e.cpu()
		r, err := closedLoop(ctx, cfg.tputConc, cfg.tputDur, rawOp)
		if err != nil {
			return fmt.Errorf("raw etcd: %w", err)
		}
		c1 := e.cpu()
		a, err := closedLoop(ctx, cfg.tputConc, cfg.tputDur, agentOp)
		if err != nil {
			return fmt.Errorf("agent: %w", err)
		}
		c2 := e.cpu()
		l, err := closedLoop(ctx, cfg.tputConc, cfg.tputDur, leasedOp)
		if err != nil {
			return fmt.Errorf("raw etcd, lease per key: %w", err)
		}
		c3 := e.cpu()
		rawCPU, agCPU, leasedCPU = rawCPU.plus(c1.minus(c0)), agCPU.plus(c2.minus(c1)), leasedCPU.plus(c3.minus(c2))
		progress("throughput round %d: raw etcd Txn %.0f/s, agent ADD %.0f/s (p50 %.1f ms, p99 %.1f ms), raw LeaseGrant+Txn %.0f/s; CPU/op raw: etcd %.0f µs, bench %.0f µs; agent: etcd %.0f µs, bench %.0f µs",
			round+1, r.rate(), a.rate(), ms(a.lat.pct(50)), ms(a.lat.pct(99)), l.rate(),
			us(c1.minus(c0).etcd)/float64(r.ops), us(c1.minus(c0).self)/float64(r.ops), us(c2.minus(c1).etcd)/float64(a.ops), us(c2.minus(c1).self)/float64(a.ops))
		for _, p := range []struct{ all, one *loadResult }{{&rawAll, &r}, {&agAll, &a}, {&leasedAll, &l}} {
			p.all.ops, p.all.elapsed, p.all.lat = p.all.ops+p.one.ops, p.all.elapsed+p.one.elapsed, append(p.all.lat, p.one.lat...)
		}
	}
	m, err := gather(ag.agent.Metrics())
	if err != nil {
		return err
	}
	retries := sum(m, "leasehold_cas_retries_total", nil)
	res.add(row{Figure: fmt.Sprintf("agent API throughput, %d concurrent ADDs", cfg.tputConc), Leasehold: agAll.rate(), Peer: rawAll.rate(),
		hasPeer: true, Unit: "/s", PeerName: "raw etcd Txn", Target: "—"})
	// The target is against the least etcd work that gives each pod its own lease: a lease per
	// pod is the design's unit of ownership, and a bare Txn per key does not pay for it.
	r := row{Figure: fmt.Sprintf("agent API throughput, %d concurrent ADDs, against a LeaseGrant + Txn per key", cfg.tputConc),
		Leasehold: agAll.rate(), Peer: leasedAll.rate(), hasPeer: true, Unit: "/s", PeerName: "raw etcd LeaseGrant, then Txn on it",
		Target: ">= 0.5x LeaseGrant + Txn"}
	q, _ := r.ratio()
	r.judge(q >= 0.5)
	res.add(r)
	res.note("Throughput CPU per operation (2 shared cores): raw Txn: etcd %.0f µs, bench process (client) %.0f µs; "+
		"agent ADD: etcd %.0f µs, bench process (agent + socket client) %.0f µs; LeaseGrant + Txn per key: etcd %.0f µs, bench process (client) %.0f µs.",
		us(rawCPU.etcd)/float64(rawAll.ops), us(rawCPU.self)/float64(rawAll.ops), us(agCPU.etcd)/float64(agAll.ops), us(agCPU.self)/float64(agAll.ops),
		us(leasedCPU.etcd)/float64(leasedAll.ops), us(leasedCPU.self)/float64(leasedAll.ops))
	res.note("Throughput: %d workers back to back for %d alternating rounds of %s each. Agent: an in-process agent (leases.Start, "+
		"its own clientv3 client, leaseholdd's defaults) served on a unix socket by agentapi.Serve as leaseholdd serves it, driven through agentapi.Client "+
		"with ADDs as the plugin binary sends them (operation cni: environment and stdin, parsed and rendered by the agent); "+
		"every ADD is a new pod (a lease from the keeper, the claim Txn, the journal file); %d ADDs, p50 %.1f ms, p99 %.1f ms, "+
		"%.0f CAS retries. Raw: `If CreateRevision(key)==0 Then Put(key, %d-byte value, WithLease)` on one pre-granted lease, "+
		"one client; %d Txns, p50 %.1f ms, p99 %.1f ms. Lease per key (the least etcd work of a lease per pod; third in each round): "+
		"a LeaseGrant, then the same Txn on that lease, one client; %d keys, p50 %.1f ms, p99 %.1f ms.",
		cfg.tputConc, cfg.tputRounds, cfg.tputDur, agAll.ops, ms(agAll.lat.pct(50)), ms(agAll.lat.pct(99)), retries, len(value),
		rawAll.ops, ms(rawAll.lat.pct(50)), ms(rawAll.lat.pct(99)), leasedAll.ops, ms(leasedAll.lat.pct(50)), ms(leasedAll.lat.pct(99)))
	return nil
}

// cpuSplit is CPU time used by etcd and by the bench process (in-process agents and clients).
type cpuSplit struct{ etcd, self time.Duration }

func (c cpuSplit) minus(o cpuSplit) cpuSplit { return cpuSplit{c.etcd - o.etcd, c.self - o.self} }
func (c cpuSplit) plus(o cpuSplit) cpuSplit  { return cpuSplit{c.etcd + o.etcd, c.self + o.self} }

func (e *etcdProc) cpu() cpuSplit {
	et, _ := cpuTime(e.cmd.Process.Pid)
	st, _ := cpuTime(os.Getpid())
	return cpuSplit{et, st}
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
