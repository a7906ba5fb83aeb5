package integration

import (
	"fmt"
	"strings"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// TestEtcdOutOfSpace: etcd's NOSPACE alarm is raised (a quota-limited etcd filled up). ADD is
// refused with code 11 naming the cause; DEL still releases, without quarantine (etcd takes
// no put and no lease grant under the alarm, but takes deletes), and counts it in a metric, so
// that deleting pods, an operator's first step to free space, works. Once the operator frees
// space and disarms the alarm, ADD works again and DEL quarantines again.
func TestEtcdOutOfSpace(t *testing.T) {
	const quota = 4 << 20
	addr := strings.TrimPrefix(freeURL(t), "http://")
	f := newFixture(t, withEtcdFlags("--quota-backend-bytes", fmt.Sprint(quota)),
		withAgentFlags("--quarantine", "30s", "--metrics-addr", addr))
	conf := v4conf(f.Pool, f.Agent.Socket, "10.41.0.0/24")
	a := f.ipv4(conf, "ns-a", "K8S_POD_UID=uid-a")
	b := f.ipv4(conf, "ns-b", "K8S_POD_UID=uid-b")

	// Fill etcd until it raises the alarm: each put is a new 512 KiB value.
	filler := strings.Repeat("x", 512<<10)
	full := false
	for i := 0; i < 4*quota/len(filler) && !full; i++ {
		_, err := f.Cli.Put(f.Ctx, fmt.Sprintf("/filler/%d", i), filler)
		switch {
		case err == nil:
		case strings.Contains(err.Error(), rpctypes.ErrNoSpace.Error()):
			full = true
		default:
			t.Fatalf("filling etcd: %v", err)
		}
	}
	if !full {
		t.Fatalf("etcd with a %d-byte quota took %d bytes of puts without raising NOSPACE", quota, 4*quota)
	}

	_, err := f.add(conf, "ns-c", "eth0", "K8S_POD_UID=uid-c")
	if code := cniCode(err); code != 11 || !strings.Contains(err.Error(), "out of space") {
		t.Errorf("ADD under NOSPACE: code %d, %v; want code 11 naming etcd being out of space", code, err)
	}
	_, text := httpGet(t, "http://"+addr+"/metrics")
	if got := metricValue(t, text, "leasehold_etcd_nospace_refusals_total", ""); got != 1 {
		t.Errorf("NOSPACE refusals counted after the refused ADD: %v, want 1", got)
	}

	if err := f.del(conf, "ns-a", "eth0", "K8S_POD_UID=uid-a"); err != nil {
		t.Fatalf("DEL under NOSPACE: %v", err)
	}
	if exists(t, f.Cli, keyspace.IPKey(f.Pool, allocator.DefaultBlocks, a)) {
		t.Errorf("%s is still allocated after its DEL under NOSPACE", a)
	}
	if exists(t, f.Cli, keyspace.QuarantineKey(f.Pool, allocator.DefaultBlocks, a)) {
		t.Errorf("%s was quarantined although etcd takes no put", a)
	}
	_, text = httpGet(t, "http://"+addr+"/metrics")
	if got := metricValue(t, text, "leasehold_releases_without_quarantine_total", ""); got != 1 {
		t.Errorf("releases without quarantine counted: %v, want 1", got)
	}
	if got := metricValue(t, text, "leasehold_etcd_nospace_refusals_total", ""); got != 2 {
		t.Errorf("NOSPACE refusals counted after the DEL released without quarantine: %v, want 2", got)
	}

	// The operator frees space: delete the filler, compact, defragment, disarm.
	del, err := f.Cli.Delete(f.Ctx, "/filler/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Cli.Compact(f.Ctx, del.Header.Revision); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Cli.Defragment(f.Ctx, f.Endpoint); err != nil {
		t.Fatal(err)
	}
	alarms, err := f.Cli.AlarmList(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, al := range alarms.Alarms {
		if al.Alarm == pb.AlarmType_NOSPACE {
			if _, err := f.Cli.AlarmDisarm(f.Ctx, (*clientv3.AlarmMember)(al)); err != nil {
				t.Fatal(err)
			}
		}
	}

	c := f.ipv4(conf, "ns-c", "K8S_POD_UID=uid-c")
	if c == a {
		t.Logf("%s, released without quarantine, went to the next pod", c)
	}
	if err := f.del(conf, "ns-b", "eth0", "K8S_POD_UID=uid-b"); err != nil {
		t.Fatal(err)
	}
	if !exists(t, f.Cli, keyspace.QuarantineKey(f.Pool, allocator.DefaultBlocks, b)) {
		t.Errorf("%s, released after the alarm was disarmed, is not quarantined", b)
	}
}
