package integration

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/etcdserver"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// pki is a CA with a server certificate for loopback and client certificates, as PEM files.
type pki struct {
	dir        string
	ca         *x509.Certificate
	caKey      *ecdsa.PrivateKey
	CACert     string
	ServerCert string
	ServerKey  string
	serial     int64
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	p := &pki{dir: t.TempDir(), serial: 1}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "leasehold test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	p.ca, _ = x509.ParseCertificate(der)
	p.caKey = key
	p.CACert = p.write(t, "ca.pem", "CERTIFICATE", der)
	p.ServerCert, p.ServerKey = p.issue(t, "server", true)
	return p
}

func (p *pki) write(t *testing.T, name, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(p.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// issue signs a certificate for cn (a server certificate for 127.0.0.1 when server is set).
func (p *pki) issue(t *testing.T, cn string, server bool) (cert, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	p.serial++
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(p.serial), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		tmpl.DNSNames = []string{"localhost"}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &k.PublicKey, p.caKey)
	if err != nil {
		t.Fatal(err)
	}
	kd, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return p.write(t, cn+".pem", "CERTIFICATE", der), p.write(t, cn+"-key.pem", "EC PRIVATE KEY", kd)
}

// startTLSEtcd runs bin/etcd serving clients over TLS with client certificates required.
func startTLSEtcd(t *testing.T, p *pki, extra ...string) string {
	t.Helper()
	curl, err := etcdserver.FreeLoopbackURL(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	purl, err := etcdserver.FreeLoopbackURL(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	curl = strings.Replace(curl, "http://", "https://", 1)
	args := append([]string{"--name", "tls", "--data-dir", t.TempDir(),
		"--listen-client-urls", curl, "--advertise-client-urls", curl,
		"--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl, "--initial-cluster", "tls=" + purl,
		"--cert-file", p.ServerCert, "--key-file", p.ServerKey, "--trusted-ca-file", p.CACert, "--client-cert-auth",
		"--log-level", "error"}, extra...)
	var logs bytes.Buffer
	cmd := exec.Command(filepath.Join(binDir(t), "etcd"), args...)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("etcd output:\n%s", logs.String())
		}
	})
	return curl
}

func tlsClient(t *testing.T, url string, p *pki, cert, key, user, pass string) *clientv3.Client {
	t.Helper()
	tc, err := transport.TLSInfo{CertFile: cert, KeyFile: key, TrustedCAFile: p.CACert}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{url}, TLS: tc, Username: user, Password: pass, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	eventually(t, "etcd over TLS answers", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // one try of many
		defer cancel()
		_, err := cli.Get(ctx, "health")
		if err == nil || strings.Contains(err.Error(), "permission denied") || strings.Contains(err.Error(), "user name") {
			return nil
		}
		return err
	})
	return cli
}

// runAgentExpectingFailure runs leaseholdd and returns its output once it exits.
func runAgentExpectingFailure(t *testing.T, args ...string) string {
	t.Helper()
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir(t), "leaseholdd"), append([]string{"--socket", filepath.Join(dir, "s.sock"),
		"--state-dir", filepath.Join(dir, "state"), "--node", "n", "--node-uid", "u", "--metrics-addr", "",
		"--publish-host-addresses=false"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("leaseholdd %v started and exited 0; want a refusal:\n%s", args, out)
	}
	if ctx.Err() != nil {
		t.Fatalf("leaseholdd %v neither served nor refused within %s:\n%s", args, etcdtest.Patience, out)
	}
	return string(out)
}

// TestMutualTLSToEtcd: the agent talks to etcd over TLS with a client certificate
// (certificates generated here), and refuses to start, saying why, when its TLS files are
// unreadable or do not match.
func TestMutualTLSToEtcd(t *testing.T) {
	p := newPKI(t)
	cert, key := p.issue(t, "agent", false)
	f := newFixture(t, withTLSEtcd(p), withAgentFlags("--etcd-cacert", p.CACert, "--etcd-cert", cert, "--etcd-key", key))
	url := f.Endpoint
	if _, err := f.add(netconf(f.Pool, f.Agent.Socket, dualStackIPAM("10.60.0.0/24", "fd60::/64")), "c1", "eth0", ""); err != nil {
		t.Fatalf("ADD over mTLS: %v", err)
	}

	_, otherKey := p.issue(t, "other", false)
	cases := []struct {
		name    string
		args    []string
		mention string
	}{
		// A key file that does not exist.
		{"missing key file", []string{"--etcd-cacert", p.CACert, "--etcd-cert", cert, "--etcd-key", filepath.Join(p.dir, "nope.pem")}, "nope.pem"},
		// A key that belongs to another certificate.
		{"mismatched key", []string{"--etcd-cacert", p.CACert, "--etcd-cert", cert, "--etcd-key", otherKey}, "private key does not match"},
		// A certificate without its key.
		{"cert without key", []string{"--etcd-cacert", p.CACert, "--etcd-cert", cert}, "needs both cert and key"},
		// No client certificate at all, against an etcd that requires one: refused after the
		// bounded connection check, naming the endpoint.
		{"no client certificate", []string{"--etcd-cacert", p.CACert}, url},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out := runAgentExpectingFailure(t, append([]string{"--etcd-endpoints", url}, tc.args...)...)
			t.Logf("%s refusal: %s", tc.name, lastLine(out))
			if !strings.Contains(out, tc.mention) {
				t.Errorf("refusal should mention %q:\n%s", tc.mention, out)
			}
		})
	}
}

// TestAgentUnderAnEtcdRoleLimitedToItsPrefixes: etcd with authentication on, a user whose
// role grants only the prefixes deploy/etcd documents for one cluster (readwrite on
// keyspace.RolePrefixes, read on keyspace.ReadPrefixes). With a selection rule stored, the
// agent serves ADD (from the rule's pool), CHECK and DEL with it, its password never appears
// in its logs, and the same user cannot write outside those prefixes, nor a selection rule.
func TestAgentUnderAnEtcdRoleLimitedToItsPrefixes(t *testing.T) {
	p := newPKI(t)
	f := newFixture(t, withTLSEtcd(p), withoutAgent())
	root := f.Cli // its certificate is for user root
	const cluster, user, pass = "prod-a", "leasehold-prod-a", "s3cret-Pa55word"
	must := func(_ any, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(root.UserAdd(f.Ctx, "root", "rootpw"))
	must(root.RoleAdd(f.Ctx, "root"))
	must(root.UserGrantRole(f.Ctx, "root", "root"))
	must(root.RoleAdd(f.Ctx, user))
	for _, prefix := range keyspace.RolePrefixes(cluster) {
		end := clientv3.GetPrefixRangeEnd(prefix)
		must(root.RoleGrantPermission(f.Ctx, user, prefix, end, clientv3.PermissionType(clientv3.PermReadWrite)))
	}
	for _, prefix := range keyspace.ReadPrefixes(cluster) {
		end := clientv3.GetPrefixRangeEnd(prefix)
		must(root.RoleGrantPermission(f.Ctx, user, prefix, end, clientv3.PermissionType(clientv3.PermRead)))
	}
	// The namespace's pods get their addresses from a pool of their own.
	team := uniq("team")
	teamSpec := allocator.PoolSpec{Name: team, Ranges: []allocator.RangeSet{
		{{Subnet: netip.MustParsePrefix("10.62.0.0/24")}}, {{Subnet: netip.MustParsePrefix("fd62::/64")}}}}
	must(admin.CreatePool(f.Ctx, root, teamSpec))
	if err := admin.SetNamespaceRule(f.Ctx, root, cluster, f.Pool, "team-a", keyspace.NamespaceRule{Pools: []string{team}}); err != nil {
		t.Fatal(err)
	}
	must(root.UserAdd(f.Ctx, user, pass))
	must(root.UserGrantRole(f.Ctx, user, user))
	must(root.AuthEnable(f.Ctx))

	cert, key := p.issue(t, "agent-prod-a", false)
	agentEnv := os.Environ()
	_ = agentEnv
	t.Setenv("LEASEHOLD_ETCD_PASSWORD", pass)
	agent := f.startAgent("--cluster", cluster, "--etcd-cacert", p.CACert, "--etcd-cert", cert, "--etcd-key", key,
		"--etcd-username", user)
	conf := netconf(f.Pool, agent.Socket, dualStackIPAM("10.61.0.0/24", "fd61::/64"))
	if _, err := f.add(conf, "c1", "eth0", "K8S_POD_UID=u1"); err != nil {
		t.Fatalf("ADD under the limited role: %v", err)
	}
	const teamPod = "K8S_POD_UID=u2;K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=p2"
	if ip := f.ipv4(conf, "c2", teamPod); !netip.MustParsePrefix("10.62.0.0/24").Contains(ip) {
		t.Errorf("ADD of a team-a pod under the limited role got %s, want one of its rule's pool %s (10.62.0.0/24)", ip, team)
	}
	if err := f.del(conf, "c2", "eth0", teamPod); err != nil {
		t.Errorf("DEL of the team-a pod under the limited role: %v", err)
	}
	if err := f.check(conf, "c1", "eth0", "K8S_POD_UID=u1"); err != nil {
		t.Errorf("CHECK under the limited role: %v", err)
	}
	if err := f.del(conf, "c1", "eth0", "K8S_POD_UID=u1"); err != nil {
		t.Errorf("DEL (with lease revoke) under the limited role: %v", err)
	}
	if strings.Contains(agent.logs.String(), pass) {
		t.Errorf("the etcd password appears in the agent's logs")
	}
	limited := tlsClient(t, f.Endpoint, p, cert, key, user, pass)
	if _, err := limited.Put(f.Ctx, "/not-leasehold/x", "y"); err == nil || !strings.Contains(err.Error(), "permission denied") {
		t.Errorf("the role must not write outside leasehold's prefixes; Put /not-leasehold/x: %v", err)
	}
	if _, err := limited.Put(f.Ctx, keyspace.OwnerKey("other-cluster", "o", "eth0", "p"), "y"); err == nil {
		t.Errorf("the role must not write another cluster's owner index")
	}
	if _, err := limited.Put(f.Ctx, keyspace.NamespaceRuleKey(cluster, f.Pool, "team-b"), `{"pools":["`+team+`"]}`); err == nil {
		t.Errorf("the role must not write its cluster's selection rules (admins do)")
	}
	if _, err := limited.Get(f.Ctx, keyspace.SelectionPrefix("other-cluster", ""), clientv3.WithPrefix()); err == nil {
		t.Errorf("the role must not read another cluster's selection rules")
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
