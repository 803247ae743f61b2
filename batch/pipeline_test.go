package batch_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// holdAndFail fails the chunk that holds failID, but only once the next
// chunk is in flight and has written its rows (its transaction waits, idle,
// for this one): the next chunk's writes must then roll back with it.
type holdAndFail struct {
	failAfter
	pool    *pgxpool.Pool
	failID  string
	nextID  string // first id of the chunk after the failing one
	fail    atomic.Bool
	once    sync.Once
	sawNext chan struct{}
}

func (h *holdAndFail) Process(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
	if rows[0].ID == h.nextID {
		h.once.Do(func() { close(h.sawNext) })
	}
	for _, r := range rows {
		if h.fail.Load() && r.ID == h.failID {
			select {
			case <-h.sawNext:
			case <-time.After(time.Minute):
				return nil, fmt.Errorf("the next chunk never started: no chunk in flight next to this one")
			}
			// Both transactions open: this one (processing) and the next
			// one, written and waiting for this one to commit.
			deadline := time.Now().Add(time.Minute)
			for {
				var idle int
				if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'`).Scan(&idle); err != nil {
					return nil, err
				}
				if idle >= 2 {
					break
				}
				if time.Now().After(deadline) {
					return nil, fmt.Errorf("the next chunk never wrote")
				}
				time.Sleep(10 * time.Millisecond) // polling a server-side condition
			}
			return nil, fmt.Errorf("processor failed on id %s", r.ID)
		}
	}
	return h.failAfter.Process(ctx, rows)
}

func TestPipelineCommitsInOrderUnderFailure(t *testing.T) {
	t.Parallel()
	url, pool := newDB(t)
	seed(t, pool, 0, 3000, 3, 1) // ids 7g in cursor order; 500-row chunks
	s := spec(func(s *batch.Spec) { s.Chunk.Pipeline = 2 })
	// Chunk 2 (rows 1000..1499) fails at row 1250 while chunk 3 (1500..) is
	// in flight.
	p := &holdAndFail{pool: pool, failID: "8750", nextID: "10500", sawNext: make(chan struct{})}
	p.fail.Store(true)
	_, err := run(t, pool, s, batch.Config{Processor: p})
	require.ErrorContains(t, err, "processor failed on id 8750")

	c := count(t, pool, s.Job)
	require.Equal(t, counts{Normalized: 1000, Events: 1000, DistinctEvents: 1000, Processed: 1000, States: "failed"}, c,
		"chunks 0 and 1 committed; 2 failed; 3 (written, in flight) rolled back")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id::bigint >= 7000`))
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_id::bigint >= 7000`))
	var cursor []string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT cursor FROM batch_runs WHERE job = $1`, s.Job).Scan(&cursor))
	require.Equal(t, "6993", cursor[len(cursor)-1], "the checkpoint is the last row of chunk 1")

	p.fail.Store(false)
	sum, err := run(t, pool, s, batch.Config{Processor: p})
	require.NoError(t, err)
	require.True(t, sum.Done)
	exact(t, url, s.Job, 3000)
}

// A pipelined run gives the same results as one chunk at a time, on both
// paths, and MaxChunks counts committed chunks even with two in flight.
func TestPipelineSameResults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		pipeline  int
		processor bool
	}{
		{name: "sql one at a time", pipeline: 1},
		{name: "sql two in flight", pipeline: 2},
		{name: "go one at a time", pipeline: 1, processor: true},
		{name: "go two in flight", pipeline: 2, processor: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			url, pool := newDB(t)
			seed(t, pool, 0, 5003, 4, 1)
			s := spec(func(s *batch.Spec) { s.Chunk.Pipeline = tc.pipeline })
			cfg := batch.Config{MaxChunks: 3}
			if tc.processor {
				cfg.Processor = &failAfter{}
			}
			sum, err := run(t, pool, s, cfg)
			require.NoError(t, err)
			require.EqualValues(t, 3, sum.Chunks)
			require.Equal(t, counts{Normalized: 1500, Events: 1500, DistinctEvents: 1500, Processed: 1500, States: "pending"}, count(t, pool, s.Job))
			cfg.MaxChunks = 0
			sum, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.True(t, sum.Done)
			require.EqualValues(t, 8, sum.Chunks) // 3500 rows: 7 full chunks and the 3 left
			exact(t, url, s.Job, 5003)
		})
	}
}

// textKeys creates text_records: a text primary key k0000..k(n-1), the
// cursor of a job whose new rows land between existing keys (random, UUID
// or text keys).
func textKeys(t *testing.T, pool *pgxpool.Pool, n int) batch.Spec {
	t.Helper()
	_, err := pool.Exec(context.Background(), `CREATE TABLE text_records (id text PRIMARY KEY, version bigint NOT NULL DEFAULT 1, payload jsonb NOT NULL DEFAULT '{}')`)
	require.NoError(t, err)
	_, err = pool.Exec(context.Background(), `INSERT INTO text_records (id) SELECT 'k' || lpad(g::text, 4, '0') FROM generate_series(0, $1::int - 1) g`, n)
	require.NoError(t, err)
	return batch.Spec{
		Job:              "text-keys",
		Source:           batch.Source{Table: "text_records", Cursor: []string{"id"}, ID: "id", Version: "version"},
		ProcessorVersion: "v1",
		Chunk:            batch.ChunkSettings{Size: 100, Min: 100, Max: 100, Pipeline: 2},
	}
}

// missingTextKeys counts rows of text_records k0000..k(n-1) that have no
// normalized record at their version.
func missingTextKeys(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	return queryInt(t, pool, `SELECT count(*) FROM text_records t LEFT JOIN normalized_records n ON n.source = 'text_records' AND n.source_id = t.id AND n.source_version = t.version
WHERE n.source_id IS NULL AND t.id !~ 'x'`)
}

// A pipelined chunk's range (prev, upto] is planned before it runs. Rows
// inserted inside that range meanwhile (text keys land between existing
// ones) must not push rows that existed at the start out of the chunk:
// here a chunk is retried after lock timeouts while 150 rows are inserted
// inside its range of 100, and every row that existed at the start is
// processed.
func TestPipelinedRetryReadsThePlannedRange(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		proc batch.Processor
	}{
		{name: "sql"},
		{name: "go", proc: batch.ProcessorFunc(func(_ context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
			out := make([]batch.Result, len(rows))
			for i, r := range rows {
				out[i] = batch.Result{Document: r.Row}
			}
			return out, nil
		})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			s := textKeys(t, pool, 1000)
			s.Chunk.LockTimeout = batch.Duration(200 * time.Millisecond)
			s.Errors = batch.ErrorPolicy{MaxRetries: 1000, InitialBackoff: batch.Duration(20 * time.Millisecond), MaxBackoff: batch.Duration(100 * time.Millisecond)}

			// The chunk k0200..k0299 waits on k0250's key, times out, retries.
			blocker, err := pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = blocker.Rollback(context.Background()) })
			var blockerPID int32
			require.NoError(t, blocker.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&blockerPID))
			_, err = blocker.Exec(ctx, `INSERT INTO normalized_records (source, source_id, source_version, processor_version) VALUES ('text_records', 'k0250', 0, 'v0')`)
			require.NoError(t, err)
			done := startRun(t, url, s, batch.Config{LeaseTTL: testLease, Processor: tc.proc})
			// (Pipelined chunks also wait on each other's row locks: only a
			// wait on the blocker counts.)
			blocked := func(since time.Time) bool {
				return queryInt(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND $1 = ANY(pg_blocking_pids(pid)) AND xact_start > $2`, blockerPID, since) > 0
			}
			waitFor(t, time.Minute, "the chunk of k0250 waiting on the blocker", func() bool { return blocked(time.Time{}) })
			// More than the chunk's planned size: the read's LIMIT must grow.
			_, err = pool.Exec(ctx, `INSERT INTO text_records (id) SELECT 'k0250x' || lpad(g::text, 3, '0') FROM generate_series(0, 149) g`)
			require.NoError(t, err)
			var inserted time.Time
			require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&inserted))
			// A transaction begun after the insert committed: a retry whose
			// reads saw the new rows.
			waitFor(t, time.Minute, "a retry that sees the inserted rows waiting on the blocker", func() bool { return blocked(inserted) })
			require.NoError(t, blocker.Rollback(ctx))

			res := <-done
			require.NoError(t, res.err)
			require.True(t, res.sum.Done)
			require.Zero(t, missingTextKeys(t, pool), "every row that existed at the start is processed")
			require.Positive(t, queryInt(t, pool, `SELECT retries FROM batch_runs WHERE job = 'text-keys'`))
		})
	}
}

// The last chunk of a pipelined partition, shorter than the chunk size, is
// split in two halves that run side by side, instead of the whole of it on
// one connection while the other idles: 1,000 rows in chunks of 600 are
// 600, 200 and 200, and the result is the same.
func TestPipelinedLastChunkIsSplit(t *testing.T) {
	t.Parallel()
	for _, pipeline := range []int{1, 2} {
		t.Run(fmt.Sprintf("pipeline=%d", pipeline), func(t *testing.T) {
			t.Parallel()
			url, pool := newDB(t)
			seed(t, pool, 0, 1000, 4, 1)
			s := spec(func(s *batch.Spec) {
				s.Chunk = batch.ChunkSettings{Size: 600, Min: 100, Max: 600, Pipeline: pipeline}
			})
			sum, err := run(t, pool, s, batch.Config{})
			require.NoError(t, err)
			require.True(t, sum.Done)
			exact(t, url, s.Job, 1000)
			want := map[int]int64{1: 2, 2: 3}[pipeline] // 600 + 400, or 600 + 200 + 200
			require.Equal(t, want, sum.Chunks)
			require.Equal(t, want, queryInt(t, pool, `SELECT chunks FROM batch_runs WHERE job = $1`, s.Job))
		})
	}
}
