package sink

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

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
	client, err := NewClient(es)
	require.NoError(t, err)
	cfg := Config{URL: es, Alias: stack.UniqueName("rb")}.withDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })

	v1, err := createGeneration(ctx, client, cfg.Alias, "v1", cfg.Mapping, nil)
	require.NoError(t, err)
	_, err = MoveAliases(ctx, cfg, v1)
	require.NoError(t, err)
	v2, err := createGeneration(ctx, client, cfg.Alias, "v2", cfg.Mapping, nil)
	require.NoError(t, err)
	_, err = MoveAliases(ctx, cfg, v2)
	require.NoError(t, err)

	// A rollback to the generation the cutover left works (and forward again).
	from, into, err := Rollback(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, [2]string{v2, v1}, [2]string{from, into})
	_, into, err = Rollback(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, v2, into)

	require.NoError(t, DropGeneration(ctx, cfg, v1))
	_, err = createGeneration(ctx, client, cfg.Alias, "v1", cfg.Mapping, nil) // the router, on a replayed v1 event
	require.NoError(t, err)

	_, _, err = Rollback(ctx, cfg)
	require.ErrorIs(t, err, ErrUnsafeMove)
	require.ErrorContains(t, err, "created again")
	read, err := AliasTargets(ctx, client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{v2}, read, "the read alias did not move")
}
