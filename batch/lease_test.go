package batch_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// blockFirstRow opens a transaction that holds the normalized_records key
// of the first source row (id 0), so the first chunk's upsert waits on it:
// a chunk that takes as long as the test wants, active on the server. It
// returns the transaction and its backend pid.
func blockFirstRow(t *testing.T, pool *pgxpool.Pool) (pgx.Tx, int32) {
	t.Helper()
	ctx := context.Background()
	blocker, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = blocker.Rollback(context.Background()) })
	var pid int32
	require.NoError(t, blocker.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	_, err = blocker.Exec(ctx, `INSERT INTO normalized_records (source, source_id, source_version, processor_version) VALUES ('source_records', '0', 1, 'v0')`)
	require.NoError(t, err)
	return blocker, pid
}

// waitForPipelinedWait waits until chunk 0 waits on the blocker's lock and
// chunk 1, its rows written, waits idle in its transaction for chunk 0, both
// for longer than `open`.
func waitForPipelinedWait(t *testing.T, pool *pgxpool.Pool, blockerPID int32, open time.Duration) {
	t.Helper()
	waitFor(t, time.Minute, "two chunk transactions open for "+open.String()+", one waiting on the lock, one idle", func() bool {
		var onLock, idle int64
		require.NoError(t, pool.QueryRow(context.Background(), `
SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), count(*) FILTER (WHERE state = 'idle in transaction')
FROM pg_stat_activity
WHERE datname = current_database() AND pid NOT IN ($1, pg_backend_pid()) AND xact_start < now() - $2::interval`,
			blockerPID, open.String()).Scan(&onLock, &idle))
		return onLock == 1 && idle == 1
	})
}

type runResult struct {
	sum *batch.Summary
	err error
}

// startRun runs s on its own pool (the test's pool stays free for the
// blocker and the checks) and returns the result when the run ends.
func startRun(t *testing.T, url string, s batch.Spec, cfg batch.Config) <-chan runResult {
	t.Helper()
	r, err := batch.NewRunner(stack.Pool(t, url), s, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	done := make(chan runResult, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		sum, err := r.Run(ctx, ctx)
		done <- runResult{sum, err}
	}()
	// A failed test stops the run before its pool closes.
	t.Cleanup(func() { cancel(); <-finished })
	return done
}

// testLease is the lease of the runs in these tests. The server ends a
// chunk transaction idle for the lease TTL, and a waiting chunk reads its
// lease every third of it: a lease of a few seconds leaves room for a
// scheduling stall of over a second under -race on a loaded CI machine,
// which must not fail these tests.
const testLease = 3 * time.Second

// A pipelined chunk waits, idle in its transaction, for the chunk before it
// to commit. The server ends a session idle for the lease TTL, for frozen
// workers; a predecessor that takes several lease TTLs (here it waits on a
// row lock) must not end the waiting chunk's session. (What the wait does
// when the lease is lost or the predecessor is stuck: lease_internal_test.go.)
func TestPipelinedChunkOutwaitsTheLease(t *testing.T) {
	t.Parallel()
	url, pool := newDB(t)
	seed(t, pool, 0, 1000, 3, 1) // two chunks of 500
	blocker, pid := blockFirstRow(t, pool)
	s := spec(func(s *batch.Spec) { s.Chunk.Pipeline = 2; s.Chunk.LockTimeout = batch.Duration(time.Minute) })
	done := startRun(t, url, s, batch.Config{LeaseTTL: testLease})

	waitForPipelinedWait(t, pool, pid, 2*testLease)
	require.NoError(t, blocker.Rollback(context.Background()))
	res := <-done
	require.NoError(t, res.err)
	require.True(t, res.sum.Done)
	require.EqualValues(t, 2, res.sum.Chunks)
	exact(t, url, s.Job, 1000)
}

// stallOnce works like failAfter, except that its first call returns only
// once the server has ended the chunk's session for idling in its
// transaction: a processor slower than the lease.
type stallOnce struct {
	failAfter
	pool    *pgxpool.Pool
	stalled atomic.Bool
}

func (p *stallOnce) Process(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
	if !p.stalled.Swap(true) {
		// The chunk's transaction is the only one, idle while this runs.
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		deadline := time.After(time.Minute)
		for {
			var idle int
			if err := p.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`).Scan(&idle); err != nil {
				return nil, err
			}
			if idle == 0 {
				break
			}
			select {
			case <-tick.C:
			case <-deadline:
				return nil, fmt.Errorf("the chunk's idle transaction was never ended")
			}
		}
	}
	return p.failAfter.Process(ctx, rows)
}

// A chunk whose session the server ended for idling fails its partition
// with an error that says what happened and what to change, not a bare
// connection error; the next run resumes.
func TestIdleTimeoutErrorSaysWhy(t *testing.T) {
	t.Parallel()
	url, pool := newDB(t)
	seed(t, pool, 0, 1000, 3, 1)
	s := spec(func(s *batch.Spec) { s.Chunk.Pipeline = 1 })
	p := &stallOnce{pool: pool}
	_, err := run(t, pool, s, batch.Config{Processor: p, LeaseTTL: testLease})
	require.ErrorIs(t, err, batch.ErrIdleTimeout)
	require.False(t, batch.IsRetryable(err))
	require.ErrorContains(t, err, `partition "": PostgreSQL ended the chunk's transaction: idle for the lease TTL (3s, idle_in_transaction_session_timeout): `+
		`this worker sent no statement for that long (it was stopped or starved, or a custom Processor worked that long on one slice of rows); `+
		`raise the lease TTL or make the processor faster; the chunk rolled back: `)
	require.ErrorContains(t, err, "(SQLSTATE 25P03)")
	require.Equal(t, counts{States: "failed"}, count(t, pool, s.Job))

	sum, err := run(t, pool, s, batch.Config{Processor: p, LeaseTTL: testLease})
	require.NoError(t, err)
	require.True(t, sum.Done)
	exact(t, url, s.Job, 1000)

	// The timeout was the chunk transactions' own: the connections the run
	// gave back to the caller's pool keep the server's default.
	conns := pool.AcquireAllIdle(context.Background())
	require.NotEmpty(t, conns)
	for _, c := range conns {
		var timeout string
		require.NoError(t, c.QueryRow(context.Background(), `SHOW idle_in_transaction_session_timeout`).Scan(&timeout))
		c.Release()
		require.Equal(t, "0", timeout)
	}
}

func TestLeaseTooShortForTheChunks(t *testing.T) {
	t.Parallel()
	adaptive := func(s *batch.Spec) {
		s.Chunk = batch.ChunkSettings{Size: 1000, Min: 100, Max: 20000, TargetDuration: batch.Duration(time.Second)}
	}
	tests := []struct {
		name string
		mut  func(*batch.Spec)
		cfg  batch.Config
		want string // "" = accepted
	}{
		{name: "processor, lease under 3 targets", mut: adaptive, cfg: batch.Config{Processor: &failAfter{}, LeaseTTL: 2 * time.Second},
			want: "lease TTL 2s is shorter than 3 × chunk.target_duration 1s of spec records: a custom Processor works on a chunk " +
				"while the chunk's transaction is idle, and PostgreSQL ends a transaction idle for the lease TTL; " +
				"raise the lease TTL to 3s or more, or lower chunk.target_duration to 666ms or less"},
		{name: "processor, lease of 3 targets", mut: adaptive, cfg: batch.Config{Processor: &failAfter{}, LeaseTTL: 3 * time.Second}},
		{name: "processor, fixed size", cfg: batch.Config{Processor: &failAfter{}, LeaseTTL: 500 * time.Millisecond}},
		{name: "built-in normalizer, lease under the target", mut: adaptive, cfg: batch.Config{LeaseTTL: 500 * time.Millisecond}},
		{name: "lease under 100ms", cfg: batch.Config{LeaseTTL: 50 * time.Millisecond}, want: "lease TTL 50ms: want >= 100ms"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := spec()
			if tt.mut != nil {
				s = spec(tt.mut)
			}
			_, err := batch.NewRunner(nil, s, tt.cfg)
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.EqualError(t, err, tt.want)
		})
	}
}
