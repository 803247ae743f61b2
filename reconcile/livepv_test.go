package reconcile_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// runAt runs the fixture's job once at processor version pv.
func (f *rebuildFixture) runAt(t *testing.T, pv string, opts batch.StartOptions) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := f.spec
	s.ProcessorVersion = pv
	r, err := batch.NewRunner(f.pool, s, batch.Config{Workers: 1, StartOptions: opts})
	require.NoError(t, err)
	_, err = r.Run(ctx, ctx)
	return err
}

// indexInto writes every normalized row into index at its version, as
// the indexer would route it.
func (f *rebuildFixture) indexInto(t *testing.T, index string) {
	t.Helper()
	ctx := context.Background()
	rows, err := f.pool.Query(ctx, `SELECT source_id, source_version, deleted, processor_version FROM normalized_records WHERE source = $1`, f.spec.Source.Table)
	require.NoError(t, err)
	type row struct {
		ID      string
		Version int64
		Deleted bool
		PV      string
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	bulk := f.client.Bulk().Index(index).Refresh("true")
	for _, r := range all {
		bulk.Add(indexDocOf(f.spec.Source.Table, r.ID, r.Version, r.Deleted, r.PV))
	}
	res, err := bulk.Do(ctx)
	require.NoError(t, err)
	for _, item := range res.Failed() {
		require.Equal(t, http.StatusConflict, item.Status, "%+v", item.Error)
	}
}

func liveVersion(t *testing.T, f *rebuildFixture) string {
	t.Helper()
	v, err := batch.LoadLiveVersion(context.Background(), f.pool, f.spec.Job)
	require.NoError(t, err)
	return v.ProcessorVersion
}

// The live processor version follows the aliases (issue 27, item 2): a
// job's first run makes v1 live, indexer cutover records v2, and a
// declared rebuild of v1 afterwards (its generation is the bootstrap
// index, which records no cutover in its _meta) is never moved live again
// by the automatic cutover: v1 was live before. A rollback records v1 as
// live, and the v2 schedule is refused then.
func TestLiveVersionFollowsCutoverAndRollback(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 200)
	require.NoError(t, f.runAt(t, "v1", batch.StartOptions{}))
	f.indexInto(t, f.live)
	require.Equal(t, "v1", liveVersion(t, f), "the first run's version is live")
	require.NoError(t, f.runAt(t, "v2", batch.StartOptions{}))
	f.indexInto(t, f.next)
	res, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: f.spec.Job})
	require.NoError(t, err)
	require.Equal(t, f.next, res.Index)
	require.Equal(t, "v2", liveVersion(t, f), "indexer cutover records the live version")
	require.ErrorIs(t, f.runAt(t, "v1", batch.StartOptions{}), batch.ErrNotLive, "the old schedule after the cutover")

	// A declared rebuild of v1: its generation (the bootstrap index, no
	// cutover in its _meta) is complete again and not live.
	require.NoError(t, f.runAt(t, "v1", batch.StartOptions{Rebuild: true}))
	f.indexInto(t, f.live)
	var logs logBuffer
	startAutoCutover(t, f, &logs)
	require.Eventually(t, func() bool { return logs.count("rolled back from; left to the operator") > 0 }, time.Minute, 20*time.Millisecond, logs.String())
	require.Equal(t, []string{f.next}, f.readAlias(t), "the automatic cutover never moves back to a generation live before")
	require.Zero(t, logs.count("the read alias moved"), logs.String())
	require.Equal(t, "v2", liveVersion(t, f))

	// The operator rolls back: v1 is live, and recorded so.
	rb, err := reconcile.Rollback(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: f.spec.Job})
	require.NoError(t, err)
	require.Equal(t, f.live, rb.Index)
	require.Equal(t, "v1", liveVersion(t, f))
	require.ErrorIs(t, f.runAt(t, "v2", batch.StartOptions{}), batch.ErrNotLive, "the new schedule after the rollback")
	require.NoError(t, f.runAt(t, "v1", batch.StartOptions{}))

	var moves []string
	rows, err := f.pool.Query(ctx, `SELECT coalesce(from_version, '-') || '>' || to_version || ' ' || how FROM batch_live_version_moves WHERE job = $1 ORDER BY id`, f.spec.Job)
	require.NoError(t, err)
	moves, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"->v1 first run", "v1>v2 cutover", "v2>v1 rollback"}, moves)
}

// An upgraded deployment (issue 27, item 2): migration 016 registered v1,
// the version the job ran at before it, with nothing live. The first run
// after it is already the v2 rebuild, which records nothing live; the
// cutover then records v2 live and v1, the version the documents left, as
// having been live: the old schedule at v1 is refused afterwards.
func TestCutoverAfterTheMigrationRecordsTheVersionLeft(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 200)
	require.NoError(t, f.runAt(t, "v1", batch.StartOptions{}))
	f.indexInto(t, f.live)
	// As the migration leaves a job that ran before it.
	_, err := f.pool.Exec(ctx, `DELETE FROM batch_live_version_moves WHERE job = $1`, f.spec.Job)
	require.NoError(t, err)
	_, err = f.pool.Exec(ctx, `UPDATE batch_processor_versions SET live = false, first_live_at = NULL, live_since = NULL WHERE job = $1`, f.spec.Job)
	require.NoError(t, err)

	require.NoError(t, f.runAt(t, "v2", batch.StartOptions{}))
	_, err = batch.LoadLiveVersion(ctx, f.pool, f.spec.Job)
	require.ErrorIs(t, err, batch.ErrNotFound, "a rebuild after the migration records nothing live")
	f.indexInto(t, f.next)
	res, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: f.spec.Job})
	require.NoError(t, err)
	require.Equal(t, f.next, res.Index)
	require.Equal(t, "v2", liveVersion(t, f))
	require.ErrorIs(t, f.runAt(t, "v1", batch.StartOptions{}), batch.ErrNotLive, "the old schedule after the cutover")
}
