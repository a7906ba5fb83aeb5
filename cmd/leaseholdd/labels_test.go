package main

import (
	"io"
	"maps"
	"testing"
)

// TestNodeLabelFlags: --node-label gives the agent its node's labels, repeatable or
// comma-separated; an empty one adds none (the deployment files' default); a label without
// '=' is refused.
func TestNodeLabelFlags(t *testing.T) {
	base := []string{"--etcd-endpoints", "http://127.0.0.1:2379"}
	o, err := parse(append(base, "--node-label", "zone=a,rack=r1", "--node-label", "gpu="), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if want := (labelFlag{"zone": "a", "rack": "r1", "gpu": ""}); !maps.Equal(o.nodeLabels, want) {
		t.Errorf("labels %v, want %v", o.nodeLabels, want)
	}
	if o, err := parse(append(base, "--node-label="), io.Discard); err != nil || len(o.nodeLabels) != 0 {
		t.Errorf("--node-label= (empty): %v, %v; want no labels", o.nodeLabels, err)
	}
	if _, err := parse(append(base, "--node-label", "zone"), io.Discard); err == nil {
		t.Error("--node-label zone (no '=') was accepted")
	}
}
