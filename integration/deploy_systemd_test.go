package integration

import (
	"fmt"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// ---------------------------------------------------------------------------------------
// systemd

// deployParseUnit reads a unit file: section → key → values, continuation lines joined.
func deployParseUnit(text string) map[string]map[string][]string {
	units := map[string]map[string][]string{}
	section := ""
	var pending string
	for _, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		if pending == "" && (trimmed == "" || strings.HasPrefix(trimmed, "#") || strings.HasPrefix(trimmed, ";")) {
			continue
		}
		if pending != "" && (strings.HasPrefix(trimmed, "#") || strings.HasPrefix(trimmed, ";")) {
			continue
		}
		if strings.HasSuffix(trimmed, "\\") {
			pending += strings.TrimSuffix(trimmed, "\\") + " "
			continue
		}
		line, pending = pending+trimmed, ""
		if strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]") {
			section = line[1 : len(line)-1]
			if units[section] == nil {
				units[section] = map[string][]string{}
			}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if ok && section != "" {
			units[section][strings.TrimSpace(k)] = append(units[section][strings.TrimSpace(k)], strings.TrimSpace(v))
		}
	}
	return units
}

func deployParseEnvFile(text string) map[string]string {
	env := map[string]string{}
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			continue
		}
		if len(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		}
		env[strings.TrimSpace(k)] = v
	}
	return env
}

func deployCheckSystemd(unitText, envText string, flags map[string]deployFlagKind) []string {
	var probs []string
	add := func(format string, args ...any) { probs = append(probs, fmt.Sprintf(format, args...)) }
	u := deployParseUnit(unitText)
	env := deployParseEnvFile(envText)
	words := func(section, key string) []string {
		var out []string
		for _, v := range u[section][key] {
			out = append(out, strings.Fields(v)...)
		}
		return out
	}
	last := func(section, key string) string {
		if v := u[section][key]; len(v) > 0 {
			return v[len(v)-1]
		}
		return ""
	}
	for _, key := range []string{"After", "Wants"} {
		if !slices.Contains(words("Unit", key), "network-online.target") {
			add("unit: %s= does not name network-online.target", key)
		}
	}
	if r := last("Service", "Restart"); r != "always" {
		add("unit: Restart=%q, want always", r)
	}
	rd, sd := words("Service", "RuntimeDirectory"), words("Service", "StateDirectory")
	if !slices.Contains(rd, "leasehold") {
		add("unit: RuntimeDirectory does not include leasehold")
	}
	if !slices.Contains(sd, "leasehold") {
		add("unit: StateDirectory does not include leasehold")
	}
	if ef := strings.TrimPrefix(last("Service", "EnvironmentFile"), "-"); ef != "/etc/leasehold/leaseholdd.env" {
		add("unit: EnvironmentFile=%q, want /etc/leasehold/leaseholdd.env", ef)
	}
	execStart := strings.Fields(last("Service", "ExecStart"))
	if len(execStart) == 0 {
		return append(probs, "unit: no ExecStart")
	}
	if bin := strings.TrimLeft(execStart[0], "-@:+!"); !path.IsAbs(bin) || path.Base(bin) != "leaseholdd" {
		add("unit: ExecStart runs %q, want an absolute path to leaseholdd", execStart[0])
	}
	var args []string
	for _, w := range execStart[1:] {
		switch {
		case strings.HasPrefix(w, "${") && strings.HasSuffix(w, "}"):
			name := w[2 : len(w)-1]
			v, ok := env[name]
			if !ok {
				add("unit: ExecStart uses %s, which the env file does not set", w)
			}
			args = append(args, v)
		case strings.HasPrefix(w, "$"):
			v, ok := env[w[1:]]
			if !ok {
				add("unit: ExecStart uses %s, which the env file does not set", w)
			}
			args = append(args, strings.Fields(v)...)
		default:
			args = append(args, w)
		}
	}
	vals, p := deployCheckFlagArgs("unit ExecStart", args, flags)
	probs = append(probs, p...)
	if vals["etcd-endpoints"] == "" && vals["embedded-etcd"] == "" {
		add("unit: no --etcd-endpoints (nor --embedded-etcd)")
	}
	if vals["cluster"] == "" {
		add("unit: no --cluster")
	}
	if s := vals["socket"]; s != "" && !slices.ContainsFunc(rd, func(d string) bool { return path.Dir(s) == "/run/"+d }) {
		add("unit: --socket=%s is not in the RuntimeDirectory %v", s, rd)
	}
	if s := vals["state-dir"]; s != "" && !slices.ContainsFunc(sd, func(d string) bool { return path.Clean(s) == "/var/lib/"+d }) {
		add("unit: --state-dir=%s is not the StateDirectory %v", s, sd)
	}
	if _, ok := env["LEASEHOLD_ETCD_PASSWORD"]; !ok {
		add("env file: no LEASEHOLD_ETCD_PASSWORD (the only way the agent takes a password)")
	}
	// Hardening that would break the agent.
	yes := func(v string) bool { return slices.Contains([]string{"yes", "true", "1", "on"}, strings.ToLower(v)) }
	if af := words("Service", "RestrictAddressFamilies"); len(af) > 0 {
		for _, want := range []string{"AF_UNIX", "AF_NETLINK", "AF_INET", "AF_INET6"} {
			if slices.Contains(af, "~"+want) || (!strings.HasPrefix(af[0], "~") && !slices.Contains(af, want)) {
				add("unit: RestrictAddressFamilies forbids %s", want)
			}
		}
	}
	if cb := words("Service", "CapabilityBoundingSet"); len(cb) > 0 {
		for _, want := range []string{"CAP_NET_ADMIN", "CAP_SYS_ADMIN"} {
			if !slices.Contains(cb, want) {
				add("unit: CapabilityBoundingSet lacks %s", want)
			}
		}
	}
	if rn := words("Service", "RestrictNamespaces"); len(rn) > 0 {
		deny := strings.HasPrefix(rn[0], "~")
		hasNet := slices.ContainsFunc(rn, func(s string) bool { return strings.TrimPrefix(s, "~") == "net" })
		if (deny && hasNet) || (!deny && !hasNet && !slices.Contains([]string{"no", "false", "0", "off"}, strings.ToLower(rn[0]))) {
			add("unit: RestrictNamespaces=%v forbids setns into network namespaces", rn)
		}
	}
	if yes(last("Service", "PrivateNetwork")) {
		add("unit: PrivateNetwork hides the host's addresses")
	}
	if v := last("Service", "ProtectProc"); v == "invisible" || v == "noaccess" || v == "ptraceable" {
		add("unit: ProtectProc=%s hides sandboxes' /proc/<pid>/ns/net: their addresses would be released", v)
	}
	if last("Service", "ProcSubset") == "pid" {
		add("unit: ProcSubset=pid hides the boot ID the node identity is made of")
	}
	if yes(last("Service", "PrivatePIDs")) {
		add("unit: PrivatePIDs hides sandboxes' /proc/<pid>/ns/net")
	}
	if yes(last("Service", "DynamicUser")) {
		add("unit: DynamicUser: leaseholdd needs root")
	}
	if usr := last("Service", "User"); usr != "" && usr != "root" && usr != "0" {
		add("unit: User=%s: leaseholdd needs root", usr)
	}
	return probs
}

// TestDeploySystemdUnit checks deploy/systemd/leaseholdd.service and its env file together,
// then breaks them one way at a time.
func TestDeploySystemdUnit(t *testing.T) {
	flags := deployAgentFlags(t)
	unit := deployReadFile(t, filepath.Join(deployDir, "systemd", "leaseholdd.service"))
	env := deployReadFile(t, filepath.Join(deployDir, "systemd", "leaseholdd.env"))
	for _, p := range deployCheckSystemd(unit, env, flags) {
		t.Error(p)
	}
	for name, tc := range map[string]struct{ unit, env func(string) string }{
		"Restart=on-failure": {unit: func(s string) string { return strings.Replace(s, "Restart=always", "Restart=on-failure", 1) }},
		"another binary": {unit: func(s string) string {
			return strings.Replace(s, "/usr/local/bin/leaseholdd", "/usr/local/bin/leaseholdctl", 1)
		}},
		"no network-online":   {unit: func(s string) string { return strings.ReplaceAll(s, "network-online.target", "network.target") }},
		"no RuntimeDirectory": {unit: func(s string) string { return strings.Replace(s, "RuntimeDirectory=leasehold", "", 1) }},
		"no AF_NETLINK":       {unit: func(s string) string { return strings.Replace(s, "AF_INET6 AF_NETLINK", "AF_INET6", 1) }},
		"no CAP_SYS_ADMIN":    {unit: func(s string) string { return strings.Replace(s, "=CAP_NET_ADMIN CAP_SYS_ADMIN", "=CAP_NET_ADMIN", 1) }},
		"RestrictNamespaces=yes": {unit: func(s string) string {
			return strings.Replace(s, "RestrictNamespaces=net", "RestrictNamespaces=yes", 1)
		}},
		"ProtectProc=invisible":      {unit: func(s string) string { return s + "\n[Service]\nProtectProc=invisible\n" }},
		"PrivateNetwork":             {unit: func(s string) string { return s + "\n[Service]\nPrivateNetwork=yes\n" }},
		"a non-root user":            {unit: func(s string) string { return s + "\n[Service]\nUser=leasehold\n" }},
		"a variable the env lacks":   {unit: func(s string) string { return strings.Replace(s, "$LEASEHOLD_EXTRA_OPTS", "$LEASEHOLD_MORE_OPTS", 1) }},
		"socket outside RuntimeDir":  {unit: func(s string) string { return strings.Replace(s, "--socket=/run/leasehold/", "--socket=/tmp/", 1) }},
		"a mistyped flag in the env": {env: func(s string) string { return strings.Replace(s, "--log-level=info", "--loglevel=info", 1) }},
		"a flag without =":           {env: func(s string) string { return strings.Replace(s, "--cluster=cluster-a", "--cluster cluster-a", 1) }},
		"no cluster":                 {env: func(s string) string { return strings.Replace(s, "--cluster=cluster-a", "", 1) }},
		"no password variable":       {env: func(s string) string { return strings.Replace(s, "LEASEHOLD_ETCD_PASSWORD=", "ETCD_PASSWORD=", 1) }},
	} {
		u, e := unit, env
		if tc.unit != nil {
			u = tc.unit(u)
		}
		if tc.env != nil {
			e = tc.env(e)
		}
		if u == unit && e == env {
			t.Errorf("%s: the mutation changed nothing; update this case", name)
			continue
		}
		if probs := deployCheckSystemd(u, e, flags); len(probs) == 0 {
			t.Errorf("%s: no problem found", name)
		}
	}
}
