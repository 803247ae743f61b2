package batch_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// vanishedSpec is a full run over tenants t0..t2 (a filter) in chunks of 50.
func vanishedSpec(mut ...func(*batch.Spec)) batch.Spec {
	return spec(append([]func(*batch.Spec){func(s *batch.Spec) {
		s.Chunk = batch.ChunkSettings{Size: 50, Min: 50, Max: 50}
		s.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "in", Values: []string{"t0", "t1", "t2"}}}
	}}, mut...)...)
}

// deleteEvents lists, over a new connection, the delete events per
// aggregate id with their versions ("id@version").
func deleteEvents(t *testing.T, url string) []string {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	defer pool.Close()
	rows, err := pool.Query(context.Background(), `SELECT aggregate_id || '@' || aggregate_version FROM outbox_event_members WHERE event_type = 'delete' ORDER BY aggregate_id::bigint, aggregate_version`)
	require.NoError(t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

// A full run after rows were hard-deleted from the source or left the
// job's filter turns each of them into one delete event (and a tombstone in
// normalized_records) whose version is one more than the last one
// normalized, so the index's external version takes it and a replay of the
// older upsert cannot undo it. Soft deletes still come from the scan; rows
// that stayed produce nothing; a further run produces nothing new.
func TestFullRunTurnsVanishedRowsIntoDeletes(t *testing.T) {
	t.Parallel()
	for _, partitioned := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", partitioned), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 300, 1, 3) // ids 7..2100, tenants t0..t2
			s := vanishedSpec(func(s *batch.Spec) {
				if partitioned {
					s.Source.Partition = "tenant_id"
				}
			})
			_, err := run(t, pool, s, batch.Config{Workers: 2})
			require.NoError(t, err)
			require.Empty(t, deleteEvents(t, url))

			_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id <= 20 * 7`) // 20 rows
			require.NoError(t, err)
			_, err = pool.Exec(ctx, `UPDATE source_records SET tenant_id = 't9' WHERE id > 1000 AND id <= 1070`) // 10 rows leave the filter
			require.NoError(t, err)
			_, err = pool.Exec(ctx, `UPDATE source_records SET deleted_at = now() WHERE id > 2000 AND id <= 2035`) // 5 soft deletes
			require.NoError(t, err)

			sum, err := run(t, pool, s, batch.Config{Workers: 2})
			require.NoError(t, err)
			require.True(t, sum.Done)
			var want []string
			for id := 7; id <= 2100; id += 7 {
				if id <= 140 || (id > 1000 && id <= 1070) || (id > 2000 && id <= 2035) {
					want = append(want, fmt.Sprintf("%d@2", id))
				}
			}
			require.Equal(t, want, deleteEvents(t, url), "one delete per vanished or soft-deleted row, version + 1")
			require.Equal(t, int64(35), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE deleted AND document IS NULL AND source_version = 2`))
			require.Equal(t, int64(265), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE NOT deleted AND source_version = 1`))
			require.Equal(t, int64(300+35), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`), "nothing for the rows that stayed")
			require.Equal(t, int64(30), queryInt(t, pool, `SELECT deleted_count FROM batch_sweeps WHERE state = 'succeeded' AND logical_run_id = (SELECT max(logical_run_id) FROM batch_runs)`))

			_, err = run(t, pool, s, batch.Config{Workers: 2})
			require.NoError(t, err)
			require.Equal(t, int64(300+35), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`), "a further run: nothing new")

			// A row back in the filter with a newer version wins over its tombstone.
			_, err = pool.Exec(ctx, `UPDATE source_records SET tenant_id = 't1' WHERE id = 1008`)
			require.NoError(t, err)
			_, err = run(t, pool, s, batch.Config{Workers: 2})
			require.NoError(t, err)
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '1008' AND NOT deleted AND source_version = 3`))
		})
	}
}

// vanished: keep turns the sweep off: a hard-deleted row stays in
// normalized_records and produces no event.
func TestVanishedKeepProducesNoDeletes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 100, 1, 3)
	s := vanishedSpec(func(s *batch.Spec) { s.Vanished = batch.VanishedKeep })
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id <= 70`)
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Empty(t, deleteEvents(t, url))
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE deleted`))
}

// A run whose sweep did not finish, resumed with vanished: keep, drops the
// sweep and finishes; the next run is a new one.
func TestVanishedKeepDropsAnUnfinishedSweep(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 1, 100, 1, 3)
	s := vanishedSpec()
	_, err := run(t, pool, s, batch.Config{}) // a first load: nothing to sweep
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{MaxChunks: 2}) // partitions not done: no sweep yet
	require.NoError(t, err)
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_sweeps WHERE state = 'pending'`))
	s.Vanished = batch.VanishedKeep
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_sweeps WHERE state = 'superseded'`))
	sum2, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum2.Done)
	require.NotEqual(t, sum.RunID, sum2.RunID, "a new run")
}

// The batcher is killed in the middle of the sweep (SIGKILL at a
// failpoint of its third chunk): the tombstones of the committed sweep
// chunks are there (as the sweep's checkpoint counts them), nothing of the
// killed one; the next start resumes the
// same run's sweep from its checkpoint and ends with one delete per
// vanished row.
func TestVanishedSweepCrashAndResume(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	for _, tc := range []struct {
		point     string
		committed int64 // sweep chunks committed when the process dies
	}{
		{"batch.sweep_after_delete", 2},
		{"batch.sweep_after_checkpoint", 2},
		{"batch.sweep_after_commit", 3},
	} {
		t.Run(tc.point, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 600, 1, 3)
			specFile := writeSpec(t, vanishedSpec())
			p := testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
			require.Equal(t, 0, p.ExitCode(), p.Stderr())

			// Every other row vanishes: 25 of each sweep chunk of 50.
			_, err := pool.Exec(ctx, `DELETE FROM source_records WHERE id % 14 = 0`)
			require.NoError(t, err)
			p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease, failpoint.EnvVar+"="+tc.point+"@3"), "run", "--spec", specFile)
			require.True(t, p.Killed(), "killed at %s; stderr:\n%s", tc.point, p.Stderr())
			require.Contains(t, p.Stderr(), "failpoint "+tc.point)

			// Tombstones, events and the sweep's checkpoint agree: whole
			// chunks of 50 candidates, nothing of the killed one.
			tombstones := queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE deleted`)
			require.Positive(t, tombstones)
			require.Len(t, deleteEvents(t, url), int(tombstones))
			require.Equal(t, tombstones, queryInt(t, pool, `SELECT deleted_count FROM batch_sweeps WHERE state = 'running'`))
			require.Equal(t, 50*tc.committed, queryInt(t, pool, `SELECT swept_count FROM batch_sweeps WHERE state = 'running'`))
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_sweeps WHERE state = 'running'`))

			p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
			require.Equal(t, 0, p.ExitCode(), p.Stderr())
			require.Contains(t, p.Stdout(), "succeeded")
			var want []string
			for id := 14; id <= 4200; id += 14 {
				want = append(want, fmt.Sprintf("%d@2", id))
			}
			require.Equal(t, want, deleteEvents(t, url), "one delete per vanished row")
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE deleted AND source_version = 2`))
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE NOT deleted AND source_version = 1`))
			require.Equal(t, int64(2), queryInt(t, pool, `SELECT count(DISTINCT logical_run_id) FROM batch_runs`), "the rerun resumed the killed run")
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT deleted_count FROM batch_sweeps WHERE state = 'succeeded' AND logical_run_id = (SELECT max(logical_run_id) FROM batch_runs)`))

			p = testproc.Run(t, time.Minute, bin, env(url), "status", "--job", "records")
			require.Equal(t, 0, p.ExitCode(), p.Stderr())
			require.Regexp(t, `SWEEP +CURSOR +CHECKED +DELETED +REBUILT +CHANGED +ATTEMPTS`, p.Stdout())
			require.Regexp(t, `succeeded +\S+ +600 +300 +0 +0 +2 `, p.Stdout(), "the resumed sweep: 600 rows checked, 300 deleted, no relation rebuild, in 2 attempts")
		})
	}
}

// A rebuild under a new processor version (a new index generation) leaves
// every row of the scope at that version, tombstones of rows that vanished
// before the rebuild included: each gets a delete event of the new version
// (so the new generation holds the tombstone) and the new version in
// normalized_records, as the cutover check (no row at another processor
// version) requires. Its source version stays: a later change still wins.
func TestRebuildMovesEarlierTombstonesToTheNewVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 3)
	s := vanishedSpec()
	_, err := run(t, pool, s, batch.Config{Workers: 1})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id <= 20 * 7`) // 20 rows
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{Workers: 1})
	require.NoError(t, err)

	s.ProcessorVersion = "v2"
	sum, err := run(t, pool, s, batch.Config{Workers: 1})
	require.NoError(t, err)
	require.True(t, sum.Done)

	var other, v2deletes, v2versions int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM normalized_records WHERE source = 'source_records' AND processor_version IS DISTINCT FROM 'v2'`).Scan(&other))
	require.Zero(t, other, "rows of normalized_records not at v2 after the rebuild (the cutover check refuses)")
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE n.source_version = e.aggregate_version)
FROM outbox_event_members e JOIN normalized_records n ON n.source = 'source_records' AND n.source_id = e.aggregate_id
WHERE e.event_type = 'delete' AND e.headers->>'ce_processorversion' = 'v2'`).Scan(&v2deletes, &v2versions))
	require.Equal(t, 20, v2deletes)
	require.Equal(t, 20, v2versions)

	// Nothing more on a further run.
	_, err = run(t, pool, s, batch.Config{Workers: 1})
	require.NoError(t, err)
	require.Len(t, deleteEvents(t, url), 40)
}

// A row the sweep tombstoned (hard-deleted, tombstone at version 2) that
// is inserted again with the same id and a version at or below the
// tombstone's (the version reset to 1, or equal to 2) comes back on the
// next full run: its upsert event's version is above the tombstone's, so
// the index takes it, and the row's later changes keep winning. Both
// paths: the built-in SQL normalizer and a custom Processor.
func TestVanishedRowThatReturnsWithAnOldVersionComesBack(t *testing.T) {
	t.Parallel()
	for _, goPath := range []bool{false, true} {
		t.Run(fmt.Sprintf("processor=%v", goPath), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 100, 1, 3) // ids 7..700
			s := vanishedSpec()
			cfg := batch.Config{}
			if goPath {
				cfg.Processor = batch.ProcessorFunc(passThrough)
			}
			_, err := run(t, pool, s, cfg)
			require.NoError(t, err)
			_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id IN (14, 21)`)
			require.NoError(t, err)
			_, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.Equal(t, []string{"14@2", "21@2"}, deleteEvents(t, url))

			// Back: 14 with the version reset, 21 at the tombstone's version.
			_, err = pool.Exec(ctx, `INSERT INTO source_records (id, created_at, tenant_id, version, payload)
VALUES (14, '2024-01-01', 't2', 1, '{"title": "back"}'), (21, '2024-01-01', 't0', 2, '{"title": "back"}')`)
			require.NoError(t, err)
			sum, err := run(t, pool, s, cfg)
			require.NoError(t, err)
			require.True(t, sum.Done)
			live := `SELECT count(*) FROM normalized_records WHERE source_id = $1 AND NOT deleted AND document IS NOT NULL AND source_version = $2`
			require.Equal(t, int64(1), queryInt(t, pool, live, "14", 3), "back above its tombstone (version 2)")
			require.Equal(t, int64(1), queryInt(t, pool, live, "21", 3))
			require.Equal(t, int64(2), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'upsert' AND aggregate_id IN ('14', '21') AND aggregate_version = 3`))

			// A further run: nothing new; a change of the row wins again.
			events := queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`)
			_, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.Equal(t, events, queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`))
			_, err = pool.Exec(ctx, `UPDATE source_records SET payload = '{"title": "edited"}' WHERE id = 14`) // version 1 -> 2
			require.NoError(t, err)
			_, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.Equal(t, int64(1), queryInt(t, pool, live, "14", 4), "the change after the return is newer")
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'upsert' AND aggregate_id = '14' AND aggregate_version = 4`))
			// Deleted again: a tombstone above the returned version.
			_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id = 14`)
			require.NoError(t, err)
			_, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.Equal(t, []string{"14@2", "14@5", "21@2"}, deleteEvents(t, url))
		})
	}
}

// passThrough is a custom Processor whose document is the source row.
func passThrough(_ context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
	out := make([]batch.Result, len(rows))
	for i, r := range rows {
		out[i].Document = json.RawMessage(r.Row)
	}
	return out, nil
}

// A first load (normalized_records holds no row of the source name when the
// run starts) has nothing to sweep: every row it could look at is one of its
// own chunks read from the source. Its sweep is done before it starts, reads
// nothing, and the next run sweeps as usual.
func TestAFirstLoadHasNothingToSweep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 3)
	s := vanishedSpec()
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE NOT deleted`))
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_sweeps WHERE state = 'succeeded' AND swept_count = 0 AND chunks = 0 AND cursor IS NULL`),
		"the first load's sweep read nothing")
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE first_load`), "and it wrote with plain INSERTs")

	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id <= 10 * 7`)
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Len(t, deleteEvents(t, url), 10)
	require.Equal(t, int64(300), queryInt(t, pool, `SELECT swept_count FROM batch_sweeps WHERE logical_run_id = (SELECT max(logical_run_id) FROM batch_runs)`),
		"the second run swept every row")
}

// Without the delete capture: a soft-deleted row (its tombstone indexed)
// that is then hard-deleted, or truncated, is marked vanished by the next
// full run's sweep (no new event: the index has its tombstone), so when it
// is inserted again with its version reset (1, below the soft delete's 3)
// the following full run writes it live above that tombstone, with an
// upsert event the index takes. The sweep used to skip rows already
// deleted: the re-inserted row was refused below the tombstone for good.
func TestFullRunReinsertAfterSoftAndHardDeleteComesBack(t *testing.T) {
	t.Parallel()
	for name, how := range map[string]string{"delete": "DELETE FROM source_records WHERE id = 14", "truncate": "TRUNCATE source_records"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 100, 1, 3) // ids 7..700
			s := vanishedSpec()
			_, err := run(t, pool, s, batch.Config{})
			require.NoError(t, err)
			for _, sql := range []string{
				`UPDATE source_records SET payload = jsonb_build_object('title', 'edit') WHERE id = 14`, // version 2
				`UPDATE source_records SET deleted_at = now() WHERE id = 14`,                            // version 3, soft-deleted
			} {
				_, err := pool.Exec(ctx, sql)
				require.NoError(t, err)
			}
			_, err = run(t, pool, s, batch.Config{})
			require.NoError(t, err)
			require.Equal(t, []string{"14@3"}, deleteEvents(t, url), "the soft delete's tombstone")

			_, err = pool.Exec(ctx, how)
			require.NoError(t, err)
			sum, err := run(t, pool, s, batch.Config{}) // the sweep sees 14 gone
			require.NoError(t, err)
			require.True(t, sum.Done)
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'delete' AND aggregate_id = '14'`),
				"no second delete for a row whose tombstone is indexed")

			_, err = pool.Exec(ctx, `INSERT INTO source_records (id, created_at, tenant_id, version, payload) VALUES (14, '2024-01-01', 't2', 1, '{"title": "back"}')`)
			require.NoError(t, err)
			sum, err = run(t, pool, s, batch.Config{})
			require.NoError(t, err)
			require.True(t, sum.Done)
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '14' AND NOT deleted AND document->>'title' = 'back' AND source_version > 3`),
				"14 back, above its soft delete's tombstone (version 3)")
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'upsert' AND aggregate_id = '14' AND aggregate_version > 3`))
		})
	}
}
