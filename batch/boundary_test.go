package batch_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// A transaction that took its change_seq before the rows that set the new
// boundary, and commits after them, must not be skipped: an incremental run
// starts where the previous one's boundary was, so a row below it that
// became visible too late would be lost for good. The run does not start
// while such a writer is open.
func TestRunWaitsForOpenWritersBelowTheBoundary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 100, 3, 1)
	s := spec(func(s *batch.Spec) {
		s.Job = "records-inc"
		s.Mode = batch.ModeIncremental
		s.Source.Cursor = []string{"change_seq"}
	})
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)

	// T takes the lower change_seq and stays open; a later update commits
	// with a higher one, which becomes the next run's boundary.
	late, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer late.Rollback(ctx)
	_, err = late.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"late"') WHERE id = 7`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"early"') WHERE id = 14`)
	require.NoError(t, err)

	r, err := batch.NewRunner(pool, s, batch.Config{})
	require.NoError(t, err)
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = r.Prepare(pctx)
	cancel()
	require.True(t, errors.Is(err, context.DeadlineExceeded), "the run must not start while a writer of the source table is open, got %v", err)
	var runs int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(DISTINCT logical_run_id) FROM batch_runs WHERE job = 'records-inc'`).Scan(&runs))
	require.Equal(t, 1, runs, "no second run was created")

	require.NoError(t, late.Commit(ctx))
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.EqualValues(t, 2, sum.Rows)
	var titles []string
	rows, err := pool.Query(ctx, `SELECT document->>'title' FROM normalized_records WHERE source_id IN ('7', '14') ORDER BY source_id`)
	require.NoError(t, err)
	for rows.Next() {
		var title string
		require.NoError(t, rows.Scan(&title))
		titles = append(titles, title)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"early", "late"}, titles)
}
