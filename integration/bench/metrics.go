package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// sample is one line of the Prometheus text format: a metric name, its labels, its value.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// scrape reads url (a /metrics endpoint: leaseholdd's or etcd's) in the text format.
func scrape(ctx context.Context, url string) ([]sample, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: %s", url, resp.Status)
	}
	return parseText(resp.Body)
}

func parseText(r io.Reader) ([]sample, error) {
	var out []sample
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		s := sample{labels: map[string]string{}}
		rest := line
		if i := strings.IndexByte(line, '{'); i >= 0 {
			j := strings.LastIndexByte(line, '}')
			if j < i {
				return nil, fmt.Errorf("metrics line %q: unbalanced braces", line)
			}
			s.name = line[:i]
			for _, kv := range splitLabels(line[i+1 : j]) {
				k, v, _ := strings.Cut(kv, "=")
				s.labels[k] = strings.Trim(v, `"`)
			}
			rest = strings.TrimSpace(line[j+1:])
		} else {
			s.name, rest, _ = strings.Cut(line, " ")
		}
		val, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
		v, err := strconv.ParseFloat(val, 64)
		if err != nil {
			return nil, fmt.Errorf("metrics line %q: %w", line, err)
		}
		s.value = v
		out = append(out, s)
	}
	return out, sc.Err()
}

// splitLabels splits `a="x",b="y,z"` at the commas outside quotes.
func splitLabels(s string) []string {
	var out []string
	inQ, start := false, 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '"':
			inQ = !inQ
		case ',':
			if !inQ {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	if start < len(s) {
		out = append(out, s[start:])
	}
	return out
}

// sum adds the values of every sample named name whose labels include want.
func sum(samples []sample, name string, want map[string]string) float64 {
	var t float64
next:
	for _, s := range samples {
		if s.name != name {
			continue
		}
		for k, v := range want {
			if s.labels[k] != v {
				continue next
			}
		}
		t += s.value
	}
	return t
}

// gather reads an in-process agent's registry into samples (counters, gauges, and the
// _count of histograms).
func gather(reg *prometheus.Registry) ([]sample, error) {
	mfs, err := reg.Gather()
	if err != nil {
		return nil, err
	}
	var out []sample
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.Counter != nil:
				out = append(out, sample{mf.GetName(), labels, m.Counter.GetValue()})
			case m.Gauge != nil:
				out = append(out, sample{mf.GetName(), labels, m.Gauge.GetValue()})
			case m.Histogram != nil:
				out = append(out, sample{mf.GetName() + "_count", labels, float64(m.Histogram.GetSampleCount())})
			}
		}
	}
	return out, nil
}
