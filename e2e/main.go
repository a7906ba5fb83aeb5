// Command e2e installs leasehold with its Helm chart (deploy/helm/leasehold, which renders the
// objects of deploy/kubernetes) on a single-node Kubernetes made on this machine, and checks
// leasehold's allocations against the pods Kubernetes runs (`make e2e`, docs/e2e.md). It
// needs root, Debian's containerd, runc and busybox-static, openssl, and the binaries of
// `make build tools` (Helm among them); it builds Kubernetes (e2e/tools/go.mod) into -cache
// once.
//
// Everything it starts lives under one temporary directory and is stopped and removed at the
// end, on failure too (-keep keeps the directory and its logs). Host paths the
// DaemonSet uses (/opt/cni/bin, /run/leasehold, /var/lib/leasehold) are removed if the run
// created them.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

type env struct {
	repo, bin, k8sBin, k8sVersion string
	tmp, pki, lhPKI               string
	ctrRoot, ctrState, ctrSock    string
	runcRoot, kubeletRoot         string
	hostIP                        string
	kubeconfig                    string
	ports                         map[string]int
	tools                         map[string]string
	procs                         []*proc
	kubelet, containerd           *proc
	createdHostPaths              []string
	sharedMounts                  []string
	steps                         []stepResult
	verbose                       bool
}

type stepResult struct {
	name string
	dur  time.Duration
	err  error
}

func (e *env) logf(format string, args ...any) {
	if e.verbose {
		fmt.Printf("    "+format+"\n", args...)
	}
}

// step runs one named part of the run and records its outcome; after a failure the rest is
// skipped.
func (e *env) step(name string, f func() error) bool {
	for _, s := range e.steps {
		if s.err != nil {
			return false
		}
	}
	fmt.Printf("=== %s\n", name)
	start := time.Now()
	err := f()
	r := stepResult{name: name, dur: time.Since(start), err: err}
	e.steps = append(e.steps, r)
	if err != nil {
		fmt.Printf("--- FAIL %s (%s)\n%v\n", name, r.dur.Round(100*time.Millisecond), err)
		return false
	}
	fmt.Printf("--- ok   %s (%s)\n", name, r.dur.Round(100*time.Millisecond))
	return true
}

func main() {
	repo := flag.String("repo", "..", "the repository (deploy/, bin/)")
	cache := flag.String("cache", filepath.Join(os.Getenv("HOME"), ".cache", "leasehold-e2e"), "where the Kubernetes binaries are built once")
	keep := flag.Bool("keep", false, "keep the run's directory (configurations, logs) at the end")
	verbose := flag.Bool("v", false, "log each command's detail")
	flag.Parse()

	abs, err := filepath.Abs(*repo)
	if err != nil {
		fatal(err)
	}
	e := &env{repo: abs, bin: filepath.Join(abs, "bin"), ports: map[string]int{}, tools: map[string]string{}, verbose: *verbose}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	total := time.Now()
	if os.Geteuid() != 0 {
		fatal(fmt.Errorf("make e2e needs root (it runs containerd and kubelet)"))
	}
	if e.k8sVersion, err = k8sVersion(abs); err != nil {
		fatal(err)
	}
	e.k8sBin = filepath.Join(*cache, "k8s-"+e.k8sVersion)
	if !e.step("build Kubernetes "+e.k8sVersion+" (cached)", func() error { return buildKubernetes(ctx, abs, e.k8sBin, e.k8sVersion) }) {
		summary(e, total)
	}
	if e.tmp, err = os.MkdirTemp("", "leasehold-e2e-"); err != nil {
		fatal(err)
	}
	fmt.Printf("run directory: %s\n", e.tmp)

	func() {
		defer func() {
			if r := recover(); r != nil {
				e.steps = append(e.steps, stepResult{name: "panic", err: fmt.Errorf("%v", r)})
			}
		}()
		_ = e.step("preflight: programs, ports, host paths", e.preflight) &&
			e.step("certificates and kubeconfigs", e.certificates) &&
			e.step("etcd for Kubernetes; etcd with TLS and RBAC for leasehold (deploy/etcd)", func() error { return e.etcds(ctx) }) &&
			e.step("containerd (private) with the pause and leasehold images", func() error { return e.startContainerd(ctx) }) &&
			e.step("kube-apiserver, kube-controller-manager, kube-scheduler", func() error { return e.controlPlane(ctx) }) &&
			e.step("kubelet; node Ready", func() error { return e.startKubelet(ctx) }) &&
			e.step("install the chart deploy/helm/leasehold (image, cluster, etcd); DaemonSet ready", func() error { return e.deploy(ctx) }) &&
			e.scenario(ctx)
	}()
	if ctx.Err() != nil {
		e.steps = append(e.steps, stepResult{name: "interrupted", err: ctx.Err()})
	}
	if failed(e) {
		e.diagnostics(context.Background())
	}
	cleanCtx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	cstart := time.Now()
	cerr := e.cleanup(cleanCtx)
	cancel()
	e.steps = append(e.steps, stepResult{name: "cleanup (processes, mounts, netns, bridge, cgroups, host paths)", dur: time.Since(cstart), err: cerr})
	if *keep || failed(e) && cerr != nil {
		fmt.Printf("kept %s\n", e.tmp)
	} else if err := os.RemoveAll(e.tmp); err != nil {
		e.steps = append(e.steps, stepResult{name: "remove run directory", err: err})
	}
	summary(e, total)
}

func failed(e *env) bool {
	for _, s := range e.steps {
		if s.err != nil {
			return true
		}
	}
	return false
}

func summary(e *env, start time.Time) {
	fmt.Println("\n==== leasehold e2e summary ====")
	for _, s := range e.steps {
		st := "PASS"
		if s.err != nil {
			st = "FAIL"
		}
		fmt.Printf("%s  %-80s %8s\n", st, s.name, s.dur.Round(100*time.Millisecond))
	}
	if failed(e) {
		fmt.Printf("FAIL (%s)\n", time.Since(start).Round(time.Second))
		os.Exit(1)
	}
	fmt.Printf("PASS (%s)\n", time.Since(start).Round(time.Second))
	os.Exit(0)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "e2e:", err)
	fmt.Println("FAIL")
	os.Exit(1)
}

func (e *env) preflight() error {
	var missing []string
	for _, n := range []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr", "busybox", "openssl", "unshare", "mount", "ip"} {
		p, err := look(n)
		if err != nil {
			missing = append(missing, n)
			continue
		}
		e.tools[n] = p
	}
	for _, b := range []string{"leasehold", "leaseholdd", "leaseholdctl", "etcd", "etcdctl", "helm", "cni/bridge", "cni/loopback"} {
		if _, err := os.Stat(filepath.Join(e.bin, b)); err != nil {
			missing = append(missing, "bin/"+b+" (make build tools)")
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing: %s (apt-get install containerd runc busybox-static openssl)", strings.Join(missing, ", "))
	}
	if out, err := exec.Command("file", "-L", e.tools["busybox"]).Output(); err == nil && strings.Contains(string(out), "dynamically") {
		return fmt.Errorf("%s is dynamically linked: the images need busybox-static", e.tools["busybox"])
	}
	if _, err := os.Stat("/run/leasehold/leaseholdd.sock"); err == nil {
		return fmt.Errorf("/run/leasehold/leaseholdd.sock exists: a leaseholdd runs on this host; the DaemonSet would take its place")
	}
	if _, err := os.Stat("/sys/class/net/" + bridgeName); err == nil {
		return fmt.Errorf("bridge %s exists (a run that was killed?): ip link del %s", bridgeName, bridgeName)
	}
	for _, h := range hostPaths {
		if _, err := os.Stat(h); os.IsNotExist(err) {
			e.createdHostPaths = append(e.createdHostPaths, h)
		}
	}
	// The node's address: kubelet refuses a loopback node IP.
	conn, err := net.Dial("udp", "192.0.2.255:9")
	if err != nil {
		return fmt.Errorf("no route to find this host's address: %w", err)
	}
	e.hostIP = conn.LocalAddr().(*net.UDPAddr).IP.String()
	conn.Close()
	for _, p := range []string{"k8s-etcd", "k8s-etcd-peer", "lh-etcd", "lh-etcd-peer", "apiserver", "kubelet", "kubelet-healthz", "kcm", "scheduler"} {
		if e.ports[p], err = freePort(); err != nil {
			return err
		}
	}
	e.pki = filepath.Join(e.tmp, "pki")
	e.lhPKI = filepath.Join(e.tmp, "leasehold-pki")
	e.ctrRoot, e.ctrState = filepath.Join(e.tmp, "containerd", "root"), filepath.Join(e.tmp, "containerd", "state")
	e.ctrSock, e.runcRoot = filepath.Join(e.tmp, "containerd", "containerd.sock"), filepath.Join(e.tmp, "runc")
	e.kubeletRoot = filepath.Join(e.tmp, "kubelet")
	for _, d := range []string{"logs", "pki", "net.d", "pod-logs", "sysctl", "containerd/root", "containerd/state", "runc", "kubelet"} {
		if err := os.MkdirAll(filepath.Join(e.tmp, d), 0o700); err != nil {
			return err
		}
	}
	e.logf("host address %s, ports %v, host paths to create %v", e.hostIP, e.ports, e.createdHostPaths)
	for _, v := range [][]string{
		{filepath.Join(e.k8sBin, "kubelet"), "--version"}, {e.tools["containerd"], "--version"},
		{e.tools["runc"], "--version"}, {filepath.Join(e.bin, "etcd"), "--version"}, {filepath.Join(e.bin, "leaseholdd"), "--version"},
	} {
		out, _ := exec.Command(v[0], v[1:]...).CombinedOutput()
		fmt.Printf("    %s: %s\n", filepath.Base(v[0]), strings.SplitN(strings.TrimSpace(string(out)), "\n", 2)[0])
	}
	return nil
}

func look(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/bin", "/usr/local/sbin"} {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found", name)
}
