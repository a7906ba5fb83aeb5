package agentapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// FuzzWireRequest feeds arbitrary bytes to readMessage, the function the server reads
// every request with, optionally followed by an endless stream of one byte (a client
// that never stops sending). Properties:
//
//   - it never panics and always returns, having read at most MaxMessageSize+1 bytes,
//     and having allocated a bounded amount (at most 8 MiB) however much is offered;
//   - its error is nil, io.EOF (nothing but white space before the end: the server's
//     liveness probe case) or wraps ErrProtocol, and an oversize message is reported as
//     too large;
//   - a request it decodes round-trips: encoding it and reading it back gives the same
//     envelope (the body compared as compact JSON), and encoding that again gives the
//     same bytes; a cni request's Invocation as the server decodes it (decodeBody)
//     round-trips the same way.
//
// Seeds: testdata/fuzz/FuzzWireRequest.
func FuzzWireRequest(f *testing.F) {
	body, _ := json.Marshal(testInvocation("/run/lh.sock"))
	f.Add([]byte(`{"version":1,"op":"cni","timeoutMs":29000,"request":`+string(body)+`}`), byte(0))
	f.Add([]byte(`{"version":1,"op":"cni","request":{"stdin":"`), byte('A'))
	f.Fuzz(func(t *testing.T, data []byte, tail byte) {
		var src io.Reader = bytes.NewReader(data)
		if tail != 0 {
			src = io.MultiReader(src, endless(tail))
		}
		cr := &countingReader{r: src}
		var before, after runtime.MemStats
		if tail != 0 {
			runtime.ReadMemStats(&before)
		}
		var req WireRequest
		err := readMessage(cr, &req)
		if tail != 0 {
			runtime.ReadMemStats(&after)
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 8*MaxMessageSize {
				t.Errorf("reading one request allocated %d bytes", alloc)
			}
		}
		if cr.n > MaxMessageSize+1 {
			t.Errorf("readMessage read %d bytes, more than MaxMessageSize+1", cr.n)
		}
		if err != nil {
			switch {
			case errors.Is(err, io.EOF):
				if len(bytes.TrimSpace(data)) != 0 || (tail != 0 && !isJSONSpace(tail)) {
					t.Errorf("io.EOF after non-blank input %s", short(data))
				}
			case !errors.Is(err, ErrProtocol):
				t.Errorf("error %v (%T) is neither io.EOF nor ErrProtocol", err, err)
			}
			if cr.n > MaxMessageSize && !errors.Is(err, errTooLarge) && !errors.Is(err, io.EOF) {
				// The reader hit the limit: whatever else is wrong, the answer must say so.
				t.Errorf("read %d bytes but the error %v does not say too large", cr.n, err)
			}
			return
		}

		again := roundTrip(t, &req)
		if again.Version != req.Version || again.Op != req.Op || again.TimeoutMillis != req.TimeoutMillis ||
			!bytes.Equal(compact(t, again.Request), compact(t, req.Request)) {
			t.Errorf("request %+v read back as %+v", req, again)
		}
		var v Invocation
		if req.Op != OpCNI || decodeBody(&req, &v) != nil {
			return
		}
		first, err := json.Marshal(&v)
		if err != nil {
			t.Fatalf("encoding decoded body %+v: %v", v, err)
		}
		var w Invocation
		if err := json.Unmarshal(first, &w); err != nil {
			t.Fatalf("decoding re-encoded body %s: %v", first, err)
		}
		second, _ := json.Marshal(&w)
		if !bytes.Equal(first, second) {
			t.Errorf("%s body does not round-trip:\n%s\n%s", req.Op, first, second)
		}
	})
}

// roundTrip encodes req the way a client does and reads it back the way the server does.
func roundTrip(t *testing.T, req *WireRequest) WireRequest {
	t.Helper()
	var buf bytes.Buffer
	if err := writeMessage(&buf, req); err != nil {
		if errors.Is(err, errTooLarge) {
			// Escaping can make a request that fit grow past the limit; nothing to compare.
			return *req
		}
		t.Fatalf("writeMessage(%+v): %v", req, err)
	}
	first := bytes.Clone(buf.Bytes())
	var out WireRequest
	if err := readMessage(&buf, &out); err != nil {
		t.Fatalf("reading back %s: %v", first, err)
	}
	var buf2 bytes.Buffer
	if err := writeMessage(&buf2, &out); err != nil || !bytes.Equal(buf2.Bytes(), first) {
		t.Errorf("encoding is not stable:\n%s\n%s (%v)", first, buf2.Bytes(), err)
	}
	return out
}

// compact is raw as json.Marshal writes a RawMessage: compacted, HTML-escaped.
func compact(t *testing.T, raw json.RawMessage) []byte {
	t.Helper()
	if len(raw) == 0 {
		raw = json.RawMessage("null") // an absent body is encoded as null
	}
	var b, esc bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		t.Fatalf("compacting %q: %v", raw, err)
	}
	json.HTMLEscape(&esc, b.Bytes()) // as json.Marshal writes a RawMessage
	return esc.Bytes()
}

// short quotes at most the first 200 bytes of b, for failure messages.
func short(b []byte) string {
	if len(b) > 200 {
		return fmt.Sprintf("%q... (%d bytes)", b[:200], len(b))
	}
	return fmt.Sprintf("%q", b)
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// endless yields b forever.
type endless byte

func (e endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(e)
	}
	return len(p), nil
}

type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// FuzzServe writes arbitrary bytes to a real server on a unix socket (then half-closes,
// as the client does) and checks the answer against what the server's own decoding
// says about the bytes. Properties:
//
//   - the server answers with exactly one well-formed WireResponse (known fields only,
//     this protocol version, at most MaxMessageSize bytes) or, for input with nothing
//     but white space, closes without a word;
//   - a request that decodes, has this version, the op cni and a body that decodes as
//     an Invocation reaches the Invoker unchanged, with a live context whose deadline
//     is in the future and at most the server's maximum, and is answered with the
//     Invoker's output, byte for byte; anything else (the protocol's removed operations
//     included) never reaches the Invoker and is answered with code 6 (ErrProtocol);
//   - after every input the server still answers a well-formed request.
//
// Every exchange is bounded by deadlines. Seeds: testdata/fuzz/FuzzServe.
func FuzzServe(f *testing.F) {
	body, _ := json.Marshal(testInvocation("/run/lh.sock"))
	f.Add([]byte(`{"version":1,"op":"cni","timeoutMs":29000,"request":` + string(body) + `}`))
	svc := &fuzzInvoker{}
	socket := fuzzServer(f, svc)
	c := &Client{Socket: socket, Timeout: patience}
	probe := NewInvocation("STATUS", testConf(socket), "", "")
	f.Fuzz(func(t *testing.T, data []byte) {
		svc.reset()
		resp, raw := fuzzExchange(t, socket, data)

		var want WireRequest
		rerr := readMessage(bytes.NewReader(data), &want)
		var problems []string
		fail := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
		if errors.Is(rerr, io.EOF) {
			if len(raw) != 0 {
				fail("blank input %s answered with %s", short(data), raw)
			}
		} else {
			if resp == nil {
				t.Fatalf("input %s: no answer (connection closed without a response)", short(data))
			}
			body, valid := wantBody(&want, rerr)
			got, ctxErr := svc.last()
			switch {
			case valid:
				if !reflect.DeepEqual(got, body) {
					fail("invoker saw %+v, want %+v", got, body)
				}
				if ctxErr != nil {
					fail("request %s reached the invoker with a dead or unbounded context: %v", short(data), ctxErr)
				}
				if resp.Error != nil {
					fail("valid request %s answered with error %+v", short(data), resp.Error)
				}
				if w := echo(body); resp.CNI == nil || resp.CNI.Exit != w.Exit || !bytes.Equal(resp.CNI.Stdout, w.Stdout) ||
					!bytes.Equal(resp.CNI.Stderr, w.Stderr) {
					fail("valid request %s answered with output %+v, want %+v", short(data), resp.CNI, w)
				}
			default:
				if got != nil {
					fail("invalid request %s reached the invoker as %+v", short(data), got)
				}
				if resp.Error == nil || resp.Error.Code != CodeDecodingFailure || resp.Error.Msg == "" {
					fail("invalid request %s answered with %+v, want a code 6 error", short(data), resp)
				}
			}
		}
		// The server keeps serving.
		ctx, cancel := context.WithTimeout(context.Background(), patience)
		defer cancel()
		if out, err := c.Invoke(ctx, probe); err != nil || out.Exit != 0 {
			t.Fatalf("after input %s the server no longer serves: %+v %v", short(data), out, err)
		}
		if len(problems) > 0 {
			t.Error(strings.Join(problems, "\n"))
		}

	})
}

// wantBody decodes the Invocation as the server does; valid says whether the request
// should reach the Invoker.
func wantBody(req *WireRequest, readErr error) (body *Invocation, valid bool) {
	if readErr != nil || req.Version != ProtocolVersion || req.Op != OpCNI {
		return nil, false
	}
	var inv Invocation
	if err := decodeBody(req, &inv); err != nil {
		return nil, false
	}
	return &inv, true
}

// fuzzExchange writes data to the server, half-closes and reads the whole answer. resp
// is nil when the server closed without answering; raw is every byte it sent.
func fuzzExchange(t *testing.T, socket string, data []byte) (*WireResponse, []byte) {
	t.Helper()
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(patience))
	var wg sync.WaitGroup
	wg.Go(func() {
		_, _ = conn.Write(data) // the server may answer and close before reading it all
		_ = conn.(*net.UnixConn).CloseWrite()
	})
	raw, err := io.ReadAll(io.LimitReader(conn, MaxMessageSize+1))
	wg.Wait()
	if errors.Is(err, syscall.ECONNRESET) && len(raw) > 0 {
		// The server answered and closed with part of a refused request unread; Linux
		// then resets the connection, but only after the answer has been read.
		err = nil
	}
	if err != nil {
		t.Fatalf("input %s: reading the answer: %v (got %q)", short(data), err, raw)
	}
	if len(raw) == 0 {
		return nil, raw
	}
	if len(raw) > MaxMessageSize {
		t.Fatalf("answer is larger than MaxMessageSize")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var resp WireResponse
	if err := dec.Decode(&resp); err != nil {
		t.Fatalf("input %s: answer %q is not a WireResponse: %v", short(data), raw, err)
	}
	if dec.More() {
		t.Errorf("input %s: answer %q has more than one JSON value", short(data), raw)
	}
	if resp.Version != ProtocolVersion || resp.Error != nil && resp.CNI != nil {
		t.Errorf("input %s: malformed answer %s", short(data), raw)
	}
	return &resp, raw
}

// fuzzInvoker answers every invocation as fakeInvoker does (echo) and records the first
// one since reset and whether its context was usable: alive, with a deadline in the
// future and at most the server's maximum.
type fuzzInvoker struct {
	mu     sync.Mutex
	inv    *Invocation
	ctxErr error
}

var _ Invoker = (*fuzzInvoker)(nil)

var errUnbounded = errors.New("context deadline missing or beyond the server's maximum")

func (s *fuzzInvoker) Invoke(ctx context.Context, inv *Invocation) *Output {
	var cerr error
	if d, ok := ctx.Deadline(); ctx.Err() != nil {
		cerr = ctx.Err()
	} else if !ok || time.Until(d) > maxRequestTime {
		cerr = errUnbounded
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inv == nil { // the liveness probe after each input comes second
		s.inv, s.ctxErr = inv, cerr
	}
	return echo(inv)
}

func (s *fuzzInvoker) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inv, s.ctxErr = nil, nil
}

func (s *fuzzInvoker) last() (*Invocation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inv, s.ctxErr
}

// fuzzServer serves svc on a socket in tb's temporary directory until cleanup.
func fuzzServer(tb testing.TB, svc Invoker) string {
	tb.Helper()
	return fuzzServerLog(tb, svc, nil)
}

// fuzzServerLog is fuzzServer logging to log (nil discards).
func fuzzServerLog(tb testing.TB, svc Invoker, log *slog.Logger) string {
	tb.Helper()
	socket := filepath.Join(tb.TempDir(), "lh.sock")
	l, err := Listen(socket)
	if err != nil {
		tb.Fatalf("Listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, l, svc, log) }()
	tb.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				tb.Errorf("Serve: %v", err)
			}
		case <-time.After(patience):
			tb.Errorf("Serve did not return %s after cancel", patience)
		}
	})
	return socket
}
