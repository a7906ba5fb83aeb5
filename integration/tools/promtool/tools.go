//go:build tools

// Package tools pins the version of promtool, which checks and unit-tests the Prometheus
// rules in deploy/monitoring. `make tools` builds it into bin/. It is a module of its own so
// that Prometheus's dependencies never move the etcd and gRPC versions of ../go.mod.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
