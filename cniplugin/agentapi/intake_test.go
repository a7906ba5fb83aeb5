package agentapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/syncbuf"
)

// TestStalledClientsAreBounded: 200 clients each send half of a large request and stall,
// the attack the intake exists for. While they do, what the server buffers stays within
// the intake's bound (by its own count and by the live heap), at most maxReading of them
// are read at once, and a real request is answered once an idle staller gives way, before
// the read limit would free a slot; once they close everything they held is let go; the
// log says so at a bounded rate.
func TestStalledClientsAreBounded(t *testing.T) {
	setVar(t, &clientLogEvery, time.Second)
	logs := &syncbuf.Buffer{}
	socket, in := startIntakeServer(t, &fakeInvoker{}, slog.New(slog.NewJSONHandler(logs, nil)))
	const clients = 200
	half := []byte(`{"version":1,"op":"cni","request":{"command":"ADD","stdin":"` + strings.Repeat("A", MaxMessageSize/2))
	// The bound the intake promises, and room for the rest of a live heap (connections,
	// goroutines' bookkeeping, the decoding of the real request).
	bound := maxBuffered + maxReading*firstChunk
	const slack = 8 << 20
	base := liveHeap()
	start := time.Now()

	// Sample the intake's figures throughout the attack.
	var worst atomic.Int64
	var worstReading atomic.Int64
	stopSampling := make(chan struct{})
	var sampling sync.WaitGroup
	sampling.Go(func() {
		for {
			st := in.Stats()
			worst.Store(max(worst.Load(), int64(st.Buffered)))
			worstReading.Store(max(worstReading.Load(), int64(st.Reading)))
			select {
			case <-stopSampling:
				return
			case <-time.After(time.Millisecond):
			}
		}
	})

	conns := make([]net.Conn, clients)
	var writers sync.WaitGroup
	for i := range conns {
		c, err := net.Dial("unix", socket)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		conns[i] = c
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		// A client's write blocks until the server reads it (or refuses and drains it),
		// so each writes on its own goroutine; the server may also cut it off.
		writers.Go(func() { _, _ = c.Write(half) })
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	eventually(t, "the intake is full", func() error {
		st := in.Stats()
		return saw(st.Reading == maxReading, "%+v", st)
	})

	// (b) A real request while every slot is taken: it waits for the idlest staller to
	// give way, then is served.
	addStart := time.Now()
	inv := testInvocation(socket)
	out, err := (&Client{Socket: socket, Timeout: patience}).Invoke(context.Background(), inv)
	if err != nil || out.Exit != 0 {
		t.Fatalf("a real request among %d stalled clients, after %s: %+v %v", clients, time.Since(addStart), out, err)
	}
	// Served because an idle staller gave way (after evictIdle), not because the read limit
	// cut one off, which it does readTimeout after the stallers connected, before addStart.
	if took := time.Since(addStart); took >= readTimeout {
		t.Errorf("a real request among %d stalled clients took %s, as long as the read limit (%s) that frees slots without eviction", clients, took, readTimeout)
	}

	// (a) Every staller has had its data read, drained or cut off; the heap holds no
	// more than the bound, though a good part of 100 MiB was sent.
	writers.Wait()
	if h := liveHeap() - base; h > int64(bound+slack) {
		t.Errorf("live heap grew by %d MiB with %d stalled clients; the intake bounds buffers to %d MiB",
			h>>20, clients, bound>>20)
	}
	close(stopSampling)
	sampling.Wait()
	if w := worst.Load(); w > int64(bound) || w < int64(maxBuffered/2) {
		t.Errorf("the intake buffered at most %d bytes; want more than %d (it was used) and at most %d", w, maxBuffered/2, bound)
	}
	if r := worstReading.Load(); r > int64(maxReading) {
		t.Errorf("%d connections were read at once, more than %d", r, maxReading)
	}
	t.Logf("worst buffered %d KiB, reading %d; now %+v", worst.Load()>>10, worstReading.Load(), in.Stats())
	if st := in.Stats(); st.Evicted == 0 {
		t.Errorf("no staller was evicted: %+v", st)
	}

	// (c) The stallers close: their slots and buffers are let go at once, and the heap
	// returns to what it was.
	for _, c := range conns {
		c.Close()
	}
	eventually(t, "the intake is empty", func() error {
		st := in.Stats()
		return saw(st.Reading == 0 && st.Buffered == 0, "%+v", st)
	})
	eventually(t, "the heap is back to its size before the attack", func() error {
		grew := liveHeap() - base
		return saw(grew < 4<<20, "%d KiB above", grew>>10)
	})

	// (d) Each staller was answered or cut off, and each such client is a log event: the
	// log reports every one of them, within a period of the last, in at most one line per
	// clientLogEvery.
	var lines, suppressed int
	eventually(t, "every staller is reported in the log", func() error {
		lines, suppressed = clientLogLines(t, logs.String())
		return saw(lines+suppressed >= clients, "%d lines, %d suppressed", lines, suppressed)
	})
	elapsed := time.Since(start)
	t.Logf("%d lines, %d suppressed in %s", lines, suppressed, elapsed)
	if max := int(elapsed/clientLogEvery) + 1; lines > max {
		t.Errorf("%d log lines about clients in %s; at most %d (one per %s)", lines, elapsed, max, clientLogEvery)
	}
}

// TestIdleClientGivesWayToANewcomer: when every slot is taken, the connection that has
// sent nothing for longest gives way to the next one, answered with code 11 saying
// why; the others are left alone.
func TestIdleClientGivesWayToANewcomer(t *testing.T) {
	setVar(t, &maxReading, 2)
	setVar(t, &evictIdle, 300*time.Millisecond)
	setVar(t, &readTimeout, 2*patience) // the stallers stay until the test ends, however slow the machine
	socket, in := startIntakeServer(t, &fakeInvoker{}, nil)
	stall := func(what string) net.Conn {
		c, err := net.Dial("unix", socket)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(2 * patience))
		before := in.Stats().Buffered
		if _, err := c.Write([]byte(`{"version":1,"op":"cni","request":{"stdin":"` + strings.Repeat("A", 8<<10))); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		eventually(t, what+" is read", func() error {
			st := in.Stats()
			return saw(st.Buffered > before, "%+v", st)
		})
		return c
	}
	first, second := stall("first staller"), stall("second staller")

	out, err := (&Client{Socket: socket, Timeout: patience}).Invoke(context.Background(), testInvocation(socket))
	if err != nil || out.Exit != 0 {
		t.Fatalf("the newcomer: %+v %v", out, err)
	}
	var resp WireResponse
	if err := json.NewDecoder(first).Decode(&resp); err != nil {
		t.Fatalf("the first staller got no answer: %v", err)
	}
	if e := resp.Error; e == nil || e.Code != CodeTryAgainLater || !errors.Is(e, allocator.ErrUnavailable) ||
		!strings.Contains(e.Msg, "stopped reading this request: it sent nothing for") ||
		!strings.Contains(e.Msg, "send the whole request at once") {
		t.Errorf("the evicted staller was answered %+v; want code 11 saying why and what to do", e)
	}
	if st := in.Stats(); st.Reading != 1 || st.Evicted != 1 {
		t.Errorf("intake %+v; want the second staller still read and one eviction", st)
	}
	_ = second.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := second.Read(make([]byte, 1)); n != 0 || !isTimeout(err) {
		t.Errorf("the second staller was answered or closed (%d, %v); only the idlest gives way", n, err)
	}
}

// TestRequestRefusedWhenTheBufferBudgetIsSpent: a request that needs more buffer than the
// budget has left, while the holders are still sending (none may be evicted), is refused
// with code 11 naming the limit, and the client reads the answer (no reset). Once the
// holder has been idle long enough, its buffer goes to the next request.
func TestRequestRefusedWhenTheBufferBudgetIsSpent(t *testing.T) {
	setVar(t, &maxBuffered, 4*chunkSize)
	setVar(t, &evictIdle, 2*time.Second)
	setVar(t, &readTimeout, 2*patience) // the holder stays until evicted, however slow the machine
	socket, in := startIntakeServer(t, &fakeInvoker{}, nil)
	part := []byte(`{"version":1,"op":"cni","request":{"stdin":"` + strings.Repeat("A", 3*chunkSize))

	holder, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	_ = holder.SetDeadline(time.Now().Add(2 * patience))
	if _, err := holder.Write(part); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the holder's request is buffered", func() error {
		st := in.Stats()
		return saw(st.Buffered > 3*chunkSize, "%+v", st)
	})
	heldSince := time.Now()

	resp := rawCall(t, socket, part)
	if time.Since(heldSince) < evictIdle {
		if e := resp.Error; e == nil || e.Code != CodeTryAgainLater || !strings.Contains(e.Msg, "already buffering") ||
			!strings.Contains(e.Msg, "its limit; try again") {
			t.Errorf("a request with the budget spent was answered %+v; want code 11 naming the limit", e)
		}
	} else {
		t.Logf("the machine is too slow to check the refusal: %s passed", time.Since(heldSince))
	}

	// Once idle for evictIdle, the holder gives way to a request that needs its buffer.
	full := []byte(`{"version":1,"op":"cni","request":{"command":"ADD","stdin":"` + strings.Repeat("A", 3*chunkSize) + `"}}`)
	eventually(t, "a request needing the idle holder's buffer is served", func() error {
		if time.Since(heldSince) <= evictIdle {
			return errors.New("the holder has not been idle for evictIdle yet")
		}
		if resp := rawCall(t, socket, full); resp.Error != nil {
			return fmt.Errorf("refused: %+v", resp.Error)
		}
		return nil
	})
	var hresp WireResponse
	if err := json.NewDecoder(holder).Decode(&hresp); err != nil || hresp.Error == nil || hresp.Error.Code != CodeTryAgainLater ||
		!strings.Contains(hresp.Error.Msg, "its buffer was needed by another request") {
		t.Errorf("the evicted holder was answered %+v (%v); want code 11 saying why", hresp.Error, err)
	}
}

// TestRequestsWaitingForASlotAreBounded: requests read whole leave the intake and wait for
// one of the invocation slots; what they hold is bounded too. With the only slot taken, a
// stream of complete requests is answered code 11 once the bytes waiting exceed the budget,
// at once rather than at its deadline; once the slot frees, requests run again.
func TestRequestsWaitingForASlotAreBounded(t *testing.T) {
	setVar(t, &maxInFlight, 1)
	setVar(t, &maxWaiting, 4*chunkSize)
	block := make(chan struct{})
	inv := &fakeInvoker{block: block}
	socket, _ := startIntakeServer(t, inv, nil)
	// A deadline far beyond the test's patience: a refusal that waited for it is never seen.
	body := func(n int) []byte {
		return []byte(`{"version":1,"op":"cni","timeoutMs":` + fmt.Sprint((5 * patience).Milliseconds()) +
			`,"request":{"command":"ADD","stdin":"` + strings.Repeat("A", n) + `"}}`)
	}
	first := make(chan WireResponse, 1)
	go func() { first <- rawCall(t, socket, body(16)) }() // takes the slot and blocks in the Invoker
	eventually(t, "the first request holds the slot", func() error {
		_, n := inv.lastCall()
		return saw(n == 1, "%d calls", n)
	})
	// Each waiting request holds a chunk's worth; the budget takes four.
	const waiters = 8
	answers := make(chan WireResponse, waiters)
	for range waiters {
		go func() { answers <- rawCall(t, socket, body(chunkSize-64)) }()
	}
	refused := 0
	for refused < waiters-4 {
		select {
		case resp := <-answers:
			if e := resp.Error; e == nil || e.Code != CodeTryAgainLater || !strings.Contains(e.Msg, "waiting for them, its limit") {
				t.Fatalf("a request beyond the waiting budget was answered %+v; want code 11 naming the limit", e)
			}
			refused++
		case <-time.After(patience):
			t.Fatalf("%d of %d requests beyond the waiting budget refused after %s; want them refused at once, not at their deadline",
				refused, waiters-4, patience)
		}
	}
	close(block)
	if resp := <-first; resp.Error != nil || resp.CNI == nil {
		t.Errorf("the request holding the slot: %+v", resp.Error)
	}
	for range 4 {
		if resp := <-answers; resp.Error != nil || resp.CNI == nil {
			t.Errorf("a request within the waiting budget was answered %+v; want it run once the slot freed", resp.Error)
		}
	}
}

// TestValueScanner: the end of the first object is found however the message is cut
// into pieces, strings and escapes included; anything but an object is noticed at once.
func TestValueScanner(t *testing.T) {
	tests := []struct {
		in   string
		end  int  // offset just past the object, -1 when it has not ended
		bad  bool // not an object
		note string
	}{
		{`{"a":1}`, 7, false, "a plain object"},
		{" \n\t{\"a\":[1,{\"b\":2}]} trailing", 20, false, "leading space, nesting, bytes after the end ignored"},
		{`{"a":"}]{[\"\\"}`, 16, false, "brackets and escaped quotes inside a string"},
		{`{"a":"\\"}`, 10, false, "an escaped backslash closes nothing"},
		{`{"a":{"b":`, -1, false, "cut short"},
		{`   `, -1, false, "white space only"},
		{`hello`, -1, true, "not JSON"},
		{`[{"a":1}]`, -1, true, "an array is not a request"},
		{`null`, -1, true, "null is not a request"},
	}
	for _, tt := range tests {
		t.Run(tt.note, func(t *testing.T) {
			for cut := range len(tt.in) + 1 {
				var s valueScanner
				end := s.feed([]byte(tt.in[:cut]))
				if end < 0 {
					if e := s.feed([]byte(tt.in[cut:])); e >= 0 {
						end = cut + e
					}
				}
				if end != tt.end || s.notObject != tt.bad {
					t.Errorf("cut at %d: end %d, not an object %v; want %d, %v", cut, end, s.notObject, tt.end, tt.bad)
				}
			}
		})
	}
}

// TestLogLimiter: one event per period passes, counting the ones held back before it;
// the first held back asks for a flush at the period's end, which reports them even when
// no event follows and then counts as that period's line.
func TestLogLimiter(t *testing.T) {
	l := logLimiter{every: time.Second}
	t0 := time.Unix(1000, 0)
	steps := []struct {
		at      time.Duration
		flush   bool // flush instead of an event
		ok      bool
		skipped int           // events reported as held back
		flushIn time.Duration // a flush asked for
	}{
		{0, false, true, 0, 0}, // the first passes
		{100 * time.Millisecond, false, false, 0, 900 * time.Millisecond}, // held back: flush at the period's end
		{900 * time.Millisecond, false, false, 0, 0},                      // held back, the flush is already asked for
		{time.Second, false, true, 2, 0},                                  // the period is over: passes, counting two
		{1100 * time.Millisecond, false, false, 0, 900 * time.Millisecond},
		{2 * time.Second, true, true, 1, 0},                                // the flush reports it, no event having come
		{2500 * time.Millisecond, false, false, 0, 500 * time.Millisecond}, // the flush began a period
		{3 * time.Second, true, true, 1, 0},
		{3100 * time.Millisecond, true, true, 0, 0}, // a flush with nothing held back reports nothing
		{3200 * time.Millisecond, false, false, 0, 800 * time.Millisecond},
		{4 * time.Second, false, true, 1, 0}, // passes at the period's end, before the flush asked for
		{4050 * time.Millisecond, false, false, 0, 950 * time.Millisecond},
		// The flush asked for at 3.2 s, run late: the line at 4 s reported its event, and the
		// one held back since is the new period's (a second line now was issue 36's flake).
		{4060 * time.Millisecond, true, true, 0, 0},
		{5 * time.Second, true, true, 1, 0},
	}
	for _, s := range steps {
		if s.flush {
			if n := l.flush(t0.Add(s.at)); n != s.skipped {
				t.Errorf("flush at %s: %d; want %d", s.at, n, s.skipped)
			}
			continue
		}
		if ok, skipped, flushIn := l.allow(t0.Add(s.at)); ok != s.ok || skipped != s.skipped || flushIn != s.flushIn {
			t.Errorf("at %s: %v, %d, flush in %s; want %v, %d, %s", s.at, ok, skipped, flushIn, s.ok, s.skipped, s.flushIn)
		}
	}
}

// startIntakeServer is startServer logging to log, returning the server's intake too.
func startIntakeServer(t *testing.T, inv Invoker, log *slog.Logger) (string, *intake) {
	t.Helper()
	got := make(chan *intake, 1)
	testHookIntake = func(in *intake) { got <- in }
	t.Cleanup(func() { testHookIntake = nil })
	socket := fuzzServerLog(t, inv, log)
	select {
	case in := <-got:
		return socket, in
	case <-time.After(patience):
		t.Fatal("Serve did not start")
		return "", nil
	}
}

// setVar sets *p to v for the test's duration (before any server starts).
func setVar[T any](t *testing.T, p *T, v T) {
	t.Helper()
	old := *p
	*p = v
	t.Cleanup(func() { *p = old })
}

// liveHeap is the heap in use after a collection.
func liveHeap() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// patience bounds a test's wait for something an idle machine sees at once, as
// etcdtest.Patience does (not imported: this package's tests need no etcd): far above what
// the slowest run needs on a busy machine, so that running out of it means it did not come.
const patience = 2 * time.Minute

// eventually polls cond every few milliseconds until it returns nil, and fails the test
// naming what and what cond last saw when that does not come within patience.
func eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	start := time.Now()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Since(start) > patience {
			t.Fatalf("%s: not so after %s; last saw: %v", what, patience, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// saw is a condition's answer for eventually: nil when ok, else what it saw.
func saw(ok bool, format string, args ...any) error {
	if ok {
		return nil
	}
	return fmt.Errorf(format, args...)
}

// clientLogLines counts the log lines about clients that could not be served and the
// events they say were left out.
func clientLogLines(t *testing.T, logs string) (lines, suppressed int) {
	t.Helper()
	for line := range strings.SplitSeq(strings.TrimSpace(logs), "\n") {
		var rec struct {
			Msg        string
			Suppressed int
		}
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		switch rec.Msg {
		case "agentapi: request not read", "agentapi: writing response", "agentapi: more clients not served":
			lines++
			suppressed += rec.Suppressed
		}
	}
	return lines, suppressed
}
