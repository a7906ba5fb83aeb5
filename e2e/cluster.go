package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

const (
	nodeName    = "leasehold-e2e"
	cluster     = "e2e"           // leasehold's cluster ID (ConfigMap CLUSTER)
	network     = "leasehold-e2e" // the CNI network and, by default, the pool
	bridgeName  = "lhe2e0"        // the conflist's bridge
	podSubnet   = "10.233.0.0/24" // the pool's range
	pauseRef    = "leasehold.test/pause:1"
	imageRef    = "leasehold.test/leasehold:e2e"
	hostCNIBin  = "/opt/cni/bin" // the DaemonSet's cni-bin hostPath, as shipped
	cgroupRoot  = "kubepods"     // kubelet's pod cgroups (cgroupfs driver) under each hierarchy
	containerNS = "k8s.io"
)

// hostPaths are the host directories the shipped DaemonSet (and the runtime) use; the run
// removes those it created.
var hostPaths = []string{"/opt/cni", hostCNIBin, "/run/leasehold", "/var/lib/leasehold", "/run/containerd", "/run/containerd/s"}

// etcd starts an etcd of bin/etcd; extra flags (TLS) are appended.
func (e *env) etcd(name string, client, peer int, extra ...string) (*proc, error) {
	scheme := "http"
	if len(extra) > 0 {
		scheme = "https"
	}
	url := fmt.Sprintf("%s://127.0.0.1:%d", scheme, client)
	args := append([]string{"--name", name, "--data-dir", filepath.Join(e.tmp, name),
		"--listen-client-urls", url, "--advertise-client-urls", url,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peer),
		"--initial-cluster", fmt.Sprintf("%s=http://127.0.0.1:%d", name, peer),
		"--listen-metrics-urls", "", "--log-level", "warn"}, extra...)
	return e.start(name, nil, filepath.Join(e.bin, "etcd"), args...)
}

// containerdConfig is the private containerd: its own root, state, socket and runc root
// under the run's directory. The CNI bin dir is the host's /opt/cni/bin, where the
// DaemonSet's init container installs the plugin; network namespaces are under
// /var/run/netns, the path the DaemonSet mounts (as on any node).
func (e *env) containerdConfig() string {
	q := func(s string) string { b, _ := json.Marshal(s); return string(b) }
	return fmt.Sprintf(`version = 2
root = %s
state = %s
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %s

[plugins."io.containerd.runtime.v1.linux"]
  runtime_root = %s

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %s
  # This machine withholds CAP_SYS_RESOURCE: never ask for a lower oom_score_adj.
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %s
    conf_dir = %s
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = %s
        Root = %s
        SystemdCgroup = false
`, q(e.ctrRoot), q(e.ctrState), q(e.ctrSock), q(filepath.Join(e.runcRoot, "v1")), q(pauseRef),
		q(hostCNIBin), q(filepath.Join(e.tmp, "net.d")), q(e.tools["runc"]), q(e.runcRoot))
}

// conflist: the bridge plugin with leasehold as its IPAM, as a cluster's CNI configuration
// would have it.
func conflist() string {
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": %q,
  "plugins": [{
    "type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false,
    "ipam": {
      "type": "leasehold",
      "ranges": [[{"subnet": %q, "rangeStart": "10.233.0.10", "gateway": "10.233.0.1"}]],
      "routes": [{"dst": "0.0.0.0/0"}]
    }
  }]
}
`, network, bridgeName, podSubnet)
}

func (e *env) kubeletConfig() string {
	p := func(s string) string { return filepath.Join(e.pki, s) }
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupsPerQOS: true
containerRuntimeEndpoint: unix://%s
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
tlsCertFile: %s
tlsPrivateKeyFile: %s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization: {mode: Webhook}
failSwapOn: false
podLogsDirectory: %s
resolvConf: /etc/resolv.conf
serializeImagePulls: false
evictionHard: {memory.available: "100Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 10s
`, e.ctrSock, e.hostIP, e.ports["kubelet"], e.ports["kubelet-healthz"], p("kubelet-serving.crt"), p("kubelet-serving.key"),
		p("ca.crt"), filepath.Join(e.tmp, "pod-logs"))
}

// kubeletScript runs kubelet in a mount namespace of its own in which the kernel settings it
// would otherwise rewrite on the host (vm.overcommit_memory=1, kernel.panic=10,
// kernel.panic_on_oops=1: protectKernelDefaults=false) already read as it wants them. Mounts
// it makes under its root directory (secret volumes) reach the host, and so containerd, because
// that directory is a shared mount.
const kubeletScript = `set -eu
for kv in vm/overcommit_memory=1 kernel/panic=10 kernel/panic_on_oops=1 vm/panic_on_oom=0; do
  f=${kv%%=*}; v=${kv#*=}
  if [ "$(cat /proc/sys/$f)" != "$v" ]; then
    fake="$SYSCTL_DIR/$(echo "$f" | tr / _)"
    echo "$v" > "$fake"
    mount --bind "$fake" "/proc/sys/$f"
  fi
done
exec "$@"
`

// sharedMount makes dir a mount of its own with shared propagation.
func sharedMount(dir string) error {
	if err := syscall.Mount(dir, dir, "", syscall.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", dir, err)
	}
	if err := syscall.Mount("", dir, "", syscall.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make-shared %s: %w", dir, err)
	}
	return nil
}

// buildKubernetes builds the Kubernetes programs of tools/go.mod into dir unless all are there.
func buildKubernetes(ctx context.Context, repo, dir, version string) error {
	missing := false
	for _, b := range k8sProgs {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			missing = true
		}
	}
	if !missing {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	minor := strings.Split(strings.TrimPrefix(version, "v"), ".")
	ld := fmt.Sprintf("-s -w -X k8s.io/component-base/version.gitVersion=%[1]s -X k8s.io/component-base/version.gitMajor=%[2]s "+
		"-X k8s.io/component-base/version.gitMinor=%[3]s -X k8s.io/client-go/pkg/version.gitVersion=%[1]s "+
		"-X k8s.io/component-base/version.gitTreeState=clean", version, minor[0], minor[1])
	args := []string{"-n", "19", "go", "build", "-trimpath", "-ldflags", ld, "-o", dir + "/"}
	for _, b := range k8sProgs {
		args = append(args, "k8s.io/kubernetes/cmd/"+b)
	}
	fmt.Printf("building Kubernetes %s into %s (niced; about 15 minutes the first time)\n", version, dir)
	cmd := exec.CommandContext(ctx, "nice", args...)
	cmd.Dir = filepath.Join(repo, "e2e", "tools")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	start := time.Now()
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("building Kubernetes: %w", err)
	}
	fmt.Printf("built Kubernetes in %s\n", time.Since(start).Round(time.Second))
	return nil
}

var k8sProgs = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl"}

// k8sVersion is the k8s.io/kubernetes version tools/go.mod requires.
func k8sVersion(repo string) (string, error) {
	b, err := os.ReadFile(filepath.Join(repo, "e2e", "tools", "go.mod"))
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 && f[0] == "require" && f[1] == "k8s.io/kubernetes" {
			return f[2], nil
		}
	}
	return "", fmt.Errorf("e2e/tools/go.mod requires no k8s.io/kubernetes")
}
