// Package bench_follow measures how soon a committed single-row change is
// searchable with `batcher run --follow` → publisher → indexer, the three
// real binaries on the local stack, at a steady 50 and 500 updates/s:
//
//	flock /tmp/bench.lock go test -run '^$' -bench Follow -benchtime 1x -timeout 30m -v ./bench/follow/
//
// Each update gives one row (never the same row twice) a new payload.seq;
// the document carries it as the field seq. The clock of an update starts
// when its COMMIT returns and stops when a search through the read alias
// (not a realtime GET: what users see) first returns the document with
// that seq; the searcher asks every 10 ms for seqs not yet seen. It
// reports p50, p99 and max, and the CPU the stack used meanwhile.
//
// FOLLOW_BENCH_SECONDS (default 10) is the writing window per rate;
// FOLLOW_BENCH_RATES (default "50,500") the rates; FOLLOW_BENCH_ENV extra
// settings for all three processes ("K=V K=V", e.g. FLUSH_INTERVAL=50ms)
// to compare.
package bench_follow

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/sink"
)

func TestMain(m *testing.M) { stack.Main(m) }

func BenchmarkFollowLatency(b *testing.B) {
	secs := 10
	if n, err := strconv.Atoi(os.Getenv("FOLLOW_BENCH_SECONDS")); err == nil && n > 0 {
		secs = n
	}
	rates := []int{50, 500}
	if v := os.Getenv("FOLLOW_BENCH_RATES"); v != "" {
		rates = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			check(b, err)
			rates = append(rates, n)
		}
	}
	for _, rate := range rates {
		b.Run(fmt.Sprintf("rate=%d", rate), func(b *testing.B) {
			for range b.N {
				runOnce(b, rate, time.Duration(secs)*time.Second)
			}
		})
	}
}

func runOnce(b *testing.B, rate int, window time.Duration) {
	ctx := context.Background()
	b.StopTimer()
	updates := rate * int(window/time.Second)
	rows := updates + 1000
	dbURL := stack.Database(b)
	pool := stack.Pool(b, dbURL)
	brokers := stack.KafkaBrokers(b)
	esURL := stack.ElasticsearchURL(b)
	es, err := sink.NewClient(esURL)
	check(b, err)
	topic, alias := stack.UniqueName("bench-follow"), stack.UniqueName("bench-follow")
	b.Cleanup(func() { _, _ = es.DeleteIndex(alias + "_v*").Do(context.Background()) })
	kc := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	res, err := kc.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 6, ReplicationFactor: 1}}})
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
	spec.Job, spec.Mode, spec.Vanished, spec.Topic = "records-follow", batch.ModeIncremental, batch.VanishedKeep, topic
	spec.Source.Cursor = []string{"change_seq"}
	spec.Document.Fields = append(spec.Document.Fields, batch.Field{Name: "seq", From: "payload.seq", Type: "number"})
	specFile := filepath.Join(b.TempDir(), "job.json")
	raw, err := json.Marshal(spec)
	check(b, err)
	check(b, os.WriteFile(specFile, raw, 0o644))
	env := []string{"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + strings.Join(brokers, ","), "ELASTICSEARCH_URL=" + esURL,
		"TOPIC=" + topic, "GROUP=" + topic, "ALIAS=" + alias, "METRICS_ADDR=", "PROGRESS=off", "LOG_FORMAT=json", "LOG_LEVEL=warn"}
	env = append(env, strings.Fields(os.Getenv("FOLLOW_BENCH_ENV"))...)

	check(b, demo.Seed(ctx, pool, demo.SeedOptions{Rows: rows}))
	tr := testproc.Run(b, time.Minute, bins["batcher"], env, "follow-trigger", "--spec", specFile, "--install")
	if tr.ExitCode() != 0 {
		b.Fatalf("follow-trigger: %s", tr.Stderr())
	}
	procs := []*testproc.Proc{
		testproc.Start(b, bins["publisher"], env, "run"),
		testproc.Start(b, bins["indexer"], env, "run"),
		testproc.Start(b, bins["batcher"], env, "run", "--spec", specFile, "--follow"),
	}
	logs := func() string {
		var out strings.Builder
		for _, p := range procs {
			fmt.Fprintf(&out, "--- %s %v\n%s\n", filepath.Base(p.Cmd.Path), p.Cmd.Args[1:], lastLines(p.Stderr(), 10))
		}
		return out.String()
	}
	// The initial run: every row searchable.
	deadline := time.Now().Add(5 * time.Minute)
	for {
		n, err := es.Count(alias).Do(ctx)
		if err == nil && n == int64(rows) {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("initial rows not searchable (%d of %d, %v)\n%s", n, rows, err, logs())
		}
		poll(200 * time.Millisecond)
	}
	ids, err := pickIDs(ctx, pool, updates)
	check(b, err)

	committed := make([]time.Time, updates)
	seen := make([]time.Time, updates)
	cpu0 := stack.ReadCPU()
	b.StartTimer()
	start := time.Now()
	var wg sync.WaitGroup
	var (
		werrMu sync.Mutex
		werr   error
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		// A steady rate: update i is due at start + i/rate; a late one
		// goes at once (two connections keep up when a commit is slow).
		sem := make(chan struct{}, 4)
		var inner sync.WaitGroup
		defer inner.Wait()
		for i := range updates {
			due := start.Add(time.Duration(i) * time.Second / time.Duration(rate))
			if d := time.Until(due); d > 0 {
				poll(d)
			}
			sem <- struct{}{}
			inner.Add(1)
			go func() {
				defer inner.Done()
				defer func() { <-sem }()
				_, err := pool.Exec(ctx, `UPDATE source_records SET payload = payload || jsonb_build_object('seq', $2::int) WHERE id = $1`, ids[i], i)
				committed[i] = time.Now()
				if err != nil {
					werrMu.Lock()
					werr = err
					werrMu.Unlock()
				}
			}()
		}
	}()
	// The searcher: every 10 ms, the documents whose seq is not seen yet.
	lowest := 0
	deadline = start.Add(window + 2*time.Minute)
	for lowest < updates {
		if time.Now().After(deadline) {
			b.Fatalf("update %d of %d not searchable after %s\n%s", lowest, updates, time.Since(start), logs())
		}
		res, err := es.Search(alias).Query(elastic.NewRangeQuery("seq").Gte(lowest)).
			FetchSourceContext(elastic.NewFetchSourceContext(true).Include("seq")).Size(10_000).Do(ctx)
		now := time.Now()
		if err == nil {
			for _, h := range res.Hits.Hits {
				var d struct{ Seq *int }
				if json.Unmarshal(h.Source, &d) == nil && d.Seq != nil && *d.Seq < updates && seen[*d.Seq].IsZero() {
					seen[*d.Seq] = now
				}
			}
		}
		for lowest < updates && !seen[lowest].IsZero() {
			lowest++
		}
		poll(10 * time.Millisecond)
	}
	wg.Wait()
	b.StopTimer()
	check(b, werr)
	cpu := stack.ReadCPU().Sub(cpu0)
	lat := make([]time.Duration, updates)
	for i := range updates {
		lat[i] = max(0, seen[i].Sub(committed[i]))
	}
	slices.Sort(lat)
	p50, p99, top := lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]
	b.ReportMetric(float64(p50.Milliseconds()), "p50-ms")
	b.ReportMetric(float64(p99.Milliseconds()), "p99-ms")
	b.ReportMetric(float64(top.Milliseconds()), "max-ms")
	msg := fmt.Sprintf("%d updates at %d/s over %s: commit→searchable p50 %s, p99 %s, max %s; %s; settings %v",
		updates, rate, window, p50.Round(time.Millisecond), p99.Round(time.Millisecond), top.Round(time.Millisecond), cpu, os.Getenv("FOLLOW_BENCH_ENV"))
	b.Log(msg)
	fmt.Println(b.Name() + ": " + msg)
}

// pickIDs returns n distinct source ids in a random order.
func pickIDs(ctx context.Context, pool *pgxpool.Pool, n int) ([]int64, error) {
	rows, err := pool.Query(ctx, `SELECT id FROM source_records ORDER BY random() LIMIT $1`, n)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}

func check(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

// poll waits d between looks at a condition (not a synchronization).
func poll(d time.Duration) { <-time.After(d) }

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
