package restorenotice

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/leasehold/leasehold/leases/node"
	"github.com/leasehold/leasehold/leases/poolview"
)

// settleFile keeps, in the state directory, what the agent does for the settle time after
// etcd went back in time (leases/restorehold), so that an agent restarted within it goes on doing it:
// its views' knowledge of the history the restore undid (which addresses they knew allocated,
// which blocks the backup gave back to this node) is in memory only, and a restarted agent
// would otherwise hand those addresses out. Times are the machine's clock: no monotonic clock
// spans a restart.
const settleFile = "settle"

// SettleState is the file's content.
type SettleState struct {
	Noticed  time.Time                 `json:"noticed"`
	Until    time.Time                 `json:"until"`
	Why      string                    `json:"why"`
	Kept     map[string][]netip.Addr   `json:"kept,omitempty"`     // pool -> addresses kept
	Restored map[string][]netip.Prefix `json:"restored,omitempty"` // pool -> blocks restored
}

// SaveSettle writes s into dir atomically (aside, synced, then renamed); with no directory it does
// nothing.
func SaveSettle(dir string, s SettleState) error {
	if dir == "" {
		return nil
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return node.WriteAside(dir, settleFile, b)
}

// LoadSettle reads the settle state of dir; ok is false when there is none, or it has ended.
func LoadSettle(dir string, now time.Time) (s SettleState, ok bool, err error) {
	if dir == "" {
		return s, false, nil
	}
	b, err := os.ReadFile(filepath.Join(dir, settleFile))
	if errors.Is(err, fs.ErrNotExist) {
		return s, false, nil
	}
	if err != nil {
		return s, false, err
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, false, fmt.Errorf("%s: %w", filepath.Join(dir, settleFile), err)
	}
	return s, now.Before(s.Until), nil
}

// saveSettle writes what the agent's views keep for the settle time, once they have listed
// their pools again after etcd went back (or a bound later), so that a restart within the
// settle time keeps it too.
func (w *Notices) saveSettle(relisted []<-chan struct{}) {
	bound := time.NewTimer(w.cfg.OpTimeout)
	defer bound.Stop()
	for _, ch := range relisted {
		select {
		case <-ch:
		case <-bound.C:
		case <-w.ctx.Done():
			return
		}
	}
	noticed, until, why := w.cfg.Hold.SettleTimes()
	if until.IsZero() {
		return
	}
	s := SettleState{Noticed: time.Now().Add(-time.Since(noticed)), Until: time.Now().Add(time.Until(until)), Why: why,
		Kept: map[string][]netip.Addr{}, Restored: map[string][]netip.Prefix{}}
	w.cfg.Pools.ForEachView(func(v *poolview.View) {
		kept, restored := v.SettleKnowledge()
		if len(kept) > 0 {
			s.Kept[v.Pool()] = kept
		}
		if len(restored) > 0 {
			s.Restored[v.Pool()] = restored
		}
	})
	if err := SaveSettle(w.cfg.StateDir, s); err != nil {
		w.cfg.Log.Warn("the settle time after etcd went back in time could not be saved; a restart within it forgets it",
			"err", err)
	}
}
