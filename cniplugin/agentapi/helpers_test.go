package agentapi

import (
	"context"
	"errors"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// fakeService stands in for the agent (which is tested elsewhere against a real etcd):
// it records what reached it and answers with whatever the test configured.
type fakeService struct {
	mu      sync.Mutex
	lastReq any
	lastOp  string
	result  allocator.Result
	err     error
	// block, when set, makes every call wait for it to close or for ctx to end.
	block chan struct{}
	// sawDeadline receives the remaining time of each call's context.
	sawDeadline chan time.Duration
}

var _ Service = (*fakeService)(nil)

func (f *fakeService) record(ctx context.Context, op string, req any) error {
	f.mu.Lock()
	f.lastOp, f.lastReq = op, req
	block, err, saw := f.block, f.err, f.sawDeadline
	f.mu.Unlock()
	if saw != nil {
		if d, ok := ctx.Deadline(); ok {
			saw <- time.Until(d)
		} else {
			saw <- -1
		}
	}
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return err
}

func (f *fakeService) Add(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	if err := f.record(ctx, OpAdd, req); err != nil {
		return allocator.Result{}, err
	}
	return f.result, nil
}

func (f *fakeService) Del(ctx context.Context, req allocator.Request) error {
	return f.record(ctx, OpDel, req)
}

func (f *fakeService) Check(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	if err := f.record(ctx, OpCheck, req); err != nil {
		return allocator.Result{}, err
	}
	return f.result, nil
}

func (f *fakeService) GC(ctx context.Context, req allocator.GCRequest) error {
	return f.record(ctx, OpGC, req)
}

func (f *fakeService) Status(ctx context.Context, req allocator.StatusRequest) error {
	return f.record(ctx, OpStatus, req)
}

func (f *fakeService) set(res allocator.Result, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.result, f.err = res, err
}

func (f *fakeService) last() (string, any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastOp, f.lastReq
}

// startServer serves svc on a fresh socket in t.TempDir and stops it at cleanup,
// failing the test if Serve returns an error.
func startServer(t *testing.T, svc Service) (socket string, stop func()) {
	t.Helper()
	socket = filepath.Join(t.TempDir(), "run", "lh.sock")
	l, err := Listen(socket)
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, l, svc, nil) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Serve: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Serve did not return after cancel")
			}
		})
	}
	t.Cleanup(stop)
	return socket, stop
}

func testRequest() allocator.Request {
	return allocator.Request{
		Network: "net1",
		Pool: allocator.PoolSpec{
			Name:   "net1",
			Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.10.0.0/16")}}},
		},
		ContainerID:  "c0ffee",
		IfName:       "eth0",
		Netns:        "/var/run/netns/x",
		Pod:          allocator.PodRef{UID: "uid-1", Namespace: "ns", Name: "pod"},
		RequestedIPs: []netip.Addr{netip.MustParseAddr("10.10.1.7")},
	}
}

func testResult() allocator.Result {
	return allocator.Result{IPs: []allocator.IPConfig{
		{Address: netip.MustParsePrefix("10.10.1.7/16"), Gateway: netip.MustParseAddr("10.10.0.1")},
		{Address: netip.MustParsePrefix("fd10::7/64")},
	}}
}

// asError returns err as an *Error or fails the test.
func asError(t *testing.T, err error) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not an *agentapi.Error", err, err)
	}
	return e
}
