package main

import (
	"fmt"
	"os"
	"sync"
)

// cleanups runs, once and newest first, everything the bench started or created: processes,
// clients, agents and the temporary directory. main runs it on every exit path and on
// SIGINT/SIGTERM.
var cleanups cleanupList

type cleanupList struct {
	mu   sync.Mutex
	fns  []func()
	done bool
}

// add registers f; it returns a function that runs f at once (and never again).
func (c *cleanupList) add(f func()) func() {
	var once sync.Once
	g := func() { once.Do(f) }
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done {
		g()
		return g
	}
	c.fns = append(c.fns, g)
	return g
}

func (c *cleanupList) run() {
	c.mu.Lock()
	fns := c.fns
	c.fns, c.done = nil, true
	c.mu.Unlock()
	for i := len(fns) - 1; i >= 0; i-- {
		fns[i]()
	}
}

// progress prints one line of progress to stderr.
func progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}
