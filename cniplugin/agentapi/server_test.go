package agentapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

func TestRoundTrip(t *testing.T) {
	svc := &fakeService{}
	svc.set(testResult(), nil)
	socket, _ := startServer(t, svc)
	c := &Client{Socket: socket, Timeout: 5 * time.Second}
	ctx := context.Background()
	req := testRequest()
	gc := allocator.GCRequest{Network: "net1", Pool: req.Pool, ValidAttachments: []allocator.Attachment{{ContainerID: "c1", IfName: "eth0"}}}
	st := allocator.StatusRequest{Network: "net1", Pool: req.Pool}

	tests := []struct {
		name    string
		op      string
		call    func() (any, error)
		wantReq any
		wantRes any
	}{
		// ADD carries the full request and returns the agent's result unchanged.
		{"add", OpAdd, func() (any, error) { return c.Add(ctx, req) }, req, testResult()},
		// CHECK returns the result too.
		{"check", OpCheck, func() (any, error) { return c.Check(ctx, req) }, req, testResult()},
		// DEL, GC and STATUS return only success.
		{"del", OpDel, func() (any, error) { return nil, c.Del(ctx, req) }, req, nil},
		{"gc", OpGC, func() (any, error) { return nil, c.GC(ctx, gc) }, gc, nil},
		{"status", OpStatus, func() (any, error) { return nil, c.Status(ctx, st) }, st, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := tt.call()
			if err != nil {
				t.Fatalf("%s: %v", tt.op, err)
			}
			if tt.wantRes != nil && !reflect.DeepEqual(res, tt.wantRes) {
				t.Errorf("result %+v, want %+v", res, tt.wantRes)
			}
			op, got := svc.last()
			if op != tt.op || !reflect.DeepEqual(got, tt.wantReq) {
				t.Errorf("service saw %s %+v, want %s %+v", op, got, tt.op, tt.wantReq)
			}
		})
	}
}

func TestErrorsCrossTheSocket(t *testing.T) {
	svc := &fakeService{}
	socket, _ := startServer(t, svc)
	c := &Client{Socket: socket, Timeout: 5 * time.Second}
	tests := []struct {
		name   string
		err    error
		code   uint
		target error
	}{
		// Each sentinel arrives with its code and still matches with errors.Is.
		{"config", fmt.Errorf("pool net1: %w", allocator.ErrPoolMismatch), 7, allocator.ErrPoolMismatch},
		{"name", fmt.Errorf("%w: pod UID", allocator.ErrInvalidName), 7, allocator.ErrInvalidName},
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
			svc.set(allocator.Result{}, tt.err)
			_, err := c.Add(context.Background(), testRequest())
			e := asError(t, err)
			if e.Code != tt.code {
				t.Errorf("code %d, want %d", e.Code, tt.code)
			}
			if e.Msg != tt.err.Error() {
				t.Errorf("message %q, want %q", e.Msg, tt.err.Error())
			}
			if tt.target != nil && !errors.Is(err, tt.target) {
				t.Errorf("errors.Is(%v, %v) is false on the client", err, tt.target)
			}
		})
	}
}

// rawCall writes payload on a fresh connection and decodes the answer.
func rawCall(t *testing.T, socket string, payload []byte) WireResponse {
	t.Helper()
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	go func() {
		_, _ = conn.Write(payload)
		_ = conn.(*net.UnixConn).CloseWrite()
	}()
	var resp WireResponse
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		t.Fatalf("reading response: %v", err)
	}
	return resp
}

func TestServerRefusesBadRequests(t *testing.T) {
	socket, _ := startServer(t, &fakeService{})
	body, _ := json.Marshal(testRequest())
	big := []byte(`{"version":1,"op":"add","request":{"network":"` + strings.Repeat("x", 2<<20) + `"}}`)
	tests := []struct {
		name    string
		payload []byte
		want    string
	}{
		// A request over 1 MiB is refused before it is decoded.
		{"oversize", big, "more than 1048576 bytes"},
		// Another protocol version must not be guessed at.
		{"version", []byte(`{"version":2,"op":"add","request":` + string(body) + `}`), "protocol version 1 but the request has version 2"},
		// A missing version is version 0: refused the same way.
		{"no version", []byte(`{"op":"add","request":` + string(body) + `}`), "has version 0"},
		// Unknown operations are named in the error.
		{"unknown op", []byte(`{"version":1,"op":"frobnicate","request":{}}`), `unknown operation "frobnicate"`},
		// A body of the wrong shape is a decoding failure.
		{"bad body", []byte(`{"version":1,"op":"add","request":{"ifName":7}}`), "decoding add request"},
		// No body at all.
		{"no body", []byte(`{"version":1,"op":"del"}`), "no \"request\" body"},
		// Not JSON.
		{"garbage", []byte(`hello`), "undecodable JSON"},
		// The client half-closed in the middle of its request.
		{"truncated", []byte(`{"version":1,"op":`), "cut short"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := rawCall(t, socket, tt.payload)
			if resp.Error == nil || resp.Error.Code != CodeDecodingFailure {
				t.Fatalf("response %+v, want a code 6 error", resp)
			}
			if !strings.Contains(resp.Error.Msg, tt.want) {
				t.Errorf("message %q does not contain %q", resp.Error.Msg, tt.want)
			}
			if resp.Version != ProtocolVersion {
				t.Errorf("response version %d, want %d", resp.Version, ProtocolVersion)
			}
		})
	}
}

func TestClientRefusesOversizeLocally(t *testing.T) {
	// The socket does not exist: a dial would yield code 11, so code 6 proves the size
	// check happens before any connection.
	c := &Client{Socket: filepath.Join(t.TempDir(), "none.sock")}
	req := testRequest()
	req.Netns = strings.Repeat("n", MaxMessageSize)
	_, err := c.Add(context.Background(), req)
	if e := asError(t, err); e.Code != CodeDecodingFailure || !errors.Is(err, ErrProtocol) {
		t.Errorf("error %+v, want code 6 ErrProtocol", e)
	}
}

func TestClientMissingSocket(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "missing.sock")
	err := (&Client{Socket: socket}).Status(context.Background(), allocator.StatusRequest{Network: "n"})
	e := asError(t, err)
	if e.Code != CodeTryAgainLater || !errors.Is(err, allocator.ErrUnavailable) {
		t.Errorf("error %+v, want code 11 ErrUnavailable", e)
	}
	for _, want := range []string{socket, "leaseholdd", "running"} {
		if !strings.Contains(e.Msg, want) {
			t.Errorf("message %q does not mention %q", e.Msg, want)
		}
	}
}

func TestSlowClientDoesNotBlockOthers(t *testing.T) {
	svc := &fakeService{}
	svc.set(testResult(), nil)
	socket, _ := startServer(t, svc)
	slow, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer slow.Close()
	// The slow client is connected and silent; a second client must be served at once.
	start := time.Now()
	if _, err := (&Client{Socket: socket, Timeout: 3 * time.Second}).Add(context.Background(), testRequest()); err != nil {
		t.Fatalf("second client: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("second client took %s", d)
	}
}

func TestSilentClientTimesOut(t *testing.T) {
	old := readTimeout
	readTimeout = 200 * time.Millisecond
	t.Cleanup(func() { readTimeout = old })
	socket, _ := startServer(t, &fakeService{})
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	_, _ = conn.Write([]byte(`{"version":1,`)) // never finished
	var resp WireResponse
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		t.Fatalf("reading response: %v", err)
	}
	if resp.Error == nil || resp.Error.Code != CodeDecodingFailure || !strings.Contains(resp.Error.Msg, "no complete request within") {
		t.Errorf("response %+v, want a read-timeout error", resp.Error)
	}
}

func TestRequestDeadlineFollowsClient(t *testing.T) {
	svc := &fakeService{block: make(chan struct{}), sawDeadline: make(chan time.Duration, 1)}
	socket, _ := startServer(t, svc)
	_, err := (&Client{Socket: socket, Timeout: 500 * time.Millisecond}).Add(context.Background(), testRequest())
	if e := asError(t, err); e.Code != CodeTryAgainLater {
		t.Errorf("error %+v, want code 11 after the client's timeout", e)
	}
	if d := <-svc.sawDeadline; d <= 0 || d > 500*time.Millisecond {
		t.Errorf("service context had %s left, want at most the client's 500ms", d)
	}
}

func TestShutdownWaitsForInFlight(t *testing.T) {
	svc := &fakeService{block: make(chan struct{})}
	svc.set(testResult(), nil)
	socket, stop := startServer(t, svc)
	errc := make(chan error, 1)
	go func() {
		_, err := (&Client{Socket: socket, Timeout: 10 * time.Second}).Add(context.Background(), testRequest())
		errc <- err
	}()
	for op, _ := svc.last(); op == ""; op, _ = svc.last() {
		time.Sleep(5 * time.Millisecond)
	}
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	time.Sleep(100 * time.Millisecond)
	// Shutdown has begun: no new connections, but the running request is still served.
	if _, err := net.Dial("unix", socket); err == nil {
		t.Errorf("socket still accepts connections during shutdown")
	}
	close(svc.block)
	if err := <-errc; err != nil {
		t.Errorf("in-flight request failed across shutdown: %v", err)
	}
	<-stopped
	if _, err := os.Lstat(socket); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("socket file left behind after shutdown: %v", err)
	}
}

func TestListen(t *testing.T) {
	t.Run("mode", func(t *testing.T) {
		// The socket is root-only and its new parent directory private.
		dir := filepath.Join(t.TempDir(), "new")
		l, err := Listen(filepath.Join(dir, "s.sock"))
		if err != nil {
			t.Fatalf("Listen: %v", err)
		}
		defer l.Close()
		fi, err := os.Lstat(filepath.Join(dir, "s.sock"))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Type() != fs.ModeSocket || fi.Mode().Perm() != 0o600 {
			t.Errorf("socket mode %s, want socket 0600", fi.Mode())
		}
		if di, err := os.Stat(dir); err != nil || di.Mode().Perm() != 0o700 {
			t.Errorf("directory mode %v (%v), want 0700", di.Mode(), err)
		}
		if entries, _ := os.ReadDir(dir); len(entries) != 1 {
			t.Errorf("directory holds %d entries, want only the socket", len(entries))
		}
		if got := l.Addr().String(); got != filepath.Join(dir, "s.sock") {
			t.Errorf("Addr %q, want the socket path", got)
		}
	})
	t.Run("stale socket replaced", func(t *testing.T) {
		// A crashed agent leaves its socket behind; nothing answers, so it is replaced.
		path := filepath.Join(t.TempDir(), "s.sock")
		ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		ul.SetUnlinkOnClose(false)
		ul.Close()
		l, err := Listen(path)
		if err != nil {
			t.Fatalf("Listen over a stale socket: %v", err)
		}
		l.Close()
	})
	t.Run("live server refused", func(t *testing.T) {
		// Two agents on one socket would double-allocate: the second must refuse.
		path := filepath.Join(t.TempDir(), "s.sock")
		l, err := Listen(path)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		if _, err := Listen(path); err == nil || !strings.Contains(err.Error(), "another server is live") {
			t.Errorf("second Listen: %v, want an error saying another server is live", err)
		}
	})
	t.Run("regular file kept", func(t *testing.T) {
		// A file that is not a socket is never removed.
		path := filepath.Join(t.TempDir(), "s.sock")
		if err := os.WriteFile(path, []byte("precious"), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := Listen(path); err == nil || !strings.Contains(err.Error(), "not a socket") {
			t.Errorf("Listen over a file: %v, want a not-a-socket error", err)
		}
		if b, _ := os.ReadFile(path); string(b) != "precious" {
			t.Errorf("file was changed")
		}
	})
}

// invoker is a fakeService that also runs whole invocations: it answers with the command
// and the stdin it got, and exit 1 for the command FAIL.
type invoker struct{ *fakeService }

func (invoker) Invoke(_ context.Context, inv *Invocation) *Output {
	out := &Output{Stdout: append([]byte(inv.Command+":"), inv.Stdin...), Stderr: []byte("warn")}
	if inv.Command == "FAIL" {
		out.Exit, out.Err = 1, errors.New("failed")
	}
	return out
}

// TestInvokeCrossesTheSocket: an invocation reaches the server's Invoker whole (stdin byte
// for byte, through base64), its output comes back as it was, a failed command is an
// output and not an error, and a server whose service does not run invocations refuses
// with code 6 naming the operation.
func TestInvokeCrossesTheSocket(t *testing.T) {
	socket, _ := startServer(t, invoker{&fakeService{}})
	c := &Client{Socket: socket, Timeout: 5 * time.Second}
	stdin := []byte("{\"name\": \"n\"}\x00\xff")
	for _, cmd := range []string{"ADD", "FAIL"} {
		out, err := c.Invoke(context.Background(), &Invocation{Command: cmd, ContainerID: "c1", Stdin: stdin})
		if err != nil {
			t.Fatalf("%s: %v", cmd, err)
		}
		wantExit := 0
		if cmd == "FAIL" {
			wantExit = 1
		}
		if out.Exit != wantExit || string(out.Stdout) != cmd+":"+string(stdin) || string(out.Stderr) != "warn" || out.Err != nil {
			t.Errorf("%s: output %+v", cmd, out)
		}
	}
	plain, _ := startServer(t, &fakeService{})
	_, err := (&Client{Socket: plain, Timeout: 5 * time.Second}).Invoke(context.Background(), &Invocation{Command: "ADD"})
	if CodeOf(err) != CodeDecodingFailure || !strings.Contains(err.Error(), `operation "cni"`) {
		t.Errorf("server without an Invoker: %v (code %d)", err, CodeOf(err))
	}
}
