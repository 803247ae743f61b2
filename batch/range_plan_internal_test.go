package batch

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
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
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	_, err := pool.Exec(ctx, DemoSchemaSQL)
	require.NoError(t, err)
	const rows = 50000
	_, err = pool.Exec(ctx, `
INSERT INTO source_records (id, created_at, tenant_id, payload)
SELECT g, timestamptz '2024-01-01' + g * interval '1 second', 't' || (g % 4), '{"title": "t"}'
FROM generate_series(1, 50000) g;
ANALYZE source_records`)
	require.NoError(t, err)

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
			var read float64
			walkPlan(t, plan, func(node map[string]any) {
				if node["Relation Name"] == "source_records" {
					read += node["Actual Rows"].(float64) * node["Actual Loops"].(float64)
					if f, ok := node["Rows Removed by Filter"].(float64); ok {
						read += f
					}
				}
			})
			require.Less(t, read, float64(100), "%s, %s: the plan read %.0f rows of %d:\n%s", mode, x.what, read, rows, plan)
		}
	}
}

// explainPrepared EXPLAINs st as PREPARE and EXECUTE run it, so that the
// session's plan_cache_mode decides between the generic and the custom
// plan as it does for pgx's prepared statements (an EXPLAIN sent with
// parameters is planned with their values, always a custom plan).
func explainPrepared(ctx context.Context, conn *pgxpool.Conn, st stmt, a *args, analyze bool) (string, error) {
	name := fmt.Sprintf("explained_%d", explained.Add(1))
	if _, err := conn.Exec(ctx, "PREPARE "+name+" AS "+st.sql); err != nil {
		return "", err
	}
	params := st.bind(a)
	lits := make([]string, len(params))
	for i, p := range params {
		l, err := sqlLiteralOf(p) // EXECUTE takes its arguments as literals
		if err != nil {
			return "", err
		}
		lits[i] = l
	}
	opts := "FORMAT JSON"
	if analyze {
		opts = "ANALYZE, " + opts
	}
	var plan string
	err := conn.QueryRow(ctx, "EXPLAIN ("+opts+") EXECUTE "+name+"("+strings.Join(lits, ", ")+")").Scan(&plan)
	return plan, err
}

var explained atomic.Int64

// sqlLiteralOf writes a bound parameter as an SQL literal.
func sqlLiteralOf(v any) (string, error) {
	switch v := v.(type) {
	case nil:
		return "NULL", nil
	case string:
		return sqlLiteral(v), nil
	case *string:
		if v == nil {
			return "NULL", nil
		}
		return sqlLiteral(*v), nil
	case []string:
		if v == nil {
			return "NULL", nil
		}
		els := make([]string, len(v))
		for i, e := range v {
			els[i] = sqlLiteral(e)
		}
		return "ARRAY[" + strings.Join(els, ", ") + "]::text[]", nil
	case int, int64:
		return fmt.Sprint(v), nil
	}
	return "", fmt.Errorf("no SQL literal for %T", v)
}
