package batch_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// flaky is a Processor whose first failN calls fail the whole chunk with an
// error that is not retryable inside the chunk (an external service down).
func flaky(failN int32, calls *atomic.Int32) batch.Processor {
	return batch.ProcessorFunc(func(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
		if calls.Add(1) <= failN {
			return nil, errors.New("enrichment service down")
		}
		out := make([]batch.Result, len(rows))
		for i, r := range rows {
			out[i].Document = json.RawMessage(r.Row)
		}
		return out, nil
	})
}

// A partition that fails is retried automatically after the spec's
// backoff, up to errors.partition_attempts, without an operator; status
// shows the attempts and the last error.
func TestFailedPartitionIsRetriedAutomatically(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 200, 1, 1)
	var calls atomic.Int32
	s := spec(func(s *batch.Spec) {
		s.Chunk.Pipeline = 1
		s.Errors.PartitionAttempts = 3
		s.Errors.PartitionBackoff = batch.Duration(200 * time.Millisecond)
	})
	sum, err := run(t, pool, s, batch.Config{Processor: flaky(2, &calls), LeaseTTL: time.Second})
	require.NoError(t, err, "two failures, then the third attempt succeeds")
	require.True(t, sum.Done)
	require.Equal(t, int64(200), queryInt(t, pool, `SELECT count(*) FROM normalized_records`))

	st, err := batch.Status(ctx, pool, "records", 1)
	require.NoError(t, err)
	require.Len(t, st, 1)
	require.Equal(t, "succeeded", st[0].State)
	require.Equal(t, 3, st[0].Attempt)
	require.Equal(t, 2, st[0].Failures)
	require.NotNil(t, st[0].LastError)
	require.Contains(t, *st[0].LastError, "enrichment service down")

	p := testproc.Run(t, time.Minute, testproc.Build(t, "batcher"), env(url), "status", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "ATTEMPTS")
	require.Contains(t, p.Stdout(), "enrichment service down")
}

// When every attempt fails the partition ends failed, after exactly
// errors.partition_attempts attempts; a bad row under the strict policy is
// not retried at all (it would fail the same way).
func TestPartitionAttemptsAreBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 50, 1, 1)
	var calls atomic.Int32
	s := spec(func(s *batch.Spec) {
		s.Chunk.Pipeline = 1
		s.Errors.PartitionAttempts = 2
		s.Errors.PartitionBackoff = batch.Duration(100 * time.Millisecond)
	})
	_, err := run(t, pool, s, batch.Config{Processor: flaky(1000, &calls), LeaseTTL: time.Second})
	require.ErrorContains(t, err, "enrichment service down")
	st, err := batch.Status(ctx, pool, "records", 1)
	require.NoError(t, err)
	require.Equal(t, "failed", st[0].State)
	require.Equal(t, 2, st[0].Attempt)
	require.Equal(t, 2, st[0].Failures)
	require.Equal(t, int32(2), calls.Load())

	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = '{}' WHERE id = 14`) // title is required
	require.NoError(t, err)
	_, err = run(t, pool, spec(func(s *batch.Spec) {
		s.Job = "strict"
		s.Errors.PartitionAttempts = 5
	}), batch.Config{LeaseTTL: time.Second})
	var bad *batch.BadRowError
	require.ErrorAs(t, err, &bad)
	st, err = batch.Status(ctx, pool, "strict", 1)
	require.NoError(t, err)
	require.Equal(t, "failed", st[0].State)
	require.Equal(t, 1, st[0].Attempt, "a bad row is not retried")
}

// An operator's rerun of a run whose partition waits for its automatic
// retry (the batcher stopped or died during the backoff) takes effect at
// once, instead of waiting for the old backoff (here 10 minutes, the cap).
func TestRerunDoesNotWaitForTheRetryBackoff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 200, 1, 1)
	var calls atomic.Int32
	s := spec(func(s *batch.Spec) {
		s.Chunk.Pipeline = 1
		s.Errors.PartitionAttempts = 3
		s.Errors.PartitionBackoff = batch.Duration(time.Hour)
	})
	cfg := batch.Config{Processor: flaky(1, &calls), LeaseTTL: time.Second}
	r, err := batch.NewRunner(pool, s, cfg)
	require.NoError(t, err)
	soft, stop := context.WithCancel(ctx)
	defer stop()
	waiting := make(chan error, 1)
	go func() { // stop the batcher once the partition waits for its retry
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM batch_runs WHERE state = 'pending' AND retry_at > now() + interval '5 minutes'`).Scan(&n); err != nil || n == 1 {
				stop()
				waiting <- err
				return
			}
			select {
			case <-soft.Done():
				waiting <- soft.Err()
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
		stop()
		waiting <- errors.New("the partition never waited for its retry")
	}()
	sum, err := r.Run(soft, ctx)
	require.NoError(t, err)
	require.NoError(t, <-waiting)
	require.False(t, sum.Done)

	// The rerun: done well within the old backoff.
	rctx, cancel := context.WithTimeout(ctx, 45*time.Second)
	defer cancel()
	r, err = batch.NewRunner(pool, s, cfg)
	require.NoError(t, err)
	sum, err = r.Run(rctx, ctx)
	require.NoError(t, err)
	require.True(t, sum.Done, "the rerun waited for the retry backoff")
	require.Equal(t, int64(200), queryInt(t, pool, `SELECT count(*) FROM normalized_records`))
	st, err := batch.Status(ctx, pool, "records", 1)
	require.NoError(t, err)
	require.Equal(t, "succeeded", st[0].State)
	require.Nil(t, st[0].RetryAt)
	require.Equal(t, 1, st[0].Failures, "the failure before the rerun is still counted")
}
