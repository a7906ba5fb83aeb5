package integration

import (
	"context"
	"crypto/sha512"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/leasehold/leasehold/keyspace"
)

// ccCnitool runs bin/cnitool with NETCONFPATH=netDir and CNI_PATH=bin/cni.
func ccCnitool(ctx context.Context, t *testing.T, netDir, cniArgs string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir(t), "cnitool"), args...)
	cmd.Env = append(os.Environ(), "NETCONFPATH="+netDir, "CNI_PATH="+filepath.Join(binDir(t), "cni"), "CNI_ARGS="+cniArgs,
		"CNI_IFNAME=eth0")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("cnitool %v: %w\nstdout: %s\nstderr: %s", args, err, out, stderr.String())
	}
	return out, nil
}

// ccVethPair creates a veth pair in the root namespace, both ends up, deleted at cleanup.
func ccVethPair(t *testing.T) (a, b string) {
	t.Helper()
	a, b = ccUniq("ccmva"), ccUniq("ccmvb")
	if out, err := exec.Command("ip", "link", "add", a, "type", "veth", "peer", "name", b).CombinedOutput(); err != nil {
		t.Fatalf("ip link add %s type veth peer name %s: %v\n%s", a, b, err, out)
	}
	t.Cleanup(func() {
		if _, err := net.InterfaceByName(a); err == nil {
			if out, err := exec.Command("ip", "link", "del", a).CombinedOutput(); err != nil {
				t.Errorf("ip link del %s: %v\n%s", a, err, out)
			}
		}
	})
	for _, l := range []string{a, b} {
		if out, err := exec.Command("ip", "link", "set", l, "up").CombinedOutput(); err != nil {
			t.Fatalf("ip link set %s up: %v\n%s", l, err, out)
		}
	}
	return a, b
}

// TestMacvlanWithLeaseholdViaCnitool proves that leasehold works as the IPAM of the
// reference macvlan plugin when driven by cnitool from a configuration file: the printed
// result's IPv4 and IPv6 addresses are exactly those on eth0 of the namespace, with the
// configured default routes, etcd records them for the pod UID, `cnitool check` passes,
// and `cnitool del` removes the interface and every allocation of the owner.
func TestMacvlanWithLeaseholdViaCnitool(t *testing.T) {
	f := newFixture(t, withNetns())
	master, _ := ccVethPair(t)
	ctr := f.sandbox("lh-ccmv-")
	nsPath := ccNetnsPath(ctr)
	name := f.Pool
	// cnitool keeps its result cache in /var/lib/cni, named after the network and the
	// container ID it derives from the netns path; remove ours whatever happens.
	sum := sha512.Sum512([]byte(nsPath))
	cacheFile := filepath.Join("/var/lib/cni/results", fmt.Sprintf("%s-cnitool-%x-eth0", name, sum[:10]))
	t.Cleanup(func() { _ = os.Remove(cacheFile) })

	sub4, sub6 := netip.MustParsePrefix("10.62.0.0/24"), netip.MustParsePrefix("fd62::/64")
	gw4, gw6 := netip.MustParseAddr("10.62.0.1"), netip.MustParseAddr("fd62::1")
	conf := map[string]any{
		"cniVersion": "1.1.0", "name": name, "type": "macvlan", "master": master, "mode": "bridge",
		"ipam": ccLeaseholdIPAM(f.Agent.Socket, []any{
			[]any{map[string]any{"subnet": sub4.String(), "gateway": gw4.String()}},
			[]any{map[string]any{"subnet": sub6.String(), "gateway": gw6.String()}},
		}, ccRouteConf("0.0.0.0/0", gw4.String()), ccRouteConf("::/0", gw6.String())),
	}
	netDir := t.TempDir()
	b, _ := json.Marshal(conf)
	if err := os.WriteFile(filepath.Join(netDir, "10-"+name+".conf"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	uid := "uid-" + ctr
	cniArgs := "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-" + ctr + ";K8S_POD_UID=" + uid

	out, err := ccCnitool(f.Ctx, t, netDir, cniArgs, "add", name, nsPath)
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := types100.NewResult(out)
	if err != nil {
		t.Fatalf("cnitool add printed no CNI result: %v\n%s", err, out)
	}
	res, err := types100.NewResultFromResult(parsed)
	if err != nil {
		t.Fatal(err)
	}
	ccWantDualStack(t, res, sub4, sub6)
	eth0 := ccCheckAttachment(t, ctr, res, gw4, gw6)
	var macvlanIf bool
	for _, ifc := range res.Interfaces {
		macvlanIf = macvlanIf || (ifc.Name == "eth0" && ifc.Sandbox == nsPath)
	}
	if !macvlanIf {
		t.Errorf("result names no eth0 in sandbox %s: %+v", nsPath, res.Interfaces)
	}
	if details := ccIP(nsPath, "-d", "link", "show", "eth0"); !strings.Contains(details, "macvlan mode bridge") {
		t.Errorf("eth0 (index %d) is not a macvlan in bridge mode:\n%s", eth0.Index, details)
	}
	keys := ccKeysOf(name, ccResultAddrs(res))
	if held := ccHeldBy(t, f.Cli, name, uid); !slices.Equal(held, keys) {
		t.Errorf("etcd allocations of %s: %v, want %v", uid, held, keys)
	}
	for _, k := range keys {
		if a, _ := allocation(t, f.Cli, k); a.ContainerID != fmt.Sprintf("cnitool-%x", sum[:10]) || a.IfName != "eth0" {
			t.Errorf("%s: %+v, want cnitool's container ID and eth0", k, a)
		}
	}

	if _, err := ccCnitool(f.Ctx, t, netDir, cniArgs, "check", name, nsPath); err != nil {
		t.Errorf("check: %v", err)
	}
	if _, err := ccCnitool(f.Ctx, t, netDir, cniArgs, "del", name, nsPath); err != nil {
		t.Fatalf("del: %v", err)
	}
	if _, ok := ccReadLink(t, nsPath, "eth0"); ok {
		t.Errorf("eth0 still in %s after del:\n%s", nsPath, ccIP(nsPath, "addr"))
	}
	if held := ccHeldBy(t, f.Cli, name, uid); len(held) != 0 {
		t.Errorf("after del etcd still holds %v for %s", held, uid)
	}
	for _, k := range keys {
		if exists(t, f.Cli, k) {
			t.Errorf("after del %s still exists", k)
		}
	}
	if left := keysUnder(snapshot(t, f.Cli, keyspace.Prefix), keyspace.OwnerPrefix(f.Cluster, uid)); len(left) != 0 {
		t.Errorf("after del the owner index still has %v", left)
	}
}
