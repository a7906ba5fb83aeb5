package integration

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
	"github.com/leasehold/leasehold/internal/etcdtest"
)

// TestHostileAgentClients attacks the agent socket directly: a request over the size
// limit, a crowd of clients that connect and send nothing (or half a request), pools
// of absurd shape. The agent refuses or answers at a bounded cost (its CPU time, which a
// busy machine does not inflate as it does the wall clock), and a normal ADD through the
// plugin still succeeds within its timeout.
func TestHostileAgentClients(t *testing.T) {
	f := newFixture(t)
	agent, pl, ctx := f.Agent, f.pl, f.Ctx
	pid := agent.cmd.Process.Pid
	client := &agentapi.Client{Socket: agent.Socket, Timeout: etcdtest.Patience}
	// run sends inv as the plugin does and reads the answer as the runtime does.
	run := func(inv *agentapi.Invocation) error {
		out, err := client.Invoke(ctx, inv)
		if err == nil {
			_, err = out.Result()
		}
		return err
	}
	// add sends an ADD of container with conf as the plugin does.
	add := func(conf []byte, container string) (allocator.Result, error) {
		out, err := client.Invoke(ctx, agentapi.NewInvocation("ADD", conf, container, "eth0"))
		if err != nil {
			return allocator.Result{}, err
		}
		return out.Result()
	}
	name := f.Pool
	conf := netconf(name, agent.Socket, dualStackIPAM("10.88.0.0/16", "fd88::/64"))
	var cfg map[string]any
	_ = json.Unmarshal(conf, &cfg)
	// The plugin's timeout: below the agent's 10 s read limit, so that an ADD served only once
	// the attackers' connections time out fails; far above what an ADD needs, the 1 s in
	// which the intake evicts an idle staller included, on a busy machine.
	cfg["ipam"].(map[string]any)["timeout"] = "9s"
	conf, _ = json.Marshal(cfg)
	normalAdd := func(t *testing.T, what string) {
		t.Helper()
		start := time.Now()
		c := uniq("ctr")
		if _, err := pl.add(ctx, conf, c, "eth0", "K8S_POD_UID="+uniq("uid-")); err != nil {
			t.Fatalf("%s: a normal ADD failed after %s: %v", what, time.Since(start).Round(time.Millisecond), err)
		}
	}
	// cheap runs op and fails the test when the agent spent more than a second of CPU on it:
	// each of these once cost seconds (quadratic or cubic work), a refusal costs milliseconds.
	cheap := func(t *testing.T, what string, op func()) {
		t.Helper()
		before := cpuTime(t, pid)
		op()
		if spent := cpuTime(t, pid) - before; spent > time.Second {
			t.Errorf("%s cost the agent %s of CPU", what, spent)
		}
	}

	// Over MaxMessageSize: refused with code 6 naming the limit, read no further, and the
	// agent serves on.
	t.Run("2 MiB request", func(t *testing.T) {
		big := []byte(`{"version":1,"op":"cni","timeoutMs":5000,"request":{"command":"ADD","stdin":"` + strings.Repeat("x", 2<<20) + `"}}`)
		resp, err := rawAgentCall(agent.Socket, big, etcdtest.Patience)
		if err != nil {
			t.Fatalf("no answer to a 2 MiB request: %v", err)
		}
		if resp.Error == nil || resp.Error.Code != agentapi.CodeDecodingFailure || !strings.Contains(resp.Error.Msg, "1048576") {
			t.Errorf("2 MiB request answered %+v; want code 6 naming the 1048576-byte limit", resp)
		}
		// The client refuses to send it at all.
		inv := agentapi.NewInvocation("ADD", conf, "c", "eth0")
		inv.Args = "K8S_POD_NAME=" + strings.Repeat("p", 2<<20)
		if _, err := client.Invoke(ctx, inv); agentapi.CodeOf(err) != agentapi.CodeDecodingFailure {
			t.Errorf("Client sent a 2 MiB request: %v", err)
		}
		normalAdd(t, "after a 2 MiB request")
	})

	// 100 connections that send nothing (50) or half a request (50) and stay open. A
	// normal ADD goes through meanwhile, and the agent closes every one of them (its 10 s
	// read limit), not the client.
	t.Run("100 silent connections", func(t *testing.T) {
		var conns []net.Conn
		for i := range 100 {
			c, err := net.Dial("unix", agent.Socket)
			if err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			conns = append(conns, c)
			if i%2 == 1 {
				if _, err := c.Write([]byte(`{"version":1,"op":"cni","request":{"stdin":"`)); err != nil {
					t.Fatalf("connection %d: %v", i, err)
				}
			}
		}
		opened := time.Now()
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		normalAdd(t, "with 100 silent connections open")
		if err := run(agentapi.NewInvocation("STATUS", conf, "", "")); err != nil {
			t.Errorf("STATUS with 100 silent connections open: %v", err)
		}
		var wg sync.WaitGroup
		closedAfter := make([]time.Duration, len(conns))
		for i, c := range conns {
			wg.Go(func() {
				_ = c.SetReadDeadline(opened.Add(etcdtest.Patience))
				_, err := io.Copy(io.Discard, c)
				closedAfter[i] = time.Since(opened)
				if errors.Is(err, os.ErrDeadlineExceeded) {
					t.Errorf("silent connection %d: the agent held it for %s, and its read limit is 10s", i, closedAfter[i].Round(time.Millisecond))
				}
			})
		}
		wg.Wait()
		t.Logf("the agent closed the silent connections %s to %s after they opened", slices.Min(closedAfter).Round(time.Millisecond), slices.Max(closedAfter).Round(time.Millisecond))
	})

	// 200 clients each send half of a request near the size limit and stall: the agent's
	// intake bounds what they make it buffer (its RSS stays well under what they sent), a
	// normal ADD through the plugin still succeeds in time, the memory is not held after
	// they close, and the log reports every one of them in at most one line per 10 s.
	t.Run("200 stalled half requests", func(t *testing.T) {
		const clients = 200
		const rssBound = 64 << 20 // the intake's 16.5 MiB, with room for the Go heap's growth
		logsBefore := len(agent.logs.String())
		base := vmRSS(t, pid)
		half := []byte(`{"version":1,"op":"cni","timeoutMs":5000,"request":{"command":"ADD","stdin":"` +
			strings.Repeat("A", agentapi.MaxMessageSize/2))
		start := time.Now()
		conns := make([]net.Conn, 0, clients)
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		var writers sync.WaitGroup
		for i := range clients {
			c, err := net.Dial("unix", agent.Socket)
			if err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			conns = append(conns, c)
			_ = c.SetDeadline(time.Now().Add(30 * time.Second))
			writers.Go(func() { _, _ = c.Write(half) }) // blocks until read, drained or cut off
		}
		var peak int64
		sampled := make(chan struct{})
		go func() {
			defer close(sampled)
			for range 400 {
				peak = max(peak, vmRSS(t, pid))
				select {
				case <-time.After(10 * time.Millisecond):
				case <-ctx.Done():
					return
				}
			}
		}()
		normalAdd(t, "with 200 stalled half requests")
		writers.Wait()
		<-sampled
		if grew := peak - base; grew > rssBound {
			t.Errorf("the agent's RSS grew by %d MiB (to %d MiB) with %d stalled clients that sent %d MiB; want at most %d MiB",
				grew>>20, peak>>20, clients, clients*len(half)>>20, rssBound>>20)
		}
		t.Logf("RSS %d MiB before, %d MiB at the peak", base>>20, peak>>20)

		for _, c := range conns {
			c.Close()
		}
		normalAdd(t, "after the stalled clients closed")
		after := vmRSS(t, pid)
		if grew := after - base; grew > rssBound {
			t.Errorf("the agent's RSS is %d MiB above its %d MiB before the stalled clients, after they closed", grew>>20, base>>20)
		}

		// Every staller is an event the log reports, in a line of its own or counted as
		// suppressed in another, and there is at most one line per 10 s.
		var lines, counted int
		eventually(t, "the log reports every stalled client", func() error {
			lines, counted = 0, 0
			for line := range strings.SplitSeq(agent.logs.String()[logsBefore:], "\n") {
				var rec struct {
					Msg        string
					Suppressed int
				}
				if json.Unmarshal([]byte(line), &rec) != nil {
					continue
				}
				switch rec.Msg {
				case "agentapi: request not read", "agentapi: writing response", "agentapi: more clients not served":
					lines++
					counted += 1 + rec.Suppressed
				}
			}
			return saw(counted >= clients, "%d clients reported in %d lines", counted, lines)
		})
		if elapsed := time.Since(start); lines > int(elapsed/(10*time.Second))+1 {
			t.Errorf("%d log lines about clients in %s; at most one per 10s", lines, elapsed)
		}
		t.Logf("%d log lines reported %d clients not served", lines, counted)
	})

	// One range set of 10,000 ranges (about 270 KB of JSON, inside the size limit): it
	// once took seconds of CPU per request (quadratic canonicalization); now refused.
	t.Run("10000 ranges", func(t *testing.T) {
		var set allocator.RangeSet
		for i := range 10000 {
			set = append(set, allocator.Range{Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{100, byte(64 + i/256), byte(i % 256), 0}), 24)})
		}
		pool := uniq("h10k")
		var res allocator.Result
		var err error
		// Canonicalizing compares ranges pairwise, so leasehold bounds them per set
		// (allocator.MaxRangesPerSet): refused at once, naming the limit.
		cheap(t, "ADD with a 10,000-range pool", func() {
			res, err = add(netconf(pool, agent.Socket, map[string]any{"ranges": []allocator.RangeSet{set}}), uniq("ctr"))
		})
		t.Logf("ADD with a 10,000-range pool answered: %v %v", res, err)
		if code := agentapi.CodeOf(err); code != agentapi.CodeInvalidNetworkConfig || !strings.Contains(err.Error(), "more than the 1024") {
			t.Errorf("ADD with a 10,000-range pool: code %d (%v); want code 7 naming the limit", code, err)
		}
		normalAdd(t, "after a 10,000-range pool")
	})

	// ::/0: the whole IPv6 space as one range. Sizes are big integers, candidates are
	// found without iterating: a quick, correct answer, and DEL works.
	t.Run("IPv6 /0", func(t *testing.T) {
		all6 := netconf(uniq("hall6"), agent.Socket, map[string]any{"ranges": []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("::/0")}}}})
		container := uniq("ctr")
		var res allocator.Result
		var err error
		cheap(t, "ADD from ::/0", func() { res, err = add(all6, container) })
		if err != nil {
			t.Fatalf("ADD from ::/0: %v", err)
		}
		if a := res.IPs[0].Address; len(res.IPs) != 1 || a.Bits() != 0 || !a.Addr().Is6() || a.Addr() == netip.MustParseAddr("::1") {
			t.Errorf("ADD from ::/0 gave %v; want one IPv6 address /0 that is not the gateway ::1", res.IPs)
		}
		if err := run(agentapi.NewInvocation("STATUS", all6, "", "")); err != nil {
			t.Errorf("STATUS of ::/0: %v", err)
		}
		if err := run(agentapi.NewInvocation("DEL", all6, container, "eth0")); err != nil {
			t.Errorf("DEL from ::/0: %v", err)
		}
	})

	// Range sets: an ADD claims one address from each in a single etcd transaction, which
	// etcd bounds (128 operations by default), so a pool may have at most
	// allocator.MaxRangeSets. At the limit an ADD gets one address per set; one more, or
	// 2,000 (whose canonicalization once cost time cubic in their number), is refused at
	// once with code 7 naming the limit, never answered with code 11 ("try again later")
	// that the runtime would retry forever.
	t.Run("range sets limit", func(t *testing.T) {
		add := func(n int) (res allocator.Result, err error) {
			var sets []allocator.RangeSet
			for i := range n {
				sets = append(sets, allocator.RangeSet{{Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{100, byte(100 + i/256), byte(i % 256), 0}), 24)}})
			}
			cheap(t, fmt.Sprintf("an ADD with %d range sets", n), func() {
				res, err = add(netconf(uniq(fmt.Sprintf("h%dsets", n)), agent.Socket, map[string]any{"ranges": sets}), uniq("ctr"))
			})
			return res, err
		}
		if res, err := add(allocator.MaxRangeSets); err != nil || len(res.IPs) != allocator.MaxRangeSets {
			t.Errorf("ADD with %d range sets: %d addresses, %v", allocator.MaxRangeSets, len(res.IPs), err)
		}
		for _, n := range []int{allocator.MaxRangeSets + 1, 42, 2000} {
			_, err := add(n)
			if code := agentapi.CodeOf(err); code != agentapi.CodeInvalidNetworkConfig || !strings.Contains(err.Error(), fmt.Sprint(allocator.MaxRangeSets)) {
				t.Errorf("ADD with %d range sets: code %d (%v); want code 7 naming the limit %d", n, code, err, allocator.MaxRangeSets)
			}
		}
		normalAdd(t, "after too many range sets")
	})
}

// rawAgentCall writes payload to the agent socket, half-closes and reads one response.
func rawAgentCall(socket string, payload []byte, timeout time.Duration) (*agentapi.WireResponse, error) {
	conn, err := net.Dial("unix", socket)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(timeout))
	go func() {
		_, _ = conn.Write(payload) // the agent stops reading at its limit and answers
		_ = conn.(*net.UnixConn).CloseWrite()
	}()
	var resp agentapi.WireResponse
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		return nil, err
	}
	return &resp, nil
}

// squash lower-cases s and drops spaces, so that "container ID", "containerID" and
// "CNI_CONTAINERID" all contain "containerid".
func squash(s string) string {
	return strings.ReplaceAll(strings.ToLower(s), " ", "")
}

// clip shortens s for messages: hostile values are up to 10 KB.
func clip(s string) string {
	if len(s) > 120 {
		return fmt.Sprintf("%.120s...(%d bytes)", s, len(s))
	}
	return s
}

func grepLines(s, word string) string {
	var out []string
	for line := range strings.SplitSeq(s, "\n") {
		if strings.Contains(line, word) {
			out = append(out, clip(line))
		}
	}
	return strings.Join(out, "\n")
}

// vmRSS is the resident set size of process pid, from /proc/<pid>/status.
// cpuTime is the CPU time (user and system) process pid has used.
func cpuTime(t testing.TB, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatalf("reading the agent's CPU time: %v", err)
	}
	// After "pid (comm) ": state is field 3 of proc(5); utime and stime are 14 and 15, in
	// clock ticks of 1/100 s (USER_HZ on Linux).
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	var utime, stime int64
	if len(fields) < 13 {
		t.Fatalf("/proc/%d/stat: %q", pid, s)
	}
	if _, err := fmt.Sscan(fields[11], &utime); err != nil {
		t.Fatalf("/proc/%d/stat utime %q: %v", pid, fields[11], err)
	}
	if _, err := fmt.Sscan(fields[12], &stime); err != nil {
		t.Fatalf("/proc/%d/stat stime %q: %v", pid, fields[12], err)
	}
	return time.Duration(utime+stime) * time.Second / 100
}

func vmRSS(t testing.TB, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("reading the agent's memory use: %v", err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err != nil {
				t.Fatalf("VmRSS line %q: %v", line, err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no VmRSS in /proc/%d/status", pid)
	return 0
}
