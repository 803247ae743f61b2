package batch

import (
	"context"
	"strconv"
)

// ScopeRows is SQL that reads a job's scope in its source table: every row
// the job's runs would carry, with the spec's filter and, with an explicit
// source.partitions list, only those partitions (the sweep's scope: every
// partition, not one). It is compiled as a run compiles its statements
// (columns and filter values checked against the catalog, identifiers
// quoted), for readers outside the package such as `indexer reconcile
// --source-table`. Wrap it as a subquery; its columns are
//
//	id text, version bigint, deleted boolean
//
// (deleted: the soft-delete column says deleted; false without one).
type ScopeRows struct {
	// SQL reads every row in scope.
	SQL string
	// ByIDsSQL reads the rows in scope among the ids of one more
	// parameter, $N with N = len(Args)+1, a text[] (cast to the id
	// column's type, so an index on it is used).
	ByIDsSQL string
	// Args are the arguments of both, in order.
	Args []any
	// Table is the quoted, schema-qualified table.
	Table string
}

// CompileScopeRows checks s against the catalog as a run does and returns
// the SQL of its scope.
func CompileScopeRows(ctx context.Context, db DB, s Spec) (ScopeRows, error) {
	s = s.withDefaults()
	c, err := compile(ctx, db, s)
	if err != nil {
		return ScopeRows{}, err
	}
	b := newBuilder()
	filter := *c
	filter.spec.Source.Partition = ""
	where := filter.scopeWhere(b)
	if p := s.Source.Partition; p != "" && len(s.Source.Partitions) > 0 {
		where += " AND s." + q(p) + " = ANY(" + b.p("pkeys", "text[]") + "::" + c.types[p] + "[])"
	}
	sel := `SELECT s.` + q(s.Source.ID) + `::text AS id, s.` + q(s.Source.Version) + `::bigint AS version, ` + c.deletedExpr() + ` AS deleted FROM ` + c.table + ` s WHERE ` + where
	st := b.stmt(sel)
	out := ScopeRows{SQL: sel, Args: st.bind(&args{PKeys: s.Source.Partitions}), Table: c.table}
	ids := "$" + strconv.Itoa(len(out.Args)+1)
	out.ByIDsSQL = sel + ` AND s.` + q(s.Source.ID) + ` = ANY(` + ids + `::text[]::` + c.types[s.Source.ID] + `[])`
	return out, nil
}
