package agentapi

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// The intake: how many connections are read at once and how many bytes they may buffer.
// A plugin sends its whole request at once, right after connecting, so a connection that
// sends nothing for a while is stalled or hostile; when room is short it is the one that
// gives way (it is evicted: answered with code 11 and closed), never the newcomer.
// Variables only so that tests can shorten them.
var (
	// maxReading bounds the connections whose requests are read at once: each holds a
	// goroutine, a descriptor and a buffer. Further connections wait in the listen
	// backlog, unless one being read has been idle for evictIdle, which then gives way.
	maxReading = 128
	// maxBuffered bounds the bytes buffered by requests being read, beyond their first
	// chunks (at most maxReading of firstChunk bytes): sixteen requests of the largest
	// size at once, when a real one is a few KiB.
	maxBuffered = 16 * MaxMessageSize
	// evictIdle is how long a connection being read must have sent nothing before it may
	// be evicted for a newcomer: far longer than a plugin takes to write its request.
	evictIdle = time.Second
	// admitPoll bounds how long the accept loop sleeps, when every slot is taken, before
	// it looks again for a connection that has become idle enough to evict.
	admitPoll = 100 * time.Millisecond
)

// intakeStats is a snapshot of the requests being read.
type intakeStats struct {
	// Reading is the number of connections whose request is being read.
	Reading int
	// Buffered is the number of bytes their buffers hold.
	Buffered int
	// Evicted counts the connections evicted so far to make room for others.
	Evicted int64
}

// intake admits connections to be read and accounts for their buffers.
type intake struct {
	mu       sync.Mutex
	readers  map[*reader]struct{} // admitted, not yet done or evicted
	buffered int                  // bytes held by readers' buffers
	evicted  int64
	left     chan struct{} // signalled (never blocking) when a reader leaves
}

func newIntake() *intake {
	return &intake{readers: make(map[*reader]struct{}), left: make(chan struct{}, 1)}
}

// Stats returns the intake's current figures.
func (in *intake) Stats() intakeStats {
	in.mu.Lock()
	defer in.mu.Unlock()
	return intakeStats{Reading: len(in.readers), Buffered: in.buffered, Evicted: in.evicted}
}

// admit registers conn to be read and starts its read deadline (readTimeout). While maxReading connections are being read it
// evicts the one idle longest once it has been idle for evictIdle, or waits for one to
// leave. It returns ctx's error if ctx ends first.
func (in *intake) admit(ctx context.Context, conn net.Conn) (*reader, error) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		now := time.Now()
		in.mu.Lock()
		if len(in.readers) >= maxReading {
			if v, _ := in.idlest(nil, now, false); v != nil {
				in.evictLocked(v, now, "another connection was waiting to be read")
			}
		}
		if len(in.readers) < maxReading {
			// Before registering: an eviction's deadline must not be overwritten.
			_ = conn.SetReadDeadline(now.Add(readTimeout))
			r := &reader{in: in, conn: conn}
			r.last.Store(now.UnixNano())
			in.readers[r] = struct{}{}
			in.mu.Unlock()
			return r, nil
		}
		_, idle := in.idlest(nil, now, false)
		in.mu.Unlock()

		wait := min(max(evictIdle-idle, time.Millisecond), admitPoll)
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		select {
		case <-in.left:
		case <-timer.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// idlest returns the reader other than self that has been idle longest and how long,
// or nil when none has been idle for evictIdle. With holding, only readers holding more
// than a first chunk count.
func (in *intake) idlest(self *reader, now time.Time, holding bool) (*reader, time.Duration) {
	var best *reader
	var bestIdle time.Duration = -1
	for r := range in.readers {
		if r == self || holding && r.held <= firstChunk {
			continue
		}
		if idle := now.Sub(time.Unix(0, r.last.Load())); idle > bestIdle {
			best, bestIdle = r, idle
		}
	}
	if bestIdle < evictIdle {
		return nil, max(bestIdle, 0)
	}
	return best, bestIdle
}

// evictLocked takes r out of the intake at once, its slot and buffers included, and cuts
// its read short; r's goroutine then answers it (see reader.evictedErr). in.mu is held.
func (in *intake) evictLocked(r *reader, now time.Time, why string) {
	delete(in.readers, r)
	in.buffered -= r.held
	r.held = 0
	r.evictedFor = fmt.Sprintf("it sent nothing for %s and %s", now.Sub(time.Unix(0, r.last.Load())).Round(time.Millisecond), why)
	in.evicted++
	_ = r.conn.SetReadDeadline(now)
	in.signalLeft()
}

// signalLeft wakes an admit waiting for a slot.
func (in *intake) signalLeft() {
	select {
	case in.left <- struct{}{}:
	default:
	}
}

// errBufferFull is wrapped by the error a request is refused with when the buffer budget
// is spent on requests that are still arriving.
var errBufferFull = errors.New("request buffer budget spent")

// reader is one admitted connection: it reads the request through the intake's
// accounting and notes when each byte arrives.
type reader struct {
	in   *intake
	conn net.Conn
	last atomic.Int64 // when the last byte arrived (or admission), in Unix nanoseconds

	// Guarded by in.mu.
	held       int    // bytes of buffers granted
	evictedFor string // why it was evicted; empty while it is not
}

var _ grower = (*reader)(nil)

// Read reads from the connection and notes progress.
func (r *reader) Read(p []byte) (int, error) {
	n, err := r.conn.Read(p)
	if n > 0 {
		r.last.Store(time.Now().UnixNano())
	}
	return n, err
}

// grow grants room for n more bytes. A first chunk is always granted (maxReading bound
// them); another must fit in maxBuffered, evicting idle readers (longest first) that
// hold more than a first chunk to make room. It fails with an ErrUnavailable error
// wrapping errBufferFull when nothing can be evicted, and with the eviction's error once
// r was evicted.
func (r *reader) grow(n int, first bool) error {
	in := r.in
	in.mu.Lock()
	defer in.mu.Unlock()
	if err := r.evictedErrLocked(); err != nil {
		return err
	}
	now := time.Now()
	for !first && in.buffered+n > maxBuffered {
		v, _ := in.idlest(r, now, true)
		if v == nil {
			return fmt.Errorf("%w: %w: leaseholdd is already buffering %d bytes of requests still arriving from "+
				"other clients, its limit; try again", allocator.ErrUnavailable, errBufferFull, in.buffered)
		}
		in.evictLocked(v, now, "its buffer was needed by another request")
	}
	r.held += n
	in.buffered += n
	return nil
}

// release returns r's buffers to the budget: its request has been decoded or refused.
func (r *reader) release() {
	r.in.mu.Lock()
	defer r.in.mu.Unlock()
	if _, ok := r.in.readers[r]; ok {
		r.in.buffered -= r.held
		r.held = 0
	}
}

// evictedErr returns the error to answer r with if it was evicted, else nil.
func (r *reader) evictedErr() error {
	r.in.mu.Lock()
	defer r.in.mu.Unlock()
	return r.evictedErrLocked()
}

func (r *reader) evictedErrLocked() error {
	if r.evictedFor == "" {
		return nil
	}
	return fmt.Errorf("%w: leaseholdd stopped reading this request: %s (it reads at most %d requests and buffers "+
		"at most %d MiB at once); send the whole request at once and try again",
		allocator.ErrUnavailable, r.evictedFor, maxReading, maxBuffered>>20)
}

// leave takes r out of the intake, if eviction has not already, and frees its slot.
func (r *reader) leave() {
	in := r.in
	in.mu.Lock()
	if _, ok := in.readers[r]; ok {
		delete(in.readers, r)
		in.buffered -= r.held
		r.held = 0
	}
	in.mu.Unlock()
	in.signalLeft()
}
