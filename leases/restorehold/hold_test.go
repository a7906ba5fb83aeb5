package restorehold

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// TestHoldWaitsForTheRepairOfTheLastNotice: ADDs go on until a notice, wait for the repair
// of the last notice (a repair done for an earlier one does not open the hold), and for the
// repair time at most; new blocks and borrowing wait for the settle time.
func TestHoldWaitsForTheRepairOfTheLastNotice(t *testing.T) {
	ctx := context.Background()
	h := New(time.Hour, time.Hour, 2*time.Hour)
	if err := h.Wait(ctx, time.Millisecond); err != nil || h.Repairing() || h.Settling() != nil || h.Generation() != 0 {
		t.Fatalf("a new hold: Wait %v, Repairing %v, Settling %v, Generation %d", err, h.Repairing(), h.Settling(), h.Generation())
	}
	h.Notice("first")
	first := h.Pending()
	h.Notice("second")
	if err := h.Wait(ctx, time.Millisecond); !errors.Is(err, allocator.ErrUnavailable) {
		t.Errorf("Wait while repairing: %v, want allocator.ErrUnavailable", err)
	}
	if err := h.Settling(); !errors.Is(err, ErrSettling) || !errors.Is(err, allocator.ErrUnavailable) {
		t.Errorf("Settling after a notice: %v, want ErrSettling and allocator.ErrUnavailable", err)
	}
	h.Done(first)
	if !h.Repairing() {
		t.Error("the repair of an earlier notice opened the hold")
	}
	h.Done(h.Pending())
	if err := h.Wait(ctx, time.Millisecond); err != nil || h.Repairing() {
		t.Errorf("after the repair of the last notice: Wait %v, Repairing %v", err, h.Repairing())
	}
	if h.Generation() != 2 {
		t.Errorf("Generation %d after two notices, want 2", h.Generation())
	}

	// A repair that never ends holds ADDs for the repair time only.
	short := New(10*time.Millisecond, time.Hour, time.Hour)
	short.Notice("unrepaired")
	time.Sleep(20 * time.Millisecond)
	if err := short.Wait(ctx, time.Second); err != nil {
		t.Errorf("Wait after the repair time: %v", err)
	}

	// A settle time resumed from an earlier process ends settle after its notice; no repair is due.
	resumed := New(time.Hour, time.Hour, time.Hour)
	resumed.ResumeSettle(time.Now().Add(-2*time.Hour), time.Now().Add(time.Hour), "earlier")
	if err := resumed.Settling(); err != nil || resumed.Repairing() {
		t.Errorf("a resumed settle time that ended: Settling %v, Repairing %v", err, resumed.Repairing())
	}
	if _, until, why := resumed.SettleTimes(); why != "earlier" || until.Before(time.Now()) {
		t.Errorf("SettleTimes: until %v, why %q", until, why)
	}
}
