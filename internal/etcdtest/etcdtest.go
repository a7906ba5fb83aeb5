// Package etcdtest gives tests a real etcd: one embedded member per test binary, a client per
// test, names that no other test of the run uses, a dump of what etcd holds, and a patient
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
// runnable examples, which have no *testing.T. ctx ends after Patience; done cancels it and
// closes the client.
func Connect() (ctx context.Context, cli *clientv3.Client, done func(), err error) {
	cli, err = keyspace.ClientConfig{Endpoints: []string{Endpoint}}.Dial()
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), Patience)
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

// Patience bounds a test's wait for something an idle machine sees within seconds: far above
// what the slowest run needs when `make test` runs several packages under -race on two cores
// beside other work, so that running out of it means the outcome did not come, not that the
// machine was busy. How fast something happens is the bench's to measure, not a test's.
const Patience = 2 * time.Minute

// Ctx is a test's context: it ends when the test ends, or a minute before go test's -timeout
// stops the test binary, so that a test stuck on etcd fails with its own error, naming what
// it waited for, while the other tests of the binary still get their turn. A test whose
// outcome takes time is bounded by the outcome it waits for (Eventually), not by its context.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	if d, ok := Deadline(t); ok {
		ctx, cancel = context.WithDeadline(context.Background(), d)
	}
	t.Cleanup(cancel)
	return ctx
}

// Deadline is when a test's context ends (Ctx): a minute before go test's -timeout stops the
// test binary; false when it has no timeout.
func Deadline(t testing.TB) (time.Time, bool) {
	if d, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if end, ok := d.Deadline(); ok {
			return end.Add(-time.Minute), true
		}
	}
	return time.Time{}, false
}

// Dump returns every key under prefix with the lease it is bound to.
func Dump(t testing.TB, cli *clientv3.Client, prefix string) map[string]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Patience)
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

// Eventually polls cond every 20 ms until it returns nil, and returns how long that took.
// It waits up to Patience: what it waits for comes within seconds on an idle machine, and
// nothing but the outcome is asserted. If the outcome never comes, it fails the test naming
// what it waited for, how long, and what cond last saw (its error).
func Eventually(t testing.TB, what string, cond func() error) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		err := cond()
		if err == nil {
			return time.Since(start)
		}
		if waited := time.Since(start); waited > Patience {
			t.Fatalf("%s: not so after %s; last saw: %v", what, waited.Round(time.Millisecond), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// EventuallyTrue is Eventually for a condition that says only whether it holds; the test
// says what it saw in its own failure, if it matters.
func EventuallyTrue(t testing.TB, what string, cond func() bool) time.Duration {
	t.Helper()
	return Eventually(t, what, func() error { return Saw(cond(), "not yet") })
}

// Saw is a condition's answer for Eventually: nil when ok, else what it saw.
func Saw(ok bool, format string, args ...any) error {
	if ok {
		return nil
	}
	return fmt.Errorf(format, args...)
}

// Keys is a condition for Eventually: that prefix holds n keys.
func Keys(t testing.TB, cli *clientv3.Client, prefix string, n int) func() error {
	return func() error {
		got := Dump(t, cli, prefix)
		return Saw(len(got) == n, "%d keys under %s, want %d: %v", len(got), prefix, n, got)
	}
}
