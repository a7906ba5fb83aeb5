//go:build tools

// Package helmtool pins the version of Helm that renders deploy/helm/leasehold in the tests and
// in `make e2e`. It is a module of its own because Helm's dependencies (a newer gRPC,
// Prometheus client and OpenTelemetry than etcd v3.6 is built with) would otherwise raise
// the agent's. `make tools` builds it into bin/helm.
package helmtool

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
