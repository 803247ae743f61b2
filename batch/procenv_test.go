package batch_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// gathered returns the value of a gauge or the count and sum of a histogram
// with the label job.
func gathered(t *testing.T, reg *prometheus.Registry, name, job string) (value float64, count uint64, found bool) {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !hasLabel(m, "job", job) {
				continue
			}
			switch {
			case m.Gauge != nil:
				return m.Gauge.GetValue(), 0, true
			case m.Histogram != nil:
				return m.Histogram.GetSampleSum(), m.Histogram.GetSampleCount(), true
			}
		}
	}
	return 0, 0, false
}

func hasLabel(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// docs copies each row as its document.
func docs(rows []batch.SourceRow) []batch.Result {
	out := make([]batch.Result, len(rows))
	for i, r := range rows {
		out[i].Document = json.RawMessage(r.Row)
	}
	return out
}

// batch_checkpoint_age_seconds comes from the database: a partition that
// another process runs (its last checkpoint 90 s ago) shows its age here,
// although this process never committed a chunk of it.
func TestCheckpointAgeIsReadFromTheDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	_, err := pool.Exec(ctx, `
INSERT INTO batch_runs (job, logical_run_id, partition_key, state, processor_version, scope_hash, scope, started_at, checkpoint_at)
VALUES ('elsewhere', 'r1', 'a', 'running', 'v1', 'h', '{}', now() - interval '5 minutes', now() - interval '90 seconds'),
       ('elsewhere', 'r1', 'b', 'running', 'v1', 'h', '{}', now() - interval '5 minutes', now() - interval '10 seconds')`)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	batch.NewMetrics(reg, pool)
	age, _, found := gathered(t, reg, "batch_checkpoint_age_seconds", "elsewhere")
	require.True(t, found, "the age of a job this process does not run")
	require.InDelta(t, 90, age, 30, "the oldest running partition's checkpoint")

	// A job with nothing running has a series at 0, so dashboards and the
	// stale-checkpoint alert see it between runs.
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('idle', '{}')`)
	require.NoError(t, err)
	age, _, found = gathered(t, reg, "batch_checkpoint_age_seconds", "idle")
	require.True(t, found, "a job with no running partition")
	require.Zero(t, age)
}

// A running sweep is a running phase of the job too: a sweep that committed
// no chunk for 15 minutes (every partition is over) shows that age, so the
// stale-checkpoint alert covers a stuck sweep.
func TestCheckpointAgeCoversARunningSweep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	_, err := pool.Exec(ctx, `
INSERT INTO batch_runs (job, logical_run_id, partition_key, state, processor_version, scope_hash, scope, started_at, checkpoint_at)
VALUES ('sweeping', 'r1', '', 'succeeded', 'v1', 'h', '{}', now() - interval '20 minutes', now() - interval '16 minutes');
INSERT INTO batch_sweeps (job, logical_run_id, state, started_at, checkpoint_at)
VALUES ('sweeping', 'r1', 'running', now() - interval '16 minutes', now() - interval '15 minutes')`)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	batch.NewMetrics(reg, pool)
	age, _, found := gathered(t, reg, "batch_checkpoint_age_seconds", "sweeping")
	require.True(t, found, "the age of a job whose sweep is running")
	require.InDelta(t, 900, age, 60)
}

// batch_items_inflight is the number of rows a chunk has read and not yet
// committed: while the processor holds a chunk of 500, it reads 500; after
// the run, 0.
func TestItemsInflightMetric(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 1, 1000, 1, 1)
	reg := prometheus.NewRegistry()
	m := batch.NewMetrics(reg, pool)
	var once sync.Once
	seen := make(chan float64, 1)
	proc := batch.ProcessorFunc(func(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
		once.Do(func() {
			v, _, _ := gathered(t, reg, "batch_items_inflight", "records")
			seen <- v
		})
		return docs(rows), nil
	})
	_, err := run(t, pool, spec(func(s *batch.Spec) { s.Chunk.Pipeline = 1 }), batch.Config{Processor: proc, Metrics: m})
	require.NoError(t, err)
	require.Equal(t, float64(500), <-seen)
	after, _, found := gathered(t, reg, "batch_items_inflight", "records")
	require.True(t, found)
	require.Zero(t, after)
}

// A custom processor's external calls go through the job's rate limiter
// (batch.Wait): 20 calls per second with a burst of 1 make 30 calls take
// more than a second, counted in batch_rate_limit_wait_seconds. A
// processor that gets a 429 returns a *batch.RetryAfterError: the chunk is
// retried, not before Retry-After, and the limiter holds every call until
// then. The processor sees the run id and attempt as its idempotency key,
// the same on the retry.
func TestProcessorRateLimitRetryAfterAndIdempotencyKey(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 1, 30, 1, 1)
	reg := prometheus.NewRegistry()
	m := batch.NewMetrics(reg, pool)
	var (
		calls     atomic.Int32
		mu        sync.Mutex
		keys      []string
		infos     []batch.ChunkInfo
		rejectAt  time.Time
		retriedAt time.Time
	)
	proc := batch.ProcessorFunc(func(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
		info, ok := batch.ChunkInfoFrom(ctx)
		require.True(t, ok)
		mu.Lock()
		keys, infos = append(keys, info.IdempotencyKey()), append(infos, info)
		mu.Unlock()
		if calls.Add(1) == 1 {
			rejectAt = time.Now()
			return nil, &batch.RetryAfterError{After: 1500 * time.Millisecond, Err: errors.New("HTTP 429 Too Many Requests")}
		}
		retriedAt = time.Now()
		for range rows {
			if err := batch.Wait(ctx); err != nil {
				return nil, err
			}
		}
		return docs(rows), nil
	})
	start := time.Now()
	sum, err := run(t, pool, spec(func(s *batch.Spec) { s.Chunk.Pipeline = 1 }), batch.Config{Processor: proc, Metrics: m, RateLimit: 20, RateBurst: 1})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.GreaterOrEqual(t, retriedAt.Sub(rejectAt), 1500*time.Millisecond, "Retry-After honoured")
	require.Greater(t, time.Since(start), 1500*time.Millisecond+time.Second, "30 calls at 20/s after the pause")

	waited, n, found := gathered(t, reg, "batch_rate_limit_wait_seconds", "records")
	require.True(t, found)
	require.Equal(t, uint64(30), n)
	require.Greater(t, waited, 1.0)

	require.Len(t, keys, 2)
	require.Equal(t, keys[0], keys[1], "one key for the chunk's retries")
	require.Equal(t, sum.RunID, infos[0].RunID)
	require.Equal(t, 1, infos[0].Attempt)
	require.Equal(t, int64(0), infos[0].Retry)
	require.Equal(t, int64(1), infos[1].Retry)
	require.Contains(t, keys[0], sum.RunID)
}

// The idempotency key names one call's rows: three chunks of one attempt
// (and the calls of a chunk's concurrent groups) get three different keys,
// or a service that deduplicates by key would answer the second chunk with
// the first chunk's cached response; a retry of a call is the same key.
func TestIdempotencyKeyDiffersPerChunk(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 1, 30, 1, 1)
	var (
		mu    sync.Mutex
		keys  = map[string][]string{} // key -> first row id of each call
		calls int
	)
	proc := batch.ProcessorFunc(func(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
		info, ok := batch.ChunkInfoFrom(ctx)
		require.True(t, ok)
		mu.Lock()
		defer mu.Unlock()
		calls++
		keys[info.IdempotencyKey()] = append(keys[info.IdempotencyKey()], rows[0].ID)
		if calls == 2 {
			return nil, &batch.RetryAfterError{After: time.Millisecond, Err: errors.New("HTTP 429 Too Many Requests")}
		}
		return docs(rows), nil
	})
	s := spec(func(s *batch.Spec) { s.Chunk = batch.ChunkSettings{Size: 10, Min: 10, Max: 10, Pipeline: 1} })
	sum, err := run(t, pool, s, batch.Config{Processor: proc})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, 4, calls, "three chunks, the second one twice")
	require.Len(t, keys, 3, "one key per chunk: %v", keys)
	for k, firsts := range keys {
		require.Contains(t, k, sum.RunID)
		for _, f := range firsts {
			require.Equal(t, firsts[0], f, "one key, one set of rows: %v", keys)
		}
	}
}

// A runner's retry and lock-wait series exist at 0 from its start, one
// per retry reason, so a scrape before the first retry has a line for each.
func TestRetryAndLockWaitSeriesStartAtZero(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m := batch.NewMetrics(reg, nil)
	_, err := batch.NewRunner(nil, spec(), batch.Config{Metrics: m})
	require.NoError(t, err)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	reasons := map[string]float64{}
	lockWaits := 0
	for _, mf := range mfs {
		for _, s := range mf.GetMetric() {
			if !hasLabel(s, "job", "records") {
				continue
			}
			switch mf.GetName() {
			case "batch_retry_total":
				for _, l := range s.GetLabel() {
					if l.GetName() == "reason" {
						reasons[l.GetValue()] = s.GetCounter().GetValue()
					}
				}
			case "batch_lock_wait_seconds":
				lockWaits++
				require.Zero(t, s.GetHistogram().GetSampleCount())
			}
		}
	}
	require.Equal(t, map[string]float64{"transient": 0, "lock_timeout": 0, "retry_after": 0, "sweep": 0}, reasons)
	require.Equal(t, 1, lockWaits)
}
