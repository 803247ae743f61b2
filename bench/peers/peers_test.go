// Package bench_peers runs outboxrelay beside the tools a user would pick
// instead, in one run, on the same rows and the same search engine:
//
//	make bench-peers                     # BENCH_PEERS_ROWS=1000000 by default
//	BENCH_PEERS_ROWS=100000 make bench-peers
//	BENCH_PEERS_LEGS=changes,deletes BENCH_PEERS_ROWS=100000 make bench-peers
//
// Legs, in interleaved rounds (BENCH_PEERS_ROUNDS, default 1; the order of
// the two tools alternates per round), each into a fresh index:
//
//   - PGSync (PyPI pgsync, installed by bench/peers/setup.sh with Debian's
//     redis-server): initial sync of the seeded rows (bootstrap, then
//     `pgsync` until every row is searchable), then `pgsync --daemon` with
//     single-row UPDATEs at each BENCH_PEERS_CHANGE_RATES (default 50,500/s):
//     commit→searchable latency; then single-row hard DELETEs (which its
//     triggers carry: the daemon deletes the document) at each
//     BENCH_PEERS_DELETE_RATES (default 50,500/s): commit→gone from searches.
//
//   - outboxrelay: the real binaries (batcher, publisher, indexer) with the
//     product defaults: initial sync of the same rows; then application
//     events: outbox.Enqueue inside the writer's transaction (the same
//     single-row UPDATE plus its event) at BENCH_PEERS_EVENT_RATES (default
//     50,500,5000/s): commit→searchable latency; then table changes:
//     `batcher run --follow` of an incremental job with `vanished: delete`
//     and `batcher follow-trigger --install` (the NOTIFY trigger and the
//     delete capture), with the same UPDATEs and DELETEs as PGSync's
//     (commit→searchable, commit→gone from searches through the read
//     alias, which filters the tombstones out).
//
//   - relations (relations_test.go): a product catalog whose documents
//     come from five tables (BENCH_PEERS_REL_PRODUCTS products, default
//     200,000, with 5 variants each, a brand, and categories through a join
//     table; brand 1 shared by 10,000 of them), PGSync's `children` beside
//     outboxrelay's `document.relations` (incremental, `batcher
//     follow-trigger --install`, `batcher run` then `batcher run
//     --follow`): initial sync of every product, variant UPDATEs at each
//     BENCH_PEERS_REL_RATES (default 50,500/s) commit→its product
//     searchable with the change, and brand 1 renamed: commit→all its
//     products searchable with the new name.
//
// BENCH_PEERS_LEGS (default "changes,events,deletes,debezium,relations":
// all) picks the legs; the initial syncs of the bench-e2e rows run with
// any leg but relations (each tool needs its documents first; relations
// has its own) and are reported too. "debezium" is read by `make
// bench-peers`, which runs bench/peers/debezium only when it is listed. A
// run of some legs only is a partial run: its results go to
// bench/results/peers-partial/ unless BENCH_PEERS_OUT says otherwise, its
// table says which legs it has, and it never rewrites the block in
// docs/benchmarks.md.
//
// Both tools read the same private PostgreSQL cluster (wal_level=logical,
// which PGSync needs; one database per leg, seeded by the same SQL as
// bench-e2e) and write to the stack's OpenSearch. "Searchable" is what a
// user sees: _count / _search without a forced refresh.
//
// Results go to bench/results/ (BENCH_PEERS_OUT): peers.md (the table),
// peers.json, peers-throughput.png and peers-latency.png (CDFs); a full run
// into the default directory also rewrites the "Latest make bench-peers"
// block of docs/benchmarks.md with the table.
package bench_peers

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

func TestMain(m *testing.M) { stack.Main(m) }

// settings of one run; each is read from the environment variable in its comment.
type settings struct {
	Rows        int           // BENCH_PEERS_ROWS, default 1,000,000
	Rounds      int           // BENCH_PEERS_ROUNDS, default 1
	ChangeRates []int         // BENCH_PEERS_CHANGE_RATES: table changes/s, default 50,500
	EventRates  []int         // BENCH_PEERS_EVENT_RATES: outbox events/s, default 50,500,5000
	DeleteRates []int         // BENCH_PEERS_DELETE_RATES: table hard deletes/s, default 50,500
	Legs        []string      // BENCH_PEERS_LEGS: the latency legs run, default changes,events,deletes,debezium
	LegDuration time.Duration // BENCH_PEERS_LEG: how long each rate is written, default 20s
	RelProducts int           // BENCH_PEERS_REL_PRODUCTS: the relations leg's products (5 variants each), default 200,000
	RelRates    []int         // BENCH_PEERS_REL_RATES: variant UPDATEs/s of the relations leg, default 50,500
	OursOnly    bool          // BENCH_PEERS_OURS_ONLY=1: outboxrelay's legs only, without PGSync's (a partial run, for working on outboxrelay)
	Out         string        // BENCH_PEERS_OUT: results directory, default bench/results
	PGSyncBin   string        // PGSYNC_BIN: the venv's bin directory (bench/peers/setup.sh)
	RedisServer string        // REDIS_SERVER: the redis-server binary (bench/peers/setup.sh)
}

func load(tb testing.TB) settings {
	s := settings{Rows: 1_000_000, Rounds: 1, ChangeRates: []int{50, 500}, EventRates: []int{50, 500, 5000}, DeleteRates: []int{50, 500},
		Legs:        slices.Clone(allLegs),
		RelProducts: 200_000, RelRates: []int{50, 500},
		LegDuration: 20 * time.Second, Out: filepath.Join(stack.RepoRoot(), "bench", "results"),
		PGSyncBin: os.Getenv("PGSYNC_BIN"), RedisServer: os.Getenv("REDIS_SERVER")}
	num := func(name string, v *int) {
		if raw := os.Getenv(name); raw != "" {
			n, err := strconv.Atoi(strings.ReplaceAll(raw, ",", ""))
			if err != nil || n <= 0 {
				tb.Fatalf("%s=%q: want a positive integer", name, raw)
			}
			*v = n
		}
	}
	rates := func(name string, v *[]int) {
		if raw := os.Getenv(name); raw != "" {
			*v = nil
			for _, f := range strings.Split(raw, ",") {
				n, err := strconv.Atoi(strings.TrimSpace(f))
				if err != nil || n <= 0 {
					tb.Fatalf("%s=%q: want comma-separated positive rates", name, raw)
				}
				*v = append(*v, n)
			}
		}
	}
	num("BENCH_PEERS_ROWS", &s.Rows)
	num("BENCH_PEERS_ROUNDS", &s.Rounds)
	rates("BENCH_PEERS_CHANGE_RATES", &s.ChangeRates)
	rates("BENCH_PEERS_EVENT_RATES", &s.EventRates)
	rates("BENCH_PEERS_DELETE_RATES", &s.DeleteRates)
	num("BENCH_PEERS_REL_PRODUCTS", &s.RelProducts)
	rates("BENCH_PEERS_REL_RATES", &s.RelRates)
	if raw := os.Getenv("BENCH_PEERS_LEGS"); raw != "" {
		s.Legs = nil
		for _, f := range strings.Split(raw, ",") {
			f = strings.TrimSpace(f)
			if !slices.Contains(allLegs, f) {
				tb.Fatalf("BENCH_PEERS_LEGS=%q: want some of %s", raw, strings.Join(allLegs, ","))
			}
			if !slices.Contains(s.Legs, f) {
				s.Legs = append(s.Legs, f)
			}
		}
		if s.Partial() {
			s.Out = filepath.Join(stack.RepoRoot(), "bench", "results", "peers-partial")
		}
	}
	if raw := os.Getenv("BENCH_PEERS_LEG"); raw != "" {
		d, err := time.ParseDuration(raw)
		if err != nil || d <= 0 {
			tb.Fatalf("BENCH_PEERS_LEG=%q: want a positive duration such as 20s", raw)
		}
		s.LegDuration = d
	}
	switch v := os.Getenv("BENCH_PEERS_OURS_ONLY"); v {
	case "", "0":
	case "1":
		s.OursOnly = true
		s.Out = filepath.Join(stack.RepoRoot(), "bench", "results", "peers-partial")
	default:
		tb.Fatalf("BENCH_PEERS_OURS_ONLY=%q: want 1 or 0", v)
	}
	if v := os.Getenv("BENCH_PEERS_OUT"); v != "" {
		s.Out = v
	}
	if !s.OursOnly && (s.PGSyncBin == "" || s.RedisServer == "") {
		tb.Fatal("PGSYNC_BIN and REDIS_SERVER are not set: run `make bench-peers`, or eval \"$(bench/peers/setup.sh)\" first")
	}
	return s
}

// The legs BENCH_PEERS_LEGS can name: table UPDATEs, outbox events, table
// hard DELETEs, bench/peers/debezium (run by the Makefile, not here), and
// the catalog with related tables (relations_test.go: its own initial
// syncs, variant UPDATEs and a shared brand renamed).
const (
	legChanges   = "changes"
	legEvents    = "events"
	legDeletes   = "deletes"
	legDebezium  = "debezium"
	legRelations = "relations"
)

var allLegs = []string{legChanges, legEvents, legDeletes, legDebezium, legRelations}

// Runs reports whether leg is one of the legs of this run.
func (s settings) Runs(leg string) bool { return slices.Contains(s.Legs, leg) }

// RunsRecords reports whether the run has a leg on the bench-e2e rows
// (source_records), whose initial syncs it then runs: every leg but
// relations, which has its own tables and initial syncs.
func (s settings) RunsRecords() bool {
	return slices.ContainsFunc(s.Legs, func(l string) bool { return l != legRelations })
}

// Partial reports whether the run leaves a leg out: its table is not the
// one in docs/benchmarks.md.
func (s settings) Partial() bool {
	if s.OursOnly {
		return true
	}
	for _, l := range allLegs {
		if !s.Runs(l) {
			return true
		}
	}
	return false
}

// RewritesBenchmarksPage reports whether the run's table goes into the
// bench-peers block of docs/benchmarks.md: a full run into bench/results only, the block stands
// for `make bench-peers`.
func (s settings) RewritesBenchmarksPage() bool {
	rel, err := filepath.Rel(stack.RepoRoot(), s.Out)
	return err == nil && rel == filepath.Join("bench", "results") && !s.Partial()
}

// env is what every leg shares: the private logical-decoding cluster, the
// shared Kafka and search engine, a private redis and the binaries.
type env struct {
	s        settings
	pgBase   string // URL of the private cluster's postgres database
	pg       *stack.Server
	brokers  []string
	search   string
	redis    string // host:port
	bins     map[string]string
	dir      string
	bad      int // rows the demo normalizer quarantines (no title)
	maxGroup int // the seed's last g (ids are 3g+g%2)
}

func BenchmarkPeers(b *testing.B) {
	s := load(b)
	for range b.N {
		res := run(b, s)
		check(b, res.write(s.Out))
		table, err := os.ReadFile(filepath.Join(s.Out, "peers.md"))
		check(b, err)
		fmt.Printf("bench-peers:\n%s\n", table)
		if s.RewritesBenchmarksPage() {
			check(b, updateBenchmarksPage(filepath.Join(stack.RepoRoot(), "docs", "benchmarks.md"), filepath.Join("..", "bench", "results"), string(table)))
		}
	}
}

// TestPeersSmallRound runs one small round of every leg, so a change that
// breaks the harness fails `go test` rather than the next `make bench-peers`.
func TestPeersSmallRound(t *testing.T) {
	s := load(t)
	s.Rows, s.Rounds, s.ChangeRates, s.EventRates, s.DeleteRates, s.LegDuration, s.Out = 3000, 1, []int{20}, []int{20}, []int{20}, 2*time.Second, t.TempDir()
	s.RelProducts, s.RelRates = 3000, []int{20}
	s.Legs = slices.Clone(allLegs)
	res := run(t, s)
	require.NoError(t, res.write(s.Out))
	kinds := map[string]int{}
	for _, l := range res.Legs {
		kinds[l.Tool+" / "+l.Kind]++
		if l.Kind == kindInitial || l.Kind == kindRelInitial {
			require.Positive(t, l.Seconds, "%+v", l)
			continue
		}
		if l.Kind == kindRelRename {
			require.Equal(t, int64(3000), l.Docs, "%+v", l)
			require.Positive(t, l.Seconds, "%+v", l)
			continue
		}
		require.Equal(t, 40, l.Events, "%+v", l)
		require.Zero(t, l.Lost, "%+v", l)
		require.Len(t, l.latencies, l.Events)
	}
	require.Equal(t, map[string]int{pgsyncName + " / " + kindInitial: 1, pgsyncName + " / " + kindChanges: 1, pgsyncName + " / " + kindDeletes: 1,
		ourName + " / " + kindInitial: 1, ourName + " / " + kindEvents: 1, ourName + " / " + kindChanges: 1, ourName + " / " + kindDeletes: 1,
		pgsyncName + " / " + kindRelInitial: 1, pgsyncName + " / " + kindRelChanges: 1, pgsyncName + " / " + kindRelRename: 1,
		ourName + " / " + kindRelInitial: 1, ourName + " / " + kindRelChanges: 1, ourName + " / " + kindRelRename: 1}, kinds)
	for _, f := range []string{"peers.md", "peers.json", "peers-throughput.png", "peers-latency.png"} {
		st, err := os.Stat(filepath.Join(s.Out, f))
		require.NoError(t, err)
		require.Positive(t, st.Size(), f)
	}
}

// run measures every leg of every round.
func run(tb testing.TB, s settings) *results {
	e := setup(tb, s)
	dz, err := loadDebezium()
	check(tb, err)
	res := &results{Date: time.Now().UTC(), Machine: machine(), Rows: s.Rows, Rounds: s.Rounds, Settings: s, Debezium: dz}
	for round := 1; round <= s.Rounds; round++ {
		var legs []func()
		if s.RunsRecords() {
			legs = append(legs, func() { res.add(e.pgsync(tb, round)) }, func() { res.add(e.outboxrelay(tb, round)) })
		}
		if s.Runs(legRelations) {
			legs = append(legs, func() { res.add(e.pgsyncRelations(tb, round)) }, func() { res.add(e.outboxrelayRelations(tb, round)) })
		}
		if s.OursOnly { // the pairs are (PGSync's, ours)
			var ours []func()
			for i := 1; i < len(legs); i += 2 {
				ours = append(ours, legs[i])
			}
			legs = ours
		}
		if round%2 == 0 { // each pair in the other order
			for i := 0; i+1 < len(legs); i += 2 {
				legs[i], legs[i+1] = legs[i+1], legs[i]
			}
		}
		for _, leg := range legs {
			leg()
		}
	}
	return res
}

func setup(b testing.TB, s settings) *env {
	ctx := context.Background()
	e := &env{s: s, brokers: stack.KafkaBrokers(b), search: stack.ElasticsearchURL(b), dir: b.TempDir(),
		bad: s.Rows / badEvery, maxGroup: s.Rows}

	// PGSync reads the WAL through a logical replication slot: a private
	// cluster with wal_level=logical (the stack's cluster, same settings
	// otherwise). outboxrelay's legs use the same cluster, so both read the
	// same server.
	pg := stack.Private(b, "postgres")
	e.pg = pg
	e.pgBase = pg.Env
	admin, err := pgx.Connect(ctx, e.pgBase)
	check(b, err)
	for _, q := range []string{`ALTER SYSTEM SET wal_level = logical`, `ALTER SYSTEM SET max_replication_slots = 20`, `ALTER SYSTEM SET max_wal_senders = 20`} {
		_, err = admin.Exec(ctx, q)
		check(b, err)
	}
	check(b, admin.Close(ctx))
	check(b, pg.Stop())
	check(b, pg.Start())
	e.pgBase = pg.Env

	if !s.OursOnly {
		e.redis = startRedis(b, s.RedisServer, e.dir)
	}
	e.bins = map[string]string{}
	for _, n := range []string{"batcher", "publisher", "indexer"} {
		e.bins[n] = testproc.Build(b, n)
	}
	return e
}

// database creates a fresh database on the private cluster and seeds the
// bench-e2e rows into it.
func (e *env) database(b testing.TB, name string) (string, *pgxpool.Pool) {
	url := e.createDatabase(b, name)
	return url, e.seed(b, name, url)
}

// createDatabase creates name on the private cluster and returns its URL.
func (e *env) createDatabase(b testing.TB, name string) string {
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, e.pgBase)
	check(b, err)
	_, err = admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	check(b, err)
	check(b, admin.Close(ctx))
	return stack.WithDatabase(e.pgBase, name)
}

// seed fills the database at url with the bench-e2e rows.
func (e *env) seed(b testing.TB, name, url string) *pgxpool.Pool {
	pool := stack.Pool(b, url)
	t0 := time.Now()
	check(b, demo.Seed(context.Background(), pool, demo.SeedOptions{Rows: e.s.Rows, BadEvery: badEvery}))
	b.Logf("%s: seeded %d rows in %s", name, e.s.Rows, time.Since(t0).Round(time.Millisecond))
	return pool
}

func (e *env) dropDatabase(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if admin, err := pgx.Connect(ctx, e.pgBase); err == nil {
		_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		_ = admin.Close(ctx)
	}
}

// pgsync runs PGSync's legs of one round.
func (e *env) pgsync(b testing.TB, round int) []leg {
	dbName := fmt.Sprintf("pgsync_r%d", round)
	index := stack.UniqueName("bench-peers-pgsync")
	defer e.dropDatabase(dbName)
	defer deleteIndex(e.search, index)
	url, pool := e.database(b, dbName)
	defer pool.Close()

	schema := []map[string]any{{
		"database": dbName, "index": index,
		"nodes": map[string]any{"table": "source_records", "columns": []string{"id", "created_at", "tenant_id", "version", "deleted_at", "payload"}},
	}}
	pgEnv, schemaFile := e.pgsyncConfig(b, dbName, url, schema)
	bin := func(n string) string { return filepath.Join(e.s.PGSyncBin, n) }

	want := int64(e.s.Rows)
	before := e.serversCPU()
	took, cpu := e.pgsyncInitial(b, pgEnv, schemaFile, index, want)
	legs := []leg{e.withServers(leg{Tool: pgsyncName, Kind: kindInitial, Round: round, Docs: want, Seconds: took.Seconds(), ProcessCPU: cpu.Seconds()}, before)}
	b.Logf("pgsync round %d: %d rows searchable in %s (process CPU %s)", round, want, took.Round(time.Millisecond), cpu.Round(time.Millisecond))

	// Live changes: the daemon, single-row UPDATEs at each rate.
	d := testproc.Start(b, bin("pgsync"), pgEnv, "--config", schemaFile, "--daemon")
	defer func() { _ = d.Signal(syscall.SIGTERM); _ = d.Wait(30 * time.Second) }()
	w := &writer{pool: pool, maxGroup: e.maxGroup, search: e.search, index: index, markField: "payload.mark",
		update: `UPDATE source_records SET payload = payload || jsonb_build_object('mark', $2::bigint) WHERE id = $1 RETURNING version`}
	w.warmUp(b, d)
	if e.s.Runs(legChanges) {
		for i, rate := range e.s.ChangeRates {
			l := w.run(b, rate, e.s.LegDuration, int64(round*100+i+1)*100_000_000, nil, d)
			l.Tool, l.Kind, l.Round = pgsyncName, kindChanges, round
			legs = append(legs, l)
		}
	}
	if e.s.Runs(legDeletes) {
		for _, rate := range e.s.DeleteRates {
			l := w.deletes(b, rate, e.s.LegDuration, d)
			l.Tool, l.Kind, l.Round = pgsyncName, kindDeletes, round
			legs = append(legs, l)
		}
	}
	return legs
}

// pgsyncConfig writes PGSync's schema for dbName (at url) and returns the
// environment its commands run with and the schema file.
func (e *env) pgsyncConfig(b testing.TB, dbName, url string, schema []map[string]any) ([]string, string) {
	dir := filepath.Join(e.dir, dbName)
	check(b, os.MkdirAll(dir, 0o755))
	raw, err := json.Marshal(schema)
	check(b, err)
	schemaFile := filepath.Join(dir, "schema.json")
	check(b, os.WriteFile(schemaFile, raw, 0o644))
	host, port := hostPort(b, url)
	redisHost, redisPort, _ := strings.Cut(e.redis, ":")
	return []string{"PG_HOST=" + host, "PG_PORT=" + port, "PG_USER=postgres", "PG_PASSWORD=", "PG_DATABASE=" + dbName,
		"ELASTICSEARCH_URL=" + e.search, "OPENSEARCH=true", "ELASTICSEARCH=false",
		"REDIS_HOST=" + redisHost, "REDIS_PORT=" + redisPort, "CHECKPOINT_PATH=" + dir, "CONSOLE_LOGGING_HANDLER_MIN_LEVEL=WARNING",
		// PGSync's search client gives up on a bulk after 10 s by default and
		// exits; on two cores shared with make test's other packages a bulk
		// into a new index took longer (ReadTimeoutError), twice.
		"ELASTICSEARCH_TIMEOUT=120"}, schemaFile
}

// pgsyncInitial runs PGSync's bootstrap (not counted), then a one-shot
// pgsync until index counts want documents: the time from its start and
// its process CPU.
func (e *env) pgsyncInitial(b testing.TB, pgEnv []string, schemaFile, index string, want int64) (time.Duration, time.Duration) {
	bin := func(n string) string { return filepath.Join(e.s.PGSyncBin, n) }
	boot := testproc.Run(b, 10*time.Minute, bin("bootstrap"), pgEnv, "--config", schemaFile)
	if boot.ExitCode() != 0 {
		b.Fatalf("pgsync bootstrap: exit %d\n%s", boot.ExitCode(), lastLines(boot.Stderr(), 30))
	}
	start := time.Now()
	p := testproc.Start(b, bin("pgsync"), pgEnv, "--config", schemaFile)
	took := waitCount(b, e.search, index, want, 30*time.Minute, func() string {
		select {
		case <-p.Done():
			if p.ExitCode() != 0 {
				return fmt.Sprintf("pgsync exited %d\n%s", p.ExitCode(), lastLines(p.Stderr(), 30))
			}
		default:
		}
		return ""
	}, start)
	cpu := processCPU(p)
	if err := p.Wait(5 * time.Minute); err != nil {
		b.Fatalf("pgsync (initial sync) after every row was searchable: %v\n%s", err, lastLines(p.Stderr(), 40))
	}
	return took, max(cpu, p.Cmd.ProcessState.UserTime()+p.Cmd.ProcessState.SystemTime())
}

// pipeline is outboxrelay's publisher and indexer for one database, with
// a fresh topic and alias.
type pipeline struct {
	topic, alias string
	env          []string // the processes' environment
	pub, idx     *testproc.Proc
	stop         func()
}

// alive reports why the publisher or the indexer is gone ("" while both run).
func (p *pipeline) alive() string {
	for _, pr := range []*testproc.Proc{p.pub, p.idx} {
		select {
		case <-pr.Done():
			return fmt.Sprintf("%s exited %d\n%s", filepath.Base(pr.Cmd.Path), pr.ExitCode(), lastLines(pr.Stderr(), 30))
		default:
		}
	}
	return ""
}

// pipeline creates a topic and starts the publisher and the indexer on the
// database at url; stop ends them and deletes the topic and the indices.
func (e *env) pipeline(b testing.TB, url string) *pipeline {
	ctx := context.Background()
	topic, alias := stack.UniqueName("bench-peers"), stack.UniqueName("bench-peers")
	kc := &kafka.Client{Addr: kafka.TCP(e.brokers...), Timeout: 30 * time.Second}
	cr, err := kc.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 8, ReplicationFactor: 1}}})
	check(b, err)
	for _, err := range cr.Errors {
		check(b, err)
	}
	pl := &pipeline{topic: topic, alias: alias,
		env: []string{"DATABASE_URL=" + url, "KAFKA_BROKERS=" + strings.Join(e.brokers, ","), "ELASTICSEARCH_URL=" + e.search,
			"TOPIC=" + topic, "GROUP=" + topic, "ALIAS=" + alias, "METRICS_ADDR=", "PROGRESS=off", "LOG_FORMAT=json", "LOG_LEVEL=warn"}}
	pl.pub = testproc.Start(b, e.bins["publisher"], append(slices.Clone(pl.env), "PUBLISHER_ID=bench-peers"), "run")
	pl.idx = testproc.Start(b, e.bins["indexer"], pl.env, "run")
	pl.stop = func() {
		for _, p := range []*testproc.Proc{pl.pub, pl.idx} {
			_ = p.Signal(syscall.SIGTERM)
			_ = p.Wait(30 * time.Second)
		}
		_, _ = kc.DeleteTopics(context.Background(), &kafka.DeleteTopicsRequest{Topics: []string{topic}})
		deleteIndex(e.search, alias+"_v*")
	}
	return pl
}

// batcherInitial runs `batcher run --spec specFile` (one run) until alias
// counts want documents, and waits for it to end: the time from its start
// and the CPU of the batcher, the publisher and the indexer meanwhile.
func (e *env) batcherInitial(b testing.TB, pl *pipeline, specFile string, want int64) (time.Duration, time.Duration) {
	cpu0 := processCPU(pl.pub) + processCPU(pl.idx)
	start := time.Now()
	bp := testproc.Start(b, e.bins["batcher"], pl.env, "run", "--spec", specFile)
	took := waitCount(b, e.search, pl.alias, want, 30*time.Minute, func() string {
		select {
		case <-bp.Done():
			if bp.ExitCode() != 0 {
				return fmt.Sprintf("batcher exited %d\n%s", bp.ExitCode(), lastLines(bp.Stderr(), 30))
			}
		default:
		}
		return pl.alive()
	}, start)
	check(b, bp.Wait(5*time.Minute))
	return took, processCPU(pl.pub) + processCPU(pl.idx) - cpu0 + bp.Cmd.ProcessState.UserTime() + bp.Cmd.ProcessState.SystemTime()
}

// serversCPU is the CPU the shared search engine (0 when it does not run
// from this checkout's stack: STACK_DIR) and the private PostgreSQL have
// used so far.
func (e *env) serversCPU() [2]time.Duration {
	return [2]time.Duration{stack.ReadCPU().Search, e.pg.CPU()}
}

// withServers sets an initial sync's SearchCPU and PostgresCPU to what the
// servers used since before: both tools' initial syncs index into the same
// engine, one after the other, so its CPU per sync compares what each
// tool's documents and bulk requests cost it.
func (e *env) withServers(l leg, before [2]time.Duration) leg {
	now := e.serversCPU()
	if before[0] > 0 {
		l.SearchCPU = (now[0] - before[0]).Seconds()
	}
	l.PostgresCPU = (now[1] - before[1]).Seconds()
	return l
}

// followTrigger runs `batcher follow-trigger --install` for specFile.
func (e *env) followTrigger(b testing.TB, pl *pipeline, specFile string) {
	tr := testproc.Run(b, time.Minute, e.bins["batcher"], pl.env, "follow-trigger", "--spec", specFile, "--install")
	if tr.ExitCode() != 0 {
		b.Fatalf("batcher follow-trigger: exit %d\n%s", tr.ExitCode(), tr.Stderr())
	}
}

// outboxrelay runs outboxrelay's legs of one round with the product defaults.
func (e *env) outboxrelay(b testing.TB, round int) []leg {
	dbName := fmt.Sprintf("outboxrelay_r%d", round)
	defer e.dropDatabase(dbName)
	url, pool := e.migratedSeeded(b, dbName)
	defer pool.Close()

	pl := e.pipeline(b, url)
	defer pl.stop()
	topic, alias, pub, idx := pl.topic, pl.alias, pl.pub, pl.idx

	spec, err := batch.LoadSpec(filepath.Join(stack.RepoRoot(), "demo", "job.yaml"))
	check(b, err)
	spec.Topic = topic
	// The demo's root fields, without its comments relation: these legs
	// compare one table with PGSync's one-table schema (the relations leg
	// compares documents from several tables).
	spec.Document.Relations = nil
	raw, err := json.Marshal(spec)
	check(b, err)
	specFile := filepath.Join(e.dir, dbName+"-job.json")
	check(b, os.WriteFile(specFile, raw, 0o644))

	want := int64(e.s.Rows - e.bad)
	before := e.serversCPU()
	took, cpu := e.batcherInitial(b, pl, specFile, want)
	legs := []leg{e.withServers(leg{Tool: ourName, Kind: kindInitial, Round: round, Docs: want, Seconds: took.Seconds(), ProcessCPU: cpu.Seconds()}, before)}
	b.Logf("outboxrelay round %d: %d documents searchable in %s (processes CPU %s)", round, want, took.Round(time.Millisecond), cpu.Round(time.Millisecond))

	// Application events: the writer's UPDATE and its outbox event in one transaction.
	w := &writer{pool: pool, maxGroup: e.maxGroup, search: e.search, index: alias, markField: "mark",
		update: `UPDATE source_records SET payload = payload || jsonb_build_object('mark', $2::bigint) WHERE id = $1 RETURNING version`}
	for i, rate := range e.s.EventRates {
		if !e.s.Runs(legEvents) {
			break
		}
		l := w.run(b, rate, e.s.LegDuration, int64(round*100+50+i)*100_000_000, enqueue(topic), pub, idx)
		l.Tool, l.Kind, l.Round = ourName, kindEvents, round
		legs = append(legs, l)
		if msg := pl.alive(); msg != "" {
			b.Fatal(msg)
		}
	}

	if !e.s.Runs(legChanges) && !e.s.Runs(legDeletes) {
		return legs
	}
	// Table changes: `batcher run --follow` of an incremental job over the
	// same table, woken by the NOTIFY trigger. It starts after the events
	// legs, whose UPDATEs it would otherwise index too, and its first run
	// covers every row (not counted: PGSync's daemon start is not either).
	// The job carries hard deletes too (vanished: delete, drained from the
	// capture follow-trigger installs), as PGSync's daemon does, so the
	// UPDATE legs measure the follower a user who wants deletes runs.
	fspec := spec
	fspec.Job, fspec.Mode, fspec.Vanished = "records-follow", batch.ModeIncremental, batch.VanishedDelete
	fspec.Source.Cursor = []string{"change_seq"}
	fspec.Document.Fields = append(slices.Clone(spec.Document.Fields), batch.Field{Name: "mark", From: "payload.mark", Type: "number"})
	raw, err = json.Marshal(fspec)
	check(b, err)
	fspecFile := filepath.Join(e.dir, dbName+"-follow.json")
	check(b, os.WriteFile(fspecFile, raw, 0o644))
	e.followTrigger(b, pl, fspecFile)
	catchUp := time.Now()
	fp := testproc.Start(b, e.bins["batcher"], pl.env, "run", "--spec", fspecFile, "--follow")
	defer func() { _ = fp.Signal(syscall.SIGTERM); _ = fp.Wait(time.Minute) }()
	w.warmUp(b, fp, pub, idx)
	b.Logf("outboxrelay round %d: follower's first run and one change searchable in %s", round, time.Since(catchUp).Round(time.Millisecond))
	if e.s.Runs(legChanges) {
		for i, rate := range e.s.ChangeRates {
			l := w.run(b, rate, e.s.LegDuration, int64(round*100+80+i)*100_000_000, nil, fp, pub, idx)
			l.Tool, l.Kind, l.Round = ourName, kindChanges, round
			legs = append(legs, l)
		}
	}
	if e.s.Runs(legDeletes) {
		for _, rate := range e.s.DeleteRates {
			l := w.deletes(b, rate, e.s.LegDuration, fp, pub, idx)
			l.Tool, l.Kind, l.Round = ourName, kindDeletes, round
			legs = append(legs, l)
		}
	}
	return legs
}

// migratedSeeded creates name on the private cluster, migrates it with the
// batcher binary and seeds the rows.
func (e *env) migratedSeeded(b testing.TB, name string) (string, *pgxpool.Pool) {
	url := e.createDatabase(b, name)
	e.migrate(b, url)
	return url, e.seed(b, name, url)
}

// migrate runs `batcher migrate` on the database at url.
func (e *env) migrate(b testing.TB, url string) {
	mig := testproc.Run(b, 5*time.Minute, e.bins["batcher"], []string{"DATABASE_URL=" + url, "LOG_LEVEL=warn"}, "migrate")
	if mig.ExitCode() != 0 {
		b.Fatalf("batcher migrate: exit %d\n%s", mig.ExitCode(), mig.Stderr())
	}
}

func machine() string {
	host, _ := os.Hostname()
	model := ""
	if raw, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(raw), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d cores (%s), %s/%s", host, runtime.NumCPU(), model, runtime.GOOS, runtime.GOARCH)
}

func check(tb testing.TB, err error) {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}
