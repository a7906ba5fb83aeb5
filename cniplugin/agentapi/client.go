package agentapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/cniplugin/thin"
)

// Client sends plugin invocations to leaseholdd over its unix socket, one connection per
// call, as the plugin binary does (package thin is the plugin's own client): for tests,
// benchmarks and tools written in Go. The zero value uses DefaultSocket and
// DefaultTimeout. A Client is safe for concurrent use.
//
// Every error a Client returns is an *Error: the agent's refusal of the request (its
// code, message and sentinel intact), or a local one:
//
//   - code 11 (ErrUnavailable) when the socket cannot be dialed (the message names the
//     socket and asks whether leaseholdd is running), when the agent closes the
//     connection without answering, or when the call runs out of time;
//   - code 6 (ErrProtocol) when the request is too large to send or the answer cannot be
//     decoded or has another protocol version.
type Client struct {
	// Socket is the agent's socket path; empty means DefaultSocket.
	Socket string
	// Timeout bounds each call, dial included, on top of ctx; zero means DefaultTimeout.
	Timeout time.Duration
}

// Invoke sends a whole plugin invocation (OpCNI), as the plugin binary does, and returns
// what the plugin process is to print and exit with. A failed CNI command is an Output
// with Exit 1, not an error (Output.Result reads it as the runtime would); errors are the
// request's own (see Client).
func (c *Client) Invoke(ctx context.Context, inv *Invocation) (*Output, error) {
	resp, err := c.call(ctx, OpCNI, inv)
	if err != nil {
		return nil, err
	}
	if resp.CNI == nil {
		return nil, c.protocolErr("%s answer from leaseholdd has no output", OpCNI)
	}
	return resp.CNI, nil
}

func (c *Client) socket() string {
	if c.Socket == "" {
		return DefaultSocket
	}
	return c.Socket
}

// call sends one request and reads its response; it returns the response only when it
// carries no error.
func (c *Client) call(ctx context.Context, op string, body any) (*WireResponse, error) {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	deadline, _ := ctx.Deadline()

	raw, err := json.Marshal(body)
	if err != nil {
		return nil, c.protocolErr("encoding %s request: %v", op, err)
	}
	wr := WireRequest{Version: ProtocolVersion, Op: op, TimeoutMillis: time.Until(deadline).Milliseconds(), Request: raw}
	data, err := json.Marshal(&wr)
	if err != nil {
		return nil, c.protocolErr("encoding %s request: %v", op, err)
	}
	if len(data) > MaxMessageSize {
		return nil, c.protocolErr("%s request is %d bytes, more than the %d leaseholdd accepts", op, len(data), MaxMessageSize)
	}

	out, err := thin.Exchange(ctx, c.socket(), data, MaxMessageSize)
	var ce *thin.CallError
	if errors.As(err, &ce) && ce.Op == "dial" {
		return nil, &Error{Code: CodeTryAgainLater, Sentinel: "ErrUnavailable",
			Msg: fmt.Sprintf("leasehold agent (leaseholdd) is not reachable at %s: %v; is leaseholdd running on this node?",
				c.socket(), err)}
	}
	if errors.Is(err, thin.ErrTooLarge) {
		err = fmt.Errorf("%w: %w", ErrProtocol, err)
	}
	var resp WireResponse
	if err == nil {
		err = readMessage(bytes.NewReader(out), &resp)
	}
	if err != nil {
		return nil, c.readErr(ctx, op, timeout, err)
	}
	if resp.Version != ProtocolVersion {
		return nil, c.protocolErr("leaseholdd at %s speaks protocol version %d, this plugin %d; "+
			"install the leasehold plugin and leaseholdd from the same release", c.socket(), resp.Version, ProtocolVersion)
	}
	if resp.Error != nil {
		return nil, resp.Error
	}
	return &resp, nil
}

// readErr classifies a failure to get an answer.
func (c *Client) readErr(ctx context.Context, op string, timeout time.Duration, err error) *Error {
	unavailable := func(format string, args ...any) *Error {
		return &Error{Code: CodeTryAgainLater, Sentinel: "ErrUnavailable", Msg: fmt.Sprintf(format, args...)}
	}
	switch {
	case ctx.Err() != nil || isTimeout(err):
		return unavailable("leaseholdd at %s did not answer the %s request within %s: %v; try again", c.socket(), op, timeout, err)
	case errors.Is(err, ErrProtocol):
		return c.protocolErr("reading %s answer from leaseholdd at %s: %v", op, c.socket(), err)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return unavailable("leaseholdd at %s closed the connection without answering the %s request (did it restart?): %v; try again",
			c.socket(), op, err)
	}
	return unavailable("talking to leaseholdd at %s (%s request): %v", c.socket(), op, err)
}

func (c *Client) protocolErr(format string, args ...any) *Error {
	return &Error{Code: CodeDecodingFailure, Sentinel: "ErrProtocol", Msg: "agent protocol error: " + fmt.Sprintf(format, args...)}
}
