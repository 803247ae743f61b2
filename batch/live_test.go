package batch_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// normalizedState is what a user checks of normalized_records and the
// outbox: every row's id, processor and source version, and the events.
func normalizedState(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	require.NoError(t, pool.QueryRow(context.Background(), `
SELECT coalesce(md5(string_agg(source_id || ':' || processor_version || ':' || source_version, ',' ORDER BY source_id)), '') ||
       ' events=' || (SELECT count(*) FROM outbox_event_members) FROM normalized_records`).Scan(&s))
	return s
}

func rowsAt(t *testing.T, pool *pgxpool.Pool, pv string) int64 {
	t.Helper()
	return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE processor_version = $1`, pv)
}

// The stale schedule (issue 27, item 2): after a cutover to v2 the old
// spec at v1 is refused (exit 3), naming the job, the live version and the
// commands that make a version live, and nothing changes in
// normalized_records or the outbox; after a rollback to v1 the v2 schedule
// is refused the same way; --rebuild declares a rebuild of a version that
// was live before. A version never live (the upgrade's rebuild) runs.
func TestRunAtAVersionThatIsNoLongerLiveIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 1)
	at := func(pv string) string {
		return writeSpec(t, spec(func(s *batch.Spec) { s.ProcessorVersion = pv }))
	}
	v1, v2 := at("v1"), at("v2")
	cmd := func(args ...string) *testproc.Proc {
		t.Helper()
		return testproc.Run(t, time.Minute, bin, env(url), args...)
	}
	live := func() string {
		v, err := batch.LoadLiveVersion(ctx, pool, "records")
		require.NoError(t, err)
		return v.ProcessorVersion
	}
	touch := func() {
		_, err := pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"n": 1}' WHERE id % 3 = 0`)
		require.NoError(t, err)
	}

	p := cmd("run", "--spec", v1)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Equal(t, "v1", live(), "a job's first version is live")
	p = cmd("run", "--spec", v2)
	require.Equal(t, 0, p.ExitCode(), "v2 was never live: its rebuild runs\n%s", p.Stderr())
	require.EqualValues(t, 300, rowsAt(t, pool, "v2"))
	require.Equal(t, "v1", live())

	_, err := batch.SetLiveVersion(ctx, pool, "records", "v2", batch.MovedByCutover)
	require.NoError(t, err)
	touch()
	before := normalizedState(t, pool)
	p = cmd("run", "--spec", v1)
	require.Equal(t, 3, p.ExitCode(), "the old schedule after the cutover: %s", p.Stdout())
	for _, want := range []string{"job records", "processor version v1 was live before", "v2 is live", "indexer rollback", "indexer cutover --job records", "--rebuild"} {
		require.Contains(t, p.Stderr(), want)
	}
	require.Equal(t, before, normalizedState(t, pool), "nothing changed")
	require.EqualValues(t, 300, rowsAt(t, pool, "v2"))
	var stored string
	require.NoError(t, pool.QueryRow(ctx, `SELECT spec->>'processor_version' FROM batch_jobs WHERE job = 'records'`).Scan(&stored))
	require.Equal(t, "v2", stored, "the refused run's spec is not saved (indexer cutover --job reads it)")
	p = cmd("quarantine", "retry", "--spec", v1)
	require.Equal(t, 3, p.ExitCode(), "quarantine retry with the old spec: %s", p.Stdout())
	require.Contains(t, p.Stderr(), "processor version v1 was live before")
	require.Contains(t, p.Stderr(), "pass --rebuild")
	p = cmd("quarantine", "retry", "--spec", v1, "--rebuild")
	require.Equal(t, 0, p.ExitCode(), "quarantine retry --rebuild with the old spec: %s", p.Stderr())
	require.Contains(t, p.Stdout(), "retried 0 quarantined row(s) of job records")
	require.Equal(t, before, normalizedState(t, pool), "nothing to retry")
	p = cmd("run", "--spec", v2)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "100 changed")

	_, err = batch.SetLiveVersion(ctx, pool, "records", "v1", batch.MovedByRollback)
	require.NoError(t, err)
	touch()
	before = normalizedState(t, pool)
	p = cmd("run", "--spec", v2)
	require.Equal(t, 3, p.ExitCode(), "the new schedule after the rollback: %s", p.Stdout())
	require.Contains(t, p.Stderr(), "processor version v2 was live before and is not now: v1 is live")
	require.Equal(t, before, normalizedState(t, pool), "nothing changed")
	p = cmd("run", "--spec", v1)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.EqualValues(t, 300, rowsAt(t, pool, "v1"))

	p = cmd("run", "--spec", v2, "--rebuild")
	require.Equal(t, 0, p.ExitCode(), "a declared rebuild: %s", p.Stderr())
	require.EqualValues(t, 300, rowsAt(t, pool, "v2"))
	require.Equal(t, "v1", live(), "a rebuild does not make its version live")
	require.EqualValues(t, 3, queryInt(t, pool, `SELECT count(*) FROM batch_live_version_moves WHERE job = 'records'`), "first run, cutover, rollback")
}

// Upgrading a deployment (issue 27, item 2): migration 016 registers the
// versions jobs ran at before it, none live. When the job's first run after
// it is already the v2 rebuild, v2 is not recorded live (searches still
// read v1's generation) and the run is allowed; the cutover that passes the
// version the documents left (v1) records both, and the old v1 schedule is
// then refused.
func TestFirstRunAfterTheMigrationAtAnotherVersionIsNotLive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 1)
	// What migration 016 leaves for a job that ran at v1 before it.
	_, err := pool.Exec(ctx, `INSERT INTO batch_processor_versions (job, processor_version) VALUES ('records', 'v1')`)
	require.NoError(t, err)
	at := func(pv string) batch.Spec { return spec(func(s *batch.Spec) { s.ProcessorVersion = pv }) }

	_, err = run(t, pool, at("v2"), batch.Config{})
	require.NoError(t, err, "v2 was never live: its rebuild runs")
	require.EqualValues(t, 300, rowsAt(t, pool, "v2"))
	_, err = batch.LoadLiveVersion(ctx, pool, "records")
	require.ErrorIs(t, err, batch.ErrNotFound, "the rebuild is not the live version")
	require.EqualValues(t, 0, queryInt(t, pool, `SELECT count(*) FROM batch_processor_versions WHERE job = 'records' AND first_live_at IS NOT NULL`))
	require.EqualValues(t, 2, queryInt(t, pool, `SELECT count(*) FROM batch_processor_versions WHERE job = 'records'`), "v2 is registered")

	from, err := batch.SetLiveVersion(ctx, pool, "records", "v2", batch.MovedByCutover, "v1")
	require.NoError(t, err)
	require.Equal(t, "", from, "nothing was recorded live")
	live, err := batch.LoadLiveVersion(ctx, pool, "records")
	require.NoError(t, err)
	require.Equal(t, "v2", live.ProcessorVersion)
	require.EqualValues(t, 1, queryInt(t, pool, `SELECT count(*) FROM batch_live_version_moves WHERE job = 'records' AND from_version = 'v1' AND to_version = 'v2'`))

	before := normalizedState(t, pool)
	_, err = run(t, pool, at("v1"), batch.Config{})
	var notLive *batch.LiveVersionError
	require.True(t, errors.As(err, &notLive), "the old v1 schedule after the cutover: %v", err)
	require.ErrorIs(t, err, batch.ErrNotLive)
	require.Equal(t, "v2", notLive.Live)
	require.Equal(t, before, normalizedState(t, pool), "nothing changed")
}

// A job's first run makes its version live when the only version
// registered is that one (migration 016 registered it from batch_runs).
func TestFirstRunAfterTheMigrationAtItsOnlyVersionIsLive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 50, 1, 1)
	_, err := pool.Exec(ctx, `INSERT INTO batch_processor_versions (job, processor_version) VALUES ('records', 'v1')`)
	require.NoError(t, err)
	_, err = run(t, pool, spec(), batch.Config{})
	require.NoError(t, err)
	live, err := batch.LoadLiveVersion(ctx, pool, "records")
	require.NoError(t, err)
	require.Equal(t, "v1", live.ProcessorVersion)
}
