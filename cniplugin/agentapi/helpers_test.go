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

// fakeInvoker stands in for the agent's CNI logic (package cniplugin, which is tested
// there and against a real agent elsewhere): it records the invocations that reach it
// and answers each with its command and stdin on stdout and "warn" on stderr; the
// command FAIL exits 1.
type fakeInvoker struct {
	mu    sync.Mutex
	last  *Invocation
	calls int
	// block, when set, makes every call wait for it to close or for ctx to end.
	block chan struct{}
	// sawDeadline receives the remaining time of each call's context.
	sawDeadline chan time.Duration
}

var _ Invoker = (*fakeInvoker)(nil)

func (f *fakeInvoker) Invoke(ctx context.Context, inv *Invocation) *Output {
	f.mu.Lock()
	f.last, f.calls = inv, f.calls+1
	block, saw := f.block, f.sawDeadline
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
			// As the CNI logic answers a Service call that ran out of time.
			return &Output{Exit: 1, Stdout: []byte(`{"code": 11, "msg": "context deadline exceeded"}`), Err: ctx.Err()}
		}
	}
	return echo(inv)
}

// echo is fakeInvoker's answer to inv.
func echo(inv *Invocation) *Output {
	out := &Output{Stdout: append([]byte(inv.Command+":"), inv.Stdin...), Stderr: []byte("warn")}
	if inv.Command == "FAIL" {
		out.Exit, out.Err = 1, errors.New("failed")
	}
	return out
}

// lastCall returns the last invocation that reached f and how many did.
func (f *fakeInvoker) lastCall() (*Invocation, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.last, f.calls
}

// startServer serves inv on a fresh socket in t.TempDir and stops it at cleanup,
// failing the test if Serve returns an error.
func startServer(t *testing.T, inv Invoker) (socket string, stop func()) {
	t.Helper()
	socket = filepath.Join(t.TempDir(), "run", "lh.sock")
	l, err := Listen(socket)
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, l, inv, nil) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Serve: %v", err)
				}
			case <-time.After(patience):
				t.Errorf("Serve did not return %s after cancel", patience)
			}
		})
	}
	t.Cleanup(stop)
	return socket, stop
}

// testConf is a network configuration naming socket.
func testConf(socket string) []byte {
	return []byte(`{"cniVersion": "1.1.0", "name": "net1", "ipam": {"type": "leasehold", "socket": "` + socket +
		`", "ranges": [[{"subnet": "10.10.0.0/16"}], [{"subnet": "fd10::/64"}]]}}`)
}

// testInvocation is an ADD of one attachment as the plugin sends it to socket.
func testInvocation(socket string) *Invocation {
	inv := NewInvocation("ADD", testConf(socket), "c0ffee", "eth0")
	inv.Args = "K8S_POD_UID=uid-1;IP=10.10.1.7"
	return inv
}

// testResult is the allocator.Result of a dual-stack ADD.
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
