package agentapi_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// oneAddress is a toy Invoker in place of the agent's CNI logic (package cniplugin): every
// ADD prints a result with 10.10.1.7, every other command fails as the CNI logic prints
// a pool that is exhausted.
type oneAddress struct{}

func (oneAddress) Invoke(_ context.Context, inv *agentapi.Invocation) *agentapi.Output {
	if inv.Command == "ADD" {
		return &agentapi.Output{Stdout: []byte(`{"cniVersion": "1.1.0", "ips": [{"address": "10.10.1.7/16"}]}`)}
	}
	return &agentapi.Output{Exit: 1, Stdout: []byte(`{"code": 102, "msg": "pool net1 set 0: pool exhausted"}`)}
}

// The agent listens and serves; a client sends invocations as the plugin binary does.
func Example() {
	dir, _ := os.MkdirTemp("", "leasehold-example")
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "leaseholdd.sock")

	l, err := agentapi.Listen(socket)
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	served := make(chan error, 1)
	go func() { served <- agentapi.Serve(ctx, l, oneAddress{}, nil) }()

	conf := []byte(`{"cniVersion": "1.1.0", "name": "net1", "ipam": {"type": "leasehold", "socket": "` + socket + `"}}`)
	c := &agentapi.Client{Socket: socket}
	out, err := c.Invoke(context.Background(), agentapi.NewInvocation("ADD", conf, "c1", "eth0"))
	if err != nil {
		fmt.Println(err)
		return
	}
	res, err := out.Result()
	fmt.Println(out.Exit, res.IPs[0].Address, err)

	out, err = c.Invoke(context.Background(), agentapi.NewInvocation("STATUS", conf, "", ""))
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = out.Result()
	var e *agentapi.Error
	errors.As(err, &e)
	fmt.Println(out.Exit, e.Code, errors.Is(err, allocator.ErrPoolExhausted), err)

	stop()
	fmt.Println(<-served)
	// Output:
	// 0 10.10.1.7/16 <nil>
	// 1 102 true pool net1 set 0: pool exhausted
	// <nil>
}
