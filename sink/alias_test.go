package sink

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// After a reindex to _v2, a write alias that went missing is not
// "repaired" onto _v1 (the read alias would then span two generations and
// writes would go to the old one): the indexer refuses to start and names
// both aliases and the fix.
func TestIndexerRefusesReadAliasWithoutWriteAlias(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 1)
	ctx := context.Background()
	_, err := index.Ensure(ctx, f.client, f.cfg.Alias, f.cfg.Alias+"-write", f.cfg.Mapping)
	require.NoError(t, err)
	v2 := f.cfg.Alias + "_v2"
	_, err = Reindex(ctx, f.cfg.withDefaults(), ReindexOptions{Into: v2, Settle: time.Millisecond})
	require.NoError(t, err)
	_, err = f.client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodDelete, Path: "/" + v2 + "/_alias/" + f.cfg.Alias + "-write",
	})
	require.NoError(t, err)

	ix, err := New(f.cfg)
	require.NoError(t, err)
	runCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err = ix.Run(runCtx)
	require.Error(t, err)
	require.NoError(t, runCtx.Err(), "refused at once, not retried: %v", err)
	require.ErrorIs(t, err, index.ErrWriteAliasMissing)
	for _, want := range []string{f.cfg.Alias, f.cfg.Alias + "-write", v2, "_aliases"} {
		require.Contains(t, err.Error(), want)
	}
	read, err := index.AliasTargets(ctx, f.client, f.cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{v2}, read, "the read alias still reads one generation")
	write, err := index.AliasTargets(ctx, f.client, f.cfg.Alias+"-write")
	require.NoError(t, err)
	require.Empty(t, write)
}
