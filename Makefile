# outboxrelay — `make help` lists the targets. CI (.ci/run) runs `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

GO        ?= go
STACK     := scripts/stack/stack.sh
# Each target that needs servers starts the local stack (idempotent) and
# exports DATABASE_URL, KAFKA_BROKERS, ELASTICSEARCH_URL and ELASTICSEARCH7_URL for its command.
# The servers outlive make, so they are started with every descriptor above stderr
# closed: otherwise they inherit the one of `flock /tmp/bench.lock make bench-x` and
# hold the lock until the stack stops.
CLOSE_FDS  = for fd in /proc/$$BASHPID/fd/*; do fd=$${fd\#\#*/}; if (( fd > 2 )); then eval "exec $$fd>&-"; fi; done;
WITH_STACK = eval "$$($(CLOSE_FDS) $(STACK) up)" &&
TEST_FLAGS ?= -race -count=1 -timeout 50m
BENCH_FLAGS ?= -run '^$$' -bench . -benchtime 1x -timeout 60m -v

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-16s %s\n", $$1, $$2}'

.PHONY: build
build: ## build the three binaries into bin/
	$(GO) build -o bin/ ./cmd/batcher ./cmd/publisher ./cmd/indexer

.PHONY: docs
docs: ## regenerate docs/configuration.md from the binaries' own settings (TestConfigurationReferenceIsCurrent fails when it is stale)
	$(GO) run ./internal/cmd/docgen

.PHONY: test
test: test-alerts test-deploy test-fuzz producers ## run every test against the real stack (starts it when needed; installs PGSync and redis for bench/peers' small round, and the producer examples' dependencies)
	@$(WITH_STACK) $(STACK) versions && \
	eval "$$(bench/peers/setup.sh)" && \
	$(GO) test $(TEST_FLAGS) -v -run 'Smoke|PostgresApart' ./internal/stack/ && \
	$(GO) test $(TEST_FLAGS) $$($(GO) list ./... | grep -v -e '/internal/stack$$' -e '/outboxrelay/outbox$$' -e '/outboxrelay/e2e$$') && \
	$(GO) test $(TEST_FLAGS) ./outbox/ && \
	$(GO) test $(TEST_FLAGS) ./e2e/

.PHONY: producers
producers: ## install and build the producer examples e2e/producers_test.go runs (python3-psycopg, npm ci, mvn package)
	@examples/producers/setup.sh

.PHONY: test-alerts
test-alerts: ## check the Prometheus alert rules and run their unit tests (promtool)
	@scripts/stack/prometheus.sh version >/dev/null # installs Debian's prometheus (promtool) when missing
	promtool check rules deploy/prometheus/alerts.yml
	cd deploy/prometheus && promtool test rules alerts_test.yml

.PHONY: test-deploy
test-deploy: ## check the Kubernetes manifests: strict decoding into k8s.io/api types, probes, PDBs, secrets, every setting against the binaries' --help (nested module deploy/kubernetes)
	cd deploy/kubernetes && $(GO) vet ./... && $(GO) test -count=1 ./...

.PHONY: k8s-configmaps
k8s-configmaps: ## regenerate the Kubernetes ConfigMaps of the alert rules and the Grafana dashboard (deploy/kubernetes)
	cd deploy/kubernetes && $(GO) generate ./...

# Each fuzz target, its package and its budget in inputs (about 20 s each on
# this 2-core machine). A count, not a duration: with -fuzztime=<duration>,
# Go 1.26's fuzz coordinator can fail a clean run with "context deadline
# exceeded" when a loaded worker misses the deadline (golang/go#75804).
FUZZ_TARGETS := FuzzValidJSON:./internal/jsonvalid/:200000 FuzzParseSpec:./batch/:40000 FuzzRedact:./internal/redact/:2000

.PHONY: test-fuzz
test-fuzz: ## run each fuzz target for its budget of inputs beyond its seed corpus; a failing input lands in testdata/fuzz
	@for t in $(FUZZ_TARGETS); do \
	  IFS=: read -r name pkg n <<< "$$t"; \
	  echo "fuzz: $$name, $$n inputs"; \
	  $(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime "$${n}x" -timeout 10m "$$pkg" || exit 1; \
	done

.PHONY: test-short
test-short: ## run the tests that need no server
	$(GO) test -short -count=1 ./...

.PHONY: lint
lint: ## gofmt, go vet and staticcheck
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...

.PHONY: stack-up
stack-up: ## start PostgreSQL, Kafka, OpenSearch and Elasticsearch 7.17 locally; prints their settings
	@$(STACK) up

.PHONY: stack-down
stack-down: ## stop the local stack (keeps its data; `scripts/stack/stack.sh purge` removes it)
	@$(STACK) down

.PHONY: bench-batcher
bench-batcher: ## batcher throughput vs a raw COPY baseline (1M rows)
	@$(WITH_STACK) $(GO) test $(BENCH_FLAGS) ./bench/batcher/

.PHONY: bench-publisher
bench-publisher: ## publisher throughput vs raw Client.Produce (its own Kafka path), latency, NOTIFY on/off with 16 writers
	@$(WITH_STACK) $(GO) test $(BENCH_FLAGS) ./bench/publisher/

.PHONY: bench-indexer
bench-indexer: ## indexer throughput vs a raw bulk baseline
	@$(WITH_STACK) $(GO) test $(BENCH_FLAGS) ./bench/indexer/

.PHONY: bench-e2e
bench-e2e: build ## 1,000,000 rows from the source table to searchable documents
	@$(WITH_STACK) $(GO) test $(BENCH_FLAGS) ./bench/e2e/

.PHONY: bench-follow
bench-follow: build ## commit → searchable (updates) and commit → gone from searches (hard deletes) through batcher run --follow at 50 and 500/s (FOLLOW_BENCH_SECONDS=10)
	@$(WITH_STACK) flock -o /tmp/bench.lock $(GO) test $(BENCH_FLAGS) ./bench/follow/

.PHONY: bench-peers
bench-peers: build ## PGSync and Debezium beside outboxrelay on the same rows, one run; table and plots into bench/results/ (BENCH_PEERS_ROWS=1000000; BENCH_PEERS_LEGS=changes,deletes: some legs, into bench/results/peers-partial/)
	@$(WITH_STACK) eval "$$(bench/peers/setup.sh)" && \
	if ! case ",$${BENCH_PEERS_LEGS:-debezium}," in *,debezium,*) true;; *) false;; esac; then \
	  echo "bench-peers: BENCH_PEERS_LEGS=$$BENCH_PEERS_LEGS leaves Debezium out"; \
	elif $(GO) test -list '^Benchmark' ./bench/peers/debezium/ | grep -q '^Benchmark'; then \
	  export DEBEZIUM_BENCH_OUT="$(CURDIR)/bench/results/debezium.json" BENCH_PEERS_DEBEZIUM_JSON="$(CURDIR)/bench/results/debezium.json" && \
	  flock -o /tmp/bench.lock $(GO) test $(BENCH_FLAGS) ./bench/peers/debezium/; \
	else echo "bench-peers: bench/peers/debezium has no benchmark; Debezium not measured"; fi && \
	flock -o /tmp/bench.lock $(GO) test $(BENCH_FLAGS) ./bench/peers/

.PHONY: demo
demo: build ## the whole pipeline on the local stack: seed, batch, publish, index, change, follow (ROWS=200000)
	@eval "$$($(CLOSE_FDS) $(STACK) up postgres kafka opensearch)" && $(GO) run ./demo --rows $${ROWS:-200000}

.PHONY: demo-down
demo-down: ## stop what `make demo` started (the local stack) and remove the demo's files
	@$(STACK) down
	rm -rf .stack/demo
