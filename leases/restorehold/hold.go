// Package restorehold is what the agent does while it repairs what etcd going back in time
// took (docs/agent.md, "The restore hold"): ADDs wait for the repair, and new blocks and
// borrowed addresses wait for the settle time.
package restorehold

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// Hold is what the agent does while it repairs what etcd going back in time took.
// ADDs wait until every running pod of the node holds its addresses again (a repeated ADD
// must find its pod's keys, not claim new ones), for a lease TTL at most (repairTime). For the
// settle time after it noticed, two lease TTLs, the node claims no new block and borrows
// nothing: another node's pod created after the backup holds its address with no key and no
// held key left, in a block whose claim may be gone too, until its agent re-claims it, within
// the TTL (it notices by its keep-alives or watches, is told by the agent that noticed first,
// or finds its keys lost at its audit every half TTL), with the blocks around it. And for the
// keep time, the TTL plus the reuse delay, as long as a cut-off node's addresses are held
// back, its views pass over the addresses they knew allocated or held back before they listed
// their pools again, and the blocks a restore gave back to the node. What remains open is the pod created
// after the backup on a node cut off across the restore, outside those: its address may go to
// another pod once the settle time is over, and is a conflict when its node comes back.
//
// Its methods may be called from any goroutine: one mutex guards its state, and none of them
// calls out while holding it.
type Hold struct {
	repairTime, settle, keep time.Duration

	mu        sync.Mutex
	gen       uint64 // times noticed
	recovered uint64 // the last notice whose repair is done
	noticed   time.Time
	why       string
	repairBy  time.Time     // when ADDs go on whatever the repair's state
	until     time.Time     // end of the settle time
	keepUntil time.Time     // end of the keep time
	open      chan struct{} // closed while ADDs may go on
}

// New returns a hold with nothing to repair: ADDs go on. After a notice, ADDs wait for the
// repair for repairTime at most, new blocks and borrowing for settle, and the views keep what
// they knew taken for keep.
func New(repairTime, settle, keep time.Duration) *Hold {
	h := &Hold{repairTime: repairTime, settle: settle, keep: keep, open: make(chan struct{})}
	close(h.open)
	return h
}

// Generation counts the notices: an answer read across a change of it may be of etcd's new
// history, where what the agent knew is gone, and concludes nothing. Zero on a nil hold.
func (h *Hold) Generation() uint64 {
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.gen
}

// Notice closes the hold for a new repair and returns the end of its keep time.
func (h *Hold) Notice(why string) time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.gen++
	now := time.Now()
	h.noticed, h.why, h.repairBy, h.until, h.keepUntil = now, why, now.Add(h.repairTime), now.Add(h.settle), now.Add(h.keep)
	select {
	case <-h.open:
		h.open = make(chan struct{})
	default:
	}
	return h.keepUntil
}

// Pending is the notice a repair starting now answers.
func (h *Hold) Pending() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.gen
}

// Done records that the repair started at notice gen is complete: ADDs go on unless a later
// notice came meanwhile.
func (h *Hold) Done(gen uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if gen != h.gen || gen == h.recovered {
		return
	}
	h.recovered = gen
	close(h.open)
}

// Wait returns once ADDs may go on, or after d (or when ctx ends) with an error wrapping
// allocator.ErrUnavailable that says why they may not. ADDs go on a lease TTL after the
// notice whatever the repair's state: a pod whose re-claim keeps failing (its owner index
// taken over by another node identity) is reported by the recovery loop, and its addresses
// are never offered by this node's ADDs (podbook.Book.OwnsAddr).
func (h *Hold) Wait(ctx context.Context, d time.Duration) error {
	h.mu.Lock()
	open, why, noticed, until := h.open, h.why, h.noticed, h.repairBy
	h.mu.Unlock()
	select {
	case <-open:
		return nil
	default:
	}
	left := time.Until(until)
	if left <= 0 {
		return nil
	}
	t := time.NewTimer(min(d, left))
	defer t.Stop()
	select {
	case <-open:
		return nil
	case <-ctx.Done():
	case <-t.C:
		if !time.Now().Before(until) {
			return nil
		}
	}
	return fmt.Errorf("%w: etcd went back in time at %s (%s): this node answers ADDs again once its running pods "+
		"hold their addresses again", allocator.ErrUnavailable, noticed.UTC().Format(time.RFC3339), why)
}

// SettleTimes are the last notice's time, the end of its keep time (zero: none; the settle
// time ends before) and its reason.
func (h *Hold) SettleTimes() (noticed, until time.Time, why string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.noticed, h.keepUntil, h.why
}

// ResumeSettle goes on with the settle time of a notice an earlier process of the agent made
// (the agent's settle file): no repair is due for it (the agent's start is one), only the
// settle time.
func (h *Hold) ResumeSettle(noticed, until time.Time, why string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.noticed, h.keepUntil, h.why = noticed, until, why
	h.until = noticed.Add(h.settle)
}

// SettleEnds are the ends of the last notice's repair time, settle time and keep time.
func (h *Hold) SettleEnds() (repairBy, until, keepUntil time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.repairBy, h.until, h.keepUntil
}

// Repairing tells whether a notice's repair is not done yet: while it is, ADDs wait (Wait).
func (h *Hold) Repairing() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.gen != h.recovered
}

// ErrSettling marks an ADD refused for the settle time after etcd went back in time.
var ErrSettling = errors.New("settling after a restore")

// Settling returns, during the settle time, an error wrapping allocator.ErrUnavailable and
// ErrSettling that says why a new block or a borrowed address is refused; nil after it.
func (h *Hold) Settling() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.until.IsZero() || !time.Now().Before(h.until) {
		return nil
	}
	return fmt.Errorf("%w: %w: etcd went back in time at %s (%s): until %s this node claims no new block and borrows no "+
		"address, so that every node first re-claims what its pods held", allocator.ErrUnavailable, ErrSettling,
		h.noticed.UTC().Format(time.RFC3339), h.why, h.until.UTC().Format(time.RFC3339))
}
