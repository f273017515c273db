# leasehold: one Makefile for the go.work monorepo. Every target loops over
# the workspace modules, because `go test ./...` at the root reaches none of them.
SHELL := /bin/bash
MODULES := $(shell go list -m -f '{{.Dir}}')
SERVICES := worker scheduler gateway api site-agent doctor node
BIN := $(CURDIR)/bin
# buf and the protoc plugins are pinned as tool directives in tools/go.mod,
# a module kept out of go.work so buf's dependencies never change the
# versions the services build with.
BUF := GOWORK=off go -C tools tool buf

.PHONY: all build test test-short generate check-generated lint vet fmt migrate run tidy bench clean stop check-modules

all: build

# VERSION and REVISION are stamped into every binary (pkg/buildinfo): --version,
# leasehold_build_info, /healthz/detail and the daemon's Hello report them.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
LDFLAGS := -X github.com/leasehold/leasehold/pkg/buildinfo.version=$(VERSION) -X github.com/leasehold/leasehold/pkg/buildinfo.revision=$(REVISION)

## build: compile every service into ./bin, and the operator CLI as bin/leasehold, stamped with VERSION (git describe)
build:
	@mkdir -p $(BIN)
	@for s in $(SERVICES); do \
		(cd services/$$s && CGO_ENABLED=0 go build -ldflags '$(LDFLAGS)' -o $(BIN)/leasehold-$$s .) || exit 1; \
	done
	@# the operator CLI (services/cli) is bin/leasehold, not leasehold-cli
	@cd services/cli && CGO_ENABLED=0 go build -ldflags '$(LDFLAGS)' -o $(BIN)/leasehold .

## test: run every module's tests against a real PostgreSQL (see pkg/pgtest);
## a failing module does not stop the others: all failures are listed at the end
test: build
	@failed=(); for m in $(MODULES); do \
		echo "== $${m#$(CURDIR)/}"; \
		(cd $$m && go test -count=1 -timeout 15m ./...) || failed+=("$${m#$(CURDIR)/}"); \
	done; \
	if [ $${#failed[@]} -gt 0 ]; then echo "FAILED modules: $${failed[*]}" >&2; exit 1; fi; \
	echo "every module passed"

## test-docker: the whole suite against postgres:16 in a Docker container
## (tools/pgcontainer starts it through dockertest, sets LEASEHOLD_TEST_DATABASE_URL
## and removes it afterwards); needs a Docker engine, which CI does not have
.PHONY: test-docker
test-docker: build
	GOWORK=off go -C tools/pgcontainer run . -- $(MAKE) -C $(CURDIR) test

## test-gateway-std: the gateway module and e2e again on net/http's HTTP/2
## server (--gateway.http2-server=std), so the fallback stays tested
.PHONY: test-gateway-std
test-gateway-std: build
	@set -e; for m in services/gateway e2e; do \
		echo "== LEASEHOLD_GATEWAY_HTTP2_SERVER=std $$m"; \
		(cd $$m && LEASEHOLD_GATEWAY_HTTP2_SERVER=std go test -count=1 -timeout 15m ./...); \
	done

## test-race: every module's tests under the race detector; the services that
## tests start as real processes are built with -race too (pkg/proctest), and
## a race they report fails the test. RACE_TEST_FLAGS adds flags (CI: -short).
RACE_TEST_FLAGS ?=
.PHONY: test-race
test-race:
	@set -e; for m in $(MODULES); do \
		echo "== -race $${m#$(CURDIR)/}"; \
		(cd $$m && go test -race -count=1 -timeout 30m $(RACE_TEST_FLAGS) ./...); \
	done

## h2spec: the HTTP/2 conformance suite (h2spec, pinned in tools/h2spec)
## against the lean server and net/http's, with the same trivial handler;
## the lean server must pass every case net/http passes (docs/gateway.md)
.PHONY: h2spec
h2spec:
	@set -e; out=$$(mktemp -d); trap 'rm -rf "$$out"' EXIT; \
	GOWORK=off go -C tools/h2spec build -o "$$out/h2spec" github.com/summerwind/h2spec/cmd/h2spec; \
	cd services/gateway && LEASEHOLD_H2SPEC="$$out/h2spec" go test -count=1 -run '^TestH2spec$$' ./internal/h2serve/

## test-stress: the packages with real-time tests, STRESS_COUNT runs in a row
## (20 by default), with STRESS_HOGS busy loops (3) beside them taking the CPU
## a loaded CI machine would; the first failure stops it. STRESS_PKGS narrows
## the set (module-relative paths, e.g. STRESS_PKGS="pkg:./coord/").
STRESS_COUNT ?= 20
STRESS_HOGS ?= 3
STRESS_PKGS ?= pkg:./coord/ pkg:./reconcile/ pkg:./queue/ services/gateway:./... e2e:./...
.PHONY: test-stress
test-stress: build
	@set -e; hogs=(); trap 'kill $${hogs[*]} 2>/dev/null || true' EXIT; \
	for i in $$(seq $(STRESS_HOGS)); do sh -c 'while :; do :; done' & hogs+=($$!); done; \
	echo "== $(STRESS_HOGS) CPU hogs: $${hogs[*]}"; \
	for p in $(STRESS_PKGS); do \
		echo "== -short -count=$(STRESS_COUNT) $${p%%:*} $${p#*:}"; \
		(cd $${p%%:*} && go test -short -failfast -count=$(STRESS_COUNT) -timeout 60m $${p#*:}); \
	done

## test-short: the same without the slow real-time failover tests
test-short:
	@set -e; for m in $(MODULES); do (cd $$m && go test -short -count=1 ./...); done

## generate: regenerate pkg/gen from proto/ with the pinned buf and plugins
generate:
	$(BUF) generate --template ../buf.gen.yaml -o .. ..
	@gofmt -w pkg/gen >/dev/null

## check-generated: fail when pkg/gen is stale against proto/
check-generated: generate
	@git diff --exit-code --stat -- pkg/gen || (echo "pkg/gen is stale: run make generate and commit" >&2; exit 1)
	@test -z "$$(git status --porcelain -- pkg/gen)" || (git status --porcelain -- pkg/gen; echo "pkg/gen has untracked generated files: run make generate and commit" >&2; exit 1)

## lint: buf lint, gofmt, go vet and golangci-lint over every module, and
## the rule that only pkg/coord writes or locks the leases table
lint: vet golangci check-lease-statements
	$(BUF) lint ..
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
		if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi

## golangci: golangci-lint (pinned in tools/golangci, a module outside
## go.work) with .golangci.yml over every module; the linters and why:
## docs/decisions.md. One run over all the workspace's modules (go.work
## resolves ./<module>/... patterns), so the packages they share are loaded
## and analysed once; results are cached in GOLANGCI_LINT_CACHE (default
## ~/.cache/golangci-lint), so a run after a small change is quick.
GOLANGCI_PATTERNS := $(patsubst $(CURDIR)/%,./%/...,$(MODULES))
.PHONY: golangci
golangci:
	@mkdir -p $(BIN)
	@GOWORK=off go -C tools/golangci build -o $(BIN)/golangci-lint github.com/golangci/golangci-lint/v2/cmd/golangci-lint
	$(BIN)/golangci-lint run --config $(CURDIR)/.golangci.yml $(GOLANGCI_PATTERNS)

vet:
	@for m in $(MODULES); do (cd $$m && go vet ./...) || exit 1; done

## check-lease-statements: no Go file outside pkg/coord (tests, pkg/gen and
## migrations aside) writes or locks the leases table; the rule and its
## exceptions are in pkg/coord/leasestatements_test.go
.PHONY: check-lease-statements
check-lease-statements:
	cd pkg && go test -count=1 -run '^TestLeaseStatement' ./coord/

fmt:
	gofmt -w $$(git ls-files '*.go')

## migrate: apply migrations to LEASEHOLD_DATABASE_URL (or the .dev cluster)
migrate:
	go run ./tools/devstack -migrate-only

## run: start PostgreSQL under .dev/ (unless LEASEHOLD_DATABASE_URL is set) and every service
## (built, not `go run`: go run exits 1 on Ctrl-C even when the stack stopped cleanly)
run: build
	go build -ldflags '$(LDFLAGS)' -o $(BIN)/leasehold-devstack ./tools/devstack
	$(BIN)/leasehold-devstack -bin $(BIN) $(RUN_ARGS)

tidy:
	@for m in $(MODULES) $(CURDIR)/tools $(CURDIR)/tools/h2spec $(CURDIR)/tools/golangci $(CURDIR)/tools/pgcontainer; do (cd $$m && GOWORK=off go mod tidy) || exit 1; done

## breaking: buf's breaking-change check of proto/ (the working tree) against
## the protos of BREAKING_AGAINST, by default HEAD^1: in CI, a fresh clone of
## the submitted main, that is the previous main (the first parent). The old
## protos come from `git archive`, so this works in clones and worktrees alike;
## locally, `make breaking BREAKING_AGAINST=main` checks a branch's changes.
BREAKING_AGAINST ?= HEAD^1
breaking:
	@set -eo pipefail; \
	base=$$(git rev-parse --verify --quiet '$(BREAKING_AGAINST)^{commit}') || { \
		echo "breaking: $(BREAKING_AGAINST) is not a commit of this clone (shallow? git fetch --deepen=1)" >&2; exit 1; }; \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	git archive "$$base" buf.yaml proto | tar -x -C "$$tmp"; \
	echo "buf breaking: proto/ against $(BREAKING_AGAINST) ($$(git rev-parse --short "$$base"))"; \
	$(BUF) breaking $(CURDIR) --against "$$tmp" && echo "no breaking change"

# --- TypeScript client (clients/ts) -------------------------------------------
# Connect-ES v2 code generated by the buf pinned in tools/go.mod with the
# protoc-gen-es pinned in clients/ts/package.json (npm ci installs it).
TS_CLIENT := clients/ts
.PHONY: generate-ts check-generated-ts test-ts

## generate-ts: regenerate clients/ts/src/gen from proto/
generate-ts:
	cd $(TS_CLIENT) && npm ci --no-audit --no-fund && npm run generate

## check-generated-ts: fail when clients/ts/src/gen is stale against proto/
check-generated-ts: generate-ts
	@git diff --exit-code --stat -- $(TS_CLIENT)/src/gen || (echo "$(TS_CLIENT)/src/gen is stale: run make generate-ts and commit" >&2; exit 1)
	@test -z "$$(git status --porcelain -- $(TS_CLIENT)/src/gen)" || (git status --porcelain -- $(TS_CLIENT)/src/gen; echo "$(TS_CLIENT)/src/gen has untracked generated files: run make generate-ts and commit" >&2; exit 1)

## test-ts: compile the TypeScript client (tsc) and run its test against a
## throwaway leasehold-api on a throwaway PostgreSQL (tools/devstack/withapi)
test-ts: check-generated-ts
	@mkdir -p $(BIN)
	cd services/api && go build -o $(BIN)/leasehold-api .
	cd $(TS_CLIENT) && npm run build
	go run ./tools/devstack/withapi -bin $(BIN) -- npm --prefix $(TS_CLIENT) test

clean:
	rm -rf $(BIN)

## stop: stop the development cluster under .dev/
stop:
	go run ./tools/devstack -stop

# --- deployment artefacts (deploy/) ------------------------------------------

IMAGE_REGISTRY ?= ghcr.io/leasehold
IMAGE_TAG ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
DOCKER ?= docker
CHART := $(CURDIR)/deploy/helm/leasehold
# helm and kubeconform are pinned in tools/k8s/go.mod, the PromQL parser in
# tools/promql/go.mod: modules of their own, outside go.work, so neither moves
# the versions the services or buf build with. `go -C` runs them from their
# module, hence the absolute paths.
HELM := GOWORK=off go -C tools/k8s tool helm
KUBECONFORM := GOWORK=off go -C tools/k8s tool kubeconform
# The ServiceMonitor and PrometheusRule render only when the cluster serves
# their API; `helm template` is told it does, so kubeconform and the PromQL
# check see them.
HELM_MONITORING_APIS := --api-versions monitoring.coreos.com/v1/ServiceMonitor --api-versions monitoring.coreos.com/v1/PrometheusRule

.PHONY: images helm-lint haproxy-check

## images: one image per service plus the migration image (needs a Docker engine with BuildKit)
images:
	@set -e; for s in $(SERVICES); do \
		echo "== $(IMAGE_REGISTRY)/leasehold-$$s:$(IMAGE_TAG)"; \
		$(DOCKER) build -f deploy/docker/Dockerfile --build-arg SERVICE=$$s --build-arg VERSION=$(IMAGE_TAG) --build-arg REVISION=$(REVISION) \
			-t $(IMAGE_REGISTRY)/leasehold-$$s:$(IMAGE_TAG) .; \
	done
	@echo "== $(IMAGE_REGISTRY)/leasehold-migrate:$(IMAGE_TAG)"
	$(DOCKER) build -f deploy/docker/Dockerfile --target migrate -t $(IMAGE_REGISTRY)/leasehold-migrate:$(IMAGE_TAG) .

## helm-lint: helm lint + template + kubeconform of the chart (default and HA values), its guards, PromQL of alerts and dashboard, and deploy/helm/check.sh (schema, monitoring gating, NOTES, dashboard ConfigMap, runbook anchors)
# The example balancer config in deploy/haproxy parses (haproxy from the
# distribution: apt-get install -y haproxy).
haproxy-check:
	haproxy -c -f deploy/haproxy/haproxy.cfg

helm-lint:
	@set -eo pipefail; out=$$(mktemp -d); trap 'rm -rf "$$out"' EXIT; \
	GOWORK=off go -C tools/k8s run ./schemagen -out "$$out/schemas"; \
	for v in values values-ha; do \
		echo "== $$v.yaml"; \
		$(HELM) lint --strict $(CHART) -f $(CHART)/$$v.yaml; \
		$(HELM) template leasehold $(CHART) --namespace leasehold -f $(CHART)/$$v.yaml $(HELM_MONITORING_APIS) > "$$out/rendered-$$v.yaml"; \
		$(KUBECONFORM) -strict -summary -schema-location "$$out/schemas/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
			"$$out/rendered-$$v.yaml" | tee "$$out/kubeconform.txt"; \
		grep -q 'Valid: [1-9]' "$$out/kubeconform.txt" || { echo "kubeconform validated nothing" >&2; exit 1; }; \
	done; \
	echo "== guards: configurations that break an ordering must not render"; \
	if $(HELM) template leasehold $(CHART) --set gateway.terminationGracePeriodSeconds=60 >/dev/null 2>"$$out/guard.err"; then \
		echo "helm template accepted gateway.terminationGracePeriodSeconds=60 (drain needs 95 s)" >&2; exit 1; fi; \
	grep -q 'terminationGracePeriodSeconds' "$$out/guard.err"; \
	if $(HELM) template leasehold $(CHART) --set coord.renewInterval=8s >/dev/null 2>"$$out/guard.err"; then \
		echo "helm template accepted coord.renewInterval=8s with a 15s TTL" >&2; exit 1; fi; \
	grep -q 'renewInterval' "$$out/guard.err"; \
	echo "ok"; \
	echo "== PromQL"; \
	GOWORK=off go -C tools/promql run . "$$out/rendered-values.yaml" "$$out/rendered-values-ha.yaml" $(CURDIR)/deploy/grafana/leasehold.json; \
	echo "== chart behaviour (deploy/helm/check.sh)"; \
	helm_bin=$$(GOWORK=off go -C tools/k8s tool -n helm 2>/dev/null || true); \
	if [ -x "$$helm_bin" ]; then HELM="$$helm_bin" deploy/helm/check.sh; else HELM="$(HELM)" deploy/helm/check.sh; fi

# ---- benches (bench/): failover gates and throughput, real processes ----
# Results (JSON) go to bench/results/ (git-ignored). HAProxy, the balancer in
# front of the gateways, comes from the distribution and is installed when
# missing.
BENCH_RESULTS := $(CURDIR)/bench/results
BENCH_RUNS ?= 20
BENCH_NODES ?= 3000
BENCH_HAPROXY = command -v haproxy >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq haproxy >/dev/null; }

.PHONY: bench-failover bench-throughput demo

## bench-failover: multi-gateway gate (3,000 nodes, kill) + lease failover (crash, pause, SIGTERM; River side by side)
bench-failover:
	@$(BENCH_HAPROXY)
	@mkdir -p $(BENCH_RESULTS)
	cd bench && go run ./multi-gateway -scenario kill -nodes $(BENCH_NODES) -json $(BENCH_RESULTS)/multigateway-kill-$(BENCH_NODES).json
	cd bench && go run ./cmd/leasefailover -runs $(BENCH_RUNS) -json $(BENCH_RESULTS)/leasefailover.json

## bench-dbfailover: PostgreSQL's own faults under load (45 s outage, fast restart, promotion of a
## synchronous and an asynchronous standby): time until every lease is held again, lost, duplicated,
## restarted, two holders. DBFAILOVER_ARGS passes flags (e.g. -scenario promote-async -timings fast).
DBFAILOVER_ARGS ?=
.PHONY: bench-dbfailover
bench-dbfailover:
	@$(BENCH_HAPROXY)
	@mkdir -p $(BENCH_RESULTS)
	cd bench && go run ./cmd/dbfailover -json $(BENCH_RESULTS)/dbfailover.json $(DBFAILOVER_ARGS)

## bench-throughput: commands/s end to end through 1 and 3 gateways, and River's jobs/s on the same server
bench-throughput:
	@$(BENCH_HAPROXY)
	@mkdir -p $(BENCH_RESULTS)
	cd bench && go run ./cmd/throughput -json $(BENCH_RESULTS)/throughput.json

## bench-scale: PostgreSQL's cost of 1,000/5,000/10,000 idle nodes and of one command per node per minute; nodes per primary
.PHONY: bench-scale
bench-scale:
	@$(BENCH_HAPROXY)
	@mkdir -p $(BENCH_RESULTS)
	cd bench && go run ./cmd/scale -json $(BENCH_RESULTS)/scale.json

## bench-node: the real leasehold-node against its targets: idle RSS and CPU, exec /bin/true
## create-to-done (p50/p90/p99 and its phases), 100 MiB of live output to a live reader at the
## default and raised output caps. NODE_BENCH_ARGS passes flags (e.g. -idle 10s -execs 50).
NODE_BENCH_ARGS ?=
.PHONY: bench-node
bench-node:
	@mkdir -p $(BENCH_RESULTS)
	cd bench && go run ./cmd/nodeagent -out $(BENCH_RESULTS)/nodeagent.json $(NODE_BENCH_ARGS)

## demo: PostgreSQL, the whole control plane, 300 simulated nodes; kills a gateway and shows the recovery live
demo:
	@$(BENCH_HAPROXY)
	cd bench && go run ./multi-gateway -scenario kill -nodes 300 -site-agents 2 -warmup 10s -observe 20s -rate 20 -progress

## check-large-files: no tracked file over 1 MiB (built binaries, packages and
## downloads stay out of the repository; see .gitignore)
.PHONY: check-large-files
check-large-files:
	@big=$$(git ls-files -z | xargs -0 stat -c '%s %n' 2>/dev/null | awk '$$1 > 1048576'); \
		if [ -n "$$big" ]; then echo "files over 1 MiB are tracked (built or fetched? they belong in .gitignore):"; echo "$$big"; exit 1; fi; \
		echo "no tracked file over 1 MiB"

## check-links: every relative link and #anchor of the Markdown files resolves
.PHONY: check-links
check-links:
	go run ./tools/doclinks -root .

## check-modules: every module builds and vets on its own (GOWORK=off), through its replace directives
check-modules:
	@for m in $(MODULES) $(CURDIR)/tools/pgcontainer; do echo "== GOWORK=off $${m#$(CURDIR)/}"; (cd $$m && GOWORK=off go vet ./...) || exit 1; done

## test-pgbouncer: the whole suite twice more through a real PgBouncer in
## transaction mode (pkg/pgtest): with LISTEN on a direct URL, then without
## (every waiter polls). Needs the pgbouncer binary (apt-get install pgbouncer).
PGBOUNCER_MODES ?= 1 nolisten
PGBOUNCER_TEST_FLAGS ?=
.PHONY: test-pgbouncer fuzz
test-pgbouncer: build
	@set -e; for mode in $(PGBOUNCER_MODES); do for m in $(MODULES); do \
		echo "== LEASEHOLD_TEST_PGBOUNCER=$$mode $${m#$(CURDIR)/}"; \
		(cd $$m && LEASEHOLD_TEST_PGBOUNCER=$$mode go test -count=1 -timeout 15m $(PGBOUNCER_TEST_FLAGS) ./...); \
	done; done

## fuzz: run every fuzz target for FUZZTIME each (seed corpora under
## testdata/fuzz/ also run as plain tests in make test)
FUZZTIME ?= 10s
FUZZ_TARGETS := pkg/coord:FuzzValidateName pkg/coord:FuzzValidateTTL pkg/daemon:FuzzConnectResponse \
	pkg/process:FuzzRun services/gateway/internal/gateway:FuzzConnectRequest \
	services/gateway/internal/h2serve:FuzzServeConn services/gateway/internal/gateway:FuzzReleaseAgreesWithXModSemver \
	services/site-agent/internal/pxe:FuzzHandlePacket services/site-agent/internal/tftp:FuzzParseRequest
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do dir=$${t%%:*}; name=$${t##*:}; \
		echo "== fuzz $$name ($$dir) for $(FUZZTIME)"; \
		(cd $$dir && go test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) .); \
	done

# ---- packages (deploy/nfpm): leasehold-node and the control plane as .deb and .rpm ----
# nfpm is pinned as a tool directive in tools/go.mod, like buf. It runs from
# the repository root (the package's file and script paths are relative
# to it), so `go tool -n` gives the path of the binary it builds.
DIST := $(CURDIR)/dist
ARCH ?= $(shell go env GOARCH)
# A package version both dpkg and rpm accept and order: VERSION without a
# leading v, dashes made dots (v0.2.0-3-gabc1234 is 0.2.0.3.gabc1234); a
# VERSION that is no x.y version (git describe of an untagged tree: a
# commit) is 0.0.0+git.<commit>.
PKG_VERSION := $(shell echo '$(VERSION)' | sed -E '/^v?[0-9]+\.[0-9]+/!s/^/0.0.0+git./; s/^v([0-9])/\1/; s/-/./g')
# One package per program, deploy/nfpm/leasehold-<service>.yaml: the node
# agent, and the control-plane services with their units, run as the system
# user leasehold (docs/install.md). leasehold-common holds what the control
# plane shares (the user, /etc/leasehold/leasehold.env, /etc/leasehold/tls):
# no binary, one package for every architecture (_all).
PKG_SERVICES := node api gateway worker scheduler doctor site-agent

.PHONY: packages check-packages

# The binaries are built like `make build` builds them (CGO_ENABLED=0, the
# same flags but for the linker's -s -w, which strip them), so both share
# the build cache: CI pays for compiling the services once.
## packages: leasehold-node, leasehold-{api,gateway,worker,scheduler,doctor,site-agent} and leasehold (the CLI, with its shell completions) for ARCH (amd64|arm64, default the host's), static, and leasehold-common, into dist/ as .deb and .rpm [VERSION=x.y.z]
packages:
	@set -e; mkdir -p $(DIST)/$(ARCH); \
	GOWORK=off go -C tools tool nfpm --version >/dev/null; \
	nfpm=$$(GOWORK=off go -C tools tool -n nfpm); \
	for s in $(PKG_SERVICES); do \
		echo "== leasehold-$$s $(VERSION) for linux/$(ARCH)"; \
		(cd services/$$s && CGO_ENABLED=0 GOOS=linux GOARCH=$(ARCH) go build -ldflags '-s -w $(LDFLAGS)' -o $(DIST)/$(ARCH)/leasehold-$$s .); \
		for p in deb rpm; do \
			LEASEHOLD_PKG_VERSION='$(PKG_VERSION)' LEASEHOLD_PKG_ARCH=$(ARCH) LEASEHOLD_PKG_BINARY=$(DIST)/$(ARCH)/leasehold-$$s \
				$$nfpm package --config deploy/nfpm/leasehold-$$s.yaml --packager $$p --target $(DIST)/leasehold-$${s}_$(PKG_VERSION)_$(ARCH).$$p; \
		done; \
	done; \
	echo "== leasehold (the CLI) $(VERSION) for linux/$(ARCH)"; \
	(cd services/cli && CGO_ENABLED=0 GOOS=linux GOARCH=$(ARCH) go build -ldflags '-s -w $(LDFLAGS)' -o $(DIST)/$(ARCH)/leasehold .); \
	mkdir -p $(DIST)/$(ARCH)/completions; \
	(cd services/cli && go build -o $(DIST)/leasehold-host .); \
	$(DIST)/leasehold-host completion bash > $(DIST)/$(ARCH)/completions/leasehold.bash; \
	$(DIST)/leasehold-host completion zsh > $(DIST)/$(ARCH)/completions/_leasehold; \
	$(DIST)/leasehold-host completion fish > $(DIST)/$(ARCH)/completions/leasehold.fish; \
	rm -f $(DIST)/leasehold-host; \
	for p in deb rpm; do \
		LEASEHOLD_PKG_VERSION='$(PKG_VERSION)' LEASEHOLD_PKG_ARCH=$(ARCH) LEASEHOLD_PKG_BINARY=$(DIST)/$(ARCH)/leasehold \
			LEASEHOLD_PKG_COMPLETIONS=$(DIST)/$(ARCH)/completions \
			$$nfpm package --config deploy/nfpm/leasehold.yaml --packager $$p --target $(DIST)/leasehold_$(PKG_VERSION)_$(ARCH).$$p; \
	done; \
	echo "== leasehold-common $(VERSION)"; \
	for p in deb rpm; do \
		LEASEHOLD_PKG_VERSION='$(PKG_VERSION)' \
			$$nfpm package --config deploy/nfpm/leasehold-common.yaml --packager $$p --target $(DIST)/leasehold-common_$(PKG_VERSION)_all.$$p; \
	done

## check-packages: build the amd64 packages and check them: the node's (deploy/nfpm/check.sh: contents, modes, static binary, node.env, systemd-analyze verify, maintainer scripts, rpm -qp), the control plane's (deploy/nfpm/check-control-plane.sh: the same, conffiles, the user leasehold, no start or enable, no file in two packages) and the CLI's (deploy/nfpm/check-cli.sh: contents, static binary, its own completions)
check-packages:
	@$(MAKE) --no-print-directory packages ARCH=amd64 VERSION='$(VERSION)'
	deploy/nfpm/check.sh $(DIST)/leasehold-node_$(PKG_VERSION)_amd64.deb $(DIST)/leasehold-node_$(PKG_VERSION)_amd64.rpm amd64
	deploy/nfpm/check-control-plane.sh $(DIST) '$(PKG_VERSION)' amd64
	deploy/nfpm/check-cli.sh $(DIST) '$(PKG_VERSION)' amd64

## check-packages-install: install the amd64 .deb into a fresh Debian chroot (debootstrap; needs root and Debian's mirror, 2-3 minutes, so not in CI): without and with systemd, conffile kept, remove and purge
.PHONY: check-packages-install
check-packages-install:
	@$(MAKE) --no-print-directory packages ARCH=amd64 VERSION='$(VERSION)'
	deploy/nfpm/install-test.sh $(DIST)/leasehold-node_$(PKG_VERSION)_amd64.deb

# ---- releases (deploy/release): what an operator downloads ----
# VERSION must be given (make release VERSION=1.4.0): the default above is
# `git describe`, which names no release. deploy/release/release.sh refuses
# an empty or non-semantic VERSION, naming it.
RELEASE_VERSION = $(if $(filter file undefined,$(origin VERSION)),,$(VERSION))
CHECK_RELEASE_VERSION ?= 0.0.0-check

.PHONY: release check-release release-images check-ts-pack

## release: dist/ emptied, then static binaries for linux/amd64 and linux/arm64 of every service and the CLI, tar.gz per arch, leasehold-node .deb and .rpm, a CycloneDX SBOM per artifact, SHA256SUMS (VERSION=x.y.z required; deploy/README.md, "Releases")
release:
	@deploy/release/release.sh --version '$(RELEASE_VERSION)' --out $(DIST) --clean

## check-release: a quick release for the host's arch into a temp dir (binaries and archive, no SBOM or package): each binary prints the version, SHA256SUMS verify
check-release:
	@set -e; out=$$(mktemp -d); trap 'rm -rf "$$out"' EXIT; \
	deploy/release/release.sh --quick --version '$(CHECK_RELEASE_VERSION)' --arch $$(go env GOARCH) --out "$$out/dist"

## release-images: multi-arch images (linux/amd64, linux/arm64) of the binaries in dist/ with docker buildx (deploy/release/Dockerfile), after make release VERSION=x.y.z; skipped with a message without a Docker engine; IMAGE_PUSH=1 pushes to IMAGE_REGISTRY
release-images:
	@DOCKER='$(DOCKER)' deploy/release/images.sh --version '$(RELEASE_VERSION)' --dir $(DIST) --registry '$(IMAGE_REGISTRY)' $(if $(filter 1,$(IMAGE_PUSH)),--push)

## check-ts-pack: the TypeScript client packs as a publishable npm package (clean build, npm pack --dry-run, every entry point packed, nothing else)
check-ts-pack:
	@deploy/release/check-ts-pack.sh
