package main

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// figEtcdParts: what each etcd request an ADD makes costs etcd's CPU, each run alone 64 at
// a time on one client against a fresh etcd, next to the throughput figure's raw baseline
// (a one-put create-if-absent Txn). A new pod costs etcd a LeaseGrant, its share of a claim
// Txn (6 compares, 3 puts; shared when ADDs run concurrently), the lease's first keep-alive
// and a watch event per agent serving the pool: this is where the throughput figure's etcd
// CPU per ADD goes.
func figEtcdParts(ctx context.Context, env *env, res *results) error {
	e, cli, done, err := startEtcdClient(ctx, env, "parts")
	if err != nil {
		return err
	}
	defer done()
	g, err := cli.Grant(ctx, 3600)
	if err != nil {
		return err
	}
	value := strings.Repeat("v", 396) // as large as an allocation record
	var seq atomic.Int64
	put := func(k string) clientv3.Op { return clientv3.OpPut(k, value, clientv3.WithLease(g.ID)) }
	absent := func(k string) clientv3.Cmp { return clientv3.Compare(clientv3.CreateRevision(k), "=", 0) }
	// Leases for the keep-alive part, granted before it is measured.
	var fresh []clientv3.LeaseID
	for range 4000 {
		l, err := cli.Grant(ctx, 90)
		if err != nil {
			return err
		}
		fresh = append(fresh, l.ID)
	}
	parts := []struct {
		name string
		op   func(ctx context.Context) error
	}{
		{"raw create-if-absent Txn (1 compare, 1 put)", func(ctx context.Context) error {
			k := fmt.Sprintf("/bench/parts/raw/%d", seq.Add(1))
			_, err := cli.Txn(ctx).If(absent(k)).Then(put(k)).Commit()
			return err
		}},
		{"LeaseGrant", func(ctx context.Context) error {
			_, err := cli.Grant(ctx, 90)
			return err
		}},
		{"claim-shaped Txn alone (6 compares, 3 puts)", func(ctx context.Context) error {
			n := seq.Add(1)
			k := func(kind string) string { return fmt.Sprintf("/bench/parts/%s/%d", kind, n) }
			_, err := cli.Txn(ctx).If(absent(k("ip")), absent(k("owner")), absent(k("pod")), absent(k("quarantine")),
				clientv3.Compare(clientv3.CreateRevision(k("hostips")+"/"), "=", 0).WithPrefix(), absent("/bench/parts/pool")).
				Then(put(k("ip")), put(k("owner")), put(k("pod"))).Commit()
			return err
		}},
		{"first keep-alive of a fresh lease", func(ctx context.Context) error {
			_, err := cli.KeepAliveOnce(ctx, fresh[int(seq.Add(1))%len(fresh)])
			return err
		}},
	}
	var rawUS float64
	var notes []string
	for i, p := range parts {
		c0 := e.cpu()
		r, err := closedLoop(ctx, env.cfg.tputConc, time.Second, p.op)
		if err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
		c := e.cpu().minus(c0)
		perOp := us(c.etcd) / float64(r.ops)
		progress("etcd parts: %s: %.0f/s, etcd %.0f µs/op, bench %.0f µs/op", p.name, r.rate(), perOp, us(c.self)/float64(r.ops))
		notes = append(notes, fmt.Sprintf("%s %.0f/s (client %.0f µs/op)", p.name, r.rate(), us(c.self)/float64(r.ops)))
		if i == 0 {
			rawUS = perOp
			continue
		}
		res.add(row{Figure: "etcd CPU per request, 64 concurrent: " + p.name, Leasehold: perOp, Peer: rawUS, hasPeer: true,
			Unit: "µs", PeerName: "raw Txn"})
	}
	res.note("etcd CPU per request (the requests an ADD makes, each measured alone for 1 s, %d at a time on one client, "+
		"against a fresh etcd; CPU from /proc, so the shared machine's noise is in it): %s. The raw Txn's own figure "+
		"was %.0f µs.", env.cfg.tputConc, strings.Join(notes, "; "), rawUS)
	return nil
}
