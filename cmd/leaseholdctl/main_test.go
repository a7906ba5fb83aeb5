package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
)

// endpoint is the client URL of the embedded etcd member the tests share; they keep apart by
// their own pool and cluster names. Doctor tests, which need a clean state, start their own.
var endpoint string

func TestMain(m *testing.M) {
	for _, k := range []string{"ENDPOINTS", "CACERT", "CERT", "KEY", "USER", "PASSWORD", "DIAL_TIMEOUT", "COMMAND_TIMEOUT"} {
		os.Unsetenv("ETCDCTL_" + k) // the admin's own settings must not leak into the tests
	}
	srv, stop, err := etcdtest.Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	endpoint = srv.ClientURL
	code := m.Run()
	stop()
	os.Exit(code)
}

// result is one in-process run of leaseholdctl.
type result struct {
	code           int
	stdout, stderr string
}

// ctlAt runs leaseholdctl against ep with args.
func ctlAt(ep string, args ...string) result {
	var out, errb bytes.Buffer
	code := run(append([]string{"--endpoints", ep}, args...), &out, &errb)
	return result{code, out.String(), errb.String()}
}

func ctl(args ...string) result { return ctlAt(endpoint, args...) }

// jsonOf decodes a -o json output.
func jsonOf(t *testing.T, r result, v any) {
	t.Helper()
	if err := json.Unmarshal([]byte(r.stdout), v); err != nil {
		t.Fatalf("output is not JSON (%v): %s\nstderr: %s", err, r.stdout, r.stderr)
	}
}

// agent starts a real agent on its own client; tweaks change its configuration first.
func agent(t *testing.T, ep, cluster, node string, tweaks ...func(*leases.Config)) *leases.Agent {
	t.Helper()
	cfg := leases.Config{Cluster: cluster, Node: node, NodeUID: "uid-" + node, LeaseTTL: 20 * time.Second, Quarantine: -1, SpareLeases: 1,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, tweak := range tweaks {
		tweak(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	a, err := leases.Start(ctx, etcdtest.ClientAt(t, ep), cfg)
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	t.Cleanup(a.Close)
	return a
}

// attach allocates one attachment (pod uid u-<container>) from pool, naming the pool only.
func attach(t *testing.T, a *leases.Agent, pool, container string, ips ...string) allocator.Result {
	t.Helper()
	req := allocator.Request{Network: pool, Pool: allocator.PoolSpec{Name: pool}, ContainerID: container, IfName: "eth0",
		Pod: allocator.PodRef{UID: "u-" + container, Namespace: "ns", Name: "pod-" + container}}
	for _, ip := range ips {
		req.RequestedIPs = append(req.RequestedIPs, netip.MustParseAddr(ip))
	}
	res, err := a.Add(etcdtest.Ctx(t), req)
	if err != nil {
		t.Fatalf("add %s: %v", container, err)
	}
	return res
}

func TestExitCodes(t *testing.T) {
	pool := etcdtest.Uniq("net")
	if r := ctl("pool", "create", pool, "--range", "10.80.0.0/24"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want int
		says string // a part of stdout+stderr
	}{
		// Nothing to do is a usage error, and says where the help is.
		{"no command", nil, nil, exitUsage, "no command"},
		// A typo of a command word.
		{"unknown command", []string{"pool", "lst"}, nil, exitUsage, `unknown command "pool lst"`},
		// Help is not an error.
		{"help", []string{"-h"}, nil, exitOK, "exit codes"},
		// An output format scripts cannot parse is refused up front.
		{"bad output", []string{"pool", "list", "-o", "yaml"}, nil, exitUsage, "table or json"},
		// A flag of another command is an error, never silently ignored.
		{"flag of another command", []string{"pool", "list", "--force"}, nil, exitUsage, "does not take --force"},
		// A missing argument.
		{"missing argument", []string{"pool", "show"}, nil, exitUsage, "NAME"},
		// An argument that is not an address.
		{"bad IP", []string{"alloc", "show", "10.80.0.300"}, nil, exitUsage, "not an IP address"},
		// Release must name the pool.
		{"release without pool", []string{"alloc", "release", "10.80.0.5"}, nil, exitUsage, "--pool"},
		// A range spec with an unknown key.
		{"bad range syntax", []string{"pool", "create", etcdtest.Uniq("net"), "--range", "10.81.0.0/24,begin=10.81.0.5"}, nil, exitUsage, "begin"},
		// A range that is wrong whatever the pool.
		{"range with host bits", []string{"pool", "create", etcdtest.Uniq("net"), "--range", "10.81.0.5/24"}, nil, exitUsage, "did you mean 10.81.0.0/24"},
		// A cluster name that would escape its key prefix.
		{"bad cluster name", []string{"node", "list", "--cluster", "a/b"}, nil, exitUsage, "cluster name"},
		// node forget names a node; one holding nothing is no error.
		{"node forget without node", []string{"node", "forget"}, nil, exitUsage, "NODE"},
		{"node forget of nothing", []string{"node", "forget", "nobody", "--cluster", "nowhere"}, nil, exitOK, "nothing is held back"},
		// An address nobody holds: not found, distinct from a failure.
		{"alloc show not found", []string{"alloc", "show", "10.80.0.77"}, nil, exitNotFound, "no allocation"},
		// Release of an address nobody holds.
		{"alloc release not found", []string{"alloc", "release", "10.80.0.77", "--pool", pool}, nil, exitNotFound, "no allocation"},
		// An unknown pool.
		{"pool show not found", []string{"pool", "show", etcdtest.Uniq("net")}, nil, exitNotFound, "no definition"},
		// Growing an unknown pool.
		{"add-range not found", []string{"pool", "add-range", etcdtest.Uniq("net"), "--range", "10.82.0.0/24"}, nil, exitNotFound, "no definition"},
		// Another definition under an existing name is refused: the operation failed.
		{"pool mismatch", []string{"pool", "create", pool, "--range", "10.83.0.0/24"}, nil, exitError, "requested:"},
		// Nothing answers: the operation failed, after the command timeout.
		{"etcd unreachable", []string{"--endpoints", "http://127.0.0.1:1", "--command-timeout", "1s", "pool", "list"}, nil, exitError, "deadline"},
		// Flags may follow the command words, and ETCDCTL_ENDPOINTS is the default endpoint.
		{"env endpoint, flags after words", []string{"pool", "show", pool, "-o", "json"}, map[string]string{"ETCDCTL_ENDPOINTS": endpoint}, exitOK, `"name"`},
		// A malformed ETCDCTL_* value is a usage error naming the variable.
		{"bad env duration", []string{"pool", "list"}, map[string]string{"ETCDCTL_COMMAND_TIMEOUT": "soon"}, exitUsage, "ETCDCTL_COMMAND_TIMEOUT"},
		// A client certificate without its key fails before any request.
		{"cert without key", []string{"--cert", "/nonexistent.pem", "pool", "list"}, nil, exitError, "both cert and key"},
		// version needs no etcd.
		{"version", []string{"version"}, nil, exitOK, "leaseholdctl"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			var r result
			if tt.env["ETCDCTL_ENDPOINTS"] != "" {
				var out, errb bytes.Buffer
				r = result{run(tt.args, &out, &errb), out.String(), errb.String()}
			} else {
				r = ctl(tt.args...)
			}
			if r.code != tt.want {
				t.Errorf("exit %d, want %d\nstdout: %s\nstderr: %s", r.code, tt.want, r.stdout, r.stderr)
			}
			if !strings.Contains(r.stdout+r.stderr, tt.says) {
				t.Errorf("output does not say %q\nstdout: %s\nstderr: %s", tt.says, r.stdout, r.stderr)
			}
		})
	}
}

func TestJSONShapes(t *testing.T) {
	ctx := etcdtest.Ctx(t)
	cluster, pool := etcdtest.Uniq("c"), etcdtest.Uniq("net")
	if r := ctl("pool", "create", pool, "--range", "10.84.0.0/24", "--range", "fd84::/120", "--exclude", "10.84.0.9"); r.code != 0 {
		t.Fatalf("pool create: %+v", r)
	}
	a := agent(t, endpoint, cluster, "n1")
	res := attach(t, a, pool, "c1")
	ip := res.IPs[0].Address.Addr().String()
	conflict := keyspace.ConflictRecord{ContainerID: "c9", Node: "n1", NodeUID: "uid-n1", Detected: time.Now().UTC(),
		Taken: []keyspace.TakenByOther{{IP: netip.MustParseAddr("10.84.0.99"), Holder: "other", Cluster: "c2", Node: "n7"}}}
	b, _ := json.Marshal(conflict)
	if _, err := etcdtest.ClientAt(t, endpoint).Put(ctx, keyspace.ConflictKey(cluster, "u9", "eth0", pool), string(b)); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string
		list bool     // the output is an array; its first element is checked
		keys []string // fields every script may rely on
	}{
		// Per set and per range counts, stable names; sizes are strings (IPv6 exceeds 64 bits).
		{"pool list", []string{"pool", "list"}, true, []string{"name", "key", "sets", "exclude", "allocated", "outOfRange", "layout", "blocks", "claimedBlocks",
			"expired", "expiredBlocks"}},
		// pool show adds the holders per cluster, and what is held back per node.
		{"pool show", []string{"pool", "show", pool}, false, []string{"name", "sets", "exclude", "holders", "layout", "blocks", "claimedBlocks",
			"expired", "expiredBlocks", "heldBack"}},
		// The allocation record's own field names, plus where it lives.
		{"alloc list", []string{"alloc", "list", "--pool", pool}, true, []string{"pool", "ip", "owner", "cluster", "node", "nodeUID", "pod", "containerID", "ifName", "network", "leaseID", "created", "lease", "key"}},
		// alloc show adds the lease's TTL.
		{"alloc show", []string{"alloc", "show", ip}, true, []string{"pool", "ip", "block", "key", "owner", "pod", "node", "leaseID", "ttl", "grantedTTL", "created"}},
		// node list: identity and how long ago the agent renewed its lease.
		{"node list", []string{"node", "list", "--cluster", cluster}, true, []string{"cluster", "node", "agent", "uid", "version", "started", "leaseID", "ttl", "grantedTTL", "lastRenewedSecondsAgo", "pods"}},
		// node forget: what it freed; a node holding nothing frees nothing.
		{"node forget", []string{"node", "forget", "nobody", "--cluster", cluster}, false, []string{"cluster", "node", "blocks", "held", "leases",
			"kept", "gone", "revision", "nothing", "refused"}},
		// conflicts: the record with its key parts.
		{"conflicts", []string{"conflicts", "--cluster", cluster}, true, []string{"key", "cluster", "owner", "ifName", "pool", "node", "containerID", "taken", "detected"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(append(tt.args, "-o", "json")...)
			if r.code != 0 {
				t.Fatalf("exit %d: %s", r.code, r.stderr)
			}
			var obj map[string]any
			if tt.list {
				var arr []map[string]any
				jsonOf(t, r, &arr)
				if len(arr) == 0 {
					t.Fatalf("empty list: %s", r.stdout)
				}
				obj = arr[0]
			} else {
				jsonOf(t, r, &obj)
			}
			for _, k := range tt.keys {
				if _, ok := obj[k]; !ok {
					t.Errorf("field %q missing in %s", k, r.stdout)
				}
			}
		})
	}
}

func mustIP(s string) netip.Addr { return netip.MustParseAddr(s) }
