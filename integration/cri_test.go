package integration

// kubelet reaches a CNI plugin through a CRI runtime (issue 18). TestCRI runs that path:
// containerd 1.6's CRI plugin, driven with k8s.io/cri-api's v1 RuntimeService over its
// socket, creates pod sandboxes whose network is the reference bridge plugin with leasehold
// as IPAM, against a real leaseholdd and etcd. What etcd holds is read with
// admin.ListAllocations and admin.GetClaim, as leaseholdctl does. The ipam is sticky (issue
// 19): every sandbox's attachment names the claim <namespace>.<name> of its CRI metadata, so
// the sandboxes of one test have distinct names wherever they expect distinct addresses.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/internal/etcdtest"
)

// criIPAMTimeout is the conflist's ipam timeout: short, so that the ADD of a sandbox whose
// claim another live sandbox holds fails within seconds (it waits until shortly before the
// timeout), and still ample for an ADD's conversation with a local agent on a busy machine.
const criIPAMTimeout = 10 * time.Second

// criConflist is a cniVersion 1.0.0 network configuration list (containerd 1.6 refuses
// 1.1.0 results): the bridge plugin, no gateway address on the host bridge and no
// masquerading, delegating to leasehold for pool's addresses in subnet, each attachment
// under the sticky claim of its pod's namespace and name.
func criConflist(network, pool, bridge, socket string, subnet netip.Prefix) []byte {
	b, err := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": network, "plugins": []any{
		map[string]any{"type": "bridge", "bridge": bridge, "isGateway": false, "ipMasq": false,
			"ipam": map[string]any{"type": "leasehold", "socket": socket, "pool": pool,
				"ranges": []any{[]any{map[string]any{"subnet": subnet.String()}}},
				"sticky": true, "timeout": criIPAMTimeout.String()}},
	}})
	if err != nil {
		panic(err)
	}
	return b
}

// criSuite is what TestCRI's subtests share: the fixture, containerd and the sandboxes
// alive now, by CRI id.
type criSuite struct {
	f      *fixture
	c      *criRuntime
	subnet netip.Prefix
	live   map[string]criPod
}

func TestCRI(t *testing.T) {
	bins := requireCRI(t)
	f := newFixture(t)
	// The network name names containerd's CNI result cache entries (in the system's cache
	// directory): it carries this process's tag. The pool is the fixture's.
	network := "cri-" + ccTag + "-" + f.Pool
	bridge := ccUniq("lhcri")
	subnet := netip.MustParsePrefix("10.62.0.0/24")
	c := startCRI(t, bins, filepath.Join(binDir(t), "cni"), network, bridge,
		criConflist(network, f.Pool, bridge, f.Agent.Socket, subnet))
	s := &criSuite{f: f, c: c, subnet: subnet, live: map[string]criPod{}}

	// A pod sandbox gets an address, reported by PodSandboxStatus, and etcd's allocation of
	// that address is owned by the pod UID the CRI request named.
	t.Run("SandboxAddressOwnedByPodUID", func(t *testing.T) {
		p, err := c.runPod(f.Ctx, "solo", criUID("solo"))
		if err != nil {
			t.Fatal(err)
		}
		s.live[p.ID] = p
		if !subnet.Contains(p.IP) {
			t.Errorf("sandbox address %s is outside the pool's %s", p.IP, subnet)
		}
		held := s.allocations(t)
		a, ok := held[p.IP]
		if !ok {
			t.Fatalf("etcd holds no allocation of %s, the sandbox's address; it holds %s", p.IP, criDescribe(held))
		}
		if a.Owner != p.UID {
			t.Errorf("%s is owned by %q, want the pod UID %q", p.IP, a.Owner, p.UID)
		}
		if a.Pod.UID != p.UID || a.Pod.Name != p.Name || a.Pod.Namespace != criNamespace {
			t.Errorf("%s names pod %+v, want uid %s name %s namespace %s", p.IP, a.Pod, p.UID, p.Name, criNamespace)
		}
		if a.ContainerID != p.ID || a.IfName != "eth0" {
			t.Errorf("%s is held for container %q interface %q, want the sandbox %q and eth0", p.IP, a.ContainerID, a.IfName, p.ID)
		}
		if a.Node != f.Agent.Node {
			t.Errorf("%s is held by node %q, want the agent's %q", p.IP, a.Node, f.Agent.Node)
		}
		s.checkLive(t)
	})

	// StopPodSandbox tears the network down (CNI DEL): the allocation disappears; after
	// RemovePodSandbox the sandbox is gone and nothing of it is left in etcd.
	t.Run("StopAndRemoveReleaseTheAddress", func(t *testing.T) {
		p, err := c.runPod(f.Ctx, "doomed", criUID("doomed"))
		if err != nil {
			t.Fatal(err)
		}
		s.live[p.ID] = p
		if a, ok := s.allocations(t)[p.IP]; !ok || a.Owner != p.UID {
			t.Fatalf("before the stop, %s is held by %q (held: %v), want %q", p.IP, a.Owner, ok, p.UID)
		}
		s.release(t, p)
		if ids, err := c.sandboxes(f.Ctx); err != nil {
			t.Fatal(err)
		} else if _, ok := ids[p.ID]; ok {
			t.Errorf("sandbox %s is still listed after RemovePodSandbox", p.ID)
		}
		if owned := criOwnedBy(s.allocations(t), p.UID); len(owned) > 0 {
			t.Errorf("after RemovePodSandbox, %s still holds %v", p.UID, owned)
		}
		s.checkLive(t)
	})

	// 20 RunPodSandbox calls at once: 20 distinct addresses, each owned by its pod's UID.
	t.Run("TwentySandboxesAtOnce", func(t *testing.T) {
		const n = 20
		pods := c.runPods(t, f.Ctx, "burst", n)
		seen := map[netip.Addr]string{}
		for _, p := range pods {
			s.live[p.ID] = p
			if other, dup := seen[p.IP]; dup {
				t.Errorf("%s handed to the sandboxes of %s and %s", p.IP, other, p.Name)
			}
			seen[p.IP] = p.Name
		}
		if len(seen) != n {
			t.Errorf("%d sandboxes got %d distinct addresses", n, len(seen))
		}
		held := s.allocations(t)
		for _, p := range pods {
			if a, ok := held[p.IP]; !ok || a.Owner != p.UID || a.ContainerID != p.ID {
				t.Errorf("%s (sandbox %s): held %v by owner %q for container %q, want owner %q container %q",
					p.IP, p.Name, ok, a.Owner, a.ContainerID, p.UID, p.ID)
			}
		}
		s.checkLive(t)
	})

	// containerd killed and started again on the same root and state, with its pods alive:
	// the sandboxes are still ready with their addresses, etcd's allocations are exactly
	// what they were (not even rewritten), and the restarted containerd still releases.
	t.Run("ContainerdRestartChangesNothing", func(t *testing.T) {
		for _, p := range c.runPods(t, f.Ctx, "crs", 2) {
			s.live[p.ID] = p
		}
		if !s.checkLive(t) {
			t.Fatal("the allocations do not match the live sandboxes before the restart")
		}
		before := s.allocations(t)
		c.kill()
		c.start(t)
		states, err := c.sandboxes(f.Ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(states) != len(s.live) {
			t.Errorf("the restarted containerd lists %d sandboxes, want the %d alive", len(states), len(s.live))
		}
		for _, p := range criSorted(s.live) {
			if st, ok := states[p.ID]; !ok || st != criapi.PodSandboxState_SANDBOX_READY {
				t.Errorf("after the restart, sandbox %s is listed %v in state %v, want ready", p.Name, ok, st)
				continue
			}
			if ip, err := c.podIP(f.Ctx, p.ID); err != nil || ip != p.IP {
				t.Errorf("after the restart, sandbox %s reports %s (%v), want %s", p.Name, ip, err, p.IP)
			}
		}
		if d := criDiff(before, s.allocations(t), true); len(d) > 0 {
			t.Errorf("a containerd restart changed the allocations:\n%s", strings.Join(d, "\n"))
		}
		s.release(t, s.live[criLast(s.live, "crs-")])
		s.checkLive(t)
	})

	// leaseholdd killed with SIGKILL and started again with the same flags and state
	// directory: every pod keeps its address, on the same lease, which the new process keeps
	// alive; it releases a pod it adopted and allocates around the ones it kept.
	t.Run("AgentKilledAndRestartedKeepsEveryAddress", func(t *testing.T) {
		for _, p := range c.runPods(t, f.Ctx, "ags", 2) {
			s.live[p.ID] = p
		}
		if !s.checkLive(t) {
			t.Fatal("the allocations do not match the live sandboxes before the kill")
		}
		before := s.allocations(t)
		f.Agent.kill()
		f.Agent.restart(t)
		after := s.allocations(t)
		if d := criDiff(before, after, false); len(d) > 0 {
			t.Errorf("the agent's restart changed the allocations:\n%s", strings.Join(d, "\n"))
		}
		s.checkRenewed(t, after)

		p, err := c.runPod(f.Ctx, "after-agent", criUID("after-agent"))
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range s.live {
			if q.IP == p.IP {
				t.Errorf("the restarted agent handed out %s, which the live sandbox %s holds", p.IP, q.Name)
			}
		}
		s.live[p.ID] = p
		s.release(t, s.live[criLast(s.live, "ags-")])
		s.checkLive(t)
	})

	// A StatefulSet's pod re-created (issue 19): sandbox web-2 is stopped and removed, and a
	// sandbox of the same name with a new UID gets its address again, owned in etcd by the
	// new UID. While sandbox web-3 runs, a second web-3 with another UID gets no address:
	// RunPodSandbox fails, naming the holder, and leaves nothing behind.
	t.Run("SameNameSandboxKeepsItsAddress", func(t *testing.T) {
		first, err := c.runPod(f.Ctx, "web-2", criUID("web-2"))
		if err != nil {
			t.Fatal(err)
		}
		s.live[first.ID] = first
		if cl := s.claim(t, "web-2"); cl.Value.Holder == nil || cl.Value.Holder.Owner != first.UID || !slices.Contains(cl.Value.IPs, first.IP) {
			t.Fatalf("claim web-2 after the first sandbox's ADD: %+v, want %s held by %s", cl.Value, first.IP, first.UID)
		}
		s.release(t, first)
		if cl := s.claim(t, "web-2"); cl.Value.Holder != nil || cl.Value.Released.IsZero() || !slices.Contains(cl.Value.IPs, first.IP) {
			t.Fatalf("claim web-2 after RemovePodSandbox: %+v, want %s released and kept", cl.Value, first.IP)
		}
		// Another pod does not get the resting address.
		other, err := c.runPod(f.Ctx, "web-other", criUID("web-other"))
		if err != nil {
			t.Fatal(err)
		}
		s.live[other.ID] = other
		if other.IP == first.IP {
			t.Errorf("sandbox web-other got %s, which rests under claim web-2", other.IP)
		}

		second, err := c.runPod(f.Ctx, "web-2", criUID("web-2"))
		if err != nil {
			t.Fatal(err)
		}
		s.live[second.ID] = second
		if second.UID == first.UID || second.ID == first.ID {
			t.Fatalf("the re-created sandbox has uid %s id %s, the first had %s %s", second.UID, second.ID, first.UID, first.ID)
		}
		if second.IP != first.IP {
			t.Errorf("the re-created sandbox web-2 got %s, the removed one had %s", second.IP, first.IP)
		}
		if a, ok := s.allocations(t)[first.IP]; !ok || a.Owner != second.UID || a.ContainerID != second.ID || a.Pod.Name != "web-2" {
			t.Errorf("%s after the re-creation: held %v by %q for container %q (pod %+v), want %q for %q",
				first.IP, ok, a.Owner, a.ContainerID, a.Pod, second.UID, second.ID)
		}
		if cl := s.claim(t, "web-2"); cl.Value.Holder == nil || cl.Value.Holder.Owner != second.UID || cl.Value.Holder.ContainerID != second.ID {
			t.Errorf("claim web-2 after the re-creation: %+v, want held by %s for %s", cl.Value, second.UID, second.ID)
		}
		s.checkLive(t)

		holder, err := c.runPod(f.Ctx, "web-3", criUID("web-3"))
		if err != nil {
			t.Fatal(err)
		}
		s.live[holder.ID] = holder
		dupUID := criUID("web-3")
		start := time.Now()
		dup, err := c.runPod(f.Ctx, "web-3", dupUID)
		took := time.Since(start).Round(time.Millisecond)
		switch {
		case err == nil:
			t.Fatalf("a second sandbox web-3 (uid %s) got %s while the first (uid %s) holds %s", dupUID, dup.IP, holder.UID, holder.IP)
		case !strings.Contains(err.Error(), holder.UID):
			// Only leasehold's refusal names the holder: an ADD that waited past the ipam
			// timeout, or hung until the test's context, would not.
			t.Errorf("RunPodSandbox of a second web-3 after %s: %v, want an error naming the holder %s", took, err, holder.UID)
		default:
			t.Logf("RunPodSandbox of a second web-3 failed after %s: %v", took, err)
		}
		if ids, err := c.sandboxes(f.Ctx); err != nil {
			t.Fatal(err)
		} else if len(ids) != len(s.live) {
			t.Errorf("containerd lists %d sandboxes after the failed RunPodSandbox, want the %d alive", len(ids), len(s.live))
		}
		if owned := criOwnedBy(s.allocations(t), dupUID); len(owned) > 0 {
			t.Errorf("the refused sandbox's uid %s holds %v", dupUID, owned)
		}
		if cl := s.claim(t, "web-3"); cl.Value.Holder == nil || cl.Value.Holder.Owner != holder.UID {
			t.Errorf("claim web-3 after the refused sandbox: %+v, want still held by %s", cl.Value, holder.UID)
		}
		s.checkLive(t)
		for _, p := range []criPod{holder, second, other} {
			s.release(t, p)
		}
		s.checkLive(t)
	})
}

// claim reads the sticky claim of the sandboxes named name.
func (s *criSuite) claim(t testing.TB, name string) admin.ClaimEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(s.f.Ctx, etcdtest.Patience)
	defer cancel()
	cl, err := admin.GetClaim(ctx, s.f.Cli, s.f.Cluster, s.f.Pool, criNamespace+"."+name)
	if err != nil {
		t.Fatalf("GetClaim %s: %v", name, err)
	}
	if cl.Unreadable != "" {
		t.Fatalf("claim %s is unreadable: %s", name, cl.Unreadable)
	}
	return cl
}

// allocations returns the pool's allocations by address.
func (s *criSuite) allocations(t testing.TB) map[netip.Addr]admin.AllocationEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(s.f.Ctx, etcdtest.Patience)
	defer cancel()
	list, err := admin.ListAllocations(ctx, s.f.Cli, s.f.Pool)
	if err != nil {
		t.Fatalf("ListAllocations %s: %v", s.f.Pool, err)
	}
	out := map[netip.Addr]admin.AllocationEntry{}
	for _, a := range list {
		if a.Unreadable != "" {
			t.Errorf("allocation %s is unreadable: %s", a.Key, a.Unreadable)
		}
		if prev, dup := out[a.IP]; dup {
			t.Errorf("%s listed twice: %q and %q", a.IP, prev.Owner, a.Owner)
		}
		out[a.IP] = a
	}
	return out
}

// checkLive asserts that the pool's allocations are exactly the live sandboxes' addresses,
// each owned by its pod's UID for its sandbox, and reports whether they are.
func (s *criSuite) checkLive(t testing.TB) bool {
	t.Helper()
	held := s.allocations(t)
	ok := true
	for _, p := range criSorted(s.live) {
		a, found := held[p.IP]
		if !found || a.Owner != p.UID || a.ContainerID != p.ID {
			t.Errorf("live sandbox %s at %s: held %v by %q for container %q, want %q for %q",
				p.Name, p.IP, found, a.Owner, a.ContainerID, p.UID, p.ID)
			ok = false
		}
		delete(held, p.IP)
	}
	if len(held) > 0 {
		t.Errorf("allocations no live sandbox accounts for: %s", criDescribe(held))
		ok = false
	}
	return ok
}

// release stops and removes p through the CRI and asserts that its address is released
// (StopPodSandbox runs the CNI DEL) and stays released.
func (s *criSuite) release(t testing.TB, p criPod) {
	t.Helper()
	if p.ID == "" {
		t.Fatal("no sandbox to release")
	}
	if err := s.c.stopPod(s.f.Ctx, p.ID); err != nil {
		t.Fatalf("StopPodSandbox %s: %v", p.Name, err)
	}
	eventually(t, fmt.Sprintf("the stopped sandbox %s's address %s is released", p.Name, p.IP), func() error {
		held := s.allocations(t)
		a, still := held[p.IP]
		owned := criOwnedBy(held, p.UID)
		return saw(!still && len(owned) == 0, "%s held by %q, the pod's uid holds %v", p.IP, a.Owner, owned)
	})
	if err := s.c.removePod(s.f.Ctx, p.ID); err != nil {
		t.Fatalf("RemovePodSandbox %s: %v", p.Name, err)
	}
	delete(s.live, p.ID)
}

// checkRenewed asserts that every lease the allocations are bound to is alive and is
// renewed by the agent now running: each one's remaining TTL is seen to go up.
func (s *criSuite) checkRenewed(t testing.TB, held map[netip.Addr]admin.AllocationEntry) {
	t.Helper()
	low := map[clientv3.LeaseID]int64{}
	for _, a := range held {
		if a.BoundLease == 0 {
			t.Errorf("%s (owner %s) is bound to no lease", a.IP, a.Owner)
			continue
		}
		low[a.BoundLease] = 1 << 62
	}
	renewed := map[clientv3.LeaseID]bool{}
	var last time.Time
	eventually(t, "the restarted agent renews every pod lease", func() error {
		if time.Since(last) < 200*time.Millisecond {
			return errors.New("not yet looked again")
		}
		last = time.Now()
		for id, lo := range low {
			if renewed[id] {
				continue
			}
			ctx, cancel := context.WithTimeout(s.f.Ctx, etcdtest.Patience)
			ttl, err := admin.TimeToLive(ctx, s.f.Cli, id)
			cancel()
			if err != nil {
				t.Fatalf("TimeToLive %x: %v", id, err)
			}
			if ttl.TTL <= 0 {
				t.Fatalf("lease %x expired after the agent's restart", id)
			}
			if ttl.TTL > lo {
				renewed[id] = true
			} else {
				low[id] = ttl.TTL
			}
		}
		return saw(len(renewed) == len(low), "%d of %d leases seen renewed", len(renewed), len(low))
	})
}

// criDiff lists the differences between two readings of the allocations: owner, pod,
// sandbox, interface and lease, and with revisions the key's modification revision too.
func criDiff(before, after map[netip.Addr]admin.AllocationEntry, revisions bool) []string {
	var out []string
	for ip, b := range before {
		a, ok := after[ip]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("%s (owner %s) was released", ip, b.Owner))
		case a.Owner != b.Owner || a.Pod != b.Pod || a.ContainerID != b.ContainerID || a.IfName != b.IfName:
			out = append(out, fmt.Sprintf("%s was %s/%s/%s/%+v, is %s/%s/%s/%+v", ip,
				b.Owner, b.ContainerID, b.IfName, b.Pod, a.Owner, a.ContainerID, a.IfName, a.Pod))
		case a.BoundLease != b.BoundLease:
			out = append(out, fmt.Sprintf("%s (owner %s) moved from lease %x to %x", ip, a.Owner, b.BoundLease, a.BoundLease))
		case revisions && a.ModRevision != b.ModRevision:
			out = append(out, fmt.Sprintf("%s (owner %s) was rewritten (revision %d, was %d)", ip, a.Owner, a.ModRevision, b.ModRevision))
		}
	}
	for ip, a := range after {
		if _, ok := before[ip]; !ok {
			out = append(out, fmt.Sprintf("%s appeared (owner %s)", ip, a.Owner))
		}
	}
	slices.Sort(out)
	return out
}

// criOwnedBy returns the addresses held by owner.
func criOwnedBy(held map[netip.Addr]admin.AllocationEntry, owner string) []netip.Addr {
	var out []netip.Addr
	for ip, a := range held {
		if a.Owner == owner {
			out = append(out, ip)
		}
	}
	return out
}

// criDescribe lists allocations as address=owner, sorted.
func criDescribe(held map[netip.Addr]admin.AllocationEntry) string {
	var out []string
	for ip, a := range held {
		out = append(out, ip.String()+"="+a.Owner)
	}
	slices.Sort(out)
	return "[" + strings.Join(out, " ") + "]"
}

// criSorted returns the pods by name.
func criSorted(pods map[string]criPod) []criPod {
	out := make([]criPod, 0, len(pods))
	for _, p := range pods {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b criPod) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// criLast returns the id of the live pod whose name comes last among those with prefix.
func criLast(pods map[string]criPod, prefix string) string {
	id := ""
	for _, p := range criSorted(pods) {
		if strings.HasPrefix(p.Name, prefix) {
			id = p.ID
		}
	}
	return id
}
