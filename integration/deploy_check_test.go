package integration

import (
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin"
)

// ---------------------------------------------------------------------------------------
// The DaemonSet and what it refers to

var deployVarRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)`)

// deployCheck checks the DaemonSet against everything it depends on and returns the
// agent's socket path on the host (for the NetworkAttachmentDefinition check).
func deployCheck(t *testing.T, d *deployment, flags map[string]deployFlagKind, dockerfile, goVersion string) (hostSocket string, probs []string) {
	t.Helper()
	add := func(format string, args ...any) { probs = append(probs, fmt.Sprintf(format, args...)) }
	for kind, n := range map[string]int{"Namespace": len(d.Namespaces), "ServiceAccount": len(d.ServiceAccounts),
		"ConfigMap": len(d.ConfigMaps), "Secret": len(d.Secrets), "NetworkAttachmentDefinition": len(d.NADs)} {
		if n == 0 {
			add("no %s among the manifests", kind)
		}
	}
	if len(d.DaemonSets) != 1 {
		add("want exactly one DaemonSet, found %d", len(d.DaemonSets))
		return "", probs
	}
	ds := &d.DaemonSets[0]
	ns := ds.Namespace
	if !slices.ContainsFunc(d.Namespaces, func(n corev1.Namespace) bool { return n.Name == ns }) {
		add("DaemonSet %s: its namespace %q is not among the manifests' Namespaces", ds.Name, ns)
	}
	for _, o := range d.ServiceAccounts {
		if o.Namespace != ns {
			add("ServiceAccount %s is in namespace %q, the DaemonSet in %q", o.Name, o.Namespace, ns)
		}
	}
	for _, o := range d.ConfigMaps {
		if o.Namespace != ns {
			add("ConfigMap %s is in namespace %q, the DaemonSet in %q", o.Name, o.Namespace, ns)
		}
	}
	for _, o := range d.Secrets {
		if o.Namespace != ns {
			add("Secret %s is in namespace %q, the DaemonSet in %q", o.Name, o.Namespace, ns)
		}
	}

	// Pod-level settings.
	spec := &ds.Spec.Template.Spec
	if ds.Spec.Selector == nil || len(ds.Spec.Selector.MatchLabels) == 0 {
		add("DaemonSet: no selector matchLabels")
	} else {
		for k, v := range ds.Spec.Selector.MatchLabels {
			if ds.Spec.Template.Labels[k] != v {
				add("DaemonSet: selector %s=%s does not match the pod template's labels %v", k, v, ds.Spec.Template.Labels)
			}
		}
	}
	if !spec.HostNetwork {
		add("DaemonSet: hostNetwork is not true (the agent publishes the node's addresses and the probes use the node's loopback)")
	}
	if spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		add("DaemonSet: dnsPolicy is %q, want ClusterFirstWithHostNet with hostNetwork", spec.DNSPolicy)
	}
	if spec.PriorityClassName != "system-node-critical" {
		add("DaemonSet: priorityClassName is %q, want system-node-critical", spec.PriorityClassName)
	}
	if !slices.ContainsFunc(spec.Tolerations, func(t corev1.Toleration) bool {
		return t.Key == "" && t.Operator == corev1.TolerationOpExists && t.Effect == ""
	}) {
		add("DaemonSet: no toleration {operator: Exists} (without key or effect) that tolerates every taint")
	}
	if spec.ServiceAccountName == "" || !slices.ContainsFunc(d.ServiceAccounts, func(sa corev1.ServiceAccount) bool { return sa.Name == spec.ServiceAccountName }) {
		add("DaemonSet: serviceAccountName %q is not among the manifests' ServiceAccounts", spec.ServiceAccountName)
	}
	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil || us.RollingUpdate.MaxUnavailable == nil ||
		*us.RollingUpdate.MaxUnavailable != intstr.FromInt32(1) {
		add("DaemonSet: updateStrategy is not RollingUpdate with maxUnavailable 1: %+v", us)
	} else if ms := us.RollingUpdate.MaxSurge; ms != nil && ms.String() != "0" && ms.String() != "0%" {
		add("DaemonSet: maxSurge %s would run two agents on one node during a rollout", ms.String())
	}
	vols := map[string]*corev1.Volume{}
	for i := range spec.Volumes {
		vols[spec.Volumes[i].Name] = &spec.Volumes[i]
	}
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		for _, m := range c.VolumeMounts {
			if vols[m.Name] == nil {
				add("container %s: volumeMount %s names no volume of the pod", c.Name, m.Name)
			}
		}
	}

	// The agent container.
	var agent *corev1.Container
	for i := range spec.Containers {
		if len(spec.Containers[i].Command) > 0 && path.Base(spec.Containers[i].Command[0]) == "leaseholdd" {
			if agent != nil {
				add("DaemonSet: more than one container runs leaseholdd")
			}
			agent = &spec.Containers[i]
		}
	}
	if agent == nil {
		add("DaemonSet: no container whose command is leaseholdd")
		return "", probs
	}
	env, p := d.containerEnv(ns, agent)
	probs = append(probs, p...)
	used := map[string]bool{}
	var expanded []string
	for _, a := range append(slices.Clone(agent.Command[1:]), agent.Args...) {
		for _, m := range deployVarRef.FindAllStringSubmatch(a, -1) {
			used[m[1]] = true
		}
		e, p := env.expand("container "+agent.Name, a)
		probs = append(probs, p...)
		expanded = append(expanded, e)
	}
	for name, src := range env.source {
		if strings.HasPrefix(src, "configmap:") && !used[name] {
			add("ConfigMap %s key %s is never used in the agent's arguments: editing it would change nothing", strings.TrimPrefix(src, "configmap:"), name)
		}
	}
	if pw, ok := env.source["LEASEHOLD_ETCD_PASSWORD"]; ok && !strings.HasPrefix(pw, "secret:") {
		add("container %s: LEASEHOLD_ETCD_PASSWORD comes from %s; it must come from a Secret", agent.Name, pw)
	}
	for _, cm := range d.ConfigMaps {
		for k := range cm.Data {
			if strings.Contains(strings.ToUpper(k), "PASSWORD") {
				add("ConfigMap %s holds %s: credentials belong in the Secret", cm.Name, k)
			}
		}
	}
	vals, p := deployCheckFlagArgs("container "+agent.Name, expanded, flags)
	probs = append(probs, p...)
	raw := map[string]string{}
	for _, a := range agent.Args {
		if m := deployFlagArg.FindStringSubmatch(a); m != nil {
			raw[m[1]] = m[2]
		}
	}

	// --node from the downward API.
	if m := regexp.MustCompile(`^\$\(([A-Za-z_][A-Za-z0-9_]*)\)$`).FindStringSubmatch(raw["node"]); m == nil || env.source[m[1]] != "fieldRef:spec.nodeName" {
		add("container %s: --node is %q, want $(VAR) with VAR from the downward API fieldRef spec.nodeName", agent.Name, raw["node"])
	}
	if err := allocator.ValidateName("cluster", vals["cluster"]); err != nil {
		add("container %s: --cluster: %v", agent.Name, err)
	}
	tlsGiven := vals["etcd-cacert"] != "" || vals["etcd-cert"] != "" || vals["etcd-key"] != ""
	if vals["etcd-endpoints"] == "" {
		add("container %s: no --etcd-endpoints", agent.Name)
	}
	for _, e := range strings.Split(vals["etcd-endpoints"], ",") {
		u, err := url.Parse(e)
		if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") || (tlsGiven && u.Scheme != "https") {
			add("container %s: etcd endpoint %q is not an http(s) URL (https with TLS files)", agent.Name, e)
		}
	}
	// TLS files: read-only from a Secret volume, each a key of the Secret.
	for _, f := range []string{"etcd-cacert", "etcd-cert", "etcd-key"} {
		p := vals[f]
		if p == "" {
			continue
		}
		m, vol, rel := deployMountFor(spec, agent, p)
		if m == nil || vol == nil || vol.Secret == nil {
			add("container %s: --%s=%s is not in a volume mounted from a Secret", agent.Name, f, p)
			continue
		}
		if !m.ReadOnly {
			add("container %s: the Secret volume %s is not mounted readOnly", agent.Name, m.Name)
		}
		key := strings.TrimPrefix(rel, "/")
		if len(vol.Secret.Items) > 0 {
			found := false
			for _, it := range vol.Secret.Items {
				if it.Path == key {
					key, found = it.Key, true
				}
			}
			if !found {
				add("container %s: --%s=%s: the Secret volume %s projects no item to %s", agent.Name, f, p, vol.Name, rel)
				continue
			}
		}
		if s := d.secret(ns, vol.Secret.SecretName); s == nil || !deploySecretHasKey(s, key) {
			add("container %s: --%s=%s: Secret %s/%s has no key %q", agent.Name, f, p, ns, vol.Secret.SecretName, key)
		}
	}
	// Socket and journal on the host; the netns directory at the host's path, with the
	// runtime's later mounts propagating in; the machine ID behind the default node UID.
	socket, ok := vals["socket"]
	if !ok {
		socket = "/run/leasehold/leaseholdd.sock"
	}
	if hs, ok := deployHostPathOf(spec, agent, path.Dir(socket)); !ok {
		add("container %s: the socket directory %s is not a hostPath mount: the plugin on the host could not reach the agent", agent.Name, path.Dir(socket))
	} else {
		hostSocket = hs + "/" + path.Base(socket)
	}
	stateDir, ok := vals["state-dir"]
	if !ok {
		stateDir = "/var/lib/leasehold"
	}
	if _, ok := deployHostPathOf(spec, agent, path.Clean(stateDir)); !ok {
		add("container %s: --state-dir %s is not on a hostPath mount: the journal would die with the container", agent.Name, stateDir)
	}
	// The runtime passes /var/run/netns/<name>; the host directory is /run/netns (where
	// /var/run links to), since a hostPath through the /var/run link is refused with
	// HostToContainer propagation on hosts whose / is a private mount (make e2e found it).
	netns, hostNetns := "/var/run/netns", "/run/netns"
	m, vol, _ := deployMountFor(spec, agent, netns)
	switch {
	case m == nil || path.Clean(m.MountPath) != netns || vol == nil || vol.HostPath == nil || path.Clean(vol.HostPath.Path) != hostNetns:
		add("container %s: no mount of the host's %s at %s (the runtime passes that path)", agent.Name, hostNetns, netns)
	case m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer:
		add("container %s: %s is mounted without mountPropagation HostToContainer: namespaces created later would be empty files", agent.Name, netns)
	}
	// --node-label: the labels selection rules match, KEY=VALUE comma-separated, or empty (none),
	// as leaseholdd parses them; a label without '=' stops the agent at start.
	if v := vals["node-label"]; strings.TrimSpace(v) != "" {
		for item := range strings.SplitSeq(v, ",") {
			if k, _, ok := strings.Cut(strings.TrimSpace(item), "="); !ok || k == "" {
				add("container %s: --node-label=%s: %q is not KEY=VALUE", agent.Name, v, item)
			}
		}
	}
	if vals["node-uid"] == "" {
		if hp, ok := deployHostPathOf(spec, agent, "/etc/machine-id"); !ok || hp != "/etc/machine-id" {
			add("container %s: --node-uid is empty but the host's /etc/machine-id is not mounted: the node identity would be the image's", agent.Name)
		}
	}
	// Probes on the metrics port.
	metricsAddr, ok := vals["metrics-addr"]
	if !ok {
		metricsAddr = "127.0.0.1:9615"
	}
	mhost, mport, err := net.SplitHostPort(metricsAddr)
	if err != nil {
		add("container %s: --metrics-addr %q: %v", agent.Name, metricsAddr, err)
	}
	maddr, _ := netip.ParseAddr(mhost)
	if mhost != "" && !maddr.IsLoopback() && !maddr.IsUnspecified() {
		add("container %s: --metrics-addr %q names one node's address in a setting shared by every node", agent.Name, metricsAddr)
	}
	probe := func(kind string, pr *corev1.Probe, wantPath string) {
		if pr == nil || pr.HTTPGet == nil {
			add("container %s: no %s probe with httpGet", agent.Name, kind)
			return
		}
		g := pr.HTTPGet
		if g.Path != wantPath {
			add("container %s: %s probe path is %q, want %s", agent.Name, kind, g.Path, wantPath)
		}
		port := g.Port.String()
		if g.Port.Type == intstr.String {
			port = ""
			for _, cp := range agent.Ports {
				if cp.Name == g.Port.StrVal {
					port = strconv.Itoa(int(cp.ContainerPort))
				}
			}
		}
		if port != mport {
			add("container %s: %s probe port %s is %q, but --metrics-addr is %s", agent.Name, kind, g.Port.String(), port, metricsAddr)
		}
		if maddr.IsLoopback() {
			if h, err := netip.ParseAddr(g.Host); err != nil || h != maddr {
				add("container %s: %s probe host is %q: the agent listens on %s only", agent.Name, kind, g.Host, mhost)
			}
		}
	}
	probe("liveness", agent.LivenessProbe, "/healthz")
	probe("readiness", agent.ReadinessProbe, "/readyz")
	if agent.StartupProbe != nil {
		probe("startup", agent.StartupProbe, "/healthz")
	}
	// Resources and privileges.
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			req, okr := c.Resources.Requests[r]
			lim, okl := c.Resources.Limits[r]
			if !okr || !okl {
				add("container %s: no %s request and limit", c.Name, r)
			} else if req.Cmp(lim) > 0 {
				add("container %s: %s request %s exceeds its limit %s", c.Name, r, req.String(), lim.String())
			}
		}
		sc := c.SecurityContext
		if sc == nil || sc.Privileged == nil || *sc.Privileged {
			add("container %s: securityContext.privileged must be set to false", c.Name)
			continue
		}
		if sc.RunAsNonRoot != nil && *sc.RunAsNonRoot || sc.RunAsUser != nil && *sc.RunAsUser != 0 {
			add("container %s: does not run as root; leasehold's agent and installer need root", c.Name)
		}
		if sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation && deployHasCap(sc.Capabilities, "SYS_ADMIN") {
			add("container %s: allowPrivilegeEscalation false with SYS_ADMIN (meaningless, and refused by the API when spelled CAP_SYS_ADMIN)", c.Name)
		}
	}
	if sc := agent.SecurityContext; sc != nil {
		for _, cp := range []string{"NET_ADMIN", "SYS_ADMIN"} {
			if !deployHasCap(sc.Capabilities, cp) {
				add("container %s: capability %s is not added", agent.Name, cp)
			}
		}
	}

	// The init container that installs the plugin.
	var install *corev1.Container
	for i := range spec.InitContainers {
		if slices.ContainsFunc(spec.InitContainers[i].Env, func(e corev1.EnvVar) bool { return e.Name == "DEST_DIR" }) {
			install = &spec.InitContainers[i]
		}
	}
	var pluginSrc string
	if install == nil {
		add("DaemonSet: no init container with DEST_DIR (the plugin installer)")
	} else {
		if install.Image != agent.Image {
			add("init container %s: image %s differs from the agent's %s", install.Name, install.Image, agent.Image)
		}
		ienv, p := d.containerEnv(ns, install)
		probs = append(probs, p...)
		pluginSrc = ienv.vals["SRC"]
		if hp, ok := deployHostPathOf(spec, install, path.Clean(ienv.vals["DEST_DIR"])); !ok || hp != "/opt/cni/bin" {
			add("init container %s: DEST_DIR %s is not the host's /opt/cni/bin (a hostPath mount), it is %q", install.Name, ienv.vals["DEST_DIR"], hp)
		}
		// CNI configuration files (the chart's cni.files): CONF_FILES from the ConfigMap
		// mounted at CONF_SRC, into the host's CNI configuration directory at CONF_DIR.
		var confFiles map[string]string
		if confDir, ok := ienv.vals["CONF_DIR"]; ok {
			if hp, ok := deployHostPathOf(spec, install, path.Clean(confDir)); !ok || hp != "/etc/cni/net.d" {
				add("init container %s: CONF_DIR %s is not the host's /etc/cni/net.d (a hostPath mount), it is %q", install.Name, confDir, hp)
			}
			confFiles = map[string]string{}
			_, vol, _ := deployMountFor(spec, install, path.Clean(ienv.vals["CONF_SRC"]))
			var cm *corev1.ConfigMap
			if vol != nil && vol.ConfigMap != nil {
				cm = d.configMap(ns, vol.ConfigMap.Name)
			}
			if cm == nil {
				add("init container %s: CONF_SRC %s is not a volume of a ConfigMap among the manifests", install.Name, ienv.vals["CONF_SRC"])
			}
			for _, name := range strings.Fields(ienv.vals["CONF_FILES"]) {
				if cm != nil {
					if data, ok := cm.Data[name]; !ok {
						add("init container %s: CONF_FILES names %s, which ConfigMap %s does not hold", install.Name, name, cm.Name)
					} else {
						confFiles[name] = data
					}
				}
			}
		}
		probs = append(probs, deployCheckInstall(t, install, ienv, confFiles)...)
	}
	probs = append(probs, deployCheckDockerfile(dockerfile, goVersion, []string{agent.Command[0], pluginSrc, "/usr/local/bin/leaseholdctl"})...)
	return hostSocket, probs
}

// deployCheckNAD: the example's CNI configuration is one leasehold's own parser accepts,
// macvlan, dual-stack, and talks to the DaemonSet's socket.
func deployCheckNAD(nad deployNAD, hostSocket string) []string {
	var probs []string
	add := func(format string, args ...any) {
		probs = append(probs, fmt.Sprintf("NetworkAttachmentDefinition %s: ", nad.Metadata.Name)+fmt.Sprintf(format, args...))
	}
	if nad.Metadata.Name == "" {
		add("no metadata.name")
	}
	cfgs, p := deployCheckCNIConfig("NetworkAttachmentDefinition "+nad.Metadata.Name+": spec.config", nad.Spec.Config, hostSocket)
	probs = append(probs, p...)
	var top struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal([]byte(nad.Spec.Config), &top); err == nil && top.Type != "macvlan" {
		add("spec.config type is %q, want macvlan", top.Type)
	}
	for _, cfg := range cfgs {
		var v4, v6 bool
		for _, set := range cfg.IPAM.Ranges {
			if len(set) > 0 {
				v4 = v4 || set[0].Subnet.Addr().Is4()
				v6 = v6 || set[0].Subnet.Addr().Is6()
			}
		}
		if !v4 || !v6 {
			add("spec.config is not dual-stack (IPv4 range set: %v, IPv6 range set: %v)", v4, v6)
		}
	}
	return probs
}

// deployCheckCNIConfig: a CNI configuration, of one plugin or a list of them ("plugins"), in
// which at least one plugin has ipam type leasehold, each such plugin's configuration (with
// the list's name and cniVersion, as the runtime passes it) passes leasehold's own parser,
// and its socket is the one the DaemonSet's agent serves. It returns the parsed
// configurations.
func deployCheckCNIConfig(where, config, hostSocket string) ([]*cniplugin.Config, []string) {
	var probs []string
	add := func(format string, args ...any) { probs = append(probs, where+" "+fmt.Sprintf(format, args...)) }
	var top map[string]json.RawMessage
	if err := json.Unmarshal([]byte(config), &top); err != nil {
		add("is not a JSON object: %v", err)
		return nil, probs
	}
	plugins := []json.RawMessage{json.RawMessage(config)}
	if list, ok := top["plugins"]; ok {
		plugins = nil
		if err := json.Unmarshal(list, &plugins); err != nil {
			add("plugins is not a list: %v", err)
			return nil, probs
		}
	}
	var cfgs []*cniplugin.Config
	var ipamTypes []string
	for i, raw := range plugins {
		var plugin map[string]json.RawMessage
		var ipam struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(raw, &plugin); err != nil {
			add("plugin %d: %v", i, err)
			continue
		}
		if err := json.Unmarshal(plugin["ipam"], &ipam); plugin["ipam"] == nil || err != nil {
			continue
		}
		if ipamTypes = append(ipamTypes, ipam.Type); ipam.Type != "leasehold" {
			continue
		}
		for _, k := range []string{"name", "cniVersion"} {
			if v, ok := top[k]; ok {
				plugin[k] = v
			}
		}
		conf, _ := json.Marshal(plugin)
		cfg, err := cniplugin.ParseConfig(conf, "", "ctr", "eth0", "/var/run/netns/x")
		if err != nil {
			add("is refused by cniplugin.ParseConfig: %v", err)
			continue
		}
		if cfg.IPAM.Socket != hostSocket {
			add("ipam.socket is %q, but the DaemonSet's agent serves %q", cfg.IPAM.Socket, hostSocket)
		}
		cfgs = append(cfgs, cfg)
	}
	if !slices.Contains(ipamTypes, "leasehold") {
		add("has no plugin whose ipam.type is leasehold (found %q), want leasehold", ipamTypes)
	}
	return cfgs, probs
}
