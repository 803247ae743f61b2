package batch_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

func incremental(job string) batch.Spec {
	return spec(func(s *batch.Spec) {
		s.Job = job
		s.Mode = batch.ModeIncremental
		s.Source.Cursor = []string{"change_seq"}
	})
}

// follower runs a Follower in the background; stop cancels it softly and
// returns what Run returned.
type follower struct {
	cancel context.CancelFunc
	done   chan struct{}
	sum    *batch.FollowSummary
	err    error
}

func startFollower(t *testing.T, pool *pgxpool.Pool, s batch.Spec, cfg batch.Config, fc batch.FollowConfig) *follower {
	t.Helper()
	f, err := batch.NewFollower(pool, s, cfg, fc)
	require.NoError(t, err)
	hard, hcancel := context.WithTimeout(context.Background(), 3*time.Minute)
	soft, scancel := context.WithCancel(hard)
	fl := &follower{cancel: scancel, done: make(chan struct{})}
	go func() {
		defer close(fl.done)
		fl.sum, fl.err = f.Run(soft, hard)
	}()
	t.Cleanup(func() { scancel(); <-fl.done; hcancel() })
	return fl
}

func (f *follower) stop(t *testing.T) (*batch.FollowSummary, error) {
	t.Helper()
	f.cancel()
	select {
	case <-f.done:
	case <-time.After(time.Minute):
		t.Fatal("follower did not stop within a minute of the soft stop")
	}
	return f.sum, f.err
}

// behind counts source rows whose normalized row is missing or not at the
// row's current version, read over a new connection.
func behind(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	require.NoError(t, pool.QueryRow(context.Background(), `
SELECT count(*) FROM source_records s LEFT JOIN normalized_records n ON n.source = 'source_records' AND n.source_id = s.id::text
WHERE n.source_version IS DISTINCT FROM s.version`).Scan(&n))
	return n
}

func waitCaughtUp(t *testing.T, pool *pgxpool.Pool, timeout time.Duration, f *follower) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		n := behind(t, pool)
		if n == 0 {
			return
		}
		select {
		case <-f.done:
			t.Fatalf("follower ended with %d rows behind: %v", n, f.err)
		default:
		}
		require.Truef(t, time.Now().Before(deadline), "%d source rows not normalized at their version after %s", n, timeout)
		time.Sleep(20 * time.Millisecond) // poll interval of the check, not a synchronization
	}
}

func runCount(t *testing.T, pool *pgxpool.Pool, job string) (runs, open int) {
	t.Helper()
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(DISTINCT logical_run_id), count(*) FILTER (WHERE state NOT IN ('succeeded', 'superseded')) FROM batch_runs WHERE job = $1`, job).Scan(&runs, &open))
	return runs, open
}

// With the trigger installed, a change wakes an idle follower by NOTIFY:
// the poll interval here is an hour, so only the NOTIFY can start the runs
// that bring every update into normalized_records.
func TestFollowWakesOnNotify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 300, 1, 1)
	s := incremental("follow-notify")
	_, err := pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)

	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: time.Hour})
	waitCaughtUp(t, pool, time.Minute, f)
	for i := range 30 {
		_, err := pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', to_jsonb('changed ' || $1::int)) WHERE id = $2`, i, 7*(1+i*9))
		require.NoError(t, err)
		// A batch of new rows too: inserts take a change_seq as well.
		if i%10 == 0 {
			seed(t, pool, 1000+i, 5, 1, 1)
		}
	}
	waitCaughtUp(t, pool, time.Minute, f)
	sum, err := f.stop(t)
	require.NoError(t, err)
	require.GreaterOrEqual(t, sum.Rows, int64(300+30+15))
	_, open := runCount(t, pool, s.Job)
	require.Zero(t, open, "a follower stopped while idle leaves no unfinished run")
}

// Without the trigger the follower finds changes by polling.
func TestFollowPollsWithoutTrigger(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 100, 1, 1)
	s := incremental("follow-poll")
	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: 100 * time.Millisecond, PollOnly: true})
	waitCaughtUp(t, pool, time.Minute, f)
	_, err := pool.Exec(ctx, `UPDATE source_records SET deleted_at = now() WHERE id % 3 = 0`)
	require.NoError(t, err)
	waitCaughtUp(t, pool, time.Minute, f)
	var tombstones int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM normalized_records WHERE deleted`).Scan(&tombstones))
	require.NotZero(t, tombstones, "soft deletes became tombstones")
	_, err = f.stop(t)
	require.NoError(t, err)
}

// An idle follower makes no runs: over a window of many poll intervals
// without changes, batch_runs gains nothing. The first change after it
// gets one run.
func TestFollowIdleMakesNoRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 100, 1, 1)
	s := incremental("follow-idle")
	_, err := pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)
	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: 50 * time.Millisecond})
	waitCaughtUp(t, pool, time.Minute, f)
	// The run after the catch-up may still be under way; wait for the
	// follower to settle (no unfinished run, same count twice a window apart).
	var before int
	for deadline := time.Now().Add(time.Minute); ; {
		runs, open := runCount(t, pool, s.Job)
		if open == 0 && runs == before {
			break
		}
		before = runs
		require.True(t, time.Now().Before(deadline), "follower did not settle")
		time.Sleep(200 * time.Millisecond) // a measuring window
	}
	time.Sleep(time.Second) // the idle window measured: 20 poll intervals
	after, _ := runCount(t, pool, s.Job)
	require.Equal(t, before, after, "runs made by an idle follower")

	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"x": 1}' WHERE id = 14`)
	require.NoError(t, err)
	waitCaughtUp(t, pool, time.Minute, f)
	_, err = f.stop(t)
	require.NoError(t, err)
}

// A soft stop in the middle of a run stops at a chunk boundary: the run's
// partition is released at its last committed checkpoint, with exactly
// the rows up to it normalized; the next follower resumes that run and
// then follows on, with no event written twice.
func TestFollowSoftStopAtAChunkBoundary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 30_000, 1, 1)
	s := incremental("follow-stop")
	s.Chunk = batch.ChunkSettings{Size: 200, Min: 200, Max: 200}
	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{})
	for deadline := time.Now().Add(time.Minute); ; {
		var processed int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT COALESCE(max(processed_count), 0) FROM batch_runs WHERE job = $1`, s.Job).Scan(&processed))
		if processed >= 1000 {
			break
		}
		require.True(t, time.Now().Before(deadline), "no progress")
		time.Sleep(10 * time.Millisecond) // poll interval of the check
	}
	sum, err := f.stop(t)
	require.NoError(t, err)
	var state string
	var processed, normalized int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT state, processed_count FROM batch_runs WHERE job = $1 AND logical_run_id = $2`, s.Job, sum.LastRunID).Scan(&state, &processed))
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM normalized_records`).Scan(&normalized))
	require.Equal(t, "pending", state, "the stopped run waits for the next worker")
	require.Less(t, processed, int64(30_000), "stopped in the middle of the run")
	require.Zero(t, processed%200, "stopped at a chunk boundary")
	require.Equal(t, processed, normalized, "normalized rows are exactly the checkpointed ones")

	f2 := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{})
	waitCaughtUp(t, pool, 2*time.Minute, f2)
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"y": 2}' WHERE id < 700`)
	require.NoError(t, err)
	waitCaughtUp(t, pool, time.Minute, f2)
	sum2, err := f2.stop(t)
	require.NoError(t, err)
	require.GreaterOrEqual(t, sum2.Runs, int64(2))
	c := count(t, pool, s.Job)
	require.Equal(t, c.Events, c.DistinctEvents, "no event twice")
	require.EqualValues(t, 30_000+100, c.Events, "one event per insert and per update")
	var resumed int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND state = 'succeeded'`, s.Job, sum.LastRunID).Scan(&resumed))
	require.Equal(t, 1, resumed, "the next follower finished the stopped run")
}

// Following makes sense for incremental jobs only, and a follower makes
// its own run ids.
func TestFollowRejectsWhatCannotBeFollowed(t *testing.T) {
	t.Parallel()
	_, err := batch.NewFollower(nil, spec(), batch.Config{}, batch.FollowConfig{})
	require.True(t, errors.Is(err, batch.ErrSpec), "full job: %v", err)
	require.ErrorContains(t, err, "only an incremental job can be followed")
	_, err = batch.NewFollower(nil, incremental("x"), batch.Config{StartOptions: batch.StartOptions{RunID: "r1"}}, batch.FollowConfig{})
	require.ErrorContains(t, err, "run id r1")
	_, err = batch.NewFollower(nil, incremental("x"), batch.Config{MaxChunks: 3}, batch.FollowConfig{})
	require.ErrorContains(t, err, "max chunks 3")
}

// A table that changes every few milliseconds gets one run per
// MinInterval, not one per change: over a second of updates every 5 ms, a
// 400 ms floor allows a handful of runs, each starting at least the floor
// (less the time a run takes to begin) after the one before, and every
// change is normalized. Without the floor, the same stream made 105 runs
// on an idle machine (a load only makes runs fewer, so only the bounds of
// the floor are asserted).
func TestFollowMinIntervalGathersABusyTablesChanges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const floor = 400 * time.Millisecond
	_, pool := newDB(t)
	seed(t, pool, 0, 300, 1, 1)
	s := incremental("follow-floor")
	_, err := pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)
	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: time.Hour, MinInterval: floor})
	waitCaughtUp(t, pool, time.Minute, f)
	before, _ := runCount(t, pool, s.Job)
	start := time.Now()
	for i := 0; time.Since(start) < time.Second; i++ {
		_, err := pool.Exec(ctx, `UPDATE source_records SET payload = payload || jsonb_build_object('n', $1::int) WHERE id = $2`, i, 7*(1+i%200))
		require.NoError(t, err)
		time.Sleep(5 * time.Millisecond) // the writer's pace, not a synchronization
	}
	window := time.Since(start)
	waitCaughtUp(t, pool, time.Minute, f)
	_, err = f.stop(t)
	require.NoError(t, err)
	after, open := runCount(t, pool, s.Job)
	require.Zero(t, open)
	runs := after - before
	t.Logf("%d runs for %s of changes every 5 ms (floor %s)", runs, window.Round(time.Millisecond), floor)
	require.GreaterOrEqual(t, runs, 1)
	// The first run starts at the first change; the last may start up to
	// one floor after the window.
	require.LessOrEqual(t, runs, 2+int(window/floor))
	rows, err := pool.Query(ctx, `SELECT min(created_at) FROM batch_runs WHERE job = $1 GROUP BY logical_run_id ORDER BY 1`, s.Job)
	require.NoError(t, err)
	starts, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	require.NoError(t, err)
	for i := len(starts) - runs + 1; i < len(starts); i++ {
		require.GreaterOrEqual(t, starts[i].Sub(starts[i-1]), floor/2, "runs %d and %d of the window", i-1, i)
	}
}

// A follower of one partition would finish its partition's run and then
// wait for the run's other partitions for good (#26: it stalled after its
// own partition succeeded), so --follow with a partition is refused at
// start, naming the setting.
func TestFollowWithOnePartitionIsRefused(t *testing.T) {
	t.Parallel()
	_, err := batch.NewFollower(nil, incremental("x"), batch.Config{Partition: "t0"}, batch.FollowConfig{})
	require.ErrorContains(t, err, "partition t0")

	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 100, 1, 2)
	specFile := writeSpec(t, spec(func(s *batch.Spec) {
		s.Mode = batch.ModeIncremental
		s.Vanished = batch.VanishedKeep
		s.Source.Cursor = []string{"change_seq"}
		s.Source.Partition = "tenant_id"
	}))
	p := testproc.Run(t, time.Minute, bin, env(url, "BATCH_PARTITION=t0"), "run", "--spec", specFile, "--follow")
	require.Equal(t, 2, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stderr(), "--follow with --partition (BATCH_PARTITION) t0")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM batch_runs`), "refused before any run was created")
}

// --restart of an incremental job starts a new run from the beginning of
// the change column, as a full job's does (#26: it started from the last
// succeeded boundary and read nothing).
func TestRestartOfIncrementalJobStartsFromTheBeginning(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 1000, 1, 1)
	s := incremental("records")
	s.Vanished = batch.VanishedKeep
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Equal(t, int64(1000), count(t, pool, "records").Processed)

	_, err = run(t, pool, s, batch.Config{StartOptions: batch.StartOptions{Restart: true}})
	require.NoError(t, err)
	require.Equal(t, int64(1000), count(t, pool, "records").Processed, "the restarted run read every row again")
	require.Equal(t, int64(2), queryInt(t, pool, `SELECT count(DISTINCT logical_run_id) FROM batch_runs WHERE job = 'records' AND start_cursor IS NULL`), "both runs start at the beginning")

	// Without --restart the next run starts where the last one ended.
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Zero(t, count(t, pool, "records").Processed)
}

// A change committed below what the follower saw as the table's newest
// change value must not wait for a later write (#26 item 3): a writer
// takes change_seq N in partition t0 and stays open; N+1 commits in t1
// and wakes the follower, whose run reads t0's boundary below N and waits
// for the writer; the writer commits N. The run ends with N unread (t0's
// boundary is below it) while the table's newest value, N+1, was covered,
// and nothing else is written: the follower must still read N at once.
func TestFollowStrandsNoChangeBelowTheNewest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 200, 1, 2) // ids 0, 7, 14, ...: t0 even rows, t1 odd rows
	s := incremental("follow-strand")
	s.Vanished = batch.VanishedKeep
	s.Source.Partition = "tenant_id"
	_, err := pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)
	// The poll is an hour: only a NOTIFY (one per committed write) or the
	// follower's own look after a run can start the next run.
	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: time.Hour, MinInterval: -1})
	waitCaughtUp(t, pool, time.Minute, f)

	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	_, err = writer.Exec(ctx, `UPDATE source_records SET payload = payload || '{"title": "held"}' WHERE id = 0`) // t0
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"title": "quick"}' WHERE id = 7`) // t1
	require.NoError(t, err)

	// The follower's run has read its boundaries and waits for the open
	// writer: its session runs the open-writers query.
	deadline := time.Now().Add(time.Minute)
	for queryInt(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
		AND query LIKE 'SELECT l.virtualtransaction, min(l.pid)%'`) == 0 {
		require.True(t, time.Now().Before(deadline), "the follower never waited for the open writer")
		time.Sleep(10 * time.Millisecond) // poll interval of the check, not a synchronization
	}
	require.NoError(t, writer.Commit(ctx))
	waitCaughtUp(t, pool, 30*time.Second, f)
	_, err = f.stop(t)
	require.NoError(t, err)
}

// A follower keeps its compiled spec across runs while the catalog of its
// tables stays as it was, and compiles it again after a schema change: a
// column of the document renamed under it ends the follower with the
// spec's error naming the setting, as at start, and not with a failed
// chunk of statements compiled for the old table.
func TestFollowCompilesAgainAfterASchemaChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 50, 1, 1)
	s := incremental("follow-schema")
	_, err := pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)

	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: time.Hour})
	waitCaughtUp(t, pool, time.Minute, f)
	seed(t, pool, 100, 5, 1, 1) // a run with the compiled spec kept
	waitCaughtUp(t, pool, time.Minute, f)

	_, err = pool.Exec(ctx, `ALTER TABLE source_records RENAME COLUMN tenant_id TO tenant_key`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"title": "after"}' WHERE id = (SELECT min(id) FROM source_records)`)
	require.NoError(t, err)
	select {
	case <-f.done:
	case <-time.After(time.Minute):
		t.Fatal("the follower did not stop after its document's column was renamed")
	}
	require.ErrorIs(t, f.err, batch.ErrSpec)
	require.ErrorContains(t, f.err, `column "tenant_id" does not exist`)
}
