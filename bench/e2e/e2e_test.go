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
// The process settings are the tuned ones below; E2E_BENCH_* environment
// variables override them to compare (see settings).
package bench_e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

func TestMain(m *testing.M) { stack.Main(m) }

// settings of one benchmark run. Each can be overridden by the environment
// variable named in its comment.
type settings struct {
	Rows            int    // E2E_BENCH_ROWS, default 1,000,000
	TopicPartitions int    // E2E_BENCH_PARTITIONS, default 8
	BatcherWorkers  int    // E2E_BENCH_WORKERS: partitions (tenants) scanned at once, default 4
	PartitionBy     string // E2E_BENCH_PARTITION_BY: spec source.partition, default tenant_id ("none" = one cursor)
	ChunkSize       int    // E2E_BENCH_CHUNK: first chunk size, default 5000 (adapts between 1000 and 20000)
	Publishers      int    // E2E_BENCH_PUBLISHERS, default 1
	PublisherBatch  int    // E2E_BENCH_PUBLISHER_BATCH: events per shard per Kafka write, default 2000 (product default)
	Indexers        int    // E2E_BENCH_INDEXERS, default 1
	IndexerLanes    int    // E2E_BENCH_LANES, default 4
	IndexerBatch    int    // E2E_BENCH_INDEXER_BATCH: documents per bulk, default 5000
	RefreshInterval string // E2E_BENCH_REFRESH: index.refresh_interval of the index, default 30s ("" = product mapping, 1s)
}

func load() settings {
	s := settings{Rows: 1_000_000, TopicPartitions: 8, BatcherWorkers: 4, PartitionBy: "tenant_id", ChunkSize: 5000,
		Publishers: 1, PublisherBatch: 2000, Indexers: 1, IndexerLanes: 4, IndexerBatch: 5000, RefreshInterval: "30s"}
	num := func(name string, v *int) {
		if n, err := strconv.Atoi(os.Getenv(name)); err == nil {
			*v = n
		}
	}
	num("E2E_BENCH_ROWS", &s.Rows)
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

func BenchmarkPipeline(b *testing.B) {
	s := load()
	for range b.N {
		runOnce(b, s)
	}
}

func runOnce(b *testing.B, s settings) {
	ctx := context.Background()
	b.StopTimer()
	b.Logf("settings %+v", s)
	dbURL := stack.Database(b)
	pool := stack.Pool(b, dbURL)
	brokers := stack.KafkaBrokers(b)
	esURL := stack.ElasticsearchURL(b)
	es, err := sink.NewClient(esURL)
	check(b, err)
	topic, alias := stack.UniqueName("bench-e2e"), stack.UniqueName("bench-e2e")
	b.Cleanup(func() { _, _ = es.DeleteIndex(alias + "_v*").Do(context.Background()) })
	kc := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	res, err := kc.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: s.TopicPartitions, ReplicationFactor: 1}}})
	check(b, err)
	for _, e := range res.Errors {
		check(b, e)
	}

	bins := map[string]string{}
	for _, n := range []string{"batcher", "publisher", "indexer"} {
		bins[n] = testproc.Build(b, n)
	}
	spec, err := batch.LoadSpec(filepath.Join(stack.RepoRoot(), "demo", "job.yaml"))
	check(b, err)
	spec.Topic = topic
	spec.Source.Partition = s.PartitionBy
	spec.Chunk = batch.ChunkSettings{Size: s.ChunkSize, Min: 1000, Max: 20_000, TargetDuration: batch.Duration(time.Second)}
	dir := b.TempDir()
	specFile := filepath.Join(dir, "job.json")
	raw, err := json.Marshal(spec)
	check(b, err)
	check(b, os.WriteFile(specFile, raw, 0o644))
	env := []string{"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + strings.Join(brokers, ","), "ELASTICSEARCH_URL=" + esURL,
		"TOPIC=" + topic, "GROUP=" + topic, "ALIAS=" + alias, "METRICS_ADDR=", "PROGRESS=off", "LOG_FORMAT=json", "LOG_LEVEL=warn"}
	with := func(extra ...string) []string { return append(append([]string{}, env...), extra...) }
	if s.RefreshInterval != "" {
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
	b.Logf("seeded %d rows in %s", s.Rows, time.Since(t0).Round(time.Millisecond))
	bad := int64(s.Rows / 10_000)

	var procs []*testproc.Proc
	for i := range s.Publishers {
		procs = append(procs, testproc.Start(b, bins["publisher"], with("BATCH_SIZE="+strconv.Itoa(s.PublisherBatch), "PUBLISHER_ID=bench-"+strconv.Itoa(i)), "run"))
	}
	for range s.Indexers {
		procs = append(procs, testproc.Start(b, bins["indexer"], with("LANES="+strconv.Itoa(s.IndexerLanes), "BATCH_SIZE="+strconv.Itoa(s.IndexerBatch),
			"BATCH_BYTES="+strconv.Itoa(16<<20)), "run"))
	}
	logs := func() string {
		var out strings.Builder
		for _, p := range procs {
			fmt.Fprintf(&out, "--- %s\n%s\n", filepath.Base(p.Cmd.Path), lastLines(p.Stderr(), 10))
		}
		return out.String()
	}

	b.StartTimer()
	start := time.Now()
	bp := testproc.Start(b, bins["batcher"], with(), "run", "--spec", specFile, "--workers", strconv.Itoa(s.BatcherWorkers))
	var batched, drained, caught time.Duration
	var peakBacklog int64
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
		var backlog int64
		check(b, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_events`).Scan(&backlog))
		peakBacklog = max(peakBacklog, backlog)
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
	for _, p := range procs {
		_ = p.Signal(15)
		_ = p.Wait(30 * time.Second)
	}
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
