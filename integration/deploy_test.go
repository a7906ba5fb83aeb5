package integration

// Tests of deploy/: every Kubernetes manifest decodes strictly into the API types (a typo
// fails here, not on a cluster), the DaemonSet, ConfigMap, Secret, Dockerfile, systemd unit
// and Multus example agree with each other and with leaseholdd's real flags, the plugin
// install is atomic, and the etcd scripts do what deploy/README.md says. Each check is a
// function returning the problems it finds; the *CatchMistakes tests feed it broken inputs
// to show that it can fail.

import (
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

const (
	deployDir     = "../deploy"
	deployKubeDir = "../deploy/kubernetes"
)

// ---------------------------------------------------------------------------------------
// The tests

// TestDeployManifests decodes every manifest under deploy/kubernetes with the Kubernetes API
// types and checks the DaemonSet against the ConfigMap, the Secret template, leaseholdd's
// flags, the Dockerfile and the Multus example.
func TestDeployManifests(t *testing.T) {
	d := deployLoad(t, deployKubeDir)
	flags := deployAgentFlags(t)
	hostSocket, probs := deployCheck(t, d, flags, deployReadFile(t, filepath.Join(deployDir, "Dockerfile")), deployGoVersion(t))
	for _, nad := range d.NADs {
		probs = append(probs, deployCheckNAD(nad, hostSocket)...)
	}
	for _, p := range probs {
		t.Error(p)
	}
}

// TestDeployDecodingIsStrict shows the decoder refusing what an API server would refuse.
func TestDeployDecodingIsStrict(t *testing.T) {
	const good = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\ndata:\n  A: \"1\"\n"
	if err := deployAddDoc(&deployment{}, []byte(good)); err != nil {
		t.Fatalf("a valid ConfigMap is refused: %v", err)
	}
	for name, doc := range map[string]string{
		"unknown field":              "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\ndatta:\n  A: \"1\"\n",
		"field in the wrong case":    "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\nspec:\n  template:\n    spec:\n      hostnetwork: true\n",
		"duplicate key":              "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n  name: y\n",
		"unknown kind":               "apiVersion: v1\nkind: ConfigMapp\nmetadata:\n  name: x\n",
		"wrong apiVersion":           "apiVersion: apps/v1beta2\nkind: DaemonSet\nmetadata:\n  name: x\n",
		"unquoted boolean in data":   "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\ndata:\n  A: true\n",
		"wrong type":                 "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\nspec:\n  template:\n    spec:\n      hostNetwork: \"yes\"\n",
		"NAD with an unknown field":  "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata:\n  name: x\nspec:\n  confg: \"{}\"\n",
		"nested unknown field":       "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\nspec:\n  template:\n    spec:\n      containers:\n      - name: a\n        imagePullPolicy: Always\n        volumeMount: []\n",
		"unknown field in metadata":  "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n  label: {}\n",
		"misspelt probe handler key": "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\nspec:\n  template:\n    spec:\n      containers:\n      - name: a\n        livenessProbe:\n          httpget: {path: /healthz}\n",
	} {
		if err := deployAddDoc(&deployment{}, []byte(doc)); err == nil {
			t.Errorf("%s: decoded without error:\n%s", name, doc)
		}
	}
	docs := deploySplitYAML([]byte("# only a comment\n---\na: 1\n--- # second\nb: 2\n---\n"))
	if len(docs) != 2 {
		t.Errorf("splitting found %d documents, want 2", len(docs))
	}
}

// TestDeployChecksCatchMistakes breaks the real manifests one way at a time and expects
// the check to name the break.
func TestDeployChecksCatchMistakes(t *testing.T) {
	base := deployLoad(t, deployKubeDir)
	flags := deployAgentFlags(t)
	dockerfile := deployReadFile(t, filepath.Join(deployDir, "Dockerfile"))
	goVersion := deployGoVersion(t)
	if _, probs := deployCheck(t, base, flags, dockerfile, goVersion); len(probs) > 0 {
		t.Fatalf("the real manifests already have problems: %v", probs)
	}
	agentOf := func(d *deployment) *corev1.Container {
		for i, c := range d.DaemonSets[0].Spec.Template.Spec.Containers {
			if path.Base(c.Command[0]) == "leaseholdd" {
				return &d.DaemonSets[0].Spec.Template.Spec.Containers[i]
			}
		}
		t.Fatal("no agent container")
		return nil
	}
	setArg := func(c *corev1.Container, flag, value string) {
		for i, a := range c.Args {
			if strings.HasPrefix(a, "--"+flag+"=") {
				c.Args[i] = "--" + flag + "=" + value
				return
			}
		}
		t.Fatalf("no --%s in the agent's args", flag)
	}
	mount := func(c *corev1.Container, mountPath string) *corev1.VolumeMount {
		for i := range c.VolumeMounts {
			if c.VolumeMounts[i].MountPath == mountPath {
				return &c.VolumeMounts[i]
			}
		}
		t.Fatalf("no mount at %s", mountPath)
		return nil
	}
	cases := []struct {
		name   string
		break_ func(d *deployment)
		want   string
	}{
		{"no host network", func(d *deployment) { d.DaemonSets[0].Spec.Template.Spec.HostNetwork = false }, "hostNetwork"},
		{"default dnsPolicy", func(d *deployment) { d.DaemonSets[0].Spec.Template.Spec.DNSPolicy = corev1.DNSClusterFirst }, "dnsPolicy"},
		{"no priority class", func(d *deployment) { d.DaemonSets[0].Spec.Template.Spec.PriorityClassName = "" }, "priorityClassName"},
		{"tolerates one taint only", func(d *deployment) {
			d.DaemonSets[0].Spec.Template.Spec.Tolerations = []corev1.Toleration{{Key: "node.kubernetes.io/not-ready", Operator: corev1.TolerationOpExists}}
		}, "every taint"},
		{"maxUnavailable 2", func(d *deployment) {
			v := intstr.FromInt32(2)
			d.DaemonSets[0].Spec.UpdateStrategy.RollingUpdate.MaxUnavailable = &v
		}, "maxUnavailable 1"},
		{"maxSurge 1", func(d *deployment) {
			v := intstr.FromInt32(1)
			d.DaemonSets[0].Spec.UpdateStrategy.RollingUpdate.MaxSurge = &v
		}, "two agents"},
		{"--node from a ConfigMap", func(d *deployment) { setArg(agentOf(d), "node", "$(CLUSTER)") }, "spec.nodeName"},
		{"a node label without a value", func(d *deployment) { setArg(agentOf(d), "node-label", "zone=a,rack") }, `"rack" is not KEY=VALUE`},
		{"a flag leaseholdd does not have", func(d *deployment) {
			a := agentOf(d)
			a.Args = append(a.Args, "--lease-tll=90s")
		}, "no flag --lease-tll"},
		{"a flag given twice", func(d *deployment) {
			a := agentOf(d)
			a.Args = append(a.Args, "--log-level=debug")
		}, "given twice"},
		{"a flag and its value as two arguments", func(d *deployment) {
			a := agentOf(d)
			a.Args = append(a.Args, "--quarantine", "30s")
		}, "--flag=value"},
		{"a ConfigMap key missing", func(d *deployment) { delete(d.ConfigMaps[0].Data, "LEASE_TTL") }, "$(LEASE_TTL)"},
		{"a ConfigMap key nobody uses", func(d *deployment) { d.ConfigMaps[0].Data["LEASE_TIME"] = "90s" }, "LEASE_TIME is never used"},
		{"a duration without unit", func(d *deployment) { d.ConfigMaps[0].Data["LEASE_TTL"] = "90" }, "not a valid duration"},
		{"a boolean that is not one", func(d *deployment) { d.ConfigMaps[0].Data["PUBLISH_HOST_ADDRESSES"] = "on" }, "not a valid bool"},
		{"an empty integer", func(d *deployment) { d.ConfigMaps[0].Data["SPARE_LEASES"] = "" }, "not a valid int"},
		{"a cluster ID with a slash", func(d *deployment) { d.ConfigMaps[0].Data["CLUSTER"] = "a/b" }, "--cluster"},
		{"http endpoint with TLS files", func(d *deployment) { d.ConfigMaps[0].Data["ETCD_ENDPOINTS"] = "http://etcd:2379" }, "https with TLS files"},
		{"a password in the ConfigMap", func(d *deployment) { d.ConfigMaps[0].Data["ETCD_PASSWORD"] = "x" }, "credentials belong in the Secret"},
		{"the password as a literal", func(d *deployment) {
			a := agentOf(d)
			for i := range a.Env {
				if a.Env[i].Name == "LEASEHOLD_ETCD_PASSWORD" {
					a.Env[i].ValueFrom, a.Env[i].Value = nil, "hunter2"
				}
			}
		}, "must come from a Secret"},
		{"a TLS file outside the Secret", func(d *deployment) { d.ConfigMaps[0].Data["ETCD_CACERT"] = "/etc/ssl/ca.crt" }, "not in a volume mounted from a Secret"},
		{"a TLS file the Secret does not have", func(d *deployment) { d.ConfigMaps[0].Data["ETCD_KEY"] = "/etc/leasehold/etcd/client.key" }, "projects no item"},
		{"the Secret without the key", func(d *deployment) { delete(d.Secrets[0].StringData, "tls.key") }, "has no key \"tls.key\""},
		{"the Secret volume writable", func(d *deployment) { mount(agentOf(d), "/etc/leasehold/etcd").ReadOnly = false }, "not mounted readOnly"},
		{"the socket outside a hostPath", func(d *deployment) { setArg(agentOf(d), "socket", "/tmp/leaseholdd.sock") }, "socket directory"},
		{"the journal outside a hostPath", func(d *deployment) { setArg(agentOf(d), "state-dir", "/tmp/state") }, "--state-dir"},
		{"netns without propagation", func(d *deployment) { mount(agentOf(d), "/var/run/netns").MountPropagation = nil }, "HostToContainer"},
		{"netns at another path", func(d *deployment) { mount(agentOf(d), "/var/run/netns").MountPath = "/host/netns" }, "/var/run/netns"},
		{"no machine ID", func(d *deployment) { mount(agentOf(d), "/etc/machine-id").MountPath = "/host/machine-id" }, "machine-id"},
		{"liveness on the wrong path", func(d *deployment) { agentOf(d).LivenessProbe.HTTPGet.Path = "/readyz" }, "liveness probe path"},
		{"readiness on the wrong path", func(d *deployment) { agentOf(d).ReadinessProbe.HTTPGet.Path = "/healthz" }, "readiness probe path"},
		{"no readiness probe", func(d *deployment) { agentOf(d).ReadinessProbe = nil }, "no readiness probe"},
		{"probe on another port", func(d *deployment) { d.ConfigMaps[0].Data["METRICS_ADDR"] = "127.0.0.1:9616" }, "probe port"},
		{"probe on the node address", func(d *deployment) { agentOf(d).LivenessProbe.HTTPGet.Host = "" }, "listens on 127.0.0.1 only"},
		{"metrics on one node's address", func(d *deployment) { d.ConfigMaps[0].Data["METRICS_ADDR"] = "10.0.0.5:9615" }, "one node's address"},
		{"no memory limit", func(d *deployment) { delete(agentOf(d).Resources.Limits, corev1.ResourceMemory) }, "no memory request and limit"},
		{"privileged", func(d *deployment) { v := true; agentOf(d).SecurityContext.Privileged = &v }, "privileged must be set to false"},
		{"no SYS_ADMIN", func(d *deployment) { agentOf(d).SecurityContext.Capabilities.Add = []corev1.Capability{"NET_ADMIN"} }, "SYS_ADMIN is not added"},
		{"non-root", func(d *deployment) { v := int64(1000); agentOf(d).SecurityContext.RunAsUser = &v }, "does not run as root"},
		{"no escalation with SYS_ADMIN", func(d *deployment) {
			v := false
			agentOf(d).SecurityContext.AllowPrivilegeEscalation = &v
		}, "allowPrivilegeEscalation"},
		{"installer from another image", func(d *deployment) { d.DaemonSets[0].Spec.Template.Spec.InitContainers[0].Image = "other:1" }, "differs from the agent's"},
		{"installer into the wrong host dir", func(d *deployment) {
			for i := range d.DaemonSets[0].Spec.Template.Spec.Volumes {
				if v := &d.DaemonSets[0].Spec.Template.Spec.Volumes[i]; v.HostPath != nil && v.HostPath.Path == "/opt/cni/bin" {
					v.HostPath.Path = "/opt/cni"
				}
			}
		}, "/opt/cni/bin"},
		{"installer copies in place", func(d *deployment) {
			ic := &d.DaemonSets[0].Spec.Template.Spec.InitContainers[0]
			ic.Command = []string{"/bin/sh", "-c", `cp "$SRC" "$DEST_DIR/leasehold" && chmod 0755 "$DEST_DIR/leasehold"`}
		}, "same inode"},
		{"installer leaves its temporary file", func(d *deployment) {
			ic := &d.DaemonSets[0].Spec.Template.Spec.InitContainers[0]
			ic.Command = []string{"/bin/sh", "-c", `cp "$SRC" "$DEST_DIR/.tmp" && cp "$DEST_DIR/.tmp" "$DEST_DIR/x" && chmod 0755 "$DEST_DIR/x" && mv "$DEST_DIR/x" "$DEST_DIR/leasehold"`}
		}, "want only leasehold"},
		{"the plugin source not in the image", func(d *deployment) {
			ic := &d.DaemonSets[0].Spec.Template.Spec.InitContainers[0]
			for i := range ic.Env {
				if ic.Env[i].Name == "SRC" {
					ic.Env[i].Value = "/usr/bin/leasehold"
				}
			}
		}, "the image has no /usr/bin/leasehold"},
		{"unknown service account", func(d *deployment) { d.DaemonSets[0].Spec.Template.Spec.ServiceAccountName = "default2" }, "serviceAccountName"},
		{"a mount without volume", func(d *deployment) { mount(agentOf(d), "/run/leasehold").Name = "sockets" }, "names no volume"},
		{"selector not matching", func(d *deployment) { d.DaemonSets[0].Spec.Selector.MatchLabels["app.kubernetes.io/name"] = "x" }, "does not match"},
		{"ConfigMap in another namespace", func(d *deployment) { d.ConfigMaps[0].Namespace = "kube-system" }, "namespace"},
		{"no Multus example", func(d *deployment) { d.NADs = nil }, "no NetworkAttachmentDefinition"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := base.clone()
			tc.break_(d)
			_, probs := deployCheck(t, d, flags, dockerfile, goVersion)
			if !slices.ContainsFunc(probs, func(p string) bool { return strings.Contains(p, tc.want) }) {
				t.Errorf("no problem mentioning %q; got %q", tc.want, probs)
			}
		})
	}

	// The Dockerfile checks.
	for name, mutate := range map[string]func(string) string{
		"another Go":    func(s string) string { return strings.Replace(s, "FROM golang:"+goVersion, "FROM golang:1.20", 1) },
		"no make build": func(s string) string { return strings.ReplaceAll(s, "make build", "go build ./...") },
		"cgo on":        func(s string) string { return strings.ReplaceAll(s, "CGO_ENABLED=0", "CGO_ENABLED=1") },
		"no leaseholdctl": func(s string) string {
			return strings.ReplaceAll(s, "/usr/local/bin/leaseholdctl", "/usr/bin/leaseholdctl")
		},
		"a non-root user": func(s string) string { return s + "\nUSER 65532\n" },
		"single stage":    func(s string) string { return regexp.MustCompile(`(?m)^FROM debian.*$`).ReplaceAllString(s, "") },
		"the toolchain image": func(s string) string {
			return regexp.MustCompile(`(?m)^FROM debian.*$`).ReplaceAllString(s, "FROM golang:1.26")
		},
	} {
		if probs := deployCheckDockerfile(mutate(dockerfile), goVersion, []string{"/usr/local/bin/leaseholdd", "/opt/leasehold/bin/leasehold", "/usr/local/bin/leaseholdctl"}); len(probs) == 0 {
			t.Errorf("Dockerfile with %s: no problem found", name)
		}
	}

	// The Multus example checks.
	hostSocket, _ := deployCheck(t, base, flags, dockerfile, goVersion)
	nad := base.NADs[0]
	// Each case is a list of replacements (from, to, from, to, ...) and the problem it must cause.
	for name, tc := range map[string]struct {
		edits []string
		want  string
	}{
		"a typo inside ipam":   {[]string{`"ranges"`, `"rangess"`}, "ParseConfig"},
		"another socket":       {[]string{`/run/leasehold/leaseholdd.sock`, `/run/leasehold/other.sock`}, "ipam.socket"},
		"host-local, not ours": {[]string{`"type": "leasehold"`, `"type": "host-local"`}, "want leasehold"},
		"not macvlan":          {[]string{`"type": "macvlan"`, `"type": "ipvlan"`}, "want macvlan"},
		"no cniVersion":        {[]string{`"cniVersion": "1.0.0",`, ``}, "ParseConfig"},
		"single stack": {[]string{
			`[{"subnet": "fd10::/64", "rangeStart": "fd10::1:0", "rangeEnd": "fd10::1:ffff", "gateway": "fd10::1"}]`, `[{"subnet": "10.11.0.0/16"}]`,
			`{"dst": "fd20::/48", "gw": "fd10::1"}`, `{"dst": "10.30.0.0/16", "gw": "10.10.0.1"}`,
		}, "dual-stack"},
	} {
		broken := nad
		for i := 0; i+1 < len(tc.edits); i += 2 {
			if !strings.Contains(broken.Spec.Config, tc.edits[i]) {
				t.Errorf("%s: the example no longer contains %s; update this case", name, tc.edits[i])
			}
			broken.Spec.Config = strings.Replace(broken.Spec.Config, tc.edits[i], tc.edits[i+1], 1)
		}
		probs := deployCheckNAD(broken, hostSocket)
		if !slices.ContainsFunc(probs, func(p string) bool { return strings.Contains(p, tc.want) }) {
			t.Errorf("NAD with %s: no problem mentioning %q; got %q", name, tc.want, probs)
		}
	}
}
