// Package parallel runs one function over many inputs on every CPU.
package parallel

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// Map returns f(0), ..., f(n-1), computed on every CPU: recovery decodes thousands of
// journal lines and pod records, and decoding is most of its CPU.
func Map[T any](n int, f func(i int) T) []T {
	out := make([]T, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), n) {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				out[i] = f(i)
			}
		})
	}
	wg.Wait()
	return out
}
