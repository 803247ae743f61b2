package e2e

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/demo"
)

// The happy path: 200,000 source rows through batcher → publisher → indexer
// as three real processes; afterwards the index equals the source.
func TestPipelineHappyPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const rows, badEvery = 200_000, 10_000
	p := newPipeline(t, pipelineOptions{TopicPartitions: 6})
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows, BadEvery: badEvery}))

	pub := p.startPublisher("LOG_LEVEL=warn")
	ix := p.startIndexer("LOG_LEVEL=warn", "LANES=6", "BATCH_SIZE=2000")
	procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }

	start := time.Now()
	p.runBatcher(5 * time.Minute)
	batched := time.Since(start)
	s := p.waitSettled(ctx, 5*time.Minute, procs)
	total := time.Since(start)

	const bad = rows / badEvery
	require.EqualValues(t, rows-bad, s.Report.SourceRows)
	require.EqualValues(t, rows-bad, s.Report.IndexDocs)
	require.Zero(t, s.Report.DocsRead, "a clean index is compared by bucket summaries only")

	// Spot check: the documents of a sample of ids are the normalized
	// documents, as users get them through the read alias.
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	var ids []string
	for range 300 {
		g := 1 + rng.Int64N(rows)
		if g%badEvery == 0 {
			continue
		}
		ids = append(ids, itoa(g*3+g%2))
	}
	res, err := p.es.Mget().Realtime(true).Add(mgetItems(p.alias, ids)...).Do(ctx)
	require.NoError(t, err)
	require.Len(t, res.Docs, len(ids))
	for _, d := range res.Docs {
		require.Truef(t, d.Found, "id %s not found through %s", d.Id, p.alias)
		var want []byte
		require.NoError(t, p.pool.QueryRow(ctx, `SELECT document FROM normalized_records WHERE source = $1 AND source_id = $2`, sourceName, d.Id).Scan(&want))
		var wantDoc, got map[string]any
		require.NoError(t, json.Unmarshal(want, &wantDoc))
		require.NoError(t, json.Unmarshal(d.Source, &got))
		require.Equalf(t, wantDoc, userDoc(got), "id %s", d.Id)
	}

	// Counts through the read alias: live rows minus the quarantined ones.
	var live int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(*) FROM source_records WHERE deleted_at IS NULL`).Scan(&live))
	quarantined := p.quarantined(ctx)
	require.Len(t, quarantined, bad)
	require.Equal(t, p.badIDs(ctx), quarantined)
	require.Equal(t, live-int64(len(quarantined)), p.searchCount(ctx, nil))

	pubDL, ixDL := p.deadLetters(ctx)
	require.Zero(t, pubDL, "publisher dead letters")
	require.Zero(t, ixDL, "indexer dead letters")
	records, dups := p.topicStats(ctx)
	require.GreaterOrEqual(t, records, int64(rows-bad))

	report(t, "%d rows (%d quarantined): batcher done after %s (%.0f rows/s), outbox drained after %s, consumer caught up after %s, index matched after %s (%.0f docs/s end to end); %d records on the topic, %d duplicate ce_id",
		rows, bad, batched.Round(time.Millisecond), float64(rows)/batched.Seconds(),
		(batched + s.Drained).Round(time.Millisecond), (batched + s.Caught).Round(time.Millisecond), total.Round(time.Millisecond),
		float64(rows-bad)/total.Seconds(), records, dups)
}
