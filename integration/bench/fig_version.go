package main

import "context"

// figVersion: the plugin's start-up cost. VERSION does no work beyond starting the binary
// and printing the supported versions, so its p50 is the process's floor; leasehold's must
// stay within 1.5x host-local's (the plugin links no etcd, gRPC or netlink).
func figVersion(ctx context.Context, env *env, res *results) error {
	lh, hl := newPlugin(env.bin, "leasehold"), newPlugin(env.bin, "cni/host-local")
	conf := []byte(`{"cniVersion":"1.1.0"}`)
	var lhT, hlT durations
	for i := range 2 * env.cfg.versionN {
		if err := ctx.Err(); err != nil {
			return err
		}
		// Interleaved, so that load from elsewhere on the machine hits both alike.
		p, into := lh, &lhT
		if i%2 == 1 {
			p, into = hl, &hlT
		}
		_, took, err := p.run(ctx, call{command: "VERSION", conf: conf})
		if err != nil {
			return err
		}
		*into = append(*into, took)
	}
	r := row{Figure: "plugin VERSION p50 (process start floor)", Leasehold: ms(lhT.pct(50)), Peer: ms(hlT.pct(50)), hasPeer: true,
		Unit: "ms", PeerName: "host-local", Target: "<= 1.5x host-local"}
	q, _ := r.ratio()
	r.judge(q <= 1.5)
	res.add(r)
	res.note("VERSION: %d calls of each binary, interleaved, stdin `{\"cniVersion\":\"1.1.0\"}`; p90 leasehold %.2f ms, host-local %.2f ms.",
		env.cfg.versionN, ms(lhT.pct(90)), ms(hlT.pct(90)))
	progress("VERSION p50 leasehold %.2f ms, host-local %.2f ms", ms(lhT.pct(50)), ms(hlT.pct(50)))
	return nil
}
