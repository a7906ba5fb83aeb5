package integration

import (
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
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

// TestMetricsCountFallbacksAndRefusals: a pod that asks for two pools in order, each of one
// address. The second ADD finds the first pool full and passes to the next (a fallback); the
// third finds both full and is refused with code 102, counted once, for the last pool.
func TestMetricsCountFallbacksAndRefusals(t *testing.T) {
	addr := strings.TrimPrefix(freeURL(t), "http://")
	f := newFixture(t, withAgentFlags("--metrics-addr", addr))
	first, next := f.Pool, uniq("next")
	conf := v4conf(first, f.Agent.Socket, "10.39.2.0/30")
	if _, err := admin.CreatePool(f.Ctx, f.Cli, allocator.PoolSpec{Name: next,
		Ranges: []allocator.RangeSet{{{Subnet: netip.MustParsePrefix("10.39.3.0/30")}}}}); err != nil {
		t.Fatal(err)
	}
	pod := func(n int) string {
		return fmt.Sprintf("K8S_POD_UID=fb%d;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=fb%d;LEASEHOLD_POOL=%s,%s", n, n, first, next)
	}
	// Refused (code 7, nothing written) until the agent has read pool next.
	var ip1 netip.Addr
	eventually(t, "the first ADD, into the first pool", func() error {
		res, err := f.add(conf, "fb1", "eth0", pod(1))
		if err == nil {
			ip1 = netip.MustParseAddr(res.IPs[0].Address.IP.String())
		}
		return err
	})
	if ip2 := f.ipv4(conf, "fb2", pod(2)); !netip.MustParsePrefix("10.39.2.0/30").Contains(ip1) || !netip.MustParsePrefix("10.39.3.0/30").Contains(ip2) {
		t.Fatalf("ADDs got %s and %s; want one of %s (10.39.2.0/30), then one of %s (10.39.3.0/30)", ip1, ip2, first, next)
	}
	_, err := f.add(conf, "fb3", "eth0", pod(3))
	if code := cniCode(err); code != 102 || !strings.Contains(err.Error(), first) || !strings.Contains(err.Error(), next) {
		t.Fatalf("ADD with both pools full: code %d, %v; want 102 naming both pools", code, err)
	}
	_, text := httpGet(t, "http://"+addr+"/metrics")
	for _, c := range []struct {
		name, labels string
		want         float64
	}{
		{"leasehold_pool_fallbacks_total", `from="` + first + `",to="` + next + `"`, 2},
		{"leasehold_pool_exhausted_refusals_total", `pool="` + next + `"`, 1},
		{"leasehold_pool_exhausted_refusals_total", `pool="` + first + `"`, 0}, // passed on, never refused
		{"leasehold_pool_exhausted_total", `pool="` + first + `"`, 2},
		{"leasehold_pool_exhausted_total", `pool="` + next + `"`, 1},
	} {
		if got := metricValue(t, text, c.name, c.labels); got != c.want {
			t.Errorf("%s{%s} = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}
