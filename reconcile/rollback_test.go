package reconcile_test

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// After a cutover an application enqueues its own event (no processor
// version): it goes through the write alias into the new generation only.
// A rollback would hide it from searches, so it is refused, naming it, even
// with --force (which passes the readiness checks, not this one); with
// --allow-unversioned it goes ahead.
func TestRollbackRefusesToHideApplicationDocuments(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testRollbackRefusesToHideApplicationDocuments)
}

func testRollbackRefusesToHideApplicationDocuments(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	cfg := sink.Config{URL: engineURL, Alias: stack.UniqueName("rb-app")}.WithDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })
	live, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, client, next, cfg.Mapping, map[string]any{next + "-write": map[string]any{"is_write_index": true}}))
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('j', '{"job":"j","processor_version":"v2","source_name":"src","aggregate_type":"src"}')`)
	require.NoError(t, err)
	// The run at v1 that filled the bootstrap index (its generation name):
	// a rollback resolves its processor version from it.
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('j', 'r1', 'succeeded', 'v1', 'h', '{}'), ('j', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, '{}'::jsonb, 1, 'v2', false FROM generate_series(1, 10) g`)
	require.NoError(t, err)
	old, nb := client.Bulk().Index(live), client.Bulk().Index(next)
	for g := 1; g <= 10; g++ {
		old.Add(indexDocPV(strconv.Itoa(g), 1, false, "v1"))
		nb.Add(indexDocPV(strconv.Itoa(g), 1, false, "v2"))
	}
	for _, b := range []*elastic.BulkService{old, nb} {
		res, err := b.Refresh("true").Do(ctx)
		require.NoError(t, err)
		require.False(t, res.Errors)
	}
	_, err = reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j"})
	require.NoError(t, err)

	// The application's event, as the indexer writes it: through the write
	// alias (v2 now), no _pv.
	_, err = client.Index().Index(cfg.WriteAlias).Id("order-1").Version(3).VersionType("external").Refresh("true").
		BodyJson(map[string]any{"title": "order 1", sink.FieldAggregateType: "orders", sink.FieldBucket: sink.Bucket("order-1"), sink.FieldIDV: sink.IDV("order-1", 3, false, "")}).Do(ctx)
	require.NoError(t, err)
	found := func() int64 {
		hits, err := client.Search(cfg.Alias).Query(elastic.NewIdsQuery().Ids("order-1")).Do(ctx)
		require.NoError(t, err)
		return hits.TotalHits()
	}
	require.EqualValues(t, 1, found())

	_, err = reconcile.Rollback(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j", Force: true})
	require.True(t, errors.Is(err, index.ErrUnsafeMove), "rollback hiding an application document: %v", err)
	require.ErrorContains(t, err, "1 document(s) without a processor version")
	require.EqualValues(t, 1, found(), "still found")

	res, err := reconcile.Rollback(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j", Force: true, AllowUnversioned: true})
	require.NoError(t, err)
	require.Equal(t, live, res.Index)
	require.EqualValues(t, 1, res.Unversioned)
	require.Zero(t, found(), "accepted: searches no longer find it")
}
