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
// that seq; the searcher asks every 10 ms for seqs not yet seen (small
// answers: past the highest seen, and the holes below it). It
// reports p50, p99 and max, and the CPU the stack used meanwhile.
//
// FOLLOW_BENCH_SECONDS (default 10) is the writing window per rate;
// FOLLOW_BENCH_RATES (default "50,500") the rates; FOLLOW_BENCH_ENV extra
// settings for all three processes ("K=V K=V", e.g. FLUSH_INTERVAL=50ms)
// to compare; FOLLOW_BENCH_REFRESH the index's refresh_interval (default:
// the built-in mapping's, 1s).
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
	"github.com/outboxrelay/outboxrelay/internal/benchround"
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
	pl := benchround.NewPipeline(b, "bench-follow", 6)
	pool, brokers, es, topic, alias, bins := pl.Pool, pl.Brokers, pl.Search, pl.Topic, pl.Alias, pl.Bins
	spec, err := batch.LoadSpec(filepath.Join(stack.RepoRoot(), "demo", "job.yaml"))
	check(b, err)
	spec.Job, spec.Mode, spec.Vanished, spec.Topic = "records-follow", batch.ModeIncremental, batch.VanishedKeep, topic
	spec.Source.Cursor = []string{"change_seq"}
	spec.Document.Fields = append(spec.Document.Fields, batch.Field{Name: "seq", From: "payload.seq", Type: "number"})
	specFile := filepath.Join(b.TempDir(), "job.json")
	raw, err := json.Marshal(spec)
	check(b, err)
	check(b, os.WriteFile(specFile, raw, 0o644))
	env := pl.With()
	env = append(env, strings.Fields(os.Getenv("FOLLOW_BENCH_ENV"))...)
	if v := os.Getenv("FOLLOW_BENCH_REFRESH"); v != "" {
		// The built-in mapping with another refresh interval, from
		// MAPPING_FILE for the indexer that creates the index.
		var m map[string]any
		check(b, json.Unmarshal(sink.DefaultMapping, &m))
		m["settings"].(map[string]any)["index"].(map[string]any)["refresh_interval"] = v
		mb, err := json.Marshal(m)
		check(b, err)
		mf := filepath.Join(b.TempDir(), "mapping.json")
		check(b, os.WriteFile(mf, mb, 0o644))
		env = append(env, "MAPPING_FILE="+mf)
	}

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
	// The searcher: every 10 ms, the documents past the highest seq seen,
	// and the few below it not seen yet (other topic partitions run
	// behind). Each answer is small, so its own duration does not add to
	// the latencies it measures.
	lowest, hi := 0, -1
	deadline = start.Add(window + 2*time.Minute)
	mark := func(res *elastic.SearchResult, now time.Time) {
		for _, h := range res.Hits.Hits {
			var d struct{ Seq *int }
			if json.Unmarshal(h.Source, &d) == nil && d.Seq != nil && *d.Seq >= 0 && *d.Seq < updates && seen[*d.Seq].IsZero() {
				seen[*d.Seq] = now
				hi = max(hi, *d.Seq)
			}
		}
	}
	seqOnly := elastic.NewFetchSourceContext(true).Include("seq")
	for lowest < updates {
		if time.Now().After(deadline) {
			b.Fatalf("update %d of %d not searchable after %s\n%s", lowest, updates, time.Since(start), logs())
		}
		var holes []any
		for i := lowest; i < hi && len(holes) < 1000; i++ {
			if seen[i].IsZero() {
				holes = append(holes, i)
			}
		}
		if len(holes) > 0 {
			if res, err := es.Search(alias).Query(elastic.NewTermsQuery("seq", holes...)).FetchSourceContext(seqOnly).Size(len(holes)).Do(ctx); err == nil {
				mark(res, time.Now())
			}
		}
		if res, err := es.Search(alias).Query(elastic.NewRangeQuery("seq").Gt(hi)).Sort("seq", true).FetchSourceContext(seqOnly).Size(1000).Do(ctx); err == nil {
			mark(res, time.Now())
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
	// Where the time went: the chunk transaction that normalized the
	// update (normalized_records.updated_at, its start) and the record's
	// timestamp on the topic (the publisher's produce).
	stages := stageTimes(ctx, b, pool, brokers, topic, ids)
	var batched, produced []time.Duration
	for i := range updates {
		if t, ok := stages.batched[ids[i]]; ok {
			batched = append(batched, t.Sub(committed[i]))
		}
		if t, ok := stages.produced[strconv.FormatInt(ids[i], 10)]; ok {
			produced = append(produced, t.Sub(committed[i]))
		}
	}
	slices.Sort(lat)
	p50, p99, top := lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]
	b.ReportMetric(float64(p50.Milliseconds()), "p50-ms")
	b.ReportMetric(float64(p99.Milliseconds()), "p99-ms")
	b.ReportMetric(float64(top.Milliseconds()), "max-ms")
	msg := fmt.Sprintf("%d updates at %d/s over %s: commit→searchable p50 %s, p99 %s, max %s; stages: commit→chunk %s, commit→on the topic %s; %s; settings %q refresh %q",
		updates, rate, window, p50.Round(time.Millisecond), p99.Round(time.Millisecond), top.Round(time.Millisecond), pct(batched), pct(produced), cpu,
		os.Getenv("FOLLOW_BENCH_ENV"), os.Getenv("FOLLOW_BENCH_REFRESH"))
	b.Log(msg)
	fmt.Println(b.Name() + ": " + msg)
}

// pct formats p50 and p99 of ds.
func pct(ds []time.Duration) string {
	if len(ds) == 0 {
		return "n/a"
	}
	slices.Sort(ds)
	return fmt.Sprintf("p50 %s p99 %s", ds[len(ds)/2].Round(time.Millisecond), ds[len(ds)*99/100].Round(time.Millisecond))
}

type stages struct {
	batched  map[int64]time.Time
	produced map[string]time.Time // by key: the newest record's timestamp
}

func stageTimes(ctx context.Context, b *testing.B, pool *pgxpool.Pool, brokers []string, topic string, ids []int64) stages {
	st := stages{batched: map[int64]time.Time{}, produced: map[string]time.Time{}}
	rows, err := pool.Query(ctx, `SELECT source_id::bigint, updated_at FROM normalized_records WHERE source_id::bigint = ANY($1)`, ids)
	check(b, err)
	var id int64
	var at time.Time
	_, err = pgx.ForEachRow(rows, []any{&id, &at}, func() error { st.batched[id] = at; return nil })
	check(b, err)
	for part := range 6 {
		conn, err := kafka.DialLeader(ctx, "tcp", brokers[0], topic, part)
		check(b, err)
		last, err := conn.ReadLastOffset()
		check(b, err)
		for next := int64(0); next < last; {
			check(b, conn.SetReadDeadline(time.Now().Add(30*time.Second)))
			_, err := conn.Seek(next, kafka.SeekAbsolute)
			check(b, err)
			batch := conn.ReadBatch(1, 16<<20)
			for {
				m, err := batch.ReadMessage()
				if err != nil {
					break
				}
				next = m.Offset + 1
				if t, ok := st.produced[string(m.Key)]; !ok || m.Time.After(t) {
					st.produced[string(m.Key)] = m.Time
				}
			}
			check(b, batch.Close())
		}
		check(b, conn.Close())
	}
	return st
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
