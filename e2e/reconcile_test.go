package e2e

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// After a clean pipeline run, documents are deleted and altered directly in
// the index, behind the pipeline's back. The real `indexer reconcile` finds
// them (exit 4, ids listed), `--repair` re-enqueues them while publisher and
// indexer keep running, and the pipeline puts the index right.
func TestReconcileFindsAndRepairsDriftBehindThePipelinesBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const rows = 20_000
	p := newPipeline(t, pipelineOptions{TopicPartitions: 3})
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
	pub := p.startPublisher("LOG_LEVEL=warn")
	ix := p.startIndexer("LOG_LEVEL=warn")
	procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }
	p.runBatcher(3 * time.Minute)
	p.waitSettled(ctx, 3*time.Minute, procs)

	targets, err := index.AliasTargets(ctx, p.es, p.alias+"-write")
	require.NoError(t, err)
	require.Len(t, targets, 1)
	index := targets[0]
	norm := p.readNormalized(ctx)
	ids := slices.Sorted(maps.Keys(norm))
	get := func(id string) indexDoc {
		res, err := p.es.Get().Index(index).Id(id).Realtime(true).Do(ctx)
		require.NoError(t, err)
		var src map[string]any
		require.NoError(t, json.Unmarshal(res.Source, &src))
		return indexDoc{Version: *res.Version, Source: src}
	}

	// Deleted by hand: missing.
	deleted := []string{ids[10], ids[500], ids[7000], ids[19_000]}
	for _, id := range deleted {
		_, err := p.es.Delete().Index(index).Id(id).Do(ctx)
		require.NoError(t, err)
	}
	// Rewritten by hand with the index API and no version: the engine bumps
	// its internal version, so the index is ahead of the source (stale).
	rewritten := []string{ids[20], ids[12_345]}
	for _, id := range rewritten {
		_, err := p.es.Index().Index(index).Id(id).BodyJson(map[string]any{"title": "edited by hand"}).Do(ctx)
		require.NoError(t, err)
	}
	// Changed body at the same version (version_type=external_gte), keeping
	// the reconcile fields. Reconcile compares (id, version, deleted), not
	// the content, so this drift is NOT detected, by design: it is not
	// asserted either way here.
	same := ids[30]
	doc := get(same)
	doc.Source["title"] = "same version, other body"
	_, err = p.es.Index().Index(index).Id(same).Version(doc.Version).VersionType("external_gte").BodyJson(doc.Source).Refresh("true").Do(ctx)
	require.NoError(t, err)

	// The real command reports the drift and exits 4.
	check := testproc.Run(t, 2*time.Minute, p.indexerBin, p.env(), "reconcile", "--json")
	require.Equal(t, cli.ExitDrift, check.ExitCode(), check.Stderr())
	var rep reconcile.Report
	require.NoError(t, json.Unmarshal([]byte(check.Stdout()), &rep), check.Stdout())
	driftIDs := func(ds []reconcile.Drift) []string {
		var out []string
		for _, d := range ds {
			out = append(out, d.ID)
		}
		return out
	}
	require.ElementsMatch(t, deleted, driftIDs(rep.Missing), "missing")
	require.ElementsMatch(t, rewritten, driftIDs(rep.Stale), "stale")
	require.Empty(t, rep.Extra, "extra")
	for _, d := range rep.Stale {
		require.True(t, d.IndexAhead(), "%+v: the hand-written version is ahead of the source", d)
	}
	require.EqualValues(t, rows, rep.SourceRows)
	require.Less(t, rep.DocsRead, int64(rows/10), "only the differing buckets are read id by id")

	// Repair: re-enqueued through the outbox; the running publisher and
	// indexer put the index right.
	fix := testproc.Run(t, 2*time.Minute, p.indexerBin, p.env(), "reconcile", "--repair", "--json")
	require.Equal(t, 0, fix.ExitCode(), fix.Stderr())
	var fixed struct {
		Repair reconcile.RepairResult `json:"repair"`
	}
	require.NoError(t, json.Unmarshal([]byte(fix.Stdout()), &fixed), fix.Stdout())
	require.EqualValues(t, len(deleted)+len(rewritten), fixed.Repair.Enqueued)
	require.Equal(t, len(rewritten), fixed.Repair.Removed, "index-ahead documents are removed so the repair event can land")

	// The wait is reconcile's; the verdict the oracle's: every document
	// equal to the source but the one changed at the same version, which
	// reconcile cannot see and so does not repair.
	p.settle(ctx, 3*time.Minute, procs)
	idx := p.checkIndex(ctx, p.expect)
	require.Equal(t, []string{same}, idx.IDs, "ids differing from the source after the repair: %s", idx)
	require.Contains(t, idx.String(), "content "+same+": ")
	require.Contains(t, idx.String(), "same version, other body")
	for _, id := range slices.Concat(deleted, rewritten) {
		d := get(id)
		require.Equalf(t, norm[id].Version, d.Version, "id %s: version after repair", id)
		require.Equalf(t, norm[id].Doc, userDoc(d.Source), "id %s: document after repair", id)
	}
	final := testproc.Run(t, 2*time.Minute, p.indexerBin, p.env(), "reconcile")
	require.Equal(t, 0, final.ExitCode(), final.Stderr())
	require.Contains(t, final.Stdout(), "no drift")
}
