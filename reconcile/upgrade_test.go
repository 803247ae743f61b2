package reconcile_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// An existing deployment upgrades: its live index holds documents indexed
// before processor versions existed (no _pv, no _aggregate_type). The job
// is rebuilt at v2, and rows are deleted during the rebuild: v2 holds their
// tombstones, v1 still the old documents. Those are deleted rows, not
// application documents the cutover would hide: the cutover goes ahead
// without --allow-unversioned, and searches find exactly the live rows.
func TestUpgradeIsNotBlockedByDeletesDuringTheRebuild(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testUpgradeIsNotBlockedByDeletesDuringTheRebuild)
}

func testUpgradeIsNotBlockedByDeletesDuringTheRebuild(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	cfg := sink.Config{URL: engineURL, Alias: stack.UniqueName("upgrade")}.WithDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })
	live, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, client, next, cfg.Mapping, map[string]any{next + "-write": map[string]any{"is_write_index": true}}))

	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('j', '{"job":"j","processor_version":"v2","source_name":"src","aggregate_type":"src"}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('j', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	// Rows 1-40 are live at v2; 41-50 were deleted during the rebuild.
	const n, deleted = 50, 10
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, CASE WHEN g > $1 THEN NULL ELSE '{}'::jsonb END, CASE WHEN g > $1 THEN 2 ELSE 1 END, 'v2', g > $1 FROM generate_series(1, $2) g`, n-deleted, n)
	require.NoError(t, err)
	old, nb := client.Bulk().Index(live), client.Bulk().Index(next)
	for g := 1; g <= n; g++ {
		id := strconv.Itoa(g)
		// As indexed before this version: no _pv, no _aggregate_type.
		old.Add(elastic.NewBulkIndexRequest().Id(id).Version(1).VersionType("external").
			Doc(map[string]any{"title": "old " + id, sink.FieldBucket: sink.Bucket(id), sink.FieldIDV: sink.IDV(id, 1, false, "")}))
		if g > n-deleted {
			nb.Add(indexDocOf("src", id, 2, true, "v2"))
		} else {
			nb.Add(indexDocOf("src", id, 1, false, "v2"))
		}
	}
	for _, b := range []*elastic.BulkService{old, nb} {
		res, err := b.Refresh("true").Do(ctx)
		require.NoError(t, err)
		require.False(t, res.Errors, "%+v", res.Failed())
	}

	res, err := reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j"})
	require.NoError(t, err, "deleted rows are no hidden application documents")
	require.Zero(t, res.Unversioned)
	require.Equal(t, []string{live}, res.From)
	hits, err := client.Search(cfg.Alias).Size(100).Do(ctx)
	require.NoError(t, err)
	found := map[string]bool{}
	for _, h := range hits.Hits.Hits {
		found[h.Id] = true
	}
	require.Len(t, found, n-deleted, "searches find the live rows only")
	for g := 1; g <= n-deleted; g++ {
		require.True(t, found[strconv.Itoa(g)], "row %d", g)
	}
}
