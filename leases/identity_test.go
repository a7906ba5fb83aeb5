package leases

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

func readNodeRecord(t *testing.T, cli *clientv3.Client, cluster, node string) (keyspace.NodeRecord, int64) {
	t.Helper()
	resp, err := cli.Get(ctxT(t), keyspace.NodeKey(cluster, node))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("node record %s/%s: %v, %d keys", cluster, node, err, len(resp.Kvs))
	}
	var rec keyspace.NodeRecord
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
		t.Fatal(err)
	}
	return rec, resp.Kvs[0].Lease
}

// TestSameIdentityOnAnotherHostIsRefused: two machines given one node identity (the same
// --node-uid on a cloned image, say) would renew, adopt and release the same pods; the state
// directory's lock cannot see across machines, so the node record does. The second host is
// refused while the first runs; a different node UID under the same name (a replacement
// machine: the same-name replacement) and the same host's next process (after a kill -9) are not.
func TestSameIdentityOnAnotherHostIsRefused(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	first := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.Host = "host-a" })
	before, beforeLease := readNodeRecord(t, cli, cluster, "n1")
	if before.Host != "host-a" || before.UID != "uid1" {
		t.Fatalf("node record: %+v", before)
	}

	_, err := Start(ctxT(t), etcdtest.Client(t), Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", Host: "host-b",
		LeaseTTL: 10 * time.Second, StateDir: t.TempDir()})
	if !errors.Is(err, ErrAgentRunning) || !strings.Contains(err.Error(), `"host-a"`) || !strings.Contains(err.Error(), `"host-b"`) {
		t.Fatalf("same identity on another host: want ErrAgentRunning naming both hosts, got %v", err)
	}
	if after, lease := readNodeRecord(t, cli, cluster, "n1"); after != before || lease != beforeLease {
		t.Errorf("the refused agent changed the node record: %+v on %x, was %+v on %x", after, lease, before, beforeLease)
	}
	if _, err := first.Add(ctxT(t), addReq(dualStack(etcdtest.Uniq("p"), "10.40.0.0/24", "fd40::/120"), "c1", "eth0", "")); err != nil {
		t.Errorf("the first agent after the refusal: %v", err)
	}

	// The same host's next process: a record left on a live lease by a process that is gone.
	cluster2 := etcdtest.Uniq("c")
	grant, err := cli.Grant(ctxT(t), 30)
	if err != nil {
		t.Fatal(err)
	}
	stale := keyspace.NodeRecord{UID: "uid1", Host: "host-a", PID: 1, LeaseID: keyspace.LeaseHex(grant.ID)}
	if _, err := cli.Put(ctxT(t), keyspace.NodeKey(cluster2, "n1"), keyspace.Encode(stale), clientv3.WithLease(grant.ID)); err != nil {
		t.Fatal(err)
	}
	startAgent(t, cluster2, "n1", "uid1", func(c *Config) { c.Host = "host-a" })
	if rec, lease := readNodeRecord(t, cli, cluster2, "n1"); rec.PID == 1 || lease == int64(grant.ID) {
		t.Errorf("the same host did not take over its previous process's record: %+v on %x", rec, lease)
	}

	// An earlier version's record names no host: taken over, not refused.
	cluster3 := etcdtest.Uniq("c")
	legacy := keyspace.NodeRecord{UID: "uid1", PID: 2, LeaseID: keyspace.LeaseHex(grant.ID)}
	if _, err := cli.Put(ctxT(t), keyspace.NodeKey(cluster3, "n1"), keyspace.Encode(legacy), clientv3.WithLease(grant.ID)); err != nil {
		t.Fatal(err)
	}
	startAgent(t, cluster3, "n1", "uid1", func(c *Config) { c.Host = "host-b" })
	if rec, _ := readNodeRecord(t, cli, cluster3, "n1"); rec.Host != "host-b" {
		t.Errorf("a record without a host was not taken over: %+v", rec)
	}

	// A replacement machine: same name, another node UID.
	startAgent(t, cluster, "n1", "uid2", func(c *Config) { c.Host = "host-b" })
	if rec, _ := readNodeRecord(t, cli, cluster, "n1"); rec.UID != "uid2" || rec.Host != "host-b" {
		t.Errorf("replacement machine's record: %+v", rec)
	}
}

// TestSecondAgentOnTheHostWithAnotherStateDirectoryIsRefused: the state directory's lock
// cannot see a second agent of the same identity given another --state-dir; the host-wide
// lock on the identity does, and it is free again as soon as the first agent stops.
func TestSecondAgentOnTheHostWithAnotherStateDirectoryIsRefused(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	first := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.StateDir = t.TempDir() })
	before, lease := readNodeRecord(t, cli, cluster, "n1")
	cfg := Config{Cluster: cluster, Node: "n1", NodeUID: "uid1", StateDir: t.TempDir(), LeaseTTL: 10 * time.Second}
	_, err := Start(ctxT(t), etcdtest.Client(t), cfg)
	if !errors.Is(err, ErrAgentRunning) || !strings.Contains(err.Error(), "already serves") {
		t.Fatalf("second agent of the identity on this host: want ErrAgentRunning, got %v", err)
	}
	if after, l := readNodeRecord(t, cli, cluster, "n1"); after != before || l != lease {
		t.Errorf("the refused agent changed the node record: %+v, was %+v", after, before)
	}
	// Another node UID under the name is another identity: not this lock's business.
	startAgent(t, cluster, "n1", "uid2")
	first.Close()
	second, err := Start(ctxT(t), etcdtest.Client(t), cfg)
	if err != nil {
		t.Fatalf("after the first agent stopped: %v", err)
	}
	second.Close()
}

// TestAgentStopsWhenAnotherHostTookItsIdentity: an agent whose node lease was lost (etcd did
// not hear from it for a TTL) finds, when it registers again, that a second host now serves its
// node identity. It must not re-claim and fight over the pods: it stops, says why, and refuses
// every request from then on.
func TestAgentStopsWhenAnotherHostTookItsIdentity(t *testing.T) {
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	a := startAgent(t, cluster, "n1", "uid1", func(c *Config) { c.Host = "host-a" })
	_, nodeLease := readNodeRecord(t, cli, cluster, "n1")

	// Another host registers the identity and the first agent's node lease is gone: the key
	// moves to the other host's lease first, so the revoke deletes nothing of it.
	other, err := cli.Grant(ctxT(t), 30)
	if err != nil {
		t.Fatal(err)
	}
	rec := keyspace.NodeRecord{UID: "uid1", Host: "host-b", PID: 4242, LeaseID: keyspace.LeaseHex(other.ID)}
	if _, err := cli.Put(ctxT(t), keyspace.NodeKey(cluster, "n1"), keyspace.Encode(rec), clientv3.WithLease(other.ID)); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctxT(t), clientv3.LeaseID(nodeLease)); err != nil {
		t.Fatal(err)
	}

	select {
	case <-a.Stopped():
	case <-time.After(etcdtest.Patience):
		t.Fatalf("the agent kept running for %s after another host took its node identity", etcdtest.Patience)
	}
	if err := a.Err(); !errors.Is(err, ErrAgentRunning) || !strings.Contains(err.Error(), `"host-b"`) {
		t.Errorf("Err: want ErrAgentRunning naming host-b, got %v", err)
	}
	_, err = a.Add(ctxT(t), addReq(dualStack(etcdtest.Uniq("p"), "10.41.0.0/24", "fd41::/120"), "c1", "eth0", ""))
	if !errors.Is(err, allocator.ErrUnavailable) || !strings.Contains(err.Error(), "stopped") {
		t.Errorf("ADD on a stopped agent: want ErrUnavailable saying it stopped, got %v", err)
	}
	if got, _ := readNodeRecord(t, cli, cluster, "n1"); got.Host != "host-b" {
		t.Errorf("the stopped agent overwrote the other host's record: %+v", got)
	}
}

// TestSteppedWallClockChangesNoLeaseOrDecision: an NTP step or an admin's date -s on the node
// moves the wall clock. Leases are etcd's (TTLs counted by the etcd member, on its monotonic
// clock), and every age the agent itself decides on (GC grace, liveness grace, the quarantine
// lease's window, readiness) is read on the monotonic clock, so only the timestamps written into
// records follow the step. The test steps the agent's wall clock (Config.WallClock; the real
// clock of this machine is shared with everything else on it, so it is not touched) 48 hours
// forward and back, and checks each of those. Before the fix, GC compared the records' wall-
// clock creation times: a step forward collected an attachment made a second earlier, and a
// step back would have protected a stale one for two days.
func TestSteppedWallClockChangesNoLeaseOrDecision(t *testing.T) {
	// A TTL renewed every 2 s: a busy machine's keep-alive stays far inside it.
	const ttl, quarantine, grace = 6 * time.Second, 2 * time.Second, 2 * time.Second
	var offset atomic.Int64
	wall := func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
	cluster := etcdtest.Uniq("c")
	cli := etcdtest.Client(t)
	a := startAgent(t, cluster, "n1", "uid1", func(c *Config) {
		c.LeaseTTL, c.Quarantine, c.GCGrace, c.WallClock = ttl, quarantine, grace, wall
	})
	pool := allocator.PoolSpec{Name: etcdtest.Uniq("p"), Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.42.0.0/29")}}}}
	gc := allocator.GCRequest{Network: pool.Name, Pool: pool}
	ctx := ctxT(t)
	time.Sleep(grace) // past the first grace after start, where only wall-clock ages exist

	// Step forward right after an ADD: the attachment is a second old, not two days. A
	// machine so busy that the grace passes between the ADD and the GC leaves nothing to
	// check; then it is tried again with a new pod.
	var first allocator.Result
	var ipKey, ctr, uid string
	for try := 0; ; try++ {
		offset.Store(0)
		ctr, uid = fmt.Sprint("c1-", try), fmt.Sprint("uid-1-", try)
		start := time.Now()
		var err error
		if first, err = a.Add(ctx, addReq(pool, ctr, "eth0", uid)); err != nil {
			t.Fatal(err)
		}
		offset.Store(int64(48 * time.Hour))
		if err := a.GC(ctx, gc); err != nil {
			t.Fatal(err)
		}
		ipKey = keyspace.IPKey(pool.Name, allocator.DefaultBlocks, first.IPs[0].Address.Addr())
		kept := len(etcdtest.Dump(t, cli, ipKey)) == 1
		if took := time.Since(start); !kept && took < grace {
			t.Fatal("GC collected an attachment made just before the clock was stepped forward")
		} else if !kept && try < 3 {
			t.Logf("the ADD and the GC took %s, past the %s grace: trying again", took, grace)
			continue
		} else if !kept {
			t.Fatalf("the ADD and the GC took %s, past the %s grace, %d times in a row", took, grace, try+1)
		}
		break
	}

	// The lease is renewed on etcd's clock: after two TTLs the keys are still there, and etcd
	// reports a remaining TTL within the granted one.
	time.Sleep(2 * ttl)
	keys := etcdtest.Dump(t, cli, ipKey)
	if len(keys) != 1 {
		t.Fatal("the pod's address expired after the wall clock was stepped forward")
	}
	ttlResp, err := cli.TimeToLive(ctx, clientv3.LeaseID(keys[ipKey]))
	if err != nil || ttlResp.GrantedTTL != int64(ttl.Seconds()) || ttlResp.TTL <= 0 || ttlResp.TTL > ttlResp.GrantedTTL {
		t.Fatalf("pod lease after the step: %+v, %v", ttlResp, err)
	}

	// Step back: the quarantine lasts its own length, not two days more and not zero.
	offset.Store(int64(-48 * time.Hour))
	released := time.Now()
	if err := a.Del(ctx, addReq(pool, ctr, "eth0", uid)); err != nil {
		t.Fatal(err)
	}
	qKey := keyspace.QuarantineKey(pool.Name, allocator.DefaultBlocks, first.IPs[0].Address.Addr())
	q := etcdtest.Dump(t, cli, qKey)
	if len(q) != 1 {
		t.Fatal("released address not quarantined")
	}
	qTTL, err := cli.TimeToLive(ctx, clientv3.LeaseID(q[qKey]))
	if err != nil || qTTL.GrantedTTL > int64((quarantine+time.Second).Seconds()) {
		t.Fatalf("quarantine lease after the step back: %+v, %v (want at most %s)", qTTL, err, quarantine+time.Second)
	}
	etcdtest.Eventually(t, "the quarantine after the step back ends", etcdtest.Keys(t, cli, qKey, 0))
	if waited := time.Since(released); waited < quarantine {
		t.Fatalf("quarantine after the step back ended after %s, want %s plus etcd's expiry slack", waited, quarantine)
	}

	// An attachment made while the clock was two days ahead, then the clock stepped back:
	// it is not protected from GC for two days, only for the grace.
	offset.Store(int64(48 * time.Hour))
	second, err := a.Add(ctx, addReq(pool, "c2", "eth0", "uid-2"))
	if err != nil {
		t.Fatal(err)
	}
	// The step was visible to the agent: the record says what the wall clock said.
	owners, err := cli.Get(ctx, keyspace.OwnersPrefix(cluster), clientv3.WithPrefix())
	if err != nil || len(owners.Kvs) != 1 {
		t.Fatalf("owner records: %v, %d", err, len(owners.Kvs))
	}
	var orec keyspace.OwnerRecord
	if err := json.Unmarshal(owners.Kvs[0].Value, &orec); err != nil {
		t.Fatal(err)
	}
	if ahead := time.Until(orec.Created); ahead < 47*time.Hour {
		t.Fatalf("owner record created %s ahead of now; the stepped clock did not reach the agent", ahead)
	}
	offset.Store(0)
	time.Sleep(grace + 100*time.Millisecond)
	if err := a.GC(ctx, gc); err != nil {
		t.Fatal(err)
	}
	if keys := etcdtest.Dump(t, cli, keyspace.IPKey(pool.Name, allocator.DefaultBlocks, second.IPs[0].Address.Addr())); len(keys) != 0 {
		t.Error("GC kept an attachment past the grace because its record was written while the clock was ahead")
	}
	if err := a.Ready(ctx); err != nil {
		t.Errorf("Ready after the steps: %v", err)
	}
}
