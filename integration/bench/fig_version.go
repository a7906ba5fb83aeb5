package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// figVersion: the plugin's start-up cost. VERSION does no work beyond starting the binary
// and printing the supported versions, so its p50 is the process's floor; leasehold's must
// stay within 1.5x host-local's (the plugin links no etcd, gRPC or netlink).
//
// Two reference processes run interleaved with them: the smallest Go program (it writes
// one line and exits), which is as fast as any Go plugin can start, and /bin/true, a C
// program, which shows what the Go runtime's start adds.
func figVersion(ctx context.Context, env *env, res *results) error {
	minGo, err := buildMinimalGo(ctx, env)
	if err != nil {
		return err
	}
	bins := []pluginBin{newPlugin(env.bin, "leasehold"), newPlugin(env.bin, "cni/host-local"), minGo, {path: "/bin/true"}}
	conf := []byte(`{"cniVersion":"1.1.0"}`)
	took := make([]durations, len(bins))
	for i := range len(bins) * env.cfg.versionN {
		if err := ctx.Err(); err != nil {
			return err
		}
		// Interleaved, so that load from elsewhere on the machine hits all alike.
		j := i % len(bins)
		_, d, err := bins[j].run(ctx, call{command: "VERSION", conf: conf})
		if err != nil {
			return err
		}
		took[j] = append(took[j], d)
	}
	lhT, hlT, goT, cT := took[0], took[1], took[2], took[3]
	r := row{Figure: "plugin VERSION p50 (process start floor)", Leasehold: ms(lhT.pct(50)), Peer: ms(hlT.pct(50)), hasPeer: true,
		Unit: "ms", PeerName: "host-local", Target: "<= 1.5x host-local"}
	q, _ := r.ratio()
	r.judge(q <= 1.5)
	res.add(r)
	res.add(row{Figure: "plugin VERSION p50 against the smallest Go program (the Go runtime's start)", Leasehold: ms(lhT.pct(50)),
		Peer: ms(goT.pct(50)), hasPeer: true, Unit: "ms", PeerName: "minimal Go binary", Target: "—"})
	res.note("VERSION: %d calls of each binary, interleaved with as many of a minimal Go program (`main` writes one line; "+
		"built by the bench as the Makefile builds bin/leasehold: CGO_ENABLED=0, -trimpath, -ldflags '-s -w') and of /bin/true (C, dynamically linked), "+
		"stdin `{\"cniVersion\":\"1.1.0\"}`; p50 leasehold %.2f ms, host-local %.2f ms, minimal Go %.2f ms, /bin/true %.2f ms; "+
		"p90 leasehold %.2f ms, host-local %.2f ms, minimal Go %.2f ms, /bin/true %.2f ms.",
		env.cfg.versionN, ms(lhT.pct(50)), ms(hlT.pct(50)), ms(goT.pct(50)), ms(cT.pct(50)),
		ms(lhT.pct(90)), ms(hlT.pct(90)), ms(goT.pct(90)), ms(cT.pct(90)))
	progress("VERSION p50 leasehold %.2f ms, host-local %.2f ms, minimal Go %.2f ms, /bin/true %.2f ms",
		ms(lhT.pct(50)), ms(hlT.pct(50)), ms(goT.pct(50)), ms(cT.pct(50)))
	return nil
}

// minimalGo is the smallest Go program that answers like a plugin's VERSION: one line out.
const minimalGo = `package main

import "os"

func main() { os.Stdout.Write([]byte("{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"1.1.0\"]}\n")) }
`

// buildMinimalGo builds minimalGo with the go command that runs the bench.
func buildMinimalGo(ctx context.Context, env *env) (pluginBin, error) {
	dir, err := env.tempDir("mingo")
	if err != nil {
		return pluginBin{}, err
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module mingo\n\ngo 1.26\n"), 0o644); err != nil {
		return pluginBin{}, err
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(minimalGo), 0o644); err != nil {
		return pluginBin{}, err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", "-s -w", "-o", "mingo", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return pluginBin{}, fmt.Errorf("build the minimal Go program: %w: %s", err, out)
	}
	return pluginBin{path: filepath.Join(dir, "mingo")}, nil
}
