package integration

import (
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/internal/etcdtest"
)

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	c := http.Client{Timeout: etcdtest.Patience}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// metricValue finds one sample in Prometheus text output by name and label substring ("" for
// a metric without labels).
func metricValue(t *testing.T, text, name, labels string) float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `(?:\{([^}]*)\})? (\S+)$`)
	for _, m := range re.FindAllStringSubmatch(text, -1) {
		if strings.Contains(m[1], labels) {
			v, err := strconv.ParseFloat(m[2], 64)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
	}
	t.Fatalf("no sample %s{%s} in:\n%s", name, labels, text)
	return 0
}

// TestMetricsAndHealth: leaseholdd serves Prometheus metrics that count what happened (an ADD
// refused by an exhausted pool among them), and /readyz and leasehold_ready follow etcd's
// reachability while /healthz stays up.
func TestMetricsAndHealth(t *testing.T) {
	addr := strings.TrimPrefix(freeURL(t), "http://")
	f := newFixture(t, withAgentFlags("--metrics-addr", addr))
	name := f.Pool
	conf := netconf(name, f.Agent.Socket, dualStackIPAM("10.39.0.0/28", "fd39::/64"))
	for i := range 3 {
		if _, err := f.add(conf, fmt.Sprintf("m%d", i), "eth0", ""); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.del(conf, "m0", "eth0", ""); err != nil {
		t.Fatal(err)
	}
	_, text := httpGet(t, "http://"+addr+"/metrics")
	if got := metricValue(t, text, "leasehold_operation_duration_seconds_count", `op="add",result="ok"`); got != 3 {
		t.Errorf("ADD count %v, want 3", got)
	}
	if got := metricValue(t, text, "leasehold_operation_duration_seconds_count", `op="del",result="ok"`); got != 1 {
		t.Errorf("DEL count %v, want 1", got)
	}
	if got := metricValue(t, text, "leasehold_pool_addresses", `pool="`+name+`",set="0",state="allocated"`); got != 2 {
		t.Errorf("allocated in set 0: %v, want 2", got)
	}
	if got := metricValue(t, text, "leasehold_pool_addresses", `pool="`+name+`",set="0",state="size"`); got != 13 {
		t.Errorf("size of set 0 (a /28 less network, gateway, broadcast): %v, want 13", got)
	}
	if got := metricValue(t, text, "leasehold_etcd_request_duration_seconds_count", `kind="claim"`); got < 3 {
		t.Errorf("claim round trips counted: %v, want at least 3", got)
	}
	if got := metricValue(t, text, "leasehold_pool_exhausted_total", `pool="`+name+`"`); got != 0 {
		t.Errorf("ADDs refused for an exhausted pool before any was: %v, want 0", got)
	}

	// A pool with one address: the second ADD is refused, and counted for that pool only.
	tiny := name + "-tiny"
	tinyConf := v4conf(tiny, f.Agent.Socket, "10.39.1.0/30")
	if _, err := f.add(tinyConf, "t0", "eth0", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := f.add(tinyConf, "t1", "eth0", ""); err == nil {
		t.Fatal("ADD into a full pool of one address succeeded")
	}
	_, text = httpGet(t, "http://"+addr+"/metrics")
	if got := metricValue(t, text, "leasehold_pool_exhausted_total", `pool="`+tiny+`"`); got != 1 {
		t.Errorf("ADDs refused for pool %s being exhausted: %v, want 1", tiny, got)
	}
	if got := metricValue(t, text, "leasehold_pool_exhausted_total", `pool="`+name+`"`); got != 0 {
		t.Errorf("ADDs refused for pool %s, which has room: %v, want 0", name, got)
	}

	if code, _ := httpGet(t, "http://"+addr+"/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	if code, body := httpGet(t, "http://"+addr+"/readyz"); code != 200 {
		t.Errorf("/readyz with etcd up = %d %s", code, body)
	}
	if got := metricValue(t, text, "leasehold_ready", ""); got != 1 {
		t.Errorf("leasehold_ready with etcd up = %v, want 1", got)
	}
	f.Etcd.kill()
	eventually(t, "/readyz reports etcd gone", func() error {
		code, body := httpGet(t, "http://"+addr+"/readyz")
		return saw(code == http.StatusServiceUnavailable, "/readyz = %d %s", code, body)
	})
	_, text = httpGet(t, "http://"+addr+"/metrics")
	if got := metricValue(t, text, "leasehold_ready", ""); got != 0 {
		t.Errorf("leasehold_ready with etcd gone = %v, want 0", got)
	}
	if code, _ := httpGet(t, "http://"+addr+"/healthz"); code != 200 {
		t.Errorf("/healthz must stay up while etcd is away, got %d", code)
	}
}
