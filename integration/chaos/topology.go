package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// lockDir holds one file per run in progress, named after its subnet number X and holding
// its process ID: a run whose process is gone left its namespaces and links behind.
const lockDir = "/run/leasehold-chaos"

// topology is one Linux bridge in the root namespace, 198.18.X.254/24, and one network
// namespace per host (etcd member or node) with a veth to the bridge. Every name starts with
// lhc<X>- so that a run cleans up what a crashed run with its X left.
type topology struct {
	X      int
	prefix string
	bridge string
	lock   string
	hosts  []*host
}

// host is a network namespace with its veth: hostIf is the end on the bridge (a cut-off is
// that link down), IP its address inside.
type host struct {
	NS     string
	HostIf string
	IP     string
}

var nameRE = regexp.MustCompile(`^lhc([0-9]+)-`)

// ipCmd runs ip with a bounded time.
func ipCmd(ctx context.Context, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func ipOut(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", args...).Output()
	return string(out), err
}

// NetnsAvailable reports why network namespaces cannot be used here, or nil.
func NetnsAvailable(ctx context.Context) error {
	if os.Geteuid() != 0 {
		return errors.New("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("no ip command (iproute2): %w", err)
	}
	if _, err := ipOut(ctx, "netns", "list"); err != nil {
		return fmt.Errorf("ip netns list: %w", err)
	}
	return nil
}

// newTopology sweeps what crashed runs left, picks a free X, takes its lock and makes the
// bridge.
func newTopology(ctx context.Context, logf func(string, ...any)) (*topology, error) {
	if err := os.MkdirAll(lockDir, 0o755); err != nil {
		return nil, err
	}
	sweepLeftovers(ctx, logf)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(os.Getpid())))
	for _, x := range rng.Perm(250) {
		x++
		t := &topology{X: x, prefix: fmt.Sprintf("lhc%d-", x), lock: filepath.Join(lockDir, strconv.Itoa(x))}
		t.bridge = t.prefix + "br"
		if subnetInUse(x) || linkExists(ctx, t.bridge) {
			continue
		}
		f, err := os.OpenFile(t.lock, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err != nil {
			continue
		}
		fmt.Fprintf(f, "%d\n", os.Getpid())
		f.Close()
		if err := t.makeBridge(ctx); err != nil {
			t.close(ctx)
			return nil, err
		}
		return t, nil
	}
	return nil, errors.New("no free 198.18.X.0/24 for the chaos bridge")
}

// sweepLeftovers removes the namespaces, links and locks of runs whose process is gone,
// killing what still runs in their namespaces.
func sweepLeftovers(ctx context.Context, logf func(string, ...any)) {
	xs := map[int]bool{}
	if ents, err := os.ReadDir(lockDir); err == nil {
		for _, e := range ents {
			if x, err := strconv.Atoi(e.Name()); err == nil {
				xs[x] = true
			}
		}
	}
	for _, n := range leftoverNames(ctx) {
		if m := nameRE.FindStringSubmatch(n); m != nil {
			x, _ := strconv.Atoi(m[1])
			xs[x] = true
		}
	}
	for x := range xs {
		lock := filepath.Join(lockDir, strconv.Itoa(x))
		if b, err := os.ReadFile(lock); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid != os.Getpid() && processAlive(pid) {
				continue // a run in progress
			}
		}
		t := &topology{X: x, prefix: fmt.Sprintf("lhc%d-", x), lock: lock}
		t.bridge = t.prefix + "br"
		logf("chaos: removing the leftovers of a previous run with prefix %s", t.prefix)
		t.close(ctx)
	}
}

func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// leftoverNames lists the namespaces and links whose names look like a chaos run's.
func leftoverNames(ctx context.Context) []string {
	var names []string
	if out, err := ipOut(ctx, "netns", "list"); err == nil {
		for _, line := range strings.Split(out, "\n") {
			if f := strings.Fields(line); len(f) > 0 && nameRE.MatchString(f[0]) {
				names = append(names, f[0])
			}
		}
	}
	if ifs, err := net.Interfaces(); err == nil {
		for _, i := range ifs {
			if nameRE.MatchString(i.Name) {
				names = append(names, i.Name)
			}
		}
	}
	return names
}

func subnetInUse(x int) bool {
	_, want, _ := net.ParseCIDR(fmt.Sprintf("198.18.%d.0/24", x))
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return true
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && (want.Contains(n.IP) || n.Contains(want.IP)) {
			return true
		}
	}
	return false
}

func linkExists(ctx context.Context, name string) bool {
	return ipCmd(ctx, "link", "show", "dev", name) == nil
}

func (t *topology) makeBridge(ctx context.Context) error {
	for _, args := range [][]string{
		{"link", "add", t.bridge, "type", "bridge"},
		{"addr", "add", fmt.Sprintf("198.18.%d.254/24", t.X), "dev", t.bridge},
		{"link", "set", t.bridge, "up"},
	} {
		if err := ipCmd(ctx, args...); err != nil {
			return err
		}
	}
	return nil
}

// addHost makes namespace lhc<X>-<name> with a veth whose bridge end is lhc<X>-<name> and
// whose inside end is eth0 with address 198.18.X.<octet>/24.
func (t *topology) addHost(ctx context.Context, name string, octet int) (*host, error) {
	h := &host{NS: t.prefix + name, HostIf: t.prefix + name, IP: fmt.Sprintf("198.18.%d.%d", t.X, octet)}
	if len(h.HostIf) > 15 {
		return nil, fmt.Errorf("interface name %s is longer than 15 bytes", h.HostIf)
	}
	for _, args := range [][]string{
		{"netns", "add", h.NS},
		{"link", "add", h.HostIf, "type", "veth", "peer", "name", "eth0", "netns", h.NS},
		{"link", "set", h.HostIf, "master", t.bridge, "up"},
		{"-n", h.NS, "addr", "add", h.IP + "/24", "dev", "eth0"},
		{"-n", h.NS, "link", "set", "eth0", "up"},
		{"-n", h.NS, "link", "set", "lo", "up"},
	} {
		if err := ipCmd(ctx, args...); err != nil {
			return nil, err
		}
	}
	t.hosts = append(t.hosts, h)
	return h, nil
}

// setLink sets a host's bridge end up or down: down cuts it off from every other host.
func (t *topology) setLink(ctx context.Context, h *host, up bool) error {
	state := "down"
	if up {
		state = "up"
	}
	return ipCmd(ctx, "link", "set", "dev", h.HostIf, state)
}

// close kills whatever still runs in the run's namespaces, deletes them and every link of
// the run, and drops the lock. It goes on past errors.
func (t *topology) close(ctx context.Context) {
	if out, err := ipOut(ctx, "netns", "list"); err == nil {
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || !strings.HasPrefix(f[0], t.prefix) {
				continue
			}
			if pids, err := ipOut(ctx, "netns", "pids", f[0]); err == nil {
				for _, p := range strings.Fields(pids) {
					if pid, err := strconv.Atoi(p); err == nil && pid != os.Getpid() {
						_ = syscall.Kill(pid, syscall.SIGKILL)
					}
				}
			}
			_ = ipCmd(ctx, "netns", "del", f[0])
		}
	}
	if ifs, err := net.Interfaces(); err == nil {
		for _, i := range ifs {
			if strings.HasPrefix(i.Name, t.prefix) {
				_ = ipCmd(ctx, "link", "del", "dev", i.Name)
			}
		}
	}
	// The etcd members' data kept in memory (etcd.go).
	if dirs, err := filepath.Glob("/dev/shm/" + t.prefix + "etcd-*"); err == nil {
		for _, d := range dirs {
			_ = os.RemoveAll(d)
		}
	}
	_ = os.Remove(t.lock)
}
