package batch

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// A sweep chunk costs what its chunk holds, not what the tables hold: its
// plan (the generic one a prepared statement settles on, and the custom
// ones before it) reads neither normalized_records nor the source table
// from end to end. The inlined anti-join was planned as a hash join of
// the candidates with all of normalized_records, a sequential scan of the
// read model per chunk.
func TestSweepChunkPlanReadsOnlyItsChunk(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := demoRowsDB(t, 100000, true)

	s := DemoSpec().withDefaults()
	c, err := compile(ctx, pool, s)
	require.NoError(t, err)
	c.build()
	sts := c.sweepSQL(false)
	var nearEnd string
	require.NoError(t, pool.QueryRow(ctx, `SELECT source_id FROM normalized_records ORDER BY source_id DESC OFFSET 100 LIMIT 1`).Scan(&nearEnd))
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		_, err = conn.Exec(ctx, "SET plan_cache_mode = "+mode)
		require.NoError(t, err)
		for _, after := range []*string{nil, ptr("5"), &nearEnd} {
			st := sts.after(after)
			a := &args{Source: s.SourceName, After: after, Limit: 20000, PV: s.ProcessorVersion}
			plan, err := explainPrepared(ctx, conn, st, a, false)
			require.NoError(t, err)
			var nodes []string
			planNodes(t, plan, func(node map[string]any) {
				if node["Node Type"] == "Seq Scan" {
					nodes = append(nodes, node["Relation Name"].(string))
				}
			})
			require.Empty(t, nodes, "%s, after %v: sequential scans in the sweep chunk's plan:\n%s", mode, after, plan)
		}
		// The last chunk reads the last ids, not the ids before them
		// (every row is in the source: the chunk writes nothing).
		plan, err := explainPrepared(ctx, conn, sts.after(&nearEnd), &args{Source: s.SourceName, After: &nearEnd, Limit: 20000, PV: s.ProcessorVersion}, true)
		require.NoError(t, err)
		read := rowsRead(t, plan, "normalized_records")
		require.Less(t, read, float64(1000), "%s: the chunk after %s read %.0f rows of normalized_records:\n%s", mode, nearEnd, read, plan)
	}
}
