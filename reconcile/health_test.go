package reconcile_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// The new generation asks for a replica that a one-node cluster cannot
// allocate, while the generation searches read now has all its copies
// (green). The cutover waits for the replica up to its health timeout and
// then refuses, saying what is unallocated; the aliases stay. Once the
// replica count is lowered the cutover goes ahead.
func TestCutoverWaitsForTheGenerationsReplicas(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testCutoverWaitsForTheGenerationsReplicas)
}

func testCutoverWaitsForTheGenerationsReplicas(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	green := []byte(`{"settings":{"index":{"number_of_shards":1,"number_of_replicas":0}}}`)
	cfg := sink.Config{URL: engineURL, Alias: stack.UniqueName("cut-health"), Mapping: green}.WithDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })
	live, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, client, next, []byte(`{"settings":{"index":{"number_of_shards":1,"number_of_replicas":1}}}`),
		map[string]any{next + "-write": map[string]any{"is_write_index": true}}))

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

	const timeout = 3 * time.Second
	start := time.Now()
	_, err = reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j", HealthTimeout: timeout})
	require.True(t, errors.Is(err, index.ErrUnsafeMove) && errors.Is(err, index.ErrNotHealthy), "cutover onto unallocated replicas: %v", err)
	require.GreaterOrEqual(t, time.Since(start), timeout, "it waited for the replicas")
	require.ErrorContains(t, err, "generation "+next+" is yellow, not green")
	require.ErrorContains(t, err, "1 unassigned")
	read, err := index.AliasTargets(ctx, client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{live}, read, "the read alias did not move")

	_, err = client.IndexPutSettings(next).BodyString(`{"index":{"number_of_replicas":0}}`).Do(ctx)
	require.NoError(t, err)
	out, err := reconcile.Cutover(ctx, cfg, reconcile.CutoverOptions{DB: pool, Job: "j", HealthTimeout: timeout})
	require.NoError(t, err)
	require.Equal(t, []string{live}, out.From)
	read, err = index.AliasTargets(ctx, client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{next}, read)
}
