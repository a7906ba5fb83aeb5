package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

const (
	testDeploy = "e2e-pods"
	testNS     = "default"
)

// deploy installs leasehold with the chart deploy/helm/leasehold as its README shows: the
// namespace, labelled for the privileged Pod Security Standard; the Secret, made with kubectl
// create secret; then the chart with only the three values it requires (the image loaded
// into containerd, the cluster ID, this run's etcd), rendered by bin/helm (Helm, built by
// make tools from integration/helmtool) and applied with kubectl.
func (e *env) deploy(ctx context.Context) error {
	if _, err := e.kubectl(ctx, "create", "namespace", "leasehold"); err != nil {
		return err
	}
	if _, err := e.kubectl(ctx, "label", "namespace", "leasehold", "pod-security.kubernetes.io/enforce=privileged",
		"pod-security.kubernetes.io/audit=privileged", "pod-security.kubernetes.io/warn=privileged"); err != nil {
		return err
	}
	c := func(s string) string { return filepath.Join(e.lhPKI, s) }
	if _, err := e.kubectl(ctx, "-n", "leasehold", "create", "secret", "generic", "leasehold-etcd",
		"--from-file=ca.crt="+c("ca.crt"),
		"--from-file=tls.crt="+c("clients/leasehold-"+cluster+".crt"),
		"--from-file=tls.key="+c("clients/leasehold-"+cluster+".key")); err != nil {
		return err
	}
	i := strings.LastIndex(imageRef, ":")
	helmHome := filepath.Join(e.tmp, "helm")
	out, err := e.run(ctx, []string{"HELM_CACHE_HOME=" + helmHome + "/cache", "HELM_CONFIG_HOME=" + helmHome + "/config", "HELM_DATA_HOME=" + helmHome + "/data"},
		filepath.Join(e.bin, "helm"), "template", "leasehold", filepath.Join(e.repo, "deploy", "helm", "leasehold"), "--namespace", "leasehold",
		"--set", "image.repository="+imageRef[:i], "--set", "image.tag="+imageRef[i+1:], "--set", "cluster="+cluster,
		"--set", fmt.Sprintf("etcd.endpoints={https://127.0.0.1:%d}", e.ports["lh-etcd"]))
	if err != nil {
		return err
	}
	manifest := filepath.Join(e.tmp, "leasehold-chart.yaml")
	if err := os.WriteFile(manifest, []byte(out), 0o600); err != nil {
		return err
	}
	if _, err := e.kubectl(ctx, "apply", "-f", manifest); err != nil {
		return err
	}
	if _, err := e.kubectl(ctx, "-n", "leasehold", "rollout", "status", "ds/leaseholdd", "--timeout=180s"); err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(hostCNIBin, "leasehold")); err != nil {
		return fmt.Errorf("the init container did not install the plugin: %w", err)
	}
	if !httpOK("http://127.0.0.1:9615/readyz") {
		return fmt.Errorf("the agent's /readyz on 127.0.0.1:9615 does not answer 200")
	}
	return nil
}

type pod struct {
	Metadata struct {
		Name, Namespace, UID string
		DeletionTimestamp    *string `json:"deletionTimestamp"`
		Labels               map[string]string
	} `json:"metadata"`
	Spec   struct{ NodeName string } `json:"spec"`
	Status struct {
		Phase      string
		PodIP      string `json:"podIP"`
		Conditions []struct{ Type, Status string }
	} `json:"status"`
}

func (e *env) pods(ctx context.Context, ns, selector string) ([]pod, error) {
	out, err := e.kubectl(ctx, "get", "pods", "-n", ns, "-l", selector, "-o", "json")
	if err != nil {
		return nil, err
	}
	var l struct{ Items []pod }
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return nil, fmt.Errorf("kubectl get pods: %w", err)
	}
	return l.Items, nil
}

type alloc struct {
	Pool, IP, Owner, Cluster, Node, LeaseID string
	Pod                                     struct{ UID, Namespace, Name string }
}

func (e *env) allocs(ctx context.Context) ([]alloc, error) {
	out, err := e.run(ctx, e.etcdctlEnv(), filepath.Join(e.bin, "leaseholdctl"), "alloc", "list", "--pool", network, "-o", "json")
	if err != nil {
		return nil, err
	}
	var l []alloc
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return nil, fmt.Errorf("leaseholdctl alloc list -o json: %w: %s", err, out)
	}
	return l, nil
}

// matches compares the pool's allocations with the running test pods: each pod's IP is held
// by an allocation whose owner is the pod's UID (and names the pod, the cluster and the
// node), and no other address is held.
func (e *env) matches(ctx context.Context, want int) (bool, string, error) {
	ps, err := e.pods(ctx, testNS, "app="+testDeploy)
	if err != nil {
		return false, "", err
	}
	as, err := e.allocs(ctx)
	if err != nil {
		return false, "", err
	}
	byIP := map[string]alloc{}
	for _, a := range as {
		byIP[a.IP] = a
	}
	var probs []string
	if len(ps) != want {
		probs = append(probs, fmt.Sprintf("%d pods, want %d", len(ps), want))
	}
	seen := map[string]bool{}
	for _, p := range ps {
		m := p.Metadata
		if p.Status.Phase != "Running" || p.Status.PodIP == "" || m.DeletionTimestamp != nil {
			probs = append(probs, fmt.Sprintf("pod %s: phase %s, IP %q, deleting %v", m.Name, p.Status.Phase, p.Status.PodIP, m.DeletionTimestamp != nil))
			continue
		}
		if seen[p.Status.PodIP] {
			probs = append(probs, fmt.Sprintf("two pods have %s", p.Status.PodIP))
		}
		seen[p.Status.PodIP] = true
		a, ok := byIP[p.Status.PodIP]
		switch {
		case !ok:
			probs = append(probs, fmt.Sprintf("pod %s: its IP %s is not held in etcd", m.Name, p.Status.PodIP))
		case a.Owner != m.UID:
			probs = append(probs, fmt.Sprintf("pod %s (UID %s): %s is held by owner %q", m.Name, m.UID, a.IP, a.Owner))
		case a.Cluster != cluster || a.Node != nodeName || a.Pod.Name != m.Name || a.Pod.Namespace != m.Namespace:
			probs = append(probs, fmt.Sprintf("pod %s: allocation of %s names cluster %q node %q pod %s/%s", m.Name, a.IP, a.Cluster, a.Node, a.Pod.Namespace, a.Pod.Name))
		}
	}
	for _, a := range as {
		if !seen[a.IP] {
			probs = append(probs, fmt.Sprintf("%s is held (owner %s, pod %s) but no running pod has it", a.IP, a.Owner, a.Pod.Name))
		}
	}
	if len(probs) > 0 {
		return false, strings.Join(probs, "; "), nil
	}
	e.logf("%d pods, %d allocations, all owned by their pods", len(ps), len(as))
	return true, "", nil
}

func (e *env) scale(ctx context.Context, n int) error {
	if _, err := e.kubectl(ctx, "-n", testNS, "scale", "deployment/"+testDeploy, fmt.Sprintf("--replicas=%d", n)); err != nil {
		return err
	}
	if _, err := e.kubectl(ctx, "-n", testNS, "rollout", "status", "deployment/"+testDeploy, "--timeout=180s"); err != nil {
		return err
	}
	// Scaled down: wait until the surplus pods are gone (their CNI DEL has run).
	return poll(ctx, 90*time.Second, fmt.Sprintf("exactly %d pods of %s", n, testDeploy), func() (bool, string, error) {
		ps, err := e.pods(ctx, testNS, "app="+testDeploy)
		return err == nil && len(ps) == n, fmt.Sprintf("%d pods", len(ps)), err
	})
}

// checkPods polls until the allocations match the pods (bounded: a DEL's release is not
// instant for kubectl to see).
func (e *env) checkPods(ctx context.Context, n int) error {
	return poll(ctx, 60*time.Second, fmt.Sprintf("the pool's allocations are exactly the %d pods' addresses, owned by their UIDs", n),
		func() (bool, string, error) { return e.matches(ctx, n) })
}

const deployment = `apiVersion: apps/v1
kind: Deployment
metadata:
  name: e2e-pods
  namespace: default
spec:
  replicas: 3
  selector:
    matchLabels: {app: e2e-pods}
  template:
    metadata:
      labels: {app: e2e-pods}
    spec:
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: 1
      containers:
      - name: sleep
        image: ` + pauseRef + `
        imagePullPolicy: Never
`

var remainingRE = regexp.MustCompile(`remaining\((\d+)s\)`)

// leaseTTL is the remaining TTL of an etcd lease (etcdctl's hex ID).
func (e *env) leaseTTL(ctx context.Context, id string) (int, error) {
	out, err := e.run(ctx, e.etcdctlEnv(), filepath.Join(e.bin, "etcdctl"), "lease", "timetolive", id)
	if err != nil {
		return 0, err
	}
	m := remainingRE.FindStringSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("lease %s: %s", id, strings.TrimSpace(out))
	}
	return strconv.Atoi(m[1])
}

func (e *env) scenario(ctx context.Context) bool {
	var before []alloc
	var oldAgent string
	return e.step("Deployment of 3 pods: each pod's IP held in etcd, owner = the pod's UID", func() error {
		if _, err := e.kubectlIn(ctx, deployment, "apply"); err != nil {
			return err
		}
		if err := e.scale(ctx, 3); err != nil {
			return err
		}
		return e.checkPods(ctx, 3)
	}) && e.step("scale up to 10: ten distinct addresses, each owned by its pod", func() error {
		if err := e.scale(ctx, 10); err != nil {
			return err
		}
		return e.checkPods(ctx, 10)
	}) && e.step("scale down to 3: the 7 released addresses leave etcd (within 60s)", func() error {
		as, err := e.allocs(ctx)
		if err != nil {
			return err
		}
		if err := e.scale(ctx, 3); err != nil {
			return err
		}
		if err := e.checkPods(ctx, 3); err != nil {
			return err
		}
		after, err := e.allocs(ctx)
		if err != nil {
			return err
		}
		if len(as)-len(after) != 7 {
			return fmt.Errorf("%d allocations before, %d after", len(as), len(after))
		}
		before = after
		return nil
	}) && e.step("delete the agent pod: the DaemonSet recreates it; the pods keep their addresses and leases, renewed by the new agent", func() error {
		ps, err := e.pods(ctx, "leasehold", "app.kubernetes.io/name=leasehold")
		if err != nil || len(ps) != 1 {
			return fmt.Errorf("agent pods: %d, %v", len(ps), err)
		}
		oldAgent = ps[0].Metadata.UID
		if _, err := e.kubectl(ctx, "-n", "leasehold", "delete", "pod", ps[0].Metadata.Name, "--wait=true", "--timeout=90s"); err != nil {
			return err
		}
		if err := poll(ctx, 120*time.Second, "a new agent pod, Ready", func() (bool, string, error) {
			ps, err := e.pods(ctx, "leasehold", "app.kubernetes.io/name=leasehold")
			if err != nil {
				return false, "", err
			}
			for _, p := range ps {
				if p.Metadata.UID == oldAgent {
					return false, "the old pod is still there", nil
				}
				for _, c := range p.Status.Conditions {
					if c.Type == "Ready" && c.Status == "True" {
						return true, "", nil
					}
				}
			}
			return false, fmt.Sprintf("%d agent pods, none Ready", len(ps)), nil
		}); err != nil {
			return err
		}
		if err := e.checkPods(ctx, 3); err != nil {
			return err
		}
		after, err := e.allocs(ctx)
		if err != nil {
			return err
		}
		key := func(a alloc) string { return a.IP + " " + a.Owner + " " + a.LeaseID }
		k1, k2 := []string{}, []string{}
		for _, a := range before {
			k1 = append(k1, key(a))
		}
		for _, a := range after {
			k2 = append(k2, key(a))
		}
		slices.Sort(k1)
		slices.Sort(k2)
		if !slices.Equal(k1, k2) {
			return fmt.Errorf("allocations changed across the agent's restart:\nbefore %v\nafter  %v", k1, k2)
		}
		// The new agent keeps the pods' leases alive: measured now (the old agent is gone), each
		// lease's remaining TTL must rise above what time alone leaves of it.
		ttls, m0 := map[string]int{}, time.Now()
		for _, a := range after {
			if ttls[a.LeaseID], err = e.leaseTTL(ctx, a.LeaseID); err != nil {
				return err
			}
		}
		return poll(ctx, 100*time.Second, "every pod lease renewed by the new agent", func() (bool, string, error) {
			var stale []string
			for id, t0 := range ttls {
				t, err := e.leaseTTL(ctx, id)
				if err != nil {
					return false, "", err
				}
				if left := t0 - int(time.Since(m0).Seconds()); t <= left+2 {
					stale = append(stale, fmt.Sprintf("%s: %ds left (%ds when measured)", id, t, t0))
				}
			}
			return len(stale) == 0, strings.Join(stale, ", "), nil
		})
	}) && e.step("scale up to 6 with the new agent: new pods get addresses; leaseholdctl doctor exits 0", func() error {
		if err := e.scale(ctx, 6); err != nil {
			return err
		}
		if err := e.checkPods(ctx, 6); err != nil {
			return err
		}
		out, err := e.run(ctx, e.etcdctlEnv(), filepath.Join(e.bin, "leaseholdctl"), "doctor")
		fmt.Print(indent(out))
		return err
	}) && e.step("scale to 0: every address released (within 60s)", func() error {
		if err := e.scale(ctx, 0); err != nil {
			return err
		}
		return e.checkPods(ctx, 0)
	}) && e.step("leaseholdctl doctor exits 0 (after the last release)", func() error {
		out, err := e.run(ctx, e.etcdctlEnv(), filepath.Join(e.bin, "leaseholdctl"), "doctor")
		if err != nil {
			return err
		}
		fmt.Print(indent(out))
		return nil
	})
}

func indent(s string) string {
	var b strings.Builder
	for l := range strings.Lines(s) {
		b.WriteString("    " + l)
	}
	return b.String()
}
