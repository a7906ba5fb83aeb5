package agentapi

import (
	"context"
	"errors"

	"github.com/leasehold/leasehold/allocator"
)

// CNI error codes. They are plain numbers so that this package does not import the CNI
// library; the CNI logic (package cniplugin) prints a failed command's error with its
// code, and a refused request carries its code on the wire. Codes below 100 are the CNI
// specification's well-known codes; 100-999 are leasehold's own.
//
// CodeOf maps a Service error to a code by the first allocator sentinel it wraps
// (checked with errors.Is, in this order):
//
//	sentinel                                       code  meaning
//	ErrInvalidConfig, ErrInvalidName, ErrPoolMismatch  7  invalid network config: fix the netconf or the pool
//	ErrNotInRange                                   100  requested address in no range set
//	ErrAddressInUse                                 101  requested address held by another owner or quarantined
//	ErrOnlyQuarantined, ErrPoolExhausted            102  no free address in a range set
//	ErrNotAllocated                                 103  CHECK found no allocation
//	ErrConflict                                     104  an address of this owner is held by another owner
//	ErrUnavailable                                   11  try again later: etcd unreachable, agent busy or stopping
//	context.DeadlineExceeded, context.Canceled       11  try again later: the request ran out of time
//	ErrProtocol (undecodable or unknown request)       6  decoding failure: plugin and agent disagree
//	anything else                                   999  internal error
//
// The error's full message always travels with the code.
const (
	CodeDecodingFailure      uint = 6
	CodeInvalidNetworkConfig uint = 7
	CodeTryAgainLater        uint = 11
	CodeNotInRange           uint = 100
	CodeAddressInUse         uint = 101
	CodePoolExhausted        uint = 102
	CodeNotAllocated         uint = 103
	CodeConflict             uint = 104
	CodeInternal             uint = 999
)

// ErrProtocol: a request or response could not be decoded, was too large, named an
// unknown operation or spoke another protocol version. It maps to code 6.
var ErrProtocol = errors.New("agent protocol error")

// Error is an error as it crosses the socket: a CNI code, the full message, and the name
// of the allocator sentinel it came from (when there was one). The Client returns every
// failure, local or remote, as an *Error, and Output.Result a failed CNI command.
// errors.Is(err, allocator.ErrXxx) holds on the client exactly when it held on the
// server, or, without a sentinel name, for the primary sentinel of the code (see Is).
type Error struct {
	// Code is a CNI error code (see the Code constants).
	Code uint `json:"code"`
	// Msg is the complete error message.
	Msg string `json:"msg"`
	// Sentinel names the sentinel the server-side error wrapped ("ErrPoolExhausted");
	// empty when none did. Unknown names are ignored.
	Sentinel string `json:"sentinel,omitempty"`
}

// Error returns the message.
func (e *Error) Error() string { return e.Msg }

// Is reports whether target is the allocator sentinel (or ErrProtocol) that e stands for:
// the one named by Sentinel, or, when Sentinel is empty or unknown, the primary sentinel
// of e's code (7: ErrInvalidConfig, 11: ErrUnavailable, 100-104: the matching one,
// 6: ErrProtocol). An error from ErrOnlyQuarantined also matches ErrPoolExhausted, as on
// the server.
func (e *Error) Is(target error) bool {
	if e == nil {
		return false
	}
	if s := sentinelByName(e.Sentinel); s != nil {
		return target == s || (s == allocator.ErrOnlyQuarantined && target == allocator.ErrPoolExhausted)
	}
	for _, s := range sentinels {
		if s.primary && s.code == e.Code {
			return s.err == target
		}
	}
	return false
}

// sentinels is the mapping table, in the order errors.Is is tried.
var sentinels = []struct {
	name    string
	err     error
	code    uint
	primary bool // the sentinel a bare code stands for on the client
}{
	{"ErrInvalidConfig", allocator.ErrInvalidConfig, CodeInvalidNetworkConfig, true},
	{"ErrInvalidName", allocator.ErrInvalidName, CodeInvalidNetworkConfig, false},
	{"ErrPoolMismatch", allocator.ErrPoolMismatch, CodeInvalidNetworkConfig, false},
	{"ErrNotInRange", allocator.ErrNotInRange, CodeNotInRange, true},
	{"ErrAddressInUse", allocator.ErrAddressInUse, CodeAddressInUse, true},
	{"ErrOnlyQuarantined", allocator.ErrOnlyQuarantined, CodePoolExhausted, false},
	{"ErrPoolExhausted", allocator.ErrPoolExhausted, CodePoolExhausted, true},
	{"ErrNotAllocated", allocator.ErrNotAllocated, CodeNotAllocated, true},
	{"ErrConflict", allocator.ErrConflict, CodeConflict, true},
	{"ErrUnavailable", allocator.ErrUnavailable, CodeTryAgainLater, true},
	{"ErrProtocol", ErrProtocol, CodeDecodingFailure, true},
}

func sentinelByName(name string) error {
	if name == "" {
		return nil
	}
	for _, s := range sentinels {
		if s.name == name {
			return s.err
		}
	}
	return nil
}

// CodeOf returns the CNI code for err following the table above. An *Error anywhere in
// err's chain keeps its own code. CodeOf(nil) is 0.
func CodeOf(err error) uint {
	return ErrorFrom(err).code()
}

func (e *Error) code() uint {
	if e == nil {
		return 0
	}
	return e.Code
}

// ErrorFrom converts err into its wire form. Msg is always err.Error(). An *Error in
// err's chain lends its Code and Sentinel; otherwise they come from the table above.
// ErrorFrom(nil) is nil.
func ErrorFrom(err error) *Error {
	if err == nil {
		return nil
	}
	var we *Error
	if errors.As(err, &we) {
		return &Error{Code: we.Code, Msg: err.Error(), Sentinel: we.Sentinel}
	}
	for _, s := range sentinels {
		if errors.Is(err, s.err) {
			return &Error{Code: s.code, Msg: err.Error(), Sentinel: s.name}
		}
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return &Error{Code: CodeTryAgainLater, Msg: err.Error()}
	}
	return &Error{Code: CodeInternal, Msg: err.Error()}
}
