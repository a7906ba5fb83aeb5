package cniplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// stickyConf is a valid configuration with ipamExtra added to its ipam object and
// topExtra to its top level (each starting with a comma when not empty).
func stickyConf(ipamExtra, topExtra string) []byte {
	return []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"net1","ipam":{"type":"leasehold","socket":"/run/x.sock",`+
		`"ranges":[[{"subnet":"10.0.0.0/24"}]]%s}%s}`, ipamExtra, topExtra))
}

const podArgs = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_UID=uid-1"

// TestParseConfigSticky: where the claim's name comes from, how it is checked, and
// stickyHold, for an invocation that names an attachment (ADD, DEL, CHECK).
func TestParseConfigSticky(t *testing.T) {
	long := strings.Repeat("a", allocator.MaxNameLen)
	tests := []struct {
		name      string
		ipam      string // added to the ipam object
		top       string // added to the top level
		args      string // CNI_ARGS
		wantClaim string
		wantHold  time.Duration
		wantErr   string  // when not empty: the error must contain it
		is        []error // and wrap these (ErrInvalidConfig is always checked)
	}{
		// Nothing sticky: nothing changes.
		{name: "not sticky", args: podArgs},
		// sticky names the claim after the pod: <namespace>.<name>.
		{name: "sticky", ipam: `,"sticky":true`, args: podArgs, wantClaim: "ns.web-0"},
		{name: "sticky with hold", ipam: `,"sticky":true,"stickyHold":"10m"`, args: podArgs, wantClaim: "ns.web-0", wantHold: 10 * time.Minute},
		// sticky false is the same as absent.
		{name: "sticky false", ipam: `,"sticky":false`, args: podArgs},
		// The runtime names the claim (Multus, KubeVirt): no sticky needed.
		{name: "CNI_ARGS claim", args: podArgs + ";LEASEHOLD_CLAIM=vm-disk.1", wantClaim: "vm-disk.1"},
		{name: "args.cni.claim", top: `,"args":{"cni":{"claim":"vm-a"}}`, args: podArgs, wantClaim: "vm-a"},
		// args.cni may carry other plugins' keys beside ours.
		{name: "args.cni.claim with others", top: `,"args":{"cni":{"claim":"vm-a","ips":["10.0.0.5"],"mac":"x"}}`, wantClaim: "vm-a"},
		// An explicit claim wins over the pod's name, and needs no pod arguments.
		{name: "explicit over sticky", ipam: `,"sticky":true`, args: podArgs + ";LEASEHOLD_CLAIM=mine", wantClaim: "mine"},
		{name: "explicit sticky without pod", ipam: `,"sticky":true,"stickyHold":"90s"`, top: `,"args":{"cni":{"claim":"vm-a"}}`,
			wantClaim: "vm-a", wantHold: 90 * time.Second},
		// Both sources naming the same claim agree.
		{name: "both sources agree", top: `,"args":{"cni":{"claim":"c1"}}`, args: "LEASEHOLD_CLAIM=c1", wantClaim: "c1"},
		// An empty explicit claim names none: sticky's pod name is used.
		{name: "empty explicit", ipam: `,"sticky":true`, top: `,"args":{"cni":{"claim":""}}`, args: podArgs + ";LEASEHOLD_CLAIM=",
			wantClaim: "ns.web-0"},
		// stickyHold with an explicit claim and without sticky.
		{name: "hold with explicit claim", ipam: `,"stickyHold":"1h"`, args: "LEASEHOLD_CLAIM=c1", wantClaim: "c1", wantHold: time.Hour},

		// Two different explicit claims: refused, naming both.
		{name: "conflicting explicit claims", top: `,"args":{"cni":{"claim":"c2"}}`, args: "LEASEHOLD_CLAIM=c1",
			wantErr: `CNI_ARGS LEASEHOLD_CLAIM "c1" and args.cni.claim "c2" name different claims`},
		{name: "CNI_ARGS claim twice", args: "LEASEHOLD_CLAIM=c1;LEASEHOLD_CLAIM=c2",
			wantErr: `CNI_ARGS gives LEASEHOLD_CLAIM twice ("c1" and "c2")`},
		// sticky without the pod's name: refused, saying what is missing and how to name a
		// claim explicitly.
		{name: "sticky without pod args", ipam: `,"sticky":true`,
			wantErr: `ipam.sticky names the claim after the pod, <namespace>.<name>, but CNI_ARGS has no K8S_POD_NAMESPACE and no K8S_POD_NAME; ` +
				`have the runtime pass K8S_POD_NAMESPACE and K8S_POD_NAME, or name the claim explicitly with CNI_ARGS LEASEHOLD_CLAIM=<name> ` +
				`or "args": {"cni": {"claim": "<name>"}}`},
		{name: "sticky without pod name", ipam: `,"sticky":true`, args: "K8S_POD_NAMESPACE=ns;K8S_POD_UID=u",
			wantErr: "CNI_ARGS has no K8S_POD_NAME; have the runtime"},
		{name: "sticky without namespace", ipam: `,"sticky":true`, args: "K8S_POD_NAME=web-0",
			wantErr: "CNI_ARGS has no K8S_POD_NAMESPACE; have the runtime"},
		// Claim names become etcd key parts.
		{name: "invalid CNI_ARGS claim", args: "LEASEHOLD_CLAIM=a/b",
			wantErr: `CNI_ARGS LEASEHOLD_CLAIM: invalid name: claim name "a/b" has '/'`, is: []error{allocator.ErrInvalidName}},
		{name: "invalid args.cni.claim", top: `,"args":{"cni":{"claim":".."}}`,
			wantErr: `args.cni.claim: invalid name: claim name ".." is reserved`, is: []error{allocator.ErrInvalidName}},
		{name: "invalid pod-named claim", ipam: `,"sticky":true`, args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web 0",
			wantErr: `ipam.sticky: the claim named after the pod (K8S_POD_NAMESPACE.K8S_POD_NAME): invalid name: claim name "ns.web 0" has ' '`,
			is:      []error{allocator.ErrInvalidName}},
		{name: "pod-named claim too long", ipam: `,"sticky":true`, args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=" + long,
			wantErr: "bytes long; use at most 253; or name the claim explicitly", is: []error{allocator.ErrInvalidName}},
		{name: "claim of the wrong type", top: `,"args":{"cni":{"claim":7}}`, wantErr: "args.cni.claim: got a JSON number, want a string"},
		// null is no claim.
		{name: "claim null", ipam: `,"sticky":true`, top: `,"args":{"cni":{"claim":null}}`, args: podArgs, wantClaim: "ns.web-0"},
		// stickyHold: a positive Go duration, and only with a claim.
		{name: "hold not a duration", ipam: `,"sticky":true,"stickyHold":"ten minutes"`, args: podArgs,
			wantErr: `ipam.stickyHold "ten minutes" is not a positive duration; write it like "10m" or "1h"`},
		{name: "hold without unit", ipam: `,"sticky":true,"stickyHold":"600"`, args: podArgs,
			wantErr: `ipam.stickyHold "600" is not a positive duration`},
		{name: "hold negative", ipam: `,"sticky":true,"stickyHold":"-5m"`, args: podArgs,
			wantErr: `ipam.stickyHold "-5m" is not a positive duration`},
		{name: "hold zero", ipam: `,"sticky":true,"stickyHold":"0s"`, args: podArgs,
			wantErr: `ipam.stickyHold "0s" is not a positive duration`},
		{name: "hold a number", ipam: `,"sticky":true,"stickyHold":600`, args: podArgs,
			wantErr: "ipam.stickyHold: got a JSON number, want a string"},
		{name: "sticky a string", ipam: `,"sticky":"yes"`, args: podArgs,
			wantErr: "ipam.sticky: got a JSON string, want true or false"},
		{name: "hold without claim", ipam: `,"stickyHold":"10m"`, args: podArgs,
			wantErr: `ipam.stickyHold 10m0s without a claim would be ignored; set "sticky": true, or name the claim explicitly`},
		{name: "hold with sticky false", ipam: `,"sticky":false,"stickyHold":"10m"`, args: podArgs,
			wantErr: "without a claim would be ignored"},
		// A misspelled field is refused, and the hint lists the new ones.
		{name: "misspelled sticky", ipam: `,"stikcy":true`, args: podArgs,
			wantErr: `unknown field "stikcy": leasehold's ipam accepts type, socket, timeout, pool, ranges, subnet, rangeStart, ` +
				`rangeEnd, gateway, exclude, blocks, routes, dns, sticky, stickyHold and migratable`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := ParseConfig(stickyConf(tt.ipam, tt.top), tt.args, "c0ffee", "eth0", "")
			if tt.wantErr != "" {
				if err == nil {
					t.Fatalf("ParseConfig succeeded with claim %q hold %s, want an error containing %q",
						cfg.Request.Claim, cfg.Request.ClaimHold, tt.wantErr)
				}
				if !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("error %q does not contain %q", err, tt.wantErr)
				}
				for _, is := range append([]error{allocator.ErrInvalidConfig}, tt.is...) {
					if !errors.Is(err, is) {
						t.Errorf("error %q does not wrap %v", err, is)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseConfig: %v", err)
			}
			if cfg.Request.Claim != tt.wantClaim || cfg.Request.ClaimHold != tt.wantHold {
				t.Errorf("claim %q hold %s, want %q %s", cfg.Request.Claim, cfg.Request.ClaimHold, tt.wantClaim, tt.wantHold)
			}
			if cfg.IPAM.StickyHold != tt.wantHold {
				t.Errorf("IPAM.StickyHold %s, want %s", cfg.IPAM.StickyHold, tt.wantHold)
			}
		})
	}
}

// TestParseConfigClaimReference: a live migration's claim (docs/proposals/live-migration.md):
// ipam-claim-reference from args.cni (the one path Multus gives it, through cni-args) in the
// pod's namespace, in its place in the order of the claim's sources, and what makes a claim
// migratable.
func TestParseConfigClaimReference(t *testing.T) {
	ref := func(r string) string { return `,"args":{"cni":{"ipam-claim-reference":"` + r + `"}}` }
	tests := []struct {
		name      string
		ipam, top string
		args      string
		wantClaim string
		wantMig   bool
		wantErr   string
	}{
		// KubeVirt's reference <vm>.<network> becomes a claim of the pod's namespace.
		{name: "reference", top: ref("vm-a.tenantred"), args: podArgs, wantClaim: "ns.vm-a.tenantred"},
		// The network's allowPersistentIPs, or ipam.migratable, makes it migratable.
		{name: "allowPersistentIPs", top: `,"allowPersistentIPs":true` + ref("vm-a.tenantred"), args: podArgs,
			wantClaim: "ns.vm-a.tenantred", wantMig: true},
		{name: "ipam migratable", ipam: `,"migratable":true`, top: ref("vm-a.tenantred"), args: podArgs,
			wantClaim: "ns.vm-a.tenantred", wantMig: true},
		{name: "migratable false", ipam: `,"migratable":false`, top: `,"allowPersistentIPs":false` + ref("vm-a"), args: podArgs,
			wantClaim: "ns.vm-a"},
		// Without a claim the knob is passed on, and ignored by the agent (which logs it once):
		// stock Multus drops the reference, and a network's pods must still start.
		{name: "allowPersistentIPs without a claim", top: `,"allowPersistentIPs":true`, args: podArgs, wantMig: true},
		// The reference comes after the explicit claim: both naming the same claim agree.
		{name: "explicit agrees", top: ref("vm-a"), args: podArgs + ";LEASEHOLD_CLAIM=ns.vm-a", wantClaim: "ns.vm-a"},
		{name: "args.cni.claim agrees", top: `,"args":{"cni":{"claim":"ns.vm-a","ipam-claim-reference":"vm-a"}}`, args: podArgs,
			wantClaim: "ns.vm-a"},
		// and naming another is refused, naming both.
		{name: "explicit disagrees", top: ref("vm-a"), args: podArgs + ";LEASEHOLD_CLAIM=other",
			wantErr: `CNI_ARGS LEASEHOLD_CLAIM "other" and args.cni["ipam-claim-reference"] (claim "ns.vm-a") name different claims`},
		// The reference comes before ipam.sticky's pod name (a launcher pod's name is new per
		// migration).
		{name: "before sticky", ipam: `,"sticky":true`, top: ref("vm-a"), args: podArgs, wantClaim: "ns.vm-a"},
		// An IPAMClaim is namespaced: without the pod's namespace the claim cannot be named.
		{name: "no namespace", top: ref("vm-a"), args: "K8S_POD_NAME=p",
			wantErr: `args.cni["ipam-claim-reference"] "vm-a" names an IPAMClaim of the pod's namespace, but CNI_ARGS has no K8S_POD_NAMESPACE`},
		{name: "invalid reference", top: ref("a/b"), args: podArgs, wantErr: `args.cni["ipam-claim-reference"] in the pod's namespace`},
		{name: "reference of the wrong type", top: `,"args":{"cni":{"ipam-claim-reference":3}}`, args: podArgs,
			wantErr: "got a JSON number, want a string"},
		// Not accepted in the ipam section: a network's configuration is shared by its pods.
		{name: "reference in ipam", ipam: `,"ipam-claim-reference":"vm-a"`, args: podArgs, wantErr: `unknown field "ipam-claim-reference"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := ParseConfig(stickyConf(tt.ipam, tt.top), tt.args, "c0ffee", "eth0", "")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.Is(err, allocator.ErrInvalidConfig) {
					t.Fatalf("ParseConfig: %v, want ErrInvalidConfig containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseConfig: %v", err)
			}
			if cfg.Request.Claim != tt.wantClaim || cfg.Request.Migratable != tt.wantMig {
				t.Errorf("claim %q migratable %v, want %q %v", cfg.Request.Claim, cfg.Request.Migratable, tt.wantClaim, tt.wantMig)
			}
		})
	}
}

// TestStickyWithoutAttachment: GC and STATUS name no attachment and carry no claim, so a
// sticky configuration parses for them without pod arguments (a runtime passes none).
func TestStickyWithoutAttachment(t *testing.T) {
	for _, tt := range []struct{ name, ipam, args string }{
		{"sticky without pod args", `,"sticky":true`, ""},
		{"hold without claim", `,"stickyHold":"10m"`, ""},
		{"claim args ignored", `,"sticky":true`, "LEASEHOLD_CLAIM=a/b;LEASEHOLD_CLAIM=c"},
		{"args.cni.claim ignored", `,"sticky":true`, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			top := ""
			if tt.name == "args.cni.claim ignored" {
				top = `,"args":{"cni":{"claim":7}}`
			}
			cfg, err := ParseConfig(stickyConf(tt.ipam, top), tt.args, "", "", "")
			if err != nil {
				t.Fatalf("ParseConfig without attachment: %v", err)
			}
			if cfg.Request.Claim != "" || cfg.Request.ClaimHold != 0 {
				t.Errorf("claim %q hold %s without an attachment", cfg.Request.Claim, cfg.Request.ClaimHold)
			}
			if len(cfg.Request.Pool.Ranges) != 1 {
				t.Errorf("pool %v: the full parse, not the release fallback, was wanted", cfg.Request.Pool)
			}
		})
	}
	// A stickyHold that does not parse is the configuration's error, whatever the command.
	if _, err := ParseConfig(stickyConf(`,"stickyHold":"soon"`, ""), "", "", "", ""); !errors.Is(err, allocator.ErrInvalidConfig) {
		t.Errorf("bad stickyHold without attachment: %v, want ErrInvalidConfig", err)
	}
}

// TestParseCNIArgsClaim: LEASEHOLD_CLAIM is read as it is (validated by ParseConfig); two
// different values are refused by ParseCNIArgs.
func TestParseCNIArgsClaim(t *testing.T) {
	for in, want := range map[string]string{
		"LEASEHOLD_CLAIM=ns.web-0":                "ns.web-0",
		"IgnoreUnknown=1;LEASEHOLD_CLAIM=a/b":     "a/b",
		"LEASEHOLD_CLAIM=c;LEASEHOLD_CLAIM=c":     "c",
		"LEASEHOLD_CLAIM=":                        "",
		"leasehold_claim=x":                       "",
		"LEASEHOLD_CLAIM=x=y;K8S_POD_NAME=web-0;": "x=y",
	} {
		got, err := ParseCNIArgs(in)
		if err != nil || got.Claim != want {
			t.Errorf("ParseCNIArgs(%q): claim %q, %v; want %q", in, got.Claim, err, want)
		}
	}
	_, err := ParseCNIArgs("LEASEHOLD_CLAIM=a;LEASEHOLD_CLAIM=b")
	if !errors.Is(err, allocator.ErrInvalidConfig) || !strings.Contains(err.Error(), "gives LEASEHOLD_CLAIM twice") {
		t.Errorf("conflicting LEASEHOLD_CLAIM: %v", err)
	}
}

// TestReleaseConfigSticky: a DEL with a sticky configuration that ParseConfig refuses still
// produces a request (the release fallback), without a claim: the agent finds the claim from
// its own records. A valid sticky configuration's DEL carries the claim.
func TestReleaseConfigSticky(t *testing.T) {
	tests := []struct {
		name, ipam, top, args string
		wantClaim             string
		wantHold              time.Duration
		wantRanges            int // 1: the full parse; 0: the fallback
	}{
		{"valid sticky", `,"sticky":true,"stickyHold":"10m"`, "", podArgs, "ns.web-0", 10 * time.Minute, 1},
		{"valid explicit", "", `,"args":{"cni":{"claim":"vm-a"}}`, podArgs, "vm-a", 0, 1},
		{"sticky without pod args", `,"sticky":true`, "", "", "", 0, 0},
		{"conflicting claims", "", `,"args":{"cni":{"claim":"c2"}}`, "LEASEHOLD_CLAIM=c1", "", 0, 0},
		{"CNI_ARGS claim twice", `,"sticky":true`, "", podArgs + ";LEASEHOLD_CLAIM=c1;LEASEHOLD_CLAIM=c2", "", 0, 0},
		{"invalid claim name", "", "", podArgs + ";LEASEHOLD_CLAIM=a/b", "", 0, 0},
		{"invalid pod-named claim", `,"sticky":true`, "", "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web/0", "", 0, 0},
		{"bad stickyHold", `,"sticky":true,"stickyHold":"forever"`, "", podArgs, "", 0, 0},
		{"stickyHold of the wrong type", `,"sticky":true,"stickyHold":10`, "", podArgs, "", 0, 0},
		{"sticky of the wrong type", `,"sticky":"yes"`, "", podArgs, "", 0, 0},
		{"stickyHold without claim", `,"stickyHold":"10m"`, "", podArgs, "", 0, 0},
		{"claim of the wrong type", `,"sticky":true`, `,"args":{"cni":{"claim":["x"]}}`, podArgs, "", 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			conf := stickyConf(tt.ipam, tt.top)
			_, perr := ParseConfig(conf, tt.args, "c0ffee", "eth0", "")
			if (perr == nil) != (tt.wantRanges == 1) {
				t.Fatalf("ParseConfig: %v; the case expects it to %s", perr, map[bool]string{true: "succeed", false: "fail"}[tt.wantRanges == 1])
			}
			cfg, err := ParseReleaseConfig(conf, tt.args, "c0ffee", "eth0", "")
			if err != nil {
				t.Fatalf("ParseReleaseConfig: %v", err)
			}
			r := cfg.Request
			if r.Claim != tt.wantClaim || r.ClaimHold != tt.wantHold || len(r.Pool.Ranges) != tt.wantRanges {
				t.Errorf("claim %q hold %s ranges %d, want %q %s %d", r.Claim, r.ClaimHold, len(r.Pool.Ranges),
					tt.wantClaim, tt.wantHold, tt.wantRanges)
			}
			if r.Network != "net1" || r.Pool.Name != "net1" || r.ContainerID != "c0ffee" || r.IfName != "eth0" ||
				cfg.IPAM.Socket != "/run/x.sock" {
				t.Errorf("request %+v socket %q: the attachment is not named", r, cfg.IPAM.Socket)
			}
			if tt.args != "" && strings.Contains(tt.args, "K8S_POD_UID") && r.Pod.UID != "uid-1" {
				t.Errorf("pod %+v, want the UID carried over (it is the owner)", r.Pod)
			}
		})
	}
}

// TestStickyRequestReachesAgent runs ADD, CHECK and DEL through the plugin as leaseholdd
// does: each request the agent gets names the claim and its hold, and they appear in the
// request's JSON as "claim" and "claimHold". A DEL whose sticky configuration is refused
// still reaches the agent, without a claim, while ADD and CHECK of it fail with code 7.
func TestStickyRequestReachesAgent(t *testing.T) {
	stub := &agentStub{result: dualStack()}
	plain := string(readTemplate(t, "plugin.json", testSocket, "1.1.0"))
	withIPAM := func(extra string) []byte {
		out := strings.Replace(plain, `"timeout": "5s",`, `"timeout": "5s", `+extra, 1)
		if out == plain {
			t.Fatal("plugin.json has no timeout line to add to")
		}
		return []byte(out)
	}
	sticky := withIPAM(`"sticky": true, "stickyHold": "10m",`)
	args := "K8S_POD_NAMESPACE=db;K8S_POD_NAME=pg-2;K8S_POD_UID=uid-7"
	requestJSON := func(t *testing.T) map[string]any {
		t.Helper()
		req, _ := stub.lastReq()
		data, err := json.Marshal(req)
		if err != nil {
			t.Fatalf("encoding the request: %v", err)
		}
		var m map[string]any
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	for _, command := range []string{"ADD", "CHECK", "DEL"} {
		t.Run(command, func(t *testing.T) {
			stub.mu.Lock()
			stub.calls, stub.req = nil, allocator.Request{}
			stub.mu.Unlock()
			out := Invoke(context.Background(), stub, invocation(command, sticky, args))
			if out.Exit != 0 || out.Err != nil {
				t.Fatalf("%s: exit %d, stdout %s, err %v", command, out.Exit, out.Stdout, out.Err)
			}
			req, _ := stub.lastReq()
			if req.Claim != "db.pg-2" || req.ClaimHold != 10*time.Minute || req.Pod.UID != "uid-7" {
				t.Errorf("agent got claim %q hold %s pod %+v", req.Claim, req.ClaimHold, req.Pod)
			}
			m := requestJSON(t)
			if m["claim"] != "db.pg-2" || m["claimHold"] != float64(10*time.Minute) {
				t.Errorf("request JSON has claim %v claimHold %v; want \"db.pg-2\" and %d", m["claim"], m["claimHold"], 10*time.Minute)
			}
		})
	}
	// Without a claim, the JSON carries neither key.
	ok := Invoke(context.Background(), stub, invocation("ADD", []byte(plain), args))
	if ok.Exit != 0 {
		t.Fatalf("ADD without sticky: exit %d, stdout %s", ok.Exit, ok.Stdout)
	}
	if m := requestJSON(t); m["claim"] != nil || m["claimHold"] != nil {
		t.Errorf("request JSON without a claim has claim %v claimHold %v", m["claim"], m["claimHold"])
	}
	// A hold left out is zero in the request: the agent's default.
	ok = Invoke(context.Background(), stub, invocation("ADD", withIPAM(`"sticky": true,`), args))
	if req, _ := stub.lastReq(); ok.Exit != 0 || req.Claim != "db.pg-2" || req.ClaimHold != 0 {
		t.Errorf("ADD sticky without stickyHold: exit %d, claim %q hold %s", ok.Exit, req.Claim, req.ClaimHold)
	}

	// Sticky, but the runtime gave no pod name: ADD and CHECK are refused before the agent,
	// DEL still releases.
	noPod := "K8S_POD_UID=uid-7"
	for _, command := range []string{"ADD", "CHECK"} {
		stub.mu.Lock()
		stub.calls = nil
		stub.mu.Unlock()
		code, msg := cniErr(t, Invoke(context.Background(), stub, invocation(command, sticky, noPod)))
		if code != 7 || !strings.Contains(msg, "CNI_ARGS has no K8S_POD_NAMESPACE and no K8S_POD_NAME") {
			t.Errorf("%s sticky without pod name: code %d %q", command, code, msg)
		}
		stub.mu.Lock()
		calls := stub.calls
		stub.mu.Unlock()
		if len(calls) != 0 {
			t.Errorf("%s refused locally reached the agent: %v", command, calls)
		}
	}
	for _, bad := range []struct {
		name string
		conf []byte
		args string
	}{
		{"no pod name", sticky, noPod},
		{"bad claim name", sticky, noPod + ";LEASEHOLD_CLAIM=a/b"},
		{"bad stickyHold", withIPAM(`"sticky": true, "stickyHold": "-1s",`), args},
	} {
		out := Invoke(context.Background(), stub, invocation("DEL", bad.conf, bad.args))
		if out.Exit != 0 || out.Err != nil {
			t.Errorf("DEL with %s: exit %d, stdout %s", bad.name, out.Exit, out.Stdout)
			continue
		}
		if req, _ := stub.lastReq(); req.Claim != "" || req.ContainerID != "c0ffee" || req.Pod.UID != "uid-7" || req.Pool.Name != "plug" {
			t.Errorf("DEL with %s: agent got %+v", bad.name, req)
		}
	}

	// GC and STATUS carry no claim and need no pod arguments.
	gc := strings.Replace(string(readTemplate(t, "gc.json", testSocket, "")), `"type": "leasehold",`,
		`"type": "leasehold", "sticky": true, "stickyHold": "10m",`, 1)
	if !strings.Contains(gc, `"sticky"`) {
		t.Fatal("gc.json has no ipam type line to add to")
	}
	for _, command := range []string{"GC", "STATUS"} {
		if out := Invoke(context.Background(), stub, invocation(command, []byte(gc), "")); out.Exit != 0 || out.Err != nil {
			t.Errorf("%s with a sticky configuration: exit %d, stdout %s", command, out.Exit, out.Stdout)
		}
	}
	if _, g := stub.lastReq(); len(g.Pool.Ranges) == 0 {
		t.Errorf("GC of a sticky configuration fell back to the loose parse: %+v", g)
	}
}
