// Package bench_e2e measures the whole pipeline with the real binaries:
// 1,000,000 rows of the demo table source_records, from the source table
// to searchable documents (batcher → outbox → publisher → Kafka → indexer →
// OpenSearch), all three stages running at once, as a user runs them.
//
//	make bench-e2e
//	go test -run '^$' -bench . -benchtime 1x -timeout 60m -v ./bench/e2e/
//
// The clock starts when the batcher starts (the table is seeded before)
// and stops when reconcile finds the index equal to normalized_records.
// Per stage it reports the rate over the time until that stage was done:
// batcher rows/s (its process exited), publisher events/s (outbox empty),
// indexer docs/s (consumer lag zero and the index reconciled).
//
// Two variants run one after the other, each a sub-benchmark: "defaults"
// starts the three binaries with nothing but the settings a user must give
// (the headline number: what a user gets), "tuned" with the settings below,
// which E2E_BENCH_* environment variables override (see settings).
// E2E_BENCH_VARIANTS=defaults (or tuned) runs one of them.
//
// By default the benchmark starts its own PostgreSQL, Kafka and OpenSearch
// and warms them up with a run of 50,000 rows (E2E_BENCH_WARMUP; 0: none)
// (E2E_BENCH_STACK=shared uses the servers of DATABASE_URL, KAFKA_BROKERS
// and ELASTICSEARCH_URL instead), so that it can report the CPU-seconds
// per 1,000 rows of every component: each server and each of the three
// processes. On a machine shared with other work the CPU-seconds are the
// measure to compare; the wall time moves with the load.
package bench_e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/benchround"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

func TestMain(m *testing.M) { stack.Main(m) }

// settings of one benchmark run. In the tuned variant each can be
// overridden by the environment variable named in its comment; the
// defaults variant takes only Rows (E2E_BENCH_ROWS) and the topic's
// partition count, and leaves the rest to the binaries' defaults.
type settings struct {
	Defaults        bool   // start the binaries without any of the settings below
	Rows            int    // E2E_BENCH_ROWS, default 1,000,000
	TopicPartitions int    // E2E_BENCH_PARTITIONS, default 8 (defaults variant: 3, the indexer's TOPIC_PARTITIONS default)
	BatcherWorkers  int    // E2E_BENCH_WORKERS: partitions (tenants) scanned at once, default 4
	PartitionBy     string // E2E_BENCH_PARTITION_BY: spec source.partition, default tenant_id ("none" = one cursor)
	ChunkSize       int    // E2E_BENCH_CHUNK: first chunk size, default 5000 (adapts between 1000 and 20000)
	Publishers      int    // E2E_BENCH_PUBLISHERS, default 1
	PublisherBatch  int    // E2E_BENCH_PUBLISHER_BATCH: events per shard per Kafka write, default 2000 (product default)
	Indexers        int    // E2E_BENCH_INDEXERS, default 1
	IndexerLanes    int    // E2E_BENCH_LANES, default 4
	IndexerBatch    int    // E2E_BENCH_INDEXER_BATCH: documents per bulk, default 5000
	RefreshInterval string // E2E_BENCH_REFRESH: index.refresh_interval of the index, default 30s ("" = product mapping, 1s)
	PublisherEnv    string // E2E_BENCH_PUBLISHER_ENV: extra "K=V,K=V" settings of the publisher, both variants (to compare one setting, e.g. COMPRESSION=none)
	IndexerEnv      string // E2E_BENCH_INDEXER_ENV: the same for the indexer
}

func productDefaults() settings {
	return settings{Defaults: true, Rows: 1_000_000, TopicPartitions: 3, Publishers: 1, Indexers: 1}
}

func tuned() settings {
	return settings{Rows: 1_000_000, TopicPartitions: 8, BatcherWorkers: 4, PartitionBy: "tenant_id", ChunkSize: 5000,
		Publishers: 1, PublisherBatch: 2000, Indexers: 1, IndexerLanes: 4, IndexerBatch: 5000, RefreshInterval: "30s"}
}

// load applies the environment to s.
func load(s settings) settings {
	num := func(name string, v *int) {
		if n, err := strconv.Atoi(os.Getenv(name)); err == nil {
			*v = n
		}
	}
	num("E2E_BENCH_ROWS", &s.Rows)
	s.PublisherEnv, s.IndexerEnv = os.Getenv("E2E_BENCH_PUBLISHER_ENV"), os.Getenv("E2E_BENCH_INDEXER_ENV")
	if s.Defaults {
		return s
	}
	num("E2E_BENCH_PARTITIONS", &s.TopicPartitions)
	num("E2E_BENCH_WORKERS", &s.BatcherWorkers)
	num("E2E_BENCH_CHUNK", &s.ChunkSize)
	num("E2E_BENCH_PUBLISHERS", &s.Publishers)
	num("E2E_BENCH_PUBLISHER_BATCH", &s.PublisherBatch)
	num("E2E_BENCH_INDEXERS", &s.Indexers)
	num("E2E_BENCH_LANES", &s.IndexerLanes)
	num("E2E_BENCH_INDEXER_BATCH", &s.IndexerBatch)
	if v, ok := os.LookupEnv("E2E_BENCH_PARTITION_BY"); ok {
		s.PartitionBy = strings.TrimPrefix(v, "none")
	}
	if v, ok := os.LookupEnv("E2E_BENCH_REFRESH"); ok {
		s.RefreshInterval = v
	}
	return s
}

// servers are the benchmark's own servers (nil with E2E_BENCH_STACK=shared).
type servers struct {
	postgres, kafka, search *stack.Server
}

// startServers starts a private PostgreSQL, Kafka and OpenSearch and points
// the stack helpers at them for the rest of the benchmark.
func startServers(b *testing.B) *servers {
	if os.Getenv("E2E_BENCH_STACK") == "shared" {
		return nil
	}
	s := &servers{postgres: stack.Private(b, "postgres"), kafka: stack.Private(b, "kafka"), search: stack.Private(b, "opensearch")}
	b.Setenv("DATABASE_URL", s.postgres.Env)
	b.Setenv("KAFKA_BROKERS", s.kafka.Env)
	b.Setenv("ELASTICSEARCH_URL", s.search.Env)
	return s
}

// cpu is the CPU time of each component over one run.
type cpu struct {
	Postgres, Kafka, Search, Batcher, Publisher, Indexer, Bench time.Duration
}

func (s *servers) read() cpu {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	c := cpu{Bench: time.Duration(ru.Utime.Nano() + ru.Stime.Nano())}
	if s != nil {
		c.Postgres, c.Kafka, c.Search = s.postgres.CPU(), s.kafka.CPU(), s.search.CPU()
	}
	return c
}

// procCPU is the CPU time of an exited process.
func procCPU(p *testproc.Proc) time.Duration {
	if p.Cmd.ProcessState == nil {
		return 0
	}
	return p.Cmd.ProcessState.UserTime() + p.Cmd.ProcessState.SystemTime()
}

// result of one run.
type result struct {
	name                            string
	rows                            int
	total, batched, drained, caught time.Duration
	cpu                             cpu
	statements                      []clientShare // PostgreSQL's share by client (nil: not measured)
}

func BenchmarkPipeline(b *testing.B) {
	srv := startServers(b)
	want := strings.Split(os.Getenv("E2E_BENCH_VARIANTS"), ",")
	if srv != nil {
		// New JVMs spend their first minute compiling: a short run of the
		// whole pipeline first, so the first variant is not charged for it.
		w := productDefaults()
		w.Rows = 50_000
		if n, err := strconv.Atoi(os.Getenv("E2E_BENCH_WARMUP")); err == nil {
			w.Rows = n
		}
		if w.Rows > 0 {
			b.Logf("warm-up: %d rows (E2E_BENCH_WARMUP)", w.Rows)
			runOnce(b, w, srv)
		}
	}
	var results []result
	for _, v := range []struct {
		name string
		s    settings
	}{{"defaults", load(productDefaults())}, {"tuned", load(tuned())}} {
		if want[0] != "" && !slices.Contains(want, v.name) {
			continue
		}
		b.Run(v.name, func(b *testing.B) {
			for range b.N {
				r := runOnce(b, v.s, srv)
				r.name = v.name
				results = append(results, r)
			}
		})
	}
	table := resultTable(results, srv != nil)
	b.Log("\n" + table)
	fmt.Print(table)
}

// resultTable is one row per run: wall times and CPU-seconds per 1,000 rows
// of each component.
func resultTable(results []result, ownServers bool) string {
	var out strings.Builder
	out.WriteString("bench-e2e: wall time and CPU-seconds per 1,000 rows per component\n")
	if !ownServers {
		out.WriteString("(E2E_BENCH_STACK=shared: the servers' CPU is not measured)\n")
	}
	fmt.Fprintf(&out, "%-9s %8s %8s %8s %8s %8s | %8s %8s %8s %8s %8s %8s %8s %8s\n",
		"variant", "rows", "e2e_s", "batch_s", "drain_s", "caught_s",
		"postgres", "kafka", "search", "batcher", "publishr", "indexer", "bench", "total")
	for _, r := range results {
		per := func(d time.Duration) float64 { return d.Seconds() / float64(r.rows) * 1000 }
		c := r.cpu
		sum := c.Postgres + c.Kafka + c.Search + c.Batcher + c.Publisher + c.Indexer + c.Bench
		fmt.Fprintf(&out, "%-9s %8d %8.1f %8.1f %8.1f %8.1f | %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f\n",
			r.name, r.rows, r.total.Seconds(), r.batched.Seconds(), r.drained.Seconds(), r.caught.Seconds(),
			per(c.Postgres), per(c.Kafka), per(c.Search), per(c.Batcher), per(c.Publisher), per(c.Indexer), per(c.Bench), per(sum))
	}
	for _, r := range results {
		if r.statements != nil {
			out.WriteString("\n" + statementsTable(r.name, r.rows, r.cpu.Postgres, r.statements))
		}
	}
	return out.String()
}

func runOnce(b *testing.B, s settings, srv *servers) result {
	ctx := context.Background()
	b.StopTimer()
	b.Logf("settings %+v", s)
	pl := benchround.NewPipeline(b, "bench-e2e", s.TopicPartitions)
	pool, brokers, es, topic, alias, bins := pl.Pool, pl.Brokers, pl.Search, pl.Topic, pl.Alias, pl.Bins
	spec, err := batch.LoadSpec(filepath.Join(stack.RepoRoot(), "demo", "job.yaml"))
	check(b, err)
	spec.Topic = topic
	// One table, as the earlier results: without the demo's comments
	// relation (bench/peers' relations leg measures relations).
	spec.Document.Relations = nil
	if !s.Defaults {
		spec.Source.Partition = s.PartitionBy
		spec.Chunk = batch.ChunkSettings{Size: s.ChunkSize, Min: 1000, Max: 20_000, TargetDuration: batch.Duration(time.Second)}
	}
	dir := b.TempDir()
	specFile := filepath.Join(dir, "job.json")
	raw, err := json.Marshal(spec)
	check(b, err)
	check(b, os.WriteFile(specFile, raw, 0o644))
	env := pl.Env
	with := func(extra ...string) []string { return append(append([]string{}, env...), extra...) }
	if s.RefreshInterval != "" && !s.Defaults {
		// The built-in mapping with another refresh interval: the index is
		// created by the first indexer from MAPPING_FILE.
		var m map[string]any
		check(b, json.Unmarshal(sink.DefaultMapping, &m))
		m["settings"].(map[string]any)["index"].(map[string]any)["refresh_interval"] = s.RefreshInterval
		mb, err := json.Marshal(m)
		check(b, err)
		mf := filepath.Join(dir, "mapping.json")
		check(b, os.WriteFile(mf, mb, 0o644))
		env = append(env, "MAPPING_FILE="+mf)
	}

	t0 := time.Now()
	check(b, demo.Seed(ctx, pool, demo.SeedOptions{Rows: s.Rows, BadEvery: 10_000}))
	// What seeding left to do (hint bits, statistics, dirty buffers) is not
	// the pipeline's work: do it before the CPU counters are read.
	_, err = pool.Exec(ctx, `VACUUM ANALYZE source_records`)
	check(b, err)
	_, err = pool.Exec(ctx, `CHECKPOINT`)
	check(b, err)
	b.Logf("seeded %d rows in %s", s.Rows, time.Since(t0).Round(time.Millisecond))
	bad := int64(s.Rows / 10_000)

	var publishers, indexers []*testproc.Proc
	for i := range s.Publishers {
		e := with("PUBLISHER_ID=bench-" + strconv.Itoa(i))
		if !s.Defaults {
			e = append(e, "BATCH_SIZE="+strconv.Itoa(s.PublisherBatch))
		}
		publishers = append(publishers, testproc.Start(b, bins["publisher"], asRole(append(e, envList(s.PublisherEnv)...), clientRoles["publisher"]), "run"))
	}
	for range s.Indexers {
		e := with()
		if !s.Defaults {
			e = append(e, "LANES="+strconv.Itoa(s.IndexerLanes), "BATCH_SIZE="+strconv.Itoa(s.IndexerBatch), "BATCH_BYTES="+strconv.Itoa(16<<20))
		}
		indexers = append(indexers, testproc.Start(b, bins["indexer"], asRole(append(e, envList(s.IndexerEnv)...), clientRoles["indexer"]), "run"))
	}
	procs := slices.Concat(publishers, indexers)
	logs := func() string {
		var out strings.Builder
		for _, p := range procs {
			fmt.Fprintf(&out, "--- %s\n%s\n", filepath.Base(p.Cmd.Path), lastLines(p.Stderr(), 10))
		}
		return out.String()
	}

	stmts, why, err := prepareStatements(ctx, pool)
	check(b, err)
	if !stmts {
		b.Logf("no split of PostgreSQL's share by client: %s", why)
	}
	cpu0 := srv.read()
	b.StartTimer()
	start := time.Now()
	args := []string{"run", "--spec", specFile}
	if !s.Defaults {
		args = append(args, "--workers", strconv.Itoa(s.BatcherWorkers))
	}
	bp := testproc.Start(b, bins["batcher"], asRole(with(), clientRoles["batcher"]), args...)
	var batched, drained, caught time.Duration
	var peakBacklog int64
	var polls int
	deadline := start.Add(20 * time.Minute)
	for {
		if time.Now().After(deadline) {
			b.Fatalf("the index did not match the source within 20 minutes\n%s", logs())
		}
		if batched == 0 {
			select {
			case <-bp.Done():
				if bp.ExitCode() != 0 {
					b.Fatalf("batcher: exit %d\n%s", bp.ExitCode(), lastLines(bp.Stderr(), 20))
				}
				batched = time.Since(start)
			default:
			}
		}
		// Is anything left: the first id in index order, not a count(*)
		// of the whole outbox every poll (that cost PostgreSQL 15.7 s of a
		// 1,000,000-row run, a tenth of its CPU, charged to the pipeline)
		// nor an EXISTS, which the planner makes a sequential scan of the
		// 64 partitions, their dead rows included (127 ms a poll near the
		// end, 28.6 s in all). An index scan skips the entries an earlier
		// poll found dead. The peak backlog is counted every 8th poll.
		var backlog int64
		var first int64
		err := pool.QueryRow(ctx, `SELECT id FROM outbox_events ORDER BY id LIMIT 1`).Scan(&first)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			check(b, err)
		}
		left := err == nil
		if polls++; left && polls%8 == 0 {
			check(b, pool.QueryRow(ctx, `SELECT coalesce(sum(coalesce(cardinality(group_ids), 1)), 0) FROM outbox_events`).Scan(&backlog)) // events: a group counts its members
			peakBacklog = max(peakBacklog, backlog)
		}
		if left {
			backlog = max(backlog, 1)
		}
		if batched == 0 || backlog > 0 {
			poll(250 * time.Millisecond)
			continue
		}
		if drained == 0 {
			drained = time.Since(start)
		}
		st, err := sink.GetStatus(ctx, sink.Config{Brokers: brokers, Topic: topic, Group: topic})
		if err != nil || st.TotalLag() > 0 {
			poll(250 * time.Millisecond)
			continue
		}
		if caught == 0 {
			caught = time.Since(start)
		}
		_, _ = es.Refresh(alias + "-write").Do(ctx)
		rep, err := reconcile.Run(ctx, reconcile.Config{DB: pool, Search: es, Index: alias + "-write", Source: "source_records"})
		if err == nil && rep.Clean() && rep.IndexDocs == int64(s.Rows)-bad {
			break
		}
		poll(500 * time.Millisecond)
	}
	total := time.Since(start)
	b.StopTimer()
	used := srv.read()
	for _, p := range procs {
		_ = p.Signal(15)
		_ = p.Wait(30 * time.Second)
	}
	used = cpu{Postgres: used.Postgres - cpu0.Postgres, Kafka: used.Kafka - cpu0.Kafka, Search: used.Search - cpu0.Search,
		Bench: used.Bench - cpu0.Bench, Batcher: procCPU(bp)}
	for _, p := range publishers {
		used.Publisher += procCPU(p)
	}
	for _, p := range indexers {
		used.Indexer += procCPU(p)
	}

	var shares []clientShare
	if stmts {
		shares, err = readStatements(ctx, pool)
		check(b, err)
	}

	docs := float64(int64(s.Rows) - bad)
	b.ReportMetric(total.Seconds(), "e2e_s")
	b.ReportMetric(float64(s.Rows)/total.Seconds(), "rows/s_e2e")
	b.ReportMetric(float64(s.Rows)/batched.Seconds(), "batcher_rows/s")
	b.ReportMetric(docs/drained.Seconds(), "publisher_events/s")
	b.ReportMetric(docs/caught.Seconds(), "indexer_docs/s")
	b.ReportMetric(float64(peakBacklog), "peak_outbox_backlog")
	msg := fmt.Sprintf("%d rows → %d searchable documents in %s (target < 3m): batcher done %s (%.0f rows/s), outbox drained %s (%.0f events/s), consumer caught up %s (%.0f docs/s), reconciled %s; peak outbox backlog %d",
		s.Rows, int64(docs), total.Round(time.Millisecond), batched.Round(time.Millisecond), float64(s.Rows)/batched.Seconds(),
		drained.Round(time.Millisecond), docs/drained.Seconds(), caught.Round(time.Millisecond), docs/caught.Seconds(), total.Round(time.Millisecond), peakBacklog)
	b.Log(msg)
	fmt.Println("bench-e2e:", msg)
	return result{rows: s.Rows, total: total, batched: batched, drained: drained, caught: caught, cpu: used, statements: shares}
}

// envList splits "K=V,K=V" into environment entries.
func envList(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

func check(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

// poll is the interval between checks of a condition.
func poll(d time.Duration) { time.Sleep(d) }

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}
