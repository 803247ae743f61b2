package batch_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// A busy table always has a write transaction open. A new run waits only
// for the writers open when it starts (they may commit rows below its
// boundary), sees them end, and starts; writers that begin later do not
// delay it. Nothing the writers commit is lost: what commits after one
// run's boundary is picked up by the next run.
func TestRunStartsOnABusyTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 200, 3, 1)
	s := spec(func(s *batch.Spec) {
		s.Job = "records-busy"
		s.Mode = batch.ModeIncremental
		s.Source.Cursor = []string{"change_seq"}
		s.Chunk = batch.ChunkSettings{Size: 50, Min: 50, Max: 50}
	})

	// Two writers, each keeping a write transaction open for 2s, the second
	// starting 1s after the first: at every moment one is open.
	const hold = 2 * time.Second
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	werrs := make(chan error, 2)
	var next atomic.Int64
	next.Store(200)
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if w == 1 {
				time.Sleep(hold / 2) // the writers' schedule, not a synchronization
			}
			for wctx.Err() == nil {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					n := next.Add(1)
					if _, err := tx.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', to_jsonb($1::text)) WHERE id = $2`,
						fmt.Sprint("busy ", n), (n%200)*7); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO source_records (id, payload) VALUES ($1, '{"title": "new"}')`, n*7); err != nil {
						return err
					}
					time.Sleep(hold) // an open write transaction, as on a busy table
					return nil
				})
				if err != nil {
					werrs <- err
					return
				}
			}
		}()
	}
	t.Cleanup(func() { stop(); wg.Wait() })

	waitFor(t, 10*time.Second, "both writers in a write transaction", func() bool {
		return queryInt(t, pool, `SELECT count(DISTINCT pid) FROM pg_locks WHERE relation = 'source_records'::regclass AND mode = 'RowExclusiveLock'`) == 2
	})
	for i := range 3 {
		start := time.Now()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		r, err := batch.NewRunner(pool, s, batch.Config{})
		require.NoError(t, err)
		sum, err := r.Run(rctx, rctx)
		cancel()
		require.NoError(t, err, "run %d", i)
		require.True(t, sum.Done, "run %d", i)
		// The writers open at its start end within one hold.
		require.Less(t, time.Since(start), 4*hold+5*time.Second, "run %d took too long to start and finish", i)
	}
	stop()
	wg.Wait()
	close(werrs)
	for err := range werrs {
		require.NoError(t, err)
	}

	// Once the writers stopped, one more run: every row, at its last version.
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM source_records s LEFT JOIN normalized_records n ON n.source_id = s.id::text AND n.source_version = s.version WHERE n.source_id IS NULL`),
		"every row's last version is normalized")
	require.Greater(t, queryInt(t, pool, `SELECT count(*) FROM source_records`), int64(200), "the writers inserted rows")
}

// An INSERT evaluates its nextval() default and its BEFORE triggers before
// it has a transaction id. A row that took change_seq 6 and sits in a slow
// trigger while change_seq 7 commits must be processed: the run waits for
// it (by its virtual transaction id) before it starts.
func TestIncrementalRunWaitsForAnInsertInItsTrigger(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 0, 5, 1, 1)
	s := spec(func(s *batch.Spec) {
		s.Job = "records-trigger"
		s.Mode = batch.ModeIncremental
		s.Source.Cursor = []string{"change_seq"}
	})
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)

	// The trigger waits for an advisory lock the test holds.
	_, err = pool.Exec(ctx, `
CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.payload ? 'slow' THEN PERFORM pg_advisory_xact_lock(4242); END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER slow_insert BEFORE INSERT ON source_records FOR EACH ROW EXECUTE FUNCTION slow_insert();`)
	require.NoError(t, err)
	gate, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = gate.Close(context.Background()) })
	_, err = gate.Exec(ctx, `SELECT pg_advisory_lock(4242)`)
	require.NoError(t, err)
	slow := make(chan error, 1)
	go func() {
		_, err := pool.Exec(ctx, `INSERT INTO source_records (id, payload) VALUES (1000, '{"title": "slow", "slow": true}')`)
		slow <- err
	}()
	waitFor(t, 10*time.Second, "the insert waiting in its trigger", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`) == 1
	})
	_, err = pool.Exec(ctx, `INSERT INTO source_records (id, payload) VALUES (1007, '{"title": "fast"}')`)
	require.NoError(t, err)
	require.EqualValues(t, 7, queryInt(t, pool, `SELECT max(change_seq) FROM source_records`), "change_seq 7 committed")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM source_records WHERE change_seq = 6`), "change_seq 6 is still in the trigger")

	// A run that starts now must not pass change_seq 6 by. (It waits; its
	// soft stop ends the wait, and the next run starts once the insert
	// committed.)
	r, err := batch.NewRunner(pool, s, batch.Config{})
	require.NoError(t, err)
	soft, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = r.Run(soft, ctx)
	cancel()
	require.NoError(t, err)

	_, err = gate.Exec(ctx, `SELECT pg_advisory_unlock(4242)`)
	require.NoError(t, err)
	require.NoError(t, <-slow)
	for range 2 {
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
	}
	var titles []string
	rows, err := pool.Query(ctx, `SELECT document->>'title' FROM normalized_records WHERE source_id IN ('1000', '1007') ORDER BY source_id`)
	require.NoError(t, err)
	titles, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"slow", "fast"}, titles, "both rows processed")
}

// The incremental mode needs change values that become visible in the
// order they are taken; a sequence with CACHE > 1 hands out values out of
// that order, and a run refuses to start on one.
func TestIncrementalRefusesACachedSequence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	_, err := pool.Exec(ctx, `ALTER SEQUENCE source_records_change_seq CACHE 20`)
	require.NoError(t, err)
	s := spec(func(s *batch.Spec) {
		s.Job = "records-cached"
		s.Mode = batch.ModeIncremental
		s.Source.Cursor = []string{"change_seq"}
	})
	_, err = run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, `source.cursor[0] "change_seq" of incremental job records-cached is filled from sequence source_records_change_seq with CACHE 20`)
	require.ErrorContains(t, err, "ALTER SEQUENCE source_records_change_seq CACHE 1")

	// An identity column's own sequence is checked too.
	_, err = pool.Exec(ctx, `ALTER SEQUENCE source_records_change_seq CACHE 1; ALTER TABLE source_records ALTER COLUMN id SET CACHE 5`)
	require.NoError(t, err)
	s.Source.Cursor = []string{"id"}
	_, err = run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, "CACHE 5")
}

// An incremental job's change column must be an integer a sequence sets:
// a clock value (updated_at) is taken when a transaction starts or a row
// is written, and such a transaction can commit after a run's boundary
// passed it, below the boundary, and is skipped for good (#26 item 4). It
// is refused at start, saying why and what to use.
func TestIncrementalRefusesAClockChangeColumn(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	for _, tc := range []struct{ cursor []string }{
		{cursor: []string{"created_at", "id"}},
		{cursor: []string{"created_at"}},
	} {
		s := spec(func(s *batch.Spec) {
			s.Job = "records-clock"
			s.Mode = batch.ModeIncremental
			s.Vanished = batch.VanishedKeep
			s.Source.Cursor = tc.cursor
		})
		_, err := run(t, pool, s, batch.Config{})
		require.ErrorIs(t, err, batch.ErrSpec, "cursor %v", tc.cursor)
		require.ErrorContains(t, err, `source.cursor[0] "created_at" of incremental job records-clock is timestamp with time zone`)
		require.ErrorContains(t, err, "a bigint column set from a sequence on every change")
	}
}

// TRUNCATE ... RESTART IDENTITY (or ALTER SEQUENCE ... RESTART) puts every
// new change value below the last run's boundary, where an incremental run
// would never read it (#26 item 4). The next run fails loudly, naming the
// sequence and the remedy; --restart reads the job from the beginning.
func TestIncrementalRefusesARestartedSequence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 500, 1, 1)
	s := spec(func(s *batch.Spec) {
		s.Job = "records-restarted"
		s.Mode = batch.ModeIncremental
		s.Vanished = batch.VanishedKeep
		s.Source.Cursor = []string{"change_seq"}
	})
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)

	_, err = pool.Exec(ctx, `TRUNCATE source_records; ALTER SEQUENCE source_records_change_seq RESTART`)
	require.NoError(t, err)
	seed(t, pool, 1000, 200, 1, 1)
	_, err = run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrCheckpointIncompatible)
	require.ErrorContains(t, err, `sequence source_records_change_seq of source.cursor[0] "change_seq" is at 200, below the last run's boundary 500`)
	require.ErrorContains(t, err, "StartOptions.Restart")

	_, err = run(t, pool, s, batch.Config{StartOptions: batch.StartOptions{Restart: true}})
	require.NoError(t, err)
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM source_records s LEFT JOIN normalized_records n ON n.source_id = s.id::text AND n.source_version = s.version WHERE n.source_id IS NULL`), "every new row normalized")
}
