package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// Issue 32, by hand: admins inspect and repair state with etcdctl, and a running pod's key
// deleted or overwritten with it must come back to the pod (or be recorded as a conflict),
// with no ADD meanwhile given the pod's address, and doctor must say the truth about it.

// handEditBound is how long the tests wait for an agent to put back a key edited by hand:
// the issue asks for one TTL; the machine is loaded, so the bound is far above it, and each
// test logs the time it actually took.
const handEditBound = 30 * time.Second

// value32 is the value of key, and its lease; it fails the test when the key is missing.
func value32(t testing.TB, cli *clientv3.Client, key string) ([]byte, int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatalf("get %s: %v (found %d)", key, err, len(resp.Kvs))
	}
	return resp.Kvs[0].Value, resp.Kvs[0].Lease
}

// leaseOf32 is the lease key is on, 0 when there is no such key (or none can be read).
func leaseOf32(t testing.TB, cli *clientv3.Client, key string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		return 0
	}
	return resp.Kvs[0].Lease
}

// conflictNames reports whether etcd holds a conflict record of p's attachment naming its
// address.
func conflictNames(t testing.TB, cli *clientv3.Client, pool string, p pod32) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, keyspace.ConflictKey(p.agent.Cluster, p.uid, "eth0", pool))
	if err != nil || len(resp.Kvs) == 0 {
		return false
	}
	var c keyspace.ConflictRecord
	return json.Unmarshal(resp.Kvs[0].Value, &c) == nil &&
		slices.ContainsFunc(c.Taken, func(x keyspace.TakenByOther) bool { return x.IP == p.ip })
}

// TestKeyOfARunningPodDeletedByHand: an agent with short leases, pods whose sandboxes exist,
// and no ADD traffic. For each kind of key of a running pod, `etcdctl del` of it: the agent puts
// it back, for the pod, on a live lease with the pod's other keys. `etcdctl put` over the
// allocation, with the same value but no lease: back on the pod's lease. With a value naming
// another owner: the pod gets its address back or a conflict is recorded, and its other keys
// stay. In a full pool, an allocation deleted by hand: no ADD, on its node or on a second
// node that borrows, is given the address.
func TestKeyOfARunningPodDeletedByHand(t *testing.T) {
	f := newFixture(t, withAgents(2), withShortLeases(), withNetns())
	h := newHistory32(f)
	blocks := allocator.DefaultBlocks
	conf := v4conf(f.Pool, f.Agent.Socket, "10.87.0.0/24")
	newPod := func(t *testing.T, name string) pod32 {
		t.Helper()
		hd, err := h.add(f.Agent, conf, fmt.Sprintf("%s-%s", f.Pool, name))
		if err != nil {
			t.Fatalf("ADD %s: %v", name, err)
		}
		return hd.pod
	}
	// waitKeys polls until p holds its keys again and returns the lease they are on.
	waitKeys := func(t *testing.T, p pod32, what string) (int64, bool) {
		t.Helper()
		start := time.Now()
		problem, lease := "", int64(0)
		for {
			if problem, lease = podKeysProblem(t, f.Cli, f.Pool, blocks, p); problem == "" {
				t.Logf("%s: the pod held its keys again %s later (the issue asks for one TTL, %s), on lease %x",
					what, time.Since(start).Round(time.Millisecond), ttl, lease)
				return lease, true
			}
			if time.Since(start) > handEditBound {
				t.Errorf("%s: %s later, %s", what, handEditBound, problem)
				return 0, false
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	for _, kind := range []string{"allocation", "owner index", "pod record"} {
		t.Run("etcdctl del of the "+strings.ReplaceAll(kind, " ", "-"), func(t *testing.T) {
			p := newPod(t, strings.ReplaceAll(kind, " ", "-"))
			ipKey, ownerKey, podKey := keys32(f.Pool, blocks, p)
			key := map[string]string{"allocation": ipKey, "owner index": ownerKey, "pod record": podKey}[kind]
			if out := etcdctl(t, f.Endpoint, "del", key); strings.TrimSpace(out) != "1" {
				t.Fatalf("etcdctl del %s: %q", key, out)
			}
			waitKeys(t, p, "etcdctl del of the "+kind+" "+key)
		})
	}

	t.Run("etcdctl put of the allocation without its lease", func(t *testing.T) {
		p := newPod(t, "no-lease")
		ipKey, _, _ := keys32(f.Pool, blocks, p)
		value, _ := value32(t, f.Cli, ipKey)
		etcdctl(t, f.Endpoint, "put", ipKey, string(value))
		waitKeys(t, p, "etcdctl put of "+ipKey+" with its value and no lease")
	})

	t.Run("etcdctl put of the allocation naming another owner", func(t *testing.T) {
		p := newPod(t, "overwritten")
		ipKey, _, _ := keys32(f.Pool, blocks, p)
		value, _ := value32(t, f.Cli, ipKey)
		var a keyspace.Allocation
		if err := json.Unmarshal(value, &a); err != nil {
			t.Fatal(err)
		}
		a.Owner, a.ContainerID = "uid-intruder", "intruder"
		etcdctl(t, f.Endpoint, "put", ipKey, keyspace.Encode(a))
		_, ownerKey, podKey := keys32(f.Pool, blocks, p)
		start := time.Now()
		for {
			problem, lease := podKeysProblem(t, f.Cli, f.Pool, blocks, p)
			if problem == "" {
				t.Logf("the pod held its address again %s after the overwrite, on lease %x", time.Since(start).Round(time.Millisecond), lease)
				break
			}
			// The re-claim writes the conflict record with the owner index, and the pod record only
			// once it has read that answer: a conflict counts once the pod record is back too.
			if conflictNames(t, f.Cli, f.Pool, p) {
				ol, pl := leaseOf32(t, f.Cli, ownerKey), leaseOf32(t, f.Cli, podKey)
				if ol != 0 && ol == pl {
					t.Logf("a conflict on %s was recorded %s after the overwrite", p.ip, time.Since(start).Round(time.Millisecond))
					break
				}
				problem = fmt.Sprintf("a conflict is recorded, and the owner index is on lease %x, the pod record on %x", ol, pl)
			}
			if time.Since(start) > handEditBound {
				t.Fatalf("%s after %s was overwritten naming another owner, neither does the pod hold it nor is a conflict recorded "+
					"with its other keys on its lease: %s", handEditBound, ipKey, problem)
			}
			time.Sleep(50 * time.Millisecond)
		}
		// The pod's own keys stay on its lease either way.
		_, ol := value32(t, f.Cli, ownerKey)
		_, pl := value32(t, f.Cli, podKey)
		if ol == 0 || ol != pl {
			t.Errorf("after the overwrite, the owner index is on lease %x and the pod record on %x", ol, pl)
		}
	})

	t.Run("etcdctl del of the allocation in a full pool", func(t *testing.T) {
		// A /29 hands out .2-.6: five pods of the first node fill it. The second node borrows
		// in the first node's block once its own has nothing free.
		pool := f.Pool + "-full"
		full := []*agentProc{f.Agents[0], f.Agents[1]}
		confs := [][]byte{v4conf(pool, full[0].Socket, "10.88.0.0/29"), v4conf(pool, full[1].Socket, "10.88.0.0/29")}
		var pods []pod32
		for i := range 5 {
			hd, err := h.add(full[0], confs[0], fmt.Sprintf("%s-%d", pool, i))
			if err != nil {
				t.Fatalf("filling %s: %v", pool, err)
			}
			pods = append(pods, hd.pod)
		}
		for i := range full {
			if _, err := f.pl.add(f.Ctx, confs[i], pool+"-over", "eth0", "K8S_POD_UID=uid-"+pool+"-over"); cniCode(err) != 102 {
				t.Fatalf("ADD on %s in the full pool: want code 102, got %v", full[i].Node, err)
			}
		}
		victim := pods[2]
		ipKey := keyspace.IPKey(pool, blocks, victim.ip)
		etcdctl(t, f.Endpoint, "del", ipKey)
		// ADDs on both nodes while the key is missing (at least four, at most ten): none may
		// be given the running pod's address.
		for i := 0; i < 10; i++ {
			if i >= 4 && exists(t, f.Cli, ipKey) {
				break
			}
			a := full[(i+1)%2]
			hd, err := h.add(a, confs[(i+1)%2], fmt.Sprintf("%s-new-%d", pool, i))
			switch {
			case err != nil:
				t.Logf("ADD %d on %s after the key was deleted: %v", i, a.Node, err)
				if c := cniCode(err); c != 102 && c != 11 {
					t.Errorf("ADD %d on %s in the full pool after the key was deleted: %v", i, a.Node, err)
				}
			case hd.pod.ip == victim.ip:
				t.Errorf("ADD %d on %s was given %s, the address of running pod %s, whose allocation key had been deleted by hand",
					i, a.Node, victim.ip, victim.uid)
			default:
				t.Errorf("ADD %d on %s was given %s in the pool the test had filled", i, a.Node, hd.pod.ip)
			}
		}
		start := time.Now()
		for {
			problem, _ := podKeysProblem(t, f.Cli, pool, blocks, victim)
			if problem == "" {
				t.Logf("the running pod held its address again %s after the loop of ADDs", time.Since(start).Round(time.Millisecond))
				break
			}
			if time.Since(start) > handEditBound {
				t.Errorf("%s after the loop of ADDs: %s", handEditBound, problem)
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	})
	if o := h.overlaps(); len(o) > 0 {
		t.Errorf("%d addresses were given to a second pod while the first ran:\n%s", len(o), strings.Join(o, "\n"))
	}
}

// doctorReport is leaseholdctl doctor -o json's output.
type doctorReport struct {
	Clean    bool `json:"clean"`
	Findings []struct {
		Kind     string   `json:"kind"`
		Severity string   `json:"severity"`
		Keys     []string `json:"keys"`
		Message  string   `json:"message"`
		Fix      string   `json:"fix"`
	} `json:"findings"`
}

// TestDoctorReportsARunningPodsMissingKey: the agent is frozen (SIGSTOP), so it cannot put
// anything back, and its leases are long enough to outlive the test. With keys of a running
// pod deleted by hand, doctor exits non-zero with an error naming the pod's keys, and no
// finding about them says there is nothing to do. Each case removes keys of its own pod and
// puts them back (same value, same lease) before the next.
func TestDoctorReportsARunningPodsMissingKey(t *testing.T) {
	f := newFixture(t, withAgentFlags("--lease-ttl", "2m"), withNetns())
	h := newHistory32(f)
	blocks := allocator.DefaultBlocks
	conf := v4conf(f.Pool, f.Agent.Socket, "10.89.0.0/24")
	cases := []struct {
		name string
		del  []string // of allocation, owner index, pod record
	}{
		{"the allocation", []string{"allocation"}},
		{"the owner index", []string{"owner index"}},
		{"the pod record", []string{"pod record"}},
		{"the allocation and owner index (a pod record without its attachment)", []string{"allocation", "owner index"}},
		// Not a row: all three deleted. Only the held key is left, as when the pod's lease ran
		// out on a node that is back: from etcd alone doctor cannot tell a running pod from
		// one that is gone, and says what the node's agent does with either (address-expired).
		// The agent, which knows its pods, puts the keys back (TestKeyOfARunningPodDeletedByHand).
	}
	pods := make([]pod32, len(cases))
	for i := range cases {
		hd, err := h.add(f.Agent, conf, fmt.Sprintf("%s-%d", f.Pool, i))
		if err != nil {
			t.Fatal(err)
		}
		pods[i] = hd.pod
	}
	f.Agent.freeze(t)
	defer f.Agent.thaw(t)
	if code, out := doctor(t, f.Endpoint); code != 0 {
		t.Fatalf("doctor before anything was deleted exits %d:\n%s", code, out)
	}
	for i, c := range cases {
		t.Run("etcdctl del of "+c.name, func(t *testing.T) {
			p := pods[i]
			ipKey, ownerKey, podKey := keys32(f.Pool, blocks, p)
			keys := map[string]string{"allocation": ipKey, "owner index": ownerKey, "pod record": podKey}
			type saved struct {
				key   string
				value []byte
				lease int64
			}
			var put []saved
			for _, k := range c.del {
				v, l := value32(t, f.Cli, keys[k])
				put = append(put, saved{keys[k], v, l})
				etcdctl(t, f.Endpoint, "del", keys[k])
			}
			defer func() {
				for _, s := range put {
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					_, err := f.Cli.Put(ctx, s.key, string(s.value), clientv3.WithLease(clientv3.LeaseID(s.lease)))
					cancel()
					if err != nil {
						t.Fatalf("putting %s back: %v", s.key, err)
					}
				}
			}()
			code, out := doctor(t, f.Endpoint, "-o", "json")
			var rep doctorReport
			if err := json.Unmarshal([]byte(out), &rep); err != nil {
				t.Fatalf("doctor -o json: %v\n%s", err, out)
			}
			mine := []string{ipKey, ownerKey, podKey, keyspace.HeldKey(f.Pool, blocks, p.ip)}
			erred := false
			for _, fd := range rep.Findings {
				if !slices.ContainsFunc(fd.Keys, func(k string) bool { return slices.Contains(mine, k) }) {
					continue
				}
				t.Logf("doctor: %s %s %v: %s", fd.Severity, fd.Kind, fd.Keys, fd.Message)
				erred = erred || fd.Severity == "error"
				if strings.Contains(fd.Message, "Nothing to do") {
					t.Errorf("doctor says %q about running pod %s, whose %v were deleted by hand: %s", "Nothing to do", p, c.del, fd.Message)
				}
			}
			if code == 0 {
				t.Errorf("doctor exits 0 with the %v of running pod %s deleted:\n%s", c.del, p, out)
			}
			if !erred {
				t.Errorf("doctor reports no error naming the keys of running pod %s, whose %v were deleted", p, c.del)
			}
		})
	}
}
