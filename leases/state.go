package leases

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
)

// attachment is one interface of a pod on one pool, as the agent remembers it.
type attachment struct {
	IfName      string       `json:"ifName"`
	Pool        string       `json:"pool"`
	Network     string       `json:"network"`
	ContainerID string       `json:"containerID"`
	IPs         []netip.Addr `json:"ips"`
	Created     time.Time    `json:"created"`
}

// podState is what the agent knows of one pod whose lease it holds. It is mirrored in the
// local journal, so that after a lease loss (or a restart after one) the agent can re-claim
// the addresses of the pods that still run.
type podState struct {
	Owner       string           `json:"owner"`
	Pod         allocator.PodRef `json:"pod,omitzero"`
	Netns       string           `json:"netns,omitempty"`
	NodeUID     string           `json:"nodeUID"`
	LeaseID     string           `json:"leaseID"`
	Attachments []attachment     `json:"attachments"`

	lease   clientv3.LeaseID
	lastAdd time.Time // an ADD touched the pod; sandbox liveness leaves it alone for a grace
	lost    bool      // the lease stopped being renewed; re-claim pending
}

func (ps *podState) setLease(id clientv3.LeaseID) {
	ps.lease = id
	ps.LeaseID = LeaseHex(id)
}

func (ps *podState) put(at attachment) {
	for i, old := range ps.Attachments {
		if old.IfName == at.IfName && old.Pool == at.Pool {
			ps.Attachments[i] = at
			return
		}
	}
	ps.Attachments = append(ps.Attachments, at)
}

func (ps *podState) drop(ifName, pool string) {
	ps.Attachments = slices.DeleteFunc(ps.Attachments, func(a attachment) bool { return a.IfName == ifName && a.Pool == pool })
}

func (ps *podState) clone() podState {
	c := *ps
	c.Attachments = slices.Clone(ps.Attachments)
	return c
}

// journal keeps one small JSON file per pod in a directory. Files are written to a temporary
// name and renamed, so a crash leaves the old or the new version. There is no fsync: a
// process crash keeps the page cache, and after a machine crash the boot ID, and with it the
// node UID, changes and every sandbox of the old boot is gone anyway.
type journal struct {
	dir string // empty: no journal
}

const journalExt = ".json"

// journalName is the file an owner's state is kept in: the owner itself, or, for owners too
// long to leave room for the extension and a temporary suffix within a file name's 255
// bytes, a hash of it (the owner is inside the file either way).
func journalName(owner string) string {
	if len(owner) <= 200 {
		return owner + journalExt
	}
	sum := sha256.Sum256([]byte(owner))
	return "h-" + hex.EncodeToString(sum[:16]) + journalExt
}

func (j journal) save(ps podState) error {
	if j.dir == "" {
		return nil
	}
	b, err := json.Marshal(ps)
	if err != nil {
		return err
	}
	final := filepath.Join(j.dir, journalName(ps.Owner))
	tmp := final + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("journal %s: %w", final, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		return fmt.Errorf("journal %s: %w", final, err)
	}
	return nil
}

func (j journal) remove(owner string) error {
	if j.dir == "" {
		return nil
	}
	err := os.Remove(filepath.Join(j.dir, journalName(owner)))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// load reads every pod of the journal. Unreadable files are reported and skipped, never
// deleted: they may be the only record of a running pod.
func (j journal) load() ([]podState, []error) {
	if j.dir == "" {
		return nil, nil
	}
	entries, err := os.ReadDir(j.dir)
	if err != nil {
		return nil, []error{fmt.Errorf("read journal %s: %w", j.dir, err)}
	}
	// Thousands of small files: read and decode them on every CPU, each worker on its own
	// slots, then collect in directory order.
	type slot struct {
		ps  podState
		ok  bool
		err error
	}
	slots := make([]slot, len(entries))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(2*runtime.GOMAXPROCS(0), len(entries)) {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < len(entries); i = int(next.Add(1) - 1) {
				slots[i].ps, slots[i].ok, slots[i].err = j.loadOne(entries[i])
			}
		})
	}
	wg.Wait()
	var out []podState
	var errs []error
	for _, s := range slots {
		if s.err != nil {
			errs = append(errs, s.err)
		} else if s.ok {
			out = append(out, s.ps)
		}
	}
	return out, errs
}

// loadOne reads one journal entry; ok is false for what is not a journal file.
func (j journal) loadOne(e fs.DirEntry) (podState, bool, error) {
	name := e.Name()
	if e.IsDir() || !strings.HasSuffix(name, journalExt) {
		return podState{}, false, nil
	}
	b, err := os.ReadFile(filepath.Join(j.dir, name))
	if err != nil {
		return podState{}, false, err
	}
	var ps podState
	if err := json.Unmarshal(b, &ps); err != nil || journalName(ps.Owner) != name {
		return podState{}, false, fmt.Errorf("journal file %s is unreadable (%v); leaving it", name, err)
	}
	if id, err := ParseLeaseHex(ps.LeaseID); err == nil {
		ps.lease = id
	}
	return ps, true, nil
}

// sandboxGone reports whether the sandbox behind netns certainly no longer exists: its
// network namespace path is gone. Any other answer (no path, a read error) counts as alive,
// so a failed look never releases a running pod's addresses.
func sandboxGone(netns string) bool {
	if netns == "" {
		return false
	}
	_, err := os.Stat(netns)
	return errors.Is(err, fs.ErrNotExist)
}
