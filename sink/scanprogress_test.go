package sink

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// Mid-rebuild, the generation holds nearly every normalized row of its
// version (both grow with the scan), so indexer status also shows how far
// the rebuild run has scanned, from batch_runs.
func TestStatusShowsTheRebuildRunsScan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	_, err := pool.Exec(ctx, `
INSERT INTO batch_runs (job, logical_run_id, partition_key, state, processor_version, scope_hash, scope, processed_count, estimated_total, created_at) VALUES
  ('records', 'r1', '',   'succeeded', 'v1', 'h', '{}', 1000, 1000, now() - interval '2 hours'),
  ('records', 'r2', 't0', 'succeeded', 'v2', 'h', '{}', 300,  300,  now() - interval '1 hour'),
  ('records', 'r2', 't1', 'running',   'v2', 'h', '{}', 100,  400,  now() - interval '1 hour'),
  ('records', 'r0', 't1', 'failed',    'v2', 'h', '{}', 5,    400,  now() - interval '3 hours'),
  ('orders',  'o1', '',   'running',   'v3', 'h', '{}', 42,   NULL, now())`)
	require.NoError(t, err)
	scans, err := ScanByPV(ctx, pool)
	require.NoError(t, err)
	seven := int64(700)
	require.Equal(t, map[string]RunScan{
		"v2": {Run: "r2", Processed: 400, Estimated: &seven}, // the newest run at v2; v1's run is over
		"v3": {Run: "o1", Processed: 42},
	}, scans)

	st := &Status{
		ReadAlias: "records",
		Generations: []index.Generation{
			{Index: "records_v1", Meta: index.GenerationMeta{ProcessorVersion: "v1", CreatedAt: "2026-01-01T00:00:00Z"}, Live: true, Docs: 1000},
			{Index: "records_v2", Meta: index.GenerationMeta{ProcessorVersion: "v2", CreatedAt: "2026-01-02T00:00:00Z"}, Docs: 390},
			{Index: "records_v3", Meta: index.GenerationMeta{ProcessorVersion: "v3", CreatedAt: "2026-01-03T00:00:00Z"}, Docs: 40},
		},
		RowsByPV: map[string]int64{"v1": 1000, "v2": 400, "v3": 42},
		ScanByPV: scans,
	}
	var out bytes.Buffer
	st.writeGenerations(&out)
	require.Regexp(t, `records_v1\s+v1\s+live\s+1000\s+0\s+1000/1000 normalized rows \(100\.0%\)\s`, out.String())
	require.Contains(t, out.String(), "390/400 normalized rows (97.5%); scan 400/~700 rows (57.1%) of run r2")
	require.Contains(t, out.String(), "40/42 normalized rows (95.2%); scan 42 rows of run o1")
}
