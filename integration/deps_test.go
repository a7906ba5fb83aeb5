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

// TestDependencyRule keeps the layering of ARCHITECTURE.md true: imports point downward,
// the plugin binary is a thin client (no etcd, gRPC, netlink, CNI library, net,
// encoding/json, fmt or reflect: in a process that lives for one call each of them
// costs startup time), allocator is standard library only, and only leases/kernel talks
// netlink.
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
	for _, pkg := range []string{"./allocator/...", "./cniplugin/...", "./cmd/...", "./leases", "./leases/etcdserver"} {
		for _, imp := range goList(t, false, pkg) {
			if strings.Contains(imp, "vishvananda/netlink") {
				t.Errorf("%s imports netlink; only leases/kernel may", pkg)
			}
		}
	}
}
