package main

import (
	"fmt"
	"math/rand/v2"
	"sync"
)

// ids makes container IDs and pod UIDs shaped like a runtime's (64 hex digits; a UUID),
// unique within a run.
var ids = &idGen{r: rand.New(rand.NewPCG(6, 6))}

type idGen struct {
	mu sync.Mutex
	r  *rand.Rand
}

func (g *idGen) containerID() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return fmt.Sprintf("%016x%016x%016x%016x", g.r.Uint64(), g.r.Uint64(), g.r.Uint64(), g.r.Uint64())
}

func (g *idGen) podUID() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	a, b := g.r.Uint64(), g.r.Uint64()
	return fmt.Sprintf("%08x-%04x-4%03x-%04x-%012x", a>>32, a>>16&0xffff, a&0xfff, b>>48&0x3fff|0x8000, b&0xffffffffffff)
}
