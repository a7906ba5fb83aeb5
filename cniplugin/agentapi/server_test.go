package agentapi

import (
	"bytes"
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

// TestInvocationRoundTrip: an invocation built as the plugin builds it reaches the
// Invoker whole (every field, stdin byte for byte through base64), its output comes back
// as it was, and a failed command is an output with its exit status, not an error.
func TestInvocationRoundTrip(t *testing.T) {
	svc := &fakeInvoker{}
	socket, _ := startServer(t, svc)
	c := &Client{Socket: socket, Timeout: patience}
	for _, cmd := range []string{"ADD", "FAIL"} {
		t.Run(cmd, func(t *testing.T) {
			inv := testInvocation(socket)
			inv.Command = cmd
			inv.Stdin = append(inv.Stdin, 0, 0xff)
			out, err := c.Invoke(context.Background(), inv)
			if err != nil {
				t.Fatalf("Invoke: %v", err)
			}
			if got, _ := svc.lastCall(); !reflect.DeepEqual(got, inv) {
				t.Errorf("the invoker got %+v, want %+v", got, inv)
			}
			want := echo(inv)
			if out.Exit != want.Exit || !bytes.Equal(out.Stdout, want.Stdout) || !bytes.Equal(out.Stderr, want.Stderr) || out.Err != nil {
				t.Errorf("output %+v, want %+v without Err", out, want)
			}
		})
	}
}

// TestNewInvocation: the socket is the one the plugin would dial for the configuration,
// and the environment is one the CNI library accepts for the command.
func TestNewInvocation(t *testing.T) {
	inv := NewInvocation("ADD", testConf("/run/x.sock"), "c1", "eth0")
	want := &Invocation{Command: "ADD", ContainerID: "c1", Netns: "/var/run/netns/c1", IfName: "eth0", Path: "/opt/cni/bin",
		Socket: "/run/x.sock", Stdin: testConf("/run/x.sock")}
	if !reflect.DeepEqual(inv, want) {
		t.Errorf("NewInvocation: %+v, want %+v", inv, want)
	}
	// No ipam.socket (or not an absolute path): the plugin dials the default socket.
	if inv := NewInvocation("STATUS", []byte(`{"name": "n", "ipam": {"socket": "run/x.sock"}}`), "", ""); inv.Socket != DefaultSocket || inv.Netns != "" {
		t.Errorf("socket %q, netns %q; want %q and none", inv.Socket, inv.Netns, DefaultSocket)
	}
}

// TestOutputResult reads outputs as a runtime does: the CNI error's code and words, or the
// result's addresses.
func TestOutputResult(t *testing.T) {
	tests := []struct {
		name   string
		out    Output
		want   allocator.Result
		code   uint
		msg    string
		target error // errors.Is must hold
	}{
		// An ADD's result, in any CNI version: the addresses and gateways.
		{"add 1.1.0", Output{Stdout: []byte(`{"cniVersion": "1.1.0", "ips": [{"address": "10.10.1.7/16", "gateway": "10.10.0.1"},` +
			` {"address": "fd10::7/64"}], "routes": [{"dst": "0.0.0.0/0"}]}`)}, testResult(), 0, "", nil},
		{"add 0.3.1", Output{Stdout: []byte(`{"cniVersion": "0.3.1", "ips": [{"version": "4", "address": "10.10.1.7/16", ` +
			`"gateway": "10.10.0.1"}, {"version": "6", "address": "fd10::7/64"}]}`)}, testResult(), 0, "", nil},
		// DEL, CHECK, GC and STATUS print nothing.
		{"nothing printed", Output{}, allocator.Result{}, 0, "", nil},
		// A CNI error keeps its code and words; the code stands for its sentinel.
		{"exhausted", Output{Exit: 1, Stdout: []byte(`{"code": 102, "msg": "pool net1 set 0: pool exhausted"}`)},
			allocator.Result{}, 102, "pool net1 set 0: pool exhausted", allocator.ErrPoolExhausted},
		// Details follow the message, as the CNI library prints them.
		{"details", Output{Exit: 1, Stdout: []byte(`{"code": 4, "msg": "invalid characters in containerID", "details": "c/1"}`)},
			allocator.Result{}, 4, "invalid characters in containerID; c/1", nil},
		// A failure without a CNI error, or a success that is not a result, is the agent's fault.
		{"exit without error", Output{Exit: 1, Stdout: []byte(`oops`)}, allocator.Result{}, 6, "without a CNI error", ErrProtocol},
		{"not a result", Output{Stdout: []byte(`{"ips": 7}`)}, allocator.Result{}, 6, "not a CNI result", ErrProtocol},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := tt.out.Result()
			if !reflect.DeepEqual(res, tt.want) {
				t.Errorf("result %+v, want %+v", res, tt.want)
			}
			if tt.code == 0 {
				if err != nil {
					t.Errorf("error %v, want none", err)
				}
				return
			}
			if e := asError(t, err); e.Code != tt.code || !strings.Contains(e.Msg, tt.msg) {
				t.Errorf("error %d %q, want %d containing %q", e.Code, e.Msg, tt.code, tt.msg)
			}
			if tt.target != nil && !errors.Is(err, tt.target) {
				t.Errorf("errors.Is(%v, %v) is false", err, tt.target)
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
	svc := &fakeInvoker{}
	socket, _ := startServer(t, svc)
	body, _ := json.Marshal(testInvocation(socket))
	big := []byte(`{"version":1,"op":"cni","request":{"command":"ADD","stdin":"` + strings.Repeat("x", 2<<20) + `"}}`)
	tests := []struct {
		name    string
		payload []byte
		want    string
	}{
		// A request over 1 MiB is refused before it is decoded.
		{"oversize", big, "more than 1048576 bytes"},
		// Another protocol version must not be guessed at.
		{"version", []byte(`{"version":2,"op":"cni","request":` + string(body) + `}`), "protocol version 1 but the request has version 2"},
		// A missing version is version 0: refused the same way.
		{"no version", []byte(`{"op":"cni","request":` + string(body) + `}`), "has version 0"},
		// Unknown operations are named in the error, with the one there is.
		{"unknown op", []byte(`{"version":1,"op":"frobnicate","request":{}}`), `unknown operation "frobnicate"; leaseholdd serves only "cni"`},
		// The protocol's first operations, parsed requests, are gone: refused the same way.
		{"removed op", []byte(`{"version":1,"op":"add","request":{"network":"net1","containerID":"c","ifName":"eth0"}}`),
			`unknown operation "add"`},
		// A body of the wrong shape is a decoding failure.
		{"bad body", []byte(`{"version":1,"op":"cni","request":{"ifName":7}}`), "decoding cni request"},
		{"stdin not base64", []byte(`{"version":1,"op":"cni","request":{"command":"ADD","stdin":"not base64!"}}`), "decoding cni request"},
		// No body at all.
		{"no body", []byte(`{"version":1,"op":"cni"}`), "no \"request\" body"},
		// Not JSON.
		{"garbage", []byte(`hello`), "undecodable JSON"},
		// The client half-closed in the middle of its request.
		{"truncated", []byte(`{"version":1,"op":`), "cut short"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := rawCall(t, socket, tt.payload)
			if resp.Error == nil || resp.Error.Code != CodeDecodingFailure || resp.CNI != nil {
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
	if _, n := svc.lastCall(); n != 0 {
		t.Errorf("%d refused requests reached the invoker", n)
	}
}

func TestClientRefusesOversizeLocally(t *testing.T) {
	// The socket does not exist: a dial would yield code 11, so code 6 proves the size
	// check happens before any connection.
	c := &Client{Socket: filepath.Join(t.TempDir(), "none.sock")}
	inv := testInvocation(c.Socket)
	inv.Stdin = make([]byte, MaxMessageSize)
	_, err := c.Invoke(context.Background(), inv)
	if e := asError(t, err); e.Code != CodeDecodingFailure || !errors.Is(err, ErrProtocol) {
		t.Errorf("error %+v, want code 6 ErrProtocol", e)
	}
}

func TestClientMissingSocket(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "missing.sock")
	_, err := (&Client{Socket: socket}).Invoke(context.Background(), NewInvocation("STATUS", testConf(socket), "", ""))
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
	// The slow client's read limit outlasts the test: a server that served one client at a
	// time would answer the second only after cutting the slow one off.
	setVar(t, &readTimeout, 2*patience)
	socket, _ := startServer(t, &fakeInvoker{})
	slow, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer slow.Close()
	// The slow client is connected and silent; a second client is served meanwhile.
	start := time.Now()
	if _, err := (&Client{Socket: socket, Timeout: patience}).Invoke(context.Background(), testInvocation(socket)); err != nil {
		t.Fatalf("second client, after %s: %v", time.Since(start), err)
	}
	_ = slow.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := slow.Read(make([]byte, 1)); n != 0 || !isTimeout(err) {
		t.Errorf("the slow client was answered or closed (%d, %v) before the second was served", n, err)
	}
}

func TestSilentClientTimesOut(t *testing.T) {
	old := readTimeout
	readTimeout = 200 * time.Millisecond
	t.Cleanup(func() { readTimeout = old })
	socket, _ := startServer(t, &fakeInvoker{})
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(patience))
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
	svc := &fakeInvoker{block: make(chan struct{}), sawDeadline: make(chan time.Duration, 1)}
	socket, _ := startServer(t, svc)
	// The client's timeout is far shorter than the server's own bounds, and long enough that
	// the request reaches the service before it passes on a busy machine.
	const timeout = 3 * time.Second
	out, err := (&Client{Socket: socket, Timeout: timeout}).Invoke(context.Background(), testInvocation(socket))
	if err == nil {
		// The invocation ran out of time first, a hair before the client did, and its CNI
		// error came back in time.
		_, err = out.Result()
	}
	if e := asError(t, err); e.Code != CodeTryAgainLater {
		t.Errorf("error %+v, want code 11 after the client's timeout", e)
	}
	if d := <-svc.sawDeadline; d <= 0 || d > timeout {
		t.Errorf("service context had %s left, want at most the client's %s", d, timeout)
	}
}

func TestShutdownWaitsForInFlight(t *testing.T) {
	svc := &fakeInvoker{block: make(chan struct{})}
	socket, stop := startServer(t, svc)
	errc := make(chan error, 1)
	go func() {
		out, err := (&Client{Socket: socket, Timeout: patience}).Invoke(context.Background(), testInvocation(socket))
		if err == nil && out.Exit != 0 {
			err = fmt.Errorf("exit %d: %s", out.Exit, out.Stdout)
		}
		errc <- err
	}()
	for _, n := svc.lastCall(); n == 0; _, n = svc.lastCall() {
		time.Sleep(5 * time.Millisecond)
	}
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	// Shutdown has begun: no new connections, but the running request is still served.
	eventually(t, "the socket refuses connections once shutdown has begun", func() error {
		c, err := net.Dial("unix", socket)
		if err == nil {
			c.Close()
			return errors.New("it still accepts them")
		}
		return nil
	})
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
