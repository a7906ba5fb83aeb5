// Package pause waits out a backoff or a grace time unless the work it waits for is
// cancelled first.
package pause

import (
	"context"
	"time"
)

// For waits d, or until ctx ends: it reports whether d passed.
func For(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
