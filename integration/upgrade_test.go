package integration

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// flatRelease is the last commit whose agents know only the flat key layout
// (ips/<pool>/<ip>): the release a running cluster upgrades from.
const flatRelease = "e78d0417264312b9bd8e23e4c398500471a62c1d"

// buildRelease builds leaseholdd and the plugin of commit from this repository's history,
// once per machine (cached under the temporary directory).
func buildRelease(t *testing.T, commit string) (leaseholdd, plugin string) {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if err := exec.Command("git", "-C", root, "cat-file", "-e", commit+"^{commit}").Run(); err != nil {
		cannotRun(t, "commit %s is not in this clone (a shallow clone?): %v", commit, err)
	}
	dir := filepath.Join(os.TempDir(), "leasehold-release-"+commit[:12])
	leaseholdd, plugin = filepath.Join(dir, "bin", "leaseholdd"), filepath.Join(dir, "bin", "leasehold")
	if _, err := os.Stat(plugin); err == nil {
		return leaseholdd, plugin
	}
	src := dir + ".src"
	_ = os.RemoveAll(src)
	if err := os.MkdirAll(src, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(src)
	archive := exec.Command("sh", "-c", fmt.Sprintf("git -C %q archive %s | tar -x -C %q", root, commit, src))
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("extract %s: %v\n%s", commit, err, out)
	}
	for bin, pkg := range map[string]string{leaseholdd: "./cmd/leaseholdd", plugin: "./cmd/leasehold"} {
		build := exec.Command("go", "build", "-o", bin+".tmp", pkg)
		build.Dir, build.Env = src, append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("build %s of %s: %v\n%s", pkg, commit, err, out)
		}
		if err := os.Rename(bin+".tmp", bin); err != nil {
			t.Fatal(err)
		}
	}
	return leaseholdd, plugin
}

// TestUpgradeFromTheFlatLayoutWithLivePods upgrades a running cluster from the flat layout to
// blocks with real processes: agents of the previous release with live pods, a rolling
// upgrade, leaseholdctl pool migrate (refused while an old agent runs), and an old agent
// started after the migration. After every step each address has exactly one key and every
// live pod holds its own.
func TestUpgradeFromTheFlatLayoutWithLivePods(t *testing.T) {
	oldAgent, oldPlugin := buildRelease(t, flatRelease)
	f := newFixture(t, withoutAgent(), withNetns())
	oldPl := plugin{path: oldPlugin}
	ipam := func() map[string]any {
		return map[string]any{"ranges": []any{[]any{map[string]any{"subnet": "10.91.0.0/24"}}}}
	}
	live := map[string]netip.Addr{} // container -> its address
	ctr := map[string]string{}      // the test's name of a pod -> its container (and netns)
	add := func(pl plugin, a *agentProc, name string) {
		t.Helper()
		container := f.sandbox(name)
		ctr[name] = container
		res, err := pl.add(f.Ctx, netconf(f.Pool, a.Socket, ipam()), container, "eth0", "")
		if err != nil {
			t.Fatalf("ADD %s on %s: %v", container, a.Node, err)
		}
		addr, _ := netip.AddrFromSlice(res.IPs[0].Address.IP.To4())
		live[container] = addr
	}
	del := func(pl plugin, a *agentProc, name string) {
		t.Helper()
		container := ctr[name]
		if err := pl.del(f.Ctx, netconf(f.Pool, a.Socket, ipam()), container, "eth0", ""); err != nil {
			t.Fatalf("DEL %s on %s: %v", container, a.Node, err)
		}
		delete(live, container)
	}
	// state checks that every address has one key, held by the live pod that got it, and
	// returns how many keys are in the flat layout.
	state := func(step string) (flat int) {
		t.Helper()
		resp, err := f.Cli.Get(f.Ctx, keyspace.IPsPrefix(f.Pool), clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		keys := map[netip.Addr][]string{}
		for _, kv := range resp.Kvs {
			_, block, ip, err := keyspace.ParseIPKey(string(kv.Key))
			if err != nil {
				t.Fatalf("%s: %v", step, err)
			}
			if !block.IsValid() {
				flat++
			}
			rec, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value)
			if err != nil {
				t.Fatal(err)
			}
			if live[rec.ContainerID] != ip {
				t.Errorf("%s: %s is held by %s, which the test holds %v", step, kv.Key, rec.ContainerID, live[rec.ContainerID])
			}
			keys[ip] = append(keys[ip], string(kv.Key))
		}
		for ip, ks := range keys {
			if len(ks) > 1 {
				t.Errorf("%s: %s has %d keys: %v", step, ip, len(ks), ks)
			}
		}
		if len(keys) != len(live) {
			t.Errorf("%s: %d addresses in etcd, %d live pods", step, len(keys), len(live))
		}
		return flat
	}
	ctl := func(args ...string) (string, error) {
		out, err := exec.CommandContext(f.Ctx, filepath.Join(binDir(t), "leaseholdctl"),
			append([]string{"--endpoints", f.Endpoint}, args...)...).CombinedOutput()
		return string(out), err
	}

	// The previous release on two nodes, with live pods in the flat layout.
	a := f.startAgentBin(oldAgent)
	b := f.startAgentBin(oldAgent)
	for i := range 3 {
		add(oldPl, a, fmt.Sprintf("a-old-%d", i))
		add(oldPl, b, fmt.Sprintf("b-old-%d", i))
	}
	if n := state("old agents"); n != 6 {
		t.Fatalf("old agents wrote %d flat keys, want 6", n)
	}

	// Rolling upgrade, node b first: the new agent adopts b's pods and serves the flat pool
	// as the old one did, beside the old agent on a.
	b.stop()
	b.Bin = ""
	b.restart(t)
	add(f.pl, b, "b-new-0")
	add(oldPl, a, "a-old-3")
	del(f.pl, b, "b-old-0")
	if n := state("old and new agents side by side"); n != len(live) {
		t.Errorf("mixed agents: %d flat keys of %d", n, len(live))
	}

	// The migration is refused while an agent of the previous release is live, naming it.
	out, err := ctl("pool", "migrate", f.Pool)
	if err == nil || !strings.Contains(out, a.Node) {
		t.Fatalf("pool migrate with an old agent live: err=%v, output:\n%s\nwant a refusal naming %s", err, out, a.Node)
	}
	state("migration refused")

	// Node a upgraded: the migration moves every key to its block, pods keep their addresses.
	a.stop()
	a.Bin = ""
	a.restart(t)
	if out, err := ctl("pool", "migrate", f.Pool); err != nil {
		t.Fatalf("pool migrate: %v\n%s", err, out)
	}
	if n := state("migrated"); n != 0 {
		t.Errorf("%d flat keys left after the migration", n)
	}

	// ADDs now claim in blocks; DELs of pods from before the upgrade release their moved keys.
	add(f.pl, a, "a-new-0")
	add(f.pl, b, "b-new-1")
	del(f.pl, a, "a-old-1")
	del(f.pl, b, "b-old-2")
	if n := state("after the migration"); n != 0 {
		t.Errorf("%d flat keys after the migration", n)
	}

	// An agent of the previous release started now refuses the pool instead of writing a
	// flat key beside the block layout's.
	c := f.startAgentBin(oldAgent)
	if _, err := oldPl.add(f.Ctx, netconf(f.Pool, c.Socket, ipam()), f.sandbox("c-old-0"), "eth0", ""); err == nil {
		t.Error("an old agent's ADD into a migrated pool succeeded")
	}
	state("old agent after the migration")

	if out, err := ctl("doctor"); err != nil {
		t.Errorf("doctor after the upgrade: %v\n%s", err, out)
	}
}
