package integration

// containerd's CRI as the runtime in front of leasehold: kubelet's path to a CNI plugin.
// The test runs a containerd of its own (own config, root, state directory, socket, runc
// root and cgroup parent; the network namespaces it makes live under its state directory),
// with a sandbox image made here from busybox-static (no registry is reachable), and drives
// it with k8s.io/cri-api's v1 RuntimeService. Every helper of this file starts with cri.

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
)

// criImage is the sandbox ("pause") image the test makes and imports; criNamespace is the
// namespace of every pod it creates.
const (
	criImage     = "leasehold.test/pause:1"
	criNamespace = "leasehold-cri"
)

// criBins are the programs the CRI test runs: Debian's containerd (which ships ctr and the
// runc v2 shim), runc, and busybox-static for the sandbox image.
type criBins struct {
	containerd, shim, runc, ctr, busybox string
}

// criLook finds a program on PATH or in the system directories PATH may lack (runc is in
// /usr/sbin).
func criLook(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/bin", "/usr/local/sbin"} {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found on PATH or in the system directories", name)
}

// criStatic reports whether the ELF file at path is statically linked (no interpreter): the
// sandbox image holds this one file and no libc.
func criStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked; the sandbox image needs busybox-static's", path)
		}
	}
	return nil
}

// requireCRI skips the test without root (a failure in CI, which runs as root) and without
// containerd, runc or busybox-static, which .ci/run installs: in CI their absence fails it.
func requireCRI(t *testing.T) criBins {
	t.Helper()
	requireNetns(t)
	var b criBins
	var missing []string
	for _, p := range []struct {
		dst  *string
		name string
	}{{&b.containerd, "containerd"}, {&b.shim, "containerd-shim-runc-v2"}, {&b.runc, "runc"}, {&b.ctr, "ctr"}, {&b.busybox, "busybox"}} {
		path, err := criLook(p.name)
		if err != nil {
			missing = append(missing, err.Error())
			continue
		}
		*p.dst = path
	}
	if b.busybox != "" {
		if err := criStatic(b.busybox); err != nil {
			missing = append(missing, err.Error())
		}
	}
	if len(missing) > 0 {
		msg := "the CRI test needs Debian's containerd, runc and busybox-static " +
			"(apt-get install containerd runc busybox-static): " + strings.Join(missing, "; ")
		cannotRun(t, "%s", msg)
	}
	return b
}

// criRuntime is a containerd process of the test's own with the CRI plugin.
type criRuntime struct {
	t    *testing.T
	bins criBins
	// Dir holds everything: Config, Root, State, Sock, the runc root and the CNI
	// configuration directory.
	Dir, Config, Root, State, Sock, RuncRoot string
	// CgroupParent is the cgroup every sandbox is created under.
	CgroupParent string
	// Bridge is the host bridge the conflist's bridge plugin makes; Network is the
	// conflist's name.
	Bridge, Network string

	// madeDirs are system directories the shims create that did not exist before, deepest
	// first: removed at cleanup when empty.
	madeDirs []string

	logs *syncbuf.Buffer
	cmd  *exec.Cmd
	done chan struct{}
	conn *grpc.ClientConn
	// RS and IS are CRI clients of the current containerd process.
	RS criapi.RuntimeServiceClient
	IS criapi.ImageServiceClient
}

// startCRI writes containerd's configuration and conflist, starts containerd, imports the
// sandbox image and waits until the CRI plugin sees it. Cleanup (registered here, so it
// runs before the fixture's agent and etcd are stopped) removes every sandbox through the
// CRI, stops containerd, then clears whatever a failure left behind: runc containers,
// shims, mounts under Dir, the bridge, the cgroup parent and the CNI result cache.
func startCRI(t *testing.T, bins criBins, cniBinDir, network, bridge string, conflist []byte) *criRuntime {
	t.Helper()
	dir := t.TempDir()
	c := &criRuntime{t: t, bins: bins, Dir: dir,
		Config: filepath.Join(dir, "config.toml"), Root: filepath.Join(dir, "root"), State: filepath.Join(dir, "state"),
		Sock: filepath.Join(dir, "containerd.sock"), RuncRoot: filepath.Join(dir, "runc"),
		CgroupParent: "/" + ccUniq("leasehold-cri-"), Bridge: bridge, Network: network,
		logs: &syncbuf.Buffer{}}
	confDir := filepath.Join(dir, "net.d")
	for _, d := range []string{c.Root, c.State, c.RuncRoot, confDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(confDir, "10-leasehold.conflist"), conflist, 0o600); err != nil {
		t.Fatal(err)
	}
	q := func(s string) string { b, _ := json.Marshal(s); return string(b) } // TOML basic strings accept JSON's escapes
	cfg := fmt.Sprintf(`version = 2
root = %s
state = %s
# Plugins that would reach outside Dir (or need what this machine has not) are off.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %s

# Unused (the CRI runs the v2 shim) but required by the tasks service: kept inside Dir.
[plugins."io.containerd.runtime.v1.linux"]
  runtime_root = %s

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %s
  # This machine withholds CAP_SYS_RESOURCE: never ask for a lower oom_score_adj.
  restrict_oom_score_adj = true
  # Network namespaces under the state directory, not /var/run/netns.
  netns_mounts_under_state_dir = true
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
`, q(c.Root), q(c.State), q(c.Sock), q(filepath.Join(c.RuncRoot, "v1")), q(criImage), q(cniBinDir), q(confDir), q(bins.runc), q(c.RuncRoot))
	if err := os.WriteFile(c.Config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	// The shims put their sockets in /run/containerd/s whatever the configuration says:
	// what this test made there is removed at cleanup.
	for _, d := range []string{"/run/containerd", "/run/containerd/s"} {
		if _, err := os.Stat(d); errors.Is(err, fs.ErrNotExist) {
			c.madeDirs = append([]string{d}, c.madeDirs...)
		}
	}
	t.Cleanup(c.cleanup)
	c.start(t)

	img := filepath.Join(dir, "pause.tar")
	criWritePauseImage(t, img, criImage, bins.busybox)
	ctx, cancel := testCtx(t)
	defer cancel()
	if out, err := exec.CommandContext(ctx, bins.ctr, "-a", c.Sock, "-n", "k8s.io", "images", "import", img).CombinedOutput(); err != nil {
		t.Fatalf("ctr images import: %v\n%s", err, out)
	}
	eventually(t, "the CRI plugin sees the imported sandbox image", func() error {
		rctx, rcancel := context.WithTimeout(ctx, etcdtest.Patience)
		defer rcancel()
		r, err := c.IS.ImageStatus(rctx, &criapi.ImageStatusRequest{Image: &criapi.ImageSpec{Image: criImage}})
		return saw(err == nil && r.Image != nil, "ImageStatus %v, %v", r, err)
	})
	return c
}

// start runs containerd and waits until its CRI service answers.
func (c *criRuntime) start(t testing.TB) {
	t.Helper()
	c.cmd = exec.Command(c.bins.containerd, "--config", c.Config, "--log-level", "info")
	// The shim and runc come from the same directories as the binaries found.
	path := strings.Join([]string{filepath.Dir(c.bins.shim), filepath.Dir(c.bins.runc), os.Getenv("PATH")}, ":")
	c.cmd.Env = append(os.Environ(), "PATH="+path)
	c.cmd.Stdout, c.cmd.Stderr = c.logs, c.logs
	if err := c.cmd.Start(); err != nil {
		t.Fatalf("start containerd: %v", err)
	}
	c.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(c.cmd, c.done)
	conn, err := grpc.NewClient("unix://"+c.Sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c.conn, c.RS, c.IS = conn, criapi.NewRuntimeServiceClient(conn), criapi.NewImageServiceClient(conn)
	exited := false
	eventually(t, "containerd's CRI service answers at "+c.Sock, func() error {
		select {
		case <-c.done:
			exited = true
			return nil
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second) // one try of many
		defer cancel()
		_, err := c.RS.Version(ctx, &criapi.VersionRequest{})
		return err
	})
	if exited {
		t.Fatalf("containerd exited before serving the CRI:\n%s", c.logs.String())
	}
}

// running reports whether the current containerd process is alive.
func (c *criRuntime) running() bool {
	if c.cmd == nil {
		return false
	}
	select {
	case <-c.done:
		return false
	default:
		return true
	}
}

// kill stops containerd with SIGKILL, as a crash does: its shims and sandboxes live on.
func (c *criRuntime) kill() {
	if c.cmd == nil {
		return
	}
	_ = c.cmd.Process.Kill()
	<-c.done
	c.closeConn()
}

// stop stops containerd with SIGTERM (SIGKILL after etcdtest.Patience).
func (c *criRuntime) stop() {
	if c.cmd == nil {
		return
	}
	_ = c.cmd.Process.Signal(unix.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(etcdtest.Patience):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
	c.closeConn()
}

func (c *criRuntime) closeConn() {
	if c.conn != nil {
		c.conn.Close()
		c.conn = nil
	}
	c.cmd = nil
}

// criPod is a pod sandbox the test created: its CRI id, the metadata it named and the
// address PodSandboxStatus reported.
type criPod struct {
	ID, Name, UID string
	IP            netip.Addr
}

// runPod creates a pod sandbox through the CRI and returns it with the address its status
// reports.
func (c *criRuntime) runPod(ctx context.Context, name, uid string) (criPod, error) {
	ctx, cancel := context.WithTimeout(ctx, etcdtest.Patience)
	defer cancel()
	cfg := &criapi.PodSandboxConfig{
		Metadata: &criapi.PodSandboxMetadata{Name: name, Uid: uid, Namespace: criNamespace},
		Hostname: name,
		Linux: &criapi.LinuxPodSandboxConfig{CgroupParent: c.CgroupParent,
			SecurityContext: &criapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &criapi.NamespaceOption{Network: criapi.NamespaceMode_POD}}},
	}
	r, err := c.RS.RunPodSandbox(ctx, &criapi.RunPodSandboxRequest{Config: cfg})
	if err != nil {
		return criPod{}, fmt.Errorf("RunPodSandbox %s (uid %s): %w", name, uid, err)
	}
	p := criPod{ID: r.PodSandboxId, Name: name, UID: uid}
	p.IP, err = c.podIP(ctx, p.ID)
	if err != nil {
		return p, err
	}
	return p, nil
}

// podIP is the address PodSandboxStatus reports for the sandbox.
func (c *criRuntime) podIP(ctx context.Context, id string) (netip.Addr, error) {
	ctx, cancel := context.WithTimeout(ctx, etcdtest.Patience)
	defer cancel()
	st, err := c.RS.PodSandboxStatus(ctx, &criapi.PodSandboxStatusRequest{PodSandboxId: id})
	if err != nil {
		return netip.Addr{}, fmt.Errorf("PodSandboxStatus %s: %w", id, err)
	}
	if st.Status.GetNetwork().GetIp() == "" {
		return netip.Addr{}, fmt.Errorf("PodSandboxStatus %s: no network address (state %s)", id, st.Status.GetState())
	}
	ip, err := netip.ParseAddr(st.Status.GetNetwork().GetIp())
	if err != nil {
		return netip.Addr{}, fmt.Errorf("PodSandboxStatus %s: address %q: %w", id, st.Status.GetNetwork().GetIp(), err)
	}
	return ip, nil
}

// runPods creates n pod sandboxes at once, named prefix-NN with UIDs of their own, and
// returns them in order; any failure fails the test.
func (c *criRuntime) runPods(t testing.TB, ctx context.Context, prefix string, n int) []criPod {
	t.Helper()
	pods := make([]criPod, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			name := fmt.Sprintf("%s-%02d", prefix, i)
			pods[i], errs[i] = c.runPod(ctx, name, criUID(name))
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("creating %d sandboxes at once:\n%v", n, err)
	}
	return pods
}

// criUID makes a pod UID in the shape kubelet's have, distinct for each name in this run.
func criUID(name string) string {
	s := sha256.Sum256([]byte(fmt.Sprintf("%s/%d/%d", name, os.Getpid(), time.Now().UnixNano())))
	h := hex.EncodeToString(s[:16])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// stopPod and removePod are StopPodSandbox and RemovePodSandbox.
func (c *criRuntime) stopPod(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(ctx, etcdtest.Patience)
	defer cancel()
	_, err := c.RS.StopPodSandbox(ctx, &criapi.StopPodSandboxRequest{PodSandboxId: id})
	return err
}

func (c *criRuntime) removePod(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(ctx, etcdtest.Patience)
	defer cancel()
	_, err := c.RS.RemovePodSandbox(ctx, &criapi.RemovePodSandboxRequest{PodSandboxId: id})
	return err
}

// sandboxes returns the state of every sandbox containerd knows, by id.
func (c *criRuntime) sandboxes(ctx context.Context) (map[string]criapi.PodSandboxState, error) {
	ctx, cancel := context.WithTimeout(ctx, etcdtest.Patience)
	defer cancel()
	r, err := c.RS.ListPodSandbox(ctx, &criapi.ListPodSandboxRequest{})
	if err != nil {
		return nil, err
	}
	out := map[string]criapi.PodSandboxState{}
	for _, s := range r.Items {
		out[s.Id] = s.State
	}
	return out, nil
}

// cleanup takes everything down; what it had to clear by force is reported as an error.
func (c *criRuntime) cleanup() {
	t := c.t
	if c.running() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*etcdtest.Patience)
		if ids, err := c.sandboxes(ctx); err != nil {
			t.Errorf("cleanup: ListPodSandbox: %v", err)
		} else {
			var wg sync.WaitGroup
			sem := make(chan struct{}, 4)
			for id := range ids {
				wg.Go(func() {
					sem <- struct{}{}
					defer func() { <-sem }()
					if err := c.stopPod(ctx, id); err != nil {
						t.Errorf("cleanup: StopPodSandbox %s: %v", id, err)
						return
					}
					if err := c.removePod(ctx, id); err != nil {
						t.Errorf("cleanup: RemovePodSandbox %s: %v", id, err)
					}
				})
			}
			wg.Wait()
		}
		cancel()
		c.stop()
	} else {
		c.kill()
	}
	// runc containers left by a failure (containerd could not stop them), then their shims.
	runcRoot := filepath.Join(c.RuncRoot, "k8s.io")
	if out, err := exec.Command(c.bins.runc, "--root", runcRoot, "list", "-q").Output(); err == nil {
		for _, id := range strings.Fields(string(out)) {
			t.Errorf("cleanup: runc container %s was left behind; deleting it", id)
			if out, err := exec.Command(c.bins.runc, "--root", runcRoot, "delete", "--force", id).CombinedOutput(); err != nil {
				t.Errorf("cleanup: runc delete --force %s: %v\n%s", id, err, out)
			}
		}
	}
	// A shim exits once its sandbox is deleted; one still running after etcdtest.Patience is killed.
	shims := criShims(c.Sock)
	for deadline := time.Now().Add(etcdtest.Patience); len(shims) > 0 && time.Now().Before(deadline); shims = criShims(c.Sock) {
		time.Sleep(50 * time.Millisecond)
	}
	for _, pid := range shims {
		t.Errorf("cleanup: shim %d outlived its sandboxes; killing it", pid)
		_ = unix.Kill(pid, unix.SIGKILL)
	}
	// Mounts under Dir: the sandboxes' rootfs and shm, the network namespaces.
	if left := criUnmountUnder(t, c.Dir); len(left) > 0 {
		t.Errorf("cleanup: containerd left %d mounts under its directory: %v", len(left), left)
	}
	if _, err := os.Stat("/sys/class/net/" + c.Bridge); err == nil {
		if out, err := exec.Command("ip", "link", "del", c.Bridge).CombinedOutput(); err != nil {
			t.Errorf("cleanup: ip link del %s: %v\n%s", c.Bridge, err, out)
		}
	}
	cgs, _ := filepath.Glob("/sys/fs/cgroup/*" + c.CgroupParent)
	if d := "/sys/fs/cgroup" + c.CgroupParent; slices.Index(cgs, d) < 0 {
		cgs = append(cgs, d)
	}
	for _, d := range cgs {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("cleanup: removing cgroup %s: %v", d, err)
		}
	}
	// containerd's CNI library caches results in the system's cache directory; the network
	// name is this test's own.
	stale, _ := filepath.Glob(filepath.Join("/var/lib/cni/results", c.Network+"-*"))
	for _, f := range stale {
		t.Errorf("cleanup: a CNI result cache entry was left behind: %s", f)
		_ = os.Remove(f)
	}
	for _, d := range c.madeDirs {
		_ = os.Remove(d) // only when empty
	}
	if t.Failed() {
		t.Logf("containerd output:\n%s", c.logs.String())
	}
}

// criShims returns the pids of the runc v2 shims serving the containerd at sock.
func criShims(sock string) []int {
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

// criUnmountUnder detaches every mount at or below dir, deepest first, and returns the
// mount points it found.
func criUnmountUnder(t testing.TB, dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Errorf("cleanup: %v", err)
		return nil
	}
	var points []string
	for line := range strings.Lines(string(b)) {
		fields := strings.Fields(line)
		if len(fields) < 5 {
			continue
		}
		mp := criUnescape(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			points = append(points, mp)
		}
	}
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	for _, mp := range slices.Compact(points) {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			t.Errorf("cleanup: umount %s: %v", mp, err)
		}
	}
	return points
}

// criUnescape undoes mountinfo's octal escapes (\040 for a space).
func criUnescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// criWritePauseImage writes a docker-archive image tar (what `docker save` writes and `ctr
// images import` reads) tagged ref: one layer holding busybox at /bin/busybox, whose
// entrypoint sleeps forever as the pause container does.
func criWritePauseImage(t testing.TB, path, ref, busybox string) {
	t.Helper()
	bb, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	epoch := time.Unix(0, 0).UTC()
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	for _, h := range []*tar.Header{
		{Typeflag: tar.TypeDir, Name: "bin/", Mode: 0o755, ModTime: epoch},
		{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755, Size: int64(len(bb)), ModTime: epoch},
	} {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tw.Write(bb); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	layerSum := sha256.Sum256(layer.Bytes())
	layerHex := hex.EncodeToString(layerSum[:])
	config, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH, "os": "linux", "created": epoch.Format(time.RFC3339),
		"config": map[string]any{"Entrypoint": []string{"/bin/busybox", "sleep", "infinity"}, "WorkingDir": "/"},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + layerHex}},
	})
	if err != nil {
		t.Fatal(err)
	}
	configSum := sha256.Sum256(config)
	configName := hex.EncodeToString(configSum[:]) + ".json"
	layerName := layerHex + "/layer.tar"
	manifest, err := json.Marshal([]map[string]any{{"Config": configName, "RepoTags": []string{ref}, "Layers": []string{layerName}}})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	ow := tar.NewWriter(&out)
	for _, e := range []struct {
		name string
		data []byte
	}{{configName, config}, {layerName, layer.Bytes()}, {"manifest.json", manifest}} {
		if dir := filepath.Dir(e.name); dir != "." {
			if err := ow.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir + "/", Mode: 0o755, ModTime: epoch}); err != nil {
				t.Fatal(err)
			}
		}
		if err := ow.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: epoch}); err != nil {
			t.Fatal(err)
		}
		if _, err := ow.Write(e.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := ow.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, out.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}
