package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"
)

func (e *env) certificates() error {
	c, err := newCA(e.pki)
	if err != nil {
		return err
	}
	for _, x := range []struct {
		name, cn string
		orgs     []string
		hosts    []string
	}{
		{"apiserver", "kube-apiserver", nil, []string{"127.0.0.1", e.hostIP, "10.96.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"}},
		{"admin", "e2e-admin", []string{"system:masters"}, nil},
		{"apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil},
		{"controller-manager", "system:kube-controller-manager", nil, nil},
		{"scheduler", "system:kube-scheduler", nil, nil},
		{"kubelet", "system:node:" + nodeName, []string{"system:nodes"}, nil},
		{"kubelet-serving", nodeName, nil, []string{e.hostIP, "127.0.0.1", nodeName}},
	} {
		if err := c.issue(x.name, x.cn, x.orgs, x.hosts...); err != nil {
			return err
		}
	}
	if err := serviceAccountKey(e.pki); err != nil {
		return err
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", e.ports["apiserver"])
	for _, n := range []string{"admin", "controller-manager", "scheduler", "kubelet"} {
		if err := kubeconfig(filepath.Join(e.pki, n+".kubeconfig"), server, e.pki, n); err != nil {
			return err
		}
	}
	e.kubeconfig = filepath.Join(e.pki, "admin.kubeconfig")
	// leasehold's etcd: the README's way, deploy/etcd/certs.sh.
	_, err = e.run(context.Background(), nil, filepath.Join(e.repo, "deploy", "etcd", "certs.sh"), e.lhPKI, cluster)
	return err
}

// etcdctlEnv connects etcdctl, leaseholdctl and etcd-rbac.sh to leasehold's etcd as root.
func (e *env) etcdctlEnv() []string {
	return []string{
		fmt.Sprintf("ETCDCTL_ENDPOINTS=https://127.0.0.1:%d", e.ports["lh-etcd"]),
		"ETCDCTL_CACERT=" + filepath.Join(e.lhPKI, "ca.crt"),
		"ETCDCTL_CERT=" + filepath.Join(e.lhPKI, "clients", "root.crt"),
		"ETCDCTL_KEY=" + filepath.Join(e.lhPKI, "clients", "root.key"),
		"ETCDCTL=" + filepath.Join(e.bin, "etcdctl"),
		"PATH=" + e.bin + ":" + os.Getenv("PATH"),
	}
}

func (e *env) etcds(ctx context.Context) error {
	if _, err := e.etcd("k8s-etcd", e.ports["k8s-etcd"], e.ports["k8s-etcd-peer"]); err != nil {
		return err
	}
	if _, err := e.etcd("leasehold-etcd", e.ports["lh-etcd"], e.ports["lh-etcd-peer"],
		"--cert-file", filepath.Join(e.lhPKI, "server.crt"), "--key-file", filepath.Join(e.lhPKI, "server.key"),
		"--trusted-ca-file", filepath.Join(e.lhPKI, "ca.crt"), "--client-cert-auth"); err != nil {
		return err
	}
	etcdctl := filepath.Join(e.bin, "etcdctl")
	if err := poll(ctx, 30*time.Second, "Kubernetes' etcd answers", func() (bool, string, error) {
		_, err := e.run(ctx, nil, etcdctl, "--endpoints", fmt.Sprintf("http://127.0.0.1:%d", e.ports["k8s-etcd"]), "endpoint", "health")
		return err == nil, fmt.Sprint(err), nil
	}); err != nil {
		return err
	}
	if err := poll(ctx, 30*time.Second, "leasehold's etcd answers", func() (bool, string, error) {
		_, err := e.run(ctx, e.etcdctlEnv(), etcdctl, "endpoint", "health")
		return err == nil, fmt.Sprint(err), nil
	}); err != nil {
		return err
	}
	// One etcd user and role for the cluster, limited to its prefixes; authentication on.
	out, err := e.run(ctx, e.etcdctlEnv(), filepath.Join(e.repo, "deploy", "etcd", "etcd-rbac.sh"), "--enable-auth", cluster)
	e.logf("etcd-rbac.sh: %s", out)
	return err
}

func (e *env) startContainerd(ctx context.Context) error {
	// The CNI plugins the conflist names besides leasehold (which the DaemonSet installs),
	// and the loopback plugin containerd itself needs.
	if err := os.MkdirAll(hostCNIBin, 0o755); err != nil {
		return err
	}
	for _, p := range []string{"bridge", "loopback"} {
		b, err := os.ReadFile(filepath.Join(e.bin, "cni", p))
		if err != nil {
			return err
		}
		dst := filepath.Join(hostCNIBin, p)
		if _, err := os.Stat(dst); err == nil {
			continue // the host's own
		}
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			return err
		}
		e.createdHostPaths = append(e.createdHostPaths, dst)
	}
	if err := os.WriteFile(filepath.Join(e.tmp, "net.d", "10-leasehold-e2e.conflist"), []byte(conflist()), 0o644); err != nil {
		return err
	}
	cfg := filepath.Join(e.tmp, "containerd", "config.toml")
	if err := os.WriteFile(cfg, []byte(e.containerdConfig()), 0o600); err != nil {
		return err
	}
	path := strings.Join([]string{filepath.Dir(e.tools["containerd-shim-runc-v2"]), filepath.Dir(e.tools["runc"]), os.Getenv("PATH")}, ":")
	p, err := e.start("containerd", []string{"PATH=" + path}, e.tools["containerd"], "--config", cfg, "--log-level", "info")
	if err != nil {
		return err
	}
	e.containerd = p
	ctr := func(args ...string) (string, error) {
		return e.run(ctx, nil, e.tools["ctr"], append([]string{"-a", e.ctrSock, "-n", containerNS}, args...)...)
	}
	if err := poll(ctx, 30*time.Second, "containerd answers", func() (bool, string, error) {
		if p.exited() {
			return false, "", fmt.Errorf("containerd exited:\n%s", tail(p.log, 30))
		}
		_, err := ctr("version")
		return err == nil, fmt.Sprint(err), nil
	}); err != nil {
		return err
	}
	pause := filepath.Join(e.tmp, "pause.tar")
	if err := pauseImage(pause, e.tools["busybox"], pauseRef); err != nil {
		return err
	}
	img := filepath.Join(e.tmp, "leasehold-image.tar")
	if err := leaseholdImage(img, e.bin, e.tools["busybox"], imageRef); err != nil {
		return err
	}
	for _, f := range []string{pause, img} {
		if _, err := ctr("images", "import", f); err != nil {
			return err
		}
	}
	out, err := ctr("images", "ls", "-q")
	e.logf("images: %s", out)
	return err
}

func (e *env) controlPlane(ctx context.Context) error {
	p := func(s string) string { return filepath.Join(e.pki, s) }
	k8s := func(s string) string { return filepath.Join(e.k8sBin, s) }
	api, err := e.start("kube-apiserver", nil, k8s("kube-apiserver"),
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", e.ports["k8s-etcd"]),
		"--bind-address=127.0.0.1", "--advertise-address="+e.hostIP,
		fmt.Sprintf("--secure-port=%d", e.ports["apiserver"]),
		"--cert-dir="+filepath.Join(e.tmp, "apiserver"),
		"--tls-cert-file="+p("apiserver.crt"), "--tls-private-key-file="+p("apiserver.key"),
		"--client-ca-file="+p("ca.crt"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+p("sa.pub"), "--service-account-signing-key-file="+p("sa.key"),
		"--service-cluster-ip-range=10.96.0.0/16",
		"--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
		"--kubelet-client-certificate="+p("apiserver-kubelet-client.crt"), "--kubelet-client-key="+p("apiserver-kubelet-client.key"),
		"--kubelet-certificate-authority="+p("ca.crt"), "--kubelet-preferred-address-types=InternalIP",
		"--profiling=false", "--v=1")
	if err != nil {
		return err
	}
	if err := poll(ctx, 90*time.Second, "kube-apiserver /readyz", func() (bool, string, error) {
		if api.exited() {
			return false, "", fmt.Errorf("kube-apiserver exited:\n%s", tail(api.log, 40))
		}
		out, err := e.kubectl(ctx, "get", "--raw", "/readyz")
		return err == nil && strings.TrimSpace(out) == "ok", fmt.Sprint(out, err), nil
	}); err != nil {
		return err
	}
	if _, err := e.start("kube-controller-manager", nil, k8s("kube-controller-manager"),
		"--kubeconfig="+p("controller-manager.kubeconfig"),
		"--authentication-kubeconfig="+p("controller-manager.kubeconfig"), "--authorization-kubeconfig="+p("controller-manager.kubeconfig"),
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", e.ports["kcm"]),
		"--leader-elect=false", "--use-service-account-credentials=true",
		"--service-account-private-key-file="+p("sa.key"), "--root-ca-file="+p("ca.crt"),
		"--cert-dir="+filepath.Join(e.tmp, "kcm"), "--v=1"); err != nil {
		return err
	}
	if _, err := e.start("kube-scheduler", nil, k8s("kube-scheduler"),
		"--kubeconfig="+p("scheduler.kubeconfig"),
		"--authentication-kubeconfig="+p("scheduler.kubeconfig"), "--authorization-kubeconfig="+p("scheduler.kubeconfig"),
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", e.ports["scheduler"]),
		"--leader-elect=false", "--cert-dir="+filepath.Join(e.tmp, "scheduler"), "--v=1"); err != nil {
		return err
	}
	// The default ServiceAccount shows the controller-manager works.
	return poll(ctx, 60*time.Second, "the controller-manager made the default ServiceAccount", func() (bool, string, error) {
		_, err := e.kubectl(ctx, "get", "serviceaccount", "default", "-n", "default")
		return err == nil, fmt.Sprint(err), nil
	})
}

func (e *env) startKubelet(ctx context.Context) error {
	cfg := filepath.Join(e.tmp, "kubelet-config.yaml")
	if err := os.WriteFile(cfg, []byte(e.kubeletConfig()), 0o600); err != nil {
		return err
	}
	if err := sharedMount(e.kubeletRoot); err != nil {
		return err
	}
	e.sharedMounts = append(e.sharedMounts, e.kubeletRoot)
	k, err := e.start("kubelet", []string{"SYSCTL_DIR=" + filepath.Join(e.tmp, "sysctl")},
		e.tools["unshare"], "--mount", "--propagation", "unchanged", "--", "/bin/sh", "-c", kubeletScript, "kubelet",
		filepath.Join(e.k8sBin, "kubelet"),
		"--config="+cfg, "--kubeconfig="+filepath.Join(e.pki, "kubelet.kubeconfig"),
		"--hostname-override="+nodeName, "--node-ip="+e.hostIP, "--root-dir="+e.kubeletRoot, "--v=1")
	if err != nil {
		return err
	}
	e.kubelet = k
	return poll(ctx, 120*time.Second, "node "+nodeName+" Ready", func() (bool, string, error) {
		if k.exited() {
			return false, "", fmt.Errorf("kubelet exited:\n%s", tail(k.log, 40))
		}
		out, err := e.kubectl(ctx, "get", "node", nodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		return err == nil && out == "True", fmt.Sprintf("Ready=%q %v", out, err), nil
	})
}

func (e *env) kubectl(ctx context.Context, args ...string) (string, error) {
	return e.run(ctx, []string{"KUBECONFIG=" + e.kubeconfig}, filepath.Join(e.k8sBin, "kubectl"), args...)
}

// kubectlIn is kubectl with the given standard input.
func (e *env) kubectlIn(ctx context.Context, stdin string, args ...string) (string, error) {
	f := filepath.Join(e.tmp, "stdin.yaml")
	if err := os.WriteFile(f, []byte(stdin), 0o600); err != nil {
		return "", err
	}
	return e.kubectl(ctx, append(args, "-f", f)...)
}

// httpOK is for the agent's own endpoints on the host's loopback.
func httpOK(url string) bool {
	c := http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{}}}
	r, err := c.Get(url)
	if err != nil {
		return false
	}
	r.Body.Close()
	return r.StatusCode == 200
}
