package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// diagnostics prints what helps after a failure: the pods, the agent's log, the tails of the
// components' logs.
func (e *env) diagnostics(ctx context.Context) {
	fmt.Println("\n==== diagnostics ====")
	if e.kubeconfig != "" {
		for _, args := range [][]string{
			{"get", "nodes,pods", "-A", "-o", "wide"},
			{"get", "events", "-A", "--sort-by=.lastTimestamp"},
		} {
			out, err := e.kubectl(ctx, args...)
			fmt.Printf("$ kubectl %s\n%s%v\n", strings.Join(args, " "), out, errOrEmpty(err))
		}
	}
	logs, _ := filepath.Glob(filepath.Join(e.tmp, "pod-logs", "leasehold_*", "*", "*.log"))
	for _, l := range logs {
		fmt.Printf("--- %s\n%s\n", l, tail(l, 40))
	}
	for _, p := range e.procs {
		fmt.Printf("--- %s (%s)\n%s\n", p.name, p.log, tail(p.log, 25))
	}
}

func errOrEmpty(err error) any {
	if err == nil {
		return ""
	}
	return err
}

// cleanup takes everything down in order: the test pods and the DaemonSet through Kubernetes
// (so the pods' DELs run and the agent revokes its leases), kubelet, containerd and whatever
// it left (containers, shims, mounts, network namespaces, the bridge, cgroups), the control
// plane, the etcds, and the host paths the run created.
func (e *env) cleanup(ctx context.Context) error {
	fmt.Println("=== cleanup")
	var errs []error
	fail := func(err error) {
		if err != nil {
			fmt.Println("    cleanup:", err)
			errs = append(errs, err)
		}
	}
	apiUp := e.kubeconfig != "" && e.kubelet != nil && !e.kubelet.exited()
	if apiUp {
		if _, err := e.kubectl(ctx, "-n", testNS, "delete", "deployment", testDeploy, "--ignore-not-found", "--wait=true", "--timeout=60s"); err != nil {
			fail(err)
		}
		_ = poll(ctx, 60*time.Second, "test pods gone", func() (bool, string, error) {
			ps, err := e.pods(ctx, testNS, "app="+testDeploy)
			return err == nil && len(ps) == 0, fmt.Sprintf("%d pods", len(ps)), nil
		})
		if _, err := e.kubectl(ctx, "-n", "leasehold", "delete", "daemonset", "leaseholdd", "--ignore-not-found", "--wait=true", "--timeout=60s"); err != nil {
			fail(err)
		}
		fail(poll(ctx, 60*time.Second, "agent pod gone", func() (bool, string, error) {
			ps, err := e.pods(ctx, "leasehold", "app.kubernetes.io/name=leasehold")
			return err == nil && len(ps) == 0, fmt.Sprintf("%d pods", len(ps)), nil
		}))
	}
	// The network namespaces containerd's sandboxes still have, before it stops.
	netns := e.sandboxNetns(ctx)
	if e.kubelet != nil {
		e.kubelet.stop(20 * time.Second)
	}
	if e.containerd != nil {
		e.containerd.stop(15 * time.Second)
	}
	if e.runcRoot != "" {
		root := filepath.Join(e.runcRoot, containerNS)
		if out, err := exec.Command(e.tools["runc"], "--root", root, "list", "-q").Output(); err == nil {
			for _, id := range strings.Fields(string(out)) {
				if out, err := exec.Command(e.tools["runc"], "--root", root, "delete", "--force", id).CombinedOutput(); err != nil {
					fail(fmt.Errorf("runc delete --force %s: %v %s", id, err, out))
				}
			}
		}
		for _, pid := range shims(e.ctrSock) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	for _, p := range slices.Backward(e.procs) {
		p.stop(10 * time.Second)
	}
	for _, n := range netns {
		if _, err := os.Stat(n); err == nil {
			_ = syscall.Unmount(n, syscall.MNT_DETACH)
			fail(os.Remove(n))
		}
	}
	if e.tmp != "" {
		fail(unmountUnder(e.tmp))
	}
	if _, err := os.Stat("/sys/class/net/" + bridgeName); err == nil {
		if out, err := exec.Command("ip", "link", "del", bridgeName).CombinedOutput(); err != nil {
			fail(fmt.Errorf("ip link del %s: %v %s", bridgeName, err, out))
		}
	}
	fail(removeCgroups())
	stale, _ := filepath.Glob(filepath.Join("/var/lib/cni/results", network+"-*"))
	for _, f := range stale {
		fail(os.Remove(f))
	}
	// Host paths this run created: what the DaemonSet installed or wrote there goes with them.
	for _, h := range slices.Backward(e.createdHostPaths) {
		if h == "/run/containerd" || h == "/run/containerd/s" {
			_ = os.Remove(h) // only if empty: another containerd may use it meanwhile
			continue
		}
		fail(os.RemoveAll(h))
	}
	return errors.Join(errs...)
}

// sandboxNetns asks containerd which network namespaces its sandboxes were given.
func (e *env) sandboxNetns(ctx context.Context) []string {
	if e.containerd == nil || e.containerd.exited() {
		return nil
	}
	ctr := func(args ...string) (string, error) {
		return e.run(ctx, nil, e.tools["ctr"], append([]string{"-a", e.ctrSock, "-n", containerNS}, args...)...)
	}
	out, err := ctr("containers", "ls", "-q")
	if err != nil {
		return nil
	}
	var paths []string
	for _, id := range strings.Fields(out) {
		info, err := ctr("containers", "info", id)
		if err != nil {
			continue
		}
		var c struct {
			Spec struct {
				Linux struct{ Namespaces []struct{ Type, Path string } }
			}
		}
		if json.Unmarshal([]byte(info), &c) != nil {
			continue
		}
		for _, n := range c.Spec.Linux.Namespaces {
			if n.Type == "network" && (strings.HasPrefix(n.Path, "/var/run/netns/") || strings.HasPrefix(n.Path, "/run/netns/")) {
				paths = append(paths, n.Path)
			}
		}
	}
	return paths
}

// shims are the runc v2 shims of the containerd at sock.
func shims(sock string) []int {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var out []int
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) == 0 || filepath.Base(args[0]) != "containerd-shim-runc-v2" {
			continue
		}
		if i := slices.Index(args, "-address"); i >= 0 && i+1 < len(args) && args[i+1] == sock {
			var pid int
			if _, err := fmt.Sscanf(filepath.Base(filepath.Dir(p)), "%d", &pid); err == nil {
				out = append(out, pid)
			}
		}
	}
	return out
}

// unmountUnder detaches every mount at or below dir, deepest first.
func unmountUnder(dir string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var points []string
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := strings.ReplaceAll(f[4], `\040`, " ")
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			points = append(points, mp)
		}
	}
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, mp := range slices.Compact(points) {
		if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("umount %s: %w", mp, err))
		}
	}
	return errors.Join(errs...)
}

// removeCgroups removes kubelet's pod cgroups (cgroupfs driver) in every hierarchy, deepest
// first; containers are gone by now.
func removeCgroups() error {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + cgroupRoot)
	if st, err := os.Stat("/sys/fs/cgroup/" + cgroupRoot); err == nil && st.IsDir() {
		roots = append(roots, "/sys/fs/cgroup/"+cgroupRoot)
	}
	var errs []error
	for _, r := range roots {
		var dirs []string
		_ = filepath.WalkDir(r, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for _, d := range slices.Backward(dirs) {
			if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("rmdir %s: %w", d, err))
			}
		}
	}
	return errors.Join(errs...)
}
