//go:build tools

// Package tools pins the Kubernetes programs `make e2e` builds into its cache
// ($(HOME)/.cache/leasehold-e2e/k8s-<version>/).
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
