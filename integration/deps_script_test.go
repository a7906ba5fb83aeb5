package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestDepsScriptStops runs scripts/deps.sh, the part of `make test` that makes sure every test
// it runs can run, on the two machines where it cannot install what is missing: it must stop
// (exit 1) and name the command to run, never let `make test` go on and skip tests. Its third
// path, installing with apt-get, is what .ci/run does on every CI machine.
func TestDepsScriptStops(t *testing.T) {
	if os.Getuid() != 0 {
		cannotRun(t, "the script's root path needs root")
	}
	script, err := filepath.Abs("../scripts/deps.sh")
	if err != nil {
		t.Fatal(err)
	}
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Fatal(err)
	}
	// A PATH with nothing on it: no ip, containerd, runc, busybox, dpkg or apt-get.
	bare := t.TempDir()
	run := func(asNobody bool) (string, int) {
		t.Helper()
		cmd := exec.Command(bash, script)
		cmd.Env = []string{"PATH=" + bare}
		if asNobody {
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		}
		out, err := cmd.CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), code
	}

	out, code := run(false)
	if code != 1 {
		t.Fatalf("root, nothing installed, no apt-get: exit %d, want 1\n%s", code, out)
	}
	for _, pkg := range []string{"iproute2", "iptables", "openssl", "containerd", "runc", "busybox-static", "jq"} {
		if !strings.Contains(out, pkg) {
			t.Errorf("root, no apt-get: the message does not name package %s:\n%s", pkg, out)
		}
	}
	if strings.Count(out, "containerd") != 1 {
		t.Errorf("containerd named more than once (one package has three of the commands):\n%s", out)
	}

	out, code = run(true)
	if code != 1 || !strings.Contains(out, "sudo make test") {
		t.Fatalf("not root: exit %d, want 1 with the command to run (sudo make test)\n%s", code, out)
	}
}
