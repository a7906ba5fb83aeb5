package cniplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// agentStub stands in for the agent's Service: it records what reached it and answers as
// configured. The real agent is tested against etcd elsewhere.
type agentStub struct {
	mu     sync.Mutex
	calls  []string
	req    allocator.Request
	gc     allocator.GCRequest
	result allocator.Result
	err    error
}

// note records one call under the lock and returns the configured answer.
func (a *agentStub) note(op string, record func()) (allocator.Result, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, op)
	record()
	return a.result, a.err
}

func (a *agentStub) Add(_ context.Context, r allocator.Request) (allocator.Result, error) {
	return a.note("add", func() { a.req = r })
}

func (a *agentStub) Del(_ context.Context, r allocator.Request) error {
	_, err := a.note("del", func() { a.req = r })
	return err
}

func (a *agentStub) Check(_ context.Context, r allocator.Request) (allocator.Result, error) {
	return a.note("check", func() { a.req = r })
}

func (a *agentStub) GC(_ context.Context, r allocator.GCRequest) error {
	_, err := a.note("gc", func() { a.gc = r })
	return err
}

func (a *agentStub) Status(context.Context, allocator.StatusRequest) error {
	_, err := a.note("status", func() {})
	return err
}

// lastReq returns the last ADD/DEL/CHECK and GC requests the stub saw.
func (a *agentStub) lastReq() (allocator.Request, allocator.GCRequest) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.req, a.gc
}

// testSocket is the socket the test configurations name (and the plugin dialed).
const testSocket = "/run/leasehold-test/lh.sock"

// invocation is what the plugin sends for command with stdin and CNI_ARGS cniArgs: for
// the attachment c0ffee/eth0, or no attachment for GC and STATUS, as runtimes call them.
func invocation(command string, stdin []byte, cniArgs string) *agentapi.Invocation {
	containerID, ifName := "c0ffee", "eth0"
	if command == "GC" || command == "STATUS" {
		containerID, ifName = "", ""
	}
	inv := agentapi.NewInvocation(command, stdin, containerID, ifName)
	inv.Args = cniArgs
	return inv
}

// cniErr returns the code and message of the CNI error out printed, failing unless out
// exited 1 with exactly one CNI error object on stdout.
func cniErr(t *testing.T, out *agentapi.Output) (uint, string) {
	t.Helper()
	var e types.Error
	dec := json.NewDecoder(bytes.NewReader(out.Stdout))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil || dec.More() || out.Exit != 1 || out.Err == nil {
		t.Fatalf("exit %d, stdout %q (%v): not one CNI error", out.Exit, out.Stdout, err)
	}
	return e.Code, e.Msg
}

func dualStack() allocator.Result {
	return allocator.Result{IPs: []allocator.IPConfig{
		{Address: pfx("10.40.0.2/16"), Gateway: addr("10.40.0.1")},
		{Address: pfx("fd40::2/64"), Gateway: addr("fd40::1")},
	}}
}

func TestAdd(t *testing.T) {
	stub := &agentStub{result: dualStack()}
	for _, version := range SupportedVersions {
		t.Run(version, func(t *testing.T) {
			out := Invoke(context.Background(), stub,
				invocation("ADD", readTemplate(t, "plugin.json", testSocket, version), "K8S_POD_UID=uid-1;IP=10.40.0.2"))
			if out.Exit != 0 || out.Err != nil {
				t.Fatalf("ADD: exit %d, stdout %s, err %v", out.Exit, out.Stdout, out.Err)
			}
			if req, _ := stub.lastReq(); req.ContainerID != "c0ffee" || req.Pod.UID != "uid-1" || req.Pool.Name != "plug" ||
				!reflect.DeepEqual(req.RequestedIPs, []netip.Addr{addr("10.40.0.2")}) {
				t.Errorf("agent got %+v", req)
			}
			var got struct {
				CNIVersion string `json:"cniVersion"`
				IPs        []struct {
					Address string `json:"address"`
					Gateway string `json:"gateway"`
				} `json:"ips"`
				Routes []struct {
					Dst      string `json:"dst"`
					GW       string `json:"gw"`
					Priority int    `json:"priority"`
				} `json:"routes"`
				DNS types.DNS `json:"dns"`
			}
			if err := json.Unmarshal(out.Stdout, &got); err != nil {
				t.Fatalf("printed result is not JSON: %v\n%s", err, out.Stdout)
			}
			if got.CNIVersion != version || len(got.IPs) != 2 || got.IPs[0].Address != "10.40.0.2/16" ||
				got.IPs[0].Gateway != "10.40.0.1" || got.IPs[1].Address != "fd40::2/64" {
				t.Errorf("result %s", out.Stdout)
			}
			wantRoutes := fmt.Sprint([]any{"0.0.0.0/0", "10.40.0.1", 1024, "0.0.0.0/0", "10.40.0.2", 1025, "::/0", "", 0})
			var gotRoutes []any
			for _, r := range got.Routes {
				gotRoutes = append(gotRoutes, r.Dst, r.GW, r.Priority)
			}
			if fmt.Sprint(gotRoutes) != wantRoutes {
				t.Errorf("routes %v, want %v", gotRoutes, wantRoutes)
			}
			if len(got.DNS.Nameservers) != 1 {
				t.Errorf("dns missing: %s", out.Stdout)
			}
		})
	}
}

func TestCommandErrors(t *testing.T) {
	stub := &agentStub{}
	other := "/run/other/lh.sock"
	good := readTemplate(t, "plugin.json", testSocket, "1.1.0")
	tests := []struct {
		name     string
		agentErr error
		stdin    []byte
		command  string
		dialed   string // the socket the plugin dialed, when not the configuration's
		code     uint
		msg      string
	}{
		// Agent errors keep their code and message through the plugin.
		{"exhausted", fmt.Errorf("pool plug set 0: %w", allocator.ErrPoolExhausted), good, "ADD", "", 102, "pool plug set 0: pool exhausted"},
		{"in use", allocator.ErrAddressInUse, good, "ADD", "", 101, "address already allocated"},
		{"mismatch", fmt.Errorf("%w: stored ranges differ", allocator.ErrPoolMismatch), good, "ADD", "", 7, "stored ranges differ"},
		{"del unavailable", allocator.ErrUnavailable, good, "DEL", "", 11, "agent unavailable"},
		{"check not allocated", allocator.ErrNotAllocated, good, "CHECK", "", 103, "no allocation"},
		// A bad configuration never reaches the agent: 7, or 6 when it is not JSON.
		{"invalid config", nil, readFixture(t, "invalid/route_gw_offlink.json"), "ADD", "", 7, "not on-link"},
		{"not json", nil, []byte(`{"cniVersion":`), "ADD", "", 6, "error unmarshall network config"},
		// The plugin dialed another agent than the configuration names (it read the
		// configuration differently): refused before the agent is asked, naming both.
		{"other socket", nil, readTemplate(t, "plugin.json", other, "1.1.0"), "ADD", testSocket, 7,
			"reached leaseholdd at " + testSocket + ", but the network configuration names " + other},
		{"del other socket", nil, readTemplate(t, "plugin.json", other, "1.1.0"), "DEL", testSocket, 7, "names " + other},
		// STATUS failures are "plugin not available" (50), with the agent's words.
		{"status exhausted", allocator.ErrPoolExhausted, good, "STATUS", "", 50, "pool exhausted"},
		{"status other socket", nil, readTemplate(t, "plugin.json", other, "1.1.0"), "STATUS", testSocket, 50, "names " + other},
		// GC errors keep their code.
		{"gc unavailable", allocator.ErrUnavailable, readTemplate(t, "gc.json", testSocket, ""), "GC", "", 11, "agent unavailable"},
		// GC without the valid-attachments list would release everything: refused locally.
		{"gc without list", nil, good, "GC", "", 7, "cni.dev/valid-attachments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stub.mu.Lock()
			stub.err, stub.calls = tt.agentErr, nil
			stub.mu.Unlock()
			inv := invocation(tt.command, tt.stdin, "")
			if tt.dialed != "" {
				inv.Socket = tt.dialed
			}
			code, msg := cniErr(t, Invoke(context.Background(), stub, inv))
			if code != tt.code || !strings.Contains(msg, tt.msg) {
				t.Errorf("error code %d %q, want %d containing %q", code, msg, tt.code, tt.msg)
			}
			stub.mu.Lock()
			calls := stub.calls
			stub.mu.Unlock()
			if tt.agentErr == nil && len(calls) != 0 {
				t.Errorf("a command refused before the agent reached it: %v", calls)
			}
		})
	}
}

// TestErrorsReachTheRuntime serves the CNI logic on a real socket, as leaseholdd does, and
// sends it invocations as the plugin does: each Service error arrives in the printed CNI
// error with its code and full message, and reads back as its sentinel.
func TestErrorsReachTheRuntime(t *testing.T) {
	stub := &agentStub{}
	socket := filepath.Join(t.TempDir(), "lh.sock")
	l, err := agentapi.Listen(socket)
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- agentapi.Serve(ctx, l, Served(stub), nil) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	c := &agentapi.Client{Socket: socket, Timeout: 2 * time.Minute} // ample for a stub on a busy machine
	conf := readTemplate(t, "plugin.json", socket, "1.1.0")
	tests := []struct {
		name   string
		err    error
		code   uint
		target error
	}{
		// Each sentinel arrives with its code, which stands for its family's sentinel.
		{"config", fmt.Errorf("pool net1: %w", allocator.ErrPoolMismatch), 7, allocator.ErrInvalidConfig},
		{"name", fmt.Errorf("%w: pod UID", allocator.ErrInvalidName), 7, allocator.ErrInvalidConfig},
		{"not in range", allocator.ErrNotInRange, 100, allocator.ErrNotInRange},
		{"in use", allocator.ErrAddressInUse, 101, allocator.ErrAddressInUse},
		{"quarantined", fmt.Errorf("%w: %w", allocator.ErrOnlyQuarantined, allocator.ErrPoolExhausted), 102, allocator.ErrPoolExhausted},
		{"not allocated", allocator.ErrNotAllocated, 103, allocator.ErrNotAllocated},
		{"conflict", allocator.ErrConflict, 104, allocator.ErrConflict},
		{"unavailable", allocator.ErrUnavailable, 11, allocator.ErrUnavailable},
		// An unclassified failure is internal and keeps its message.
		{"internal", errors.New("disk on fire"), 999, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stub.mu.Lock()
			stub.err = tt.err
			stub.mu.Unlock()
			out, err := c.Invoke(context.Background(), invocation("ADD", conf, "K8S_POD_UID=uid-1"))
			if err != nil {
				t.Fatalf("Invoke: %v", err)
			}
			_, err = out.Result()
			var e *agentapi.Error
			if !errors.As(err, &e) {
				t.Fatalf("ADD: exit %d, stdout %s: %v, not an *agentapi.Error", out.Exit, out.Stdout, err)
			}
			if e.Code != tt.code {
				t.Errorf("code %d, want %d", e.Code, tt.code)
			}
			if e.Msg != tt.err.Error() {
				t.Errorf("message %q, want %q", e.Msg, tt.err.Error())
			}
			if tt.target != nil && !errors.Is(err, tt.target) {
				t.Errorf("errors.Is(%v, %v) is false", err, tt.target)
			}
		})
	}
}

func TestCheckComparesPrevResult(t *testing.T) {
	stub := &agentStub{}
	conf := readTemplate(t, "check_prev.json", testSocket, "")
	tests := []struct {
		name string
		held allocator.Result
		code uint // 0: success
	}{
		// The agent holds exactly prevResult's pool addresses; 192.168.99.9 is another
		// plugin's and is ignored.
		{"match", dualStack(), 0},
		// The agent holds a different IPv4 address: both lists are named.
		{"different address", allocator.Result{IPs: []allocator.IPConfig{
			{Address: pfx("10.40.0.3/16")}, {Address: pfx("fd40::2/64")}}}, 103},
		// prevResult has a pool address the agent no longer holds.
		{"address lost", allocator.Result{IPs: []allocator.IPConfig{{Address: pfx("10.40.0.2/16")}}}, 103},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stub.mu.Lock()
			stub.result, stub.err = tt.held, nil
			stub.mu.Unlock()
			out := Invoke(context.Background(), stub, invocation("CHECK", conf, ""))
			if tt.code == 0 {
				if out.Exit != 0 || len(out.Stdout) != 0 {
					t.Errorf("CHECK: exit %d, stdout %s", out.Exit, out.Stdout)
				}
				return
			}
			code, msg := cniErr(t, out)
			if code != tt.code || !strings.Contains(msg, "prevResult lists [10.40.0.2/16, fd40::2/64, 192.168.99.9/24]") ||
				!strings.Contains(msg, "leaseholdd holds [") {
				t.Errorf("error %d %q, want %d naming both address lists", code, msg, tt.code)
			}
		})
	}
}

func TestGCAndDel(t *testing.T) {
	stub := &agentStub{}
	ok := func(t *testing.T, what string, out *agentapi.Output) {
		t.Helper()
		if out.Exit != 0 || len(out.Stdout) != 0 || out.Err != nil {
			t.Fatalf("%s: exit %d, stdout %s, err %v", what, out.Exit, out.Stdout, out.Err)
		}
	}
	// GC has no attachment of its own and passes the runtime's valid attachments on.
	gc := readTemplate(t, "gc.json", testSocket, "")
	ok(t, "GC", Invoke(context.Background(), stub, invocation("GC", gc, "")))
	want := []allocator.Attachment{{ContainerID: "c1", IfName: "eth0"}, {ContainerID: "c2", IfName: "net1"}}
	if _, gc := stub.lastReq(); !reflect.DeepEqual(gc.ValidAttachments, want) || gc.Network != "plug" || gc.Pool.Name != "plug" {
		t.Errorf("agent got GC %+v", gc)
	}
	// An explicit empty list is passed on as empty (nothing is valid), not refused.
	empty := strings.Replace(string(gc), `[{"containerID": "c1", "ifname": "eth0"}, {"containerID": "c2", "ifname": "net1"}]`, "[]", 1)
	ok(t, "GC with empty list", Invoke(context.Background(), stub, invocation("GC", []byte(empty), "")))
	if _, gc := stub.lastReq(); gc.ValidAttachments == nil || len(gc.ValidAttachments) != 0 {
		t.Errorf("agent got valid attachments %#v, want an empty non-nil list", gc.ValidAttachments)
	}
	// DEL without a netns (allowed by the spec) still reaches the agent.
	del := invocation("DEL", readTemplate(t, "plugin.json", testSocket, "1.1.0"), "")
	del.Netns = ""
	ok(t, "DEL", Invoke(context.Background(), stub, del))
	if req, _ := stub.lastReq(); req.ContainerID != "c0ffee" || req.IfName != "eth0" {
		t.Errorf("agent got DEL %+v", req)
	}
	// A STATUS with a healthy agent is success.
	ok(t, "STATUS", Invoke(context.Background(), stub, invocation("STATUS", gc, "")))
}
