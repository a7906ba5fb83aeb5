package leases

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/leasehold/leasehold/leases/poolview"
)

// settleFile keeps, in the state directory, what the agent does for the settle time after
// etcd went back in time (leases/restorehold), so that an agent restarted within it goes on doing it:
// its views' knowledge of the history the restore undid (which addresses they knew allocated,
// which blocks the backup gave back to this node) is in memory only, and a restarted agent
// would otherwise hand those addresses out. Times are the machine's clock: no monotonic clock
// spans a restart.
const settleFile = "settle"

// settleState is the file's content.
type settleState struct {
	Noticed  time.Time                 `json:"noticed"`
	Until    time.Time                 `json:"until"`
	Why      string                    `json:"why"`
	Kept     map[string][]netip.Addr   `json:"kept,omitempty"`     // pool -> addresses kept
	Restored map[string][]netip.Prefix `json:"restored,omitempty"` // pool -> blocks restored
}

// saveSettle writes s into dir atomically (aside, synced, then renamed); with no directory it does
// nothing.
func saveSettle(dir string, s settleState) error {
	if dir == "" {
		return nil
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return writeAside(dir, settleFile, b)
}

// loadSettle reads the settle state of dir; ok is false when there is none, or it has ended.
func loadSettle(dir string, now time.Time) (s settleState, ok bool, err error) {
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

// writeAside writes b as dir/name atomically: into a file aside, synced, then renamed.
func writeAside(dir, name string, b []byte) error {
	tmp := filepath.Join(dir, name+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	_, err = f.Write(b)
	if serr := f.Sync(); err == nil {
		err = serr
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	return os.Rename(tmp, filepath.Join(dir, name))
}

// saveSettle writes what the agent's views keep for the settle time, once they have listed
// their pools again after etcd went back (or a bound later), so that a restart within the
// settle time keeps it too.
func (w *restoreNotices) saveSettle(relisted []<-chan struct{}) {
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
	noticed, until, why := w.hold.SettleTimes()
	if until.IsZero() {
		return
	}
	s := settleState{Noticed: time.Now().Add(-time.Since(noticed)), Until: time.Now().Add(time.Until(until)), Why: why,
		Kept: map[string][]netip.Addr{}, Restored: map[string][]netip.Prefix{}}
	w.pools.ForEachView(func(v *poolview.View) {
		kept, restored := v.SettleKnowledge()
		if len(kept) > 0 {
			s.Kept[v.Pool()] = kept
		}
		if len(restored) > 0 {
			s.Restored[v.Pool()] = restored
		}
	})
	if err := saveSettle(w.cfg.StateDir, s); err != nil {
		w.log.Warn("the settle time after etcd went back in time could not be saved; a restart within it forgets it",
			"err", err)
	}
}
