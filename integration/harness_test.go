package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/etcdserver"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
)

// binDir is where make put the binaries under test and the tools.
func binDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("LEASEHOLD_BIN")
	if dir == "" {
		abs, err := filepath.Abs("../bin")
		if err != nil {
			t.Fatal(err)
		}
		dir = abs
	}
	for _, b := range []string{"leasehold", "leaseholdd", "leaseholdctl", "etcd", "etcdctl"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			t.Fatalf("binary %s missing in %s: run `make build tools` (or `make test`) first: %v", b, dir, err)
		}
	}
	return dir
}

// toolBin is bin/<name>, one of the programs `make tools` builds from a tools module (Helm,
// promtool, promqlnames). Missing, it fails the test as a missing leasehold binary does.
func toolBin(t testing.TB, name string) string {
	t.Helper()
	p := filepath.Join(binDir(t), name)
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("%s missing: run `make tools` (or `make test`) first: %v", p, err)
	}
	return p
}

// etcdProc is etcd running as its own process.
type etcdProc struct {
	URL     string
	peerURL string
	cmd     *exec.Cmd
	done    chan struct{}
}

// startEtcdProcess runs bin/etcd with its data in a temporary directory, fsync on, and
// waits until it answers. A port found free can be taken by another process before etcd
// binds it (test packages run in parallel), so an etcd that exits at once is started again
// on new ports.
func startEtcdProcess(t testing.TB, flags ...string) *etcdProc {
	t.Helper()
	for attempt := 1; ; attempt++ {
		p, logs := tryEtcdProcess(t, flags...)
		if p != nil {
			return p
		}
		if attempt == 3 {
			t.Fatalf("etcd did not start:\n%s", logs)
		}
	}
}

// tryEtcdProcess returns etcd once it answers, or nil and its output when it exited first.
// flags are added to etcd's command line.
func tryEtcdProcess(t testing.TB, flags ...string) (*etcdProc, string) {
	t.Helper()
	ctx := context.Background()
	curl, err := etcdserver.FreeLoopbackURL(ctx)
	if err != nil {
		t.Fatal(err)
	}
	purl, err := etcdserver.FreeLoopbackURL(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return launchEtcd(t, curl, purl, flags...)
}

// replaceEtcdProcess kills p and starts an etcd with an empty data directory at p's URLs: an
// etcd whose data was lost, as the agents see it.
func replaceEtcdProcess(t testing.TB, p *etcdProc, flags ...string) *etcdProc {
	t.Helper()
	p.kill()
	np, logs := launchEtcd(t, p.URL, p.peerURL, flags...)
	if np == nil {
		t.Fatalf("the replacing etcd did not start:\n%s", logs)
	}
	return np
}

// etcdMember and etcdClusterToken are the member name and cluster token of every etcd
// launchEtcd runs: with the peer URL they make the cluster and member IDs, so a restore that
// gives the same three keeps them (restoreEtcdProcess).
const etcdMember, etcdClusterToken = "it", "etcd-cluster"

// restoreEtcdProcess kills p and starts, at p's URLs, an etcd whose data directory
// `etcdutl snapshot restore` made from snapshot (a file `etcdctl snapshot save` wrote) with
// p's member name, peer URL and cluster token, so its cluster and member IDs are p's: etcd
// lost its data and was restored from a backup, as the agents see it. restoreFlags go to
// etcdutl (--bump-revision N --mark-compacted); flags to etcd.
func restoreEtcdProcess(t testing.TB, p *etcdProc, snapshot string, restoreFlags []string, flags ...string) *etcdProc {
	t.Helper()
	p.kill()
	dir := filepath.Join(t.TempDir(), "restored")
	args := append([]string{"snapshot", "restore", snapshot, "--data-dir", dir,
		"--name", etcdMember, "--initial-cluster", etcdMember + "=" + p.peerURL,
		"--initial-advertise-peer-urls", p.peerURL, "--initial-cluster-token", etcdClusterToken}, restoreFlags...)
	if out, err := exec.Command(toolBin(t, "etcdutl"), args...).CombinedOutput(); err != nil {
		t.Fatalf("etcdutl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	np, logs := launchEtcdIn(t, dir, p.URL, p.peerURL, flags...)
	if np == nil {
		t.Fatalf("the restored etcd did not start:\n%s", logs)
	}
	return np
}

// launchEtcd runs etcd at the URLs given, with a new data directory, and returns it once it
// answers, or nil and its output when it exited first.
func launchEtcd(t testing.TB, curl, purl string, flags ...string) (*etcdProc, string) {
	t.Helper()
	return launchEtcdIn(t, t.TempDir(), curl, purl, flags...)
}

// launchEtcdIn is launchEtcd with the data directory given (one etcdutl restored, say).
func launchEtcdIn(t testing.TB, dataDir, curl, purl string, flags ...string) (*etcdProc, string) {
	t.Helper()
	ctx := context.Background()
	out := &syncbuf.Buffer{}
	cmd := exec.Command(filepath.Join(binDir(t), "etcd"),
		"--name", etcdMember, "--data-dir", dataDir,
		"--listen-client-urls", curl, "--advertise-client-urls", curl,
		"--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
		"--initial-cluster", etcdMember+"="+purl, "--initial-cluster-token", etcdClusterToken, "--log-level", "error")
	cmd.Args = append(cmd.Args, flags...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	p := &etcdProc{URL: curl, peerURL: purl, cmd: cmd, done: done}
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("etcd output:\n%s", out.String())
		}
	})
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{curl}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	exited := false
	eventually(t, "etcd answers at "+curl, func() error {
		select {
		case <-done:
			exited = true
			return nil
		default:
		}
		c, cancel := context.WithTimeout(ctx, 5*time.Second) // one try of many
		defer cancel()
		_, err := cli.Get(c, "health")
		return err
	})
	if exited {
		return nil, out.String()
	}
	return p, ""
}

// kill stops etcd with SIGKILL and waits for it.
func (p *etcdProc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// etcdctl runs bin/etcdctl against endpoints (comma-separated) with args, as an admin does,
// and returns its output; a failure fails the test.
func etcdctl(t testing.TB, endpoints string, args ...string) string {
	t.Helper()
	args = append([]string{"--endpoints", endpoints}, args...)
	out, err := exec.Command(filepath.Join(binDir(t), "etcdctl"), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("etcdctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// agentProc is leaseholdd running as its own process (fixture.startAgent starts one).
type agentProc struct {
	// Bin is the leaseholdd binary; bin/leaseholdd when empty.
	Bin      string
	Socket   string
	StateDir string
	// Cluster, Node and NodeUID are what its flags say.
	Cluster, Node, NodeUID string
	args                   []string
	cmd                    *exec.Cmd
	logs                   *syncbuf.Buffer
	done                   chan struct{}
}

// start runs the agent and waits until it serves its socket (its output is logged at
// cleanup when the test failed).
func (a *agentProc) start(t testing.TB) {
	t.Helper()
	bin := a.Bin
	if bin == "" {
		bin = filepath.Join(binDir(t), "leaseholdd")
	}
	a.cmd = exec.Command(bin, a.args...)
	a.cmd.Stdout, a.cmd.Stderr = a.logs, a.logs
	if err := a.cmd.Start(); err != nil {
		t.Fatalf("start leaseholdd: %v", err)
	}
	a.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(a.cmd, a.done)
	exited := false
	eventually(t, "leaseholdd serves "+a.Socket, func() error {
		select {
		case <-a.done:
			exited = true
			return nil
		default:
		}
		c, err := net.Dial("unix", a.Socket)
		if err == nil {
			c.Close()
		}
		return err
	})
	if exited {
		t.Fatalf("leaseholdd exited before serving %s:\n%s", a.Socket, a.logs.String())
	}
}

// kill stops the agent with SIGKILL: no cleanup of any kind runs, as when a node dies.
func (a *agentProc) kill() {
	if a.cmd == nil {
		return
	}
	_ = a.cmd.Process.Kill()
	<-a.done
	a.cmd = nil
}

// restart starts the agent again with the same flags, socket and state directory.
func (a *agentProc) restart(t testing.TB) {
	t.Helper()
	a.start(t)
}

// stop stops the agent as systemd does (SIGINT) and waits for it to finish its shutdown,
// which the test goes on to check (SIGKILL only after etcdtest.Patience).
func (a *agentProc) stop() { a.stopWithin(etcdtest.Patience) }

// stopWithin is stop with SIGKILL after d.
func (a *agentProc) stopWithin(d time.Duration) {
	if a.cmd == nil {
		return
	}
	_ = a.cmd.Process.Signal(os.Interrupt)
	select {
	case <-a.done:
	case <-time.After(d):
		_ = a.cmd.Process.Kill()
		<-a.done
	}
	a.cmd = nil
}

// netconf is a CNI network configuration with leasehold as IPAM.
func netconf(name, socket string, ipam map[string]any) []byte {
	ipam["type"] = "leasehold"
	ipam["socket"] = socket
	conf := map[string]any{"cniVersion": "1.1.0", "name": name, "type": "leasehold", "ipam": ipam}
	b, err := json.Marshal(conf)
	if err != nil {
		panic(err)
	}
	return b
}

func dualStackIPAM(v4, v6 string) map[string]any {
	return map[string]any{"ranges": []any{
		[]any{map[string]any{"subnet": v4}},
		[]any{map[string]any{"subnet": v6}},
	}}
}

// plugin runs the leasehold plugin binary the way a runtime does.
type plugin struct{ path string }

func newPlugin(t testing.TB) plugin { return plugin{path: filepath.Join(binDir(t), "leasehold")} }

func (p plugin) args(cmd, container, ifName, cniArgs string) *invoke.Args {
	return &invoke.Args{Command: cmd, ContainerID: container, NetNS: "/var/run/netns/" + container,
		IfName: ifName, PluginArgsStr: cniArgs, Path: filepath.Dir(p.path)}
}

func (p plugin) add(ctx context.Context, conf []byte, container, ifName, cniArgs string) (*types100.Result, error) {
	r, err := invoke.ExecPluginWithResult(ctx, p.path, conf, p.args("ADD", container, ifName, cniArgs), nil)
	if err != nil {
		return nil, err
	}
	return types100.NewResultFromResult(r)
}

func (p plugin) del(ctx context.Context, conf []byte, container, ifName, cniArgs string) error {
	return invoke.ExecPluginWithoutResult(ctx, p.path, conf, p.args("DEL", container, ifName, cniArgs), nil)
}

func (p plugin) check(ctx context.Context, conf []byte, container, ifName, cniArgs string) error {
	return invoke.ExecPluginWithoutResult(ctx, p.path, conf, p.args("CHECK", container, ifName, cniArgs), nil)
}

// cniCode returns the CNI error code of err, or 0 when err is not a CNI error.
func cniCode(err error) uint {
	var e *types.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

// resultAddrs returns the addresses of an ADD's result, in its order.
func resultAddrs(res *types100.Result) []netip.Addr {
	var out []netip.Addr
	for _, ip := range res.IPs {
		a, _ := netip.AddrFromSlice(ip.Address.IP)
		out = append(out, a.Unmap())
	}
	return out
}

// snapshot returns every key under prefix with its value and lease.
func snapshot(t testing.TB, cli *clientv3.Client, prefix string) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = fmt.Sprintf("lease=%x %s", kv.Lease, kv.Value)
	}
	return out
}

func keysUnder(m map[string]string, prefix string) []string {
	var out []string
	for k := range m {
		if strings.HasPrefix(k, prefix) {
			out = append(out, k)
		}
	}
	return out
}

func etcdserverFreeURL() (string, error) { return etcdserver.FreeLoopbackURL(context.Background()) }

func invokeWithoutResult(ctx context.Context, pl plugin, cmd string, conf []byte) error {
	args := &invoke.Args{Command: cmd, Path: filepath.Dir(pl.path)}
	return invoke.ExecPluginWithoutResult(ctx, pl.path, conf, args, nil)
}
