package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// figScale measures a cluster of -scale-nodes nodes, not an extrapolation, in three phases
// against one etcd.
//
// Real agents: -scale-nodes agents in -scale-hosts processes (one process cannot hold the
// file descriptors of 5,000: each agent has an etcd connection, a socket, a journal and a
// lock), every one with its own etcd client, node identity and keep-alive stream, all
// serving one dual-stack pool. Measured: their start (the STATUS each answers: pool
// definition, block claims listed, watches opened); one ADD at that size (etcd CPU and watch
// events per ADD, as the fan-out figure); and -scale-agent-pods pods ADDed on every agent
// at once through the sockets (the fill rate this machine sustains). The agents then stop.
//
// The cluster's steady state: for each node a client of its own (one keep-alive stream, as
// an agent has) holds -scale-pods pod leases, and each pod has the keys an ADD writes
// (a dual-stack allocation, owner index and pod record) on its lease, written in batches.
// Measured: etcd's CPU for the keep-alives alone, the renewals it receives, its database
// (size, in use, keys) and memory.
//
// A new node in that cluster: an agent's start, its first STATUS and first ADD (claiming a
// block among every node's).
func figScale(ctx context.Context, env *env, res *results) error {
	cfg := env.cfg
	if cfg.scaleHosts < 1 || cfg.scaleNodes < cfg.scaleHosts {
		return fmt.Errorf("-scale-hosts %d, -scale-nodes %d: want 1 <= hosts <= nodes", cfg.scaleHosts, cfg.scaleNodes)
	}
	// 550,000 dual-stack pods are about 2.2 million keys: over etcd's default 2 GiB quota
	// once their history is counted, as docs/performance.md says a production etcd at this
	// size must be configured.
	e, err := startEtcd(ctx, env, "scale", "--quota-backend-bytes", strconv.FormatInt(8<<30, 10))
	if err != nil {
		return err
	}
	defer e.stop()
	const pool = "scale"
	n := fmt.Sprintf("%d nodes", cfg.scaleNodes)
	if err := scaleAgents(ctx, env, res, e, pool, n); err != nil {
		return err
	}
	if err := scaleSteadyState(ctx, env, res, e, pool, n); err != nil {
		return err
	}

	// A new node joins the cluster.
	t0 := time.Now()
	late, err := startInproc(ctx, env, e, "scale-late", "", nil)
	if err != nil {
		return err
	}
	defer late.close()
	lateStart := time.Since(t0)
	lateConf := scaleConf(pool, late.Socket, cfg.scaleV4, cfg.scaleV6)
	t0 = time.Now()
	if err := late.status(ctx, lateConf); err != nil {
		return err
	}
	lateStatus := time.Since(t0)
	t0 = time.Now()
	inv, _ := podAdd(lateConf, env.netns)
	if _, err := invoke(ctx, late.client(), inv); err != nil {
		return fmt.Errorf("the new node's first ADD: %w", err)
	}
	lateAdd := time.Since(t0)
	progress("scale: a new node: start %s, STATUS %s, first ADD %s", lateStart.Round(time.Millisecond), lateStatus.Round(time.Millisecond),
		lateAdd.Round(time.Millisecond))
	res.add(row{Figure: "scale, " + n + ": a new agent's start (leases.Start)", Leasehold: ms(lateStart), Unit: "ms"})
	res.add(row{Figure: "scale, " + n + ": a new agent's first STATUS", Leasehold: ms(lateStatus), Unit: "ms"})
	res.add(row{Figure: "scale, " + n + ": a new agent's first ADD", Leasehold: ms(lateAdd), Unit: "ms"})
	res.note("Scale, a new node: an agent started last, in the steady state above (every node's block claims still there): " +
		"leases.Start, its STATUS for the pool and its first ADD (a block claim among every node's).")
	return scaleBorrow(ctx, env, res, e, pool, n)
}

// scaleBorrow: a new node's first ADD when every IPv4 block of the pool is claimed, so that
// it must borrow: it reads the whole pool (every allocation key, both families) into its
// borrowing snapshot. The blocks no node claimed yet are claimed for the steady state's nodes,
// in turn, on one lease of the bench's.
func scaleBorrow(ctx context.Context, env *env, res *results, e *etcdProc, pool, n string) error {
	cfg := env.cfg
	cli, err := e.client()
	if err != nil {
		return err
	}
	defer cli.Close()
	claimed, err := cli.Get(ctx, keyspace.BlocksPrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return err
	}
	have := map[string]bool{}
	for _, kv := range claimed.Kvs {
		have[string(kv.Key)] = true
	}
	g, err := cli.Grant(ctx, 3600)
	if err != nil {
		return err
	}
	bits := allocator.DefaultBlocks.IPv4
	var ops []clientv3.Op
	flush := func() error {
		if len(ops) == 0 {
			return nil
		}
		_, err := cli.Txn(ctx).Then(ops...).Commit()
		ops = ops[:0]
		return err
	}
	added := 0
	now := time.Now().UTC()
	for b := netip.PrefixFrom(cfg.scaleV4.Addr(), bits); cfg.scaleV4.Contains(b.Addr()); {
		if key := keyspace.BlockKey(pool, b); !have[key] {
			node := fmt.Sprintf("steady-%05d", added%cfg.scaleNodes)
			ops = append(ops, clientv3.OpPut(key, string(mustJSON(keyspace.BlockRecord{Cluster: "default", Node: node,
				NodeUID: "uid-" + node, LeaseID: keyspace.LeaseHex(g.ID), Since: now})), clientv3.WithLease(g.ID)))
			added++
			if len(ops) == 128 {
				if err := flush(); err != nil {
					return fmt.Errorf("claim the free blocks: %w", err)
				}
			}
		}
		next := nthAddr(b.Addr(), 1<<(32-bits))
		if !next.IsValid() || next.Less(b.Addr()) {
			break
		}
		b = netip.PrefixFrom(next, bits)
	}
	if err := flush(); err != nil {
		return fmt.Errorf("claim the free blocks: %w", err)
	}
	keys, err := cli.Get(ctx, keyspace.IPsPrefix(pool), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return err
	}
	t0 := time.Now()
	all, err := cli.Get(ctx, keyspace.IPsPrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return err
	}
	readAlone := time.Since(t0)
	progress("scale: the borrowing read alone (keys only): %d keys in %s", len(all.Kvs), readAlone.Round(time.Millisecond))
	all = nil
	progress("scale: every IPv4 block claimed (%d claims written here, %d of both families there before); the pool holds %d allocation keys", added, len(have), keys.Count)

	borrower, err := startInproc(ctx, env, e, "scale-borrower", "", nil)
	if err != nil {
		return err
	}
	defer borrower.close()
	conf := scaleConf(pool, borrower.Socket, cfg.scaleV4, cfg.scaleV6)
	// Its STATUS finds no block to claim, so it reads the pool to say whether a borrow would
	// find room; the ADDs that follow reuse that snapshot while it is fresh.
	t0 = time.Now()
	if err := borrower.status(ctx, conf); err != nil {
		return err
	}
	status := time.Since(t0)
	var took [2]time.Duration
	var got []netip.Addr
	for i := range took {
		inv, _ := podAdd(conf, env.netns)
		t0 := time.Now()
		addrs, err := invoke(ctx, borrower.client(), inv)
		took[i] = time.Since(t0)
		if err != nil {
			return fmt.Errorf("the borrowing node's ADD %d: %w", i+1, err)
		}
		got = append(got, addrs...)
	}
	m, err := gather(borrower.agent.Metrics())
	if err != nil {
		return err
	}
	borrowed, blockClaims := sum(m, "leasehold_borrowed_addresses_total", nil), sum(m, "leasehold_block_claims_total", nil)
	// The IPv4 address must lie in another node's block: borrowed, not claimed.
	var v4 netip.Addr
	for _, a := range got {
		if a.Is4() {
			v4 = a
			break
		}
	}
	owner, err := cli.Get(ctx, keyspace.BlockKey(pool, allocator.DefaultBlocks.Of(v4)))
	if err != nil {
		return err
	}
	if len(owner.Kvs) == 0 || strings.Contains(string(owner.Kvs[0].Value), `"scale-borrower"`) {
		return fmt.Errorf("the borrowing node's first IPv4 address %s is in a block it claimed, not borrowed", v4)
	}
	progress("scale: a new node that must borrow: STATUS %s (reading %d allocation keys), first ADD %s, second ADD %s; %.0f addresses borrowed, %.0f blocks claimed",
		status.Round(time.Millisecond), keys.Count, took[0].Round(time.Millisecond), took[1].Round(time.Millisecond), borrowed, blockClaims)
	if borrowed < 2 {
		return fmt.Errorf("the new node borrowed %.0f addresses in two ADDs; want 2", borrowed)
	}
	p := "scale, " + n + ", every IPv4 block claimed: "
	res.add(row{Figure: p + "the pool read for borrowing alone (keys only)", Leasehold: ms(readAlone), Unit: "ms"})
	res.add(row{Figure: p + "a new agent's STATUS (reads the pool for borrowing)", Leasehold: ms(status), Unit: "ms"})
	res.add(row{Figure: p + "its first ADD (a borrowed IPv4 address, the snapshot reused)", Leasehold: ms(took[0]), Unit: "ms"})
	res.add(row{Figure: p + "its second ADD", Leasehold: ms(took[1]), Unit: "ms"})
	res.note("Scale, a node that must borrow: every IPv4 block of the pool claimed (%d claims written for the steady state's "+
		"nodes, on one lease); the read a borrow makes (every allocation key of both families, keys only: %d) took %s alone. "+
		"Then an agent started: its STATUS found no block to claim and read the pool (%s); its two ADDs borrowed an IPv4 "+
		"address each (in another node's block) from that snapshot and claimed an IPv6 block: %s and %s.",
		added, keys.Count, readAlone.Round(time.Millisecond), status.Round(time.Millisecond), took[0].Round(time.Millisecond), took[1].Round(time.Millisecond))
	return nil
}

// scaleAgents is the scale figure's first phase: real agents.
func scaleAgents(ctx context.Context, env *env, res *results, e *etcdProc, pool, n string) error {
	cfg := env.cfg
	spec := hostSpec{Etcd: e.URL, Pool: pool, V4: cfg.scaleV4.String(), V6: cfg.scaleV6.String(), Pods: cfg.scaleAgentPods,
		Root: env.root, Netns: env.netns}
	t0 := time.Now()
	var hosts []*agentHost
	defer func() {
		for _, h := range hosts {
			h.stop()
		}
	}()
	per := cfg.scaleNodes / cfg.scaleHosts
	for i := range cfg.scaleHosts {
		s := spec
		s.First, s.Count = i*per, per
		if i == cfg.scaleHosts-1 {
			s.Count = cfg.scaleNodes - s.First
		}
		h, err := startAgentHost(ctx, s)
		if err != nil {
			return err
		}
		hosts = append(hosts, h)
	}
	var statusP50, statusP99 time.Duration
	for _, h := range hosts {
		f, err := h.await(ctx, "ready")
		if err != nil {
			return err
		}
		statusP50, statusP99 = max(statusP50, micros(f[1])), max(statusP99, micros(f[2]))
	}
	started := time.Since(t0)
	progress("scale: %d agents in %d processes serve the pool after %s (STATUS p50 %s, p99 %s, the worst process's)",
		cfg.scaleNodes, len(hosts), started.Round(time.Second), statusP50, statusP99)

	probe, err := startInproc(ctx, env, e, "scale-probe", "", nil)
	if err != nil {
		return err
	}
	defer probe.close()
	probeConf := scaleConf(pool, probe.Socket, cfg.scaleV4, cfg.scaleV6)
	if err := probe.status(ctx, probeConf); err != nil {
		return err
	}
	cost, err := measureAddCost(ctx, env, res, e, probe.Socket, probeConf, cfg.fanoutAdds, "Scale, "+n)
	if err != nil {
		return err
	}
	progress("scale: ADD with %s: p50 %.2f ms, etcd CPU %.0f µs, %.1f watch events per ADD", n, ms(cost.p50), cost.etcdCPU, cost.events)

	t0 = time.Now()
	for _, h := range hosts {
		if err := h.send("pods"); err != nil {
			return err
		}
	}
	var placed, failed int
	var firstFail string
	for _, h := range hosts {
		f, err := h.await(ctx, "pods")
		if err != nil {
			return err
		}
		ok, _ := strconv.Atoi(f[1])
		bad, _ := strconv.Atoi(f[2])
		placed, failed = placed+ok, failed+bad
		if bad > 0 && firstFail == "" {
			firstFail = strings.Join(f[3:], " ")
		}
	}
	fill := time.Since(t0)
	progress("scale: %d pods placed by the agents (%d failed) in %s", placed, failed, fill.Round(time.Second))
	if failed > 0 {
		res.note("Scale: %d of %d pod ADDs of the agents' fill failed, the first with: %s.", failed, placed+failed, firstFail)
	}
	res.add(row{Figure: "scale, " + n + ": agents started, every one serving the pool (wall time)", Leasehold: float64(started.Milliseconds()), Unit: "ms"})
	res.add(row{Figure: "scale, " + n + ": an agent's STATUS at start (pool read, block claims listed) p99", Leasehold: ms(statusP99), Unit: "ms"})
	res.add(row{Figure: "scale, " + n + ": etcd CPU per dual-stack ADD", Leasehold: cost.etcdCPU, Unit: "µs"})
	r := row{Figure: "scale, " + n + ": watch events sent per dual-stack ADD", Leasehold: cost.events, Target: "<= 2"}
	r.judge(cost.events <= 2)
	res.add(r)
	res.add(row{Figure: fmt.Sprintf("scale, %s: ADDs of %d new pods on every agent at once, rate", n, cfg.scaleAgentPods),
		Leasehold: float64(placed) / fill.Seconds(), Unit: "/s"})
	r = row{Figure: fmt.Sprintf("scale, %s: failed ADDs of %d new pods on every agent at once", n, cfg.scaleAgentPods), Leasehold: float64(failed), Target: "0"}
	r.judge(failed == 0)
	res.add(r)
	res.note("Scale (%s), real agents: leases.Agent with leaseholdd's defaults, each its own etcd client, node identity, socket "+
		"and journal, in %d processes, all serving one dual-stack pool (%s and %s, /26 and /122 blocks); etcd with an 8 GiB "+
		"quota. Start: each process starts its agents 8 at a time and each answers a STATUS (p50 %s, p99 %s, the worst "+
		"process's). ADD: %d sequential ADDs through one more agent, etcd CPU less its idle rate, watch events = delta of "+
		"etcd_debugging_mvcc_events_total (one per family: each address is in a block of its own family). Then each process ADDs %d "+
		"pods on each of its agents through their sockets, 64 agents at a time per process: %d placed in %s.",
		n, len(hosts), cfg.scaleV4, cfg.scaleV6, statusP50, statusP99, cfg.fanoutAdds, cfg.scaleAgentPods, placed, fill.Round(time.Second))
	return nil
}

// scaleSteadyState is the scale figure's second phase: every node's pods on their leases.
func scaleSteadyState(ctx context.Context, env *env, res *results, e *etcdProc, pool, n string) error {
	cfg := env.cfg
	const ttl = 90 // s, leaseholdd's default --lease-ttl
	clients := make([]*clientv3.Client, cfg.scaleNodes)
	renewers := make([]*renewer, cfg.scaleNodes)
	ctx, stopRenewing := context.WithCancel(ctx)
	defer func() {
		stopRenewing()
		for _, c := range clients {
			if c != nil {
				c.Close()
			}
		}
	}()
	v4, v6 := cfg.scaleV4.Addr(), cfg.scaleV6.Addr()
	var next atomic.Int64
	addrs := func() (netip.Addr, netip.Addr) {
		i := next.Add(1)
		return nthAddr(v4, i), nthAddr(v6, i)
	}
	// The fill is paced: unpaced, etcd's apply fell behind the writes on this two-core
	// machine, renewals (which wait for the applied index) came late and the leases expired
	// in a cascade before the steady state was reached.
	pace := time.NewTicker(time.Second / time.Duration(cfg.scaleFillRate))
	defer pace.Stop()
	grant := func() { <-pace.C }
	node := func(i int) string { return fmt.Sprintf("steady-%05d", i) }
	t0 := time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	sem := make(chan struct{}, 64)
	for i := range clients {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			err := scaleNode(ctx, e, &clients[i], node(i), pool, cfg.scalePods, ttl, addrs, grant, &renewers[i])
			if err != nil {
				mu.Lock()
				firstErr = firstOf(firstErr, err)
				mu.Unlock()
			}
		})
		if ctx.Err() != nil {
			break
		}
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	pods := cfg.scaleNodes * cfg.scalePods
	filled := time.Since(t0)
	progress("scale: %d pods (%d leases with their keys) held after %s", pods, pods, filled.Round(time.Second))

	// Keep-alives alone: one renewal period (a third of the TTL) after the last grant, then a
	// window of two periods.
	time.Sleep(ttl * time.Second / 3)
	c0, w0 := e.cpu().etcd, time.Now()
	m0, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return err
	}
	time.Sleep(2 * ttl * time.Second / 3)
	m1, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return err
	}
	window := time.Since(w0)
	keepaliveCPU := float64(e.cpu().etcd-c0) / float64(window)
	renew := map[string]string{"grpc_method": "LeaseKeepAlive"}
	renewals := (sum(m1, "grpc_server_msg_received_total", renew) - sum(m0, "grpc_server_msg_received_total", renew)) / window.Seconds()
	dbSize := sum(m1, "etcd_mvcc_db_total_size_in_bytes", nil)
	dbInUse := sum(m1, "etcd_mvcc_db_total_size_in_use_in_bytes", nil)
	keys := sum(m1, "etcd_debugging_mvcc_keys_total", nil)
	rssKB, _ := procStatusKB(e.cmd.Process.Pid, "VmRSS")
	// Every pod record is on its pod's lease: one that expired on the way is a pod missing here.
	live, err := countPodRecords(ctx, clients, node)
	if err != nil {
		return err
	}
	var gone int64
	for _, r := range renewers {
		gone += r.gone.Load()
		if err := r.err.Load(); err != nil {
			return fmt.Errorf("a node's keep-alive stream ended: %w", *err)
		}
	}
	progress("scale: %d of %d pod records still there after the window; %d renewals answered for a lease etcd no longer had", live, pods, gone)
	progress("scale: keep-alives alone: etcd %.1f%% of a core, %.0f renewals/s; database %.0f MB (%.0f MB in use), %.0f keys, etcd RSS %d MB",
		100*keepaliveCPU, renewals, dbSize/1e6, dbInUse/1e6, keys, rssKB/1024)
	p := fmt.Sprintf("scale, %s x %d pods", n, cfg.scalePods)
	for _, r := range []row{
		{Figure: p + ": etcd CPU for keep-alives alone", Leasehold: 100 * keepaliveCPU, Unit: "% of a core"},
		{Figure: p + ": lease renewals received", Leasehold: renewals, Unit: "/s"},
		{Figure: p + ": etcd database size", Leasehold: dbSize / 1e6, Unit: "MB"},
		{Figure: p + ": etcd database in use", Leasehold: dbInUse / 1e6, Unit: "MB"},
		{Figure: p + ": etcd keys", Leasehold: keys},
		{Figure: p + ": etcd RSS", Leasehold: float64(rssKB) / 1024, Unit: "MB"},
	} {
		res.add(r)
	}
	lost := row{Figure: p + ": pods whose lease expired while kept alive", Leasehold: float64(pods - live), Target: "0"}
	lost.judge(live == pods)
	res.add(lost)
	res.note("Scale (%s), steady state: for each node a clientv3 client of its own (one LeaseKeepAlive stream, as an agent has, "+
		"each lease renewed a third of its TTL after the last renewal) granted %d leases of %d s and kept them alive; each lease carries one dual-stack pod's keys as an ADD writes them "+
		"(an IPv4 and an IPv6 allocation in their blocks, the owner index, the pod record; %d pods), written 32 pods to a "+
		"transaction; 64 nodes at a time, leases granted at most %d a second, %s in all. Keep-alives: %d s after the last grant, etcd's CPU over %d s; renewals = "+
		"LeaseKeepAlive messages etcd received per second. Database: etcd_mvcc_db_total_size(_in_use)_in_bytes, "+
		"etcd_debugging_mvcc_keys_total, VmRSS, with the agents' own keys of the first phase still there.",
		n, cfg.scalePods, ttl, pods, cfg.scaleFillRate, filled.Round(time.Second), ttl/3, 2*ttl/3)
	return nil
}

// scaleNode makes one node's pods in the steady state: a client, pods leases kept alive, and
// each pod's keys on its lease.
func scaleNode(ctx context.Context, e *etcdProc, cli **clientv3.Client, node, pool string, pods int, ttl int64,
	addrs func() (netip.Addr, netip.Addr), pace func(), ren **renewer) error {
	c, err := e.client()
	if err != nil {
		return err
	}
	*cli = c
	r, err := startRenewer(ctx, c, time.Duration(ttl)*time.Second/3)
	if err != nil {
		return err
	}
	*ren = r
	cluster, nodeUID := "default", "uid-"+node
	blocks := allocator.DefaultBlocks
	var ops []clientv3.Op
	flush := func() error {
		if len(ops) == 0 {
			return nil
		}
		tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		_, err := c.Txn(tctx).Then(ops...).Commit()
		ops = ops[:0]
		return err
	}
	now := time.Now().UTC()
	for i := range pods {
		pace()
		gctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		g, err := c.Grant(gctx, ttl)
		cancel()
		if err != nil {
			return fmt.Errorf("grant: %w", err)
		}
		r.add(g.ID)
		a4, a6 := addrs()
		owner, container := ids.podUID(), ids.containerID()
		pod := allocator.PodRef{UID: owner, Namespace: "bench", Name: "pod-" + container[:10]}
		lease, with := keyspace.LeaseHex(g.ID), clientv3.WithLease(g.ID)
		for _, a := range []netip.Addr{a4, a6} {
			ops = append(ops, clientv3.OpPut(keyspace.IPKey(pool, blocks, a), string(mustJSON(keyspace.Allocation{
				Owner: owner, Cluster: cluster, Node: node, NodeUID: nodeUID, Pod: pod, ContainerID: container,
				IfName: "eth0", Network: pool, LeaseID: lease, Created: now})), with))
		}
		ops = append(ops,
			clientv3.OpPut(keyspace.OwnerKey(cluster, owner, "eth0", pool), string(mustJSON(keyspace.OwnerRecord{
				IPs: []netip.Addr{a4, a6}, ContainerID: container, Network: pool, Node: node, NodeUID: nodeUID,
				LeaseID: lease, Created: now})), with),
			clientv3.OpPut(keyspace.PodKey(cluster, node, owner), string(mustJSON(keyspace.PodRecord{
				Owner: owner, Pod: pod, NodeUID: nodeUID, LeaseID: lease, Netns: "/var/run/netns/cni-" + container[:36],
				ContainerID: container, Created: now})), with))
		if (i+1)%32 == 0 {
			if err := flush(); err != nil {
				return fmt.Errorf("write pods of %s: %w", node, err)
			}
		}
	}
	if err := flush(); err != nil {
		return fmt.Errorf("write pods of %s: %w", node, err)
	}
	return nil
}

// renewer renews one node's pod leases on one LeaseKeepAlive stream, as an agent's client
// does: a request per lease a third of the TTL after the last, the leases taken in turn.
// It does without clientv3's KeepAlive, which keeps a goroutine and channels per lease:
// 550,000 of those in one process took 4.9 GB and most of its CPU to the garbage
// collector, and the renewals fell behind for the bench's sake, not etcd's.
type renewer struct {
	stream pb.Lease_LeaseKeepAliveClient
	period time.Duration
	mu     sync.Mutex
	queue  []renewal // in the order they are due: every lease has the same period
	// gone counts renewals etcd answered for a lease it no longer has; err is the stream's end.
	gone atomic.Int64
	err  atomic.Pointer[error]
}

type renewal struct {
	id  clientv3.LeaseID
	due time.Time
}

func startRenewer(ctx context.Context, c *clientv3.Client, period time.Duration) (*renewer, error) {
	stream, err := pb.NewLeaseClient(c.ActiveConnection()).LeaseKeepAlive(ctx)
	if err != nil {
		return nil, fmt.Errorf("open a keep-alive stream: %w", err)
	}
	r := &renewer{stream: stream, period: period}
	go r.receive()
	go r.send(ctx)
	return r, nil
}

func (r *renewer) add(id clientv3.LeaseID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.queue = append(r.queue, renewal{id, time.Now().Add(r.period)})
}

// send sends what is due every half second, as clientv3's keep-alive loop does.
func (r *renewer) send(ctx context.Context) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		r.mu.Lock()
		for len(r.queue) > 0 && !r.queue[0].due.After(now) {
			id := r.queue[0].id
			r.queue = append(r.queue[1:], renewal{id, now.Add(r.period)})
			if err := r.stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
				r.err.CompareAndSwap(nil, &err)
				r.mu.Unlock()
				return
			}
		}
		r.mu.Unlock()
	}
}

func (r *renewer) receive() {
	for {
		resp, err := r.stream.Recv()
		if err != nil {
			r.err.CompareAndSwap(nil, &err)
			return
		}
		if resp.TTL <= 0 {
			r.gone.Add(1)
		}
	}
}

// countPodRecords counts the pod records of the steady state's nodes, each node's with its
// own client, 16 nodes at a time.
func countPodRecords(ctx context.Context, clients []*clientv3.Client, node func(int) string) (int, error) {
	var live atomic.Int64
	var mu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i, c := range clients {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			gctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			r, err := c.Get(gctx, keyspace.PodsPrefix("default", node(i)), clientv3.WithPrefix(), clientv3.WithCountOnly())
			if err != nil {
				mu.Lock()
				firstErr = firstOf(firstErr, err)
				mu.Unlock()
				return
			}
			live.Add(r.Count)
		})
	}
	wg.Wait()
	return int(live.Load()), firstErr
}

// nthAddr is the address i after base, within 64 bits.
func nthAddr(base netip.Addr, i int64) netip.Addr {
	b := base.As16()
	lo := binary.BigEndian.Uint64(b[8:]) + uint64(i)
	binary.BigEndian.PutUint64(b[8:], lo)
	a := netip.AddrFrom16(b)
	if base.Is4() {
		return a.Unmap()
	}
	return a
}

func passIf(ok bool) string {
	if ok {
		return "yes"
	}
	return "no"
}

// micros parses a count of microseconds printed by an agent host.
func micros(s string) time.Duration {
	n, _ := strconv.ParseInt(s, 10, 64)
	return time.Duration(n) * time.Microsecond
}

// scaleConf is a dual-stack network whose IPAM is leasehold, one range set per family.
func scaleConf(network, socket string, v4, v6 netip.Prefix) []byte {
	return mustJSON(map[string]any{
		"cniVersion": "1.1.0", "name": network, "type": "macvlan", "master": "eth0",
		"ipam": map[string]any{
			"type": "leasehold", "socket": socket,
			"ranges": []any{[]any{map[string]any{"subnet": v4.String()}}, []any{map[string]any{"subnet": v6.String()}}},
		},
	})
}

// hostSpec is what an agent host process runs: agents First..First+Count-1 of the figure.
type hostSpec struct {
	Etcd, Pool, V4, V6, Root, Netns string
	First, Count, Pods              int
}

// agentHost is a child process of the bench running a share of the figure's agents. It
// speaks in lines: it prints "ready P50 P99" (µs) once its agents serve the pool, then
// "pods OK FAILED [FIRST ERROR]" after each "pods" it is sent; it exits when its stdin
// closes, and on an error prints "error MESSAGE".
type agentHost struct {
	stop  func()
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan []string
	done  chan struct{}
}

// agentHostFlag runs the bench as an agent host instead (hidden).
const agentHostFlag = "-agent-host"

func startAgentHost(ctx context.Context, spec hostSpec) (*agentHost, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	b, _ := json.Marshal(spec)
	h := &agentHost{cmd: exec.Command(self, agentHostFlag, string(b)), lines: make(chan []string, 4), done: make(chan struct{})}
	h.cmd.Stderr = os.Stderr
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if h.in, err = h.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := h.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := h.cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			h.lines <- strings.Fields(sc.Text())
		}
		close(h.lines)
	}()
	go func() { _ = h.cmd.Wait(); close(h.done) }()
	h.stop = cleanups.add(func() {
		_ = h.in.Close()
		select {
		case <-h.done:
		case <-time.After(60 * time.Second):
			_ = h.cmd.Process.Kill()
			<-h.done
		}
	})
	return h, nil
}

func (h *agentHost) send(cmd string) error {
	_, err := io.WriteString(h.in, cmd+"\n")
	return err
}

// await is the host's next line, which must begin with word.
func (h *agentHost) await(ctx context.Context, word string) ([]string, error) {
	select {
	case f, ok := <-h.lines:
		switch {
		case !ok:
			return nil, fmt.Errorf("agent host %d exited before %q", h.cmd.Process.Pid, word)
		case len(f) > 0 && f[0] == word:
			return f, nil
		default:
			return nil, fmt.Errorf("agent host %d: %s", h.cmd.Process.Pid, strings.Join(f, " "))
		}
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// runAgentHost is the child's side of agentHost.
func runAgentHost(arg string) int {
	var spec hostSpec
	if err := json.Unmarshal([]byte(arg), &spec); err != nil {
		fmt.Println("error", err)
		return 2
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	defer cleanups.run()
	err := agentHostRun(ctx, spec)
	if err != nil {
		fmt.Println("error", strings.ReplaceAll(err.Error(), "\n", " "))
		return 1
	}
	return 0
}

func agentHostRun(ctx context.Context, spec hostSpec) error {
	v4, err := netip.ParsePrefix(spec.V4)
	if err != nil {
		return err
	}
	v6, err := netip.ParsePrefix(spec.V6)
	if err != nil {
		return err
	}
	root, err := os.MkdirTemp(spec.Root, fmt.Sprintf("host-%d-", spec.First))
	if err != nil {
		return err
	}
	// IDs unique across the run: the parent and every host draw from their own stream.
	ids = &idGen{r: rand.New(rand.NewPCG(6, uint64(spec.First)+1<<32))}
	sink := &logSink{max: 5}
	env := &env{root: root, netns: spec.Netns, agentLog: slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	e := &etcdProc{URL: spec.Etcd}
	agents := make([]*inproc, spec.Count)
	var lat durations
	var mu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range agents {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			a, err := startInproc(ctx, env, e, fmt.Sprintf("scale-%05d", spec.First+i), "", nil)
			var took time.Duration
			if err == nil {
				t := time.Now()
				err = a.status(ctx, scaleConf(spec.Pool, a.Socket, v4, v6))
				took = time.Since(t)
			}
			mu.Lock()
			defer mu.Unlock()
			agents[i], lat = a, append(lat, took)
			if err != nil && firstErr == nil {
				firstErr = err
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	fmt.Printf("ready %d %d\n", lat.pct(50).Microseconds(), lat.pct(99).Microseconds())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if in.Text() != "pods" {
			return fmt.Errorf("unknown command %q", in.Text())
		}
		var ok, failed atomic.Int64
		var first atomic.Value
		sem := make(chan struct{}, 64)
		for _, a := range agents {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				conf := scaleConf(spec.Pool, a.Socket, v4, v6)
				cl := a.client()
				for range spec.Pods {
					inv, _ := podAdd(conf, spec.Netns)
					if _, err := invoke(ctx, cl, inv); err != nil {
						failed.Add(1)
						first.CompareAndSwap(nil, strings.ReplaceAll(err.Error(), "\n", " "))
						continue
					}
					ok.Add(1)
				}
			})
		}
		wg.Wait()
		msg, _ := first.Load().(string)
		fmt.Printf("pods %d %d %s\n", ok.Load(), failed.Load(), msg)
	}
	if err := in.Err(); err != nil && !errors.Is(err, os.ErrClosed) {
		return err
	}
	return nil
}
