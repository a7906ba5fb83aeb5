package main

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
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
	// The first ADD defines the pool and lists it into the view; its answer is the one the
	// socket floor gives every client.
	first, err := cl.Invoke(ctx, func() *agentapi.Invocation { inv, _ := podAdd(conf, env.netns); return inv }())
	if err != nil {
		return err
	}
	if first.Exit != 0 {
		return fmt.Errorf("agent: first ADD: %s", first.Stdout)
	}
	// The socket floor: the lease-per-key work behind the protocol a plugin speaks to its
	// agent (agentapi.Serve and agentapi.Client, the same invocation and an answer of the
	// same bytes), without the agent's own work: what any agent holding a lease per pod
	// pays, because a plugin process cannot hold a lease past its own exit. It is served in
	// the bench process, as the agent of this figure is, so that the CPU split counts the
	// server alike for both (the plugin ADD's floor serves it from a process of its own,
	// startHopServer, because there the idle process's wake-up is the point).
	floorCl, stopFloor, err := serveSocketFloor(ctx, env, leasedOp, first.Stdout)
	if err != nil {
		return err
	}
	defer stopFloor()
	socketOp := func(ctx context.Context) error {
		inv, _ := podAdd(conf, env.netns)
		_, err := invoke(ctx, floorCl, inv)
		return err
	}
	time.Sleep(200 * time.Millisecond)
	var rawAll, agAll, leasedAll, sockAll loadResult
	var rawCPU, agCPU, leasedCPU, sockCPU cpuSplit
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
		k, err := closedLoop(ctx, cfg.tputConc, cfg.tputDur, socketOp)
		if err != nil {
			return fmt.Errorf("socket floor: %w", err)
		}
		c4 := e.cpu()
		rawCPU, agCPU, leasedCPU = rawCPU.plus(c1.minus(c0)), agCPU.plus(c2.minus(c1)), leasedCPU.plus(c3.minus(c2))
		sockCPU = sockCPU.plus(c4.minus(c3))
		perOp := func(c cpuSplit, n int) string {
			return fmt.Sprintf("etcd %.0f µs, bench %.0f µs", us(c.etcd)/float64(n), us(c.self)/float64(n))
		}
		progress("throughput round %d: raw etcd Txn %.0f/s, agent ADD %.0f/s (p50 %.1f ms, p99 %.1f ms), raw LeaseGrant+Txn %.0f/s, "+
			"the same behind the socket %.0f/s; CPU/op raw: %s; agent: %s; LeaseGrant+Txn: %s; behind the socket: %s",
			round+1, r.rate(), a.rate(), ms(a.lat.pct(50)), ms(a.lat.pct(99)), l.rate(), k.rate(),
			perOp(c1.minus(c0), r.ops), perOp(c2.minus(c1), a.ops), perOp(c3.minus(c2), l.ops), perOp(c4.minus(c3), k.ops))
		for _, p := range []struct{ all, one *loadResult }{{&rawAll, &r}, {&agAll, &a}, {&leasedAll, &l}, {&sockAll, &k}} {
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
	res.add(row{Figure: fmt.Sprintf("agent API throughput, %d concurrent ADDs, against a LeaseGrant + Txn per key", cfg.tputConc),
		Leasehold: agAll.rate(), Peer: leasedAll.rate(), hasPeer: true, Unit: "/s", PeerName: "raw etcd LeaseGrant, then Txn on it", Target: "—"})
	// The target is against the least work of the design: a lease per pod (its unit of
	// ownership; a bare Txn per key does not pay for it), granted and written by a server
	// behind the socket a plugin reaches its agent by (a plugin process cannot hold a lease).
	r := row{Figure: fmt.Sprintf("agent API throughput, %d concurrent ADDs, against its floor", cfg.tputConc),
		Leasehold: agAll.rate(), Peer: sockAll.rate(), hasPeer: true, Unit: "/s", PeerName: "LeaseGrant + Txn per key behind the agent socket",
		Target: ">= 0.5x floor"}
	q, _ := r.ratio()
	r.judge(q >= 0.5)
	res.add(r)
	res.note("Throughput CPU per operation (2 shared cores): raw Txn: etcd %.0f µs, bench process (client) %.0f µs; "+
		"agent ADD: etcd %.0f µs, bench process (agent + socket client) %.0f µs; LeaseGrant + Txn per key: etcd %.0f µs, bench process (client) %.0f µs.",
		us(rawCPU.etcd)/float64(rawAll.ops), us(rawCPU.self)/float64(rawAll.ops), us(agCPU.etcd)/float64(agAll.ops), us(agCPU.self)/float64(agAll.ops),
		us(leasedCPU.etcd)/float64(leasedAll.ops), us(leasedCPU.self)/float64(leasedAll.ops))
	res.note("Throughput behind the socket (fourth in each round): the same LeaseGrant and Txn, made by an Invoker served by "+
		"agentapi.Serve on a unix socket and driven by agentapi.Client with the agent's invocations, answering the agent's first "+
		"ADD's output: %d ADDs, p50 %.1f ms, p99 %.1f ms; CPU per operation: etcd %.0f µs, bench process (server and client) %.0f µs.",
		sockAll.ops, ms(sockAll.lat.pct(50)), ms(sockAll.lat.pct(99)), us(sockCPU.etcd)/float64(sockAll.ops), us(sockCPU.self)/float64(sockAll.ops))
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

// serveSocketFloor serves op behind agentapi.Serve on a socket of its own, answering every
// invocation with answer, and returns a client of it and the function that stops it.
func serveSocketFloor(ctx context.Context, env *env, op func(context.Context) error, answer []byte) (*agentapi.Client, func(), error) {
	dir, err := env.tempDir("socket-floor")
	if err != nil {
		return nil, nil, err
	}
	sock := filepath.Join(dir, "floor.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		return nil, nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = agentapi.Serve(sctx, l, floorInvoker{op, answer}, nil)
	}()
	return &agentapi.Client{Socket: sock, Timeout: 60 * time.Second}, func() { cancel(); <-done }, nil
}

type floorInvoker struct {
	op     func(context.Context) error
	answer []byte
}

func (f floorInvoker) Invoke(ctx context.Context, _ *agentapi.Invocation) *agentapi.Output {
	if err := f.op(ctx); err != nil {
		return &agentapi.Output{Exit: 1, Stdout: fmt.Appendf(nil, `{"cniVersion":"1.1.0","code":11,"msg":%q}`, err.Error()), Err: err}
	}
	return &agentapi.Output{Stdout: f.answer}
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
