package manifest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/manifest"
)

// A manifest job's events carry the live processor version of the scan
// job that indexes the same documents (same topic and aggregate type), so
// the indexer writes them into the generation searches read, and after a
// cutover into the new one (issue 27, item 9). A scan job of another topic
// does not count.
func TestManifestEventsCarryTheLiveProcessorVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(20), chunkSize: 10})
	f.register(t)
	_, err := f.pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES
  ('orders-search', jsonb_build_object('job', 'orders-search', 'processor_version', 'v1', 'topic', $1::text, 'source', jsonb_build_object('table', 'orders'))),
  ('orders-elsewhere', jsonb_build_object('job', 'orders-elsewhere', 'processor_version', 'v7', 'topic', 'another.topic', 'source', jsonb_build_object('table', 'orders')))`,
		manifest.DefaultTopic)
	require.NoError(t, err)
	_, err = batch.SetLiveVersion(ctx, f.pool, "orders-elsewhere", "v7", batch.MovedByCutover)
	require.NoError(t, err)
	_, err = batch.SetLiveVersion(ctx, f.pool, "orders-search", "v1", batch.MovedByCutover)
	require.NoError(t, err)
	headers := func() []string {
		t.Helper()
		rows, err := f.pool.Query(ctx, `SELECT coalesce(headers->>'ce_processorversion', '-') FROM outbox_event_members ORDER BY aggregate_id::bigint`)
		require.NoError(t, err)
		pvs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return pvs
	}

	_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 1})
	require.NoError(t, err)
	pvs := headers()
	require.Len(t, pvs, 10)
	for _, pv := range pvs {
		require.Equal(t, "v1", pv)
	}

	_, err = batch.SetLiveVersion(ctx, f.pool, "orders-search", "v2", batch.MovedByCutover)
	require.NoError(t, err)
	_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
	require.NoError(t, err)
	pvs = headers()
	require.Len(t, pvs, 20)
	for i, pv := range pvs {
		want := "v1"
		if i >= 10 {
			want = "v2"
		}
		require.Equal(t, want, pv, "event %d", i)
	}
}
