package etcdtest

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
)

// Proxy forwards a client's TCP connections to a member, so that a test can keep that client
// from etcd while others reach it: Cut drops its connections and refuses new ones until Mend.
// A client that dials the proxy hears nothing of etcd in between (an agent on a node cut off).
type Proxy struct {
	// URL is the URL the client dials instead of the member's.
	URL    string
	target string
	ln     net.Listener

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
}

// StartProxy forwards to the member at clientURL until the test ends.
func StartProxy(t testing.TB, clientURL string) *Proxy {
	t.Helper()
	u, err := url.Parse(clientURL)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{URL: "http://" + ln.Addr().String(), target: u.Host, ln: ln, conns: map[net.Conn]struct{}{}}
	t.Cleanup(func() {
		ln.Close()
		p.Cut()
	})
	go p.serve()
	return p
}

// serve accepts connections until the listener closes, and forwards those that come while
// the proxy is not cut.
func (p *Proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.forward(c)
	}
}

// forward copies c to the member and back until either side ends or Cut.
func (p *Proxy) forward(c net.Conn) {
	m, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	if !p.track(c, m) {
		c.Close()
		m.Close()
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		done <- struct{}{}
	}
	go pipe(m, c)
	go pipe(c, m)
	<-done
	c.Close()
	m.Close()
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, m)
	p.mu.Unlock()
}

// track keeps c and m for Cut, unless the proxy is cut.
func (p *Proxy) track(c, m net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
		return false
	}
	p.conns[c], p.conns[m] = struct{}{}, struct{}{}
	return true
}

// Cut drops every forwarded connection and refuses new ones until Mend.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for c := range p.conns {
		c.Close()
	}
}

// Mend forwards new connections again.
func (p *Proxy) Mend() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
}
