package integration

// Tests of deploy/: every Kubernetes manifest decodes strictly into the API types (a typo
// fails here, not on a cluster), the DaemonSet, ConfigMap, Secret, Dockerfile, systemd unit
// and Multus example agree with each other and with leaseholdd's real flags, the plugin
// install is atomic, and the etcd scripts do what deploy/README.md says. Each check is a
// function returning the problems it finds; the *CatchMistakes tests feed it broken inputs
// to show that it can fail.

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"net"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin"
	"github.com/leasehold/leasehold/keyspace"
)

const (
	deployDir     = "../deploy"
	deployKubeDir = "../deploy/kubernetes"
)

// ---------------------------------------------------------------------------------------
// Decoding

// deployNAD is a Multus NetworkAttachmentDefinition (a CRD, so not in k8s.io/api): exactly
// the fields Multus reads, decoded as strictly as the built-in kinds.
type deployNAD struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		Config string `json:"config"`
	} `json:"spec"`
}

// deployment is every object under deploy/kubernetes, by kind.
type deployment struct {
	Namespaces      []corev1.Namespace
	ServiceAccounts []corev1.ServiceAccount
	ConfigMaps      []corev1.ConfigMap
	Secrets         []corev1.Secret
	DaemonSets      []appsv1.DaemonSet
	NADs            []deployNAD
}

func (d *deployment) clone() *deployment {
	c := &deployment{NADs: slices.Clone(d.NADs)}
	for _, o := range d.Namespaces {
		c.Namespaces = append(c.Namespaces, *o.DeepCopy())
	}
	for _, o := range d.ServiceAccounts {
		c.ServiceAccounts = append(c.ServiceAccounts, *o.DeepCopy())
	}
	for _, o := range d.ConfigMaps {
		c.ConfigMaps = append(c.ConfigMaps, *o.DeepCopy())
	}
	for _, o := range d.Secrets {
		c.Secrets = append(c.Secrets, *o.DeepCopy())
	}
	for _, o := range d.DaemonSets {
		c.DaemonSets = append(c.DaemonSets, *o.DeepCopy())
	}
	return c
}

var deployDocSeparator = regexp.MustCompile(`(?m)^---[ \t]*(#.*)?$`)

// deploySplitYAML splits a multi-document YAML file on its "---" lines and drops documents
// that hold nothing but comments and blank lines.
func deploySplitYAML(data []byte) [][]byte {
	var docs [][]byte
	for _, doc := range deployDocSeparator.Split(string(data), -1) {
		for _, line := range strings.Split(doc, "\n") {
			if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
				docs = append(docs, []byte(doc))
				break
			}
		}
	}
	return docs
}

// deployDecodeStrict decodes one YAML document into obj as the API server's strict field
// validation would: YAML with duplicate keys is refused, and so is any field the type does
// not have, including one that differs only in case (sigs.k8s.io/json is case-sensitive,
// where encoding/json would quietly accept "hostnetwork" for "hostNetwork").
func deployDecodeStrict(doc []byte, obj any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strictErrs, err := sigsjson.UnmarshalStrict(j, obj, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	if len(strictErrs) > 0 {
		return fmt.Errorf("strict decoding: %w", errors.Join(strictErrs...))
	}
	return nil
}

// deployAddDoc decodes doc into the type its apiVersion and kind name and adds it to d. An
// apiVersion/kind this test does not know is an error: a typo there must fail too.
func deployAddDoc(d *deployment, doc []byte) error {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return err
	}
	switch tm.APIVersion + " " + tm.Kind {
	case "v1 Namespace":
		var o corev1.Namespace
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.Namespaces = append(d.Namespaces, o)
	case "v1 ServiceAccount":
		var o corev1.ServiceAccount
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.ServiceAccounts = append(d.ServiceAccounts, o)
	case "v1 ConfigMap":
		var o corev1.ConfigMap
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.ConfigMaps = append(d.ConfigMaps, o)
	case "v1 Secret":
		var o corev1.Secret
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.Secrets = append(d.Secrets, o)
	case "apps/v1 DaemonSet":
		var o appsv1.DaemonSet
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.DaemonSets = append(d.DaemonSets, o)
	case "k8s.cni.cncf.io/v1 NetworkAttachmentDefinition":
		var o deployNAD
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.NADs = append(d.NADs, o)
	default:
		return fmt.Errorf("apiVersion %q kind %q: not a kind deploy/kubernetes is expected to hold (typo?)", tm.APIVersion, tm.Kind)
	}
	return nil
}

// deployLoad decodes every *.yaml / *.yml file under dir, every document of each.
func deployLoad(t *testing.T, dir string) *deployment {
	t.Helper()
	d := &deployment{}
	files := 0
	err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() || (!strings.HasSuffix(p, ".yaml") && !strings.HasSuffix(p, ".yml")) {
			return err
		}
		files++
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		docs := deploySplitYAML(data)
		if len(docs) == 0 {
			t.Errorf("%s: no YAML document in it", p)
		}
		for i, doc := range docs {
			if err := deployAddDoc(d, doc); err != nil {
				t.Errorf("%s, document %d: %v", p, i+1, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files == 0 {
		t.Fatalf("no manifest under %s", dir)
	}
	return d
}

// ---------------------------------------------------------------------------------------
// leaseholdd's flags, read from its source so that a manifest can never pass a flag the
// agent does not have (every node's agent would exit at start).

type deployFlagKind string

const (
	flagString   deployFlagKind = "string"
	flagBool     deployFlagKind = "bool"
	flagDuration deployFlagKind = "duration"
	flagInt      deployFlagKind = "int"
	flagFloat    deployFlagKind = "float"
)

func deployAgentFlags(t *testing.T) map[string]deployFlagKind {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob("../cmd/leaseholdd/*.go")
	if err != nil {
		t.Fatal(err)
	}
	flags := map[string]deployFlagKind{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || !strings.HasSuffix(sel.Sel.Name, "Var") || len(call.Args) < 2 {
				return true
			}
			lit, ok := call.Args[1].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			name, err := strconv.Unquote(lit.Value)
			if err != nil {
				return true
			}
			kind := flagString
			switch m := sel.Sel.Name; {
			case strings.HasPrefix(m, "Bool"):
				kind = flagBool
			case strings.HasPrefix(m, "Duration"):
				kind = flagDuration
			case strings.HasPrefix(m, "Int"), strings.HasPrefix(m, "Uint"):
				kind = flagInt
			case strings.HasPrefix(m, "Float"):
				kind = flagFloat
			}
			flags[name] = kind
			return true
		})
	}
	// The flags the deployment files rely on; if the parse above found none of them, it is
	// broken, not the manifests.
	for _, f := range []string{"node", "cluster", "socket", "etcd-endpoints", "lease-ttl", "publish-host-addresses", "spare-leases"} {
		if _, ok := flags[f]; !ok {
			t.Fatalf("found no --%s among leaseholdd's flags in cmd/leaseholdd (found %v); has the flag parsing changed?", f, flags)
		}
	}
	return flags
}

var deployFlagArg = regexp.MustCompile(`^--?([A-Za-z0-9][A-Za-z0-9-]*)=(.*)$`)

// deployCheckFlagArgs checks an expanded argument list: every argument is --flag=value (the
// only form that works for every kind, booleans included), the flag exists, appears once,
// and its value parses as the flag's kind. It returns flag → value.
func deployCheckFlagArgs(where string, args []string, flags map[string]deployFlagKind) (map[string]string, []string) {
	var probs []string
	vals := map[string]string{}
	for _, a := range args {
		m := deployFlagArg.FindStringSubmatch(a)
		if m == nil {
			probs = append(probs, fmt.Sprintf("%s: argument %q is not of the form --flag=value", where, a))
			continue
		}
		name, val := m[1], m[2]
		kind, ok := flags[name]
		if !ok {
			probs = append(probs, fmt.Sprintf("%s: leaseholdd has no flag --%s (the agent would exit at start)", where, name))
			continue
		}
		if _, dup := vals[name]; dup {
			probs = append(probs, fmt.Sprintf("%s: --%s is given twice", where, name))
		}
		vals[name] = val
		var err error
		switch kind {
		case flagBool:
			_, err = strconv.ParseBool(val)
		case flagDuration:
			_, err = time.ParseDuration(val)
		case flagInt:
			_, err = strconv.Atoi(val)
		case flagFloat:
			_, err = strconv.ParseFloat(val, 64)
		}
		if err != nil {
			probs = append(probs, fmt.Sprintf("%s: --%s=%q is not a valid %s: %v", where, name, val, kind, err))
		}
	}
	return vals, probs
}

// ---------------------------------------------------------------------------------------
// The DaemonSet and what it refers to

// deployEnv is a container's environment as the kubelet builds it, for $(VAR) expansion.
type deployEnv struct {
	vals   map[string]string
	source map[string]string // "configmap", "fieldRef:<path>", "secret", "value", ...
}

func (d *deployment) configMap(ns, name string) *corev1.ConfigMap {
	for i := range d.ConfigMaps {
		if d.ConfigMaps[i].Namespace == ns && d.ConfigMaps[i].Name == name {
			return &d.ConfigMaps[i]
		}
	}
	return nil
}

func (d *deployment) secret(ns, name string) *corev1.Secret {
	for i := range d.Secrets {
		if d.Secrets[i].Namespace == ns && d.Secrets[i].Name == name {
			return &d.Secrets[i]
		}
	}
	return nil
}

func deploySecretHasKey(s *corev1.Secret, key string) bool {
	_, a := s.StringData[key]
	_, b := s.Data[key]
	return a || b
}

func (d *deployment) containerEnv(ns string, c *corev1.Container) (deployEnv, []string) {
	var probs []string
	env := deployEnv{vals: map[string]string{}, source: map[string]string{}}
	for _, ef := range c.EnvFrom {
		switch {
		case ef.ConfigMapRef != nil:
			cm := d.configMap(ns, ef.ConfigMapRef.Name)
			if cm == nil {
				if ef.ConfigMapRef.Optional == nil || !*ef.ConfigMapRef.Optional {
					probs = append(probs, fmt.Sprintf("container %s: envFrom ConfigMap %s/%s is not among the manifests", c.Name, ns, ef.ConfigMapRef.Name))
				}
				continue
			}
			for k, v := range cm.Data {
				env.vals[ef.Prefix+k], env.source[ef.Prefix+k] = v, "configmap:"+cm.Name
			}
		case ef.SecretRef != nil:
			probs = append(probs, fmt.Sprintf("container %s: envFrom a Secret puts every key into the environment; reference the keys one by one", c.Name))
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env.vals[e.Name], env.source[e.Name] = e.Value, "value"
		case e.ValueFrom.FieldRef != nil:
			env.vals[e.Name], env.source[e.Name] = "value-of-"+e.ValueFrom.FieldRef.FieldPath, "fieldRef:"+e.ValueFrom.FieldRef.FieldPath
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			cm := d.configMap(ns, ref.Name)
			v, ok := "", false
			if cm != nil {
				v, ok = cm.Data[ref.Key]
			}
			if !ok && (ref.Optional == nil || !*ref.Optional) {
				probs = append(probs, fmt.Sprintf("container %s: env %s refers to ConfigMap %s/%s key %q, which does not exist", c.Name, e.Name, ns, ref.Name, ref.Key))
			}
			env.vals[e.Name], env.source[e.Name] = v, "configmap:"+ref.Name
		case e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			// Optional or not, the Secret template documents every key the agent can use.
			if s := d.secret(ns, ref.Name); s == nil || !deploySecretHasKey(s, ref.Key) {
				probs = append(probs, fmt.Sprintf("container %s: env %s refers to Secret %s/%s key %q, which the Secret template does not have", c.Name, e.Name, ns, ref.Name, ref.Key))
			}
			env.vals[e.Name], env.source[e.Name] = "secret-value", "secret:"+ref.Name
		default:
			env.vals[e.Name], env.source[e.Name] = "other-value", "other"
		}
	}
	return env, probs
}

var deployVarRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)`)

// expand replaces $(VAR) as the kubelet does; an undefined VAR is a problem (the kubelet
// would pass the text through unchanged).
func (env deployEnv) expand(where, s string) (string, []string) {
	var probs []string
	out := deployVarRef.ReplaceAllStringFunc(s, func(m string) string {
		name := m[2 : len(m)-1]
		v, ok := env.vals[name]
		if !ok {
			probs = append(probs, fmt.Sprintf("%s: %q refers to $(%s), which no env or envFrom defines (the agent would get the text %q)", where, s, name, m))
			return m
		}
		return v
	})
	return out, probs
}

// deployMountFor returns the volume mount of c that holds containerPath (the longest one) and
// its volume.
func deployMountFor(spec *corev1.PodSpec, c *corev1.Container, containerPath string) (*corev1.VolumeMount, *corev1.Volume, string) {
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		m := &c.VolumeMounts[i]
		mp := path.Clean(m.MountPath)
		if (containerPath == mp || strings.HasPrefix(containerPath, mp+"/")) && (best == nil || len(mp) > len(path.Clean(best.MountPath))) {
			best = m
		}
	}
	if best == nil {
		return nil, nil, ""
	}
	rel := strings.TrimPrefix(containerPath, path.Clean(best.MountPath))
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == best.Name {
			return best, &spec.Volumes[i], rel
		}
	}
	return best, nil, rel
}

// deployHostPathOf maps a path in container c to the host path behind it, if a hostPath volume
// holds it.
func deployHostPathOf(spec *corev1.PodSpec, c *corev1.Container, containerPath string) (string, bool) {
	_, vol, rel := deployMountFor(spec, c, containerPath)
	if vol == nil || vol.HostPath == nil {
		return "", false
	}
	return path.Clean(vol.HostPath.Path) + rel, true
}

func deployHasCap(caps *corev1.Capabilities, want string) bool {
	if caps == nil {
		return false
	}
	for _, c := range caps.Add {
		if strings.TrimPrefix(strings.ToUpper(string(c)), "CAP_") == want {
			return true
		}
	}
	return false
}

// deployDockerfile is the parts of deploy/Dockerfile the checks read.
type deployDockerfile struct {
	froms  []string // image of each FROM
	copies []string // destinations of COPY --from=...
	runs   []string
	envs   []string
	users  []string // USER of the final stage
}

func deployParseDockerfile(text string) deployDockerfile {
	var df deployDockerfile
	joined := strings.ReplaceAll(text, "\\\n", " ")
	for _, line := range strings.Split(joined, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		switch strings.ToUpper(fields[0]) {
		case "FROM":
			for _, f := range fields[1:] {
				if !strings.HasPrefix(f, "--") {
					df.froms = append(df.froms, f)
					break
				}
			}
			df.users = nil
		case "COPY":
			if strings.Contains(line, "--from=") {
				df.copies = append(df.copies, fields[len(fields)-1])
			}
		case "RUN":
			df.runs = append(df.runs, line)
		case "ENV":
			df.envs = append(df.envs, line)
		case "USER":
			df.users = append(df.users, fields[1])
		}
	}
	return df
}

// deployCheckDockerfile: a golang builder of the go.mod's Go version running make build
// without cgo, a final image that is not the Go toolchain, running as root, and holding
// every path the DaemonSet executes or copies.
func deployCheckDockerfile(text, goVersion string, needPaths []string) []string {
	var probs []string
	df := deployParseDockerfile(text)
	if len(df.froms) < 2 {
		return append(probs, fmt.Sprintf("Dockerfile: want a multi-stage build, found FROM %v", df.froms))
	}
	if want := "golang:" + goVersion; df.froms[0] != want && !strings.HasPrefix(df.froms[0], want+"-") && !strings.HasPrefix(df.froms[0], want+".") {
		probs = append(probs, fmt.Sprintf("Dockerfile: builder is FROM %s, want %s (go.mod says go %s)", df.froms[0], want, goVersion))
	}
	if strings.HasPrefix(df.froms[len(df.froms)-1], "golang") {
		probs = append(probs, "Dockerfile: the final image is the Go toolchain image")
	}
	if !slices.ContainsFunc(df.runs, func(r string) bool { return strings.Contains(r, "make build") }) {
		probs = append(probs, "Dockerfile: no RUN runs `make build`")
	}
	if !slices.ContainsFunc(append(slices.Clone(df.envs), df.runs...), func(r string) bool { return strings.Contains(r, "CGO_ENABLED=0") }) {
		probs = append(probs, "Dockerfile: CGO_ENABLED=0 is not set for the build")
	}
	for _, u := range df.users {
		if u != "0" && u != "root" && !strings.HasPrefix(u, "0:") && !strings.HasPrefix(u, "root:") {
			probs = append(probs, fmt.Sprintf("Dockerfile: the final image runs as USER %s; leaseholdd needs root", u))
		}
	}
	for _, p := range needPaths {
		if !slices.Contains(df.copies, p) {
			probs = append(probs, fmt.Sprintf("Dockerfile: the image has no %s (COPY --from=... destinations: %v)", p, df.copies))
		}
	}
	return probs
}

// deployCheckInstall runs the init container's command the way the container would, with
// its SRC and DEST_DIR pointed into a temporary directory, over an existing plugin: the new
// plugin must end up in place, executable, as a new file (a rename: an in-place copy keeps
// the inode, and the runtime could execute a half-written binary), with nothing left over.
func deployCheckInstall(t *testing.T, c *corev1.Container) []string {
	t.Helper()
	var probs []string
	if len(c.Command) < 3 || path.Base(c.Command[0]) != "sh" || c.Command[1] != "-c" {
		return append(probs, fmt.Sprintf("init container %s: command %q is not [/bin/sh -c SCRIPT]", c.Name, c.Command))
	}
	dir := t.TempDir()
	src, dest := filepath.Join(dir, "src-leasehold"), filepath.Join(dir, "dest")
	if err := os.WriteFile(src, []byte("new plugin"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dest, 0o755); err != nil {
		t.Fatal(err)
	}
	old := filepath.Join(dest, "leasehold")
	if err := os.WriteFile(old, []byte("old plugin, a bit longer"), 0o755); err != nil {
		t.Fatal(err)
	}
	oldInfo, err := os.Stat(old)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(c.Command[0], c.Command[1:]...)
	cmd.Args = append(cmd.Args, c.Args...)
	cmd.Env = append(os.Environ(), "SRC="+src, "DEST_DIR="+dest)
	if out, err := cmd.CombinedOutput(); err != nil {
		return append(probs, fmt.Sprintf("init container %s: the install script failed: %v\n%s", c.Name, err, out))
	}
	newInfo, err := os.Stat(old)
	if err != nil {
		return append(probs, fmt.Sprintf("init container %s: no plugin at DEST_DIR/leasehold after the install: %v", c.Name, err))
	}
	if b, _ := os.ReadFile(old); string(b) != "new plugin" {
		probs = append(probs, fmt.Sprintf("init container %s: DEST_DIR/leasehold holds %q, want the new plugin", c.Name, b))
	}
	if newInfo.Mode().Perm()&0o111 != 0o111 {
		probs = append(probs, fmt.Sprintf("init container %s: the installed plugin has mode %v, not executable by all", c.Name, newInfo.Mode()))
	}
	if newInfo.Sys().(*syscall.Stat_t).Ino == oldInfo.Sys().(*syscall.Stat_t).Ino {
		probs = append(probs, fmt.Sprintf("init container %s: the plugin was overwritten in place (same inode): copy to a temporary name in the same directory and rename it", c.Name))
	}
	if entries, _ := os.ReadDir(dest); len(entries) != 1 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		probs = append(probs, fmt.Sprintf("init container %s: DEST_DIR holds %v after the install, want only leasehold", c.Name, names))
	}
	return probs
}

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
	netns := "/var/run/netns"
	m, vol, _ := deployMountFor(spec, agent, netns)
	switch {
	case m == nil || path.Clean(m.MountPath) != netns || vol == nil || vol.HostPath == nil || path.Clean(vol.HostPath.Path) != netns:
		add("container %s: no mount of the host's %s at the same path (the runtime passes host paths)", agent.Name, netns)
	case m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer:
		add("container %s: %s is mounted without mountPropagation HostToContainer: namespaces created later would be empty files", agent.Name, netns)
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
		probs = append(probs, deployCheckInstall(t, install)...)
	}
	probs = append(probs, deployCheckDockerfile(dockerfile, goVersion, []string{agent.Command[0], pluginSrc, "/usr/local/bin/leaseholdctl"})...)
	return hostSocket, probs
}

// deployCheckNAD: the example's CNI configuration is one leasehold's own parser accepts,
// dual-stack, and talks to the DaemonSet's socket.
func deployCheckNAD(nad deployNAD, hostSocket string) []string {
	var probs []string
	add := func(format string, args ...any) {
		probs = append(probs, fmt.Sprintf("NetworkAttachmentDefinition %s: ", nad.Metadata.Name)+fmt.Sprintf(format, args...))
	}
	if nad.Metadata.Name == "" {
		add("no metadata.name")
	}
	cfg, err := cniplugin.ParseConfig([]byte(nad.Spec.Config), "", "ctr", "eth0", "/var/run/netns/x")
	if err != nil {
		add("spec.config is refused by cniplugin.ParseConfig: %v", err)
		return probs
	}
	var top struct {
		Type string `json:"type"`
		IPAM struct {
			Type string `json:"type"`
		} `json:"ipam"`
	}
	if err := json.Unmarshal([]byte(nad.Spec.Config), &top); err != nil {
		add("spec.config: %v", err)
	}
	if top.Type != "macvlan" {
		add("spec.config type is %q, want macvlan", top.Type)
	}
	if top.IPAM.Type != "leasehold" {
		add("spec.config ipam.type is %q, want leasehold", top.IPAM.Type)
	}
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
	if cfg.IPAM.Socket != hostSocket {
		add("spec.config ipam.socket is %q, but the DaemonSet's agent serves %q", cfg.IPAM.Socket, hostSocket)
	}
	return probs
}

func deployGoVersion(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(b)
	if m == nil {
		t.Fatal("go.mod has no go directive")
	}
	return string(m[1])
}

func deployReadFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

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

// TestDeployShellScriptsParse runs `bash -n` on every .sh file under deploy/.
func TestDeployShellScriptsParse(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Fatal(err)
	}
	bashN := func(p string) error {
		if out, err := exec.Command(bash, "-n", p).CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	var scripts []string
	err = filepath.WalkDir(deployDir, func(p string, e fs.DirEntry, err error) error {
		if err == nil && !e.IsDir() && strings.HasSuffix(p, ".sh") {
			scripts = append(scripts, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"etcd/etcd-rbac.sh", "etcd/certs.sh"} {
		if !slices.Contains(scripts, filepath.Join(deployDir, want)) {
			t.Errorf("deploy/%s is missing", want)
		}
	}
	for _, s := range scripts {
		if err := bashN(s); err != nil {
			t.Errorf("bash -n %s: %v", s, err)
		}
		if fi, err := os.Stat(s); err == nil && fi.Mode().Perm()&0o100 == 0 {
			t.Errorf("%s is not executable (the docs run it as ./%s)", s, s)
		}
	}
	broken := filepath.Join(t.TempDir(), "broken.sh")
	if err := os.WriteFile(broken, []byte("if true; then echo x\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if bashN(broken) == nil {
		t.Error("bash -n accepted a script with an unterminated if")
	}
}

// deployRunRBAC runs etcd-rbac.sh with a stand-in etcdctl that records every call (and what
// it read on stdin); a user or role exists once it has been added.
func deployRunRBAC(t *testing.T, env []string, args ...string) (calls []string, stdin string, err error) {
	t.Helper()
	dir := t.TempDir()
	log := filepath.Join(dir, "calls")
	fake := filepath.Join(dir, "etcdctl")
	script := `#!/bin/sh
printf '%s\n' "$*" >>"` + log + `"
case "$1 $2" in
"role get"|"user get") grep -q "^$1 add $3\( \|\$\)" "` + log + `"; exit $? ;;
"user add"|"user passwd") case "$*" in *--interactive=false*) cat >>"` + log + `.stdin" ;; esac ;;
esac
exit 0
`
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", append([]string{filepath.Join(deployDir, "etcd", "etcd-rbac.sh")}, args...)...)
	cmd.Env = append(append(os.Environ(), "ETCDCTL="+fake, "LEASEHOLD_ETCD_PASSWORD=", "ETCD_ROOT_PASSWORD=", "ETCDCTL_CERT="), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		err = fmt.Errorf("%w: %s", err, out)
	}
	b, _ := os.ReadFile(log)
	in, _ := os.ReadFile(log + ".stdin")
	return strings.Split(strings.TrimSpace(string(b)), "\n"), string(in), err
}

// TestDeployEtcdRBACScript: etcd-rbac.sh grants each cluster's role exactly
// keyspace.RolePrefixes (the prefixes the agent uses), readwrite, by prefix; makes the user
// whose name the client certificate carries; never puts a password on a command line; and
// turns authentication on only when root could still log in.
func TestDeployEtcdRBACScript(t *testing.T) {
	grant := regexp.MustCompile(`^role grant-permission --prefix=true (\S+) (\S+) (\S+)$`)
	calls, _, err := deployRunRBAC(t, nil, "cluster-x", "cluster-y")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"cluster-x", "cluster-y"} {
		role := "leasehold-" + c
		var got []string
		for _, call := range calls {
			if m := grant.FindStringSubmatch(call); m != nil && m[1] == role {
				if m[2] != "readwrite" {
					t.Errorf("%s: %s is granted %s, want readwrite", role, m[3], m[2])
				}
				got = append(got, m[3])
			}
		}
		want := keyspace.RolePrefixes(c)
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("role %s is granted %q, the agent uses exactly %q (keyspace.RolePrefixes)", role, got, want)
		}
		for _, call := range []string{"role add " + role, "user add " + role + " --no-password", "user grant-role " + role + " " + role} {
			if !slices.Contains(calls, call) {
				t.Errorf("no call `etcdctl %s` in %q", call, calls)
			}
		}
	}
	if slices.ContainsFunc(calls, func(c string) bool { return strings.HasPrefix(c, "auth enable") }) {
		t.Error("authentication enabled without --enable-auth")
	}

	// A password goes on stdin, never into argv.
	calls, stdin, err := deployRunRBAC(t, []string{"LEASEHOLD_ETCD_PASSWORD=Pa55-w0rd"}, "cluster-x")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(strings.Join(calls, "\n"), "Pa55-w0rd") {
		t.Errorf("the password appears on an etcdctl command line: %q", calls)
	}
	if strings.TrimSpace(stdin) != "Pa55-w0rd" || !slices.Contains(calls, "user add leasehold-cluster-x --interactive=false") {
		t.Errorf("the user was not made with the password on stdin: calls %q, stdin %q", calls, stdin)
	}
	if _, _, err := deployRunRBAC(t, []string{"LEASEHOLD_ETCD_PASSWORD=Pa55-w0rd"}, "cluster-x", "cluster-y"); err == nil {
		t.Error("one password for two clusters' users was accepted")
	}
	if _, _, err := deployRunRBAC(t, []string{"LEASEHOLD_ETCD_PASSWORD=two words"}, "cluster-x"); err == nil {
		t.Error("a password with a space (which etcdctl would cut) was accepted")
	}
	// Refusals that must happen before any etcdctl call.
	for name, args := range map[string][]string{"a cluster ID with a slash": {"a/b"}, "no cluster": {}, "an unknown option": {"--enable-auht", "x"}} {
		calls, _, err := deployRunRBAC(t, nil, args...)
		if err == nil || (len(calls) > 0 && calls[0] != "") {
			t.Errorf("%s: err %v, etcdctl calls %q; want a refusal before any call", name, err, calls)
		}
	}
	// --enable-auth: never leave root without a way in.
	calls, _, err = deployRunRBAC(t, nil, "--enable-auth", "cluster-x")
	if err == nil || slices.Contains(calls, "auth enable") {
		t.Errorf("--enable-auth without a root password or client certificate: err %v, calls %q", err, calls)
	}
	calls, _, err = deployRunRBAC(t, []string{"ETCD_ROOT_PASSWORD=r00t"}, "--enable-auth", "cluster-x")
	if err != nil {
		t.Fatal(err)
	}
	if calls[len(calls)-1] != "auth enable" || !slices.Contains(calls, "user grant-role root root") {
		t.Errorf("--enable-auth: calls %q, want root granted role root and `auth enable` last", calls)
	}
}

// TestDeployCertsScript runs certs.sh: a CA, etcd's server certificate for 127.0.0.1 and
// localhost, and per cluster a client certificate whose CN is the etcd user etcd-rbac.sh
// makes, each verifying against the CA and matching its key.
func TestDeployCertsScript(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("openssl is missing; .ci/run installs it")
		}
		t.Skip("openssl is not installed")
	}
	out := filepath.Join(t.TempDir(), "pki")
	cmd := exec.Command("bash", filepath.Join(deployDir, "etcd", "certs.sh"), out, "cluster-x")
	cmd.Env = append(os.Environ(), "ETCD_SERVER_SANS=DNS:etcd-1.example.internal")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("certs.sh: %v\n%s", err, b)
	}
	load := func(name string) *x509.Certificate {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		blk, _ := pem.Decode(b)
		if blk == nil {
			t.Fatalf("%s: no PEM", name)
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	ca := load("ca.crt")
	if !ca.IsCA {
		t.Error("ca.crt is not a CA")
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	verify := func(name string, c *x509.Certificate, usage x509.ExtKeyUsage) {
		t.Helper()
		if _, err := c.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Errorf("%s does not verify for %v against ca.crt: %v", name, usage, err)
		}
		if _, err := tls.LoadX509KeyPair(filepath.Join(out, name), filepath.Join(out, strings.TrimSuffix(name, ".crt")+".key")); err != nil {
			t.Errorf("%s and its key do not match: %v", name, err)
		}
		if fi, err := os.Stat(filepath.Join(out, strings.TrimSuffix(name, ".crt")+".key")); err != nil {
			t.Error(err)
		} else if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("the key of %s has mode %v: readable by others", name, fi.Mode())
		}
	}
	server := load("server.crt")
	verify("server.crt", server, x509.ExtKeyUsageServerAuth)
	if err := server.VerifyHostname("127.0.0.1"); err != nil {
		t.Error(err)
	}
	if err := server.VerifyHostname("localhost"); err != nil {
		t.Error(err)
	}
	if err := server.VerifyHostname("etcd-1.example.internal"); err != nil {
		t.Errorf("ETCD_SERVER_SANS not applied: %v", err)
	}
	client := load("clients/leasehold-cluster-x.crt")
	verify("clients/leasehold-cluster-x.crt", client, x509.ExtKeyUsageClientAuth)
	calls, _, err := deployRunRBAC(t, nil, "cluster-x")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(calls, "user add "+client.Subject.CommonName+" --no-password") {
		t.Errorf("client certificate CN %q is not the user etcd-rbac.sh makes (%q)", client.Subject.CommonName, calls)
	}
	verify("clients/root.crt", load("clients/root.crt"), x509.ExtKeyUsageClientAuth)

	// A second run keeps the CA (certificates already issued stay valid).
	before, _ := os.ReadFile(filepath.Join(out, "ca.crt"))
	if b, err := exec.Command("bash", filepath.Join(deployDir, "etcd", "certs.sh"), out, "cluster-y").CombinedOutput(); err != nil {
		t.Fatalf("certs.sh, second run: %v\n%s", err, b)
	}
	after, _ := os.ReadFile(filepath.Join(out, "ca.crt"))
	if !bytes.Equal(before, after) {
		t.Error("a second run replaced the CA")
	}
	verify("clients/leasehold-cluster-y.crt", load("clients/leasehold-cluster-y.crt"), x509.ExtKeyUsageClientAuth)
	if b, err := exec.Command("bash", filepath.Join(deployDir, "etcd", "certs.sh"), out, "bad/name").CombinedOutput(); err == nil {
		t.Errorf("certs.sh accepted cluster ID bad/name:\n%s", b)
	}
}

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
