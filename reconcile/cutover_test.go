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

// A deployment that also enqueues its own events (outbox.Enqueue, no
// processor version) into the alias: during a rebuild those go to the live
// generation only. A cutover that moved the aliases anyway would hide them
// from every search, so it is refused, naming them, until the operator
// allows it.
func TestCutoverRefusesToHideDocumentsWithoutProcessorVersion(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testCutoverRefusesToHideDocumentsWithoutProcessorVersion)
}

func testCutoverRefusesToHideDocumentsWithoutProcessorVersion(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	cfg := sink.Config{URL: engineURL, Alias: stack.UniqueName("cut-app")}.WithDefaults()

	// The live generation (v1), as the indexer creates it, and the v2 one
	// built beside it.
	live, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, client, next, cfg.Mapping, map[string]any{next + "-write": map[string]any{"is_write_index": true}}))

	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('j', '{"job":"j","processor_version":"v2","source_name":"src"}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('j', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	const n = 50
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, jsonb_build_object('title', 'DOC ' || g), 1, 'v2', false FROM generate_series(1, $1) g`, n)
	require.NoError(t, err)
	oldDocs, newDocs := client.Bulk().Index(live), client.Bulk().Index(next)
	for g := 1; g <= n; g++ {
		oldDocs.Add(indexDocPV(strconv.Itoa(g), 1, false, "v1"))
		newDocs.Add(indexDocPV(strconv.Itoa(g), 1, false, "v2"))
	}
	// The application's own document: no _pv, written through the write
	// alias, so into the live generation only.
	oldDocs.Add(elastic.NewBulkIndexRequest().Id("order-1").Version(3).VersionType("external").
		Doc(map[string]any{"title": "order 1", sink.FieldBucket: sink.Bucket("order-1"), sink.FieldIDV: sink.IDV("order-1", 3, false, "")}))
	for _, b := range []*elastic.BulkService{oldDocs, newDocs} {
		res, err := b.Refresh("true").Do(ctx)
		require.NoError(t, err)
		require.False(t, res.Errors, "%+v", res.Failed())
	}

	_, err = reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j"})
	require.True(t, errors.Is(err, index.ErrUnsafeMove), "cutover must be refused: %v", err)
	require.ErrorContains(t, err, "without a processor version")
	read, err := index.AliasTargets(ctx, client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{live}, read, "the read alias did not move")
	hits, err := client.Search(cfg.Alias).Query(elastic.NewIdsQuery().Ids("order-1")).Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, hits.TotalHits(), "the application's document is still found")

	// Allowed explicitly, the cutover goes ahead.
	res, err := reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j", AllowUnversioned: true})
	require.NoError(t, err)
	require.Equal(t, []string{live}, res.From)
	read, err = index.AliasTargets(ctx, client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{next}, read)
}

// A job whose aggregate type ROUTES sends to another alias than ALIAS has
// its generations under that alias: the cutover checks and moves those.
func TestCutoverOfARoutedJobMovesItsOwnAlias(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testCutoverOfARoutedJobMovesItsOwnAlias)
}

func testCutoverOfARoutedJobMovesItsOwnAlias(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	orders := stack.UniqueName("cut-orders")
	cfg := sink.Config{URL: engineURL, Alias: stack.UniqueName("cut-main"), Routes: map[string]string{"orders": orders}}.WithDefaults()
	live, err := index.Ensure(ctx, client, orders, orders+"-write", cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(orders, "v2")
	require.NoError(t, index.Create(ctx, client, next, cfg.Mapping, map[string]any{next + "-write": map[string]any{"is_write_index": true}}))
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('o', '{"job":"o","processor_version":"v2","source_name":"orders","aggregate_type":"orders"}')`)
	require.NoError(t, err)
	// A job that is not routed writes the main alias, not this one: the
	// move of orders is whole, write alias included.
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('r', '{"job":"r","processor_version":"v1","source_name":"records","aggregate_type":"records"}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('o', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'orders', g::text, jsonb_build_object('title', 'DOC ' || g), 1, 'v2', false FROM generate_series(1, 20) g`)
	require.NoError(t, err)
	b := client.Bulk().Index(next)
	for g := 1; g <= 20; g++ {
		b.Add(indexDocOf("orders", strconv.Itoa(g), 1, false, "v2"))
	}
	res, err := b.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)

	out, err := reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "o"})
	require.NoError(t, err)
	require.Equal(t, next, out.Index)
	require.Equal(t, []string{live}, out.From)
	read, err := index.AliasTargets(ctx, client, orders)
	require.NoError(t, err)
	require.Equal(t, []string{next}, read, "the routed alias reads the new generation")
	writes, err := index.AliasTargets(ctx, client, orders+"-write")
	require.NoError(t, err)
	require.Equal(t, []string{next}, writes, "and writes it")
}

// Two jobs write documents of one aggregate type into one alias (two
// tables, or two filters of one table). A cutover moves the type: the
// other job's documents would move with it into a generation its runs do
// not write (they go on writing the old one, which searches no longer
// read). So the cutover is refused, naming the other job, until that job
// runs at the same processor version.
func TestCutoverRefusesWhileAnotherJobOfTheTypeIsAtAnotherVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	engineURL := stack.ElasticsearchURL(t)
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	cfg := sink.Config{URL: engineURL, Alias: stack.UniqueName("cut-shared")}.WithDefaults()
	live, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, client, next, cfg.Mapping, map[string]any{next + "-write": map[string]any{"is_write_index": true}}))
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES
  ('j', '{"job":"j","processor_version":"v2","source_name":"src","aggregate_type":"t"}'),
  ('k', '{"job":"k","processor_version":"v1","source_name":"src2","aggregate_type":"t"}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('j', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, jsonb_build_object('title', 'DOC ' || g), 1, 'v2', false FROM generate_series(1, 20) g`)
	require.NoError(t, err)
	oldDocs, newDocs := client.Bulk().Index(live), client.Bulk().Index(next)
	for g := 1; g <= 20; g++ {
		oldDocs.Add(indexDocOf("t", strconv.Itoa(g), 1, false, "v1"))
		newDocs.Add(indexDocOf("t", strconv.Itoa(g), 1, false, "v2"))
		oldDocs.Add(indexDocOf("t", "k-"+strconv.Itoa(g), 1, false, "v1")) // job k's
	}
	for _, b := range []*elastic.BulkService{oldDocs, newDocs} {
		res, err := b.Refresh("true").Do(ctx)
		require.NoError(t, err)
		require.False(t, res.Errors, "%+v", res.Failed())
	}

	_, err = reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j"})
	require.ErrorIs(t, err, index.ErrUnsafeMove)
	require.ErrorContains(t, err, "job k")
	read, err := index.AliasTargets(ctx, client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{live}, read, "the read alias did not move")
}
