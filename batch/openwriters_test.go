package batch_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// A run that waits for an open writer of the source table starts as soon
// as that writer ends: the wait must not look at one frozen picture of the
// server's backends.
func TestRunStartsWhenTheOpenWriterEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 100, 3, 1)
	s := spec(func(s *batch.Spec) { s.Job = "records-wait" })

	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	_, err = writer.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"open"') WHERE id = 7`)
	require.NoError(t, err)

	r, err := batch.NewRunner(pool, s, batch.Config{})
	require.NoError(t, err)
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	prepared := make(chan error, 1)
	go func() {
		_, err := r.Prepare(pctx)
		prepared <- err
	}()
	// The run is waiting for the writer (its prepare transaction is open).
	require.Eventually(t, func() bool {
		var waiting int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction' AND query LIKE '%l.virtualtransaction = ANY%'`).Scan(&waiting)
		return waiting > 0
	}, 20*time.Second, 20*time.Millisecond, "the run waits for the open writer")
	require.NoError(t, writer.Commit(ctx))
	select {
	case err := <-prepared:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the run did not start within 10s of the writer's commit")
	}
}

// openWriter begins a transaction that updates row id of source_records and
// holds it; it returns the transaction and its backend's pid.
func openWriter(t *testing.T, pool *pgxpool.Pool, id int) (pgx.Tx, int) {
	t.Helper()
	ctx := context.Background()
	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = writer.Rollback(context.Background()) })
	_, err = writer.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"long writer"') WHERE id = $1`, id)
	require.NoError(t, err)
	var pid int
	require.NoError(t, writer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	return writer, pid
}

// gauge reads the value of name{job} from reg (-1 when there is no such series).
func gauge(t *testing.T, reg *prometheus.Registry, name, job string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "job" && l.GetValue() == job {
					return m.GetGauge().GetValue() + m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// A writer that stays open longer than the configured wait delays the
// follower's run but does not end the follower: it gives up on that run
// start, says so (batch_open_writers, the gauge, the counter) and tries
// again; once the writer commits, it catches up with no restart.
func TestFollowerOutlastsALongWriter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 100, 1, 1)
	s := incremental("follow-long-writer")
	writer, pid := openWriter(t, pool, 7)

	reg := prometheus.NewRegistry()
	m := batch.NewMetrics(reg, pool)
	f := startFollower(t, pool, s, batch.Config{Metrics: m, OpenWritersWait: 300 * time.Millisecond}, batch.FollowConfig{PollInterval: 100 * time.Millisecond})
	require.Eventually(t, func() bool {
		return gauge(t, reg, "batch_open_writers_wait_expired_total", s.Job) >= 3
	}, 30*time.Second, 20*time.Millisecond, "the follower gives up on the run start and tries again")
	select {
	case <-f.done:
		t.Fatalf("the follower ended while a writer was open: %v", f.err)
	default:
	}
	waits, err := batch.OpenWritersWaits(ctx, pool, s.Job)
	require.NoError(t, err)
	require.Len(t, waits, 1)
	require.Equal(t, s.Job, waits[0].Job)
	require.Equal(t, `"public"."source_records"`, waits[0].Table)
	require.Contains(t, waits[0].Writers, fmt.Sprintf("(pid %d)", pid))
	require.True(t, waits[0].Current, "a follower is waiting")
	// since is the first attempt's, kept across the retries.
	require.Greater(t, waits[0].CheckedAt.Sub(waits[0].Since), 600*time.Millisecond)
	require.Greater(t, gauge(t, reg, "batch_open_writers_wait_seconds", s.Job), 0.6)
	require.Equal(t, int64(100), behind(t, pool), "no run started")

	require.NoError(t, writer.Commit(ctx))
	waitCaughtUp(t, pool, time.Minute, f)
	var title string
	require.NoError(t, pool.QueryRow(ctx, `SELECT document->>'title' FROM normalized_records WHERE source_id = '7'`).Scan(&title))
	require.Equal(t, "long writer", title)
	waits, err = batch.OpenWritersWaits(ctx, pool, s.Job)
	require.NoError(t, err)
	require.Empty(t, waits, "the run that started cleared the wait")
	require.Equal(t, 0.0, gauge(t, reg, "batch_open_writers_wait_seconds", s.Job))
	_, err = f.stop(t)
	require.NoError(t, err)
}

// A one-shot run gives up after the configured wait, naming the writers and
// the setting; the batcher says the same with its own setting's name and
// status shows the wait; a negative setting is refused.
func TestRunGivesUpAfterTheConfiguredWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 0, 100, 1, 1)
	s := spec(func(s *batch.Spec) { s.Job = "records-give-up" })
	_, pid := openWriter(t, pool, 7)

	r, err := batch.NewRunner(pool, s, batch.Config{OpenWritersWait: 300 * time.Millisecond})
	require.NoError(t, err)
	start := time.Now()
	_, err = r.Prepare(ctx)
	require.ErrorIs(t, err, batch.ErrOpenWriters)
	require.Less(t, time.Since(start), 20*time.Second)
	var ow *batch.OpenWritersError
	require.ErrorAs(t, err, &ow)
	require.Contains(t, err.Error(), fmt.Sprintf("(pid %d)", pid))
	require.Contains(t, err.Error(), "Config.OpenWritersWait")
	waits, err := batch.OpenWritersWaits(ctx, pool, s.Job)
	require.NoError(t, err)
	require.Len(t, waits, 1)
	require.NotNil(t, waits[0].ExpiredAt)
	require.False(t, waits[0].Current, "a one-shot run that gave up waits no more")

	bin := testproc.Build(t, "batcher")
	specFile := writeSpec(t, s)
	cmd := func(args ...string) *testproc.Proc {
		t.Helper()
		return testproc.Run(t, time.Minute, bin, env(url), args...)
	}
	p := cmd("run", "--help")
	require.Equal(t, 0, p.ExitCode())
	require.Contains(t, p.Stdout(), "--open-writers-wait  (env OPEN_WRITERS_WAIT, default 2m0s)")
	p = cmd("run", "--spec", specFile, "--open-writers-wait=-1s")
	require.Equal(t, 2, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stderr(), "OPEN_WRITERS_WAIT=-1s")

	p = cmd("run", "--spec", specFile, "--open-writers-wait", "300ms")
	require.Equal(t, 1, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stderr(), fmt.Sprintf("(pid %d)", pid))
	require.Contains(t, p.Stderr(), "OPEN_WRITERS_WAIT")
	p = cmd("status", "--job", s.Job)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Regexp(t, `job records-give-up: a run start gave up at \S+ after waiting since \S+ for transactions \S+ \(pid `+fmt.Sprint(pid)+`\) that wrote "public"."source_records" \(OPEN_WRITERS_WAIT \(--open-writers-wait\)\); no run starts before they end`, p.Stdout())
}
