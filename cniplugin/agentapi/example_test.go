package agentapi_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// oneAddress is a toy Service: every ADD gets 10.10.1.7, every STATUS says exhausted.
type oneAddress struct{}

func (oneAddress) Add(context.Context, allocator.Request) (allocator.Result, error) {
	return allocator.Result{IPs: []allocator.IPConfig{{Address: netip.MustParsePrefix("10.10.1.7/16")}}}, nil
}
func (oneAddress) Del(context.Context, allocator.Request) error { return nil }
func (oneAddress) Check(context.Context, allocator.Request) (allocator.Result, error) {
	return allocator.Result{}, allocator.ErrNotAllocated
}
func (oneAddress) GC(context.Context, allocator.GCRequest) error { return nil }
func (oneAddress) Status(context.Context, allocator.StatusRequest) error {
	return fmt.Errorf("pool net1 set 0: %w", allocator.ErrPoolExhausted)
}

// The agent listens and serves; the plugin calls it with a Client.
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
	served := make(chan error)
	go func() { served <- agentapi.Serve(ctx, l, oneAddress{}, nil) }()

	c := &agentapi.Client{Socket: socket}
	res, err := c.Add(context.Background(), allocator.Request{Network: "net1", ContainerID: "c1", IfName: "eth0"})
	fmt.Println(res.IPs[0].Address, err)

	err = c.Status(context.Background(), allocator.StatusRequest{Network: "net1"})
	var e *agentapi.Error
	errors.As(err, &e)
	fmt.Println(e.Code, errors.Is(err, allocator.ErrPoolExhausted), err)

	stop()
	fmt.Println(<-served)
	// Output:
	// 10.10.1.7/16 <nil>
	// 102 true pool net1 set 0: pool exhausted
	// <nil>
}
