package main

import (
	"math"
	"slices"
	"time"
)

// durations is a sample of latencies.
type durations []time.Duration

// pct returns the p-th percentile (0 < p <= 100) by the nearest-rank method; 0 for no sample.
func (d durations) pct(p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	rank := int(math.Ceil(p / 100 * float64(len(s))))
	return s[min(max(rank, 1), len(s))-1]
}

func (d durations) max() time.Duration {
	if len(d) == 0 {
		return 0
	}
	return slices.Max(d)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
