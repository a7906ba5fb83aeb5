package cniplugin

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// panicking is a Service whose Add panics, standing in for a bug on the ADD path.
type panicking struct{ refused }

func (panicking) Add(context.Context, allocator.Request) (allocator.Result, error) { panic("boom") }

// TestInvokeSurvivesAPanic: a panic while running a command is that command's internal
// error (code 999), not the end of the agent.
func TestInvokeSurvivesAPanic(t *testing.T) {
	inv := &agentapi.Invocation{Command: "ADD", ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0", Path: "/opt/cni/bin",
		Socket: DefaultSocket, Stdin: []byte(`{"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "leasehold", "ranges": [[{"subnet": "10.1.0.0/24"}]]}}`)}
	out := Invoke(context.Background(), panicking{}, inv)
	var e types.Error
	if err := json.Unmarshal(out.Stdout, &e); err != nil || out.Exit != 1 || e.Code != types.ErrInternal ||
		!strings.Contains(e.Msg, "boom") || out.Err == nil {
		t.Fatalf("exit %d, stdout %s, err %v", out.Exit, out.Stdout, out.Err)
	}
}
