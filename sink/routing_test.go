package sink

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Documents go to their processor version's generation: on a fresh
// deployment the first version's generation becomes live (the aliases
// leave the empty bootstrap index), a later version builds beside it
// without reaching searches, and documents without a version go to the
// write alias. Two indexers create the generations at once.
func TestRoutingByProcessorVersion(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 3)
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(f.cfg.Alias + "_*").Do(context.Background()) })
	withPV := func(r rec, pv string) rec {
		r.headers = map[string]string{outbox.HeaderProcessorVersion: pv}
		return r
	}
	first, next := "2024.1", "2024.2/title upper"
	var recs []rec
	for i := range 60 {
		recs = append(recs, withPV(upsert(fmt.Sprintf("g-%02d", i), 1, docN(i)), first))
	}
	f.produce(recs...)
	f.start(f.cfg)
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)

	ctx := context.Background()
	live := index.GenerationIndex(f.cfg.Alias, first)
	for _, a := range []string{f.cfg.Alias, f.cfg.Alias + "-write", index.GenerationWriteAlias(live)} {
		targets, err := index.AliasTargets(ctx, f.client, a)
		require.NoError(t, err)
		require.Equal(t, []string{live}, targets, "alias %s", a)
	}
	require.Len(t, f.search(f.cfg.Alias), 60)

	recs = recs[:0]
	for i := range 60 {
		recs = append(recs, withPV(upsert(fmt.Sprintf("g-%02d", i), 1, docN(i+100)), next))
	}
	recs = append(recs, upsert("app-1", 1, docN(7))) // an application event: no processor version
	f.produce(recs...)
	f.waitCaughtUp(f.cfg.Group, time.Minute)

	building := index.GenerationIndex(f.cfg.Alias, next)
	_, err := f.client.Refresh(building, live).Do(ctx)
	require.NoError(t, err)
	n, err := f.client.Count(building).Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 60, n, "the new version's documents are in its own generation")
	seen := f.search(f.cfg.Alias)
	require.Len(t, seen, 61, "searches still read the live generation, plus the application event")
	require.Equal(t, "v1 "+docN(0), seen["g-00"], "the live generation keeps the first version's document")

	gens, err := index.Generations(ctx, f.client, f.cfg.Alias, f.cfg.Alias+"-write")
	require.NoError(t, err)
	byIndex := map[string]index.Generation{}
	for _, g := range gens {
		byIndex[g.Index] = g
	}
	require.True(t, byIndex[live].Live)
	require.Equal(t, first, byIndex[live].Meta.ProcessorVersion)
	require.False(t, byIndex[building].Live)
	require.Equal(t, next, byIndex[building].Meta.ProcessorVersion)
	require.Contains(t, byIndex, f.cfg.Alias+"_v1", "the bootstrap index is listed")
	require.EqualValues(t, 0, byIndex[f.cfg.Alias+"_v1"].Docs)
}
