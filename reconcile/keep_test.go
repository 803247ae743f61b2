package reconcile_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// indexAt writes the normalized rows at processor version pv into index,
// as the indexer does with the events of that version.
func (f *rebuildFixture) indexAt(t *testing.T, index, pv string) {
	t.Helper()
	ctx := context.Background()
	rows, err := f.pool.Query(ctx, `SELECT source_id, source_version, deleted FROM normalized_records WHERE source = $1 AND processor_version = $2`, f.spec.Source.Table, pv)
	require.NoError(t, err)
	type row struct {
		ID      string
		Version int64
		Deleted bool
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	require.NotEmpty(t, all)
	bulk := f.client.Bulk().Index(index).Refresh("true")
	for _, r := range all {
		bulk.Add(indexDocOf(f.spec.Source.Table, r.ID, r.Version, r.Deleted, pv))
	}
	res, err := bulk.Do(ctx)
	require.NoError(t, err)
	for _, item := range res.Failed() {
		require.Equal(t, http.StatusConflict, item.Status, "%+v", item.Error)
	}
}

// An incremental job keeps vanished rows (vanished: keep, its default):
// rows deleted from the table stay in normalized_records, and their
// documents in the index, at the version that last read them. No run at a
// new version reads them again, so they never reach it. The cutover counts
// them as kept, not as rows still to rebuild, and carries their documents
// into the new generation: searches find every row the job holds, before
// and after.
func TestCutoverOfAnIncrementalKeepJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 200)
	f.spec.Mode = batch.ModeIncremental
	f.spec.Source.Cursor = []string{"change_seq"}
	f.spec.ProcessorVersion = "v1"
	f.run(t)
	f.indexAt(t, f.live, "v1")
	require.EqualValues(t, 5, f.exec(t, `DELETE FROM source_records WHERE id IN (SELECT id FROM source_records ORDER BY id LIMIT 5)`))

	// The rebuild at v2 (an incremental job's first run at a version reads
	// its whole scope).
	f.spec.ProcessorVersion = "v2"
	f.run(t)
	f.indexAt(t, f.next, "v2")
	var live, kept int64
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE NOT deleted), count(*) FILTER (WHERE processor_version = 'v1') FROM normalized_records WHERE source = $1`,
		f.spec.Source.Table).Scan(&live, &kept))
	require.EqualValues(t, 5, kept, "the deleted rows are kept at v1")
	require.Equal(t, live, f.searchCount(t), "before the cutover every kept row is found")

	res, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: f.spec.Job})
	require.NoError(t, err)
	require.EqualValues(t, 5, res.Kept)
	require.Zero(t, res.RowsOtherPV)
	require.Equal(t, []string{f.next}, f.readAlias(t))
	require.Equal(t, live, f.searchCount(t), "after the cutover too")
}

func (f *rebuildFixture) searchCount(t *testing.T) int64 {
	t.Helper()
	n, err := f.client.Count(f.cfg.Alias).Do(context.Background())
	require.NoError(t, err)
	return n
}
