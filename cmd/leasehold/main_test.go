package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// TestMain lets the test binary act as the plugin: the tests below run it again with
// LEASEHOLD_TEST_PLUGIN=1 and the CNI environment, exercising main, skel and the exit
// code exactly as a runtime would.
func TestMain(m *testing.M) {
	if os.Getenv("LEASEHOLD_TEST_PLUGIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// agent answers every ADD with one address.
type agent struct{}

func (agent) Add(context.Context, allocator.Request) (allocator.Result, error) {
	return allocator.Result{IPs: []allocator.IPConfig{{Address: netip.MustParsePrefix("10.50.0.9/24"), Gateway: netip.MustParseAddr("10.50.0.1")}}}, nil
}
func (agent) Del(context.Context, allocator.Request) error { return nil }
func (agent) Check(context.Context, allocator.Request) (allocator.Result, error) {
	return allocator.Result{}, allocator.ErrNotAllocated
}
func (agent) GC(context.Context, allocator.GCRequest) error         { return nil }
func (agent) Status(context.Context, allocator.StatusRequest) error { return nil }

func startAgent(t *testing.T) string {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "lh.sock")
	l, err := agentapi.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- agentapi.Serve(ctx, l, agent{}, nil) }()
	t.Cleanup(func() { cancel(); <-done })
	return socket
}

// runPlugin executes the plugin with command and stdin; it returns stdout, stderr and
// the exit code.
func runPlugin(t *testing.T, command, stdin string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = []string{"LEASEHOLD_TEST_PLUGIN=1", "CNI_PATH=/opt/cni/bin", "CNI_CONTAINERID=c0ffee",
		"CNI_IFNAME=eth0", "CNI_NETNS=/var/run/netns/test", "CNI_NETNS_OVERRIDE=1", "CNI_ARGS=K8S_POD_UID=uid-9"}
	if command != "" {
		cmd.Env = append(cmd.Env, "CNI_COMMAND="+command)
	}
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("running plugin: %v", err)
	}
	return stdout.String(), stderr.String(), code
}

func netconf(socket string) string {
	return `{"cniVersion": "1.0.0", "name": "net5", "type": "macvlan", "ipam": {"type": "leasehold", "socket": "` +
		socket + `", "ranges": [[{"subnet": "10.50.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}}`
}

func TestPluginBinary(t *testing.T) {
	socket := startAgent(t)
	missing := filepath.Join(t.TempDir(), "none.sock")
	tests := []struct {
		name      string
		command   string
		stdin     string
		exit      int
		stdout    []string // substrings of stdout
		errorCode float64  // CNI error code printed on failure
	}{
		// VERSION lists exactly the supported versions.
		{"version", "VERSION", "", 0, []string{`"supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]`}, 0},
		// An ADD prints the result in the configuration's version.
		{"add", "ADD", netconf(socket), 0, []string{`"cniVersion": "1.0.0"`, `"address": "10.50.0.9/24"`, `"dst": "0.0.0.0/0"`}, 0},
		// Without an agent, ADD fails with exit 1 and CNI error 11 naming the socket.
		{"add without agent", "ADD", netconf(missing), 1, []string{missing}, 11},
		// An agent error arrives with its code (103 from CHECK).
		{"check not allocated", "CHECK", netconf(socket), 1, []string{"no allocation"}, 103},
		// Invalid configuration is code 7.
		{"bad config", "ADD", strings.Replace(netconf(socket), `"ranges"`, `"rangez"`, 1), 1, []string{`unknown field \"rangez\"`}, 7},
		// DEL succeeds silently.
		{"del", "DEL", netconf(socket), 0, nil, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stdout, stderr, exit := runPlugin(t, tt.command, tt.stdin)
			if exit != tt.exit {
				t.Fatalf("exit %d, want %d\nstdout: %s\nstderr: %s", exit, tt.exit, stdout, stderr)
			}
			for _, want := range tt.stdout {
				if !strings.Contains(stdout, want) {
					t.Errorf("stdout %s does not contain %s", stdout, want)
				}
			}
			if tt.errorCode != 0 {
				var e map[string]any
				if err := json.Unmarshal([]byte(stdout), &e); err != nil || e["code"] != tt.errorCode {
					t.Errorf("stdout %s is not a CNI error with code %v", stdout, tt.errorCode)
				}
			}
		})
	}
}

func TestAbout(t *testing.T) {
	// Run by hand without CNI_COMMAND, the plugin says what it is.
	_, stderr, exit := runPlugin(t, "", "")
	if exit != 0 || !strings.Contains(stderr, "leasehold IPAM: cluster-wide addresses leased from etcd") {
		t.Errorf("exit %d, stderr %q", exit, stderr)
	}
}
