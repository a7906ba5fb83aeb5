package poolview

import (
	"net/netip"
	"time"
)

// What the view keeps after etcd went back in time (the agent's audit proves it, or a
// compacted watch suggests it): the addresses it knew taken that a listing since lacks, and
// the blocks a restore gave back to this node, passed over until the keep time ends.

// restartKeeping is restart after etcd went back in time: until keep, the new listing does
// not free the addresses the view knew allocated (core.kept).
func (v *View) restartKeeping(keep time.Time) <-chan struct{} {
	lk := v.lock()
	if keep.After(v.keepUntil) {
		v.keepUntil = keep
	}
	if time.Since(v.droppedAt) < droppedRecall {
		for _, a := range v.dropped {
			v.kept[a] = struct{}{}
		}
		for _, b := range v.gained {
			if sp := v.spans[b]; sp != nil {
				sp.restored = true
			}
		}
	}
	lk.unlock()
	return v.Restart()
}

// droppedRecall is how long before the proof that etcd went back a listing's dropped
// addresses are kept: the proof comes with the first answers after etcd's return, the
// listing of a compacted watch a little before.
const droppedRecall = time.Minute

// SettleKnowledge is what the view passes over for the settle time: the addresses it keeps,
// and the blocks a restore gave back to this node.
func (v *View) SettleKnowledge() (kept []netip.Addr, restored []netip.Prefix) {
	lk := v.lock()
	defer lk.unlock()
	if !time.Now().Before(v.keepUntil) {
		return nil, nil
	}
	for a := range v.kept {
		kept = append(kept, a)
	}
	for b, s := range v.spans {
		if s.restored {
			restored = append(restored, b)
		}
	}
	return kept, restored
}

// keeping tells whether the view passes over addresses it kept after etcd went back in time.
func (v *View) keeping() bool {
	lk := v.lock()
	defer lk.unlock()
	return len(v.kept) > 0 && time.Now().Before(v.keepUntil)
}
