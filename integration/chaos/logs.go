package chaos

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// ParseAgentLog reads one agent's JSON log lines (slog's JSON handler: time, level, msg,
// then the attributes) and returns the lines the checker judges, and counts of the WARN and
// ERROR lines by "LEVEL msg". Lines that are not JSON (a panic's trace) are counted as
// "UNPARSED".
func ParseAgentLog(path string, slot int, node string) ([]LogEvent, map[string]int, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	var events []LogEvent
	stats := map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 {
			continue
		}
		if line[0] == '{' && !bytes.Contains(line, []byte(`"level":"WARN"`)) && !bytes.Contains(line, []byte(`"level":"ERROR"`)) &&
			!bytes.Contains(line, []byte("conflict resolved")) && !bytes.Contains(line, []byte("reusing an address")) {
			continue // an INFO or DEBUG line the checker does not read: not decoded
		}
		var l struct {
			Time   time.Time       `json:"time"`
			Level  string          `json:"level"`
			Msg    string          `json:"msg"`
			Owner  string          `json:"owner"`
			IfName string          `json:"ifname"`
			Pool   string          `json:"pool"`
			IP     string          `json:"ip"`
			Taken  json.RawMessage `json:"taken"`
			// Held is a sticky claim's conflict's: "<ip> held by <owner> (node ..., container ...)".
			Held []string `json:"held"`
		}
		if json.Unmarshal(line, &l) != nil {
			stats["UNPARSED "+firstWords(string(line), 8)]++
			continue
		}
		if l.Level == "WARN" || l.Level == "ERROR" {
			stats[l.Level+" "+l.Msg]++
		}
		ev := LogEvent{Time: l.Time, Slot: slot, Node: node, Owner: l.Owner, IfName: l.IfName, Pool: l.Pool, Msg: l.Msg}
		switch {
		case strings.HasPrefix(l.Msg, "CONFLICT"):
			ev.Kind = "conflict"
			var taken []struct {
				IP     string `json:"ip"`
				Holder string `json:"holder"`
			}
			_ = json.Unmarshal(l.Taken, &taken)
			for _, t := range taken {
				ip, _ := netip.ParseAddr(t.IP)
				ev.Taken = append(ev.Taken, Taken{IP: ip, Holder: t.Holder})
			}
			for _, h := range l.Held {
				if f := strings.Fields(h); len(f) >= 4 && f[1] == "held" && f[2] == "by" {
					ip, _ := netip.ParseAddr(f[0])
					ev.Taken = append(ev.Taken, Taken{IP: ip, Holder: f[3]})
				}
			}
		case strings.HasPrefix(l.Msg, "conflict resolved"):
			ev.Kind = "resolved"
			ev.IP, _ = netip.ParseAddr(l.IP)
		case strings.HasPrefix(l.Msg, "reusing an address whose holder expired"):
			ev.Kind = "reuse"
			ev.IP, _ = netip.ParseAddr(l.IP)
		case strings.Contains(l.Msg, "etcd's history no longer tells"):
			ev.Kind = "unknown"
			ev.IP, _ = netip.ParseAddr(l.IP)
		case strings.HasPrefix(l.Msg, "etcd went back in time"):
			ev.Kind = "wentback"
		case strings.HasPrefix(l.Msg, "keys of a running pod were deleted or changed"):
			ev.Kind = "keyslost"
		case strings.HasPrefix(l.Msg, "pod re-claimed after its lease was lost"):
			ev.Kind = "reclaimed"
		case strings.HasPrefix(l.Msg, "pod lease lost"), strings.HasPrefix(l.Msg, "the lease a claim applied on had stopped being renewed"):
			ev.Kind = "leaselost"
		default:
			continue
		}
		events = append(events, ev)
	}
	return events, stats, sc.Err()
}

func firstWords(s string, n int) string {
	f := strings.Fields(s)
	if len(f) > n {
		f = f[:n]
	}
	return strings.Join(f, " ")
}

// ReloadLogs reads the agent logs of a run directory (agents/n<slot>-g<gen>-i<inc>.log) into
// h again, in place of those recorded: a checker that reads more lines than the one that
// wrote history.json judges a stored run by them.
func ReloadLogs(h *History, dir string) error {
	files, err := filepath.Glob(filepath.Join(dir, "agents", "n*-g*-i*.log"))
	if err != nil || len(files) == 0 {
		return fmt.Errorf("no agent logs in %s: %v", dir, err)
	}
	h.Logs, h.LogStats = nil, map[string]int{}
	for _, f := range files {
		var slot, gen, inc int
		if _, err := fmt.Sscanf(filepath.Base(f), "n%d-g%d-i%d.log", &slot, &gen, &inc); err != nil {
			continue
		}
		evs, st, err := ParseAgentLog(f, slot, "")
		if err != nil {
			return err
		}
		h.Logs = append(h.Logs, evs...)
		for k, v := range st {
			h.LogStats[k] += v
		}
	}
	slices.SortStableFunc(h.Logs, func(a, b LogEvent) int { return a.Time.Compare(b.Time) })
	return nil
}
