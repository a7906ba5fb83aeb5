package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/netip"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// table writes aligned columns; rows are tab-separated.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)}
	if len(header) > 0 {
		t.row(header...)
	}
	return t
}

func (t *table) row(cols ...string) { fmt.Fprintln(t.tw, strings.Join(cols, "\t")) }

func (t *table) flush() error { return t.tw.Flush() }

// writeJSON is every -o json output: indented, one document.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// short cuts a container ID to the 12 characters runtimes show.
func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return dash(id)
}

// dash is s, or "-" when s is empty.
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// podText is "namespace/name", or "-".
func podText(p allocator.PodRef) string {
	if p.Name == "" {
		return "-"
	}
	return p.Namespace + "/" + p.Name
}

// timeText is t in RFC 3339 with how long ago it was, or "-" for the zero time.
func timeText(t time.Time, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339) + " (" + ago(now.Sub(t)) + ")"
}

// ago renders a duration in whole seconds, minutes, hours or days.
func ago(d time.Duration) string {
	switch {
	case d < 0:
		return "in " + strings.TrimSuffix(ago(-d), " ago")
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d.Hours()))
	}
	return fmt.Sprintf("%dd ago", int(d.Hours()/24))
}

// ttlText is a lease's TTL left for tables.
func ttlText(ttl, granted int64) string {
	if ttl < 0 {
		return "-"
	}
	return fmt.Sprintf("%ds/%ds", ttl, granted)
}

// bigText prints a count; sizes of IPv6 ranges exceed 64 bits.
func bigText(n *big.Int) string {
	if n == nil {
		return "0"
	}
	return n.String()
}

// prefixesText lists prefixes, or "none".
func prefixesText(ps []netip.Prefix) string {
	if len(ps) == 0 {
		return "none"
	}
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = p.String()
	}
	return strings.Join(parts, ", ")
}
