# leasehold: `make demo` runs the whole thing on an embedded etcd; `make test` runs every test.
GO        ?= go
BIN       := $(CURDIR)/bin
VERSION   ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
TOOLS_MOD := integration/tools
HELM_MOD  := integration/helmtool
PROMTOOL_MOD := integration/tools/promtool

# The binaries are static (no cgo) so they run on any host; the race detector in `make test`
# needs cgo, so CGO_ENABLED is set per build command, not exported.
GOBUILD   := CGO_ENABLED=0 $(GO) build -trimpath

.PHONY: all build tools deps test test-unit demo bench soak chaos fuzz soak-fuzz lint clean e2e

# Fuzz targets as Name:package. `make fuzz` runs each for FUZZTIME (make test runs it);
# `make soak-fuzz` runs each for SOAK_FUZZTIME. A failure leaves its input in the
# package's testdata/fuzz/<Name>/, where it stays as a regression seed.
FUZZ_TARGETS  := FuzzParseConfig:./cniplugin FuzzParseCNIArgs:./cniplugin \
                 FuzzWireRequest:./cniplugin/agentapi FuzzServe:./cniplugin/agentapi \
                 FuzzValidateName:./allocator FuzzKeys:./keyspace FuzzJournalLoad:./leases/podbook \
                 FuzzJSON:./cniplugin/thin FuzzInvoke:./cniplugin
FUZZTIME      ?= 5s
SOAK_FUZZTIME ?= 30m

all: build

build:
	@mkdir -p $(BIN)/cni
	$(GOBUILD) -ldflags '$(LDFLAGS)' -o $(BIN)/leasehold ./cmd/leasehold
	$(GOBUILD) -ldflags '$(LDFLAGS)' -o $(BIN)/leaseholdd ./cmd/leaseholdd
	$(GOBUILD) -ldflags '$(LDFLAGS)' -o $(BIN)/leaseholdctl ./cmd/leaseholdctl
	cp $(BIN)/leasehold $(BIN)/cni/leasehold

# Programs the tests drive, built from the versions pinned in integration/tools/go.mod:
# etcd, etcdctl and etcdutl (v3.6.16; etcdutl restores a snapshot), cnitool (cni v1.3.1),
# reference plugins (plugins v1.9.1); Helm (v3.22.0, integration/helmtool/go.mod, a module of
# its own so that its dependencies do not raise etcd's), which renders deploy/helm/leasehold in
# the tests and in `make e2e`; and from integration/tools/promtool/go.mod: promtool (prometheus
# v0.316.0) and promqlnames.
tools: $(BIN)/etcd $(BIN)/etcdctl $(BIN)/etcdutl $(BIN)/cnitool $(BIN)/cni/bridge $(BIN)/helm $(BIN)/promtool $(BIN)/promqlnames

$(BIN)/etcd: $(TOOLS_MOD)/go.mod $(TOOLS_MOD)/etcd/main.go
	cd $(TOOLS_MOD) && $(GOBUILD) -o $(BIN)/etcd ./etcd
$(BIN)/etcdctl: $(TOOLS_MOD)/go.mod
	cd $(TOOLS_MOD) && $(GOBUILD) -o $(BIN)/etcdctl go.etcd.io/etcd/etcdctl/v3
$(BIN)/etcdutl: $(TOOLS_MOD)/go.mod
	cd $(TOOLS_MOD) && $(GOBUILD) -o $(BIN)/etcdutl go.etcd.io/etcd/etcdutl/v3
$(BIN)/cnitool: $(TOOLS_MOD)/go.mod
	cd $(TOOLS_MOD) && $(GOBUILD) -o $(BIN)/cnitool github.com/containernetworking/cni/cnitool
$(BIN)/helm: $(HELM_MOD)/go.mod
	cd $(HELM_MOD) && $(GOBUILD) -ldflags '-s -w' -o $(BIN)/helm helm.sh/helm/v3/cmd/helm
$(BIN)/cni/bridge: $(TOOLS_MOD)/go.mod
	@mkdir -p $(BIN)/cni
	cd $(TOOLS_MOD) && $(GOBUILD) -o $(BIN)/cni/ \
		github.com/containernetworking/plugins/plugins/main/bridge \
		github.com/containernetworking/plugins/plugins/main/macvlan \
		github.com/containernetworking/plugins/plugins/main/loopback \
		github.com/containernetworking/plugins/plugins/ipam/host-local

# promtool checks and unit-tests deploy/monitoring's rules; promqlnames lists the metrics a
# PromQL expression names, for the test comparing the dashboard and rules with /metrics. Their
# module is apart so that Prometheus's dependencies never move the etcd and gRPC versions
# above. remove_all_sd leaves out service discovery (cloud SDKs, Kubernetes), which rules never
# use: promtool then builds in under 4 minutes from a cold build cache on 2 cores (6 without).
$(BIN)/promtool: $(PROMTOOL_MOD)/go.mod
	cd $(PROMTOOL_MOD) && $(GOBUILD) -tags remove_all_sd -o $(BIN)/promtool github.com/prometheus/prometheus/cmd/promtool
$(BIN)/promqlnames: $(PROMTOOL_MOD)/go.mod $(PROMTOOL_MOD)/promqlnames/main.go
	cd $(PROMTOOL_MOD) && $(GOBUILD) -o $(BIN)/promqlnames ./promqlnames

# The programs the tests drive that Go does not build (ip, iptables, openssl, containerd,
# runc, a static busybox): installed with apt-get when missing (root), or named with the
# command that installs them. make test needs root and stops, saying so, without it.
deps:
	./scripts/deps.sh

# Unit tests and integration tests against real etcd (embedded and a separate process),
# the real plugin binary and the real agent. The integration package (etcd processes, agents,
# containerd) and leases (an embedded etcd, histories of many agents) each keep two cores
# busy under -race; run at once, as go test runs packages, each slowed the other past what
# its tests waited for (issue 36). So the integration package runs on its own, after the
# rest; leases runs beside the light packages, which end early.
GOTEST := LEASEHOLD_BIN=$(BIN) LEASEHOLD_TEST_ALL=1 $(GO) test -race -count=1 -timeout 15m
test: deps build tools
	$(GOTEST) $$($(GO) list ./... | grep -v '/integration$$')
	$(GOTEST) ./integration/
	$(MAKE) fuzz

fuzz:
	GO=$(GO) ./scripts/fuzz.sh $(FUZZTIME) $(FUZZ_TARGETS)

soak-fuzz:
	$(MAKE) fuzz FUZZTIME=$(SOAK_FUZZTIME)

test-unit:
	$(GO) test -count=1 ./allocator/... ./cniplugin/...

# Long randomized histories against real etcd (hours with a large LEASEHOLD_MODEL_STEPS).
soak:
	LEASEHOLD_MODEL_STEPS=$${LEASEHOLD_MODEL_STEPS:-20000} $(GO) test -count=1 -timeout 0 -run TestModelRandomHistories -v ./leases/

# The fault-injection run (integration/chaos; root): 3 etcd members and LEASEHOLD_CHAOS_NODES
# agents (default 5, at least 5), each in its own network namespace on one bridge, a simulated
# runtime creating and deleting pods through the real plugin (and 2-4 VMs it live-migrates
# between the nodes: their pods name a migratable claim), and seeded faults (links cut
# shorter than, between and beyond TTL and reuse delay, kill -9, SIGSTOP, node deaths, an etcd
# member killed or its leader cut off, compactions, issue 27's races, the whole etcd cluster
# restored from a backup (bin/etcdutl, plain or --bump-revision --mark-compacted), a running
# pod's key deleted or overwritten with etcdctl) for LEASEHOLD_CHAOS_DURATION (default 10m here,
# 2m in make test); then a checker judges the recorded history: overlaps (a migration's two
# pods count as one owner), conflicts and their justification, leaks, lost keys,
# resurrections, keys missing, the repair after a restore or an edited key, doctor.
# A new seed each time unless LEASEHOLD_CHAOS_SEED replays one (make test runs seed 1 for 2m);
# LEASEHOLD_CHAOS_SEEDS=N runs N seeds in a row; a failing run prints its seed, the command
# replaying it and the directory with its logs and history.json. Results: docs/chaos.md.
chaos: build tools
	LEASEHOLD_BIN=$(BIN) LEASEHOLD_CHAOS_SEED=$${LEASEHOLD_CHAOS_SEED:-random} LEASEHOLD_CHAOS_DURATION=$${LEASEHOLD_CHAOS_DURATION:-10m} \
		$(GO) test -count=1 -timeout 0 -run '^TestChaos$$' -v ./integration/

demo: build tools
	BIN=$(BIN) ./deploy/demo.sh

# Go benchmarks (benchstat-friendly), then the side-by-side suite: a real etcd process (fsync on),
# host-local and the real binaries; writes bench/results/ (results.md, results.csv, the PNG).
bench: build tools
	$(GO) test -run '^$$' -bench . -benchmem ./allocator/ ./leases/
	cd integration/bench && $(GO) run . -bin $(BIN) -out ../../bench/results

# leasehold installed with its Helm chart (the objects of deploy/kubernetes), rendered by
# bin/helm, on a single-node Kubernetes made on this machine (root; Debian's
# containerd, runc and busybox-static; not part of `make test` or CI): docs/e2e.md. Kubernetes
# (e2e/tools/go.mod) is built once into E2E_CACHE, niced (about 15 minutes). E2E_FLAGS: -keep, -v.
E2E_CACHE ?= $(HOME)/.cache/leasehold-e2e
e2e: build tools
	cd e2e && $(GO) run . -repo $(CURDIR) -cache $(E2E_CACHE) $(E2E_FLAGS)

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	cd $(TOOLS_MOD) && $(GO) vet ./...
	cd $(PROMTOOL_MOD) && $(GO) vet ./...
	cd integration/bench && $(GO) vet ./...

clean:
	rm -rf $(BIN)
