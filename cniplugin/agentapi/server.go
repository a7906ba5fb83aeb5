package agentapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// Server limits. They are variables only so that tests can shorten them.
var (
	// readTimeout bounds reading one request: a client that connects and sends nothing
	// holds its own goroutine for at most this long and nobody else's.
	readTimeout = 10 * time.Second
	// writeTimeout bounds writing one response.
	writeTimeout = 10 * time.Second
	// defaultRequestTime is a request's deadline when the client names none.
	defaultRequestTime = DefaultTimeout
	// maxRequestTime caps the deadline a client may ask for.
	maxRequestTime = 2 * time.Minute
	// shutdownGrace bounds how long Serve waits for in-flight requests once ctx is done;
	// after it their contexts are cancelled.
	shutdownGrace = 15 * time.Second
	// maxInFlight bounds how many invocations run at once; more wait for a slot until
	// their deadline and then fail with code 11.
	maxInFlight = 64
	// maxWaiting bounds the bytes of requests read whole and waiting for one of those slots,
	// as the intake bounds those still being read: sixteen requests of the largest size.
	maxWaiting = 16 * MaxMessageSize
	// clientLogEvery is how often at most a client the agent could not serve (stalled,
	// evicted, oversize, undecodable, refused) is logged; the line counts the ones left out.
	clientLogEvery = 10 * time.Second
)

// testHookIntake, when set, is given each Serve's intake, so tests can read its figures.
var testHookIntake func(*intake)

// Serve answers plugin requests on l until ctx is done, running each invocation with inv
// (package cniplugin's Served makes one from the agent's Service), then stops accepting,
// waits up to 15 s for requests in flight (cancelling their contexts after that) and
// closes l. Each connection is served on its own goroutine: reading the request is
// bounded by 10 s and 1 MiB, and the invocation runs with a deadline of the client's
// timeout (at most 2 min, 30 s when unset) on a context that is not cancelled by ctx,
// so a shutdown lets it finish. At most 64 invocations run at once. A request that is
// not a cni invocation of this ProtocolVersion is refused with code 6 (see the wire
// format).
//
// Reading is bounded as a whole too: at most 128 connections are read at once (more
// wait in the listen backlog) and their buffers, which grow only as bytes arrive, hold
// at most 16 MiB beyond 4 KiB each. When either runs short, the connection that has
// sent nothing for longest (at least 1 s) is answered with code 11 and closed to make
// room; a request for which no room can be made is refused with code 11. Clients that
// could not be served are logged at most once per 10 s, with a count of the others.
//
// Serve returns nil after a clean shutdown; an error when accepting fails for good
// (wrapping the listener's error) or when requests were still running after the grace
// period. A nil log discards logs.
func Serve(ctx context.Context, l net.Listener, inv Invoker, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reqBase, cancelRequests := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRequests()
	s := &server{inv: inv, log: log, stopping: ctx, base: reqBase, slots: make(chan struct{}, maxInFlight),
		in: newIntake(), clientLog: logLimiter{every: clientLogEvery}}
	if testHookIntake != nil {
		testHookIntake(s.in)
	}

	stopClose := context.AfterFunc(ctx, func() { _ = l.Close() })
	defer stopClose()

	var wg sync.WaitGroup
	var acceptErr error
	var backoff time.Duration
	for {
		conn, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || isResourceLimit(err) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				log.Warn("agentapi: accept failed, retrying", "addr", l.Addr(), "err", err, "backoff", backoff)
				time.Sleep(backoff)
				continue
			}
			acceptErr = fmt.Errorf("agentapi: accepting on %s: %w", l.Addr(), err)
			break
		}
		backoff = 0
		r, err := s.in.admit(ctx, conn)
		if err != nil {
			_ = conn.Close() // shutting down: the client reads EOF and tries again
			break
		}
		wg.Go(func() { s.handle(r) })
	}
	_ = l.Close()

	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	defer s.flushClientLog() // what the shutdown's last requests left unreported
	select {
	case <-done:
		return acceptErr
	case <-time.After(shutdownGrace):
	}
	n := s.inFlight.Load()
	cancelRequests()
	select {
	case <-done:
	case <-time.After(time.Second):
	}
	return errors.Join(acceptErr, fmt.Errorf("agentapi: %d requests still running %s after shutdown began; cancelled them", n, shutdownGrace))
}

type server struct {
	inv      Invoker
	log      *slog.Logger
	stopping context.Context // done when Serve should stop
	base     context.Context // parent of every request's context
	slots    chan struct{}
	inFlight atomic.Int64
	// waiting is the bytes of the bodies of requests read whole and waiting for a slot: once
	// read they leave the intake, and this bounds them instead (maxWaiting).
	waiting atomic.Int64
	// in admits connections to be read; clientLog paces the log lines about clients
	// that could not be served.
	in        *intake
	clientLog logLimiter
}

// handle serves one connection admitted as r: read one request, answer it, close.
func (s *server) handle(r *reader) {
	conn := r.conn
	s.inFlight.Add(1)
	defer s.inFlight.Add(-1)
	defer conn.Close()
	defer r.leave()

	// The read deadline (readTimeout) was set at admission.
	// A shutdown cuts short a client that has not sent its request yet.
	stopCut := context.AfterFunc(s.stopping, func() { _ = conn.SetReadDeadline(time.Now()) })
	var req WireRequest
	err := readMessageWithin(r, &req, r)
	stopCut()
	r.release()
	if err != nil {
		if eerr := r.evictedErr(); eerr != nil {
			err = eerr // the eviction cut the read short
		}
	}

	var resp WireResponse
	switch {
	case err == nil:
		r.leave()
		resp = s.dispatch(&req)
	case errors.Is(err, io.EOF):
		// Connected and closed without a byte: a liveness probe (see Listen). Nothing to say.
		s.log.Debug("agentapi: empty connection")
		return
	case errors.Is(err, allocator.ErrUnavailable):
		// Evicted for a newcomer, or no room to buffer the request (see the intake).
		resp.Error = ErrorFrom(err)
	case s.stopping.Err() != nil:
		resp.Error = &Error{Code: CodeTryAgainLater, Msg: "leaseholdd is shutting down; try again", Sentinel: "ErrUnavailable"}
	case isTimeout(err):
		resp.Error = &Error{Code: CodeDecodingFailure, Sentinel: "ErrProtocol",
			Msg: fmt.Sprintf("agent protocol error: no complete request within %s", readTimeout)}
	default:
		resp.Error = ErrorFrom(fmt.Errorf("reading request: %w", err))
	}
	if err != nil {
		s.logClient("agentapi: request not read", "code", resp.Error.Code, "err", resp.Error.Msg)
	}
	resp.Version = ProtocolVersion

	_ = conn.SetWriteDeadline(time.Now().Add(writeTimeout))
	if err := writeMessage(conn, &resp); err != nil {
		s.logClient("agentapi: writing response", "op", req.Op, "err", err)
		return
	}
	if errors.Is(err, errTooLarge) || errors.Is(err, errBufferFull) {
		// Let the client finish writing so that it reads our answer instead of a reset.
		// Draining buffers nothing; it keeps r's slot, which an idle client gives way
		// from, and ends at the read deadline.
		if uc, ok := conn.(interface{ CloseWrite() error }); ok {
			_ = uc.CloseWrite()
		}
		_, _ = io.Copy(io.Discard, r)
	}
}

// logClient logs a warning about a client the agent could not serve, at most once per
// clientLogEvery, with the number of such warnings left out before it and the intake's
// figures. Warnings left out at the end of a period are counted in a line of their own
// when it ends, so none goes unreported.
func (s *server) logClient(msg string, attrs ...any) {
	ok, skipped, flushIn := s.clientLog.allow(time.Now())
	if flushIn > 0 {
		time.AfterFunc(flushIn, s.flushClientLog)
	}
	if !ok {
		return
	}
	s.log.Warn(msg, append(attrs, s.intakeAttrs(skipped)...)...)
}

// flushClientLog reports the warnings logClient has left out since its last line.
func (s *server) flushClientLog() {
	if n := s.clientLog.flush(time.Now()); n > 0 {
		s.log.Warn("agentapi: more clients not served", s.intakeAttrs(n)...)
	}
}

func (s *server) intakeAttrs(suppressed int) []any {
	st := s.in.Stats()
	return []any{"suppressed", suppressed, "reading", st.Reading, "buffered", st.Buffered, "evicted", st.Evicted}
}

// dispatch runs one decoded request and returns its response (Version unset).
func (s *server) dispatch(req *WireRequest) WireResponse {
	start := time.Now()
	if req.Version != ProtocolVersion {
		return errResponse(fmt.Errorf("%w: leaseholdd speaks protocol version %d but the request has version %d; "+
			"install the leasehold plugin and leaseholdd from the same release", ErrProtocol, ProtocolVersion, req.Version))
	}
	timeout := defaultRequestTime
	if req.TimeoutMillis > 0 {
		// Cap before converting: a huge value would overflow into an expired deadline.
		timeout = maxRequestTime
		if req.TimeoutMillis < maxRequestTime.Milliseconds() {
			timeout = time.Duration(req.TimeoutMillis) * time.Millisecond
		}
	}
	ctx, cancel := context.WithTimeout(s.base, timeout)
	defer cancel()

	n := int64(len(req.Request))
	if s.waiting.Add(n) > int64(maxWaiting) {
		s.waiting.Add(-n)
		return errResponse(fmt.Errorf("%w: leaseholdd is busy (%d requests running, and %d bytes of requests waiting for them, "+
			"its limit); try again", allocator.ErrUnavailable, maxInFlight, maxWaiting))
	}
	select {
	case s.slots <- struct{}{}:
		s.waiting.Add(-n)
		defer func() { <-s.slots }()
	case <-ctx.Done():
		s.waiting.Add(-n)
		return errResponse(fmt.Errorf("%w: leaseholdd is busy (%d requests running); try again", allocator.ErrUnavailable, maxInFlight))
	}

	if req.Op != OpCNI {
		return s.refuse(req, start, fmt.Errorf("%w: unknown operation %q; leaseholdd serves only %q, "+
			"whole plugin invocations", ErrProtocol, req.Op, OpCNI))
	}
	var inv Invocation
	if err := decodeBody(req, &inv); err != nil {
		return s.refuse(req, start, err)
	}
	attrs := []any{"command", inv.Command, "containerID", inv.ContainerID, "ifName", inv.IfName}
	resp := WireResponse{CNI: s.inv.Invoke(ctx, &inv)}
	attrs = append(attrs, "op", req.Op, "took", time.Since(start))
	if resp.CNI.Err != nil {
		attrs = append(attrs, "exit", resp.CNI.Exit, "err", resp.CNI.Err)
		s.log.Warn("agentapi: CNI command failed", attrs...)
		return resp
	}
	s.log.Debug("agentapi: request done", attrs...)
	return resp
}

// refuse answers a request that does not run with err, which wraps ErrProtocol, and logs it.
func (s *server) refuse(req *WireRequest, start time.Time, err error) WireResponse {
	resp := errResponse(err)
	s.logClient("agentapi: request failed", "op", req.Op, "took", time.Since(start), "code", resp.Error.Code, "err", resp.Error.Msg)
	return resp
}

// decodeBody decodes the request's body into v; errors wrap ErrProtocol.
func decodeBody(req *WireRequest, v any) error {
	if len(req.Request) == 0 || string(req.Request) == "null" {
		return fmt.Errorf("%w: %s request has no \"request\" body", ErrProtocol, req.Op)
	}
	if err := json.Unmarshal(req.Request, v); err != nil {
		return fmt.Errorf("%w: decoding %s request: %w", ErrProtocol, req.Op, err)
	}
	return nil
}

func errResponse(err error) WireResponse { return WireResponse{Error: ErrorFrom(err)} }

// isResourceLimit reports whether an accept error is the process or system running out
// of file descriptors or buffers, which passes once other connections close.
func isResourceLimit(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// logLimiter lets one event through per period and counts the rest.
type logLimiter struct {
	every time.Duration

	mu      sync.Mutex
	next    time.Time // when the next event may pass
	skipped int       // events held back since the last that passed
}

// allow reports whether an event at now passes and, if it does, how many were held back
// before it. For the first event held back in a period, flushIn is when the period ends:
// the caller should then call flush, so the count is reported even if no event follows.
func (l *logLimiter) allow(now time.Time) (ok bool, skipped int, flushIn time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Before(l.next) {
		l.skipped++
		if l.skipped == 1 {
			return false, 0, l.next.Sub(now)
		}
		return false, 0, 0
	}
	l.next = now.Add(l.every)
	skipped, l.skipped = l.skipped, 0
	return true, skipped, 0
}

// flush returns how many events were held back since the last that passed; if any were,
// their report counts as the period's line: the period starts again at now. Before the
// period has ended it reports nothing: a flush asked for in an earlier period, run late
// (after an event passed at that period's end), must not report the new period's events
// early, a second line within the period; the flush asked for in this period reports them.
func (l *logLimiter) flush(now time.Time) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Before(l.next) {
		return 0
	}
	n := l.skipped
	if n > 0 {
		l.skipped = 0
		l.next = now.Add(l.every)
	}
	return n
}
