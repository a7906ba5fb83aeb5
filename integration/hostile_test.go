package integration

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/cniplugin/agentapi"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// hostileMarker is in every hostile path-like value, so that a file or key it escaped
// into can be found afterwards.
var hostileMarker = fmt.Sprintf("lh-escape-%d", os.Getpid())

// hostileLong is a 10 KB name.
var hostileLong = strings.Repeat("a", 10240)

// hostileRow is one hostile value given to the real plugin binary (ADD). wantCode 0
// means it must be accepted and stored safely; otherwise the plugin must fail with that
// CNI code and a message naming field (compared lower-case, without spaces).
type hostileRow struct {
	name      string
	network   string // "" is the test's network; another gets a subnet of its own
	pool      string // ipam.pool; "" leaves it out
	container string
	ifName    string
	cniArgs   string
	wantCode  uint
	field     string
	// owner is who holds the attachment when accepted (its line in the journal).
	owner string
	// knownBug, when set, names a reported bug this row shows: the journal check logs
	// instead of failing while the bug is there, and fails once it is fixed (remove it then).
	knownBug string
}

// TestHostileNamesAreRefusedOrStoredSafely drives hostile container IDs, interface names,
// pod UIDs, names and namespaces, pool and network names through the real plugin and
// agent, and as invocations sent to the agent socket directly (for NUL, which no
// environment variable can carry). Each is refused with a CNI error naming the field, or
// accepted and stored safely. Then, across everything: no key outside keyspace.Prefix,
// every key of a known shape made of valid names, the agent's state directory holding only
// its lock and journal directly inside it, no file anywhere named after a hostile value;
// and after DEL nothing of the accepted ones is left.
func TestHostileNamesAreRefusedOrStoredSafely(t *testing.T) {
	f := newFixture(t)
	agent, cli, pl, ctx := f.Agent, f.Cli, f.pl, f.Ctx

	hnet := f.Pool
	m := hostileMarker
	uid := func() string { return uniq("uid-") }
	ctr := func() string { return uniq("ctr") }
	pod := func(u string) string { return "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=" + u }
	u246, u247, u253 := "u"+strings.Repeat("6", 245), "u"+strings.Repeat("7", 246), "u"+strings.Repeat("3", 252)
	okU := []string{uid(), uid(), uid(), uid(), uid(), uid(), uid(), uid()}
	okC := []string{ctr(), "c" + strings.Repeat("0", 252), "a..b" + ctr()}

	rows := []hostileRow{
		// Container IDs. skel refuses what is outside [a-zA-Z0-9][a-zA-Z0-9_.-]* (code 4);
		// leasehold also bounds the length (a 10 KB ID would be a 10 KB key component).
		// A path escape attempt: never a key or journal file.
		{name: "container dotdot path", container: "../../" + m, ifName: "eth0", wantCode: 4, field: "containerid"},
		// The key separator.
		{name: "container slash", container: "a/" + m, ifName: "eth0", wantCode: 4, field: "containerid"},
		// Exactly "..".
		{name: "container dotdot", container: "..", ifName: "eth0", wantCode: 4, field: "containerid"},
		// skel has no length limit; ValidateName's 253 bytes is leasehold's.
		{name: "container 10KB", container: hostileLong, ifName: "eth0", wantCode: 7, field: "containerid"},
		// One byte over ValidateName's limit.
		{name: "container 254 bytes", container: "c" + strings.Repeat("4", 253), ifName: "eth0", wantCode: 7, field: "containerid"},
		// Exactly the limit is accepted, and the container is the owner (no pod UID); the
		// per-pod journal files of earlier versions could not be named after it.
		{name: "container 253 bytes", container: okC[1], ifName: "eth0", owner: okC[1]},
		// Non-ASCII.
		{name: "container unicode", container: "café" + m, ifName: "eth0", wantCode: 4, field: "containerid"},
		// White space and a newline.
		{name: "container space", container: "a b", ifName: "eth0", wantCode: 4, field: "containerid"},
		{name: "container newline", container: "a\nb", ifName: "eth0", wantCode: 4, field: "containerid"},
		// Empty: the runtime must name the container.
		{name: "container empty", container: "", ifName: "eth0", wantCode: 4, field: "containerid"},
		// ".." inside a name is not a path component: accepted, key and file are literal.
		{name: "container dots inside", container: okC[2], ifName: "eth0", owner: okC[2]},

		// Interface names. skel refuses '/', ':', white space, "." and "..", over 15 bytes
		// (code 4); leasehold refuses the rest of what ValidateName does (code 7).
		{name: "ifname slash", container: ctr(), ifName: "e/" + m[:5], cniArgs: pod(uid()), wantCode: 4, field: "interfacename"},
		{name: "ifname dotdot", container: ctr(), ifName: "..", cniArgs: pod(uid()), wantCode: 4, field: "interfacename"},
		{name: "ifname 10KB", container: ctr(), ifName: hostileLong, cniArgs: pod(uid()), wantCode: 4, field: "interfacename"},
		{name: "ifname newline", container: ctr(), ifName: "eth0\n", cniArgs: pod(uid()), wantCode: 4, field: "interfacename"},
		// skel lets non-ASCII, '%' and a leading '-' through; ValidateName does not.
		{name: "ifname unicode", container: ctr(), ifName: "éth0", cniArgs: pod(uid()), wantCode: 7, field: "interface"},
		{name: "ifname percent", container: ctr(), ifName: "eth%d", cniArgs: pod(uid()), wantCode: 7, field: "interface"},
		{name: "ifname leading dash", container: ctr(), ifName: "-eth0", cniArgs: pod(uid()), wantCode: 7, field: "interface"},
		// Characters both allow are accepted and end up in the owner key as they are.
		{name: "ifname at sign", container: ctr(), ifName: "eth0@1.x", cniArgs: pod(okU[0]), owner: okU[0]},

		// Pod UIDs (the owner: key part and journal file name).
		{name: "pod UID dotdot path", container: ctr(), ifName: "eth0", cniArgs: pod("../../" + m), wantCode: 7, field: "k8s_pod_uid"},
		{name: "pod UID slash", container: ctr(), ifName: "eth0", cniArgs: pod("a/" + m), wantCode: 7, field: "k8s_pod_uid"},
		{name: "pod UID dotdot", container: ctr(), ifName: "eth0", cniArgs: pod(".."), wantCode: 7, field: "k8s_pod_uid"},
		{name: "pod UID 10KB", container: ctr(), ifName: "eth0", cniArgs: pod(hostileLong), wantCode: 7, field: "k8s_pod_uid"},
		{name: "pod UID unicode", container: ctr(), ifName: "eth0", cniArgs: pod("üid-" + m), wantCode: 7, field: "k8s_pod_uid"},
		{name: "pod UID space", container: ctr(), ifName: "eth0", cniArgs: pod("a b"), wantCode: 7, field: "k8s_pod_uid"},
		{name: "pod UID newline", container: ctr(), ifName: "eth0", cniArgs: pod("a\nb"), wantCode: 7, field: "k8s_pod_uid"},
		// ';' cannot be in a value: the rest becomes a segment without '='.
		{name: "pod UID semicolon", container: ctr(), ifName: "eth0", cniArgs: pod("a;b"), wantCode: 7, field: "cni_args"},
		// Two different UIDs: refused rather than picking one.
		{name: "pod UID twice", container: ctr(), ifName: "eth0", cniArgs: pod("a") + ";K8S_POD_UID=b", wantCode: 7, field: "k8s_pod_uid"},
		// The longest owner whose per-pod journal file (earlier versions) and its .tmp fit
		// in NAME_MAX, and one byte more: both accepted and journaled.
		{name: "pod UID 246 bytes", container: ctr(), ifName: "eth0", cniArgs: pod(u246), owner: u246},
		{name: "pod UID 247 bytes", container: ctr(), ifName: "eth0", cniArgs: pod(u247), owner: u247},
		// The longest owner ValidateName accepts.
		{name: "pod UID 253 bytes", container: ctr(), ifName: "eth0", cniArgs: pod(u253), owner: u253},

		// Pod names and namespaces are values, never key parts: anything is stored as a
		// JSON string.
		{name: "pod name and namespace hostile", container: ctr(), ifName: "eth0", owner: okU[1],
			cniArgs: "K8S_POD_UID=" + okU[1] + ";K8S_POD_NAME=../../" + m + "/x y\nz;K8S_POD_NAMESPACE=名前空間/..", wantCode: 0},
		{name: "pod name 10KB", container: ctr(), ifName: "eth0", owner: okU[2],
			cniArgs: "K8S_POD_UID=" + okU[2] + ";K8S_POD_NAME=" + hostileLong + ";K8S_POD_NAMESPACE=" + hostileLong},

		// Network names: skel refuses anything outside its character set (code 7);
		// leasehold bounds the length (the network name is the default pool name).
		{name: "network dotdot path", network: "../../" + m, container: ctr(), ifName: "eth0", wantCode: 7, field: "networkname"},
		{name: "network slash", network: "a/" + m, container: ctr(), ifName: "eth0", wantCode: 7, field: "networkname"},
		{name: "network NUL", network: "net\x00" + m, container: ctr(), ifName: "eth0", wantCode: 7, field: "networkname"},
		{name: "network unicode", network: "réseau", container: ctr(), ifName: "eth0", wantCode: 7, field: "networkname"},
		{name: "network space", network: "a b", container: ctr(), ifName: "eth0", wantCode: 7, field: "networkname"},
		{name: "network newline", network: "a\nb", container: ctr(), ifName: "eth0", wantCode: 7, field: "networkname"},
		{name: "network 10KB", network: hostileLong, container: ctr(), ifName: "eth0", wantCode: 7, field: "networkname"},
		// 253 bytes: accepted, and as the pool name it becomes pools/<253 bytes>.
		{name: "network 253 bytes", network: "n" + strings.Repeat("5", 252), container: ctr(), ifName: "eth0", cniArgs: pod(okU[3]), owner: okU[3]},

		// Pool names (ipam.pool) come only from JSON, so NUL can be tried here.
		{name: "pool dotdot path", pool: "../../" + m, container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool slash", pool: "a/" + m, container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool dotdot", pool: "..", container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool dot", pool: ".", container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool NUL", pool: "p\x00/" + m, container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool 10KB", pool: hostileLong, container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool unicode", pool: "pööl", container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool space", pool: "a b", container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		{name: "pool newline", pool: "a\nb", container: ctr(), ifName: "eth0", wantCode: 7, field: "pool"},
		// Every punctuation character ValidateName allows: accepted, literal in the keys.
		{name: "pool punctuation", pool: "p:@-._" + uniq("x"), container: ctr(), ifName: "eth0", cniArgs: pod(okU[4]), owner: okU[4]},
		// The longest pool name.
		{name: "pool 253 bytes", pool: "p" + strings.Repeat("2", 252), container: ctr(), ifName: "eth0", cniArgs: pod(okU[5]), owner: okU[5]},

		// Requested addresses: outside the pool is the agent's code 100; a zone never
		// reaches the agent (code 7).
		{name: "requested address outside pool", container: ctr(), ifName: "eth0", cniArgs: pod(uid()) + ";IP=192.0.2.77", wantCode: 100, field: "192.0.2.77"},
		{name: "requested address with zone", container: ctr(), ifName: "eth0", cniArgs: pod(uid()) + ";IP=fd77::9%" + m, wantCode: 7, field: "cni_argsip"},
		// An IPv4-mapped request is the IPv4 address, and its key the IPv4 text.
		{name: "requested address v4-mapped", container: ctr(), ifName: "eth0", cniArgs: pod(okU[6]) + ";IP=::ffff:10.77.3.3", owner: okU[6]},
	}

	type accepted struct {
		conf                       []byte
		container, ifName, cniArgs string
		owner, pool, knownBug      string
	}
	var kept []accepted
	for i, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			network, ranges := hnet, []any{[]any{map[string]any{"subnet": "10.77.0.0/16"}}, []any{map[string]any{"subnet": "fd77::/64"}}}
			if r.network != "" || r.pool != "" {
				// Another pool: its own subnet, so that it shares no address with the others.
				ranges = []any{[]any{map[string]any{"subnet": fmt.Sprintf("10.78.%d.0/24", i)}}}
				network = r.network
				if network == "" {
					network = uniq("hnet")
				}
			}
			ipam := map[string]any{"type": "leasehold", "socket": agent.Socket, "timeout": "20s", "ranges": ranges}
			if r.pool != "" {
				ipam["pool"] = r.pool
			}
			conf, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": network, "type": "leasehold", "ipam": ipam})
			if err != nil {
				t.Fatal(err)
			}
			_, err = pl.add(ctx, conf, r.container, r.ifName, r.cniArgs)
			if r.wantCode == 0 {
				if err != nil {
					t.Fatalf("ADD refused (code %d): %v", cniCode(err), err)
				}
				pool := cmp.Or(r.pool, network)
				kept = append(kept, accepted{conf, r.container, r.ifName, r.cniArgs, r.owner, pool, r.knownBug})
				if key := keyspace.OwnerKey(f.Cluster, r.owner, r.ifName, pool); !exists(t, cli, key) {
					t.Errorf("accepted, but its owner index %q is not in etcd", key)
				}
				return
			}
			if err == nil {
				t.Fatalf("ADD accepted; want code %d naming %q", r.wantCode, r.field)
			}
			var te *types.Error
			if !errors.As(err, &te) {
				t.Fatalf("ADD failed without a CNI error: %v", err)
			}
			if te.Code != r.wantCode {
				t.Errorf("code %d (%s), want %d", te.Code, te.Msg, r.wantCode)
			}
			if text := squash(te.Msg + " " + te.Details); !strings.Contains(text, r.field) {
				t.Errorf("error %q (details %q) does not name %q", clip(te.Msg), clip(te.Details), r.field)
			}
		})
	}

	// The agent socket directly, as a hostile local client could call it: plugin
	// invocations (the only operation there is) carrying what no environment variable can
	// (NUL) and what the plugin never sends.
	client := &agentapi.Client{Socket: agent.Socket, Timeout: etcdtest.Patience}
	apiNet := uniq("hapi")
	apiConf := func(network string, ipam map[string]any, top map[string]any) []byte {
		if ipam == nil {
			ipam = dualStackIPAM("10.79.0.0/16", "fd79::/64")
		}
		var conf map[string]any
		_ = json.Unmarshal(netconf(network, agent.Socket, ipam), &conf)
		for k, v := range top {
			conf[k] = v
		}
		b, err := json.Marshal(conf)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	base := func(command string, conf []byte) *agentapi.Invocation {
		inv := agentapi.NewInvocation(command, conf, ctr(), "eth0")
		inv.Netns, inv.Args = "/var/run/netns/x", pod(uid())
		return inv
	}
	with := func(command string, conf []byte, edit func(*agentapi.Invocation)) func() *agentapi.Invocation {
		return func() *agentapi.Invocation { inv := base(command, conf); edit(inv); return inv }
	}
	add := func(edit func(*agentapi.Invocation)) func() *agentapi.Invocation {
		return with("ADD", apiConf(apiNet, nil, nil), edit)
	}
	same := func(*agentapi.Invocation) {}
	type apiRow struct {
		name  string
		inv   func() *agentapi.Invocation
		codes []uint // acceptable codes; 0 is success
		field string
	}
	apiRows := []apiRow{
		// NUL in each key part, with a path escape behind it.
		{name: "container NUL", inv: add(func(i *agentapi.Invocation) { i.ContainerID = "c\x00/../../" + m }), codes: []uint{4}, field: "containerid"},
		{name: "ifname NUL", inv: add(func(i *agentapi.Invocation) { i.IfName = "eth0\x00" }), codes: []uint{7}, field: "interfacename"},
		{name: "pod UID NUL", inv: add(func(i *agentapi.Invocation) { i.Args = pod("u\x00/../" + m) }), codes: []uint{7}, field: "k8s_pod_uid"},
		{name: "pool NUL with ranges", inv: with("ADD", apiConf(apiNet, map[string]any{"pool": "p\x00" + m,
			"ranges": []any{[]any{map[string]any{"subnet": "10.79.0.0/16"}}}}, nil), same), codes: []uint{7}, field: "pool"},
		{name: "pool NUL by reference", inv: with("ADD", apiConf(apiNet, map[string]any{"pool": "p\x00" + m}, nil), same), codes: []uint{7}, field: "pool"},
		// The plugin's own checks run in the agent, whoever sends the invocation.
		{name: "pod UID dotdot", inv: add(func(i *agentapi.Invocation) { i.Args = pod("../../" + m) }), codes: []uint{7}, field: "k8s_pod_uid"},
		{name: "container dotdot, no pod", inv: add(func(i *agentapi.Invocation) { i.Args, i.ContainerID = "", "../"+m }), codes: []uint{4}, field: "containerid"},
		{name: "container 10KB", inv: add(func(i *agentapi.Invocation) { i.ContainerID = hostileLong }), codes: []uint{7}, field: "containerid"},
		{name: "empty container", inv: add(func(i *agentapi.Invocation) { i.ContainerID = "" }), codes: []uint{4}, field: "containerid"},
		// The pool name defaults to the network name, which must then pass as a pool name.
		{name: "network as pool, dotdot", inv: with("ADD", apiConf("../../"+m, nil, nil), same), codes: []uint{7}, field: "networkname"},
		// NUL in the network name with the pool named: may be refused or stored, never
		// written into a key.
		{name: "network NUL, pool named", inv: with("ADD", apiConf("n\x00../"+m, map[string]any{"pool": apiNet,
			"ranges": []any{[]any{map[string]any{"subnet": "10.79.0.0/16"}}, []any{map[string]any{"subnet": "fd79::/64"}}}}, nil), same),
			codes: []uint{0, 7}},
		// Values only: stored as JSON strings.
		{name: "pod name and namespace NUL, 10KB", inv: add(func(i *agentapi.Invocation) {
			i.Args = "K8S_POD_UID=" + uid() + ";K8S_POD_NAME=p\x00../" + m + hostileLong + ";K8S_POD_NAMESPACE=ns\x00\n名前"
		}), codes: []uint{0}},
		// The netns path is stored, not opened on ADD (liveness is off in this agent).
		{name: "netns path hostile", inv: add(func(i *agentapi.Invocation) { i.Netns = "../../" + m + "\x00" }), codes: []uint{0}},
		// A zone never matches a range: refused, never a key.
		{name: "requested zoned address", inv: add(func(i *agentapi.Invocation) { i.Args += ";IP=fd79::5%x/../" + m }), codes: []uint{7}, field: "cni_argsip"},
		// A v4-mapped request is stored under the IPv4 text.
		{name: "requested v4-mapped", inv: add(func(i *agentapi.Invocation) { i.Args += ";IP=::ffff:10.79.4.4" }), codes: []uint{0}},
		// DEL and CHECK validate as ADD does.
		{name: "del ifname dotdot", inv: with("DEL", apiConf(apiNet, nil, nil), func(i *agentapi.Invocation) { i.IfName = ".." }),
			codes: []uint{4}, field: "interfacename"},
		{name: "check pod UID slash", inv: with("CHECK", apiConf(apiNet, nil, nil), func(i *agentapi.Invocation) { i.Args = pod("a/" + m) }),
			codes: []uint{7}, field: "k8s_pod_uid"},
		// GC with a hostile network (the pool name it defaults to).
		{name: "gc network dotdot", inv: with("GC", apiConf("../../"+m, nil, map[string]any{"cni.dev/valid-attachments": []any{}}), same),
			codes: []uint{7}, field: "networkname"},
		// GC's valid attachments are compared, never used as key parts: hostile ones are
		// harmless (another network, so that nothing of this test's is collected).
		{name: "gc hostile valid attachments", inv: with("GC", apiConf(uniq("hgc"), nil, map[string]any{"cni.dev/valid-attachments": []any{
			map[string]any{"containerID": "../../" + m, "ifname": "\x00"}, map[string]any{"containerID": hostileLong, "ifname": "a/b"}}}), same),
			codes: []uint{0}},
		// STATUS of a pool by a hostile name: a read, but still refused.
		{name: "status pool dotdot", inv: with("STATUS", apiConf(apiNet, map[string]any{"pool": "../../" + m}, nil), same), codes: []uint{7}, field: "pool"},
		{name: "status pool NUL", inv: with("STATUS", apiConf(apiNet, map[string]any{"pool": "p\x00"}, nil), same), codes: []uint{7}, field: "pool"},
	}
	send := func(inv *agentapi.Invocation) error {
		out, err := client.Invoke(ctx, inv)
		if err == nil {
			_, err = out.Result()
		}
		return err
	}
	// ownerOf is who holds an accepted invocation's attachment: its pod UID, else its container.
	ownerOf := func(inv *agentapi.Invocation) string {
		owner := inv.ContainerID
		for kv := range strings.SplitSeq(inv.Args, ";") {
			if v, ok := strings.CutPrefix(kv, "K8S_POD_UID="); ok {
				owner = v
			}
		}
		return owner
	}
	var keptAPI []*agentapi.Invocation
	for _, r := range apiRows {
		t.Run("api "+r.name, func(t *testing.T) {
			inv := r.inv()
			err := send(inv)
			code := agentapi.CodeOf(err)
			if !slices.Contains(r.codes, code) {
				t.Fatalf("%s answered code %d (%v); want one of %v", inv.Command, code, err, r.codes)
			}
			if err == nil {
				if inv.Command == "ADD" {
					keptAPI = append(keptAPI, inv)
				}
				return
			}
			if r.field != "" && !strings.Contains(squash(err.Error()), r.field) {
				t.Errorf("error %q does not name %q", clip(err.Error()), r.field)
			}
		})
	}

	// Across everything: every key is under the prefix and of a known shape.
	checkHostileKeys(t, cli)
	// The journal: one entry per accepted owner, nothing but the lock and the journal in the
	// state directory, and nothing escaped next to it.
	want := map[string]string{} // owner -> known bug
	for _, k := range kept {
		want[k.owner] = k.knownBug
	}
	for _, inv := range keptAPI {
		want[ownerOf(inv)] = ""
	}
	// The agent writes its journal every 50 ms, off the ADD path.
	eventually(t, "the journal holds every accepted owner", func() error {
		journaled := agent.journaled(t)
		for owner, bug := range want {
			if bug == "" && !journaled[owner] {
				return fmt.Errorf("owner %q is not journaled", clip(owner))
			}
		}
		return nil
	})
	checkStateDir(t, agent, want)
	checkNoEscapedFiles(t, agent.StateDir)

	// DEL of everything accepted leaves no owner, allocation or pod key, and no journal entry.
	for _, k := range kept {
		if err := pl.del(ctx, k.conf, k.container, k.ifName, k.cniArgs); err != nil {
			t.Errorf("DEL %s/%s: %v", clip(k.container), k.ifName, err)
		}
	}
	for _, inv := range keptAPI {
		del := *inv
		del.Command = "DEL"
		if err := send(&del); err != nil {
			t.Errorf("API DEL %s: %v", ownerOf(inv), err)
		}
	}
	for key := range snapshot(t, cli, keyspace.Prefix) {
		for _, family := range []string{keyspace.OwnersPrefix(""), keyspace.IPsPrefix(""), keyspace.PodsPrefix(f.Cluster, agent.Node), keyspace.ConflictsPrefix("")} {
			if strings.HasPrefix(key, family) {
				t.Errorf("after DEL of everything accepted, key %q is left", key)
			}
		}
	}
	eventually(t, "the journal forgets every owner", func() error {
		j := agent.journaled(t)
		return saw(len(j) == 0, "%d owners journaled", len(j))
	})
	checkStateDir(t, agent, nil)
	checkHostileKeys(t, cli)
	if t.Failed() {
		t.Logf("agent log (journal lines):\n%s", grepLines(agent.logs.String(), "journal"))
	}
}
