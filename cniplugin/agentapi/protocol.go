package agentapi

import (
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

// readMessage decodes one JSON value of at most MaxMessageSize bytes from r into v.
// Undecodable, truncated or oversize messages yield errors wrapping ErrProtocol (an
// oversize one also errTooLarge, a truncated one also io.ErrUnexpectedEOF). Other I/O
// errors (timeouts, resets, io.EOF before any byte) are returned as they are.
func readMessage(r io.Reader, v any) error {
	lr := &io.LimitedReader{R: r, N: MaxMessageSize + 1}
	dec := json.NewDecoder(lr)
	err := dec.Decode(v)
	if lr.N <= 0 {
		return fmt.Errorf("%w: %w: more than %d bytes", ErrProtocol, errTooLarge, MaxMessageSize)
	}
	if err == nil {
		return nil
	}
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	if errors.As(err, &syn) || errors.As(err, &typ) {
		return fmt.Errorf("%w: undecodable JSON: %w", ErrProtocol, err)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: message cut short after %d bytes: %w", ErrProtocol, dec.InputOffset(), err)
	}
	return err
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
