package imports

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/leasehold/leasehold/allocator"
)

// ledgerFile, in the state directory, lists every address an import claimed or found
// claimed, or left to another owner (an IMPORT CONFLICT), and the DELs of those conflicts'
// containers: one JSON line each. An import skips the addresses it lists that the agent no
// longer holds, and a conflict whose container was deleted: host-local's files outlive the
// switch (host-local is no longer called to remove them), so without it an agent restarted
// with the same import flags would claim again the address of a pod deleted since.
const ledgerFile = "imported"

// ledgerEntry names one address of one imported attachment.
type ledgerEntry struct {
	Pool        string     `json:"pool"`
	ContainerID string     `json:"containerID"`
	IfName      string     `json:"ifName"`
	IP          netip.Addr `json:"ip"`
}

// ledgerLine is one line of the ledger: an address imported, or left to another owner
// (Conflict), or the DEL of that conflict's container (Deleted).
type ledgerLine struct {
	ledgerEntry
	Conflict bool `json:"conflict,omitempty"`
	Deleted  bool `json:"deleted,omitempty"`
}

// ledgerMark is what the ledger says of one entry.
type ledgerMark struct{ imported, conflict, deleted bool }

// importConflictRef names the attachment of an import conflict, as a DEL names it.
type importConflictRef struct{ pool, containerID, ifName string }

// loadLedger reads the ledger; without a state directory it is empty. An unreadable line is
// skipped (its address may be imported again, which GC or the container's DEL undoes).
func (im *Importer) loadLedger() (map[ledgerEntry]ledgerMark, error) {
	out := map[ledgerEntry]ledgerMark{}
	if im.cfg.StateDir == "" {
		return out, nil
	}
	f, err := os.Open(filepath.Join(im.cfg.StateDir, ledgerFile))
	if errors.Is(err, fs.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return out, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var l ledgerLine
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			continue
		}
		m := out[l.ledgerEntry]
		switch {
		case l.Deleted:
			m.deleted = true
		case l.Conflict:
			m.conflict = true
		default:
			m.imported = true
		}
		out[l.ledgerEntry] = m
	}
	return out, sc.Err()
}

// appendLedger adds entries to the ledger and syncs it.
func (im *Importer) appendLedger(entries []ledgerLine) error {
	if im.cfg.StateDir == "" || len(entries) == 0 {
		return nil
	}
	f, err := os.OpenFile(filepath.Join(im.cfg.StateDir, ledgerFile), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	for _, e := range entries {
		b, _ := json.Marshal(e)
		w.Write(append(b, '\n'))
	}
	err = errors.Join(w.Flush(), f.Sync())
	return errors.Join(err, f.Close())
}

// reportImport logs what an import did, counts it in leasehold_import_addresses_total and
// adds what the agent now holds to the ledger.
func (im *Importer) reportImport(imp Import, rep ImportReport, ledger map[ledgerEntry]ledgerMark) {
	for _, e := range rep.Conflicts {
		im.cfg.Log.Error("IMPORT CONFLICT: an address another IPAM plugin gave a running container is held by another owner in etcd; "+
			"it is not taken, and two containers may use it", "source", imp.Source, "pool", imp.Pool, "ip", e.IP,
			"container", e.ContainerID, "ifname", e.IfName, "detail", e.Detail)
	}
	for _, e := range rep.OutsidePool {
		im.cfg.Log.Warn("import: the address is not one the pool hands out; not imported", "source", imp.Source, "pool", imp.Pool,
			"ip", e.IP, "container", e.ContainerID, "ifname", e.IfName, "detail", e.Detail)
	}
	var add []ledgerLine
	for _, list := range [][]ImportedAddr{rep.Imported, rep.Already} {
		for _, e := range list {
			if le := (ledgerEntry{imp.Pool, e.ContainerID, e.IfName, e.IP}); !ledger[le].imported {
				add = append(add, ledgerLine{ledgerEntry: le})
			}
		}
	}
	im.icmu.Lock()
	for _, e := range rep.Conflicts {
		le := ledgerEntry{imp.Pool, e.ContainerID, e.IfName, e.IP}
		if !ledger[le].conflict {
			add = append(add, ledgerLine{ledgerEntry: le, Conflict: true})
		}
		ref := importConflictRef{imp.Pool, e.ContainerID, e.IfName}
		im.importConflicts[ref] = append(im.importConflicts[ref], e.IP)
	}
	im.icmu.Unlock()
	if err := im.appendLedger(add); err != nil {
		im.cfg.Log.Warn("could not write the import ledger; an import run again may claim addresses released since", "err", err)
	}
	for result, n := range map[string]int{"imported": len(rep.Imported), "already": len(rep.Already), "released": len(rep.Released),
		"conflict": len(rep.Conflicts), "outside_pool": len(rep.OutsidePool)} {
		im.cfg.Imported.WithLabelValues(result).Add(float64(n))
	}
	im.cfg.Log.Info("import done", "source", imp.Source, "network", imp.Network, "pool", imp.Pool, "imported", len(rep.Imported),
		"already_imported", len(rep.Already), "released_since_imported", len(rep.Released), "conflicts", len(rep.Conflicts),
		"outside_pool", len(rep.OutsidePool))
}

// ConflictDeleted records, before a DEL answers, that the container of an import
// conflict was deleted: the address it was using is not imported again by a later import
// with the same flags, once its other holder is gone. Only a DEL of such a container writes.
func (im *Importer) ConflictDeleted(req allocator.Request) error {
	ref := importConflictRef{req.Pool.Name, req.ContainerID, req.IfName}
	im.icmu.Lock()
	defer im.icmu.Unlock()
	ips, ok := im.importConflicts[ref]
	if !ok {
		return nil
	}
	lines := make([]ledgerLine, len(ips))
	for i, ip := range ips {
		lines[i] = ledgerLine{ledgerEntry: ledgerEntry{ref.pool, ref.containerID, ref.ifName, ip}, Deleted: true}
	}
	if err := im.appendLedger(lines); err != nil {
		return fmt.Errorf("%w: the import ledger in %s cannot record the DEL of container %s, whose address an import left to "+
			"another owner, and a restart could import it again: %w; free the state directory's disk, then retry",
			allocator.ErrUnavailable, im.cfg.StateDir, req.ContainerID, err)
	}
	delete(im.importConflicts, ref)
	return nil
}
