package integration

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/etcdserver"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/internal/syncbuf"
	"github.com/leasehold/leasehold/keyspace"
)

// etcdCluster is a three-member etcd cluster of separate processes.
type etcdCluster struct {
	t       *testing.T
	names   []string
	clients []string
	args    [][]string
	procs   []*exec.Cmd
	done    []chan struct{}
	logs    []*syncbuf.Buffer
}

func startEtcdCluster(t *testing.T) *etcdCluster {
	t.Helper()
	c := &etcdCluster{t: t}
	var peers []string
	for i := range 3 {
		cu, err := etcdserver.FreeLoopbackURL(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		pu, err := etcdserver.FreeLoopbackURL(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		c.names = append(c.names, fmt.Sprintf("m%d", i))
		c.clients = append(c.clients, cu)
		peers = append(peers, fmt.Sprintf("m%d=%s", i, pu))
		c.args = append(c.args, []string{"--name", c.names[i], "--data-dir", t.TempDir(),
			"--listen-client-urls", cu, "--advertise-client-urls", cu,
			"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
			"--initial-cluster-token", "lh-faults", "--log-level", "error"})
	}
	for i := range c.args {
		c.args[i] = append(c.args[i], "--initial-cluster", strings.Join(peers, ","))
	}
	c.procs, c.done, c.logs = make([]*exec.Cmd, 3), make([]chan struct{}, 3), make([]*syncbuf.Buffer, 3)
	for i := range 3 {
		c.start(i)
	}
	t.Cleanup(func() {
		for i := range 3 {
			c.kill(i)
		}
	})
	c.waitHealthy()
	return c
}

func (c *etcdCluster) start(i int) {
	c.logs[i] = &syncbuf.Buffer{}
	cmd := exec.Command(filepath.Join(binDir(c.t), "etcd"), c.args[i]...)
	cmd.Stdout, cmd.Stderr = c.logs[i], c.logs[i]
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	c.procs[i], c.done[i] = cmd, done
}

func (c *etcdCluster) kill(i int) {
	if c.procs[i] == nil {
		return
	}
	_ = c.procs[i].Process.Kill()
	<-c.done[i]
	c.procs[i] = nil
}

func (c *etcdCluster) endpoints() string { return strings.Join(c.clients, ",") }

// leader returns the index of the current leader.
func (c *etcdCluster) leader() int {
	cli := etcdClient(c.t, c.clients[0])
	leader := -1
	eventually(c.t, "an etcd leader", func() error {
		var errs []error
		for i, ep := range c.clients {
			if c.procs[i] == nil {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // one try of many
			st, err := cli.Status(ctx, ep)
			cancel()
			if err == nil && st.Leader == st.Header.MemberId {
				leader = i
				return nil
			}
			errs = append(errs, fmt.Errorf("m%d: status %v, %v", i, st, err))
		}
		return errors.Join(errs...)
	})
	return leader
}

func (c *etcdCluster) waitHealthy() {
	c.t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: c.clients, DialTimeout: 5 * time.Second})
	if err != nil {
		c.t.Fatal(err)
	}
	defer cli.Close()
	eventually(c.t, "etcd cluster answers a linearizable read", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // one try of many
		defer cancel()
		_, err := cli.Get(ctx, "health")
		return err
	})
}

// TestEtcdLeaderKilledDuringABurstAndTheWholeClusterDown: a real three-member etcd. The
// leader is killed in the middle of a burst of ADDs: every ADD answers (addresses or a CNI
// error) within the plugin's deadline, no address has two owners, every successful ADD has
// its keys. The member comes back and rejoins. Then the whole cluster is down for longer
// than the lease TTL and back: the agents serve again, and the pods allocated before keep
// their addresses (etcd re-arms lease TTLs when a leader is elected).
func TestEtcdLeaderKilledDuringABurstAndTheWholeClusterDown(t *testing.T) {
	f := newFixture(t, withThreeMemberEtcd(), withShortLeases(), withAgents(2), withNetns())
	ec, name := f.Members, f.Pool
	ipam := dualStackIPAM("10.70.0.0/24", "fd70::/64")
	ipam["timeout"] = "20s"
	confs := []*struct{ conf []byte }{{netconf(name, f.Agents[0].Socket, ipam)}, {netconf(name, f.Agents[1].Socket, ipam)}}

	type outcome struct {
		ctr  string
		ips  []netip.Addr
		err  error
		took time.Duration
	}
	const n = 60
	// Real sandboxes: after the outage the agents keep only pods whose netns still exists.
	prefix := ccUniq("lhb")
	for i := range n {
		sandbox(t, fmt.Sprintf("%s-%02d", prefix, i))
	}
	results := make([]outcome, n)
	var wg sync.WaitGroup
	killed := make(chan int, 1)
	for i := range n {
		wg.Go(func() {
			if i == n/3 {
				l := ec.leader()
				ec.kill(l)
				killed <- l
			}
			ctx, cancel := context.WithTimeout(f.Ctx, etcdtest.Patience)
			defer cancel()
			ctr := fmt.Sprintf("%s-%02d", prefix, i)
			start := time.Now()
			res, err := f.pl.add(ctx, confs[i%2].conf, ctr, "eth0", "K8S_POD_UID=uid-"+ctr)
			o := outcome{ctr: ctr, err: err, took: time.Since(start)}
			if err == nil {
				for _, ip := range res.IPs {
					a, _ := netip.AddrFromSlice(ip.Address.IP)
					o.ips = append(o.ips, a.Unmap())
				}
			}
			results[i] = o
		})
	}
	wg.Wait()
	l := <-killed
	ok := 0
	seen := map[netip.Addr]string{}
	for _, o := range results {
		// The plugin gives up at its deadline: twice it leaves its own start and stop ample
		// room on a busy machine, and a plugin waiting for etcd's election does not fit.
		if o.took > 2*20*time.Second {
			t.Errorf("%s answered after %s, far past the plugin's 20s deadline", o.ctr, o.took)
		}
		if o.err != nil {
			if cniCode(o.err) == 0 {
				t.Errorf("%s failed without a CNI error: %v", o.ctr, o.err)
			}
			continue
		}
		ok++
		for _, ip := range o.ips {
			if other, dup := seen[ip]; dup {
				t.Errorf("%s given to %s and %s", ip, other, o.ctr)
			}
			seen[ip] = o.ctr
		}
	}
	t.Logf("leader m%d killed during the burst: %d of %d ADDs succeeded", l, ok, n)
	if ok < n/2 {
		t.Errorf("only %d of %d ADDs succeeded with two of three members up", ok, n)
	}
	keysPresent := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
		defer cancel()
		resp, err := f.Cli.Get(ctx, keyspace.IPsPrefix(name), clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			return -1
		}
		have := map[string]bool{}
		for _, kv := range resp.Kvs {
			have[string(kv.Key)] = true
		}
		missing := 0
		for ip := range seen {
			if !have[keyspace.IPKey(name, allocator.DefaultBlocks, ip)] {
				missing++
			}
		}
		return missing
	}
	if m := keysPresent(); m != 0 {
		t.Errorf("%d addresses of successful ADDs have no key in etcd", m)
	}

	// The killed member restarts and rejoins.
	ec.start(l)
	ec.waitHealthy()

	// The whole cluster goes down for longer than the TTL, then comes back.
	for i := range 3 {
		ec.kill(i)
	}
	time.Sleep(ttl + 2*time.Second) // no condition to poll: the outage itself must outlast the TTL
	for i := range 3 {
		ec.start(i)
	}
	ec.waitHealthy()
	// The agents serve again.
	eventually(t, "the agents serve ADDs again", func() error {
		ctx, cancel := context.WithTimeout(f.Ctx, 30*time.Second) // one try of many
		defer cancel()
		_, err := f.pl.add(ctx, confs[0].conf, "after-outage", "eth0", "K8S_POD_UID=uid-after")
		return err
	})
	// Pods allocated before the outage still hold their addresses, renewed again.
	time.Sleep(2 * ttl) // no condition to poll: the test is that several TTLs pass and every address stays
	if m := keysPresent(); m != 0 {
		t.Errorf("%d addresses of pods allocated before the outage are gone after it", m)
	}
}
