package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// TestMain lets the test binary act as the plugin: the tests below run it again with
// LEASEHOLD_TEST_PLUGIN=1 and the CNI environment, exercising main, skel and the exit
// code exactly as a runtime would.
//
// With LEASEHOLD_TEST_PLUGIN=skel it is instead the plugin as it was before it became a
// thin client: the same handlers, run in the plugin process by the CNI library's skel,
// calling the stub agent in-process as if it had dialed LEASEHOLD_TEST_SOCKET.
// TestThinPluginAnswersAsSkelDid compares the two.
func TestMain(m *testing.M) {
	switch os.Getenv("LEASEHOLD_TEST_PLUGIN") {
	case "1":
		main()
		os.Exit(0)
	case "skel":
		p := &cniplugin.Plugin{Service: agent{}, Socket: os.Getenv("LEASEHOLD_TEST_SOCKET"), Stdout: os.Stdout}
		skel.PluginMainFuncs(p.Funcs(), version.PluginSupports(cniplugin.SupportedVersions...), cniplugin.About)
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

// startAgent serves the stub agent as leaseholdd serves its own (cniplugin.Served) on a
// socket in t.TempDir until the test ends.
func startAgent(t *testing.T) string {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "lh.sock")
	l, err := agentapi.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- agentapi.Serve(ctx, l, cniplugin.Served(agent{}), nil) }()
	t.Cleanup(func() { cancel(); <-done })
	return socket
}

// startOldAgent answers every request as a leaseholdd from before the cni operation
// answered it: an unknown operation.
func startOldAgent(t *testing.T) string {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "old.sock")
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(2 * time.Minute)) // a bound for a client that never finishes, not a figure
				_, _ = io.Copy(io.Discard, c)
				_, _ = io.WriteString(c, `{"version":1,"error":{"code":6,"msg":"agent protocol error: unknown operation \"cni\"; `+
					`leaseholdd knows add, del, check, gc and status","sentinel":"ErrProtocol"}}`)
			}()
		}
	}()
	return socket
}

// runPlugin executes the plugin with command and stdin; it returns stdout, stderr and
// the exit code.
func runPlugin(t *testing.T, command, stdin string) (string, string, int) {
	t.Helper()
	env := []string{"CNI_PATH=/opt/cni/bin", "CNI_CONTAINERID=c0ffee",
		"CNI_IFNAME=eth0", "CNI_NETNS=/var/run/netns/test", "CNI_NETNS_OVERRIDE=1", "CNI_ARGS=K8S_POD_UID=uid-9"}
	if command != "" {
		env = append(env, "CNI_COMMAND="+command)
	}
	return runAs(t, "1", env, stdin)
}

// runAs executes the test binary as plugin mode ("1" or "skel") with env and stdin.
func runAs(t *testing.T, mode string, env []string, stdin string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append([]string{"LEASEHOLD_TEST_PLUGIN=" + mode}, env...)
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
		// STATUS without an agent: the plugin is not available (50), and says why.
		{"status without agent", "STATUS", strings.Replace(netconf(missing), "1.0.0", "1.1.0", 1), 1,
			[]string{missing, "is leaseholdd running"}, 50},
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

// TestPluginRefusals covers what only the thin plugin does: it refuses to be served by
// an agent the configuration does not name, tells an agent that predates it apart from a
// broken one, and refuses a container namespace that is its own.
func TestPluginRefusals(t *testing.T) {
	socket := startAgent(t)
	env := []string{"CNI_COMMAND=ADD", "CNI_PATH=/opt/cni/bin", "CNI_CONTAINERID=c0ffee", "CNI_IFNAME=eth0",
		"CNI_NETNS=/var/run/netns/test", "CNI_NETNS_OVERRIDE=1"}
	cniErr := func(t *testing.T, stdout string, exit int, code uint, msg string) {
		t.Helper()
		var e types.Error
		if err := json.Unmarshal([]byte(stdout), &e); err != nil || exit != 1 || e.Code != code || !strings.Contains(e.Msg, msg) {
			t.Errorf("exit %d, stdout %s; want exit 1 and CNI error %d containing %q", exit, stdout, code, msg)
		}
	}
	t.Run("socket read differently", func(t *testing.T) {
		// encoding/json matches "ſocket" (long s) to "socket"; the plugin's reader does
		// not, so the two disagree on the socket, and the agent refuses with code 7.
		conf := strings.Replace(netconf(socket), `"ranges"`, `"ſocket": "/elsewhere.sock", "ranges"`, 1)
		stdout, _, exit := runAs(t, "1", env, conf)
		cniErr(t, stdout, exit, 7, "names /elsewhere.sock")
	})
	t.Run("agent without CNI invocations", func(t *testing.T) {
		old := startOldAgent(t)
		stdout, _, exit := runAs(t, "1", env, netconf(old))
		cniErr(t, stdout, exit, 11, "upgrade leaseholdd")
		stdout, _, exit = runAs(t, "1", append(slices.Clone(env), "CNI_COMMAND=STATUS"), strings.Replace(netconf(old), "1.0.0", "1.1.0", 1))
		cniErr(t, stdout, exit, 50, "upgrade leaseholdd")
	})
	t.Run("own network namespace", func(t *testing.T) {
		own := []string{"CNI_COMMAND=ADD", "CNI_PATH=/opt/cni/bin", "CNI_CONTAINERID=c0ffee", "CNI_IFNAME=eth0", "CNI_NETNS=/proc/self/ns/net"}
		stdout, _, exit := runAs(t, "1", own, netconf(socket))
		cniErr(t, stdout, exit, 8, "should not be the same")
		stdout, _, exit = runAs(t, "1", append(own, "CNI_NETNS_OVERRIDE=true"), netconf(socket))
		if exit != 0 || !strings.Contains(stdout, "10.50.0.9/24") {
			t.Errorf("with CNI_NETNS_OVERRIDE: exit %d, stdout %s", exit, stdout)
		}
	})
}

func TestAbout(t *testing.T) {
	// Run by hand without CNI_COMMAND, the plugin says what it is.
	_, stderr, exit := runPlugin(t, "", "")
	if exit != 0 || !strings.Contains(stderr, "leasehold IPAM: cluster-wide addresses leased from etcd") {
		t.Errorf("exit %d, stderr %q", exit, stderr)
	}
}

// TestThinPluginAnswersAsSkelDid runs each invocation through the thin plugin (the
// agent runs the CNI logic) and through the plugin as it was (skel and the same handlers
// in the plugin process), and requires the same exit status and stdout byte for byte:
// moving the work into the agent must change nothing a runtime sees. (A missing agent,
// which only the thin plugin can meet now, is TestPluginBinary's.)
func TestThinPluginAnswersAsSkelDid(t *testing.T) {
	socket := startAgent(t)
	full := []string{"CNI_PATH=/opt/cni/bin", "CNI_CONTAINERID=c0ffee", "CNI_IFNAME=eth0",
		"CNI_NETNS=/var/run/netns/test", "CNI_NETNS_OVERRIDE=1", "CNI_ARGS=K8S_POD_UID=uid-9"}
	conf := func(version, extra string) string {
		return `{"cniVersion": "` + version + `", "name": "net5", "type": "macvlan", ` + extra + `"ipam": {"type": "leasehold", "socket": "` +
			socket + `", "ranges": [[{"subnet": "10.50.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}}`
	}
	without := func(name string) []string {
		var out []string
		for _, e := range full {
			if !strings.HasPrefix(e, name+"=") {
				out = append(out, e)
			}
		}
		return out
	}
	cases := []struct {
		name, command string
		env           []string
		stdin         string
	}{
		{"add 1.0.0", "ADD", full, conf("1.0.0", "")},
		{"add 0.3.1", "ADD", full, conf("0.3.1", "")},
		{"add 1.1.0 with dns", "ADD", full, strings.Replace(conf("1.1.0", ""), `"routes"`, `"dns": {"nameservers": ["10.50.0.10"]}, "routes"`, 1)},
		{"add unsupported version", "ADD", full, conf("9.9.9", "")},
		{"add unparsable version", "ADD", full, conf("x.y", "")},
		{"add no version", "ADD", full, strings.Replace(conf("1.0.0", ""), `"cniVersion": "1.0.0", `, "", 1)},
		{"add without CNI_PATH and CNI_CONTAINERID", "ADD", without("CNI_PATH")[1:], conf("1.0.0", "")},
		{"add with a bad interface name", "ADD", append(without("CNI_IFNAME"), "CNI_IFNAME=a/b"), conf("1.0.0", "")},
		{"add with a bad container ID", "ADD", append(without("CNI_CONTAINERID"), "CNI_CONTAINERID=-x"), conf("1.0.0", "")},
		// Not JSON is answered by the plugin itself (it cannot find the socket), with the
		// same code and its own wording of where the document breaks; compared below.
		{"add no name", "ADD", full, strings.Replace(conf("1.0.0", ""), `"name": "net5", `, "", 1)},
		{"add bad name", "ADD", full, strings.Replace(conf("1.0.0", ""), `"net5"`, `"net/5"`, 1)},
		{"add invalid ipam", "ADD", full, strings.Replace(conf("1.0.0", ""), `"ranges"`, `"rangez"`, 1)},
		{"add with CNI_ARGS IP", "ADD", append(without("CNI_ARGS"), "CNI_ARGS=K8S_POD_UID=uid-9;IP=10.50.0.9"), conf("1.0.0", "")},
		{"check 1.0.0", "CHECK", full, conf("1.0.0", "")},
		{"check 0.3.1", "CHECK", full, conf("0.3.1", "")},
		{"del", "DEL", full, conf("1.0.0", "")},
		{"del with a broken ipam", "DEL", full, strings.Replace(conf("1.0.0", ""), `"ranges"`, `"rangez"`, 1)},
		{"del without netns", "DEL", without("CNI_NETNS"), conf("1.0.0", "")},
		{"gc 1.1.0", "GC", full, conf("1.1.0", `"cni.dev/valid-attachments": [{"containerID": "c0ffee", "ifname": "eth0"}], `)},
		{"gc without valid attachments", "GC", full, conf("1.1.0", "")},
		{"gc 1.0.0", "GC", full, conf("1.0.0", "")},
		{"status 1.1.0", "STATUS", full, conf("1.1.0", "")},
		{"status 0.4.0", "STATUS", full, conf("0.4.0", "")},
		{"unknown command", "FROB", full, conf("1.0.0", "")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			env := append(slices.Clone(tc.env), "CNI_COMMAND="+tc.command)
			gotOut, gotErr, gotExit := runAs(t, "1", env, tc.stdin)
			wantOut, wantErr, wantExit := runAs(t, "skel", append(env, "LEASEHOLD_TEST_SOCKET="+socket), tc.stdin)
			if gotExit != wantExit || gotOut != wantOut {
				t.Errorf("thin plugin: exit %d, stdout %s\nskel plugin: exit %d, stdout %s", gotExit, gotOut, wantExit, wantOut)
			}
			if gotErr != wantErr {
				t.Errorf("thin plugin stderr %q, skel plugin stderr %q", gotErr, wantErr)
			}
		})
	}
	for _, stdin := range []string{`{"cniVersion": `, `{"a": 1} x`, `not json`, ``} {
		env := append(slices.Clone(full), "CNI_COMMAND=ADD")
		gotOut, _, gotExit := runAs(t, "1", env, stdin)
		wantOut, _, wantExit := runAs(t, "skel", env, stdin)
		var got, want types.Error
		if err := json.Unmarshal([]byte(gotOut), &got); err != nil || gotExit != wantExit ||
			json.Unmarshal([]byte(wantOut), &want) != nil || got.Code != want.Code || got.Code != types.ErrDecodingFailure ||
			!strings.HasPrefix(got.Msg, "error unmarshall network config: ") {
			t.Errorf("stdin %q: thin plugin exit %d, stdout %s; skel plugin exit %d, stdout %s", stdin, gotExit, gotOut, wantExit, wantOut)
		}
	}
}
