package leases

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/leases/etcdserver"
)

// testEndpoint is the client URL of the real etcd member every test in this package shares;
// tests keep apart by using their own pool, cluster and node names.
var testEndpoint string

func TestMain(m *testing.M) {
	os.Exit(runWithEtcd(m))
}

func runWithEtcd(m *testing.M) int {
	dir, err := os.MkdirTemp("", "leasehold-etcd-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	// A free port can be taken by another process before etcd binds it (test packages run
	// in parallel): try again with new ports.
	var srv *etcdserver.Server
	for attempt := 1; ; attempt++ {
		srv, err = startEmbedded(dir)
		if err == nil {
			break
		}
		if attempt == 3 {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	defer srv.Close()
	testEndpoint = srv.ClientURL
	return m.Run()
}

func startEmbedded(dir string) (*etcdserver.Server, error) {
	ctx := context.Background()
	curl, err := etcdserver.FreeLoopbackURL(ctx)
	if err != nil {
		return nil, err
	}
	purl, err := etcdserver.FreeLoopbackURL(ctx)
	if err != nil {
		return nil, err
	}
	return etcdserver.Start(etcdserver.Config{Dir: dir, ClientURL: curl, PeerURL: purl})
}

func newClient(t testing.TB) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{testEndpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

var nameSeq atomic.Int64

// uniq returns a name no other test in this run uses.
func uniq(prefix string) string {
	return fmt.Sprintf("%s%d", prefix, nameSeq.Add(1))
}

// startAgent runs an agent for node on its own etcd client.
func startAgent(t testing.TB, cluster, node, uid string, mod ...func(*Config)) *Agent {
	t.Helper()
	cfg := Config{Cluster: cluster, Node: node, NodeUID: uid, LeaseTTL: 10 * time.Second, Quarantine: -1,
		SpareLeases: 2, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	for _, f := range mod {
		f(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a, err := Start(ctx, newClient(t), cfg)
	if err != nil {
		t.Fatalf("start agent %s/%s: %v", cluster, node, err)
	}
	t.Cleanup(a.Close)
	return a
}

// dump returns every key under prefix with its lease, for assertions on etcd's contents.
func dump(t testing.TB, cli *clientv3.Client, prefix string) map[string]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatalf("get %s: %v", prefix, err)
	}
	out := make(map[string]int64, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = kv.Lease
	}
	return out
}

func keysWith(m map[string]int64, part string) int {
	n := 0
	for k := range m {
		if strings.Contains(k, part) {
			n++
		}
	}
	return n
}
