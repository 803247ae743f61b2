package sink

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// A generation dropped after the cutover and created again by an indexer
// that received a replayed event of its version holds only that event. A
// rollback to it would empty every search, so it is refused.
func TestRollbackRefusesAGenerationRecreatedAfterTheCutover(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testRollbackRefusesAGenerationRecreatedAfterTheCutover)
}

func testRollbackRefusesAGenerationRecreatedAfterTheCutover(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	es := engineURL
	client, err := index.NewClient(es)
	require.NoError(t, err)
	cfg := Config{URL: es, Alias: stack.UniqueName("rb")}.withDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })

	v1, err := index.CreateGeneration(ctx, client, cfg.Alias, "v1", cfg.Mapping, nil, false)
	require.NoError(t, err)
	_, err = index.MoveAliases(ctx, client, cfg.Alias, cfg.WriteAlias, v1)
	require.NoError(t, err)
	v2, err := index.CreateGeneration(ctx, client, cfg.Alias, "v2", cfg.Mapping, nil, false)
	require.NoError(t, err)
	_, err = index.MoveAliases(ctx, client, cfg.Alias, cfg.WriteAlias, v2)
	require.NoError(t, err)

	// A rollback to the generation the cutover left works (and forward again).
	from, into, err := index.Rollback(ctx, client, cfg.Alias, cfg.WriteAlias)
	require.NoError(t, err)
	require.Equal(t, [2]string{v2, v1}, [2]string{from, into})
	_, into, err = index.Rollback(ctx, client, cfg.Alias, cfg.WriteAlias)
	require.NoError(t, err)
	require.Equal(t, v2, into)

	require.NoError(t, index.Drop(ctx, client, cfg.Alias, cfg.WriteAlias, v1))
	_, err = index.CreateGeneration(ctx, client, cfg.Alias, "v1", cfg.Mapping, nil, false) // the router, on a replayed v1 event
	require.NoError(t, err)

	_, _, err = index.Rollback(ctx, client, cfg.Alias, cfg.WriteAlias)
	require.ErrorIs(t, err, index.ErrUnsafeMove)
	require.ErrorContains(t, err, "created again")
	read, err := index.AliasTargets(ctx, client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{v2}, read, "the read alias did not move")
}
