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

// An application enqueues an event (no processor version) after the
// cutover counted the documents it would hide and before the aliases move:
// the indexer writes it through the write alias into the generation being
// left. The cutover copies it into the new generation after the move, so
// searches find it.
func TestCutoverKeepsADocumentWrittenBetweenTheCheckAndTheMove(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testCutoverKeepsADocumentWrittenBetweenTheCheckAndTheMove)
}

func testCutoverKeepsADocumentWrittenBetweenTheCheckAndTheMove(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	cfg := sink.Config{URL: engineURL, Alias: stack.UniqueName("cut-window")}.WithDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })
	live, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, client, next, cfg.Mapping, map[string]any{next + "-write": map[string]any{"is_write_index": true}}))
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('j', '{"job":"j","processor_version":"v2","source_name":"src","aggregate_type":"src"}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('j', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, '{}'::jsonb, 1, 'v2', false FROM generate_series(1, 10) g`)
	require.NoError(t, err)
	b := client.Bulk().Index(next)
	for g := 1; g <= 10; g++ {
		b.Add(indexDocPV(strconv.Itoa(g), 1, false, "v2"))
	}
	res, err := b.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)

	opts := reconcile.WithBeforeMove(reconcile.CutoverOptions{DB: pool, Job: "j"}, func() {
		// As the indexer writes an application event: through the write
		// alias, no _pv, not refreshed.
		_, err := client.Index().Index(cfg.WriteAlias).Id("order-1").Version(3).VersionType("external").
			BodyJson(map[string]any{"title": "order 1", sink.FieldAggregateType: "orders", sink.FieldBucket: sink.Bucket("order-1"), sink.FieldIDV: sink.IDV("order-1", 3, false, "")}).Do(ctx)
		require.NoError(t, err)
	})
	out, err := reconcile.Cutover(ctx, cfg, opts)
	require.NoError(t, err)
	require.Equal(t, []string{live}, out.From)
	require.NoError(t, index.Refresh(ctx, client, next))
	hits, err := client.Search(cfg.Alias).Query(elastic.NewIdsQuery().Ids("order-1")).Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, hits.TotalHits(), "the document written during the move is found")
	require.EqualValues(t, 1, out.Copied)
}
