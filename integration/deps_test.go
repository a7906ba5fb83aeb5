package integration

import (
	"os/exec"
	"strings"
	"testing"
)

// goList returns the packages pkg depends on (with -deps) or imports directly.
func goList(t *testing.T, deps bool, pkg string) []string {
	t.Helper()
	args := []string{"list", "-f", "{{join .Imports \"\\n\"}}", pkg}
	if deps {
		args = []string{"list", "-deps", pkg}
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = ".."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go %s: %v", strings.Join(args, " "), err)
	}
	return strings.Fields(string(out))
}

// TestDependencyRule keeps the layering of ARCHITECTURE.md true: imports point downward
// (allocator <- keyspace <- admin, leases <- cmd), the plugin binary is a thin client (no etcd,
// gRPC, netlink, CNI library, net, encoding/json, fmt or reflect: in a process that lives for
// one call each of them costs startup time), allocator is standard library only, only
// leases/kernel talks netlink, leaseholdctl links neither the agent, netlink nor the
// Prometheus client, no part of the agent under leases/ depends on package leases, and none
// depends on the parts only the orchestrator calls (the recovery, the import).
func TestDependencyRule(t *testing.T) {
	const mod = "github.com/leasehold/leasehold/"
	for _, dep := range goList(t, true, "./cmd/leasehold") {
		if strings.Contains(dep, ".") && !strings.HasPrefix(dep, mod+"cniplugin/thin") && dep != mod+"cmd/leasehold" {
			t.Errorf("the plugin binary links %s; it may link only package cniplugin/thin and the standard library", dep)
		}
		switch dep {
		case "net", "encoding/json", "fmt", "reflect", "log/slog":
			t.Errorf("the plugin binary links %s; the thin plugin leaves parsing and networking to leaseholdd", dep)
		}
	}
	for _, dep := range goList(t, true, "./allocator") {
		if strings.Contains(dep, ".") && !strings.HasPrefix(dep, mod+"allocator") {
			t.Errorf("allocator depends on %s; it must be standard library only", dep)
		}
	}
	for _, pkg := range []string{"./cniplugin/...", "./leases/..."} {
		for _, imp := range goList(t, false, pkg) {
			if strings.HasPrefix(pkg, "./cniplugin") && strings.HasPrefix(imp, mod+"leases") {
				t.Errorf("cniplugin imports %s", imp)
			}
			if strings.HasPrefix(pkg, "./leases") && strings.HasPrefix(imp, mod+"cniplugin") {
				t.Errorf("leases imports %s", imp)
			}
		}
	}
	// The agent's parts (leases/etcdgate, leases/kernel, leases/adopt, ...) sit below it: none
	// depends on the orchestrator, package leases (docs/agent.md).
	out, err := exec.Command("go", "list", "../leases/...").Output()
	if err != nil {
		t.Fatalf("go list ../leases/...: %v", err)
	}
	// The recovery (leases/reclaim) and the import (leases/imports) sit right under it, above
	// the parts they are handed (the claim loop, the pod book, the views, ...): only the
	// orchestrator calls them.
	top := map[string]bool{mod + "leases/reclaim": true, mod + "leases/imports": true}
	parts := 0
	for _, pkg := range strings.Fields(string(out)) {
		if pkg == mod+"leases" {
			continue
		}
		parts++
		for _, dep := range goList(t, true, pkg) {
			if dep == mod+"leases" {
				t.Errorf("%s depends on package leases; the agent's parts sit below the orchestrator", pkg)
			}
			if top[dep] && dep != pkg {
				t.Errorf("%s depends on %s, which only the orchestrator calls", pkg, dep)
			}
		}
	}
	if parts < 3 {
		t.Errorf("go list found %d parts under leases/: %s", parts, out)
	}
	for _, dep := range goList(t, true, "./cmd/leaseholdctl") {
		switch {
		case strings.Contains(dep, "vishvananda/netlink"), strings.Contains(dep, "prometheus"),
			strings.HasPrefix(dep, mod+"leases"), strings.HasPrefix(dep, mod+"cniplugin"):
			t.Errorf("leaseholdctl links %s; the admin tool needs only allocator, keyspace and admin", dep)
		}
	}
	for _, pkg := range []string{"./keyspace", "./admin"} {
		for _, imp := range goList(t, false, pkg) {
			if strings.HasPrefix(imp, mod+"leases") || strings.HasPrefix(imp, mod+"cniplugin") || imp == mod+"admin" && pkg == "./keyspace" {
				t.Errorf("%s imports %s; the etcd contract and the operator side sit below the agent and the plugin", pkg, imp)
			}
		}
	}
	for _, pkg := range []string{"./allocator/...", "./keyspace", "./admin", "./cniplugin/...", "./cmd/...", "./leases", "./etcdserver"} {
		for _, imp := range goList(t, false, pkg) {
			if strings.Contains(imp, "vishvananda/netlink") {
				t.Errorf("%s imports netlink; only leases/kernel may", pkg)
			}
		}
	}
}
