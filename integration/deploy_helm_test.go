package integration

// Tests of the Helm chart deploy/helm/leasehold, rendered by the real Helm (bin/helm, built
// by `make tools` from integration/helmtool) as `helm template` renders it for an install:
// every object decodes strictly, each rendering passes the checks the plain manifests pass
// (deployCheck) but for the deviations its values ask for, the chart with values matching
// deploy/kubernetes renders those very objects, invalid values fail with a message naming
// the fix, and the chart's copy of the Prometheus rules is the rule file.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const (
	helmChartDir  = "../deploy/helm/leasehold"
	helmRulesFile = "../deploy/monitoring/leasehold-rules.yaml"
	helmRulesCopy = helmChartDir + "/files/leasehold-rules.yaml"
	// What every rendering needs: the three values without a default.
	helmRequired = `
image: {repository: registry.example.com/leasehold/leasehold}
cluster: cluster-a
etcd: {endpoints: [https://etcd-1.example.internal:2379, https://etcd-2.example.internal:2379]}
`
)

// helmOwnLabels are the labels the chart adds for Helm's bookkeeping, which the plain
// manifests do not carry.
var helmOwnLabels = []string{"helm.sh/chart", "app.kubernetes.io/instance", "app.kubernetes.io/version", "app.kubernetes.io/managed-by"}

// helmTemplate runs `helm template` on the chart into namespace leasehold, with the values of
// each YAML document given (later ones override earlier ones, as repeated -f do). It returns
// Helm's output, or an error holding what Helm printed on stderr.
func helmTemplate(t *testing.T, values ...string) (string, error) {
	t.Helper()
	// Not t.TempDir(): its name comes from the test's, and Helm splits --values on commas.
	dir, err := os.MkdirTemp("", "leasehold-helm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	helm := toolBin(t, "helm")
	args := []string{"template", "leasehold", helmChartDir, "--namespace", "leasehold"}
	for i, v := range values {
		f := filepath.Join(dir, "values-"+string(rune('a'+i))+".yaml")
		if err := os.WriteFile(f, []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
		args = append(args, "--values", f)
	}
	cmd := helmCommand(helm, dir, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", errors.New(strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// helmCommand runs Helm with its cache, configuration and data directories under dir, out
// of $HOME.
func helmCommand(helm, dir string, args ...string) *exec.Cmd {
	cmd := exec.Command(helm, args...)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+dir+"/cache", "HELM_CONFIG_HOME="+dir+"/config", "HELM_DATA_HOME="+dir+"/data")
	return cmd
}

// helmRender renders the chart and decodes every object strictly.
func helmRender(t *testing.T, values ...string) *deployment {
	t.Helper()
	out, err := helmTemplate(t, values...)
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	d := &deployment{}
	for i, doc := range deploySplitYAML([]byte(out)) {
		if err := deployAddDoc(d, doc); err != nil {
			t.Errorf("rendered document %d: %v\n%s", i+1, err, doc)
		}
	}
	if len(d.DaemonSets) == 0 {
		t.Fatalf("the rendering holds no DaemonSet:\n%s", out)
	}
	return d
}

// helmWithUserObjects adds what a user makes outside the chart, as deploy/README.md says:
// the namespace (deploy/kubernetes/00-namespace.yaml) and the etcd Secret (its template,
// under the name the chart refers to).
func helmWithUserObjects(t *testing.T, d *deployment, secretName string) *deployment {
	t.Helper()
	manifests := deployLoad(t, deployKubeDir)
	d = d.clone()
	d.Namespaces = append(d.Namespaces, manifests.Namespaces...)
	s := *manifests.Secrets[0].DeepCopy()
	s.Name = secretName
	d.Secrets = append(d.Secrets, s)
	return d
}

// helmAgentArgs returns the agent's arguments as the kubelet expands them: flag -> value.
func helmAgentArgs(t *testing.T, d *deployment) map[string]string {
	t.Helper()
	agent := helmContainer(t, d, "leaseholdd")
	env, probs := d.containerEnv(d.DaemonSets[0].Namespace, agent)
	var expanded []string
	for _, a := range agent.Args {
		e, p := env.expand("agent", a)
		probs = append(probs, p...)
		expanded = append(expanded, e)
	}
	vals, p := deployCheckFlagArgs("agent", expanded, deployAgentFlags(t))
	for _, p := range append(probs, p...) {
		t.Error(p)
	}
	return vals
}

func helmContainer(t *testing.T, d *deployment, name string) *corev1.Container {
	t.Helper()
	spec := &d.DaemonSets[0].Spec.Template.Spec
	for _, cs := range [][]corev1.Container{spec.Containers, spec.InitContainers} {
		for i := range cs {
			if cs[i].Name == name {
				return &cs[i]
			}
		}
	}
	t.Fatalf("the DaemonSet has no container %s", name)
	return nil
}

// helmRuleGroups decodes a Prometheus rule file strictly.
func helmRuleGroups(t *testing.T, file string) []deployRuleGroup {
	t.Helper()
	var rf struct {
		Groups []deployRuleGroup `json:"groups"`
	}
	if err := deployDecodeStrict([]byte(deployReadFile(t, file)), &rf); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	if len(rf.Groups) == 0 {
		t.Fatalf("%s has no rule group", file)
	}
	return rf.Groups
}

// helmCheckMonitoring: with a ServiceMonitor, a headless Service on the agents' metrics port
// that it selects, an agent listening beyond loopback, and a PrometheusRule holding the rule
// file's groups; without one, none of them.
func helmCheckMonitoring(d *deployment, groups []deployRuleGroup) []string {
	var probs []string
	add := func(format string, args ...any) { probs = append(probs, fmt.Sprintf(format, args...)) }
	if len(d.ServiceMonitors) == 0 {
		if len(d.Services)+len(d.PrometheusRules) > 0 {
			add("no ServiceMonitor, but %d Services and %d PrometheusRules", len(d.Services), len(d.PrometheusRules))
		}
		return probs
	}
	if len(d.ServiceMonitors) != 1 || len(d.Services) != 1 || len(d.PrometheusRules) != 1 {
		add("want one ServiceMonitor, Service and PrometheusRule, found %d, %d, %d", len(d.ServiceMonitors), len(d.Services), len(d.PrometheusRules))
		return probs
	}
	ds, svc, sm := &d.DaemonSets[0], &d.Services[0], &d.ServiceMonitors[0]
	var agent *corev1.Container
	for i, c := range ds.Spec.Template.Spec.Containers {
		if path.Base(c.Command[0]) == "leaseholdd" {
			agent = &ds.Spec.Template.Spec.Containers[i]
		}
	}
	if agent == nil {
		return append(probs, "DaemonSet: no container runs leaseholdd")
	}
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		add("Service %s: clusterIP %q, want None (headless: one endpoint per node's agent)", svc.Name, svc.Spec.ClusterIP)
	}
	for k, v := range svc.Spec.Selector {
		if ds.Spec.Template.Labels[k] != v {
			add("Service %s: selector %s=%s does not select the agent's pods %v", svc.Name, k, v, ds.Spec.Template.Labels)
		}
	}
	if len(svc.Spec.Selector) == 0 {
		add("Service %s: no selector", svc.Name)
	}
	var svcPort *corev1.ServicePort
	for i, p := range svc.Spec.Ports {
		if p.TargetPort.StrVal != "" && slices.ContainsFunc(agent.Ports, func(cp corev1.ContainerPort) bool {
			return cp.Name == p.TargetPort.StrVal && cp.ContainerPort == p.Port
		}) {
			svcPort = &svc.Spec.Ports[i]
		}
	}
	if svcPort == nil {
		add("Service %s: no port whose targetPort names the agent's metrics port %v", svc.Name, agent.Ports)
	}
	for k, v := range sm.Spec.Selector.MatchLabels {
		if svc.Labels[k] != v {
			add("ServiceMonitor %s: selector %s=%s does not select Service %s (labels %v)", sm.Metadata.Name, k, v, svc.Name, svc.Labels)
		}
	}
	if !slices.Contains(sm.Spec.NamespaceSelector.MatchNames, svc.Namespace) {
		add("ServiceMonitor %s: namespaceSelector %v leaves out the Service's namespace %s", sm.Metadata.Name, sm.Spec.NamespaceSelector.MatchNames, svc.Namespace)
	}
	if len(sm.Spec.Endpoints) != 1 {
		add("ServiceMonitor %s: %d endpoints, want 1", sm.Metadata.Name, len(sm.Spec.Endpoints))
	} else {
		ep := sm.Spec.Endpoints[0]
		if svcPort == nil || ep.Port != svcPort.Name {
			add("ServiceMonitor %s: endpoint port %q is not the Service's metrics port", sm.Metadata.Name, ep.Port)
		}
		if ep.Path != "/metrics" {
			add("ServiceMonitor %s: path %q, want /metrics", sm.Metadata.Name, ep.Path)
		}
		iv, err1 := time.ParseDuration(ep.Interval)
		to, err2 := time.ParseDuration(ep.ScrapeTimeout)
		if err1 != nil || err2 != nil || to > iv {
			add("ServiceMonitor %s: interval %q and scrapeTimeout %q: not durations, or the timeout exceeds the interval", sm.Metadata.Name, ep.Interval, ep.ScrapeTimeout)
		}
	}
	if cm := d.configMap(ds.Namespace, "leaseholdd-config"); cm == nil || !strings.HasPrefix(cm.Data["METRICS_ADDR"], "0.0.0.0:") && !strings.HasPrefix(cm.Data["METRICS_ADDR"], "[::]:") {
		add("a ServiceMonitor, but the agent's METRICS_ADDR is not 0.0.0.0:PORT: Prometheus could not scrape it")
	}
	if diff := cmp.Diff(groups, d.PrometheusRules[0].Spec.Groups); diff != "" {
		add("PrometheusRule %s: spec.groups differ from %s (-file +rule):\n%s", d.PrometheusRules[0].Metadata.Name, helmRulesFile, diff)
	}
	return probs
}

// helmCheckCNIConfigs runs deployCheckCNIConfig on every CNI configuration the chart installs:
// the files of the ConfigMap leasehold-cni-files and the NetworkAttachmentDefinitions.
func helmCheckCNIConfigs(d *deployment, hostSocket string) []string {
	var probs []string
	if cm := d.configMap(d.DaemonSets[0].Namespace, "leasehold-cni-files"); cm != nil {
		for name, config := range cm.Data {
			_, p := deployCheckCNIConfig("cni file "+name+":", config, hostSocket)
			probs = append(probs, p...)
		}
	}
	for _, nad := range d.NADs {
		_, p := deployCheckCNIConfig("NetworkAttachmentDefinition "+nad.Metadata.Name+": spec.config", nad.Spec.Config, hostSocket)
		probs = append(probs, p...)
	}
	return probs
}

// TestHelmChart renders the chart for several sets of values. Each rendering decodes
// strictly and passes the manifests' checks (deployCheck: flags that exist and parse,
// mounts, the Secret, probes, the plugin install run for real, ...) but for the deviations
// its values ask for, each of which must show; then the case checks what its values change.
func TestHelmChart(t *testing.T) {
	flags := deployAgentFlags(t)
	dockerfile := deployReadFile(t, filepath.Join(deployDir, "Dockerfile"))
	goVersion := deployGoVersion(t)
	groups := helmRuleGroups(t, helmRulesFile)
	example := deployLoad(t, filepath.Join(deployKubeDir, "examples")).NADs[0]
	exampleValue, err := json.Marshal(map[string]any{"cni": map[string]any{"networkAttachments": []any{
		map[string]any{"name": example.Metadata.Name, "namespace": example.Metadata.Namespace, "config": example.Spec.Config},
		map[string]any{"name": "ipvlan-shared", "config": `{"cniVersion": "1.0.0", "name": "ipvlan-shared", "type": "ipvlan", "master": "eth1", "ipam": {"type": "leasehold", "pool": "shared"}}`},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	noNAD := "no NetworkAttachmentDefinition among the manifests"

	cases := []struct {
		name       string
		values     []string // after helmRequired, each as another --values file
		secret     string   // the Secret the DaemonSet refers to
		deviations []string // the problems deployCheck must find, and the only ones
		check      func(t *testing.T, d *deployment, args map[string]string)
	}{{
		// The install deploy/README.md shows: only what has no default.
		name: "required values only", secret: "leasehold-etcd", deviations: []string{noNAD},
		check: func(t *testing.T, d *deployment, args map[string]string) {
			want := map[string]string{
				"cluster": "cluster-a", "etcd-endpoints": "https://etcd-1.example.internal:2379,https://etcd-2.example.internal:2379",
				"etcd-cacert": "/etc/leasehold/etcd/ca.crt", "etcd-cert": "/etc/leasehold/etcd/tls.crt", "etcd-key": "/etc/leasehold/etcd/tls.key",
				"metrics-addr": "127.0.0.1:9615", "lease-ttl": "90s", "socket": "/run/leasehold/leaseholdd.sock",
			}
			for f, v := range want {
				if args[f] != v {
					t.Errorf("--%s=%q, want %q", f, args[f], v)
				}
			}
			for _, c := range []string{"leaseholdd", "install-cni-plugin"} {
				if img := helmContainer(t, d, c).Image; img != "registry.example.com/leasehold/leasehold:0.1.0" {
					t.Errorf("container %s: image %s, want the repository at the chart's appVersion 0.1.0", c, img)
				}
			}
			if len(d.Services)+len(d.NADs) > 0 || d.configMap("leasehold", "leasehold-cni-files") != nil {
				t.Errorf("defaults render %d Services, %d NADs, a cni-files ConfigMap: %v; want none", len(d.Services), len(d.NADs), d.configMap("leasehold", "leasehold-cni-files") != nil)
			}
		},
	}, {
		name: "monitoring on", secret: "leasehold-etcd", deviations: []string{noNAD},
		values: []string{`monitoring: {enabled: true, labels: {release: kube-prometheus-stack}, serviceMonitor: {interval: 15s}}`},
		check: func(t *testing.T, d *deployment, args map[string]string) {
			if args["metrics-addr"] != "0.0.0.0:9615" {
				t.Errorf("--metrics-addr=%q, want 0.0.0.0:9615 so that Prometheus reaches it", args["metrics-addr"])
			}
			if len(d.ServiceMonitors) != 1 || len(d.PrometheusRules) != 1 {
				t.Fatalf("%d ServiceMonitors, %d PrometheusRules; want one each", len(d.ServiceMonitors), len(d.PrometheusRules))
			}
			for _, m := range []metav1.ObjectMeta{d.ServiceMonitors[0].Metadata, d.PrometheusRules[0].Metadata} {
				if m.Labels["release"] != "kube-prometheus-stack" {
					t.Errorf("%s: labels %v lack monitoring.labels release=kube-prometheus-stack", m.Name, m.Labels)
				}
			}
			if iv := d.ServiceMonitors[0].Spec.Endpoints[0].Interval; iv != "15s" {
				t.Errorf("ServiceMonitor interval %q, want 15s", iv)
			}
			if h := helmContainer(t, d, "leaseholdd").ReadinessProbe.HTTPGet.Host; h != "127.0.0.1" {
				t.Errorf("readiness probe host %q, want 127.0.0.1", h)
			}
		},
	}, {
		name: "etcd without TLS, with a password", secret: "etcd-creds", deviations: []string{noNAD},
		values: []string{`etcd: {endpoints: "http://etcd-1:2379,http://etcd-2:2379", tls: {enabled: false}, username: leasehold-cluster-a, secretName: etcd-creds}`},
		check: func(t *testing.T, d *deployment, args map[string]string) {
			for f, v := range map[string]string{"etcd-endpoints": "http://etcd-1:2379,http://etcd-2:2379", "etcd-cacert": "", "etcd-cert": "", "etcd-key": "", "etcd-username": "leasehold-cluster-a"} {
				if args[f] != v {
					t.Errorf("--%s=%q, want %q", f, args[f], v)
				}
			}
			spec := &d.DaemonSets[0].Spec.Template.Spec
			for _, v := range spec.Volumes {
				if v.Secret != nil {
					t.Errorf("volume %s mounts Secret %s without TLS", v.Name, v.Secret.SecretName)
				}
			}
			agent := helmContainer(t, d, "leaseholdd")
			if m, _, _ := deployMountFor(spec, agent, "/etc/leasehold/etcd"); m != nil {
				t.Errorf("mount %s at %s without TLS", m.Name, m.MountPath)
			}
			i := slices.IndexFunc(agent.Env, func(e corev1.EnvVar) bool { return e.Name == "LEASEHOLD_ETCD_PASSWORD" })
			if i < 0 || agent.Env[i].ValueFrom == nil || agent.Env[i].ValueFrom.SecretKeyRef == nil ||
				agent.Env[i].ValueFrom.SecretKeyRef.Name != "etcd-creds" || agent.Env[i].ValueFrom.SecretKeyRef.Key != "password" {
				t.Errorf("LEASEHOLD_ETCD_PASSWORD does not come from Secret etcd-creds key password: %+v", agent.Env)
			}
		},
	}, {
		// Two files installed on every node, two Multus networks: the example of
		// deploy/kubernetes/examples and one naming a pool made with leaseholdctl.
		name: "CNI files and networks", secret: "leasehold-etcd",
		values: []string{`
cni:
  files:
    - name: 10-leasehold.conflist
      config:
        cniVersion: 1.0.0
        name: pods
        plugins:
          - type: bridge
            bridge: cni0
            isGateway: true
            ipam: {type: leasehold, ranges: [[{subnet: 10.233.0.0/16}]]}
          - type: loopback
    - name: 20-macvlan.conf
      config: '{"cniVersion": "0.4.0", "name": "mv", "type": "macvlan", "master": "eth0", "ipam": {"type": "leasehold", "pool": "mv"}}'
`, string(exampleValue)},
		check: func(t *testing.T, d *deployment, args map[string]string) {
			cm := d.configMap("leasehold", "leasehold-cni-files")
			if cm == nil || len(cm.Data) != 2 || !strings.Contains(cm.Data["20-macvlan.conf"], `"pool": "mv"`) {
				t.Fatalf("ConfigMap leasehold-cni-files: %v, want the two files", cm)
			}
			var conflist struct {
				Plugins []struct{ Type string }
			}
			if err := json.Unmarshal([]byte(cm.Data["10-leasehold.conflist"]), &conflist); err != nil || len(conflist.Plugins) != 2 {
				t.Errorf("10-leasehold.conflist: %v, %+v; want bridge and loopback", err, conflist)
			}
			install := helmContainer(t, d, "install-cni-plugin")
			if i := slices.IndexFunc(install.Env, func(e corev1.EnvVar) bool { return e.Name == "CONF_FILES" }); i < 0 || install.Env[i].Value != "10-leasehold.conflist 20-macvlan.conf" {
				t.Errorf("init container env %+v: CONF_FILES does not list both files", install.Env)
			}
			if len(d.NADs) != 2 || d.NADs[0].Metadata.Namespace != "default" || d.NADs[1].Metadata.Namespace != "leasehold" {
				t.Errorf("NetworkAttachmentDefinitions %+v: want the example in default and ipvlan-shared in the release's namespace", d.NADs)
			}
			// A changed file restarts the agents, or the init container would never install it.
			sum := d.DaemonSets[0].Spec.Template.Annotations["checksum/cni-files"]
			other := helmRender(t, helmRequired, `cni: {files: [{name: 10-leasehold.conflist, config: {cniVersion: 1.0.0, name: pods, type: bridge, ipam: {type: leasehold, pool: pods}}}]}`)
			if sum == "" || other.DaemonSets[0].Spec.Template.Annotations["checksum/cni-files"] == sum {
				t.Errorf("pod template annotation checksum/cni-files %q does not change with the files", sum)
			}
		},
	}, {
		name: "custom image, resources, scheduling", secret: "leasehold-etcd",
		deviations: []string{noNAD, "every taint", "priorityClassName", "/opt/cni/bin"},
		values: []string{`
image: {repository: registry.internal/net/leasehold, tag: "0.2.0-rc.1", pullPolicy: Always}
imagePullSecrets: [{name: regcred}]
resources: {requests: {cpu: 100m, memory: 128Mi}, limits: {cpu: "2", memory: 512Mi}}
installerResources: {requests: {cpu: 5m, memory: 8Mi}, limits: {cpu: 50m, memory: 32Mi}}
tolerations: [{key: dedicated, operator: Equal, value: network, effect: NoSchedule}]
nodeSelector: {node-role.example.com/network: "true"}
priorityClassName: network-critical
cni: {binDir: /var/lib/rancher/k3s/data/current/bin}
`},
		check: func(t *testing.T, d *deployment, args map[string]string) {
			spec := &d.DaemonSets[0].Spec.Template.Spec
			agent, install := helmContainer(t, d, "leaseholdd"), helmContainer(t, d, "install-cni-plugin")
			for _, c := range []*corev1.Container{agent, install} {
				if c.Image != "registry.internal/net/leasehold:0.2.0-rc.1" || c.ImagePullPolicy != corev1.PullAlways {
					t.Errorf("container %s: image %s, pull policy %s", c.Name, c.Image, c.ImagePullPolicy)
				}
			}
			if l := agent.Resources.Limits[corev1.ResourceMemory]; l.String() != "512Mi" {
				t.Errorf("agent memory limit %s, want 512Mi", l.String())
			}
			if r := install.Resources.Requests[corev1.ResourceCPU]; r.String() != "5m" {
				t.Errorf("installer CPU request %s, want 5m", r.String())
			}
			if len(spec.Tolerations) != 1 || spec.Tolerations[0].Key != "dedicated" || spec.Tolerations[0].Effect != corev1.TaintEffectNoSchedule {
				t.Errorf("tolerations %+v", spec.Tolerations)
			}
			// Helm merges a map value with the default's.
			if !maps.Equal(spec.NodeSelector, map[string]string{"kubernetes.io/os": "linux", "node-role.example.com/network": "true"}) {
				t.Errorf("nodeSelector %v", spec.NodeSelector)
			}
			if len(spec.ImagePullSecrets) != 1 || spec.ImagePullSecrets[0].Name != "regcred" {
				t.Errorf("imagePullSecrets %v", spec.ImagePullSecrets)
			}
			if hp, ok := deployHostPathOf(spec, install, "/host/opt/cni/bin"); !ok || hp != "/var/lib/rancher/k3s/data/current/bin" {
				t.Errorf("the plugin goes to the host's %q, want cni.binDir", hp)
			}
		},
	}, {
		name: "agent flags and extra args", secret: "leasehold-etcd", deviations: []string{noNAD},
		values: []string{`
agent:
  leaseTTL: 2m
  quarantine: 0s
  publishHostAddresses: false
  spareLeases: 16
  logLevel: debug
  metricsAddr: 127.0.0.1:9700
  extraArgs: [--reuse-delay=30m, --claim-hold=1h, --block-idle=0s]
`},
		check: func(t *testing.T, d *deployment, args map[string]string) {
			for f, v := range map[string]string{"lease-ttl": "2m", "quarantine": "0s", "publish-host-addresses": "false", "spare-leases": "16",
				"log-level": "debug", "metrics-addr": "127.0.0.1:9700", "reuse-delay": "30m", "claim-hold": "1h", "block-idle": "0s"} {
				if args[f] != v {
					t.Errorf("--%s=%q, want %q", f, args[f], v)
				}
			}
			if p := helmContainer(t, d, "leaseholdd").Ports[0].ContainerPort; p != 9700 {
				t.Errorf("metrics containerPort %d, want 9700 (the probes use it)", p)
			}
			// The agent reads its flags at start: a change must roll the pods.
			defaults := helmRender(t, helmRequired)
			if a, b := d.DaemonSets[0].Spec.Template.Annotations["checksum/config"], defaults.DaemonSets[0].Spec.Template.Annotations["checksum/config"]; a == "" || a == b {
				t.Errorf("pod template annotation checksum/config %q does not change with the agent's flags", a)
			}
		},
	}, {
		// Node labels for selection rules: one --node-label from the ConfigMap's NODE_LABELS,
		// KEY=VALUE comma-separated, sorted; empty without any.
		name: "node labels", secret: "leasehold-etcd", deviations: []string{noNAD},
		values: []string{`
agent:
  nodeLabels: {topology.kubernetes.io/zone: zone-a, rack: 7}
`},
		check: func(t *testing.T, d *deployment, args map[string]string) {
			if got, want := args["node-label"], "rack=7,topology.kubernetes.io/zone=zone-a"; got != want {
				t.Errorf("--node-label=%q, want %q", got, want)
			}
			if got, ok := helmAgentArgs(t, helmWithUserObjects(t, helmRender(t, helmRequired), "leasehold-etcd"))["node-label"]; !ok || got != "" {
				t.Errorf("--node-label=%q (given: %v) without agent.nodeLabels; want it given empty (no labels)", got, ok)
			}
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := helmRender(t, append([]string{helmRequired}, tc.values...)...)
			full := helmWithUserObjects(t, d, tc.secret)
			hostSocket, probs := deployCheck(t, full, flags, dockerfile, goVersion)
			probs = append(probs, helmCheckCNIConfigs(full, hostSocket)...)
			probs = append(probs, helmCheckMonitoring(full, groups)...)
			for _, p := range probs {
				if !slices.ContainsFunc(tc.deviations, func(dev string) bool { return strings.Contains(p, dev) }) {
					t.Error(p)
				}
			}
			for _, dev := range tc.deviations {
				if !slices.ContainsFunc(probs, func(p string) bool { return strings.Contains(p, dev) }) {
					t.Errorf("the values should make deployCheck report %q; it did not (were they ignored?)", dev)
				}
			}
			tc.check(t, d, helmAgentArgs(t, full))
		})
	}
}

// TestHelmChartMatchesManifests renders the chart with the values deploy/kubernetes has
// (the image, CLUSTER and ETCD_ENDPOINTS, the Multus example) and nothing else, and wants
// the manifests' objects back, but for Helm's own labels: a change to one and not the other
// fails here. The manifests' Namespace and Secret template are not the chart's to make; the
// chart's pod template carries checksums of its configuration besides.
func TestHelmChartMatchesManifests(t *testing.T) {
	m := deployLoad(t, deployKubeDir)
	cm := m.configMap("leasehold", "leaseholdd-config")
	if cm == nil || len(m.DaemonSets) != 1 || len(m.NADs) != 1 {
		t.Fatal("deploy/kubernetes lacks the ConfigMap leaseholdd-config, the DaemonSet or the Multus example")
	}
	image := m.DaemonSets[0].Spec.Template.Spec.Containers[0].Image
	i := strings.LastIndex(image, ":")
	values, err := json.Marshal(map[string]any{
		"image":   map[string]any{"repository": image[:i], "tag": image[i+1:]},
		"cluster": cm.Data["CLUSTER"],
		"etcd":    map[string]any{"endpoints": strings.Split(cm.Data["ETCD_ENDPOINTS"], ",")},
		"cni": map[string]any{"networkAttachments": []any{map[string]any{
			"name": m.NADs[0].Metadata.Name, "namespace": m.NADs[0].Metadata.Namespace, "config": m.NADs[0].Spec.Config}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	c := helmRender(t, string(values))
	if len(c.Namespaces)+len(c.Secrets)+len(c.Services)+len(c.ServiceMonitors)+len(c.PrometheusRules) > 0 {
		t.Errorf("the chart renders %d Namespaces, %d Secrets, %d Services, %d ServiceMonitors, %d PrometheusRules; want none with these values",
			len(c.Namespaces), len(c.Secrets), len(c.Services), len(c.ServiceMonitors), len(c.PrometheusRules))
	}
	// kind/namespace/name -> the object as JSON, Helm's labels removed from the chart's.
	index := func(d *deployment, helm bool) map[string]any {
		objs := map[string]any{}
		put := func(kind string, meta *metav1.ObjectMeta, obj any) {
			if helm {
				for _, l := range helmOwnLabels {
					if _, ok := meta.Labels[l]; !ok {
						t.Errorf("%s %s: no label %s", kind, meta.Name, l)
					}
					delete(meta.Labels, l)
				}
			}
			b, err := json.Marshal(obj)
			if err != nil {
				t.Fatal(err)
			}
			var v any
			if err := json.Unmarshal(b, &v); err != nil {
				t.Fatal(err)
			}
			objs[kind+" "+meta.Namespace+"/"+meta.Name] = v
		}
		for i := range d.ServiceAccounts {
			put("ServiceAccount", &d.ServiceAccounts[i].ObjectMeta, &d.ServiceAccounts[i])
		}
		for i := range d.ConfigMaps {
			put("ConfigMap", &d.ConfigMaps[i].ObjectMeta, &d.ConfigMaps[i])
		}
		for i := range d.DaemonSets {
			if helm {
				// The checksums that make helm upgrade roll the agents when their flags change.
				tm := &d.DaemonSets[i].Spec.Template.ObjectMeta
				if tm.Annotations["checksum/config"] == "" {
					t.Errorf("DaemonSet %s: no pod template annotation checksum/config", d.DaemonSets[i].Name)
				}
				maps.DeleteFunc(tm.Annotations, func(k, _ string) bool { return strings.HasPrefix(k, "checksum/") })
				if len(tm.Annotations) == 0 {
					tm.Annotations = nil
				}
			}
			put("DaemonSet", &d.DaemonSets[i].ObjectMeta, &d.DaemonSets[i])
		}
		for i := range d.NADs {
			// The configuration as JSON, not as text: the chart re-indents it.
			nad := d.NADs[i]
			var config any
			if err := json.Unmarshal([]byte(nad.Spec.Config), &config); err != nil {
				t.Errorf("NetworkAttachmentDefinition %s: %v", nad.Metadata.Name, err)
			}
			put("NetworkAttachmentDefinition", &nad.Metadata, map[string]any{"meta": nad.Metadata, "config": config})
		}
		return objs
	}
	want, got := index(m, false), index(c, true)
	if len(want) != 4 {
		t.Errorf("compared %d objects of deploy/kubernetes (%v), want 4: update this test", len(want), slices.Sorted(maps.Keys(want)))
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("the chart and deploy/kubernetes differ (-manifests +chart); change both the same way:\n%s", diff)
	}
}

// TestHelmChartRefusesInvalidValues: values that would give a broken deployment fail the
// rendering with a message that names the value and the fix.
func TestHelmChartRefusesInvalidValues(t *testing.T) {
	cases := []struct {
		name, values string
		want         []string // in the error, all of them
	}{
		// No default for these three: a wrong guess would be worse than an error.
		{"no image", `image: {repository: ""}`, []string{"image.repository is required", "deploy/Dockerfile"}},
		{"no cluster", `cluster: ""`, []string{"cluster is required", "--set cluster="}},
		{"no etcd endpoints", `etcd: {endpoints: []}`, []string{"etcd.endpoints is required", "--set 'etcd.endpoints={"}},
		{"empty endpoints string", `etcd: {endpoints: ""}`, []string{"etcd.endpoints is required"}},
		// What leaseholdd would refuse at start, on every node.
		{"cluster with a slash", `cluster: a/b`, []string{`cluster "a/b"`, "letters, digits"}},
		{"endpoint without scheme", `etcd: {endpoints: [etcd-1:2379]}`, []string{`"etcd-1:2379" is not a client URL`}},
		{"http endpoint with TLS", `etcd: {endpoints: [http://etcd-1:2379]}`, []string{"is http:// but etcd.tls.enabled is true", "etcd.tls.enabled=false"}},
		{"duration without unit", `agent: {leaseTTL: "90"}`, []string{"leaseTTL", "pattern"}},
		{"unknown log level", `agent: {logLevel: verbose}`, []string{"logLevel"}},
		{"a misspelt value", `etcd: {endpoint: [https://etcd-1:2379]}`, []string{"endpoint", "not allowed"}},
		{"a misspelt top-level value", `monitorig: {enabled: true}`, []string{"monitorig", "not allowed"}},
		// The metrics listener: shared by every node, scraped with monitoring on.
		{"metrics on loopback with monitoring", `{monitoring: {enabled: true}, agent: {metricsAddr: "127.0.0.1:9615"}}`, []string{"listens on loopback only", "0.0.0.0:PORT"}},
		{"metrics on one node's address", `agent: {metricsAddr: "10.0.0.5:9615"}`, []string{"names one node's address"}},
		{"metrics address without port", `agent: {metricsAddr: "0.0.0.0"}`, []string{"is not IP:PORT"}},
		{"metrics port out of range", `agent: {metricsAddr: "0.0.0.0:70000"}`, []string{"not between 1 and 65535"}},
		// extraArgs: only --flag=value, never a flag the chart sets.
		{"extra arg the chart sets", `agent: {extraArgs: [--lease-ttl=2m]}`, []string{"--lease-ttl is set by the chart"}},
		{"extra arg as two items", `agent: {extraArgs: [--reuse-delay, 30m]}`, []string{`"--reuse-delay" is not of the form --flag=value`}},
		// nodeLabels: Kubernetes label syntax, so nothing breaks --node-label's KEY=VALUE,...
		// or is expanded by the kubelet; never also in extraArgs.
		{"node label key with =", `agent: {nodeLabels: {"a=b": x}}`, []string{`key "a=b" is not a Kubernetes label key`}},
		{"node label value with a comma", `agent: {nodeLabels: {zone: "a,b"}}`, []string{`the value "a,b" of zone is not a Kubernetes label value`}},
		{"node label value expanded by the kubelet", `agent: {nodeLabels: {zone: "$(NODE_NAME)"}}`, []string{"not a Kubernetes label value"}},
		{"node label as an extra arg", `agent: {extraArgs: [--node-label=zone=a]}`, []string{"--node-label is set by the chart"}},
		// CNI configurations.
		{"CNI file without extension", `cni: {files: [{name: leasehold, config: {cniVersion: 1.0.0, name: a, type: bridge}}]}`, []string{`cni.files[0].name "leasehold"`, ".conflist"}},
		{"CNI file twice", `cni: {files: [{name: a.conf, config: {cniVersion: 1.0.0, name: a, type: bridge}}, {name: a.conf, config: {cniVersion: 1.0.0, name: a, type: bridge}}]}`, []string{`cni.files[1].name "a.conf" is given twice`}},
		{"CNI config not JSON", `cni: {files: [{name: a.conf, config: '{"cniVersion": "1.0.0",'}]}`, []string{"cni.files[0].config is not valid JSON"}},
		{"CNI config without cniVersion", `cni: {networkAttachments: [{name: a, config: {name: a, type: macvlan}}]}`, []string{"cni.networkAttachments[0].config has no cniVersion"}},
		{"CNI config without plugin", `cni: {files: [{name: a.conf, config: {cniVersion: 1.0.0, name: a}}]}`, []string{"neither type", "nor plugins"}},
		{"network without name", `cni: {networkAttachments: [{config: {cniVersion: 1.0.0, name: a, type: macvlan}}]}`, []string{"name"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, err := helmTemplate(t, helmRequired, tc.values)
			if err == nil {
				t.Fatalf("rendered without error:\n%s", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not mention %q:\n%v", w, err)
				}
			}
		})
	}
	// The values above are each a departure from a rendering that works.
	if _, err := helmTemplate(t, helmRequired); err != nil {
		t.Fatalf("the required values alone do not render: %v", err)
	}
}

// TestHelmRulesCopyIsCurrent: the chart cannot read deploy/monitoring/, so it holds a copy of
// the rule file, which must be the same bytes.
func TestHelmRulesCopyIsCurrent(t *testing.T) {
	orig, cp := deployReadFile(t, helmRulesFile), deployReadFile(t, helmRulesCopy)
	if orig != cp {
		t.Errorf("%s differs from %s; the chart's PrometheusRule would not be the rule file: run\n  cp deploy/monitoring/leasehold-rules.yaml deploy/helm/leasehold/files/leasehold-rules.yaml",
			strings.TrimPrefix(helmRulesCopy, "../"), strings.TrimPrefix(helmRulesFile, "../"))
	}
}

// TestHelmChartLint runs `helm lint --strict` (Chart.yaml, the schema, templates that render
// to valid YAML) with monitoring on, so that every template is rendered.
func TestHelmChartLint(t *testing.T) {
	dir := t.TempDir()
	values := filepath.Join(dir, "values.yaml")
	if err := os.WriteFile(values, []byte(helmRequired+"monitoring: {enabled: true}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := helmCommand(toolBin(t, "helm"), dir, "lint", "--strict", helmChartDir, "--values", values).CombinedOutput(); err != nil {
		t.Errorf("helm lint --strict: %v\n%s", err, out)
	}
}

// TestHelmChartReadmeListsEveryValue: the chart's README has a row for every value of
// values.yaml (maps whose keys are the user's, such as resources, count as one value).
func TestHelmChartReadmeListsEveryValue(t *testing.T) {
	var values map[string]any
	if err := yaml.Unmarshal([]byte(deployReadFile(t, filepath.Join(helmChartDir, "values.yaml"))), &values); err != nil {
		t.Fatal(err)
	}
	readme := deployReadFile(t, filepath.Join(helmChartDir, "README.md"))
	opaque := map[string]bool{"resources": true, "installerResources": true, "nodeSelector": true, "monitoring.labels": true,
		"agent.nodeLabels": true}
	var walk func(prefix string, m map[string]any)
	n := 0
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			key := strings.TrimPrefix(prefix+"."+k, ".")
			if sub, ok := v.(map[string]any); ok && !opaque[key] {
				walk(key, sub)
				continue
			}
			n++
			if !strings.Contains(readme, "| `"+key+"` |") {
				t.Errorf("README.md has no row | `%s` | in its table of values", key)
			}
		}
	}
	walk("", values)
	if n < 30 {
		t.Errorf("found only %d values in values.yaml; is the walk broken?", n)
	}
}
