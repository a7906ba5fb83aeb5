package integration

import (
	"io"
	"net"
	"sync"
	"testing"
)

// proxy forwards TCP connections from a loopback port to etcd and can cut them, a real
// network partition between an agent and etcd: while cut, connections are accepted and held
// but no byte crosses, as when packets are dropped.
type proxy struct {
	URL    string
	target string
	l      net.Listener

	mu    sync.Mutex
	cut   bool
	conns []net.Conn
}

func newProxy(t testing.TB, targetURL string) *proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{URL: "http://" + l.Addr().String(), target: hostPort(targetURL), l: l}
	go p.serve()
	t.Cleanup(func() {
		l.Close()
		p.closeAll()
	})
	return p
}

func hostPort(url string) string {
	for _, pre := range []string{"http://", "https://"} {
		if len(url) > len(pre) && url[:len(pre)] == pre {
			return url[len(pre):]
		}
	}
	return url
}

func (p *proxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.conns = append(p.conns, c)
		cut := p.cut
		p.mu.Unlock()
		if cut {
			go func() { _, _ = io.Copy(io.Discard, c) }() // black hole
			continue
		}
		go p.forward(c)
	}
}

func (p *proxy) forward(c net.Conn) {
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	p.conns = append(p.conns, u)
	p.mu.Unlock()
	go func() { _, _ = io.Copy(u, c); u.Close() }()
	_, _ = io.Copy(c, u)
	c.Close()
}

// partition drops every established connection's traffic and black-holes new ones.
func (p *proxy) partition() {
	p.mu.Lock()
	p.cut = true
	p.mu.Unlock()
	// Established connections: closing the etcd side stops delivery; the agent's side stays
	// open and silent until its keep-alive pings time out.
	p.mu.Lock()
	for _, c := range p.conns {
		if tc, ok := c.(*net.TCPConn); ok && c.RemoteAddr().String() == p.target {
			tc.Close()
		}
	}
	p.mu.Unlock()
}

// heal lets new connections through again and resets the black-holed ones.
func (p *proxy) heal() {
	p.mu.Lock()
	p.cut = false
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

func (p *proxy) closeAll() { p.heal() }
