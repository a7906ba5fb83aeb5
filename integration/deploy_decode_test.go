package integration

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
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

// deployServiceMonitor is the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1,
// a CRD): the fields the chart sets, decoded strictly.
type deployServiceMonitor struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		Endpoints []struct {
			Port          string `json:"port"`
			Path          string `json:"path"`
			Interval      string `json:"interval"`
			ScrapeTimeout string `json:"scrapeTimeout"`
			Relabelings   []struct {
				SourceLabels []string `json:"sourceLabels"`
				TargetLabel  string   `json:"targetLabel"`
			} `json:"relabelings"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// deployRuleGroup is one group of a Prometheus rule file, which is also what a PrometheusRule's
// spec.groups holds: every field either accepts, so that a field of the rule file the chart
// would drop, or a misspelt one, fails decoding.
type deployRuleGroup struct {
	Name                    string            `json:"name"`
	Interval                string            `json:"interval,omitempty"`
	QueryOffset             string            `json:"query_offset,omitempty"`
	Limit                   int               `json:"limit,omitempty"`
	Labels                  map[string]string `json:"labels,omitempty"`
	PartialResponseStrategy string            `json:"partial_response_strategy,omitempty"`
	Rules                   []deployRule      `json:"rules"`
}

// deployRule is one recording or alerting rule of a deployRuleGroup.
type deployRule struct {
	Record        string            `json:"record,omitempty"`
	Alert         string            `json:"alert,omitempty"`
	Expr          string            `json:"expr"`
	For           string            `json:"for,omitempty"`
	KeepFiringFor string            `json:"keep_firing_for,omitempty"`
	Labels        map[string]string `json:"labels,omitempty"`
	Annotations   map[string]string `json:"annotations,omitempty"`
}

// deployPrometheusRule is the Prometheus Operator's PrometheusRule (monitoring.coreos.com/v1).
type deployPrometheusRule struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		Groups []deployRuleGroup `json:"groups"`
	} `json:"spec"`
}

// deployment is every object under deploy/kubernetes, or of a rendering of the Helm chart,
// by kind.
type deployment struct {
	Namespaces      []corev1.Namespace
	ServiceAccounts []corev1.ServiceAccount
	ConfigMaps      []corev1.ConfigMap
	Secrets         []corev1.Secret
	Services        []corev1.Service
	DaemonSets      []appsv1.DaemonSet
	NADs            []deployNAD
	ServiceMonitors []deployServiceMonitor
	PrometheusRules []deployPrometheusRule
}

func (d *deployment) clone() *deployment {
	c := &deployment{NADs: slices.Clone(d.NADs), ServiceMonitors: slices.Clone(d.ServiceMonitors), PrometheusRules: slices.Clone(d.PrometheusRules)}
	for _, o := range d.Services {
		c.Services = append(c.Services, *o.DeepCopy())
	}
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
	case "v1 Service":
		var o corev1.Service
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.Services = append(d.Services, o)
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
	case "monitoring.coreos.com/v1 ServiceMonitor":
		var o deployServiceMonitor
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.ServiceMonitors = append(d.ServiceMonitors, o)
	case "monitoring.coreos.com/v1 PrometheusRule":
		var o deployPrometheusRule
		if err := deployDecodeStrict(doc, &o); err != nil {
			return err
		}
		d.PrometheusRules = append(d.PrometheusRules, o)
	default:
		return fmt.Errorf("apiVersion %q kind %q: not a kind deploy/kubernetes or the chart is expected to hold (typo?)", tm.APIVersion, tm.Kind)
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
