// Package syncbuf is a bytes.Buffer that several goroutines may write while another reads:
// a process's output copied by its goroutines, or a logger's lines read by the test that
// waits for them.
package syncbuf

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"sync"
)

// Buffer is safe for concurrent use. The zero value is empty and ready.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Log is a logger's output, safe to read while the logger writes.
type Log struct{ Buffer }

// Logger is a text logger of level and above writing to l.
func (l *Log) Logger(level slog.Level) *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: level}))
}

// Count is how many lines with message msg were logged.
func (l *Log) Count(msg string) int {
	return strings.Count(l.String(), fmt.Sprintf("msg=%q", msg))
}
