package agentapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/leasehold/leasehold/cniplugin/thin"
)

// The wire format. A client connects to the agent's unix socket, writes one WireRequest
// as JSON, half-closes its side, reads one WireResponse as JSON and closes:
//
//	-> {"version": 1, "op": "cni", "timeoutMs": 29000, "request": {Invocation}}
//	<- {"version": 1, "cni": {"exit": 0, "stdout": "<base64>", "stderr": "<base64>"}}
//	<- {"version": 1, "error": {"code": 11, "msg": "...", "sentinel": "ErrUnavailable"}}
//
// There is one operation, cni: the request is the plugin binary's whole environment and
// stdin, which the agent runs as the plugin process once did, and the answer is what the
// process prints and its exit status (package thin is the plugin's side). A failed CNI
// command is a cni answer with exit 1 and the CNI error on stdout; an "error" answer means
// the request itself was refused: another protocol version, an unknown operation or an
// undecodable request (code 6), or an agent that is busy or shutting down (code 11).
// Unknown fields are ignored: a change of meaning needs a new ProtocolVersion, which the
// server refuses clearly. Either direction is at most MaxMessageSize bytes.

// ProtocolVersion is the version of the wire format this package speaks. A server answers
// a request of any other version with an ErrProtocol error (code 6) and does nothing.
const ProtocolVersion = thin.ProtocolVersion

// MaxMessageSize bounds one request or response (1 MiB). A larger request is refused
// with an ErrProtocol error; a larger response is treated as undecodable.
const MaxMessageSize = thin.MaxMessageSize

// OpCNI is the protocol's only operation: one whole plugin invocation. The server refuses
// any other with an ErrProtocol error (code 6).
const OpCNI = thin.OpCNI

// DefaultSocket is where leaseholdd listens unless configured otherwise.
const DefaultSocket = thin.DefaultSocket

// DefaultTimeout bounds a Client call whose Timeout is zero.
const DefaultTimeout = 30 * time.Second

// WireRequest is the envelope of one request.
type WireRequest struct {
	// Version is the client's ProtocolVersion.
	Version int `json:"version"`
	// Op is OpCNI.
	Op string `json:"op"`
	// TimeoutMillis is how long the client will wait for the answer; the server stops
	// working on the request after that (bounded by its own maximum). Zero means the
	// server's default.
	TimeoutMillis int64 `json:"timeoutMs,omitempty"`
	// Request is the operation's argument: an Invocation.
	Request json.RawMessage `json:"request"`
}

// WireResponse is the envelope of one response: CNI when the invocation ran (whatever
// its exit status), Error when the request was refused.
type WireResponse struct {
	// Version is the server's ProtocolVersion.
	Version int     `json:"version"`
	CNI     *Output `json:"cni,omitempty"`
	Error   *Error  `json:"error,omitempty"`
}

// errTooLarge is wrapped (with ErrProtocol) by readMessage for an oversize message.
var errTooLarge = errors.New("message too large")

// readMessage decodes one JSON object of at most MaxMessageSize bytes from r into v.
// Undecodable, truncated or oversize messages yield errors wrapping ErrProtocol (an
// oversize one also errTooLarge, a truncated one also io.ErrUnexpectedEOF). Other I/O
// errors (timeouts, resets, io.EOF before any byte) are returned as they are.
func readMessage(r io.Reader, v any) error {
	return readMessageWithin(r, v, nil)
}

// Buffering a message. A message is read into chunks that are added only as its bytes
// arrive, so a client that stops halfway holds what it sent plus less than one chunk,
// and nothing is copied as the message grows.
const (
	// firstChunk holds a typical request (a network configuration of a few KiB) whole.
	firstChunk = 4 << 10
	// chunkSize is each further chunk: few enough chunks for the largest message, and
	// little left unused by a client that stops.
	chunkSize = 64 << 10
)

// A grower grants a message room for n more bytes (a chunk) before they are allocated,
// or says why not; first is set for a message's first chunk.
type grower interface {
	grow(n int, first bool) error
}

// readMessageWithin is readMessage asking g (unless nil) before each chunk it adds. An
// error from g ends the read and is returned as it is.
func readMessageWithin(r io.Reader, v any, g grower) error {
	var (
		chunks [][]byte // full chunks, then the one being filled
		total  int      // bytes read
		scan   valueScanner
		end    = -1 // offset just past the message, once seen
	)
	for end < 0 {
		if total > MaxMessageSize {
			return fmt.Errorf("%w: %w: more than %d bytes", ErrProtocol, errTooLarge, MaxMessageSize)
		}
		last := len(chunks) - 1
		if last < 0 || len(chunks[last]) == cap(chunks[last]) {
			n := chunkSize
			if last < 0 {
				n = firstChunk
			}
			n = min(n, MaxMessageSize+1-total) // read one byte past the limit, no more
			if g != nil {
				if err := g.grow(n, last < 0); err != nil {
					return err
				}
			}
			chunks = append(chunks, make([]byte, 0, n))
			last++
		}
		c := chunks[last]
		n, err := r.Read(c[len(c):cap(c)])
		if n > 0 {
			if i := scan.feed(c[len(c) : len(c)+n]); i >= 0 {
				end = total + i
			}
			chunks[last] = c[:len(c)+n]
			total += n
		}
		switch {
		case end >= 0:
		case scan.notObject:
			return fmt.Errorf("%w: undecodable JSON: a message is a JSON object; this one begins with %q", ErrProtocol, scan.first)
		case err == io.EOF && !scan.started:
			return io.EOF
		case err == io.EOF:
			return fmt.Errorf("%w: message cut short after %d bytes: %w", ErrProtocol, total, io.ErrUnexpectedEOF)
		case err != nil:
			return err
		}
	}
	if total > MaxMessageSize {
		return fmt.Errorf("%w: %w: more than %d bytes", ErrProtocol, errTooLarge, MaxMessageSize)
	}
	msg := chunks[0]
	if len(chunks) > 1 {
		msg = bytes.Join(chunks, nil)
		clear(chunks) // let the chunks go while msg is decoded
	}
	if err := json.Unmarshal(msg[:end], v); err != nil {
		return fmt.Errorf("%w: undecodable JSON: %w", ErrProtocol, err)
	}
	return nil
}

// valueScanner finds where the JSON object a message begins with ends, reading the
// message piece by piece as it arrives; it tracks only strings and nesting, leaving
// validation to json.Unmarshal.
type valueScanner struct {
	started   bool // a byte other than white space was seen
	notObject bool // and it was not '{'
	first     byte
	depth     int
	inString  bool
	escaped   bool
}

// feed scans the next piece of the message and returns the offset in p just past the
// object's end, or -1 when it has not ended yet (or the message is not an object).
func (s *valueScanner) feed(p []byte) int {
	for i, c := range p {
		switch {
		case s.notObject:
			return -1
		case !s.started:
			if c == ' ' || c == '\t' || c == '\n' || c == '\r' {
				continue
			}
			s.started, s.first = true, c
			if c != '{' {
				s.notObject = true
				return -1
			}
			s.depth = 1
		case s.inString:
			switch {
			case s.escaped:
				s.escaped = false
			case c == '\\':
				s.escaped = true
			case c == '"':
				s.inString = false
			}
		case c == '"':
			s.inString = true
		case c == '{' || c == '[':
			s.depth++
		case c == '}' || c == ']':
			s.depth--
			if s.depth == 0 {
				return i + 1
			}
		}
	}
	return -1
}

// writeMessage encodes v as JSON to w, refusing to write more than MaxMessageSize bytes.
// Errors wrap ErrProtocol for encoding or size, else they are w's.
func writeMessage(w io.Writer, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("%w: encoding message: %w", ErrProtocol, err)
	}
	if len(data) > MaxMessageSize {
		return fmt.Errorf("%w: %w: %d bytes, at most %d allowed", ErrProtocol, errTooLarge, len(data), MaxMessageSize)
	}
	_, err = w.Write(data)
	return err
}
