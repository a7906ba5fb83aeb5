package leases

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/etcdtest"
)

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m)) }

// startAgent runs an agent for node on its own etcd client.
func startAgent(t testing.TB, cluster, node, uid string, mod ...func(*Config)) *Agent {
	t.Helper()
	return startAgentAt(t, etcdtest.Endpoint, cluster, node, uid, mod...)
}

// startAgentAt runs an agent for node on its own client of the etcd at endpoint.
func startAgentAt(t testing.TB, endpoint, cluster, node, uid string, mod ...func(*Config)) *Agent {
	t.Helper()
	cfg := Config{Cluster: cluster, Node: node, NodeUID: uid, LeaseTTL: 10 * time.Second, Quarantine: -1,
		SpareLeases: 2, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	for _, f := range mod {
		f(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	a, err := Start(ctx, etcdtest.ClientAt(t, endpoint), cfg)
	if err != nil {
		t.Fatalf("start agent %s/%s: %v", cluster, node, err)
	}
	t.Cleanup(a.Close)
	return a
}
