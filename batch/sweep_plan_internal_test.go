package batch

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
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
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	_, err := pool.Exec(ctx, DemoSchemaSQL)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
INSERT INTO source_records (id, created_at, tenant_id, payload)
SELECT g, timestamptz '2024-01-01' + g * interval '1 second', 't' || (g % 4), '{"title": "t"}'
FROM generate_series(1, 100000) g;
INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'source_records', g::text, '{}', 1, 'v1', false FROM generate_series(1, 100000) g;
ANALYZE source_records; ANALYZE normalized_records`)
	require.NoError(t, err)

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
			st := sts[0]
			if after != nil {
				st = sts[1]
			}
			a := &args{Source: s.SourceName, After: after, Limit: 20000, PV: s.ProcessorVersion}
			plan, err := explainPrepared(ctx, conn, st, a, false)
			require.NoError(t, err)
			var nodes []string
			walkPlan(t, plan, func(node map[string]any) {
				if node["Node Type"] == "Seq Scan" {
					nodes = append(nodes, node["Relation Name"].(string))
				}
			})
			require.Empty(t, nodes, "%s, after %v: sequential scans in the sweep chunk's plan:\n%s", mode, after, plan)
		}
		// The last chunk reads the last ids, not the ids before them
		// (every row is in the source: the chunk writes nothing).
		plan, err := explainPrepared(ctx, conn, sts[1], &args{Source: s.SourceName, After: &nearEnd, Limit: 20000, PV: s.ProcessorVersion}, true)
		require.NoError(t, err)
		var read float64
		walkPlan(t, plan, func(node map[string]any) {
			if node["Relation Name"] == "normalized_records" {
				read += node["Actual Rows"].(float64) * node["Actual Loops"].(float64)
				if f, ok := node["Rows Removed by Filter"].(float64); ok {
					read += f
				}
			}
		})
		require.Less(t, read, float64(1000), "%s: the chunk after %s read %.0f rows of normalized_records:\n%s", mode, nearEnd, read, plan)
	}
}

func ptr[T any](v T) *T { return &v }

// walkPlan calls fn on every node of an EXPLAIN (FORMAT JSON) plan.
func walkPlan(t *testing.T, plan string, fn func(map[string]any)) {
	t.Helper()
	var top []map[string]any
	require.NoError(t, json.NewDecoder(strings.NewReader(plan)).Decode(&top))
	var walk func(map[string]any)
	walk = func(n map[string]any) {
		fn(n)
		kids, _ := n["Plans"].([]any)
		for _, k := range kids {
			walk(k.(map[string]any))
		}
	}
	for _, p := range top {
		walk(p["Plan"].(map[string]any))
	}
}
