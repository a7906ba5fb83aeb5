package leases

import (
	"bufio"
	"encoding/json"
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
)

// ledgerFile, in the state directory, lists every address an import claimed or found
// claimed: one JSON line each. An import skips the addresses it lists that the agent no
// longer holds: host-local's files outlive the switch (host-local is no longer called to
// remove them), so without it an agent restarted with the same import flags would claim
// again the address of a pod deleted since.
const ledgerFile = "imported"

// ledgerEntry is one line of the ledger.
type ledgerEntry struct {
	Pool        string     `json:"pool"`
	ContainerID string     `json:"containerID"`
	IfName      string     `json:"ifName"`
	IP          netip.Addr `json:"ip"`
}

// loadLedger reads the ledger; without a state directory it is empty. An unreadable line is
// skipped (its address may be imported again, which GC or the container's DEL undoes).
func (a *Agent) loadLedger() (map[ledgerEntry]bool, error) {
	out := map[ledgerEntry]bool{}
	if a.cfg.StateDir == "" {
		return out, nil
	}
	f, err := os.Open(filepath.Join(a.cfg.StateDir, ledgerFile))
	if errors.Is(err, fs.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return out, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var e ledgerEntry
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			out[e] = true
		}
	}
	return out, sc.Err()
}

// appendLedger adds entries to the ledger and syncs it.
func (a *Agent) appendLedger(entries []ledgerEntry) error {
	if a.cfg.StateDir == "" || len(entries) == 0 {
		return nil
	}
	f, err := os.OpenFile(filepath.Join(a.cfg.StateDir, ledgerFile), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
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
func (a *Agent) reportImport(imp Import, rep ImportReport, ledger map[ledgerEntry]bool) {
	for _, e := range rep.Conflicts {
		a.log.Error("IMPORT CONFLICT: an address another IPAM plugin gave a running container is held by another owner in etcd; "+
			"it is not taken, and two containers may use it", "source", imp.Source, "pool", imp.Pool, "ip", e.IP,
			"container", e.ContainerID, "ifname", e.IfName, "detail", e.Detail)
	}
	for _, e := range rep.OutsidePool {
		a.log.Warn("import: the address is not one the pool hands out; not imported", "source", imp.Source, "pool", imp.Pool,
			"ip", e.IP, "container", e.ContainerID, "ifname", e.IfName, "detail", e.Detail)
	}
	var add []ledgerEntry
	for _, list := range [][]ImportedAddr{rep.Imported, rep.Already} {
		for _, e := range list {
			if le := (ledgerEntry{imp.Pool, e.ContainerID, e.IfName, e.IP}); !ledger[le] {
				add = append(add, le)
			}
		}
	}
	if err := a.appendLedger(add); err != nil {
		a.log.Warn("could not write the import ledger; an import run again may claim addresses released since", "err", err)
	}
	for result, n := range map[string]int{"imported": len(rep.Imported), "already": len(rep.Already), "released": len(rep.Released),
		"conflict": len(rep.Conflicts), "outside_pool": len(rep.OutsidePool)} {
		a.metrics.imports.WithLabelValues(result).Add(float64(n))
	}
	a.log.Info("import done", "source", imp.Source, "network", imp.Network, "pool", imp.Pool, "imported", len(rep.Imported),
		"already_imported", len(rep.Already), "released_since_imported", len(rep.Released), "conflicts", len(rep.Conflicts),
		"outside_pool", len(rep.OutsidePool))
}
