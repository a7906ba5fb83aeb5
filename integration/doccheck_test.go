package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
	"github.com/leasehold/leasehold/keyspace"
)

// TestDocCommands keeps the etcdctl and leaseholdctl examples of the documentation true: it
// runs every one (docextract_test.go says which lines are commands, and how a block is
// marked as one that cannot run) against the state `make demo DEMO_KEEP=1` leaves, as a
// reader pastes them after `. $work/env`.
//
// The state: deploy/demo.sh itself (leaseholdd of node node-a on an embedded etcd, pods
// demo/web-1 to web-5 added to pool net1 through the real plugin, web-1 and web-2 deleted
// again), plus node-b, a node that died: its agent added pod demo/db-1 and was killed, and
// its node and pod leases ran out, so its blocks and held keys wait for the reuse delay
// (what `node forget` frees). A block's commands run in order; the next block gets a fresh
// state when they changed etcd (a release, a forget), else the same one.
//
// A command fails when its exit status is not the one expected (0, or its `# exit N`
// comment's), when it prints a usage error, or when a lone `etcdctl get` prints nothing
// while the state has keys of the family it reads (a key of the wrong layout, a wrong name).
// docPlaceholders lists the <names> a command may use for what only the live state knows.
// The first subtest shows that these checks catch what they are for.
func TestDocCommands(t *testing.T) {
	bin := binDir(t)
	blocks, problems := readDocs(t)
	for _, p := range problems {
		t.Error(p)
	}
	s := newDocState(t, bin)
	t.Run("the checks catch wrong commands", func(t *testing.T) { checksCatchWrongCommands(t, s) })
	var skipped []string
	ran := 0
	for _, b := range blocks {
		if b.Skip != "" {
			skipped = append(skipped, fmt.Sprintf("%s:%d (%d command(s)): %s", b.File, b.Line, len(b.Commands), b.Skip))
			continue
		}
		if s.changed(t) {
			s.stop(t)
			s = newDocState(t, bin)
		}
		t.Run(fmt.Sprintf("%s:%d", b.File, b.Line), func(t *testing.T) {
			for _, c := range b.Commands {
				if msg := s.run(t, c); msg != "" {
					t.Error(msg)
				}
			}
		})
		ran += len(b.Commands)
	}
	t.Logf("%d command(s) run; %d block(s) marked as unable to run on the demo's state:\n  %s",
		ran, len(skipped), strings.Join(skipped, "\n  "))
	if ran == 0 {
		t.Error("no etcdctl or leaseholdctl command found in the docs: is the extractor broken?")
	}
	if t.Failed() {
		t.Log("How to fix a doc command: run `make demo DEMO_KEEP=1`, `. <its dir>/env`, and paste the command: " +
			"the failure above shows what it printed. Placeholders: " + placeholderHelp() +
			". A command refused on purpose declares it: `# exit N: why`. A block that cannot run on the demo's state: " + docMarkerFix + ".")
	}
}

// checksCatchWrongCommands runs a sample doc's commands as TestDocCommands runs the docs'
// (none of them changes the state): each must be reported, but for the first.
func checksCatchWrongCommands(t *testing.T, s *docState) {
	const sample = "```sh\n" +
		"leaseholdctl alloc show " + docAddr + "              # good: the one that passes\n" +
		"leaseholdctl alloc list --bogus                      # unknown flag (exit 2)\n" +
		"etcdctl get --prefix /leasehold/v1/pools/ --bogus    # etcdctl's unknown flag (exit 1)\n" +
		"etcdctl get --bogus /leasehold/v1/pools/net1         # exit 1: a usage error, although the status is the one declared\n" +
		"leaseholdctl alloc show " + docAddr + "              # exit 4: declared, but it exits 0\n" +
		"etcdctl get /leasehold/v1/ips/net1/" + docAddr + " --print-value-only   # the flat layout of a block pool: prints nothing\n" +
		"etcdctl lease timetolive <lease-id> --keys           # an unknown placeholder\n" +
		"leaseholdctl pool show net2                          # a pool the demo does not have (exit 4)\n" +
		"etcdctl get --prefix /leasehold/v1/pools/ | jqq .    # a tool that does not exist\n" +
		"etcdctl get /leasehold/v1/ips/net1/" + docAddr + " \\\n" +
		"  --print-value-only                                 # the same flat key, on two lines\n" +
		"```\n"
	blocks, errs := extractDocCommands("sample.md", sample)
	if len(errs) > 0 || len(blocks) != 1 || len(blocks[0].Commands) != 10 {
		t.Fatalf("sample: %v, %+v", errs, blocks)
	}
	for i, c := range blocks[0].Commands {
		msg := s.run(t, c)
		if (msg == "") != (i == 0) {
			t.Errorf("%s: reported %q", c.Text, msg)
		}
	}
}

// TestArchitectureIsADesignDocument holds ARCHITECTURE.md to the size of a design document
// one reads whole; figures as measured live in docs/performance.md and bench/results/.
func TestArchitectureIsADesignDocument(t *testing.T) {
	const limit = 25 * 1024
	b, err := os.ReadFile("../ARCHITECTURE.md")
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > limit {
		t.Errorf("ARCHITECTURE.md is %d bytes, more than its %d: say it shorter, or move detail to docs/ (measured figures to docs/performance.md)", len(b), limit)
	}
}

// docAddr is the address the docs' examples show: demo/web-3's IPv4 address, which pods of
// node node-a (node UID demo-uid) are given in pool net1 by deploy/demo.sh.
const docAddr = "10.10.9.66"

// docPlaceholders are the <names> a doc command may use, with what each stands for; the
// test puts the live state's value in.
var docPlaceholders = map[string]string{
	"pod-uid":    "the UID of the pod holding " + docAddr,
	"leaseID":    "that pod's lease ID (hex)",
	"blockLease": "node-a's block lease ID (hex)",
}

func placeholderHelp() string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(docPlaceholders)) {
		out = append(out, "<"+k+"> is "+docPlaceholders[k])
	}
	return strings.Join(out, ", ")
}

// readDocs extracts the commands of README.md, ARCHITECTURE.md, deploy/README.md and
// docs/*.md (docs/proposals/ describes designs, not the code).
func readDocs(t *testing.T) ([]docBlock, []error) {
	t.Helper()
	files, err := filepath.Glob("../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append([]string{"../README.md", "../ARCHITECTURE.md", "../deploy/README.md"}, files...)
	var blocks []docBlock
	var errs []error
	for _, f := range files {
		text, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b, e := extractDocCommands(strings.TrimPrefix(f, "../"), string(text))
		blocks, errs = append(blocks, b...), append(errs, e...)
	}
	return blocks, errs
}

// docState is a running demo as TestDocCommands uses it.
type docState struct {
	// Dir is the demo's directory ($work in demo.sh); env in it sets ETCDCTL_ENDPOINTS and PATH.
	Dir string
	Cli *clientv3.Client
	// vars are the placeholders' values.
	vars map[string]string
	// cwd is where commands run: a directory of their own.
	cwd string
	pid int   // the demo's leaseholdd
	rev int64 // etcd's revision when the state was last seen unchanged
}

// newDocState runs deploy/demo.sh with DEMO_KEEP=1, stopped at the test's end, then kills
// node-b as described at TestDocCommands. A demo that fails (two demos starting at once may
// pick the same free port) is run again, up to three times.
func newDocState(t *testing.T, bin string) *docState {
	t.Helper()
	s := &docState{cwd: t.TempDir()}
	for attempt := 1; ; attempt++ {
		out, err := s.runDemo(t, bin)
		if err == nil {
			break
		}
		if attempt == 3 {
			t.Fatalf("deploy/demo.sh (DEMO_KEEP=1) failed three times: %v; its last output:\n%s", err, out)
		}
		t.Logf("deploy/demo.sh failed, once more: %v\n%s", err, out)
	}
	env, err := os.ReadFile(filepath.Join(s.Dir, "env"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^export ETCDCTL_ENDPOINTS=(\S+)$`).FindSubmatch(env)
	if m == nil {
		t.Fatalf("the demo's env file sets no ETCDCTL_ENDPOINTS:\n%s", env)
	}
	s.Cli = etcdClient(t, string(m[1]))
	s.killNodeB(t, string(m[1]))
	s.readVars(t)
	s.changed(t)
	return s
}

// runDemo runs the demo once; its agent, left running, is stopped at cleanup.
func (s *docState) runDemo(t *testing.T, bin string) ([]byte, error) {
	tmp := t.TempDir()
	ctx, cancel := testCtx(t) // the demo takes half a minute on an idle machine
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "../deploy/demo.sh")
	cmd.Env = append(os.Environ(), "BIN="+bin, "TMPDIR="+tmp, "DEMO_KEEP=1")
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	dirs, _ := filepath.Glob(filepath.Join(tmp, "leasehold-demo.*"))
	if len(dirs) != 1 {
		return out, errors.Join(err, fmt.Errorf("want one leasehold-demo.* directory in %s, found %q", tmp, dirs))
	}
	s.Dir = dirs[0]
	if b, rerr := os.ReadFile(filepath.Join(s.Dir, "leaseholdd.pid")); rerr == nil {
		if s.pid, rerr = strconv.Atoi(strings.TrimSpace(string(b))); rerr != nil {
			return out, fmt.Errorf("leaseholdd.pid: %w", rerr)
		}
		t.Cleanup(func() { s.stop(t) })
	}
	return out, err
}

// stop stops the demo's leaseholdd as its last lines say (SIGINT). It is not this process's
// child: it is gone once /proc has it no more, or as a zombie. Stopping again does nothing.
func (s *docState) stop(t *testing.T) {
	if s.pid == 0 || syscall.Kill(s.pid, syscall.SIGINT) != nil {
		return
	}
	gone := func() bool {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", s.pid))
		if err != nil {
			return true
		}
		f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		return len(f) == 0 || f[0] == "Z" || f[0] == "X"
	}
	for deadline := time.Now().Add(etcdtest.Patience); !gone(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			_ = syscall.Kill(s.pid, syscall.SIGKILL)
			log, _ := os.ReadFile(filepath.Join(s.Dir, "leaseholdd.log"))
			t.Errorf("the demo's leaseholdd (pid %d) did not stop within %s of SIGINT; its log:\n%s", s.pid, etcdtest.Patience, log)
			break
		}
	}
	s.pid = 0
}

// changed says whether etcd's revision moved since the last call: a command wrote, or a
// lease expired.
func (s *docState) changed(t *testing.T) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), etcdtest.Patience)
	defer cancel()
	resp, err := s.Cli.Get(ctx, keyspace.Prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	moved := resp.Header.Revision != s.rev
	s.rev = resp.Header.Revision
	return moved
}

// killNodeB adds node-b, a node that died: an agent that added pod demo/db-1 to net1 and was
// killed, whose node and pod leases then expired. Revoking them is that expiry without the
// wait of their TTL; its block lease, which outlives them by the reuse delay, stays.
func (s *docState) killNodeB(t *testing.T, endpoint string) {
	t.Helper()
	dir := t.TempDir()
	b := &agentProc{Socket: filepath.Join(dir, "leaseholdd.sock"), logs: &syncbuf.Buffer{}}
	b.args = []string{"--etcd-endpoints", endpoint, "--node", "node-b", "--node-uid", "node-b-uid", "--socket", b.Socket,
		"--state-dir", filepath.Join(dir, "state"), "--publish-host-addresses=false", "--liveness-interval", "0s", "--metrics-addr", ""}
	b.start(t)
	defer b.kill()
	ctx, cancel := context.WithTimeout(t.Context(), etcdtest.Patience)
	defer cancel()
	conf := netconf("net1", b.Socket, map[string]any{"pool": "net1"})
	if _, err := newPlugin(t).add(ctx, conf, "ctr-db-1", "eth0", "K8S_POD_UID=uid-db-1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=db-1"); err != nil {
		t.Fatalf("ADD of demo/db-1 on node-b: %v\n%s", err, b.logs)
	}
	b.kill()
	node := keyspace.NodeKey("default", "node-b")
	resp, err := s.Cli.Get(ctx, node, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	leases := map[clientv3.LeaseID]bool{}
	for _, kv := range resp.Kvs {
		if string(kv.Key) == node || strings.HasPrefix(string(kv.Key), keyspace.PodsPrefix("default", "node-b")) {
			leases[keyspace.LeaseOf(kv)] = true
		}
	}
	if len(leases) != 2 {
		t.Fatalf("node-b's node record and pod record: want 2 leases, found %d in %d keys", len(leases), len(resp.Kvs))
	}
	for id := range leases {
		if _, err := s.Cli.Revoke(ctx, id); err != nil {
			t.Fatalf("revoke node-b's lease %s: %v", keyspace.LeaseHex(id), err)
		}
	}
	held, err := s.Cli.Get(ctx, keyspace.HeldPrefix("net1"), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range held.Kvs {
		if rec, err := keyspace.Decode[keyspace.HeldRecord](string(kv.Key), kv.Value); err == nil && rec.Node == "node-b" {
			return
		}
	}
	t.Fatal("node-b's held keys went with its leases: node forget would have nothing to free")
}

// readVars reads the placeholders' values, and checks that docAddr is where the docs say.
func (s *docState) readVars(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), etcdtest.Patience)
	defer cancel()
	resp, err := s.Cli.Get(ctx, keyspace.IPsPrefix("net1"), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var held []string
	for _, kv := range resp.Kvs {
		_, _, ip, err := keyspace.ParseIPKey(string(kv.Key))
		if err != nil {
			t.Fatal(err)
		}
		alloc, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
		if err != nil {
			t.Fatal(err)
		}
		if ip != netip.MustParseAddr(docAddr) {
			held = append(held, ip.String()+" ("+alloc.Pod.Namespace+"/"+alloc.Pod.Name+")")
			continue
		}
		s.vars = map[string]string{"pod-uid": alloc.Owner, "leaseID": alloc.LeaseID}
	}
	if s.vars == nil {
		t.Fatalf("the docs' example address %s is not allocated in the demo's state, which holds %s: "+
			"did the demo change? Put one of these in docAddr and in the docs", docAddr, strings.Join(held, ", "))
	}
	node := keyspace.NodeKey("default", "node-a")
	nr, err := s.Cli.Get(ctx, node)
	if err != nil || len(nr.Kvs) != 1 {
		t.Fatalf("node-a's node record %s: %v", node, err)
	}
	rec, err := keyspace.Decode[keyspace.NodeRecord](node, nr.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	s.vars["blockLease"] = rec.BlockLease
}

var (
	placeholderRE = regexp.MustCompile(`<([A-Za-z][A-Za-z0-9-]*)>`)
	// usageErrorRE matches what etcdctl (cobra) and leaseholdctl print for a command line
	// they do not take, which a pipeline's status may hide.
	usageErrorRE = regexp.MustCompile(`(?m)^Error: (unknown (flag|shorthand flag|command)|flag needs an argument|invalid argument|.* needs .*argument)|flag provided but not defined|\(leaseholdctl -h lists the commands and flags\)`)
)

// run runs one doc command in bash, with the demo's env file as BASH_ENV, and returns what
// is wrong with it ("" when nothing is): the message names the command's file and line.
func (s *docState) run(t *testing.T, c docCommand) string {
	t.Helper()
	fail := func(format string, args ...any) string {
		return fmt.Sprintf("%s:%d: %s\n    %s", c.File, c.Line, strings.ReplaceAll(c.Text, "\n", "\n    "), fmt.Sprintf(format, args...))
	}
	var unknown []string
	code := placeholderRE.ReplaceAllStringFunc(c.Code, func(p string) string {
		v, ok := s.vars[p[1:len(p)-1]]
		if !ok {
			unknown = append(unknown, p)
		}
		return v
	})
	if len(unknown) > 0 {
		return fail("unknown placeholder %s (%s)", strings.Join(unknown, ", "), placeholderHelp())
	}
	ctx, cancel := context.WithTimeout(t.Context(), etcdtest.Patience)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c", code)
	cmd.Dir = s.cwd
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "ETCDCTL_") && !strings.HasPrefix(e, "BASH_ENV=") {
			cmd.Env = append(cmd.Env, e)
		}
	}
	cmd.Env = append(cmd.Env, "BASH_ENV="+filepath.Join(s.Dir, "env"))
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	status := 0
	if exit := (*exec.ExitError)(nil); errors.As(err, &exit) {
		status = exit.ExitCode()
	} else if err != nil {
		return fail("did not run: %v", err)
	}
	shown := printed(out, 20)
	switch {
	case status != c.Exit:
		return fail("exit status %d, the doc expects %d; it printed:\n%s", status, c.Exit, shown)
	case usageErrorRE.Match(out):
		return fail("a usage error; it printed:\n%s", shown)
	}
	if family, example := s.emptyGet(t, code, out); family != "" {
		return fail("printed nothing, while the demo's state has keys under %s, as %s: is the key right (layout, pool, node)?", family, example)
	}
	if testing.Verbose() { // what each command printed, for a reader of go test -v; a failure shows its own
		t.Logf("%s:%d: exit %d\n    $ %s\n%s", c.File, c.Line, status, strings.ReplaceAll(code, "\n", "\n    "), printed(out, 0))
	}
	return ""
}

// printed indents a command's output for a message, cut after max lines (0: never).
func printed(out []byte, max int) string {
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if max > 0 && len(lines) > max {
		lines = append(lines[:max], fmt.Sprintf("... (%d more lines)", len(lines)-max))
	}
	return "    | " + strings.Join(lines, "\n    | ")
}

// emptyGet returns, for a lone `etcdctl get` that printed nothing, the family of leasehold
// keys it reads and a key of it, when the state has one: a key or prefix that names nothing.
func (s *docState) emptyGet(t *testing.T, code string, out []byte) (family, example string) {
	t.Helper()
	code = strings.ReplaceAll(code, "\\\n", " ") // a continued line is one command
	words := strings.Fields(code)
	if len(bytes.TrimSpace(out)) > 0 || strings.ContainsAny(code, "|;&$`\n") || len(words) < 2 || words[0] != "etcdctl" || words[1] != "get" {
		return "", ""
	}
	for _, w := range words[2:] {
		rest, ok := strings.CutPrefix(strings.Trim(w, `"'`), keyspace.Prefix)
		name, _, _ := strings.Cut(rest, "/")
		if !ok || name == "" {
			continue
		}
		family = keyspace.Prefix + name + "/"
		ctx, cancel := context.WithTimeout(t.Context(), etcdtest.Patience)
		resp, err := s.Cli.Get(ctx, family, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(1))
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) > 0 {
			return family, string(resp.Kvs[0].Key)
		}
	}
	return "", ""
}
