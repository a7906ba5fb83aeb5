package integration

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	types100 "github.com/containernetworking/cni/pkg/types/100"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
)

// fixture is what an integration test runs against: an etcd of its own, a client of it,
// leaseholdd agents as separate processes, the plugin binary, a context bounded by the
// test, and names no other test of the run uses. newFixture builds it in one call; every
// part is taken down by t.Cleanup, the agents before etcd.
type fixture struct {
	t *testing.T
	// Ctx ends when the test ends, or shortly before go test's -timeout would stop the
	// binary (testCtx): nothing but the outcomes a test waits for bounds it.
	Ctx context.Context
	// Endpoint is the etcd the agents are given (--etcd-endpoints): one URL, or three
	// comma-separated ones with withThreeMemberEtcd. Empty with withoutEtcd.
	Endpoint string
	// Cli is a client of Endpoint; nil with withoutEtcd.
	Cli *clientv3.Client
	// Etcd is the etcd process of the default kind, nil with another kind.
	Etcd *etcdProc
	// Members is the cluster of withThreeMemberEtcd, nil with another kind.
	Members *etcdCluster
	// Agent is the first agent started; Agents are all of them, in order.
	Agent  *agentProc
	Agents []*agentProc
	// Pool is a network and pool name no other test uses.
	Pool string
	// Cluster is the cluster ID every agent is given unless its flags name another.
	Cluster string

	pl  plugin
	cfg fixtureConfig
}

// etcdKind is the etcd a fixture runs.
type etcdKind int

const (
	etcdProcessKind etcdKind = iota // bin/etcd, one member (the default)
	etcdThreeMembersKind
	etcdTLSKind
	etcdInAgentKind // leaseholdd --embedded-etcd of the first agent
	etcdNoneKind
)

type fixtureConfig struct {
	etcd       etcdKind
	etcdFlags  []string
	pki        *pki
	agents     int
	agentFlags []string
	netns      bool
}

// fixtureOption changes what newFixture builds.
type fixtureOption func(*fixtureConfig)

// withEtcdFlags adds flags to the command line of the default single etcd process
// (--quota-backend-bytes, say).
func withEtcdFlags(flags ...string) fixtureOption {
	return func(c *fixtureConfig) { c.etcdFlags = append(c.etcdFlags, flags...) }
}

// withThreeMemberEtcd runs a three-member etcd cluster of separate processes instead of
// one member.
func withThreeMemberEtcd() fixtureOption {
	return func(c *fixtureConfig) { c.etcd = etcdThreeMembersKind }
}

// withTLSEtcd runs bin/etcd serving clients over TLS with client certificates of p
// required; Cli authenticates with a certificate for user root. The agents get no TLS
// flags from the fixture: each test gives its own.
func withTLSEtcd(p *pki) fixtureOption {
	return func(c *fixtureConfig) { c.etcd, c.pki = etcdTLSKind, p }
}

// withAgentEmbeddedEtcd runs no etcd process: the first agent runs its embedded etcd
// (leaseholdd --embedded-etcd), which Endpoint and Cli then point at.
func withAgentEmbeddedEtcd() fixtureOption {
	return func(c *fixtureConfig) { c.etcd = etcdInAgentKind }
}

// withoutEtcd runs neither etcd nor an agent: only the plugin and the context.
func withoutEtcd() fixtureOption {
	return func(c *fixtureConfig) { c.etcd = etcdNoneKind }
}

// withAgents starts n agents (default 1), each with its own node name and identity.
func withAgents(n int) fixtureOption {
	return func(c *fixtureConfig) { c.agents = n }
}

// withoutAgent starts no agent: the test starts its own with startAgent.
func withoutAgent() fixtureOption { return withAgents(0) }

// withAgentFlags adds flags to every agent the fixture starts, after its defaults.
func withAgentFlags(flags ...string) fixtureOption {
	return func(c *fixtureConfig) { c.agentFlags = append(c.agentFlags, flags...) }
}

// withShortLeases gives every agent ttl leases, to watch keep-alive and expiry happen.
func withShortLeases() fixtureOption { return withAgentFlags("--lease-ttl", ttl.String()) }

// withNetns declares that the test makes network namespaces: without root it is skipped
// (a failure in CI, which runs as root) before anything starts.
func withNetns() fixtureOption {
	return func(c *fixtureConfig) { c.netns = true }
}

// newFixture starts what opts ask for: by default one etcd process, a client of it and one
// agent.
func newFixture(t *testing.T, opts ...fixtureOption) *fixture {
	t.Helper()
	cfg := fixtureConfig{agents: 1}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.netns {
		requireNetns(t)
	}
	ctx, cancel := testCtx(t)
	t.Cleanup(cancel)
	f := &fixture{t: t, Ctx: ctx, Pool: uniq("net"), Cluster: uniq("cluster-"), pl: newPlugin(t), cfg: cfg}
	agents := cfg.agents
	switch cfg.etcd {
	case etcdProcessKind:
		f.Etcd = startEtcdProcess(t, cfg.etcdFlags...)
		f.Endpoint = f.Etcd.URL
		f.Cli = etcdClient(t, f.Endpoint)
	case etcdThreeMembersKind:
		f.Members = startEtcdCluster(t)
		f.Endpoint = f.Members.endpoints()
		f.Cli = etcdClient(t, f.Endpoint)
	case etcdTLSKind:
		f.Endpoint = startTLSEtcd(t, cfg.pki)
		cert, key := cfg.pki.issue(t, "root", false)
		f.Cli = tlsClient(t, f.Endpoint, cfg.pki, cert, key, "", "")
	case etcdInAgentKind:
		curl := freeURL(t)
		f.launch("", "", []string{"--embedded-etcd", t.TempDir(), "--embedded-etcd-client-url", curl,
			"--embedded-etcd-peer-url", freeURL(t)})
		f.Endpoint = curl
		f.Cli = etcdClient(t, f.Endpoint)
		agents--
	case etcdNoneKind:
		agents = 0
	}
	for range agents {
		f.startAgent()
	}
	return f
}

// startAgent starts another agent against Endpoint, with the fixture's defaults, then the
// flags of withAgentFlags, then flags (a flag given again overrides the earlier value).
func (f *fixture) startAgent(flags ...string) *agentProc {
	f.t.Helper()
	return f.launch(f.Endpoint, "", flags)
}

// startAgentBin is startAgent with another leaseholdd binary (an earlier release).
func (f *fixture) startAgentBin(bin string, flags ...string) *agentProc {
	f.t.Helper()
	return f.launch(f.Endpoint, bin, flags)
}

// launch runs bin/leaseholdd (or bin) against endpoint (none when "": flags name an embedded etcd)
// and waits for its socket. Defaults: the fixture's cluster, a node name and identity of its
// own, a private state directory, 10s leases, no quarantine, no sandbox liveness, no host
// address publication (this machine's own addresses would change etcd under the tests'
// snapshots), no metrics listener.
func (f *fixture) launch(endpoint, bin string, flags []string) *agentProc {
	t := f.t
	t.Helper()
	dir := t.TempDir()
	a := &agentProc{Bin: bin, Socket: filepath.Join(dir, "leaseholdd.sock"), StateDir: filepath.Join(dir, "state")}
	a.args = []string{"--socket", a.Socket, "--state-dir", a.StateDir,
		"--cluster", f.Cluster, "--node", uniq("node-"), "--node-uid", uniq("node-uid-"),
		"--lease-ttl", "10s", "--quarantine", "0s", "--liveness-interval", "0s", "--publish-host-addresses=false",
		"--metrics-addr", "", "--log-level", "debug"}
	if endpoint != "" {
		a.args = append(a.args, "--etcd-endpoints", endpoint)
	}
	a.args = append(a.args, f.cfg.agentFlags...)
	a.args = append(a.args, flags...)
	a.Cluster, a.Node, a.NodeUID = lastFlag(a.args, "cluster"), lastFlag(a.args, "node"), lastFlag(a.args, "node-uid")
	a.logs = &syncbuf.Buffer{}
	t.Cleanup(func() {
		// Nothing checks this shutdown: one whose etcd the test took away may take its
		// timeouts, and need not be waited for.
		a.stopWithin(10 * time.Second)
		if t.Failed() {
			t.Logf("leaseholdd %v output:\n%s", a.args, a.logs.String())
		}
	})
	a.start(t)
	f.Agents = append(f.Agents, a)
	if f.Agent == nil {
		f.Agent = a
	}
	return a
}

// lastFlag is the value args give flag --name last ("--name v" or "--name=v").
func lastFlag(args []string, name string) string {
	v := ""
	for i, a := range args {
		if a == "--"+name && i+1 < len(args) {
			v = args[i+1]
		} else if s, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			v = s
		}
	}
	return v
}

// add, del and check run the plugin binary as a runtime does, bounded by Ctx.
func (f *fixture) add(conf []byte, container, ifName, cniArgs string) (*types100.Result, error) {
	return f.pl.add(f.Ctx, conf, container, ifName, cniArgs)
}

func (f *fixture) del(conf []byte, container, ifName, cniArgs string) error {
	return f.pl.del(f.Ctx, conf, container, ifName, cniArgs)
}

func (f *fixture) check(conf []byte, container, ifName, cniArgs string) error {
	return f.pl.check(f.Ctx, conf, container, ifName, cniArgs)
}

// run runs the plugin for a command that takes no container (GC, STATUS).
func (f *fixture) run(cmd string, conf []byte) error {
	return invokeWithoutResult(f.Ctx, f.pl, cmd, conf)
}

// ipv4 runs ADD on eth0 and returns the IPv4 address of the result; anything else fails
// the test (call it from the test's goroutine).
func (f *fixture) ipv4(conf []byte, container, cniArgs string) netip.Addr {
	f.t.Helper()
	res, err := f.add(conf, container, "eth0", cniArgs)
	if err != nil {
		f.t.Fatalf("ADD %s: %v", container, err)
	}
	for _, ip := range res.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP.To4()); ok && ip.Address.IP.To4() != nil {
			return a
		}
	}
	f.t.Fatalf("ADD %s: no IPv4 address in %v", container, res)
	return netip.Addr{}
}

// sandbox creates a network namespace with a name no other test (nor another run of this
// package on the machine) uses, removed at cleanup, and returns its name: the container ID
// whose netns path the plugin passes is /var/run/netns/<name>.
func (f *fixture) sandbox(prefix string) string {
	f.t.Helper()
	name := ccUniq(prefix)
	sandbox(f.t, name)
	return name
}

// uniq returns prefix followed by a number no other call in this test binary returned.
var uniq = etcdtest.Uniq

// eventually polls cond until it returns nil and returns how long that took; it fails the
// test, naming what and what cond last saw, when that does not come within etcdtest.Patience,
// far above what any run needs. Waits for a condition use it, never a sleep; how fast
// something happens is the bench's to measure.
func eventually(t testing.TB, what string, cond func() error) time.Duration {
	t.Helper()
	return etcdtest.Eventually(t, what, cond)
}

// saw is a condition's answer for eventually: nil when ok, else what it saw.
var saw = etcdtest.Saw

// testCtx is a test's context: it ends when the test ends, or shortly before go test's
// -timeout stops the binary (etcdtest.Deadline). A test is bounded by the outcomes it waits
// for, not by a clock of its own.
func testCtx(t testing.TB) (context.Context, context.CancelFunc) {
	if d, ok := etcdtest.Deadline(t); ok {
		return context.WithDeadline(t.Context(), d)
	}
	return context.WithCancel(t.Context())
}

// etcdClient returns a client of the comma-separated endpoints, closed when the test ends.
func etcdClient(t testing.TB, endpoints string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: strings.Split(endpoints, ","), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// requireNetns skips a test that makes network namespaces when not root (and fails it in
// CI, which runs as root).
func requireNetns(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		cannotRun(t, "network namespaces need root (make test and CI run as root)")
	}
}

// cannotRun ends a test that this machine cannot run. Under `make test` (which sets
// LEASEHOLD_TEST_ALL after scripts/deps.sh made sure everything is there) and in CI the test
// fails, so neither ever passes with a part quietly skipped; a bare `go test` skips it.
func cannotRun(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") != "" || os.Getenv("LEASEHOLD_TEST_ALL") != "" {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}

// sandbox creates a real network namespace named after a container, so that the agent's
// sandbox liveness sees it at /var/run/netns/<container> as the runtime's netns path.
func sandbox(t testing.TB, container string) {
	t.Helper()
	requireNetns(t)
	if out, err := exec.Command("ip", "netns", "add", container).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v\n%s", container, err, out)
	}
	t.Cleanup(func() { removeSandbox(t, container) })
}

func removeSandbox(t testing.TB, container string) {
	if _, err := os.Stat("/var/run/netns/" + container); err != nil {
		return
	}
	if out, err := exec.Command("ip", "netns", "del", container).CombinedOutput(); err != nil {
		t.Errorf("ip netns del %s: %v\n%s", container, err, out)
	}
}

// journaled returns the owners the agent's journal holds now, its lines replayed in order.
// A partly written last line (the agent is appending) is left out, and so is an unreadable
// line: the caller polls, and checkStateDir judges the file.
func (a *agentProc) journaled(t testing.TB) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(a.StateDir, "journal"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("reading the journal: %v", err)
	}
	owners := map[string]bool{}
	for rest := string(b); ; {
		line, after, complete := strings.Cut(rest, "\n")
		if !complete {
			return owners
		}
		rest = after
		var rec struct {
			Put *struct {
				Owner string `json:"owner"`
			} `json:"put"`
			Del string `json:"del"`
		}
		switch {
		case json.Unmarshal([]byte(line), &rec) != nil:
		case rec.Put != nil:
			owners[rec.Put.Owner] = true
		default:
			delete(owners, rec.Del)
		}
	}
}
