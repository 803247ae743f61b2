package batch

// Helpers of the plan tests: PREPARE/EXECUTE explains, plan walks, the
// demo table filled with generate_series.

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

// demoRowsDB is a new database with the demo schema and rows source rows
// (ids 1..rows, one a second from 2024-01-01), and with normalized, a
// normalized record of each; analyzed.
func demoRowsDB(t *testing.T, rows int, normalized bool) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	_, err := pool.Exec(ctx, DemoSchemaSQL)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
INSERT INTO source_records (id, created_at, tenant_id, payload)
SELECT g, timestamptz '2024-01-01' + g * interval '1 second', 't' || (g % 4), '{"title": "t"}'
FROM generate_series(1, $1::int) g`, rows)
	require.NoError(t, err)
	if normalized {
		_, err = pool.Exec(ctx, `
INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'source_records', g::text, '{}', 1, 'v1', false FROM generate_series(1, $1::int) g`, rows)
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `ANALYZE source_records; ANALYZE normalized_records`)
	require.NoError(t, err)
	return pool
}

// rowsRead is how many rows of table an EXPLAIN ANALYZE plan's scans
// returned or filtered out, over all their loops.
func rowsRead(t *testing.T, plan, table string) float64 {
	t.Helper()
	var read float64
	planNodes(t, plan, func(node map[string]any) {
		if node["Relation Name"] == table {
			read += node["Actual Rows"].(float64) * node["Actual Loops"].(float64)
			if f, ok := node["Rows Removed by Filter"].(float64); ok {
				read += f
			}
		}
	})
	return read
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

func ptr[T any](v T) *T { return &v }
