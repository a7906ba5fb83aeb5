package integration

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Issue 27 with the real agent binary, real etcd and real network namespaces: a deleted pod
// stays deleted, and a running pod keeps its key, across kill -9, freezes longer than the
// TTL, and conflicts. The fault run (chaos_test.go) checks the same against a whole history.

// freeze stops the agent's process (SIGSTOP) without ending it; thaw continues it.
func (a *agentProc) freeze(t testing.TB) {
	t.Helper()
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
}

func (a *agentProc) thaw(t testing.TB) {
	t.Helper()
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
}

// ownerKeys counts the owner's keys under owners/ (its attachments) in cluster.
func (f *fixture) ownerKeys(owner string) int {
	f.t.Helper()
	return len(snapshot(f.t, f.Cli, keyspace.OwnerPrefix(f.Cluster, owner)))
}

// holderOf is the owner of the allocation at key, "" when there is none.
func holderOf(t testing.TB, f *fixture, key string) string {
	if !exists(t, f.Cli, key) {
		return ""
	}
	a, _ := allocation(t, f.Cli, key)
	return a.Owner
}

// logged counts the agent's log lines whose message is msg.
func (a *agentProc) logged(msg string) int {
	return strings.Count(a.logs.String(), `"msg":"`+msg+`"`)
}

// TestDelAnsweredThenKilledIsNeverBroughtBack: ADD, DEL (answered), kill -9 at a random moment
// 0-50 ms after the answer, restart with the same identity: 100 rounds, and no deleted pod's
// keys ever come back (they used to, from the journal, in 2 of 2 tries).
func TestDelAnsweredThenKilledIsNeverBroughtBack(t *testing.T) {
	f := newFixture(t, withShortLeases(), withNetns())
	conf := v4conf(f.Pool, f.Agent.Socket, "10.81.0.0/22")
	rng := rand.New(rand.NewPCG(1, 27))
	var deleted []string
	for round := range 100 {
		pod := f.sandbox("lh-dk-")
		uid := "uid-" + pod
		f.ipv4(conf, pod, "K8S_POD_UID="+uid)
		if err := f.del(conf, pod, "eth0", "K8S_POD_UID="+uid); err != nil {
			t.Fatalf("round %d: DEL: %v", round, err)
		}
		time.Sleep(time.Duration(rng.IntN(51)) * time.Millisecond) // the fault's moment, drawn
		f.Agent.kill()
		deleted = append(deleted, uid)
		f.Agent.restart(t)
		eventually(t, "the restarted agent has recovered", func() error {
			n := f.Agent.logged("recovered this node's pods")
			return saw(n == round+2, "%d recoveries logged, want %d", n, round+2) // the first start's too
		})
	}
	// A re-claim runs right after each recovery; a deleted pod brought back keeps its keys
	// for good, so the last restart's recovery round is enough to see all of them.
	eventually(t, "the last recovery round is done", func() error {
		j, n := f.Agent.journaled(t), f.ownerKeys(deleted[len(deleted)-1])
		return saw(len(j) == 0 || n > 0, "the journal lists %v", j)
	})
	for _, uid := range deleted {
		if n := f.ownerKeys(uid); n != 0 {
			t.Errorf("pod %s was deleted (DEL answered) and has %d owner keys after a kill -9 and a restart", uid, n)
		}
	}
	if n := len(snapshot(t, f.Cli, keyspace.IPsPrefix(f.Pool))); n != 0 {
		t.Errorf("%d allocations left after 100 pods were added and deleted", n)
	}
}

// TestDelsAroundAFreezeAreFinal: the agent is frozen (SIGSTOP) for twice the TTL, so its pods'
// leases expire; the runtime's DELs of half of them arrive at random moments around the
// SIGCONT, racing the re-claim. Every DEL answered is final, every other pod is re-claimed.
func TestDelsAroundAFreezeAreFinal(t *testing.T) {
	f := newFixture(t, withShortLeases(), withNetns())
	conf := v4conf(f.Pool, f.Agent.Socket, "10.82.0.0/24")
	rng := rand.New(rand.NewPCG(2, 27))
	type pod struct {
		name, uid string
		ip        netip.Addr
	}
	var pods []pod
	for range 12 {
		p := f.sandbox("lh-fz-")
		uid := "uid-" + p
		pods = append(pods, pod{p, uid, f.ipv4(conf, p, "K8S_POD_UID="+uid)})
	}
	f.Agent.freeze(t)
	eventually(t, "the frozen agent's leases expire", func() error {
		for _, p := range pods {
			if exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, p.ip)) {
				return fmt.Errorf("%s of %s is still allocated", p.ip, p.uid)
			}
		}
		return nil
	})
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, len(pods))
	for i, p := range pods[:6] {
		at := time.Duration(rng.IntN(1500)) * time.Millisecond // around the SIGCONT at 750 ms
		wg.Go(func() {
			time.Sleep(time.Until(start.Add(at)))
			errs[i] = f.del(conf, p.name, "eth0", "K8S_POD_UID="+p.uid)
		})
	}
	time.Sleep(time.Until(start.Add(750 * time.Millisecond)))
	f.Agent.thaw(t)
	wg.Wait()
	for i, err := range errs[:6] {
		if err != nil {
			t.Errorf("DEL of %s: %v", pods[i].uid, err)
		}
	}
	eventually(t, "the pods not deleted are re-claimed", func() error {
		for _, p := range pods[6:] {
			if !exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, p.ip)) {
				return fmt.Errorf("%s of %s is not allocated", p.ip, p.uid)
			}
		}
		return nil
	})
	// A DEL that found its pod's keys expired leaves the held key to the recovery, which frees
	// it after its re-claims have their answers (settleHeld): wait for that too.
	eventually(t, "the journal lists exactly the pods not deleted, and the deleted pods' addresses are not held back", func() error {
		j := f.Agent.journaled(t)
		if len(j) != 6 {
			return fmt.Errorf("the journal lists %v", j)
		}
		for _, p := range pods[:6] {
			if exists(t, f.Cli, keyspace.HeldKey(f.Pool, allocator.DefaultBlocks, p.ip)) {
				return fmt.Errorf("pod %s was deleted, and %s is still held back for it", p.uid, p.ip)
			}
		}
		return nil
	})
	for _, p := range pods[:6] {
		if n := f.ownerKeys(p.uid); n != 0 {
			t.Errorf("pod %s: DEL answered around the SIGCONT, and it has %d owner keys", p.uid, n)
		}
	}
	for _, p := range pods[6:] {
		if err := f.check(conf, p.name, "eth0", "K8S_POD_UID="+p.uid); err != nil {
			t.Errorf("CHECK of re-claimed %s: %v", p.uid, err)
		}
	}
}

// TestBurstAfterAFreezeTakesNoRunningPodsAddress: the agent is frozen (SIGSTOP) for twice the
// TTL, or killed and restarted after it, and at once given 20 ADDs: none gets an address of
// the node's running pods (expired, not yet re-claimed), and every running pod is re-claimed
// without a conflict.
func TestBurstAfterAFreezeTakesNoRunningPodsAddress(t *testing.T) {
	for _, fault := range []string{"SIGSTOP", "kill -9"} {
		t.Run(fault, func(t *testing.T) { burstAfterAFreeze(t, fault == "kill -9") })
	}
}

func burstAfterAFreeze(t *testing.T, kill bool) {
	f := newFixture(t, withShortLeases(), withNetns())
	// Blocks of 16: the running pods fill most of the node's first block, and a burst that
	// comes back to it meets their addresses first.
	blocks := allocator.Blocks{IPv4: 28, IPv6: allocator.DefaultBlocks.IPv6}
	ipam := map[string]any{"type": "leasehold", "socket": f.Agent.Socket, "ranges": [][]map[string]string{{{"subnet": "10.83.0.0/24"}}},
		"blocks": map[string]int{"ipv4": 28}}
	conf := netconf(f.Pool, f.Agent.Socket, ipam)
	running := map[netip.Addr]string{}
	var first netip.Prefix
	for range 10 {
		p := f.sandbox("lh-bf-")
		ip := f.ipv4(conf, p, "K8S_POD_UID=uid-"+p)
		running[ip] = p
		if !first.IsValid() {
			first = blocks.Of(ip)
		}
	}
	// Fill the rest of their block and free it again: the node's next search starts past the
	// block, and comes back to it, lowest address first, once the next block is full.
	var temps []string
	for i := 0; ; i++ {
		c := fmt.Sprintf("temp-%s-%d", f.Pool, i)
		temps = append(temps, c)
		if ip := f.ipv4(conf, c, "K8S_POD_UID=uid-"+c); !first.Contains(ip) || i > 16 {
			break
		}
	}
	for _, c := range temps {
		if err := f.del(conf, c, "eth0", "K8S_POD_UID=uid-"+c); err != nil {
			t.Fatal(err)
		}
	}
	if kill {
		f.Agent.kill()
	} else {
		f.Agent.freeze(t)
	}
	eventually(t, "the running pods' leases expire", func() error {
		for ip, p := range running {
			if exists(t, f.Cli, keyspace.IPKey(f.Pool, blocks, ip)) {
				return fmt.Errorf("%s of %s is still allocated", ip, p)
			}
		}
		return nil
	})
	if kill {
		f.Agent.restart(t)
	} else {
		f.Agent.thaw(t)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			c := fmt.Sprintf("burst-%s-%d", f.Pool, i)
			res, err := f.add(conf, c, "eth0", "K8S_POD_UID=uid-"+c)
			if err != nil {
				t.Errorf("ADD %s: %v", c, err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			for _, ip := range res.IPs {
				a, _ := netip.AddrFromSlice(ip.Address.IP.To4())
				if p, ok := running[a]; ok {
					t.Errorf("new pod %s got %s of the node's running pod %s", c, a, p)
				}
			}
		})
	}
	wg.Wait()
	// A re-claim logs a conflict, and writes the pod record, only once it has read the answer
	// of its claim: wait for the pod records, so that the log below says all it will.
	eventually(t, "every running pod is re-claimed", func() error {
		for ip, p := range running {
			if h := holderOf(t, f, keyspace.IPKey(f.Pool, blocks, ip)); h != "uid-"+p {
				return fmt.Errorf("%s held by %q, want uid-%s", ip, h, p)
			}
			if pk := keyspace.PodKey(f.Cluster, f.Agent.Node, "uid-"+p); !exists(t, f.Cli, pk) {
				return fmt.Errorf("%s holds %s again, and has no pod record %s yet", p, ip, pk)
			}
		}
		return nil
	})
	if n := f.Agent.logged("CONFLICT: addresses of a running pod were taken by another owner while its lease was lost"); n != 0 {
		t.Errorf("%d conflicts: the node gave its own running pods' addresses away", n)
	}
}

// TestConflictResolvesWhenTheOtherHolderLetsGo: a pod's address is taken by another node while
// its agent is partitioned past the TTL; on heal the re-claim records the conflict; when the
// other holder's DEL comes, the running pod holds its address again within one TTL, and CHECK
// passes.
func TestConflictResolvesWhenTheOtherHolderLetsGo(t *testing.T) {
	f := newFixture(t, withShortLeases(), withoutAgent(), withNetns())
	px := newProxy(t, f.Endpoint)
	agent := f.startAgent("--etcd-endpoints", px.URL, "--quarantine", "30s")
	other := f.startAgent("--quarantine", "30s")
	conf := v4conf(f.Pool, agent.Socket, "10.84.0.0/24")
	p1 := f.sandbox("lh-cr-")
	ip1 := f.ipv4(conf, p1, "K8S_POD_UID=uid-"+p1)
	px.partition()
	eventually(t, "the partitioned agent's lease expires in etcd", func() error {
		return saw(!exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip1)), "%s is still allocated", ip1)
	})
	otherConf := v4conf(f.Pool, other.Socket, "10.84.0.0/24")
	if got := f.ipv4(otherConf, "thief", "K8S_POD_UID=thief;IP="+ip1.String()); got != ip1 {
		t.Fatalf("other node got %s, asked for %s", got, ip1)
	}
	px.heal()
	conflictKey := keyspace.ConflictKey(f.Cluster, "uid-"+p1, "eth0", f.Pool)
	eventually(t, "the conflict is recorded", func() error { return saw(exists(t, f.Cli, conflictKey), "no %s", conflictKey) })
	if err := f.del(otherConf, "thief", "eth0", "K8S_POD_UID=thief"); err != nil {
		t.Fatal(err)
	}
	ipKey := keyspace.IPKey(f.Pool, allocator.DefaultBlocks, ip1)
	// The agent logs the resolution once it has read the answer of its claim, after etcd shows
	// the address back: wait for the log line too.
	const resolved = "conflict resolved: the other holder let the address go, and it is the running pod's again"
	took := eventually(t, "the running pod holds its address again", func() error {
		h, n := holderOf(t, f, ipKey), agent.logged(resolved)
		return saw(h == "uid-"+p1 && n == 1, "%s held by %q; the resolution logged %d times, want once", ip1, h, n)
	})
	t.Logf("the running pod held %s again %s after the other holder's DEL", ip1, took.Round(time.Millisecond))
	// At once, not after the other holder's 30 s quarantine: read at the revision before the
	// running pod's claim (however late the test looks), the quarantine key still stood.
	claimed, err := f.Cli.Get(f.Ctx, ipKey)
	if err != nil || len(claimed.Kvs) != 1 {
		t.Fatalf("%s: %v, %v", ipKey, claimed, err)
	}
	qKey := keyspace.QuarantineKey(f.Pool, allocator.DefaultBlocks, ip1)
	if q, err := f.Cli.Get(f.Ctx, qKey, clientv3.WithRev(claimed.Kvs[0].CreateRevision-1)); err != nil || len(q.Kvs) != 1 {
		t.Errorf("the running pod took %s back only after the other holder's quarantine ended (%s just before: %v, %v)", ip1, qKey, q, err)
	}
	if err := f.check(conf, p1, "eth0", "K8S_POD_UID=uid-"+p1); err != nil {
		t.Errorf("CHECK after the conflict was resolved: %v", err)
	}
	if exists(t, f.Cli, conflictKey) {
		t.Errorf("the conflict record outlived its resolution")
	}
}
