package cniplugin

import (
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// panicking is a Service whose Add panics, standing in for a bug on the ADD path.
type panicking struct{ agentStub }

func (*panicking) Add(context.Context, allocator.Request) (allocator.Result, error) { panic("boom") }

// TestInvokeSurvivesAPanic: a panic while running a command is that command's internal
// error (code 999), not the end of the agent.
func TestInvokeSurvivesAPanic(t *testing.T) {
	inv := &agentapi.Invocation{Command: "ADD", ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0", Path: "/opt/cni/bin",
		Socket: DefaultSocket, Stdin: []byte(`{"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "leasehold", "ranges": [[{"subnet": "10.1.0.0/24"}]]}}`)}
	out := Invoke(context.Background(), &panicking{}, inv)
	var e types.Error
	if err := json.Unmarshal(out.Stdout, &e); err != nil || out.Exit != 1 || e.Code != types.ErrInternal ||
		!strings.Contains(e.Msg, "boom") || out.Err == nil {
		t.Fatalf("exit %d, stdout %s, err %v", out.Exit, out.Stdout, out.Err)
	}
}

// recording is a Service that answers every call and remembers the ADD requests it saw.
type recording struct {
	adds []allocator.Request
}

func (r *recording) Add(_ context.Context, req allocator.Request) (allocator.Result, error) {
	r.adds = append(r.adds, req)
	return allocator.Result{IPs: []allocator.IPConfig{{Address: netip.MustParsePrefix("10.1.0.5/24")}}}, nil
}
func (r *recording) Del(context.Context, allocator.Request) error { return nil }
func (r *recording) Check(context.Context, allocator.Request) (allocator.Result, error) {
	return allocator.Result{IPs: []allocator.IPConfig{{Address: netip.MustParsePrefix("10.1.0.5/24")}}}, nil
}
func (r *recording) GC(context.Context, allocator.GCRequest) error         { return nil }
func (r *recording) Status(context.Context, allocator.StatusRequest) error { return nil }

// FuzzInvoke runs arbitrary invocations (command, environment, stdin) in the agent, as the
// thin plugin forwards them. The agent parses them now, so they must not hurt it.
// Properties:
//
//   - Invoke never panics out (it would recover into code 999, which counts as a failure
//     here too: every error has a code from the CNI table or the agent's);
//   - the exit status is 0 or 1, and on 1 stdout is exactly one CNI error object;
//   - an ADD reaches the service only with names that pass allocator.ValidateName, and
//     only when the configuration names the socket the plugin dialed;
//   - on exit 0 an ADD printed a result with the service's address.
func FuzzInvoke(f *testing.F) {
	conf := `{"cniVersion":"1.0.0","name":"n","ipam":{"type":"leasehold","socket":"/s","ranges":[[{"subnet":"10.1.0.0/24"}]]}}`
	f.Add("ADD", "c1", "eth0", "/var/run/netns/x", "K8S_POD_UID=u1", "/s", []byte(conf))
	f.Add("DEL", "c1", "eth0", "", "", "/s", []byte(conf))
	f.Add("CHECK", "c1", "eth0", "/x", "", "/s", []byte(strings.Replace(conf, "1.0.0", "0.3.1", 1)))
	f.Add("GC", "", "", "", "", "/s", []byte(strings.Replace(conf, `"name"`, `"cni.dev/valid-attachments":[],"name"`, 1)))
	f.Add("STATUS", "", "", "", "", "/other", []byte(strings.Replace(conf, "1.0.0", "1.1.0", 1)))
	// Repeated keys: encoding/json takes the last, so the configuration names /t.
	f.Add("ADD", "c1", "eth0", "/x", "IP=10.1.0.7", "/s", []byte(strings.Replace(conf, `"socket":"/s"`, `"socket":"/s","Socket":"/t"`, 1)))
	f.Fuzz(func(t *testing.T, cmd, containerID, ifName, netns, args, socket string, stdin []byte) {
		svc := &recording{}
		inv := &agentapi.Invocation{Command: cmd, ContainerID: containerID, IfName: ifName, Netns: netns, Args: args,
			Path: "/opt/cni/bin", Socket: socket, Stdin: stdin}
		out := Invoke(context.Background(), svc, inv)
		switch out.Exit {
		case 0:
			if out.Err != nil {
				t.Fatalf("exit 0 with error %v", out.Err)
			}
			if cmd == "ADD" && !strings.Contains(string(out.Stdout), "10.1.0.5/24") {
				t.Fatalf("ADD exit 0 printed %s", out.Stdout)
			}
		case 1:
			var e types.Error
			dec := json.NewDecoder(strings.NewReader(string(out.Stdout)))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&e); err != nil || dec.More() {
				t.Fatalf("exit 1 stdout %q is not one CNI error: %v", out.Stdout, err)
			}
			if e.Code == 0 || e.Code == types.ErrInternal {
				t.Fatalf("CNI error code %d: %s (%s)", e.Code, e.Msg, e.Details)
			}
		default:
			t.Fatalf("exit %d", out.Exit)
		}
		for _, req := range svc.adds {
			if _, got := agentOfConfig(stdin); got != socket {
				t.Errorf("ADD reached the service although the configuration names %q and the plugin dialed %q", got, socket)
			}
			for what, name := range map[string]string{"network": req.Network, "pool": req.Pool.Name, "container ID": req.ContainerID,
				"interface": req.IfName} {
				if err := allocator.ValidateName(what, name); err != nil {
					t.Errorf("ADD reached the service with %s %q: %v", what, name, err)
				}
			}
		}
	})
}

// agentOfConfig reads ipam.socket as the thin plugin's rule says (an absolute path, else
// the default), with encoding/json.
func agentOfConfig(stdin []byte) (bool, string) {
	var c struct {
		IPAM struct {
			Socket json.RawMessage `json:"socket"`
		} `json:"ipam"`
	}
	socket := DefaultSocket
	if json.Unmarshal(stdin, &c) != nil {
		return false, socket
	}
	var s string
	if json.Unmarshal(c.IPAM.Socket, &s) == nil && strings.HasPrefix(s, "/") {
		socket = s
	}
	return true, socket
}
