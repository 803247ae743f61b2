package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/sink"
)

// indexer run with AUTO_CUTOVER: the v2 generation goes live without
// indexer cutover, but only once the catch-up run after the rebuild is
// indexed (rows changed after the rebuild read them).
func TestIndexerAutoCutover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newPipeline(t, pipelineOptions{TopicPartitions: 2})
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: 3000}))
	pub := p.startPublisher("LOG_LEVEL=warn", "POLL_INTERVAL=200ms")
	ix := p.startIndexer("LOG_LEVEL=debug", "FLUSH_INTERVAL=100ms", "AUTO_CUTOVER="+p.spec.Job, "AUTO_CUTOVER_INTERVAL=300ms")
	procs := func() string {
		return "publisher:\n" + tail(pub.Stderr(), 10) + "\nindexer:\n" + tail(ix.Stderr(), 30)
	}
	p.runBatcher(2 * time.Minute)
	p.waitSettled(ctx, 2*time.Minute, procs)
	v1, v2 := index.GenerationIndex(p.alias, "v1"), index.GenerationIndex(p.alias, "v2")
	requireAliasOn(t, p, v1)

	specV2 := p.spec
	specV2.ProcessorVersion = "v2"
	specV2.Document.Fields = append([]batch.Field(nil), p.spec.Document.Fields...)
	for i, f := range specV2.Document.Fields {
		if f.Name == "title" {
			specV2.Document.Fields[i].Transforms = []string{"trim", "upper"}
		}
	}
	b, err := json.Marshal(specV2)
	require.NoError(t, err)
	v2File := filepath.Join(t.TempDir(), "job-v2.json")
	require.NoError(t, os.WriteFile(v2File, b, 0o644))
	runV2 := func() {
		bt := testproc.Run(t, 2*time.Minute, p.batcherBin, p.env(), "run", "--spec", v2File)
		require.Equal(t, 0, bt.ExitCode(), "batcher run v2:\n%s", tail(bt.Stderr(), 20))
	}

	// The rebuild, then changes it did not see: the indexer waits.
	runV2()
	c, err := demo.Mutate(ctx, p.pool, 50, 0, 1)
	require.NoError(t, err)
	require.Positive(t, c.Updated)
	waitUntil(t, 2*time.Minute, "the automatic cutover waits for the catch-up", func() bool {
		return strings.Contains(ix.Stderr(), "changed after run")
	})
	requireAliasOn(t, p, v1)

	// The catch-up: the indexer moves the aliases by itself.
	runV2()
	waitUntil(t, 2*time.Minute, "the automatic cutover to "+v2, func() bool {
		targets, err := index.AliasTargets(ctx, p.es, p.alias)
		return err == nil && len(targets) == 1 && targets[0] == v2
	})
	requireAliasOn(t, p, v2)
	// The indexer logs the move once it has recorded the job's live
	// version, a moment after the _aliases call.
	waitUntil(t, time.Minute, "the automatic cutover's log line", func() bool {
		return strings.Contains(ix.Stderr(), "the read alias moved to the rebuilt generation")
	})
	require.Equal(t, 1, strings.Count(ix.Stderr(), "the read alias moved to the rebuilt generation"), procs())
	require.Equal(t, "v2", sampleDoc(t, p)[sink.FieldPV])
	p.expect = expectV2
	p.waitSettled(ctx, 2*time.Minute, procs) // the v2 documents, through both aliases
	var live int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(*) FROM normalized_records WHERE source = $1 AND NOT deleted AND processor_version = 'v2'`, sourceName).Scan(&live))
	require.Equal(t, live, p.searchCount(ctx, nil), "documents visible through the read alias")
}
