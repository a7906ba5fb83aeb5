package main

import (
	"encoding/csv"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// row is one line of the results table: a figure measured for leasehold, the peer it is
// compared with (host-local, raw etcd, or leasehold itself under other conditions), their
// ratio and the target.
type row struct {
	Figure    string
	Leasehold float64
	Peer      float64 // NaN-free: hasPeer says whether there is one
	hasPeer   bool
	Unit      string
	PeerName  string
	Target    string
	// pass is "yes", "no" or "" (no target: reported only).
	pass  string
	Notes string
}

func (r row) ratio() (float64, bool) {
	if !r.hasPeer || r.Peer == 0 {
		return 0, false
	}
	return r.Leasehold / r.Peer, true
}

// judge sets pass from a condition.
func (r *row) judge(ok bool) {
	if ok {
		r.pass = "yes"
	} else {
		r.pass = "no"
	}
}

// sweepPoint is ADD latency at one pool occupancy, for one plugin.
type sweepPoint struct {
	Plugin    string
	Allocated int // addresses allocated when the samples started
	Size      int
	P50, P90  time.Duration
	N         int
}

// results is everything one run measured.
type results struct {
	rows    []row
	sweep   []sweepPoint
	notes   []string
	start   time.Time
	took    time.Duration
	config  string
	version string
	// etcdVersion is what bin/etcd reports.
	etcdVersion string
}

func (res *results) add(r row) { res.rows = append(res.rows, r) }

func (res *results) note(format string, args ...any) {
	res.notes = append(res.notes, fmt.Sprintf(format, args...))
}

func num(v float64) string {
	switch {
	case v == 0:
		return "0"
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
}

func (r row) cells() (lh, peer, ratio, pass string) {
	lh = num(r.Leasehold) + " " + r.Unit
	peer = "—"
	if r.hasPeer {
		peer = num(r.Peer) + " " + r.Unit
		if r.PeerName != "" {
			peer += " (" + r.PeerName + ")"
		}
	}
	ratio = "—"
	if q, ok := r.ratio(); ok {
		ratio = strconv.FormatFloat(q, 'f', 2, 64) + "x"
	}
	pass = r.pass
	if pass == "" {
		pass = "—"
	}
	return
}

// table renders the summary table in markdown.
func (res *results) table() string {
	var b strings.Builder
	b.WriteString("| figure | leasehold | peer | ratio | target | pass |\n|---|---|---|---|---|---|\n")
	for _, r := range res.rows {
		lh, peer, ratio, pass := r.cells()
		target := r.Target
		if target == "" {
			target = "—"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", r.Figure, lh, peer, ratio, target, pass)
	}
	return b.String()
}

// sweepPair is one occupancy level with the points measured there.
type sweepPair struct {
	allocated, size int
	lh, hl, ref     *sweepPoint
}

// pairs groups the sweep's points by occupancy, in the order they were measured.
func (res *results) pairs() []*sweepPair {
	var out []*sweepPair
	by := map[int]*sweepPair{}
	for i := range res.sweep {
		p := &res.sweep[i]
		pr := by[p.Allocated]
		if pr == nil {
			pr = &sweepPair{allocated: p.Allocated, size: p.Size}
			by[p.Allocated] = pr
			out = append(out, pr)
		}
		switch p.Plugin {
		case "leasehold":
			pr.lh = p
		case "leasehold-ref":
			pr.ref = p
		default:
			pr.hl = p
		}
	}
	return out
}

func (res *results) sweepTable() string {
	var b strings.Builder
	b.WriteString("| allocated | occupancy | leasehold p50 | leasehold p90 | n | host-local p50 | host-local p90 | n | leasehold, empty pool, interleaved p50 |\n|---|---|---|---|---|---|---|---|---|\n")
	cell := func(p *sweepPoint) (string, string, string) {
		if p == nil {
			return "—", "—", "—"
		}
		return fmt.Sprintf("%.2f ms", ms(p.P50)), fmt.Sprintf("%.2f ms", ms(p.P90)), strconv.Itoa(p.N)
	}
	for _, pr := range res.pairs() {
		a, b2, c := cell(pr.lh)
		d, e, f := cell(pr.hl)
		g, _, _ := cell(pr.ref)
		fmt.Fprintf(&b, "| %d | %.2f%% | %s | %s | %s | %s | %s | %s | %s |\n", pr.allocated, 100*float64(pr.allocated)/float64(pr.size), a, b2, c, d, e, f, g)
	}
	return b.String()
}

// write puts results.md and results.csv into dir.
func (res *results) write(dir string) error {
	var md strings.Builder
	md.WriteString("# leasehold benchmark results\n\n")
	fmt.Fprintf(&md, "Produced by `make bench` (`integration/bench`) on %s in %s, leasehold %s; %s, %d CPUs, GOOS %s.\n",
		res.start.UTC().Format("2006-01-02 15:04 MST"), res.took.Round(time.Second), res.version, runtime.Version(), runtime.NumCPU(), runtime.GOOS)
	fmt.Fprintf(&md, "Every figure was measured in this one run against a real etcd (bin/etcd v%s as its own process, fsync on, data on local disk), "+
		"with the real binaries (bin/leasehold, bin/leaseholdd, bin/cni/host-local from plugins v1.9.1).\n\n", res.etcdVersion)
	md.WriteString(res.table())
	md.WriteString("\n## ADD latency vs pool occupancy\n\n")
	md.WriteString("Sequential ADDs through the plugin binaries into a /16, leasehold and host-local samples interleaved at each level, " +
		"and with them leasehold ADDs into a second, nearly empty /16 (the last column), so that load from elsewhere on the shared machine shows. ")
	md.WriteString("Pre-filled allocations are spread over the pool in a fixed pseudo-random order (the same addresses for both).\n\n")
	md.WriteString("![ADD p50 vs occupancy](latency_vs_occupancy.png)\n\n")
	md.WriteString(res.sweepTable())
	md.WriteString("\n## How each figure was measured\n\n")
	for _, n := range res.notes {
		md.WriteString("- " + n + "\n")
	}
	fmt.Fprintf(&md, "\nSettings: `%s`\n", res.config)
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}

	f, err := os.Create(filepath.Join(dir, "results.csv"))
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	_ = w.Write([]string{"section", "figure", "leasehold", "peer", "unit", "ratio", "target", "pass"})
	for _, r := range res.rows {
		peer, ratio := "", ""
		if r.hasPeer {
			peer = strconv.FormatFloat(r.Peer, 'g', 6, 64)
		}
		if q, ok := r.ratio(); ok {
			ratio = strconv.FormatFloat(q, 'f', 3, 64)
		}
		_ = w.Write([]string{"summary", r.Figure, strconv.FormatFloat(r.Leasehold, 'g', 6, 64), peer, r.Unit, ratio, r.Target, r.pass})
	}
	for _, pr := range res.pairs() {
		lh, hl, ref := "", "", ""
		if pr.ref != nil {
			ref = strconv.FormatFloat(ms(pr.ref.P50), 'f', 3, 64)
		}
		if pr.lh != nil {
			lh = strconv.FormatFloat(ms(pr.lh.P50), 'f', 3, 64)
		}
		if pr.hl != nil {
			hl = strconv.FormatFloat(ms(pr.hl.P50), 'f', 3, 64)
		}
		_ = w.Write([]string{"sweep", fmt.Sprintf("ADD p50 at %d of %d allocated", pr.allocated, pr.size), lh, hl, "ms", "", "", ""})
		if ref != "" {
			_ = w.Write([]string{"sweep-ref", fmt.Sprintf("ADD p50 into an empty pool, interleaved with the samples at %d allocated", pr.allocated), ref, "", "ms", "", "", ""})
		}
	}
	w.Flush()
	if err := w.Error(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
