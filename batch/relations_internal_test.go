package batch

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// Test hooks of relations_more_test.go (package batch_test), which holds
// the catalog fixture.

// RelationPlans returns the EXPLAIN (FORMAT JSON) plans, with bound
// arguments, of spec s's statements that read related rows: "chunk" (the
// first keyset chunk, up to the last key), "work" (a relation chunk of up
// to chunk.size queued roots) and "resolve" (the resolution of the
// captures into roots), each under plan_cache_mode (force_custom_plan,
// force_generic_plan: the plan of the first executions and the one a
// prepared statement may settle on), keyed "<mode> <statement>".
func RelationPlans(ctx context.Context, db *pgxpool.Pool, s Spec) (map[string]string, error) {
	s = s.withDefaults()
	c, err := compile(ctx, db, s)
	if err != nil {
		return nil, err
	}
	var last []string
	if err := db.QueryRow(ctx, "SELECT "+c.cursorText("x.")+" FROM (SELECT "+c.rowColumnsKeysOnly()+" FROM "+c.table+" s ORDER BY "+c.orderBy(true)+" LIMIT 1) x").Scan(&last); err != nil {
		return nil, err
	}
	var ids []string
	if err := db.QueryRow(ctx, "SELECT array_agg(s."+q(s.Source.ID)+"::text) FROM (SELECT * FROM "+c.table+" s ORDER BY random() LIMIT $1) s", s.Chunk.Size).Scan(&ids); err != nil {
		return nil, err
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	out := map[string]string{}
	for name, x := range map[string]struct {
		st stmt
		a  *args
	}{
		"chunk":   {c.chunkFirst, &args{Boundary: last, Limit: s.Chunk.Size, Job: s.Job, Run: "r", Source: s.SourceName, PV: s.ProcessorVersion}},
		"work":    {c.chunkWork, &args{IDs: ids, Job: s.Job, Run: "r", Source: s.SourceName, PV: s.ProcessorVersion}},
		"resolve": {c.resolveRel, &args{Job: s.Job}},
		"take":    {stmt{sql: relWorkSQL, params: []param{{field: func(a *args) any { return a.Job }}, {field: func(a *args) any { return a.Limit }}}}, &args{Job: s.Job, Limit: s.Chunk.Size}},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
				return nil, err
			}
			plan, err := explainPrepared(ctx, conn, x.st, x.a, false)
			if err != nil {
				return nil, fmt.Errorf("%s %s: %w", mode, name, err)
			}
			out[mode+" "+name] = plan
		}
	}
	if _, err := conn.Exec(ctx, "RESET plan_cache_mode; DEALLOCATE ALL"); err != nil {
		return nil, err
	}
	return out, nil
}

// planNodes calls visit with every node of an EXPLAIN (FORMAT JSON) plan.
func planNodes(t *testing.T, plan string, visit func(map[string]any)) {
	t.Helper()
	var top []map[string]any
	require.NoError(t, json.NewDecoder(strings.NewReader(plan)).Decode(&top))
	var walk func(map[string]any)
	walk = func(n map[string]any) {
		visit(n)
		kids, _ := n["Plans"].([]any)
		for _, k := range kids {
			walk(k.(map[string]any))
		}
	}
	for _, p := range top {
		walk(p["Plan"].(map[string]any))
	}
}

// PlanJoinFilters lists the join filters of an EXPLAIN (FORMAT JSON) plan:
// a join that compares every row of one side with every row of the other.
func PlanJoinFilters(t *testing.T, plan string) []string {
	t.Helper()
	var out []string
	planNodes(t, plan, func(n map[string]any) {
		if f, ok := n["Join Filter"].(string); ok {
			out = append(out, n["Node Type"].(string)+": "+f)
		}
	})
	return out
}

// PlanIndexes lists the indexes an EXPLAIN (FORMAT JSON) plan scans (index,
// index-only and bitmap index scans).
func PlanIndexes(t *testing.T, plan string) []string {
	t.Helper()
	var out []string
	planNodes(t, plan, func(n map[string]any) {
		switch n["Node Type"] {
		case "Index Scan", "Index Only Scan", "Bitmap Index Scan":
			out = append(out, n["Index Name"].(string))
		}
	})
	return out
}
