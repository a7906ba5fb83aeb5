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

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/thin"
)

// Client talks to leaseholdd over its unix socket, one connection per call. The zero
// value uses DefaultSocket and DefaultTimeout. A Client is safe for concurrent use.
//
// Every error a Client returns is an *Error: the agent's own (its code, message and
// sentinel intact, so errors.Is(err, allocator.ErrPoolExhausted) works), or a local one:
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

var _ Service = (*Client)(nil)

// Add asks the agent to allocate (or return the existing) addresses of req's attachment.
// Errors are *Error values; see Client.
func (c *Client) Add(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	return c.callResult(ctx, OpAdd, req)
}

// Del asks the agent to release req's attachment. Releasing nothing is not an error.
// Errors are *Error values; see Client.
func (c *Client) Del(ctx context.Context, req allocator.Request) error {
	_, err := c.call(ctx, OpDel, req)
	return err
}

// Check asks the agent whether req's attachment still holds its addresses and returns
// them. Errors are *Error values (code 103, ErrNotAllocated, when it holds none); see Client.
func (c *Client) Check(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	return c.callResult(ctx, OpCheck, req)
}

// GC asks the agent to release this node's allocations of req.Network whose attachment
// is not in req.ValidAttachments. Errors are *Error values; see Client.
func (c *Client) GC(ctx context.Context, req allocator.GCRequest) error {
	_, err := c.call(ctx, OpGC, req)
	return err
}

// Status asks the agent whether an ADD for req.Pool could succeed now. Errors are *Error
// values; see Client.
func (c *Client) Status(ctx context.Context, req allocator.StatusRequest) error {
	_, err := c.call(ctx, OpStatus, req)
	return err
}

// Invoke sends a whole plugin invocation (OpCNI), as the plugin binary does, and returns
// what the plugin process is to print and exit with. A failed CNI command is an Output
// with Exit 1, not an error; errors are the request's own (as for the other calls).
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

func (c *Client) callResult(ctx context.Context, op string, body any) (allocator.Result, error) {
	resp, err := c.call(ctx, op, body)
	if err != nil {
		return allocator.Result{}, err
	}
	if resp.Result == nil {
		return allocator.Result{}, c.protocolErr("%s answer from leaseholdd has no result", op)
	}
	return *resp.Result, nil
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
