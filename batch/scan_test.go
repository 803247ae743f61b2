package batch_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/outbox"
)

func TestScanTiesAndGaps(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 100_000, 700, 1) // 700 rows share each created_at: more than a chunk
	s := spec(func(s *batch.Spec) { s.Chunk = batch.ChunkSettings{Size: 1000, Min: 200, Max: 5000} })
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, counts{Normalized: 100_000, Events: 100_000, DistinctEvents: 100_000, Processed: 100_000, States: "succeeded"}, count(t, pool, s.Job))

	ctx := context.Background()
	var atBoundary bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT cursor = boundary FROM batch_runs WHERE job = $1`, s.Job).Scan(&atBoundary))
	require.True(t, atBoundary, "checkpoint at the boundary")
	var missing int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM source_records s LEFT JOIN outbox_event_members e ON e.aggregate_id = s.id::text AND e.aggregate_version = s.version WHERE e.id IS NULL`).Scan(&missing))
	require.Zero(t, missing)

	// The event carries the deterministic id, the version and the document.
	var id, doc, typ string
	var ver int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_id::text, aggregate_version, event_type, payload::text FROM outbox_event_members WHERE aggregate_id = '7'`).Scan(&id, &ver, &typ, &doc))
	require.Equal(t, outbox.EventID("source_records", "7", 1, "v1"), id)
	require.Equal(t, "upsert", typ)
	var d map[string]any
	require.NoError(t, json.Unmarshal([]byte(doc), &d))
	require.Equal(t, "Title 1", d["title"], "trimmed")

	// A second full run over unchanged rows commits no new event.
	sum, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.EqualValues(t, 100_000, sum.Rows)
	require.Zero(t, sum.Changed)
	require.EqualValues(t, 100_000, count(t, pool, s.Job).Events)
}

func TestBoundaryFixedAtStart(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 5000, 10, 1)
	s := spec()
	_, err := run(t, pool, s, batch.Config{MaxChunks: 2})
	require.NoError(t, err)
	require.EqualValues(t, 1000, count(t, pool, s.Job).Processed)

	// Rows that arrive after the run started lie above its boundary.
	seed(t, pool, 5000, 1000, 10, 1)
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, counts{Normalized: 5000, Events: 5000, DistinctEvents: 5000, Processed: 5000, States: "succeeded"}, count(t, pool, s.Job))
	var newest int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM normalized_records WHERE source_id::bigint >= 5000 * 7`).Scan(&newest))
	require.Zero(t, newest)

	// The next run picks them up; unchanged rows make no new event.
	sum, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.EqualValues(t, 1000, sum.Changed)
	require.Equal(t, counts{Normalized: 6000, Events: 6000, DistinctEvents: 6000, Processed: 6000, States: "succeeded"}, count(t, pool, s.Job))
}

// failAfter is a custom processor that fails the chunk after n rows while
// failing is set (the seed's "failure after 250 rows of a 500-row chunk").
type failAfter struct {
	n       int
	failing atomic.Bool
	calls   atomic.Int64
}

func (f *failAfter) Process(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
	f.calls.Add(1)
	out := make([]batch.Result, len(rows))
	for i, r := range rows {
		if f.failing.Load() && i == f.n {
			return nil, fmt.Errorf("processor crashed at row %d (id %s)", i, r.ID)
		}
		var row map[string]any
		if err := json.Unmarshal(r.Row, &row); err != nil {
			return nil, err
		}
		doc, _ := json.Marshal(map[string]any{"id": r.ID, "title": row["payload"].(map[string]any)["title"]})
		out[i] = batch.Result{Document: doc}
	}
	return out, nil
}

func TestChunkFailureRollsBackEverything(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 1000, 3, 1)
	s := spec()
	p := &failAfter{n: 250}
	p.failing.Store(true)
	_, err := run(t, pool, s, batch.Config{Processor: p})
	require.ErrorContains(t, err, "processor crashed at row 250")
	c := count(t, pool, s.Job)
	require.Equal(t, counts{States: "failed"}, c, "processed count 0 and no results")

	p.failing.Store(false)
	sum, err := run(t, pool, s, batch.Config{Processor: p})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, counts{Normalized: 1000, Events: 1000, DistinctEvents: 1000, Processed: 1000, States: "succeeded"}, count(t, pool, s.Job))
}

func TestCustomProcessorConcurrency(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 3000, 3, 1)
	s := spec(func(s *batch.Spec) { s.Chunk.Concurrency = 4 })
	p := &failAfter{}
	sum, err := run(t, pool, s, batch.Config{Processor: p})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, counts{Normalized: 3000, Events: 3000, DistinctEvents: 3000, Processed: 3000, States: "succeeded"}, count(t, pool, s.Job))
	require.Greater(t, p.calls.Load(), int64(6), "chunks split across goroutines")
}

func TestIncompatibleRunsRefused(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 2000, 3, 2)
	s := spec()
	_, err := run(t, pool, s, batch.Config{MaxChunks: 1})
	require.NoError(t, err)

	tests := []struct {
		name string
		mut  func(*batch.Spec)
		opts batch.StartOptions
		want []string
	}{
		{name: "processor version", mut: func(s *batch.Spec) { s.ProcessorVersion = "v2" },
			want: []string{"processor version v1, the spec has v2", "rerun with StartOptions.Restart"}},
		{name: "processor version not declared compatible", mut: func(s *batch.Spec) { s.ProcessorVersion = "v2" }, opts: batch.StartOptions{Resume: true},
			want: []string{"declare v1 in compatible_versions"}},
		{name: "filter", mut: func(s *batch.Spec) {
			s.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "=", Value: "t1"}}
		}, want: []string{"scope", `"filter":[{"column":"tenant_id","op":"=","value":"t1"}]`, "rerun with StartOptions.Restart"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s2 := spec(tt.mut)
			_, err := run(t, pool, s2, batch.Config{StartOptions: tt.opts})
			require.ErrorIs(t, err, batch.ErrCheckpointIncompatible)
			for _, w := range tt.want {
				require.ErrorContains(t, err, w)
			}
			// The library names its options; the batcher prints its flags.
			require.NotContains(t, err.Error(), "--")
			var ie *batch.IncompatibleError
			require.ErrorAs(t, err, &ie)
			require.Contains(t, ie.Message("--restart", "--resume"), "rerun with --restart")
		})
	}

	// --resume with a declared compatible version continues the run.
	s2 := spec(func(s *batch.Spec) { s.ProcessorVersion = "v2"; s.CompatibleVersions = []string{"v1"} })
	sum, err := run(t, pool, s2, batch.Config{StartOptions: batch.StartOptions{Resume: true}, MaxChunks: 1})
	require.NoError(t, err)
	require.EqualValues(t, 500, sum.Rows)

	// --restart: a new run from the beginning with the new filter.
	s3 := spec(func(s *batch.Spec) {
		s.ProcessorVersion = "v3"
		s.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "=", Value: "t1"}}
	})
	sum, err = run(t, pool, s3, batch.Config{StartOptions: batch.StartOptions{Restart: true}})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.EqualValues(t, 1000, sum.Rows)
	var superseded int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM batch_runs WHERE state = 'superseded'`).Scan(&superseded))
	require.Equal(t, 1, superseded)
}

func TestSpecErrorsNameTheColumn(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	tests := []struct {
		name string
		mut  func(*batch.Spec)
		want string
	}{
		{name: "table", mut: func(s *batch.Spec) { s.Source.Table = "nope" }, want: `source table public.nope does not exist`},
		{name: "cursor", mut: func(s *batch.Spec) { s.Source.Cursor = []string{"made_at", "id"} }, want: `source.cursor[0]: column "made_at" does not exist`},
		{name: "version", mut: func(s *batch.Spec) { s.Source.Version = "rev" }, want: `source.version: column "rev" does not exist`},
		{name: "field", mut: func(s *batch.Spec) { s.Document.Fields[0].From = "ident" }, want: `document.fields[0].from: column "ident" does not exist`},
		{name: "path on text", mut: func(s *batch.Spec) { s.Document.Fields[0].From = "tenant_id.x" }, want: `a key path needs jsonb`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := run(t, pool, spec(tt.mut), batch.Config{})
			require.ErrorIs(t, err, batch.ErrSpec)
			require.ErrorContains(t, err, tt.want)
		})
	}
}

// transientOnce fails the row with id failID transiently the first `fails`
// times it sees it.
type transientOnce struct {
	failID string
	fails  atomic.Int64
}

func (p *transientOnce) Process(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
	out := make([]batch.Result, len(rows))
	for i, r := range rows {
		if r.ID == p.failID && p.fails.Add(-1) >= 0 {
			out[i] = batch.Result{Err: batch.Transient(errors.New("upstream 503")), Code: "upstream"}
			continue
		}
		out[i] = batch.Result{Document: json.RawMessage(`{"id":"` + r.ID + `"}`)}
	}
	return out, nil
}

func TestBadRowPolicies(t *testing.T) {
	t.Parallel()
	const badTitle, notObject = "707", "714" // rows g=101 and g=102
	tests := []struct {
		name   string
		policy string
		check  func(t *testing.T, c counts, sum *batch.Summary, err error)
	}{
		{name: "strict", policy: batch.PolicyStrict, check: func(t *testing.T, c counts, _ *batch.Summary, err error) {
			require.ErrorIs(t, err, batch.ErrBadRow)
			require.ErrorContains(t, err, "row id="+badTitle+": invalid_type: field title (payload.title): want string, got number")
			require.Equal(t, "failed", c.States)
			require.Zero(t, c.Processed, "the first chunk holds the bad row and rolled back")
		}},
		{name: "quarantine", policy: batch.PolicyQuarantine, check: func(t *testing.T, c counts, sum *batch.Summary, err error) {
			require.NoError(t, err)
			require.EqualValues(t, 2, sum.Quarantined)
			require.Equal(t, counts{Normalized: 998, Events: 998, DistinctEvents: 998, Processed: 1000, States: "succeeded"}, c)
		}},
		{name: "retry", policy: batch.PolicyRetry, check: func(t *testing.T, c counts, _ *batch.Summary, err error) {
			require.ErrorIs(t, err, batch.ErrBadRow, "a malformed row is not transient: no retry")
			require.ErrorContains(t, err, "row id="+badTitle)
			require.Equal(t, "failed", c.States)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, pool := newDB(t)
			seed(t, pool, 0, 1000, 3, 1)
			ctx := context.Background()
			_, err := pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '42') WHERE id = $1`, badTitle)
			require.NoError(t, err)
			_, err = pool.Exec(ctx, `UPDATE source_records SET payload = '[1,2]' WHERE id = $1`, notObject)
			require.NoError(t, err)
			s := spec(func(s *batch.Spec) { s.Errors.Policy = tt.policy })
			sum, err := run(t, pool, s, batch.Config{})
			tt.check(t, count(t, pool, s.Job), sum, err)
			var retries int64
			require.NoError(t, pool.QueryRow(ctx, `SELECT COALESCE(sum(retries), 0) FROM batch_runs`).Scan(&retries))
			require.Zero(t, retries)
		})
	}

	t.Run("quarantine retry after the rows are fixed", func(t *testing.T) {
		t.Parallel()
		_, pool := newDB(t)
		seed(t, pool, 0, 1000, 3, 1)
		ctx := context.Background()
		_, err := pool.Exec(ctx, `UPDATE source_records SET payload = '[1,2]' WHERE id IN ($1, $2)`, badTitle, notObject)
		require.NoError(t, err)
		s := spec(func(s *batch.Spec) { s.Errors.Policy = batch.PolicyQuarantine })
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		rows, err := batch.ListQuarantine(ctx, pool, s.Job, false)
		require.NoError(t, err)
		require.Len(t, rows, 2)
		require.Equal(t, "not_an_object", rows[0].Code)

		_, err = pool.Exec(ctx, `UPDATE source_records SET payload = '{"title":"fixed"}' WHERE id = $1`, badTitle)
		require.NoError(t, err)
		res, err := batch.RetryQuarantine(ctx, pool, s, nil, batch.RetryOptions{})
		require.NoError(t, err)
		require.Equal(t, batch.RetryResult{Retried: 2, Resolved: 1, StillBad: 1}, res)
		rows, err = batch.ListQuarantine(ctx, pool, s.Job, false)
		require.NoError(t, err)
		require.Len(t, rows, 1)
		require.Equal(t, notObject, rows[0].SourceID)
		require.Equal(t, 2, rows[0].Attempts)
		require.Equal(t, counts{Normalized: 999, Events: 999, DistinctEvents: 999, Processed: 1000, States: "succeeded"}, count(t, pool, s.Job))
	})

	t.Run("retry heals transient row errors", func(t *testing.T) {
		t.Parallel()
		_, pool := newDB(t)
		seed(t, pool, 0, 1000, 3, 1)
		s := spec(func(s *batch.Spec) {
			s.Errors = batch.ErrorPolicy{Policy: batch.PolicyRetry, InitialBackoff: batch.Duration(time.Millisecond), MaxBackoff: batch.Duration(10 * time.Millisecond), PartitionAttempts: 1}
		})
		p := &transientOnce{failID: badTitle}
		p.fails.Store(2)
		sum, err := run(t, pool, s, batch.Config{Processor: p})
		require.NoError(t, err)
		require.True(t, sum.Done)
		var retries int64
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT sum(retries) FROM batch_runs`).Scan(&retries))
		require.EqualValues(t, 2, retries)
		require.Equal(t, counts{Normalized: 1000, Events: 1000, DistinctEvents: 1000, Processed: 1000, States: "succeeded"}, count(t, pool, s.Job))

		// Bounded: more failures than retries fail the run.
		_, pool = newDB(t)
		seed(t, pool, 0, 1000, 3, 1)
		s.Errors.MaxRetries = 2
		p.fails.Store(5)
		_, err = run(t, pool, s, batch.Config{Processor: p})
		require.ErrorContains(t, err, "upstream 503")
		require.Equal(t, "failed", count(t, pool, s.Job).States)
	})
}

func TestSoftDeleteAndVersionGuard(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 100, 3, 1)
	s := spec()
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	_, err = pool.Exec(ctx, `UPDATE source_records SET deleted_at = now() WHERE id = 7`)
	require.NoError(t, err)
	// A newer version already in the read model is never overwritten.
	_, err = pool.Exec(ctx, `UPDATE normalized_records SET source_version = 99, document = '{"newer":true}' WHERE source_id = '14'`)
	require.NoError(t, err)
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.EqualValues(t, 1, sum.Changed)
	var typ string
	var payload *string
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_type, payload::text FROM outbox_event_members WHERE aggregate_id = '7' AND aggregate_version = 2`).Scan(&typ, &payload))
	require.Equal(t, "delete", typ)
	require.Nil(t, payload)
	var doc string
	require.NoError(t, pool.QueryRow(ctx, `SELECT document::text FROM normalized_records WHERE source_id = '14'`).Scan(&doc))
	require.JSONEq(t, `{"newer":true}`, doc)
}

func TestCheckpointSetIsAudited(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 3000, 3, 1)
	s := spec()
	sum, err := run(t, pool, s, batch.Config{MaxChunks: 2})
	require.NoError(t, err)
	ctx := context.Background()
	var cur []string
	require.NoError(t, pool.QueryRow(ctx, `SELECT cursor FROM batch_runs`).Scan(&cur))

	move := batch.CheckpointMove{Job: s.Job, RunID: sum.RunID, Actor: "ops", Reason: "skip a known-bad range"}
	move.Cursor = []string{"2024-01-02 00:00:00+00", "0"}
	_, err = batch.SetCheckpoint(ctx, pool, move)
	require.ErrorContains(t, err, "past the run's boundary")

	move.Cursor = []string{"2024-01-01 00:10:00+00", "0"} // row 1800 onwards
	moved, err := batch.SetCheckpoint(ctx, pool, move)
	require.NoError(t, err)
	require.Empty(t, moved.NewRunID)
	require.Equal(t, cur, moved.Before)

	move.Cursor = []string{"2024-01-01 00:00:00+00", "-1"}
	move.Reason = "reprocess from the start"
	moved, err = batch.SetCheckpoint(ctx, pool, move)
	require.NoError(t, err)
	require.NotEmpty(t, moved.NewRunID)

	var audits int
	var actions string
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), string_agg(action || ':' || actor || ':' || reason, ';' ORDER BY id) FROM checkpoint_audit`).Scan(&audits, &actions))
	require.Equal(t, 2, audits)
	require.Equal(t, "forward:ops:skip a known-bad range;backward-new-run:ops:reprocess from the start", actions)

	sum, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Equal(t, moved.NewRunID, sum.RunID)
	require.True(t, sum.Done)
	require.Equal(t, counts{Normalized: 3000, Events: 3000, DistinctEvents: 3000, Processed: 3000, States: "succeeded"}, count(t, pool, s.Job))
}

func TestIncrementalRun(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 1000, 3, 1)
	s := spec(func(s *batch.Spec) {
		s.Job = "records-inc"
		s.Mode = batch.ModeIncremental
		s.Source.Cursor = []string{"change_seq"}
	})
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.EqualValues(t, 1000, sum.Rows)
	ctx := context.Background()
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"changed"') WHERE id % 10 = 0`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE source_records SET deleted_at = now() WHERE id = 7`)
	require.NoError(t, err)
	sum, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	var changed int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM source_records WHERE version > 1`).Scan(&changed))
	require.Equal(t, changed, sum.Rows, "only changed rows are scanned")
	require.Equal(t, changed, sum.Changed)
	var deletes int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'delete' AND aggregate_id = '7'`).Scan(&deletes))
	require.Equal(t, 1, deletes)
}

func TestPauseAndResume(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 2000, 3, 1)
	s := spec()
	sum, err := run(t, pool, s, batch.Config{MaxChunks: 1})
	require.NoError(t, err)
	ctx := context.Background()
	n, err := batch.SetState(ctx, pool, s.Job, "", "", "paused")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	sum2, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Zero(t, sum2.Rows, "a paused partition is not claimed")
	require.Equal(t, sum.RunID, sum2.RunID)
	_, err = batch.SetState(ctx, pool, s.Job, "", "", "pending")
	require.NoError(t, err)
	sum2, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum2.Done)
	require.EqualValues(t, 1500, sum2.Rows)

	st, err := batch.Status(ctx, pool, s.Job, 1)
	require.NoError(t, err)
	require.Len(t, st, 1)
	require.Equal(t, "succeeded", st[0].State)
	require.EqualValues(t, 2000, st[0].Processed)
}

func TestSizer(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		steps func(s *batch.Sizer)
		want  int
	}{
		{name: "fast chunk grows at most 1.5x", steps: func(s *batch.Sizer) { s.Observe(1000, time.Millisecond) }, want: 1500},
		{name: "slow chunk shrinks at most 0.5x", steps: func(s *batch.Sizer) { s.Observe(1000, time.Hour) }, want: 500},
		{name: "proportional in between", steps: func(s *batch.Sizer) { s.Observe(1000, 1250*time.Millisecond) }, want: 800},
		{name: "bounded by max", steps: func(s *batch.Sizer) {
			for range 20 {
				s.Observe(s.Size(), time.Millisecond)
			}
		}, want: 4000},
		{name: "bounded by min", steps: func(s *batch.Sizer) {
			for range 20 {
				s.Backoff()
			}
		}, want: 100},
		{name: "short last chunk says nothing", steps: func(s *batch.Sizer) { s.Observe(10, time.Hour) }, want: 1000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := batch.NewSizer(1000, 100, 4000, time.Second)
			tt.steps(s)
			require.Equal(t, tt.want, s.Size())
		})
	}
}

// The cursor must be a strict total order: NOT NULL columns that a primary
// key or unique index covers. A cursor of [grp] with 15 rows per value
// would skip the rows of a value that a chunk ends among; it is refused at
// start with the columns and the fix, as is a column that may be NULL.
func TestCursorMustBeUniqueAndNotNull(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	_, err := pool.Exec(ctx, `CREATE TABLE grp_records (id bigint PRIMARY KEY, grp int NOT NULL, label text, version bigint NOT NULL DEFAULT 1)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO grp_records (id, grp, label) SELECT g, g % 3, CASE WHEN g <> 7 THEN 'l' || g END FROM generate_series(1, 45) g`)
	require.NoError(t, err)
	grp := func(cursor ...string) batch.Spec {
		return batch.Spec{Job: "grp", ProcessorVersion: "v1",
			Source: batch.Source{Table: "grp_records", Cursor: cursor, ID: "id", Version: "version"},
			Chunk:  batch.ChunkSettings{Size: 10, Min: 10, Max: 10}}
	}
	_, err = run(t, pool, grp("grp"), batch.Config{})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, "source.cursor (grp) of job grp is not unique: no primary key or unique index of public.grp_records has only these columns")
	require.ErrorContains(t, err, "add a unique tie-breaker as the last cursor column (e.g. [grp, id] with id the primary key)")

	_, err = run(t, pool, grp("label", "id"), batch.Config{})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, "source.cursor (label, id) of job grp: column label of public.grp_records may be NULL")

	sum, err := run(t, pool, grp("grp", "id"), batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.EqualValues(t, 45, sum.Rows)
	require.EqualValues(t, 45, queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source = 'grp_records'`))
}

// A custom processor's document that is not JSON (broken, or none at all)
// is that row's fault, checked in Go before the write: quarantined with
// invalid_document, or failing the run under strict; the other rows keep
// the documents the processor returned, byte for byte as jsonb.
func TestInvalidProcessorDocuments(t *testing.T) {
	t.Parallel()
	const broken, missing = "707", "714"
	proc := batch.ProcessorFunc(func(_ context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
		out := make([]batch.Result, len(rows))
		for i, r := range rows {
			switch r.ID {
			case broken:
				out[i].Document = json.RawMessage(`{"id":"` + r.ID + `",`)
			case missing:
			default:
				out[i].Document = json.RawMessage(`{"id":"` + r.ID + `","n":` + strconv.Itoa(i) + `}`)
			}
		}
		return out, nil
	})
	for _, policy := range []string{batch.PolicyQuarantine, batch.PolicyStrict} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 0, 1000, 3, 1)
			s := spec(func(s *batch.Spec) {
				s.Errors.Policy = policy
				s.Chunk.Concurrency = 2
			})
			sum, err := run(t, pool, s, batch.Config{Processor: proc})
			if policy == batch.PolicyStrict {
				require.ErrorIs(t, err, batch.ErrBadRow)
				require.ErrorContains(t, err, "invalid_document")
				return
			}
			require.NoError(t, err)
			require.EqualValues(t, 2, sum.Quarantined)
			rows, err := batch.ListQuarantine(ctx, pool, s.Job, false)
			require.NoError(t, err)
			require.Len(t, rows, 2)
			for _, r := range rows {
				require.Equal(t, "invalid_document", r.Code)
				require.Contains(t, []string{broken, missing}, r.SourceID)
			}
			// Read over a new connection: every other row holds its own document.
			check, err := pgxpool.New(ctx, url)
			require.NoError(t, err)
			defer check.Close()
			var n, wrong int64
			require.NoError(t, check.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE document->>'id' IS DISTINCT FROM source_id OR jsonb_typeof(document->'n') <> 'number') FROM normalized_records`).Scan(&n, &wrong))
			require.EqualValues(t, 998, n)
			require.Zero(t, wrong)
			require.Equal(t, int64(998), queryInt(t, check, `SELECT count(*) FROM outbox_event_members WHERE payload::jsonb->>'id' = aggregate_id`))
		})
	}
}
