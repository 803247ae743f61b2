package batch_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// A quarantine-policy run whose rows are all bad used to succeed. Past the
// skip limit (a count of quarantined rows per run) the chunk that crosses
// it rolls back and the run fails, naming the most frequent error code.
func TestSkipLimitFailsARunThatQuarantinesTooMuch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 1000, 1, 1)
	// Every row misses its required title.
	_, err := pool.Exec(ctx, `UPDATE source_records SET payload = payload - 'title'`)
	require.NoError(t, err)
	s := spec(func(s *batch.Spec) {
		s.Errors.Policy = batch.PolicyQuarantine
		s.Errors.SkipLimit = 600
		s.Chunk = batch.ChunkSettings{Size: 250, Min: 250, Max: 250, Pipeline: 1}
	})
	_, err = run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrSkipLimit)
	require.ErrorContains(t, err, "errors.skip_limit 600")
	require.ErrorContains(t, err, "most frequent error: missing_field")
	require.Equal(t, "failed", count(t, pool, s.Job).States)
	require.Equal(t, int64(500), queryInt(t, pool, `SELECT count(*) FROM batch_quarantine`), "the chunk that crossed the limit rolled back")
	require.Equal(t, int64(500), queryInt(t, pool, `SELECT sum(quarantined_count) FROM batch_runs`))
}

// The ratio form: more than skip_ratio of the rows processed so far are
// quarantined. A run below both limits succeeds.
func TestSkipRatioFailsTheRunAndBelowItSucceeds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 1000, 1, 1)
	_, err := pool.Exec(ctx, `UPDATE source_records SET payload = payload - 'title' WHERE id % 10 = 0`) // 10% bad
	require.NoError(t, err)
	s := spec(func(s *batch.Spec) {
		s.Errors.Policy = batch.PolicyQuarantine
		s.Errors.SkipRatio = 0.05
	})
	_, err = run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrSkipLimit)
	require.ErrorContains(t, err, "errors.skip_ratio 0.05")
	require.ErrorContains(t, err, "most frequent error: missing_field")

	_, pool = newDB(t)
	seed(t, pool, 1, 1000, 1, 1)
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload - 'title' WHERE id % 10 = 0`)
	require.NoError(t, err)
	s.Errors.SkipRatio, s.Errors.SkipLimit = 0.2, 150
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, int64(100), sum.Quarantined)
}

// The ratio is judged only once the run has seen errors.skip_ratio_min_rows
// rows (default 1000): the first quarantined row of a run is 1 of 1, which
// used to fail a run whose bad share ends far below the ratio. Once the
// sample is reached the ratio is judged, also at a chunk without bad rows
// (the bad rows before it count).
func TestSkipRatioWaitsForItsMinimumSample(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 1000, 1, 1)
	_, err := pool.Exec(ctx, `UPDATE source_records SET payload = payload - 'title' WHERE id IN (7, 14)`) // the first two rows: 0.2%
	require.NoError(t, err)
	s := spec(func(s *batch.Spec) {
		s.Errors.Policy = batch.PolicyQuarantine
		s.Errors.SkipRatio = 0.01
		s.Chunk = batch.ChunkSettings{Size: 50, Min: 50, Max: 50, Pipeline: 1}
	})
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err, "2 of 1000 is below 1%")
	require.True(t, sum.Done)
	require.Equal(t, int64(2), sum.Quarantined)

	// 300 bad rows first, then good ones: judged at 500 rows (60%).
	_, pool = newDB(t)
	seed(t, pool, 1, 1000, 1, 1)
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload - 'title' WHERE id <= 300 * 7`)
	require.NoError(t, err)
	s.Errors.SkipRatio, s.Errors.SkipRatioMinRows = 0.1, 500
	_, err = run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrSkipLimit)
	require.ErrorContains(t, err, "quarantined 300 of 500 rows")
	require.Equal(t, int64(450), queryInt(t, pool, `SELECT sum(processed_count) FROM batch_runs`), "the chunk that reached the sample rolled back")
}
