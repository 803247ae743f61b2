package bench_batcher

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/benchround"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/outbox"
)

func TestMain(m *testing.M) { stack.Main(m) }

const body = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu fugiat nulla pariatur. Excepteur sint occaecat cupidatat non proident, sunt in culpa qui officia deserunt mollit anim id est."

// copyBaseline COPYs the equivalent normalized rows and events from memory,
// 5,000 per transaction, and returns rows/s. The documents are byte for
// byte what the batcher builds from the same source rows (checked by
// sameWork), so both sides write the same bytes into the same indexes.
func copyBaseline(b *testing.B, pool *pgxpool.Pool, n int) float64 {
	ctx := context.Background()
	docs := make([][]byte, n)
	t0 := time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range n {
		g := i + 1
		created := t0.Add(time.Duration(g/10) * time.Second).Format("2006-01-02T15:04:05+00:00")
		docs[i], _ = json.Marshal(document{ID: int64(g * 3), Tenant: "t" + strconv.Itoa(g%8), Title: "Title number " + strconv.Itoa(g),
			Body: body, Tags: []string{"alpha", "beta", "gamma"}, CreatedAt: created})
	}
	// The events carry the document as jsonb prints it, which is what the
	// batcher puts into the outbox (normalized_records.document::json).
	payloads := make([]string, 0, n)
	for lo := 0; lo < n; lo += 10000 {
		batch := make([]string, 0, 10000)
		for _, d := range docs[lo:min(lo+10000, n)] {
			batch = append(batch, string(d))
		}
		rows, err := pool.Query(ctx, `SELECT d::text FROM unnest($1::jsonb[]) WITH ORDINALITY AS u(d, i) ORDER BY i`, batch)
		must(b, err)
		texts, err := pgx.CollectRows(rows, pgx.RowTo[string])
		must(b, err)
		payloads = append(payloads, texts...)
	}
	start := time.Now()
	for lo := 0; lo < n; lo += 5000 {
		hi := min(lo+5000, n)
		must(b, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.CopyFrom(ctx, pgx.Identifier{"normalized_records"}, []string{"source", "source_id", "document", "source_version", "processor_version", "deleted"},
				pgx.CopyFromSlice(hi-lo, func(i int) ([]any, error) {
					return []any{"source_records", strconv.Itoa((lo + i + 1) * 3), string(docs[lo+i]), int64(1), "v1", false}, nil
				})); err != nil {
				return err
			}
			_, err := tx.CopyFrom(ctx, pgx.Identifier{"outbox_events"}, []string{"event_id", "topic", "aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload"},
				pgx.CopyFromSlice(hi-lo, func(i int) ([]any, error) {
					id := strconv.Itoa((lo + i + 1) * 3)
					return []any{outbox.EventID("source_records", id, 1, "v1"), "outboxrelay.records", "source_records", id, int64(1), "upsert", payloads[lo+i]}, nil
				}))
			return err
		}))
	}
	return float64(n) / time.Since(start).Seconds()
}

func benchSpec() batch.Spec {
	s := batch.DemoSpec()
	s.Errors.Policy = batch.PolicyStrict
	s.Chunk = batch.ChunkSettings{Size: 5000, Min: 1000, Max: 20000, TargetDuration: batch.Duration(time.Second)}
	return s
}

// benchRows: BENCH_ROWS=100000,1000000 (default), each run for
// benchround.Repeats rounds of baseline, batcher, Go processor.
func benchRows(b *testing.B) []int {
	var out []int
	for _, f := range strings.Split(cmp.Or(os.Getenv("BENCH_ROWS"), "100000,1000000"), ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			b.Fatalf("BENCH_ROWS %q: want comma-separated positive counts", f)
		}
		out = append(out, n)
	}
	return out
}

// BenchmarkBatcher runs baseline, batcher and Go processor interleaved
// (baseline, batcher, Go, baseline, batcher, Go, ...) so that a noisy
// neighbour on the shared machine hits all three alike, and reports the
// median of each with the spread. The ratios are medians of the per-round
// ratios (each against the baseline of its own round).
func BenchmarkBatcher(b *testing.B) {
	bin := testproc.Build(b, "batcher")
	var rss = map[int]int64{}
	repeats := benchround.Repeats(b)
	for _, n := range benchRows(b) {
		b.Run(fmt.Sprintf("rows=%d", n), func(b *testing.B) {
			url := stack.Database(b)
			pool := stack.Pool(b, url)
			ctx := context.Background()
			must(b, exec(ctx, pool, batch.DemoSchemaSQL))
			must(b, exec(ctx, pool, `
INSERT INTO source_records (id, created_at, tenant_id, payload)
SELECT g * 3, timestamptz '2024-01-01' + (g / 10) * interval '1 second', 't' || (g % 8),
       jsonb_build_object('title', '  Title number ' || g || '  ', 'body', $2::text, 'tags', jsonb_build_array('alpha', 'beta', 'gamma'))
FROM generate_series(1, $1::int) g`, n, body))
			must(b, exec(ctx, pool, `VACUUM ANALYZE source_records`))
			// Autovacuum waking up on the target tables in the middle of one
			// contender's pass and not another's is noise, not work.
			// outbox_events is partitioned: the setting belongs to each shard's partition.
			must(b, exec(ctx, pool, `ALTER TABLE normalized_records SET (autovacuum_enabled = off);
DO $$ BEGIN
    FOR s IN 0..63 LOOP
        EXECUTE format('ALTER TABLE %I SET (autovacuum_enabled = off)', 'outbox_events_shard_' || lpad(s::text, 2, '0'));
    END LOOP;
END $$`))
			var avg float64
			must(b, pool.QueryRow(ctx, `SELECT avg(pg_column_size(payload)) FROM source_records`).Scan(&avg))
			b.Logf("%d source rows, payload ~%.0f bytes, %d rounds", n, avg, repeats)
			reset(b, pool)

			var baseline, sqlRate, goRate, sqlRatio, goRatio benchround.Series
			var p50, p99 []float64
			var peak int64
			var chunks int
			var want written
			for round := range repeats {
				base := copyBaseline(b, pool, n)
				baseline = append(baseline, base)
				got := sameWork(b, pool, n, "baseline", nil)
				if round == 0 {
					want = got
				}
				reset(b, pool)

				// The batcher binary, built-in normalizers compiled to SQL.
				specFile := filepath.Join(b.TempDir(), "spec.json")
				sb, _ := json.Marshal(benchSpec())
				must(b, os.WriteFile(specFile, sb, 0o600))
				start := time.Now()
				p := testproc.Start(b, bin, []string{"DATABASE_URL=" + url, "METRICS_ADDR=", "LOG_FORMAT=json", "PROGRESS=off"}, "run", "--spec", specFile)
				hwm := watchHWM(p)
				if err := p.Wait(30 * time.Minute); err != nil {
					b.Fatalf("batcher: %v\n%s", err, p.Stderr())
				}
				rate := float64(n) / time.Since(start).Seconds()
				sqlRate, sqlRatio = append(sqlRate, rate), append(sqlRatio, rate/base)
				a, z, c := chunkPercentiles(p.Stderr())
				p50, p99, chunks = append(p50, a), append(p99, z), c
				peak = max(peak, <-hwm)
				sameWork(b, pool, n, "batcher", &want)
				reset(b, pool)

				// A custom Go processor: read the chunk, build documents in
				// Go, write back (in process).
				goSpec := benchSpec()
				goSpec.Chunk.Concurrency = 2 // JSON work on both cores while the server waits
				r, err := batch.NewRunner(pool, goSpec, batch.Config{Processor: goProcessor{}})
				must(b, err)
				start = time.Now()
				if _, err := r.Run(ctx, ctx); err != nil {
					b.Fatal(err)
				}
				rate = float64(n) / time.Since(start).Seconds()
				goRate, goRatio = append(goRate, rate), append(goRatio, rate/base)
				sameWork(b, pool, n, "go processor", &want)
				reset(b, pool)
				b.Logf("round %d: baseline %.0f rows/s, batcher %.0f (%.2f), Go processor %.0f (%.2f)", round+1, base, sqlRate[round], sqlRatio[round], goRate[round], goRatio[round])
			}
			rss[n] = peak
			slices.Sort(p50)
			slices.Sort(p99)

			b.ReportMetric(sqlRate.Median(), "rows/s")
			b.ReportMetric(baseline.Median(), "baseline_rows/s")
			b.ReportMetric(sqlRatio.Median(), "ratio_sql")
			b.ReportMetric(goRate.Median(), "go_rows/s")
			b.ReportMetric(goRatio.Median(), "ratio_go")
			b.ReportMetric(p50[len(p50)/2], "chunk_p50_ms")
			b.ReportMetric(p99[len(p99)/2], "chunk_p99_ms")
			b.ReportMetric(float64(peak)/(1<<20), "peak_rss_MiB")
			b.Logf("rows=%d over %d rounds, median (min–max): baseline COPY %.0f (%s) rows/s | batcher (SQL) %.0f (%s) rows/s, ratio %.2f (%.2f–%.2f), %d chunks p50 %.0f ms p99 %.0f ms, peak RSS %.1f MiB (subprocess VmHWM) | Go processor %.0f (%s) rows/s, ratio %.2f (%.2f–%.2f)",
				n, repeats, baseline.Median(), baseline.Spread("%.0f"), sqlRate.Median(), sqlRate.Spread("%.0f"), sqlRatio.Median(), slices.Min(sqlRatio), slices.Max(sqlRatio),
				chunks, p50[len(p50)/2], p99[len(p99)/2], float64(peak)/(1<<20),
				goRate.Median(), goRate.Spread("%.0f"), goRatio.Median(), slices.Min(goRatio), slices.Max(goRatio))
			if small, ok := rss[100_000]; ok && n == 1_000_000 {
				b.ReportMetric(float64(peak)/float64(small), "rss_1M_over_100k")
				b.Logf("peak RSS 1M / 100k = %.2f", float64(peak)/float64(small))
			}
		})
	}
}

// written is what a contender left in the target tables.
type written struct {
	rows, events         int
	docBytes, eventBytes int64
}

// sameWork checks that a contender wrote n rows and n events and, when want
// is set, exactly as many document and payload bytes as the baseline: the
// comparison is only fair if both sides did the same work. Payloads are
// counted as the events' text (the view outbox_event_members), since the
// batcher's first load writes event groups (one row per shard, migration
// 019) where the baseline copies a row per event.
func sameWork(b *testing.B, pool *pgxpool.Pool, n int, who string, want *written) written {
	b.Helper()
	var w written
	must(b, pool.QueryRow(context.Background(), `SELECT
  (SELECT count(*) FROM normalized_records), (SELECT count(*) FROM outbox_event_members),
  (SELECT COALESCE(sum(pg_column_size(document)), 0) FROM normalized_records),
  (SELECT COALESCE(sum(octet_length(payload::text)), 0) FROM outbox_event_members)`).Scan(&w.rows, &w.events, &w.docBytes, &w.eventBytes))
	if w.rows != n || w.events != n {
		b.Fatalf("%s: normalized %d, events %d, want %d each", who, w.rows, w.events, n)
	}
	if want != nil && w != *want {
		b.Fatalf("%s wrote %+v, the baseline %+v: not the same work", who, w, *want)
	}
	return w
}

// watchHWM polls the child's VmHWM (peak RSS of its own image) until it
// exits. getrusage's maxrss is not used: it counts the test process's pages
// the child shared between fork and exec.
func watchHWM(p *testproc.Proc) <-chan int64 {
	out := make(chan int64, 1)
	go func() {
		var peak int64
		path := "/proc/" + strconv.Itoa(p.Cmd.Process.Pid) + "/status"
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			if b, err := os.ReadFile(path); err == nil {
				for _, line := range strings.Split(string(b), "\n") {
					if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
						kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
						peak = max(peak, kb*1024)
					}
				}
			}
			select {
			case <-p.Done():
				out <- peak
				return
			case <-t.C:
			}
		}
	}()
	return out
}

type document struct {
	ID        int64    `json:"id"`
	Tenant    string   `json:"tenant"`
	Title     string   `json:"title"`
	Body      string   `json:"body"`
	Tags      []string `json:"tags"`
	CreatedAt string   `json:"created_at"`
}

type goProcessor struct{}

func (goProcessor) Process(_ context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
	out := make([]batch.Result, len(rows))
	for i, r := range rows {
		var row struct {
			ID        int64           `json:"id"`
			Tenant    string          `json:"tenant_id"`
			CreatedAt string          `json:"created_at"`
			Payload   json.RawMessage `json:"payload"`
		}
		if err := json.Unmarshal(r.Row, &row); err != nil {
			return nil, err
		}
		var p struct {
			Title string   `json:"title"`
			Body  string   `json:"body"`
			Tags  []string `json:"tags"`
		}
		if err := json.Unmarshal(row.Payload, &p); err != nil {
			out[i] = batch.Result{Err: err, Code: "bad_payload"}
			continue
		}
		doc, err := json.Marshal(document{ID: row.ID, Tenant: row.Tenant, Title: strings.TrimSpace(p.Title), Body: p.Body, Tags: p.Tags, CreatedAt: row.CreatedAt})
		if err != nil {
			return nil, err
		}
		out[i] = batch.Result{Document: doc}
	}
	return out, nil
}

func chunkPercentiles(stderr string) (p50, p99 float64, n int) {
	var ds []float64
	sc := bufio.NewScanner(strings.NewReader(stderr))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var l struct {
			Msg                          string
			Fetch, Process, Commit       float64
			FetchMS, ProcessMS, CommitMS float64
		}
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) != nil || m["msg"] != "chunk committed" {
			continue
		}
		_ = l
		ds = append(ds, m["fetch_ms"].(float64)+m["process_ms"].(float64)+m["commit_ms"].(float64))
	}
	if len(ds) == 0 {
		return 0, 0, 0
	}
	slices.Sort(ds)
	return ds[len(ds)*50/100], ds[min(len(ds)-1, len(ds)*99/100)], len(ds)
}

func reset(b *testing.B, pool *pgxpool.Pool) {
	must(b, exec(context.Background(), pool, `TRUNCATE normalized_records, outbox_events, batch_runs, batch_jobs`))
	must(b, exec(context.Background(), pool, `CHECKPOINT`))
}

func exec(ctx context.Context, pool *pgxpool.Pool, sql string, args ...any) error {
	_, err := pool.Exec(ctx, sql, args...)
	return err
}

func must(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}
