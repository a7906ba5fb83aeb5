package agentapi

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/leasehold/leasehold/allocator"
)

func TestErrorFrom(t *testing.T) {
	tests := []struct {
		name     string
		err      error
		code     uint
		sentinel string
	}{
		// Nil stays nil so callers can pass any error through.
		{"nil", nil, 0, ""},
		// The three configuration sentinels all mean "fix the netconf".
		{"invalid config", fmt.Errorf("range 0: %w", allocator.ErrInvalidConfig), 7, "ErrInvalidConfig"},
		{"invalid name", fmt.Errorf("%w: container ID", allocator.ErrInvalidName), 7, "ErrInvalidName"},
		{"pool mismatch", fmt.Errorf("%w: net1", allocator.ErrPoolMismatch), 7, "ErrPoolMismatch"},
		// leasehold's own codes, one per allocation failure.
		{"not in range", allocator.ErrNotInRange, 100, "ErrNotInRange"},
		{"in use", allocator.ErrAddressInUse, 101, "ErrAddressInUse"},
		{"exhausted", allocator.ErrPoolExhausted, 102, "ErrPoolExhausted"},
		// ErrOnlyQuarantined also wraps ErrPoolExhausted; the more specific name must win.
		{"only quarantined", fmt.Errorf("%w: %w", allocator.ErrOnlyQuarantined, allocator.ErrPoolExhausted), 102, "ErrOnlyQuarantined"},
		{"not allocated", allocator.ErrNotAllocated, 103, "ErrNotAllocated"},
		{"conflict", allocator.ErrConflict, 104, "ErrConflict"},
		// Transient: the runtime should retry.
		{"unavailable", fmt.Errorf("etcd: %w", allocator.ErrUnavailable), 11, "ErrUnavailable"},
		{"deadline", fmt.Errorf("txn: %w", context.DeadlineExceeded), 11, ""},
		// Protocol problems are decoding failures.
		{"protocol", ErrProtocol, 6, "ErrProtocol"},
		// An already-coded error keeps its code (and the outer message).
		{"wire error", fmt.Errorf("outer: %w", &Error{Code: 101, Msg: "inner", Sentinel: "ErrAddressInUse"}), 101, "ErrAddressInUse"},
		// Anything unknown is internal.
		{"other", errors.New("boom"), 999, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ErrorFrom(tt.err)
			if tt.err == nil {
				if got != nil {
					t.Errorf("ErrorFrom(nil) = %v, want nil", got)
				}
				return
			}
			if got.Code != tt.code || got.Sentinel != tt.sentinel {
				t.Errorf("ErrorFrom(%v) = code %d sentinel %q, want %d %q", tt.err, got.Code, got.Sentinel, tt.code, tt.sentinel)
			}
			if got.Msg != tt.err.Error() {
				t.Errorf("message %q, want the full %q", got.Msg, tt.err.Error())
			}
			if CodeOf(tt.err) != tt.code {
				t.Errorf("CodeOf = %d, want %d", CodeOf(tt.err), tt.code)
			}
		})
	}
}

func TestErrorIs(t *testing.T) {
	tests := []struct {
		name   string
		err    *Error
		target error
		want   bool
	}{
		// The sentinel named on the wire matches.
		{"named", &Error{Code: 7, Sentinel: "ErrPoolMismatch"}, allocator.ErrPoolMismatch, true},
		// ...and only that one, even when another sentinel shares the code.
		{"named excludes sibling", &Error{Code: 7, Sentinel: "ErrInvalidName"}, allocator.ErrInvalidConfig, false},
		// As on the server, only-quarantined is also exhausted.
		{"quarantined is exhausted", &Error{Code: 102, Sentinel: "ErrOnlyQuarantined"}, allocator.ErrPoolExhausted, true},
		// Exhausted is not necessarily only-quarantined.
		{"exhausted is not quarantined", &Error{Code: 102, Sentinel: "ErrPoolExhausted"}, allocator.ErrOnlyQuarantined, false},
		// A bare code (older or foreign server) falls back to its primary sentinel.
		{"bare code", &Error{Code: 102}, allocator.ErrPoolExhausted, true},
		{"bare code 11", &Error{Code: 11}, allocator.ErrUnavailable, true},
		// An unknown sentinel name is ignored in favour of the code.
		{"unknown name", &Error{Code: 104, Sentinel: "ErrFromTheFuture"}, allocator.ErrConflict, true},
		// Internal errors match no sentinel.
		{"internal", &Error{Code: 999}, allocator.ErrUnavailable, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := errors.Is(fmt.Errorf("wrapped: %w", tt.err), tt.target); got != tt.want {
				t.Errorf("errors.Is(%+v, %v) = %v, want %v", tt.err, tt.target, got, tt.want)
			}
		})
	}
}
