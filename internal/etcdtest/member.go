package etcdtest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/etcdserver"
)

// Member is an etcd member of one test's own, which the test backs up, stops and restores
// from a backup while its clients run: what an operator does with `etcdctl snapshot save` and
// `etcdutl snapshot restore`, with etcd's own code for both. The member comes back at the same
// URLs, so the clients of the test reconnect to it by themselves.
type Member struct {
	// ClientURL is the URL clients dial, the same in every life of the member.
	ClientURL string
	peerURL   string
	dir       string // one data directory per life under it
	lives     int
	etcd      *embed.Etcd

	// The streams the member serves (watches, keep-alives), which a stop ends at once: etcd's
	// own stop waits several seconds for them, then cuts them too.
	mu       sync.Mutex
	stopping bool
	streams  map[*context.CancelFunc]struct{}
}

// memberName and memberToken are what etcdserver.Start gives a member (the name, and etcd's
// default cluster token): a restore with the same name, token and peer URL makes a member of
// the same member and cluster IDs, as an operator's restore with etcdutl's defaults does.
const (
	memberName  = "leasehold"
	memberToken = "etcd-cluster"
)

// StartMember starts a member on free loopback ports; it stops and its data goes when the test
// ends (after the test's later cleanups: its clients and agents).
func StartMember(t testing.TB) *Member {
	t.Helper()
	dir, err := os.MkdirTemp("", "leasehold-member-")
	if err != nil {
		t.Fatal(err)
	}
	m := &Member{dir: dir, streams: map[*context.CancelFunc]struct{}{}}
	t.Cleanup(func() {
		m.stop()
		os.RemoveAll(dir)
	})
	ctx := context.Background()
	for range 3 { // a free port may be taken before etcd binds it: try new ones
		if m.ClientURL, err = etcdserver.FreeLoopbackURL(ctx); err != nil {
			break
		}
		if m.peerURL, err = etcdserver.FreeLoopbackURL(ctx); err != nil {
			break
		}
		if err = m.start(); err == nil {
			return m
		}
	}
	t.Fatalf("start an etcd member: %v", err)
	return nil
}

func (m *Member) dataDir() string { return filepath.Join(m.dir, fmt.Sprintf("life%d", m.lives)) }

// start runs the member on the data directory of its life, as etcdserver.Start does, with the
// streams it serves kept for stop.
func (m *Member) start() error {
	curl, err := url.Parse(m.ClientURL)
	if err != nil {
		return err
	}
	purl, err := url.Parse(m.peerURL)
	if err != nil {
		return err
	}
	ec := embed.NewConfig()
	ec.Name, ec.Dir, ec.LogLevel = memberName, m.dataDir(), "error"
	ec.ListenClientUrls, ec.AdvertiseClientUrls = []url.URL{*curl}, []url.URL{*curl}
	ec.ListenPeerUrls, ec.AdvertisePeerUrls = []url.URL{*purl}, []url.URL{*purl}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	ec.InitialClusterToken = memberToken
	ec.GRPCAdditionalServerOptions = []grpc.ServerOption{grpc.ChainStreamInterceptor(m.keepStream)}
	m.mu.Lock()
	m.stopping = false
	m.mu.Unlock()
	e, err := embed.StartEtcd(ec)
	if err != nil {
		return fmt.Errorf("%w in %s (client %s, peer %s): %w", etcdserver.ErrStart, ec.Dir, m.ClientURL, m.peerURL, err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return fmt.Errorf("%w: %w", etcdserver.ErrStart, err)
	case <-time.After(30 * time.Second):
		e.Server.Stop()
		e.Close()
		return fmt.Errorf("%w within 30s", etcdserver.ErrStart)
	}
	m.etcd = e
	return nil
}

// keepStream serves a stream with a context stop ends, which the client then sees as etcd
// unavailable; none is served while stopping.
func (m *Member) keepStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	m.mu.Lock()
	if m.stopping {
		m.mu.Unlock()
		return status.Error(codes.Unavailable, "etcd is stopping")
	}
	m.streams[&cancel] = struct{}{}
	m.mu.Unlock()
	err := handler(srv, ctxStream{ss, ctx})
	m.mu.Lock()
	delete(m.streams, &cancel)
	cut := m.stopping && ctx.Err() != nil && ss.Context().Err() == nil
	m.mu.Unlock()
	if cut {
		// What the client sees when etcd goes away (a handler's own error for a cancelled
		// context, a watch's "canceled", would end the client's watch instead of resuming it).
		return status.Error(codes.Unavailable, "etcd is stopping")
	}
	return err
}

type ctxStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s ctxStream) Context() context.Context { return s.ctx }

// stop ends the streams the member serves and stops it, as a stopped etcd does once its
// grace for them is over.
func (m *Member) stop() {
	if m.etcd == nil {
		return
	}
	m.mu.Lock()
	m.stopping = true
	for cancel := range m.streams {
		(*cancel)()
	}
	m.mu.Unlock()
	m.etcd.Close()
	m.etcd = nil
}

// Snapshot writes a backup of the member's data to path, as `etcdctl snapshot save` does.
func (m *Member) Snapshot(ctx context.Context, path string) error {
	cfg := clientv3.Config{Endpoints: []string{m.ClientURL}, DialTimeout: 5 * time.Second, Context: ctx}
	if _, err := snapshot.NewV3(zap.NewNop()).Save(ctx, cfg, path); err != nil {
		return fmt.Errorf("snapshot save of %s to %s: %w", m.ClientURL, path, err)
	}
	return nil
}

// Restart stops the member and starts it again on the same data, at the same URLs: a member
// of one begins a new raft term each time it starts.
func (m *Member) Restart() error {
	m.stop()
	return m.startAgain()
}

// Restore stops the member, restores backup (a file Snapshot wrote) into a new data directory
// as `etcdutl snapshot restore` does, and starts the member on it at the same URLs. With bump
// above 0 it restores as etcd's documentation recommends when clients watch (Kubernetes):
// `--bump-revision bump --mark-compacted`, the revision jumps forward and every watch is
// compacted; else the revision goes back to the backup's.
func (m *Member) Restore(backup string, bump uint64) error {
	m.stop()
	m.lives++
	cfg := snapshot.RestoreConfig{SnapshotPath: backup, Name: memberName, OutputDataDir: m.dataDir(),
		PeerURLs: []string{m.peerURL}, InitialCluster: memberName + "=" + m.peerURL, InitialClusterToken: memberToken,
		RevisionBump: bump, MarkCompacted: bump > 0}
	if err := snapshot.NewV3(zap.NewNop()).Restore(cfg); err != nil {
		return fmt.Errorf("snapshot restore of %s: %w", backup, err)
	}
	return m.startAgain()
}

// startAgain starts the stopped member at its URLs. The ports were the member's a moment ago;
// one still closing is tried again shortly.
func (m *Member) startAgain() error {
	var err error
	for try := 0; try < 50; try++ {
		if err = m.start(); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	u, _ := url.Parse(m.ClientURL)
	return fmt.Errorf("start the member again at %s: %w", u.Host, err)
}
