package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"
)

// figChurn: pods that come and go, as in a rolling update. One after the other, each pod is
// ADDed and then DELeted through the plugin binary, leasehold against a leaseholdd process
// and host-local interleaved with it. It reports DEL's p50 against host-local's and what a
// pod's whole life costs etcd: unary requests per pod, and among them lease grants and
// revokes (a DEL gives its pod's lease to the next new pod when no key is left on it).
func figChurn(ctx context.Context, env *env, res *results) error {
	e, err := startEtcd(ctx, env, "churn")
	if err != nil {
		return err
	}
	defer e.stop()
	state, err := env.tempDir("churn-state")
	if err != nil {
		return err
	}
	agent, err := startLeaseholdd(ctx, env, e.URL, "churn-node", state, "")
	if err != nil {
		return err
	}
	defer agent.stop()
	hlData, err := env.tempDir("churn-host-local")
	if err != nil {
		return err
	}
	subnet := netip.MustParsePrefix("10.60.0.0/16")
	lh, hl := newPlugin(env.bin, "leasehold"), newPlugin(env.bin, "cni/host-local")
	lhConf, hlConf := leaseholdConf("churn", agent.Socket, subnet), hostLocalConf("churn", hlData, subnet)

	// life ADDs one new pod, waits as between two plugin calls, DELs it, and returns how
	// long the DEL took.
	life := func(p pluginBin, conf []byte) (time.Duration, error) {
		c := call{container: ids.containerID(), podUID: ids.podUID(), netns: env.netns, conf: conf}
		if _, _, err := p.add(ctx, c); err != nil {
			return 0, err
		}
		time.Sleep(idleGap)
		c.command = "DEL"
		_, took, err := p.run(ctx, c)
		if err != nil {
			return took, fmt.Errorf("%s DEL: %w", filepath.Base(p.path), err)
		}
		time.Sleep(idleGap)
		return took, nil
	}
	for range 10 { // pool definition, view and spares in place
		if _, err := life(lh, lhConf); err != nil {
			return err
		}
	}
	time.Sleep(300 * time.Millisecond) // the keeper's refill, if any, is done
	e0, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return err
	}
	n := env.cfg.churnPods
	var lhDel, hlDel durations
	for range n {
		if err := ctx.Err(); err != nil {
			return err
		}
		took, err := life(lh, lhConf)
		if err != nil {
			return err
		}
		lhDel = append(lhDel, took)
		if took, err = life(hl, hlConf); err != nil {
			return err
		}
		hlDel = append(hlDel, took)
	}
	time.Sleep(300 * time.Millisecond)
	e1, err := scrape(ctx, e.URL+"/metrics")
	if err != nil {
		return err
	}
	per := func(method string) float64 {
		want := map[string]string{"grpc_type": "unary"}
		if method != "" {
			want["grpc_method"] = method
		}
		return (sum(e1, "grpc_server_handled_total", want) - sum(e0, "grpc_server_handled_total", want)) / float64(n)
	}
	all, grants, revokes := per(""), per("LeaseGrant"), per("LeaseRevoke")
	r := row{Figure: "churn: plugin DEL p50 (each pod ADDed just before)", Leasehold: ms(lhDel.pct(50)), Peer: ms(hlDel.pct(50)),
		hasPeer: true, Unit: "ms", PeerName: "host-local"}
	res.add(r)
	res.add(row{Figure: "churn: etcd requests per pod (ADD + DEL)", Leasehold: all})
	res.add(row{Figure: "churn: LeaseGrants + LeaseRevokes per pod", Leasehold: grants + revokes})
	res.note("Churn: %d pods one after the other, each ADDed and DELeted through the plugin binary (%s idle after each call), "+
		"leasehold against a leaseholdd process (defaults: 8 spare leases, 30 s quarantine) and its own etcd, host-local "+
		"interleaved (its dataDir on the same disk); DEL p90 leasehold %.2f ms, host-local %.2f ms. etcd requests per pod = delta of "+
		"etcd's grpc_server_handled_total{grpc_type=\"unary\"} over the pods: Txn %.2f, Range %.2f, LeaseGrant %.2f, "+
		"LeaseRevoke %.2f, LeaseTimeToLive %.2f (a DEL's lease with no key left goes back to the spares, and the next new pod "+
		"takes it, so neither grants nor revokes; 1 LeaseGrant per quarantine window is shared by every DEL in it).",
		n, idleGap, ms(lhDel.pct(90)), ms(hlDel.pct(90)), per("Txn"), per("Range"), grants, revokes, per("LeaseTimeToLive"))
	progress("churn: DEL p50 leasehold %.2f ms, host-local %.2f ms; etcd requests per pod %.2f, grants+revokes %.2f",
		ms(lhDel.pct(50)), ms(hlDel.pct(50)), all, grants+revokes)
	return os.RemoveAll(hlData)
}
