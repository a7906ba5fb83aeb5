package admin

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/leases"
)

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m)) }

// startAgent runs a real agent for node, whose allocations the admin operations then act on.
func startAgent(t testing.TB, cluster, node, uid string) *leases.Agent {
	t.Helper()
	return startAgentOn(t, etcdtest.Client(t), cluster, node, uid, 10*time.Second)
}

// startAgentOn runs a real agent for node on cli's etcd, with pod leases of ttl.
func startAgentOn(t testing.TB, cli *clientv3.Client, cluster, node, uid string, ttl time.Duration) *leases.Agent {
	t.Helper()
	cfg := leases.Config{Cluster: cluster, Node: node, NodeUID: uid, LeaseTTL: ttl, Quarantine: -1,
		SpareLeases: 2, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	a, err := leases.Start(ctx, cli, cfg)
	if err != nil {
		t.Fatalf("start agent %s/%s: %v", cluster, node, err)
	}
	t.Cleanup(a.Close)
	return a
}
