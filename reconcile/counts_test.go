package reconcile_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// The index catches up between the bucket summaries and the id-by-id read
// of the buckets that differed (the indexer still writing, a refresh in
// between): the report is clean, and its counts are those of the read, not
// the summaries' — a clean report never says the index holds fewer
// documents than the source.
func TestReportCountsWhatTheDrillDownRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 300)
	f.run(t)
	f.index(t)
	const late = 40
	f.exec(t, `INSERT INTO source_records (id, tenant_id, payload)
SELECT 900000 + g, 'tenant-1', jsonb_build_object('title', 'late ' || g) FROM generate_series(1, 40) g`)
	f.run(t) // normalized_records and the scope hold the late rows; the index does not yet
	var normalized, live int64
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE NOT deleted) FROM normalized_records WHERE source = 'source_records'`).Scan(&normalized, &live))

	caughtUp := 0
	cfg := reconcile.WithAfterSummaries(reconcile.Config{DB: f.pool, Search: f.client, Index: f.next, Topic: "records-topic"}, func() {
		f.index(t)
		caughtUp++
	})

	rep, err := reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, 1, caughtUp)
	require.NotEmpty(t, rep.DifferingBuckets, "the summaries saw the late rows missing")
	require.True(t, rep.Clean(), "%+v", rep)
	require.EqualValues(t, normalized, rep.SourceRows)
	require.EqualValues(t, normalized, rep.IndexDocs, "index documents counted before the index caught up")

	// The same for the comparison with the source table; the index is
	// behind again by the next late rows.
	f.exec(t, `INSERT INTO source_records (id, tenant_id, payload)
SELECT 910000 + g, 'tenant-2', jsonb_build_object('title', 'later ' || g) FROM generate_series(1, 40) g`)
	f.run(t)
	live += late
	spec, err := batch.LoadJobSpec(ctx, f.pool, f.spec.Job)
	require.NoError(t, err)
	src, err := reconcile.RunSourceTable(ctx, cfg, spec)
	require.NoError(t, err)
	require.Equal(t, 2, caughtUp)
	require.NotEmpty(t, src.DifferingBuckets, "the summaries saw the later rows missing")
	require.True(t, src.Clean(), "%+v", src)
	require.EqualValues(t, live, src.SourceRows)
	require.EqualValues(t, live, src.IndexDocs, "index documents counted before the index caught up")
}
