package e2e

import (
	"context"
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
	total := batched + s.Matching // the oracle's check after it is not throughput

	const bad = rows / badEvery
	require.EqualValues(t, rows-bad, s.Report.SourceRows)
	require.EqualValues(t, rows-bad, s.Report.IndexDocs)
	require.Zero(t, s.Report.DocsRead, "a clean index is compared by bucket summaries only")

	// The verdict of waitSettled's oracle: every document through the
	// read alias, content and version, equals the source.
	require.EqualValues(t, rows-bad, s.Index.Live)
	require.Zero(t, s.Index.Tombstones)

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

	report(t, "%d rows (%d quarantined): batcher done after %s (%.0f rows/s), outbox drained after %s, consumer caught up after %s, index matched after %s (%.0f docs/s end to end); %d records on the topic, %d duplicate ce_id; the oracle scrolled and compared all %d documents in %s",
		rows, bad, batched.Round(time.Millisecond), float64(rows)/batched.Seconds(),
		(batched + s.Drained).Round(time.Millisecond), (batched + s.Caught).Round(time.Millisecond), total.Round(time.Millisecond),
		float64(rows-bad)/total.Seconds(), records, dups, s.Index.Live, s.Index.Took.Round(time.Millisecond))
}
