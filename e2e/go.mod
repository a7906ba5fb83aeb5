// The end-to-end run of the Helm chart deploy/helm/leasehold on a single-node Kubernetes
// (`make e2e`, docs/e2e.md). Standard library only; the Kubernetes programs it runs are pinned
// in tools/go.mod, and it renders the chart with bin/helm (integration/helmtool/go.mod).
module github.com/leasehold/leasehold/e2e

go 1.26.8
