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

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// agentStub stands in for leaseholdd behind a real agentapi socket: it records what
// reached it and answers as configured. The real agent is tested against etcd elsewhere.
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

// startAgent serves stub on a socket in t.TempDir until the test ends.
func startAgent(t *testing.T, stub *agentStub) string {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "lh.sock")
	l, err := agentapi.Listen(socket)
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- agentapi.Serve(ctx, l, stub, nil) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return socket
}

func dualStack() allocator.Result {
	return allocator.Result{IPs: []allocator.IPConfig{
		{Address: pfx("10.40.0.2/16"), Gateway: addr("10.40.0.1")},
		{Address: pfx("fd40::2/64"), Gateway: addr("fd40::1")},
	}}
}

func cmdArgs(stdin []byte, cniArgs string) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "c0ffee", IfName: "eth0", Netns: "/var/run/netns/x", Args: cniArgs, StdinData: stdin}
}

// codeOf returns err's CNI code, failing unless it is a *types.Error.
func codeOf(t *testing.T, err error) (uint, string) {
	t.Helper()
	var te *types.Error
	if !errors.As(err, &te) {
		t.Fatalf("error %v (%T) is not a *types.Error", err, err)
	}
	return te.Code, te.Msg
}

func TestCmdAdd(t *testing.T) {
	stub := &agentStub{result: dualStack()}
	socket := startAgent(t, stub)
	for _, version := range SupportedVersions {
		t.Run(version, func(t *testing.T) {
			var out bytes.Buffer
			p := &Plugin{Dial: DialAgent, Stdout: &out}
			err := p.CmdAdd(cmdArgs(readTemplate(t, "plugin.json", socket, version), "K8S_POD_UID=uid-1;IP=10.40.0.2"))
			if err != nil {
				t.Fatalf("CmdAdd: %v", err)
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
			if err := json.Unmarshal(out.Bytes(), &got); err != nil {
				t.Fatalf("printed result is not JSON: %v\n%s", err, out.String())
			}
			if got.CNIVersion != version || len(got.IPs) != 2 || got.IPs[0].Address != "10.40.0.2/16" ||
				got.IPs[0].Gateway != "10.40.0.1" || got.IPs[1].Address != "fd40::2/64" {
				t.Errorf("result %s", out.String())
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
				t.Errorf("dns missing: %s", out.String())
			}
		})
	}
}

func TestHandlerErrors(t *testing.T) {
	stub := &agentStub{}
	socket := startAgent(t, stub)
	missing := filepath.Join(t.TempDir(), "nobody.sock")
	good := readTemplate(t, "plugin.json", socket, "1.1.0")
	tests := []struct {
		name     string
		agentErr error
		stdin    []byte
		cmd      func(p *Plugin, a *skel.CmdArgs) error
		code     uint
		msg      string
	}{
		// Agent errors keep their code and message through socket and plugin.
		{"exhausted", fmt.Errorf("pool plug set 0: %w", allocator.ErrPoolExhausted), good, (*Plugin).CmdAdd, 102, "pool plug set 0: pool exhausted"},
		{"in use", allocator.ErrAddressInUse, good, (*Plugin).CmdAdd, 101, "address already allocated"},
		{"mismatch", fmt.Errorf("%w: stored ranges differ", allocator.ErrPoolMismatch), good, (*Plugin).CmdAdd, 7, "stored ranges differ"},
		{"del unavailable", allocator.ErrUnavailable, good, (*Plugin).CmdDel, 11, "agent unavailable"},
		{"check not allocated", allocator.ErrNotAllocated, good, (*Plugin).CmdCheck, 103, "no allocation"},
		// A bad configuration never reaches the agent: 7, or 6 when it is not JSON.
		{"invalid config", nil, readFixture(t, "invalid/route_gw_offlink.json"), (*Plugin).CmdAdd, 7, "not on-link"},
		{"not json", nil, []byte(`{"cniVersion":`), (*Plugin).CmdAdd, 6, "not valid JSON"},
		// No agent: try again later, naming the socket.
		{"no agent", nil, readTemplate(t, "plugin.json", missing, "1.1.0"), (*Plugin).CmdAdd, 11, missing},
		// STATUS failures are "plugin not available" (50), with the agent's words.
		{"status exhausted", allocator.ErrPoolExhausted, good, (*Plugin).CmdStatus, 50, "pool exhausted"},
		{"status no agent", nil, readTemplate(t, "plugin.json", missing, "1.1.0"), (*Plugin).CmdStatus, 50, "is leaseholdd running"},
		// GC errors keep their code.
		{"gc unavailable", allocator.ErrUnavailable, readTemplate(t, "gc.json", socket, ""), (*Plugin).CmdGC, 11, "agent unavailable"},
		// GC without the valid-attachments list would release everything: refused locally.
		{"gc without list", nil, good, (*Plugin).CmdGC, 7, "cni.dev/valid-attachments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stub.mu.Lock()
			stub.err, stub.calls = tt.agentErr, nil
			stub.mu.Unlock()
			var out bytes.Buffer
			err := tt.cmd(&Plugin{Dial: DialAgent, Stdout: &out}, cmdArgs(tt.stdin, ""))
			code, msg := codeOf(t, err)
			if code != tt.code || !strings.Contains(msg, tt.msg) {
				t.Errorf("error code %d %q, want %d containing %q", code, msg, tt.code, tt.msg)
			}
			if out.Len() != 0 {
				t.Errorf("a failed command printed %q", out.String())
			}
			stub.mu.Lock()
			calls := stub.calls
			stub.mu.Unlock()
			if (code == 6 || code == 7) && tt.agentErr == nil && len(calls) != 0 {
				t.Errorf("a bad configuration reached the agent: %v", calls)
			}
		})
	}
}

func TestCmdCheckComparesPrevResult(t *testing.T) {
	stub := &agentStub{}
	socket := startAgent(t, stub)
	conf := readTemplate(t, "check_prev.json", socket, "")
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
			err := (&Plugin{Dial: DialAgent, Stdout: &bytes.Buffer{}}).CmdCheck(cmdArgs(conf, ""))
			if tt.code == 0 {
				if err != nil {
					t.Errorf("CmdCheck: %v", err)
				}
				return
			}
			code, msg := codeOf(t, err)
			if code != tt.code || !strings.Contains(msg, "prevResult lists [10.40.0.2/16, fd40::2/64, 192.168.99.9/24]") ||
				!strings.Contains(msg, "leaseholdd holds [") {
				t.Errorf("error %d %q, want %d naming both address lists", code, msg, tt.code)
			}
		})
	}
}

func TestCmdGCAndDel(t *testing.T) {
	stub := &agentStub{}
	socket := startAgent(t, stub)
	p := &Plugin{Dial: DialAgent, Stdout: &bytes.Buffer{}}
	// GC has no attachment of its own and passes the runtime's valid attachments on.
	if err := p.CmdGC(&skel.CmdArgs{StdinData: readTemplate(t, "gc.json", socket, "")}); err != nil {
		t.Fatalf("CmdGC: %v", err)
	}
	want := []allocator.Attachment{{ContainerID: "c1", IfName: "eth0"}, {ContainerID: "c2", IfName: "net1"}}
	if _, gc := stub.lastReq(); !reflect.DeepEqual(gc.ValidAttachments, want) || gc.Network != "plug" || gc.Pool.Name != "plug" {
		t.Errorf("agent got GC %+v", gc)
	}
	// An explicit empty list is passed on as empty (nothing is valid), not refused.
	empty := strings.Replace(string(readTemplate(t, "gc.json", socket, "")),
		`[{"containerID": "c1", "ifname": "eth0"}, {"containerID": "c2", "ifname": "net1"}]`, "[]", 1)
	if err := p.CmdGC(&skel.CmdArgs{StdinData: []byte(empty)}); err != nil {
		t.Fatalf("CmdGC with empty list: %v", err)
	}
	if _, gc := stub.lastReq(); gc.ValidAttachments == nil || len(gc.ValidAttachments) != 0 {
		t.Errorf("agent got valid attachments %#v, want an empty non-nil list", gc.ValidAttachments)
	}
	// DEL without a netns (allowed by the spec) still reaches the agent.
	a := cmdArgs(readTemplate(t, "plugin.json", socket, "1.1.0"), "")
	a.Netns = ""
	if err := p.CmdDel(a); err != nil {
		t.Fatalf("CmdDel: %v", err)
	}
	if req, _ := stub.lastReq(); req.ContainerID != "c0ffee" || req.IfName != "eth0" {
		t.Errorf("agent got DEL %+v", req)
	}
	// A STATUS with a healthy agent is success.
	if err := p.CmdStatus(&skel.CmdArgs{StdinData: readTemplate(t, "gc.json", socket, "")}); err != nil {
		t.Errorf("CmdStatus: %v", err)
	}
}
