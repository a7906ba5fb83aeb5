// Package etcdserver runs a single-member etcd inside the current process, for one-machine
// use, demos and tests (leaseholdd --embedded-etcd).
package etcdserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// Config says where the embedded member keeps its data and where it listens.
type Config struct {
	// Dir is the data directory; created if missing, reused if it holds a member already.
	Dir string
	// ClientURL is the loopback URL clients (leaseholdd, etcdctl, leaseholdctl) dial.
	ClientURL string
	// PeerURL is the member's peer URL; nothing else joins, but etcd needs one.
	PeerURL string
	// LogLevel is etcd's own log level (debug, info, warn, error); default "error".
	LogLevel string
	// StartTimeout bounds how long Start waits for the member to serve; default 30s.
	StartTimeout time.Duration
}

// Server is a running embedded etcd member.
type Server struct {
	etcd *embed.Etcd
	// ClientURL is the URL clients dial.
	ClientURL string
}

// ErrStart is wrapped by every error Start returns.
var ErrStart = errors.New("embedded etcd did not start")

// Start runs the member and waits until it serves clients or cfg.StartTimeout passes.
func Start(cfg Config) (*Server, error) {
	if cfg.Dir == "" {
		return nil, fmt.Errorf("%w: no data directory given", ErrStart)
	}
	curl, err := url.Parse(cfg.ClientURL)
	if err != nil || curl.Host == "" {
		return nil, fmt.Errorf("%w: client URL %q: want http://HOST:PORT", ErrStart, cfg.ClientURL)
	}
	purl, err := url.Parse(cfg.PeerURL)
	if err != nil || purl.Host == "" {
		return nil, fmt.Errorf("%w: peer URL %q: want http://HOST:PORT", ErrStart, cfg.PeerURL)
	}
	ec := embed.NewConfig()
	ec.Name = "leasehold"
	ec.Dir = cfg.Dir
	ec.ListenClientUrls = []url.URL{*curl}
	ec.AdvertiseClientUrls = []url.URL{*curl}
	ec.ListenPeerUrls = []url.URL{*purl}
	ec.AdvertisePeerUrls = []url.URL{*purl}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	ec.LogLevel = cfg.LogLevel
	if ec.LogLevel == "" {
		ec.LogLevel = "error"
	}
	timeout := cfg.StartTimeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	e, err := embed.StartEtcd(ec)
	if err != nil {
		return nil, fmt.Errorf("%w in %s (client %s, peer %s): %w", ErrStart, cfg.Dir, cfg.ClientURL, cfg.PeerURL, err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("%w: %w", ErrStart, err)
	case <-time.After(timeout):
		e.Server.Stop()
		e.Close()
		return nil, fmt.Errorf("%w within %s", ErrStart, timeout)
	}
	return &Server{etcd: e, ClientURL: curl.String()}, nil
}

// Err reports a fatal error of the running member.
func (s *Server) Err() <-chan error { return s.etcd.Err() }

// Close stops the member and waits for it to release its files and ports.
func (s *Server) Close() { s.etcd.Close() }

// FreeLoopbackURL returns http://127.0.0.1:PORT for a port that was free a moment ago.
// Tests and the demo use it to run several members side by side.
func FreeLoopbackURL(ctx context.Context) (string, error) {
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free loopback port: %w", err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		return "", fmt.Errorf("find a free loopback port: %w", err)
	}
	return "http://" + addr, nil
}
