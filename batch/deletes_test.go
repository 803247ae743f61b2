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

// followLatency bounds how long a change may take to reach
// normalized_records and the outbox in these follow tests (a loaded
// machine included); the follower's poll interval is an hour, so only the
// trigger's NOTIFY wakes it.
const followLatency = 30 * time.Second

// deletingJob is an incremental job with vanished: delete over tenants
// t0..t2 (a filter), with the follow and capture triggers installed.
func deletingJob(t *testing.T, pool *pgxpool.Pool, job string, mut ...func(*batch.Spec)) batch.Spec {
	t.Helper()
	s := incremental(job)
	s.Vanished = batch.VanishedDelete
	s.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "in", Values: []string{"t0", "t1", "t2"}}}
	for _, m := range mut {
		m(&s)
	}
	_, err := pool.Exec(context.Background(), batch.FollowTriggerSQL(s))
	require.NoError(t, err)
	return s
}

// liveRows counts the live rows of normalized_records over a new query.
func liveRows(t *testing.T, pool *pgxpool.Pool) int64 {
	return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE NOT deleted`)
}

// followDeletes starts a follower of s (woken by NOTIFY only) and waits
// until the 300 rows of tenants t0..t2 (ids 7..2100, seeded) are live.
func followDeletes(t *testing.T, pool *pgxpool.Pool, s batch.Spec) *follower {
	t.Helper()
	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: time.Hour})
	waitFor(t, time.Minute, "the first load", func() bool { return liveRows(t, pool) == 300 })
	return f
}

// Every kind of delete reaches normalized_records and the outbox as a
// delete event within the follow latency, with no manual run: a hard
// DELETE, a row updated out of the filter, a row moved to a partition not
// in the job's list, an UPDATE of the id, and a TRUNCATE followed by new
// rows (one of them an
// id that was there before, with its version reset). Each delete event's
// version is one more than the row's last upsert.
func TestFollowCarriesEveryKindOfDelete(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("hard delete", func(t *testing.T) {
		t.Parallel()
		url, pool := newDB(t)
		seed(t, pool, 1, 300, 1, 3)
		s := deletingJob(t, pool, "del-hard")
		f := followDeletes(t, pool, s)
		_, err := pool.Exec(ctx, `DELETE FROM source_records WHERE id IN (14, 21, 70)`)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id = 2100`)
		require.NoError(t, err)
		waitFor(t, followLatency, "the delete events", func() bool { return len(deleteEvents(t, url)) == 4 })
		require.Equal(t, []string{"14@2", "21@2", "70@2", "2100@2"}, deleteEvents(t, url))
		require.Equal(t, int64(4), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE deleted AND vanished AND document IS NULL AND source_version = 2`))
		require.Equal(t, int64(296), liveRows(t, pool))
		_, err = f.stop(t)
		require.NoError(t, err)
		m, ok, err := batch.ReadDeleteMarks(ctx, pool, s.Job)
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, int64(4), m.Tombstones)
		require.Zero(t, m.Pending)
		require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM batch_deletes`), "captures every job has passed are deleted")
	})

	t.Run("out of the filter", func(t *testing.T) {
		t.Parallel()
		url, pool := newDB(t)
		seed(t, pool, 1, 400, 1, 4) // tenants t0..t3; t3 is out of scope
		s := deletingJob(t, pool, "del-filter")
		f := followDeletes(t, pool, s)
		// id 7 is t1, id 14 t2: both leave the filter (version 2).
		_, err := pool.Exec(ctx, `UPDATE source_records SET tenant_id = 't3' WHERE id IN (7, 14)`)
		require.NoError(t, err)
		waitFor(t, followLatency, "the delete events", func() bool { return len(deleteEvents(t, url)) == 2 })
		require.Equal(t, []string{"7@2", "14@2"}, deleteEvents(t, url))
		// Back into the filter (version 3): above the tombstone.
		_, err = pool.Exec(ctx, `UPDATE source_records SET tenant_id = 't0' WHERE id = 7`)
		require.NoError(t, err)
		waitFor(t, followLatency, "id 7 back", func() bool {
			return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '7' AND NOT deleted AND source_version = 3`) == 1
		})
		require.Equal(t, int64(299), liveRows(t, pool))
		_, err = f.stop(t)
		require.NoError(t, err)
	})

	t.Run("out of the partition list", func(t *testing.T) {
		t.Parallel()
		url, pool := newDB(t)
		seed(t, pool, 1, 450, 1, 3) // t0..t2, 150 each
		s := deletingJob(t, pool, "del-partition", func(s *batch.Spec) {
			s.Source.Filter = nil
			s.Source.Partition = "tenant_id"
			s.Source.Partitions = []string{"t0", "t1"}
		})
		f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: time.Hour})
		waitFor(t, time.Minute, "the first load", func() bool { return liveRows(t, pool) == 300 })
		// id 7 is t1: to t2, not in the list; id 21 (t0) to t1 stays.
		_, err := pool.Exec(ctx, `UPDATE source_records SET tenant_id = CASE id WHEN 7 THEN 't2' ELSE 't1' END WHERE id IN (7, 21)`)
		require.NoError(t, err)
		waitFor(t, followLatency, "the delete event", func() bool { return len(deleteEvents(t, url)) == 1 })
		waitFor(t, followLatency, "id 21 in t1", func() bool {
			return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '21' AND NOT deleted AND source_version = 2`) == 1
		})
		require.Equal(t, []string{"7@2"}, deleteEvents(t, url))
		require.Equal(t, int64(299), liveRows(t, pool))
		_, err = f.stop(t)
		require.NoError(t, err)
	})

	// An UPDATE of the id column (a natural key renamed) leaves the old id
	// without a row and without a change value: it is a delete of the old
	// id, captured by a row trigger that fires only when the id changes.
	t.Run("id changed by an update", func(t *testing.T) {
		t.Parallel()
		url, pool := newDB(t)
		seed(t, pool, 1, 300, 1, 3)
		s := deletingJob(t, pool, "del-rekey")
		f := followDeletes(t, pool, s)
		_, err := pool.Exec(ctx, `UPDATE source_records SET id = id + 500000 WHERE id IN (14, 21)`)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `UPDATE source_records SET id = id WHERE id = 28`) // in the SET list, unchanged: no capture
		require.NoError(t, err)
		waitFor(t, followLatency, "the new ids", func() bool {
			return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id IN ('500014', '500021') AND NOT deleted`) == 2
		})
		waitFor(t, followLatency, "the delete events", func() bool { return len(deleteEvents(t, url)) == 2 })
		require.Equal(t, []string{"14@2", "21@2"}, deleteEvents(t, url))
		require.Equal(t, int64(300), liveRows(t, pool))
		require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '28' AND NOT deleted`))
		_, err = f.stop(t)
		require.NoError(t, err)
	})

	t.Run("truncate", func(t *testing.T) {
		t.Parallel()
		url, pool := newDB(t)
		seed(t, pool, 1, 300, 1, 3)
		s := deletingJob(t, pool, "del-truncate")
		f := followDeletes(t, pool, s)
		_, err := pool.Exec(ctx, `UPDATE source_records SET payload = '{"title": "v2"}' WHERE id = 7`) // version 2
		require.NoError(t, err)
		waitFor(t, followLatency, "id 7 at version 2", func() bool {
			return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '7' AND source_version = 2`) == 1
		})
		_, err = pool.Exec(ctx, `TRUNCATE source_records`)
		require.NoError(t, err)
		// After the truncate: id 7 again at version 1, and a new id.
		_, err = pool.Exec(ctx, `INSERT INTO source_records (id, tenant_id, payload) VALUES (7, 't1', '{"title": "again"}'), (9999, 't0', '{"title": "new"}')`)
		require.NoError(t, err)
		waitFor(t, followLatency, "the truncate's deletes", func() bool {
			return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE deleted AND vanished`) == 299 && liveRows(t, pool) == 2
		})
		require.Len(t, deleteEvents(t, url), 300, "one delete per row the truncate removed")
		require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '7' AND NOT deleted AND source_version = 4 AND document->>'title' = 'again'`),
			"id 7 back above its tombstone (version 3)")
		require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '9999' AND NOT deleted`))
		_, err = f.stop(t)
		require.NoError(t, err)
	})
}

// A row deleted and inserted again with its version reset (id 7 at
// version 5 deleted, then inserted with version 1) ends live, above the
// delete's tombstone, whether or not a run fell between the two.
func TestFollowReinsertWithAResetVersionComesBack(t *testing.T) {
	t.Parallel()
	for _, together := range []bool{false, true} {
		t.Run(fmt.Sprintf("one_transaction=%v", together), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 300, 1, 3)
			s := deletingJob(t, pool, "del-reinsert")
			f := followDeletes(t, pool, s)
			for i := range 4 { // version 5
				_, err := pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_build_object('title', 'edit ' || $1::int) WHERE id = 7`, i)
				require.NoError(t, err)
			}
			waitFor(t, followLatency, "id 7 at version 5", func() bool {
				return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '7' AND source_version = 5`) == 1
			})
			del := `DELETE FROM source_records WHERE id = 7`
			ins := `INSERT INTO source_records (id, tenant_id, version, payload) VALUES (7, 't1', 1, '{"title": "back"}')`
			if together {
				_, err := pool.Exec(ctx, del+"; "+ins)
				require.NoError(t, err)
			} else {
				_, err := pool.Exec(ctx, del)
				require.NoError(t, err)
				_, err = pool.Exec(ctx, ins)
				require.NoError(t, err)
			}
			waitFor(t, followLatency, "id 7 back", func() bool {
				return queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '7' AND NOT deleted AND document->>'title' = 'back'`) == 1
			})
			require.Equal(t, int64(7), queryInt(t, pool, `SELECT source_version FROM normalized_records WHERE source_id = '7'`), "above the tombstone (version 6)")
			require.Equal(t, []string{"7@6"}, deleteEvents(t, url))
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'upsert' AND aggregate_id = '7' AND aggregate_version = 7`))
			_, err := f.stop(t)
			require.NoError(t, err)
		})
	}
}

// Rows deleted during a first load, after their chunk read them, reach the
// outbox as deletes once the first load is over, with no manual run.
func TestFollowFirstLoadWithDeletesDuringIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 15_000, 1, 3)
	s := deletingJob(t, pool, "del-firstload", func(s *batch.Spec) {
		s.Source.Filter = nil
		s.Chunk = batch.ChunkSettings{Size: 200, Min: 200, Max: 200}
	})
	f := startFollower(t, pool, s, batch.Config{}, batch.FollowConfig{PollInterval: time.Hour})
	waitFor(t, time.Minute, "the first load under way", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM normalized_records`) >= 1000
	})
	// The first 100 ids, read already (change_seq follows the ids), while
	// the first load is under way: the lock on its run row keeps it from
	// finishing before the delete commits.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	var open int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM (SELECT FROM batch_runs WHERE job = $1 AND first_load AND state <> 'succeeded' FOR SHARE) r`, s.Job).Scan(&open))
	require.Equal(t, 1, open, "the first load is still under way")
	_, err = tx.Exec(ctx, `DELETE FROM source_records WHERE id <= 700`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	waitFor(t, 2*time.Minute, "the deletes", func() bool { return len(deleteEvents(t, url)) == 100 })
	waitFor(t, followLatency, "every row", func() bool { return liveRows(t, pool) == 14_900 })
	var want []string
	for id := 7; id <= 700; id += 7 {
		want = append(want, fmt.Sprintf("%d@2", id))
	}
	require.Equal(t, want, deleteEvents(t, url))
	_, err = f.stop(t)
	require.NoError(t, err)
}

// A job with vanished: delete needs the capture: without the trigger its
// run is refused, naming the command that installs it.
func TestIncrementalDeleteNeedsTheCapture(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 1, 10, 1, 1)
	s := incremental("del-nocapture")
	s.Vanished = batch.VanishedDelete
	_, err := run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, "follow-trigger --install")
}

// kill -9 inside the drain (tombstones written, marks moved, or the run
// committed) loses no delete and writes none twice: the next run ends with
// one delete event per deleted row and the marks at the newest capture.
// Before the run, CountBehind counts the deleted rows as gone.
func TestDeletesDrainCrashAndResume(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	for _, tc := range []struct {
		point     string
		committed bool // the drain committed when the process died
	}{
		{"batch.deletes_after_tombstones", false},
		{"batch.deletes_after_mark", false},
		{"batch.deletes_after_commit", true},
	} {
		t.Run(tc.point, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 300, 1, 3)
			s := deletingJob(t, pool, "del-crash")
			specFile := writeSpec(t, s)
			p := testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
			require.Equal(t, 0, p.ExitCode(), p.Stderr())
			require.Equal(t, int64(300), liveRows(t, pool))

			_, err := pool.Exec(ctx, `DELETE FROM source_records WHERE id % 14 = 0`) // 150 rows
			require.NoError(t, err)
			b, err := batch.CountBehind(ctx, pool, s)
			require.NoError(t, err)
			require.Equal(t, int64(150), b.Gone, "CountBehind sees the deleted rows of an incremental job")
			before, ok, err := batch.ReadDeleteMarks(ctx, pool, s.Job)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, int64(150), before.Pending)

			p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease, failpoint.EnvVar+"="+tc.point), "run", "--spec", specFile)
			require.True(t, p.Killed(), "killed at %s; stderr:\n%s", tc.point, p.Stderr())
			require.Contains(t, p.Stderr(), "failpoint "+tc.point)
			m, _, err := batch.ReadDeleteMarks(ctx, pool, s.Job)
			require.NoError(t, err)
			if tc.committed {
				require.Len(t, deleteEvents(t, url), 150)
				require.Zero(t, m.Pending)
				require.Equal(t, int64(150), m.Tombstones)
			} else {
				require.Empty(t, deleteEvents(t, url), "nothing of the killed drain")
				require.Equal(t, before, m, "the marks did not move")
				require.Equal(t, int64(300), liveRows(t, pool))
			}

			p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
			require.Equal(t, 0, p.ExitCode(), p.Stderr())
			var want []string
			for id := 14; id <= 2100; id += 14 {
				want = append(want, fmt.Sprintf("%d@2", id))
			}
			require.Equal(t, want, deleteEvents(t, url), "one delete per deleted row")
			require.Equal(t, int64(150), liveRows(t, pool))
			m, _, err = batch.ReadDeleteMarks(ctx, pool, s.Job)
			require.NoError(t, err)
			require.Zero(t, m.Pending)
			require.Equal(t, int64(150), m.Tombstones)
			require.Equal(t, queryInt(t, pool, `SELECT last_value FROM batch_deletes_id_seq`), m.CaptureID, "the mark at the newest capture")
			b, err = batch.CountBehind(ctx, pool, s)
			require.NoError(t, err)
			require.Zero(t, b.Total())

			p = testproc.Run(t, time.Minute, bin, env(url), "status", "--job", s.Job)
			require.Equal(t, 0, p.ExitCode(), p.Stderr())
			require.Regexp(t, `JOB +TABLE +DELETES DRAINED TO +PENDING +TOMBSTONES`, p.Stdout())
			require.Regexp(t, fmt.Sprintf(`del-crash +public\.source_records +%d +0 +150 `, m.CaptureID), p.Stdout())
		})
	}
}

// A full run over a table with the capture: a row deleted and inserted
// again with its version reset between two runs (no sweep between them)
// comes back above the delete's tombstone. Without the capture the run
// refused the old version and the sweep found the row there: the index
// kept the deleted row's document.
func TestFullRunReinsertWithAResetVersionBetweenRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 3)
	s := vanishedSpec()
	_, err := pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	for i := range 4 { // version 5
		_, err := pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_build_object('title', 'edit ' || $1::int) WHERE id = 14`, i)
		require.NoError(t, err)
	}
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Equal(t, int64(5), queryInt(t, pool, `SELECT source_version FROM normalized_records WHERE source_id = '14'`))

	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id IN (14, 21)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO source_records (id, created_at, tenant_id, version, payload) VALUES (14, '2024-01-01', 't2', 1, '{"title": "back"}')`)
	require.NoError(t, err)
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '14' AND NOT deleted AND source_version = 7 AND document->>'title' = 'back'`),
		"14 back above its tombstone (version 6)")
	require.Equal(t, []string{"14@6", "21@2"}, deleteEvents(t, url))
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'upsert' AND aggregate_id = '14' AND aggregate_version = 7`))
	require.Equal(t, int64(299), liveRows(t, pool))
}

// A writer with no grant on batch_deletes deletes as before (the capture
// runs as the role that installed it), and its delete reaches the outbox.
func TestCaptureNeedsNoGrantForWriters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 30, 1, 3)
	s := deletingJob(t, pool, "del-grant")
	_, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)

	role := fmt.Sprintf("outboxrelay_writer_%d", time.Now().UnixNano())
	_, err = pool.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN; GRANT SELECT, DELETE ON source_records TO `+role)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), `REVOKE ALL ON source_records FROM `+role+`; DROP ROLE `+role)
		require.NoError(t, err)
	})
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, `SET LOCAL ROLE `+role)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SET LOCAL search_path = pg_catalog`) // the writer's own path does not matter
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `DELETE FROM public.source_records WHERE id = 14`)
	require.NoError(t, err, "a writer without a grant on batch_deletes")
	require.NoError(t, tx.Commit(ctx))

	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Equal(t, []string{"14@2"}, deleteEvents(t, url))
}

// On a table that only vanished: keep jobs read, captures do not pile up:
// a run deletes those older than an hour and leaves the newer ones.
func TestKeepJobPurgesUnreadCaptures(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 30, 1, 1)
	s := incremental("keep-purge")
	_, err := pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id IN (7, 14)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE batch_deletes SET captured_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id = 21`)
	require.NoError(t, err)
	require.Equal(t, int64(3), queryInt(t, pool, `SELECT count(*) FROM batch_deletes`))
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_deletes WHERE source_id = '21'`))
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_deletes`))
}

// A soft-deleted row (its tombstone already indexed) that is then
// hard-deleted, or truncated, and inserted again with its version reset
// comes back live above that tombstone, in the next incremental run.
// Found by e2e's TestRandomFollow: the drain tombstoned only live rows, so
// the soft-deleted row's normalized row was left as it was (not vanished)
// and the run refused the re-inserted row's version 1 below it for good.
func TestReinsertAfterSoftAndHardDeleteComesBack(t *testing.T) {
	t.Parallel()
	for name, how := range map[string]string{"delete": "DELETE FROM source_records WHERE id = 7", "truncate": "TRUNCATE source_records"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			_, pool := newDB(t)
			seed(t, pool, 1, 300, 1, 3)
			s := deletingJob(t, pool, "del-soft-reinsert")
			_, err := run(t, pool, s, batch.Config{})
			require.NoError(t, err)
			for _, sql := range []string{
				`UPDATE source_records SET payload = jsonb_build_object('title', 'edit') WHERE id = 7`, // version 2
				`UPDATE source_records SET deleted_at = now() WHERE id = 7`,                            // version 3, soft-deleted
			} {
				_, err := pool.Exec(ctx, sql)
				require.NoError(t, err)
			}
			_, err = run(t, pool, s, batch.Config{})
			require.NoError(t, err)
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '7' AND deleted AND source_version = 3`), "the soft delete's tombstone")

			_, err = pool.Exec(ctx, how)
			require.NoError(t, err)
			_, err = pool.Exec(ctx, `INSERT INTO source_records (id, tenant_id, version, payload) VALUES (7, 't1', 1, '{"title": "back"}')`)
			require.NoError(t, err)
			_, err = run(t, pool, s, batch.Config{})
			require.NoError(t, err)
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '7' AND NOT deleted AND document->>'title' = 'back' AND source_version > 3`),
				"7 back, above its soft delete's tombstone (version 3)")
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE event_type = 'upsert' AND aggregate_id = '7' AND aggregate_version > 3`))
		})
	}
}

// A quarantine retry that reprocesses a row while the row is deleted and a
// run drains that delete must not bring the row back after the drain: the
// retry holds the job lock, so the drain waits for it and then tombstones
// what it wrote. Without the lock the drain found no normalized row of the
// quarantined id, moved its mark past the capture, and the retry then
// wrote the deleted row live for good.
func TestQuarantineRetryDuringADrainLeavesTheDeleteStanding(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 3)
	_, err := pool.Exec(ctx, `UPDATE source_records SET payload = '[1,2]' WHERE id = 14`)
	require.NoError(t, err)
	s := deletingJob(t, pool, "retry-drain", func(s *batch.Spec) { s.Errors.Policy = batch.PolicyQuarantine })
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Equal(t, int64(299), liveRows(t, pool))
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = '{"title": "fixed"}' WHERE id = 14`)
	require.NoError(t, err)

	processing, release := make(chan struct{}), make(chan struct{})
	proc := batch.ProcessorFunc(func(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
		out := make([]batch.Result, len(rows))
		for i, r := range rows {
			if r.ID == "14" {
				close(processing)
				<-release
			}
			out[i] = batch.Result{Document: json.RawMessage(`{"title":"fixed"}`)}
		}
		return out, nil
	})
	retried := make(chan error, 1)
	go func() {
		_, err := batch.RetryQuarantine(ctx, pool, s, proc, batch.RetryOptions{})
		retried <- err
	}()
	<-processing
	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id = 14`)
	require.NoError(t, err)
	ran := make(chan error, 1)
	go func() {
		r, err := batch.NewRunner(pool, s, batch.Config{})
		if err == nil {
			_, err = r.Run(ctx, ctx)
		}
		ran <- err
	}()
	// The run either waits for the retry's job lock or (without it) is
	// done draining already.
	var runErr error
	runDone := false
	waitFor(t, time.Minute, "the run to wait for the job lock or end", func() bool {
		select {
		case runErr = <-ran:
			runDone = true
			return true
		default:
		}
		return queryInt(t, pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`) > 0
	})
	close(release)
	require.NoError(t, <-retried)
	if !runDone {
		runErr = <-ran
	}
	require.NoError(t, runErr)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id = '14' AND NOT deleted`), "the deleted row is live again")
	require.Equal(t, int64(299), liveRows(t, pool))
}
