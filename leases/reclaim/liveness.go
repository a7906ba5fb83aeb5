package reclaim

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"time"
)

// livenessLoop releases the pods whose sandbox is gone: the node's own knowledge, never
// another component's. A pod is left alone within LivenessGrace of an ADD.
func (r *Reclaimer) livenessLoop() {
	if r.cfg.LivenessInterval < 0 {
		return
	}
	t := time.NewTicker(r.cfg.LivenessInterval)
	defer t.Stop()
	for {
		select {
		case <-r.ctx.Done():
			return
		case <-t.C:
			r.releaseGoneSandboxes(r.ctx)
		}
	}
}

func (r *Reclaimer) releaseGoneSandboxes(ctx context.Context) {
	grace := r.cfg.LivenessGrace
	for owner, netns := range r.cfg.Pods.Idle(grace) {
		if !SandboxGone(netns) {
			continue
		}
		own := r.cfg.Locks.Lock(owner)
		if netns, ok := r.cfg.Pods.StillIdle(owner, grace); ok && SandboxGone(netns) {
			r.cfg.Log.Info("sandbox gone (network namespace removed); releasing its addresses", "owner", owner, "netns", netns)
			if err := r.cfg.ReleaseOwner(ctx, own); err != nil {
				r.cfg.Log.Warn("release of a gone sandbox failed; will retry", "owner", owner, "err", err)
			}
		}
		own.Unlock()
	}
}

// SandboxGone reports whether the sandbox behind netns certainly no longer exists: its
// network namespace path is gone. Any other answer (no path, a read error) counts as alive,
// so a failed look never releases a running pod's addresses.
func SandboxGone(netns string) bool {
	if netns == "" {
		return false
	}
	_, err := os.Stat(netns)
	return errors.Is(err, fs.ErrNotExist)
}
