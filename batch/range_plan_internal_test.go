package batch

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// A run's boundary (read at every run start, and after every follower run
// to look past it) and its row count cost what lies past the start, not
// what the table holds, also in the generic plan a prepared statement
// settles on after five executions. One statement with "start IS NULL OR
// key > start" had a generic plan that scanned the whole cursor index
// backwards with the comparison as a filter: 49 ms per boundary on a
// 200,000-row table, twice per follower run.
func TestRangePlansReadOnlyPastTheStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const rows = 50000
	pool := demoRowsDB(t, rows, false)

	s := DemoSpec().withDefaults()
	c, err := compile(ctx, pool, s)
	require.NoError(t, err)
	var last []string
	require.NoError(t, pool.QueryRow(ctx, `SELECT ARRAY[created_at::text, id::text] FROM source_records ORDER BY created_at DESC, id DESC LIMIT 1`).Scan(&last))
	var nearEnd []string
	require.NoError(t, pool.QueryRow(ctx, `SELECT ARRAY[created_at::text, id::text] FROM source_records ORDER BY created_at DESC, id DESC OFFSET 10 LIMIT 1`).Scan(&nearEnd))

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		_, err = conn.Exec(ctx, "SET plan_cache_mode = "+mode)
		require.NoError(t, err)
		for _, x := range []struct {
			what string
			st   stmt
			a    *args
		}{
			{"boundary past the newest row", from(c.boundary, last), &args{Start: last}},
			{"count of the last rows", from(c.count, nearEnd), &args{Start: nearEnd, Boundary: last}},
		} {
			plan, err := explainPrepared(ctx, conn, x.st, x.a, true)
			require.NoError(t, err)
			read := rowsRead(t, plan, "source_records")
			require.Less(t, read, float64(100), "%s, %s: the plan read %.0f rows of %d:\n%s", mode, x.what, read, rows, plan)
		}
	}
}
