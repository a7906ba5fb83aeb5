// Package etcdtest gives tests a real etcd: one embedded member per test binary, a client per
// test, names that no other test of the run uses, a dump of what etcd holds, and a bounded
// wait for a condition.
package etcdtest

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/etcdserver"
	"github.com/leasehold/leasehold/keyspace"
)

// Endpoint is the client URL of the member Main started; tests keep apart by using their own
// pool, cluster and node names (Uniq).
var Endpoint string

// Main starts an embedded etcd member in a temporary directory, runs the tests and stops it.
// Use it as `func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m)) }`.
func Main(m *testing.M) int {
	srv, stop, err := Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
	Endpoint = srv.ClientURL
	return m.Run()
}

// Start runs a new embedded member on free loopback ports. A free port can be taken by
// another process before etcd binds it (test packages run in parallel), so it tries again
// with new ports, up to three times. stop closes the member and removes its data.
func Start() (srv *etcdserver.Server, stop func(), err error) {
	dir, err := os.MkdirTemp("", "leasehold-etcd-")
	if err != nil {
		return nil, nil, err
	}
	ctx := context.Background()
	for range 3 {
		var curl, purl string
		if curl, err = etcdserver.FreeLoopbackURL(ctx); err != nil {
			break
		}
		if purl, err = etcdserver.FreeLoopbackURL(ctx); err != nil {
			break
		}
		if srv, err = etcdserver.Start(etcdserver.Config{Dir: dir, ClientURL: curl, PeerURL: purl}); err == nil {
			return srv, func() { srv.Close(); os.RemoveAll(dir) }, nil
		}
	}
	os.RemoveAll(dir)
	return nil, nil, err
}

// Connect dials Endpoint the way a program dials its etcd (keyspace.ClientConfig), for the
// runnable examples, which have no *testing.T. done cancels ctx (30 s) and closes the client.
func Connect() (ctx context.Context, cli *clientv3.Client, done func(), err error) {
	cli, err = keyspace.ClientConfig{Endpoints: []string{Endpoint}}.Dial()
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	return ctx, cli, func() { cancel(); cli.Close() }, nil
}

// Client returns a client of Endpoint, closed when the test ends.
func Client(t testing.TB) *clientv3.Client {
	t.Helper()
	return ClientAt(t, Endpoint)
}

// ClientAt returns a client of endpoint, closed when the test ends.
func ClientAt(t testing.TB, endpoint string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

var seq atomic.Int64

// Uniq returns prefix followed by a number no other call in this test binary returned.
func Uniq(prefix string) string { return fmt.Sprintf("%s%d", prefix, seq.Add(1)) }

// Ctx is a context that ends 30 s from now or when the test ends.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Dump returns every key under prefix with the lease it is bound to.
func Dump(t testing.TB, cli *clientv3.Client, prefix string) map[string]int64 {
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

// Count is how many keys of m contain part.
func Count(m map[string]int64, part string) int {
	n := 0
	for k := range m {
		if strings.Contains(k, part) {
			n++
		}
	}
	return n
}

// Eventually polls cond every 20 ms until it holds, and fails the test naming what if it
// does not hold within the bound.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not so within %s", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
