# leasehold: one Makefile for the go.work monorepo. Every target loops over
# the workspace modules, because `go test ./...` at the root reaches none of them.
SHELL := /bin/bash
MODULES := $(shell go list -m -f '{{.Dir}}')
SERVICES := worker scheduler gateway api site-agent doctor
BIN := $(CURDIR)/bin
# buf and the protoc plugins are pinned as tool directives in tools/go.mod,
# a module kept out of go.work so buf's dependencies never change the
# versions the services build with.
BUF := GOWORK=off go -C tools tool buf

.PHONY: all build test test-short generate check-generated lint vet fmt migrate run tidy bench clean stop

all: build

## build: compile every service into ./bin
build:
	@mkdir -p $(BIN)
	@for s in $(SERVICES); do \
		(cd services/$$s && go build -o $(BIN)/leasehold-$$s .) || exit 1; \
	done

## test: run every module's tests against a real PostgreSQL (see pkg/pgtest)
test: build
	@set -e; for m in $(MODULES); do \
		echo "== $${m#$(CURDIR)/}"; \
		(cd $$m && go test -count=1 -timeout 15m ./...); \
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

## lint: buf lint, gofmt and go vet over every module
lint: vet
	$(BUF) lint ..
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
		if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi

vet:
	@for m in $(MODULES); do (cd $$m && go vet ./...) || exit 1; done

fmt:
	gofmt -w $$(git ls-files '*.go')

## migrate: apply migrations to LEASEHOLD_DATABASE_URL (or the .dev cluster)
migrate:
	go run ./tools/devstack -migrate-only

## run: start PostgreSQL under .dev/ (unless LEASEHOLD_DATABASE_URL is set) and every service
run: build
	go run ./tools/devstack -bin $(BIN) $(RUN_ARGS)

tidy:
	@for m in $(MODULES) $(CURDIR)/tools; do (cd $$m && GOWORK=off go mod tidy) || exit 1; done

## breaking: buf's breaking-change check of proto/ against main
breaking:
	$(BUF) breaking .. --against '../.git#branch=main,subdir=proto'

clean:
	rm -rf $(BIN)

## stop: stop the development cluster under .dev/
stop:
	go run ./tools/devstack -stop
