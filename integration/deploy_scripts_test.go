package integration

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/keyspace"
)

// TestDeployShellScriptsParse runs `bash -n` on every .sh file under deploy/.
func TestDeployShellScriptsParse(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Fatal(err)
	}
	bashN := func(p string) error {
		if out, err := exec.Command(bash, "-n", p).CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	var scripts []string
	err = filepath.WalkDir(deployDir, func(p string, e fs.DirEntry, err error) error {
		if err == nil && !e.IsDir() && strings.HasSuffix(p, ".sh") {
			scripts = append(scripts, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"etcd/etcd-rbac.sh", "etcd/certs.sh"} {
		if !slices.Contains(scripts, filepath.Join(deployDir, want)) {
			t.Errorf("deploy/%s is missing", want)
		}
	}
	for _, s := range scripts {
		if err := bashN(s); err != nil {
			t.Errorf("bash -n %s: %v", s, err)
		}
		if fi, err := os.Stat(s); err == nil && fi.Mode().Perm()&0o100 == 0 {
			t.Errorf("%s is not executable (the docs run it as ./%s)", s, s)
		}
	}
	broken := filepath.Join(t.TempDir(), "broken.sh")
	if err := os.WriteFile(broken, []byte("if true; then echo x\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if bashN(broken) == nil {
		t.Error("bash -n accepted a script with an unterminated if")
	}
}

// deployRunRBAC runs etcd-rbac.sh with a stand-in etcdctl that records every call (and what
// it read on stdin); a user or role exists once it has been added.
func deployRunRBAC(t *testing.T, env []string, args ...string) (calls []string, stdin string, err error) {
	t.Helper()
	dir := t.TempDir()
	log := filepath.Join(dir, "calls")
	fake := filepath.Join(dir, "etcdctl")
	script := `#!/bin/sh
printf '%s\n' "$*" >>"` + log + `"
case "$1 $2" in
"role get"|"user get") grep -q "^$1 add $3\( \|\$\)" "` + log + `"; exit $? ;;
"user add"|"user passwd") case "$*" in *--interactive=false*) cat >>"` + log + `.stdin" ;; esac ;;
esac
exit 0
`
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", append([]string{filepath.Join(deployDir, "etcd", "etcd-rbac.sh")}, args...)...)
	cmd.Env = append(append(os.Environ(), "ETCDCTL="+fake, "LEASEHOLD_ETCD_PASSWORD=", "ETCD_ROOT_PASSWORD=", "ETCDCTL_CERT="), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		err = fmt.Errorf("%w: %s", err, out)
	}
	b, _ := os.ReadFile(log)
	in, _ := os.ReadFile(log + ".stdin")
	return strings.Split(strings.TrimSpace(string(b)), "\n"), string(in), err
}

// TestDeployEtcdRBACScript: etcd-rbac.sh grants each cluster's role exactly
// keyspace.RolePrefixes (the prefixes the agent writes), readwrite, and keyspace.ReadPrefixes
// (the selection rules it follows), read, by prefix; makes the user
// whose name the client certificate carries; never puts a password on a command line; and
// turns authentication on only when root could still log in.
func TestDeployEtcdRBACScript(t *testing.T) {
	grant := regexp.MustCompile(`^role grant-permission --prefix=true (\S+) (\S+) (\S+)$`)
	calls, _, err := deployRunRBAC(t, nil, "cluster-x", "cluster-y")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"cluster-x", "cluster-y"} {
		role := "leasehold-" + c
		got := map[string][]string{}
		for _, call := range calls {
			if m := grant.FindStringSubmatch(call); m != nil && m[1] == role {
				got[m[2]] = append(got[m[2]], m[3])
			}
		}
		want := map[string][]string{"readwrite": keyspace.RolePrefixes(c), "read": keyspace.ReadPrefixes(c)}
		for perm, w := range want {
			slices.Sort(got[perm])
			slices.Sort(w)
			if !slices.Equal(got[perm], w) {
				t.Errorf("role %s is granted %s on %q, the agent needs exactly %q (keyspace.RolePrefixes, ReadPrefixes)", role, perm, got[perm], w)
			}
			delete(got, perm)
		}
		for perm, ps := range got {
			t.Errorf("role %s is granted %s on %q; the agent needs only read and readwrite", role, perm, ps)
		}
		for _, call := range []string{"role add " + role, "user add " + role + " --no-password", "user grant-role " + role + " " + role} {
			if !slices.Contains(calls, call) {
				t.Errorf("no call `etcdctl %s` in %q", call, calls)
			}
		}
	}
	if slices.ContainsFunc(calls, func(c string) bool { return strings.HasPrefix(c, "auth enable") }) {
		t.Error("authentication enabled without --enable-auth")
	}

	// A password goes on stdin, never into argv.
	calls, stdin, err := deployRunRBAC(t, []string{"LEASEHOLD_ETCD_PASSWORD=Pa55-w0rd"}, "cluster-x")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(strings.Join(calls, "\n"), "Pa55-w0rd") {
		t.Errorf("the password appears on an etcdctl command line: %q", calls)
	}
	if strings.TrimSpace(stdin) != "Pa55-w0rd" || !slices.Contains(calls, "user add leasehold-cluster-x --interactive=false") {
		t.Errorf("the user was not made with the password on stdin: calls %q, stdin %q", calls, stdin)
	}
	if _, _, err := deployRunRBAC(t, []string{"LEASEHOLD_ETCD_PASSWORD=Pa55-w0rd"}, "cluster-x", "cluster-y"); err == nil {
		t.Error("one password for two clusters' users was accepted")
	}
	if _, _, err := deployRunRBAC(t, []string{"LEASEHOLD_ETCD_PASSWORD=two words"}, "cluster-x"); err == nil {
		t.Error("a password with a space (which etcdctl would cut) was accepted")
	}
	// Refusals that must happen before any etcdctl call.
	for name, args := range map[string][]string{"a cluster ID with a slash": {"a/b"}, "no cluster": {}, "an unknown option": {"--enable-auht", "x"}} {
		calls, _, err := deployRunRBAC(t, nil, args...)
		if err == nil || (len(calls) > 0 && calls[0] != "") {
			t.Errorf("%s: err %v, etcdctl calls %q; want a refusal before any call", name, err, calls)
		}
	}
	// --enable-auth: never leave root without a way in.
	calls, _, err = deployRunRBAC(t, nil, "--enable-auth", "cluster-x")
	if err == nil || slices.Contains(calls, "auth enable") {
		t.Errorf("--enable-auth without a root password or client certificate: err %v, calls %q", err, calls)
	}
	calls, _, err = deployRunRBAC(t, []string{"ETCD_ROOT_PASSWORD=r00t"}, "--enable-auth", "cluster-x")
	if err != nil {
		t.Fatal(err)
	}
	if calls[len(calls)-1] != "auth enable" || !slices.Contains(calls, "user grant-role root root") {
		t.Errorf("--enable-auth: calls %q, want root granted role root and `auth enable` last", calls)
	}
}

// TestDeployCertsScript runs certs.sh: a CA, etcd's server certificate for 127.0.0.1 and
// localhost, and per cluster a client certificate whose CN is the etcd user etcd-rbac.sh
// makes, each verifying against the CA and matching its key.
func TestDeployCertsScript(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		cannotRun(t, "openssl is not installed (scripts/deps.sh installs it)")
	}
	out := filepath.Join(t.TempDir(), "pki")
	cmd := exec.Command("bash", filepath.Join(deployDir, "etcd", "certs.sh"), out, "cluster-x")
	cmd.Env = append(os.Environ(), "ETCD_SERVER_SANS=DNS:etcd-1.example.internal")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("certs.sh: %v\n%s", err, b)
	}
	load := func(name string) *x509.Certificate {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		blk, _ := pem.Decode(b)
		if blk == nil {
			t.Fatalf("%s: no PEM", name)
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	ca := load("ca.crt")
	if !ca.IsCA {
		t.Error("ca.crt is not a CA")
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	verify := func(name string, c *x509.Certificate, usage x509.ExtKeyUsage) {
		t.Helper()
		if _, err := c.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Errorf("%s does not verify for %v against ca.crt: %v", name, usage, err)
		}
		if _, err := tls.LoadX509KeyPair(filepath.Join(out, name), filepath.Join(out, strings.TrimSuffix(name, ".crt")+".key")); err != nil {
			t.Errorf("%s and its key do not match: %v", name, err)
		}
		if fi, err := os.Stat(filepath.Join(out, strings.TrimSuffix(name, ".crt")+".key")); err != nil {
			t.Error(err)
		} else if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("the key of %s has mode %v: readable by others", name, fi.Mode())
		}
	}
	server := load("server.crt")
	verify("server.crt", server, x509.ExtKeyUsageServerAuth)
	if err := server.VerifyHostname("127.0.0.1"); err != nil {
		t.Error(err)
	}
	if err := server.VerifyHostname("localhost"); err != nil {
		t.Error(err)
	}
	if err := server.VerifyHostname("etcd-1.example.internal"); err != nil {
		t.Errorf("ETCD_SERVER_SANS not applied: %v", err)
	}
	client := load("clients/leasehold-cluster-x.crt")
	verify("clients/leasehold-cluster-x.crt", client, x509.ExtKeyUsageClientAuth)
	calls, _, err := deployRunRBAC(t, nil, "cluster-x")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(calls, "user add "+client.Subject.CommonName+" --no-password") {
		t.Errorf("client certificate CN %q is not the user etcd-rbac.sh makes (%q)", client.Subject.CommonName, calls)
	}
	verify("clients/root.crt", load("clients/root.crt"), x509.ExtKeyUsageClientAuth)

	// A second run keeps the CA (certificates already issued stay valid).
	before, _ := os.ReadFile(filepath.Join(out, "ca.crt"))
	if b, err := exec.Command("bash", filepath.Join(deployDir, "etcd", "certs.sh"), out, "cluster-y").CombinedOutput(); err != nil {
		t.Fatalf("certs.sh, second run: %v\n%s", err, b)
	}
	after, _ := os.ReadFile(filepath.Join(out, "ca.crt"))
	if !bytes.Equal(before, after) {
		t.Error("a second run replaced the CA")
	}
	verify("clients/leasehold-cluster-y.crt", load("clients/leasehold-cluster-y.crt"), x509.ExtKeyUsageClientAuth)
	if b, err := exec.Command("bash", filepath.Join(deployDir, "etcd", "certs.sh"), out, "bad/name").CombinedOutput(); err == nil {
		t.Errorf("certs.sh accepted cluster ID bad/name:\n%s", b)
	}
}
