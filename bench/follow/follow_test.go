// Package bench_follow measures how soon a committed single-row change is
// seen by searches with `batcher run --follow` → publisher → indexer, the
// three real binaries on the local stack, at a steady 50 and 500 changes/s,
// for two kinds of change (a sub-benchmark each, op=update and op=delete):
//
//	make bench-follow    # or, on a running stack:
//	flock /tmp/bench.lock go test -run '^$' -bench Follow -benchtime 1x -timeout 30m -v ./bench/follow/
//
// op=update: each update gives one row (never the same row twice) a new
// payload.seq; the document carries it as the field seq. The clock of an
// update starts when its COMMIT returns and stops when a search through
// the read alias (not a realtime GET: what users see) first returns the
// document with that seq; the searcher asks every 10 ms for seqs not yet
// seen (small answers: past the highest seen, and the holes below it).
//
// op=delete: each is a hard DELETE of one row (never the same row twice)
// from a `vanished: delete` job's table with the follow trigger (and so
// the delete capture) installed. The clock starts when the DELETE's COMMIT
// returns and stops when a search through the read alias (which filters
// the tombstones out) first no longer returns that id; the searcher asks
// every 10 ms which of the committed, still pending ids are visible (an
// ids query: a small answer).
//
// Each reports p50, p99 and max, where the time went (commit → the chunk
// or tombstone transaction, commit → the record on the topic), and the
// CPU the stack used meanwhile.
//
// The update legs run twice: on a `vanished: keep` job (as before deletes
// were carried: the figures to compare with earlier ones) and on the
// `vanished: delete` job the delete legs run, whose every run also drains
// the captured deletes (sub-benchmarks vanished=keep and vanished=delete).
// FOLLOW_BENCH_ROUNDS (default 1) repeats the whole set, interleaved
// (the repeated sub-benchmarks' names get #01, #02, …).
//
// FOLLOW_BENCH_SECONDS (default 10) is the writing window per rate;
// FOLLOW_BENCH_RATES (default "50,500") the rates; FOLLOW_BENCH_OPS
// (default "update,delete") the kinds of change; FOLLOW_BENCH_VANISHED
// (default "keep,delete") the update legs' jobs; FOLLOW_BENCH_ENV extra settings for all
// three processes ("K=V K=V", e.g. FLUSH_INTERVAL=50ms) to compare;
// FOLLOW_BENCH_REFRESH the index's refresh_interval (default: the
// built-in mapping's, 1s).
package bench_follow

import (
	"cmp"
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
	ops := []string{opUpdate, opDelete}
	if v := os.Getenv("FOLLOW_BENCH_OPS"); v != "" {
		ops = nil
		for _, f := range strings.Split(v, ",") {
			op := strings.TrimSpace(f)
			if op != opUpdate && op != opDelete {
				b.Fatalf("FOLLOW_BENCH_OPS=%q: want update, delete or both", v)
			}
			ops = append(ops, op)
		}
	}
	var updateJobs []string
	for _, f := range strings.Split(cmp.Or(os.Getenv("FOLLOW_BENCH_VANISHED"), "keep,delete"), ",") {
		v := strings.TrimSpace(f)
		if v != batch.VanishedKeep && v != batch.VanishedDelete {
			b.Fatalf("FOLLOW_BENCH_VANISHED=%q: want keep, delete or both", os.Getenv("FOLLOW_BENCH_VANISHED"))
		}
		updateJobs = append(updateJobs, v)
	}
	rounds, err := strconv.Atoi(cmp.Or(os.Getenv("FOLLOW_BENCH_ROUNDS"), "1"))
	if err != nil || rounds < 1 {
		b.Fatalf("FOLLOW_BENCH_ROUNDS=%q: want a positive count", os.Getenv("FOLLOW_BENCH_ROUNDS"))
	}
	for range rounds {
		followLegs(b, ops, updateJobs, rates, time.Duration(secs)*time.Second)
	}
}

// followLegs runs one leg of each op, job and rate, the rate outermost so
// that the legs compared at one rate run next to each other.
func followLegs(b *testing.B, ops, updateJobs []string, rates []int, window time.Duration) {
	for _, rate := range rates {
		for _, op := range ops {
			jobs := updateJobs
			if op == opDelete {
				// Hard deletes reach the index only through a job that
				// drains the delete capture.
				jobs = []string{batch.VanishedDelete}
			}
			for _, vanished := range jobs {
				b.Run(fmt.Sprintf("op=%s/vanished=%s/rate=%d", op, vanished, rate), func(b *testing.B) {
					for range b.N {
						runOnce(b, op, vanished, rate, window)
					}
				})
			}
		}
	}
}

const (
	opUpdate = "update"
	opDelete = "delete"
)

func runOnce(b *testing.B, op, vanished string, rate int, window time.Duration) {
	ctx := context.Background()
	b.StopTimer()
	changes := rate * int(window/time.Second)
	rows := changes + 1000
	pl := benchround.NewPipeline(b, "bench-follow", 6)
	pool, brokers, es, topic, alias, bins := pl.Pool, pl.Brokers, pl.Search, pl.Topic, pl.Alias, pl.Bins
	spec, err := batch.LoadSpec(filepath.Join(stack.RepoRoot(), "demo", "job.yaml"))
	check(b, err)
	spec.Job, spec.Mode, spec.Vanished, spec.Topic = "records-follow", batch.ModeIncremental, vanished, topic
	// One table, as the earlier results: without the demo's comments
	// relation (bench/peers' relations leg measures relations).
	spec.Document.Relations = nil
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
	ids, err := pickIDs(ctx, pool, changes)
	check(b, err)

	cpu0 := stack.ReadCPU()
	b.StartTimer()
	var committed, seen []time.Time
	if op == opDelete {
		committed, seen = measureDeletes(ctx, b, pool, es, alias, ids, rate, window, logs)
	} else {
		committed, seen = measureUpdates(ctx, b, pool, es, alias, ids, rate, window, logs)
	}
	b.StopTimer()
	cpu := stack.ReadCPU().Sub(cpu0)
	lat := make([]time.Duration, changes)
	for i := range changes {
		lat[i] = max(0, seen[i].Sub(committed[i]))
	}
	// Where the time went: the chunk transaction that normalized the
	// update, or the run's transaction that wrote the delete's tombstone
	// (normalized_records.updated_at, its start), and the record's
	// timestamp on the topic (the publisher's produce).
	stages := stageTimes(ctx, b, pool, brokers, topic, ids)
	var batched, produced []time.Duration
	for i := range changes {
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
	what, until, stage := "updates", "searchable", "chunk"
	if op == opDelete {
		what, until, stage = "hard deletes", "gone from searches", "tombstone"
	}
	msg := fmt.Sprintf("%d %s at %d/s over %s (job vanished: %s): commit→%s p50 %s, p99 %s, max %s; stages: commit→%s %s, commit→on the topic %s; %s; settings %q refresh %q",
		changes, what, rate, window, vanished, until, p50.Round(time.Millisecond), p99.Round(time.Millisecond), top.Round(time.Millisecond), stage, pct(batched), pct(produced), cpu,
		os.Getenv("FOLLOW_BENCH_ENV"), os.Getenv("FOLLOW_BENCH_REFRESH"))
	b.Log(msg)
	fmt.Println(b.Name() + ": " + msg)
}

// writeAtRate runs change(i) for i in [0, n) at a steady rate: change i is
// due at start + i/rate; a late one goes at once (up to four connections
// keep up when a commit is slow). It records when each change's commit
// returned and then calls done(i) (nil: nothing); it returns after the
// last commit and with the first error.
func writeAtRate(start time.Time, n, rate int, change func(i int) error, committed []time.Time, done func(i int)) error {
	sem := make(chan struct{}, 4)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		werr error
	)
	for i := range n {
		due := start.Add(time.Duration(i) * time.Second / time.Duration(rate))
		if d := time.Until(due); d > 0 {
			poll(d)
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			err := change(i)
			committed[i] = time.Now()
			if err != nil {
				mu.Lock()
				werr = cmp.Or(werr, err)
				mu.Unlock()
				return
			}
			if done != nil {
				done(i)
			}
		}()
	}
	wg.Wait()
	return werr
}

// measureUpdates gives the rows ids[i] payload.seq = i at rate/s and
// returns when each commit returned and when a search first found it.
func measureUpdates(ctx context.Context, b *testing.B, pool *pgxpool.Pool, es *elastic.Client, alias string, ids []int64, rate int, window time.Duration, logs func() string) (committed, seen []time.Time) {
	updates := len(ids)
	committed, seen = make([]time.Time, updates), make([]time.Time, updates)
	start := time.Now()
	werr := make(chan error, 1)
	go func() {
		werr <- writeAtRate(start, updates, rate, func(i int) error {
			_, err := pool.Exec(ctx, `UPDATE source_records SET payload = payload || jsonb_build_object('seq', $2::int) WHERE id = $1`, ids[i], i)
			return err
		}, committed, nil)
	}()
	// The searcher: every 10 ms, the documents past the highest seq seen,
	// and the few below it not seen yet (other topic partitions run
	// behind). Each answer is small, so its own duration does not add to
	// the latencies it measures.
	lowest, hi := 0, -1
	deadline := start.Add(window + 2*time.Minute)
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
	check(b, <-werr)
	return committed, seen
}

// measureDeletes deletes the rows ids at rate/s, one DELETE per
// transaction, and returns when each commit returned and when a search
// through the read alias first no longer found the id.
func measureDeletes(ctx context.Context, b *testing.B, pool *pgxpool.Pool, es *elastic.Client, alias string, ids []int64, rate int, window time.Duration, logs func() string) (committed, seen []time.Time) {
	n := len(ids)
	committed, seen = make([]time.Time, n), make([]time.Time, n)
	// Each delete's index once its commit returned: only then is its
	// absence from searches its latency (before, the id is visible anyway).
	done := make(chan int, n)
	start := time.Now()
	werr := make(chan error, 1)
	go func() {
		werr <- writeAtRate(start, n, rate, func(i int) error {
			tag, err := pool.Exec(ctx, `DELETE FROM source_records WHERE id = $1`, ids[i])
			if err == nil && tag.RowsAffected() != 1 {
				err = fmt.Errorf("DELETE of id %d deleted %d rows", ids[i], tag.RowsAffected())
			}
			return err
		}, committed, func(i int) { done <- i })
	}()
	// The searcher: every 10 ms, which of the committed deletes not yet
	// gone are still visible (an ids query over them; a small answer).
	pending := map[string]int{} // _id → index of its delete
	gone, writing := 0, true
	var wres error
	deadline := start.Add(window + 2*time.Minute)
	for gone < n {
		if time.Now().After(deadline) {
			b.Fatalf("%d of %d deletes not gone from searches after %s\n%s", n-gone, n, time.Since(start), logs())
		}
		for more := true; more; {
			select {
			case i := <-done:
				pending[strconv.FormatInt(ids[i], 10)] = i
			case wres = <-werr:
				writing = false
				check(b, wres)
			default:
				more = false
			}
		}
		if len(pending) > 0 {
			asked := make([]string, 0, len(pending))
			for id := range pending {
				if len(asked) == 10_000 { // the engine's largest page
					break
				}
				asked = append(asked, id)
			}
			res, err := es.Search(alias).Query(elastic.NewIdsQuery().Ids(asked...)).FetchSource(false).Size(len(asked)).Do(ctx)
			// An answer counts only when complete: a missing hit must mean
			// the document is not searchable, not that a shard failed.
			if err == nil && !res.TimedOut && (res.Shards == nil || res.Shards.Failed == 0) {
				now := time.Now()
				visible := make(map[string]bool, len(res.Hits.Hits))
				for _, h := range res.Hits.Hits {
					visible[h.Id] = true
				}
				for _, id := range asked {
					if !visible[id] {
						seen[pending[id]] = now
						delete(pending, id)
						gone++
					}
				}
			}
		}
		poll(10 * time.Millisecond)
	}
	if writing {
		check(b, <-werr)
	}
	return committed, seen
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
