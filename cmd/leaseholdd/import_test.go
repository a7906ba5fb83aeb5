package main

import (
	"io"
	"strings"
	"testing"
)

// TestImportFlags checks the import flags' grammar, NETWORK[/POOL][=PATH], their defaults and
// the refusals that keep a whereabouts import to this node's pods.
func TestImportFlags(t *testing.T) {
	base := []string{"--etcd-endpoints", "http://127.0.0.1:2379"}
	o, err := parse(append(base, "--import-host-local", "net1", "--import-host-local", "net2/pool2=/data/net2",
		"--import-whereabouts", "net3=/tmp/pools.json", "--import-pods", "/tmp/pods.json", "--import-ifname", "net1"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := []importSource{{"net1", "", "/var/lib/cni/networks/net1"}, {"net2", "pool2", "/data/net2"}}
	if got := o.imports.hostLocal.list; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("--import-host-local: %+v, want %+v", got, want)
	}
	if got := o.imports.whereabouts.list; len(got) != 1 || got[0] != (importSource{"net3", "", "/tmp/pools.json"}) {
		t.Errorf("--import-whereabouts: %+v", got)
	}
	if o.imports.ifName != "net1" || o.imports.pods != "/tmp/pods.json" {
		t.Errorf("--import-ifname %q, --import-pods %q", o.imports.ifName, o.imports.pods)
	}
	if o, err := parse(base, io.Discard); err != nil || o.imports.ifName != "eth0" {
		t.Errorf("without import flags: %v, interface %q", err, o.imports.ifName)
	}
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--import-whereabouts", "net3"}, "names no file"},
		{[]string{"--import-whereabouts", "net3=/p.json"}, "needs --import-pods"},
		{[]string{"--import-pods", "/pods.json"}, "only read with --import-whereabouts"},
		{[]string{"--import-host-local", "../x=/d"}, "invalid name"},
		{[]string{"--import-host-local", "net1/=/d"}, "pool name is empty"},
		{[]string{"--import-host-local", "net1", "--import-ifname", "a/b"}, "invalid name"},
	} {
		if _, err := parse(append(base, tt.args...), io.Discard); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%v: want an error with %q, got %v", tt.args, tt.want, err)
		}
	}
}
