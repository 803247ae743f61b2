package batch

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Documents from related tables (Spec.Document.Relations).
//
// Building: each relation is a correlated subquery in the chunk's one
// statement, next to the root's fields: a one_to_many relation is
// jsonb_agg over the related rows of the parent's row (an index scan on the
// join column per parent row, never a round trip), a one_to_one relation
// the first such row, a relation through a join table the join of the two.
// Nested relations are subqueries inside the related row's object. A
// related row that breaks a field check makes the root a bad row; a second
// subquery per relation (only when it or a nested one has checks) finds
// the first such row and names it.
//
// Versions: a related row has no version the root's could be compared
// with, so the guard of a relation job's upsert also compares documents: a
// rebuilt document that differs from the stored one at the same root
// version (and processor version) is written at the stored version + 1,
// the difference kept in version_offset like a return over a tombstone's
// (upsertTail). Rebuilds of one root never run at once: a relation job is
// the only writer of its source name (checkSharedSourceName), a run's
// chunks cover disjoint roots, its relation phase runs after every
// partition committed, the next run starts after that, and a quarantine
// retry takes the job's lock exclusively (relLockSQL); so each rebuild
// reads a snapshot taken after the previous one committed, and "differs"
// always means "newer".
//
// Propagation: full runs rebuild every root. For incremental and follow
// runs, the capture triggers (relationTriggerSQL) record which related
// rows changed (batch_relation_changes: the relation and the changed row's
// join value, migration 017); a new run resolves them, through the spec's
// joins and with the snapshot of the transaction that creates it, into
// root ids (batch_relation_work), and its relation phase rebuilds those in
// chunks (relation.go's rebuild in sweep.go). The resolution runs after the
// capture committed, so a root that joined a changed parent at the same
// time is either resolved or rebuilt by its own change's capture later.

// relNode is a compiled relation.
type relNode struct {
	rel    Relation
	path   string // "variants.prices": the capture's node
	table  string // quoted, schema-qualified
	name   string // schema.table, for messages
	types  map[string]string
	parent *relNode // nil: the root
	// The join: parent.<parentCol> = this.<childCol>, or through a join
	// table: parent.<parentCol> = through.<thParent> and
	// through.<thChild> = this.<childCol>.
	parentCol, childCol string
	through             *relThrough
	key                 string // a column naming a related row in messages (its primary key's first)
	order               []string
	children            []*relNode
	checks              bool // it or a nested relation has field checks
}

type relThrough struct {
	table, name       string
	types             map[string]string
	thParent, thChild string
}

// relTables are the tables a relation job's documents read beside the
// root, each with the capture nodes it feeds.
type relTable struct {
	schema, table string
	nodes         []relCapture
}

type relCapture struct {
	node, col string // batch_relation_changes.node, and the column whose value is its key
}

// fkSQL lists the single-column foreign keys between tables $1 and $2 (in
// either direction): the referencing table, its column, the referenced
// column.
const fkSQL = `
SELECT c.conrelid = to_regclass($1), a1.attname::text, a2.attname::text
FROM pg_constraint c
JOIN pg_attribute a1 ON a1.attrelid = c.conrelid AND a1.attnum = c.conkey[1]
JOIN pg_attribute a2 ON a2.attrelid = c.confrelid AND a2.attnum = c.confkey[1]
WHERE c.contype = 'f' AND cardinality(c.conkey) = 1
  AND ((c.conrelid = to_regclass($1) AND c.confrelid = to_regclass($2)) OR (c.conrelid = to_regclass($2) AND c.confrelid = to_regclass($1)))`

// pkSQL lists the primary key columns of table $1 in key order.
const pkSQL = `
SELECT a.attname::text FROM pg_index i
JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, n) ON true
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = to_regclass($1) AND i.indisprimary ORDER BY k.n`

// foreignKey finds the one single-column foreign key between parent and
// child (either direction): parent.<p> = child.<c>.
func foreignKey(ctx context.Context, db querier, parent, child string) (p, c string, n int, err error) {
	rows, err := db.Query(ctx, fkSQL, parent, child)
	if err != nil {
		return "", "", 0, err
	}
	var fromParent bool
	var a1, a2 string
	_, err = pgx.ForEachRow(rows, []any{&fromParent, &a1, &a2}, func() error {
		n++
		if fromParent {
			p, c = a1, a2
		} else {
			p, c = a2, a1
		}
		return nil
	})
	return p, c, n, err
}

// compileRelations checks every relation against the catalog and builds
// the nodes.
func (c *compiled) compileRelations(ctx context.Context, db querier) error {
	root := &relNode{table: c.table, name: c.spec.Source.Schema + "." + c.spec.Source.Table, types: c.types}
	var err error
	c.rels, err = c.relNodes(ctx, db, root, c.spec.Document.Relations, "", "document.relations")
	return err
}

func (c *compiled) relNodes(ctx context.Context, db querier, parent *relNode, rels []Relation, prefix, at string) ([]*relNode, error) {
	var out []*relNode
	for i, r := range rels {
		here := fmt.Sprintf("%s[%s]", at, cmpOr(r.Name, strconv.Itoa(i)))
		n := &relNode{rel: r, path: prefix + cmpOr(r.Name, strconv.Itoa(i)), table: q(r.Schema, r.Table), name: r.Schema + "." + r.Table}
		if parent.table != c.table {
			n.parent = parent
		}
		types, err := introspect(ctx, db, r.Schema, r.Table)
		if err != nil {
			if errors.Is(err, ErrSpec) {
				return nil, fmt.Errorf("%w: %s.table: table %s does not exist", ErrSpec, here, n.name)
			}
			return nil, err
		}
		n.types = types
		need := func(setting, tbl string, types map[string]string, col string) error {
			if _, ok := types[col]; !ok {
				return fmt.Errorf("%w: %s: column %q does not exist in %s", ErrSpec, setting, col, tbl)
			}
			return nil
		}
		if r.Through == nil {
			if r.ForeignKey != nil {
				n.parentCol, n.childCol = r.ForeignKey.Parent, r.ForeignKey.Child
			} else {
				p, ch, cnt, err := foreignKey(ctx, db, parent.table, n.table)
				if err != nil {
					return nil, fmt.Errorf("read the foreign keys between %s and %s: %w", parent.name, n.name, err)
				}
				if cnt != 1 {
					return nil, fmt.Errorf("%w: %s: %d single-column foreign keys between %s and %s; name the join with foreign_key: {parent: <column of %s>, child: <column of %s>}",
						ErrSpec, here, cnt, parent.name, n.name, parent.name, n.name)
				}
				n.parentCol, n.childCol = p, ch
			}
			if err := need(here+".foreign_key.parent", parent.name, parent.types, n.parentCol); err != nil {
				return nil, err
			}
			if err := need(here+".foreign_key.child", n.name, n.types, n.childCol); err != nil {
				return nil, err
			}
			if err := checkComparable(ctx, db, here, parent.name+"."+n.parentCol, parent.types[n.parentCol], n.name+"."+n.childCol, n.types[n.childCol]); err != nil {
				return nil, err
			}
		} else {
			t := r.Through
			th := &relThrough{table: q(t.Schema, t.Table), name: t.Schema + "." + t.Table, thParent: t.Parent, thChild: t.Child}
			if th.types, err = introspect(ctx, db, t.Schema, t.Table); err != nil {
				if errors.Is(err, ErrSpec) {
					return nil, fmt.Errorf("%w: %s.through.table: table %s does not exist", ErrSpec, here, th.name)
				}
				return nil, err
			}
			if r.ForeignKey != nil {
				n.parentCol, n.childCol = r.ForeignKey.Parent, r.ForeignKey.Child
			}
			if th.thParent == "" || n.parentCol == "" {
				p, tc, cnt, err := foreignKey(ctx, db, parent.table, th.table)
				if err != nil {
					return nil, fmt.Errorf("read the foreign keys between %s and %s: %w", parent.name, th.name, err)
				}
				if cnt != 1 {
					return nil, fmt.Errorf("%w: %s: %d single-column foreign keys between %s and join table %s; name them with through: {parent: ..., child: ...} and foreign_key: {parent: ..., child: ...}",
						ErrSpec, here, cnt, parent.name, th.name)
				}
				th.thParent, n.parentCol = cmpOr(th.thParent, tc), cmpOr(n.parentCol, p)
			}
			if th.thChild == "" || n.childCol == "" {
				tc, ch, cnt, err := foreignKey(ctx, db, th.table, n.table)
				if err != nil {
					return nil, fmt.Errorf("read the foreign keys between %s and %s: %w", th.name, n.name, err)
				}
				if cnt != 1 {
					return nil, fmt.Errorf("%w: %s: %d single-column foreign keys between join table %s and %s; name them with through: {parent: ..., child: ...} and foreign_key: {parent: ..., child: ...}",
						ErrSpec, here, cnt, th.name, n.name)
				}
				th.thChild, n.childCol = cmpOr(th.thChild, tc), cmpOr(n.childCol, ch)
			}
			for _, chk := range []struct {
				setting, tbl, col string
				types             map[string]string
			}{
				{here + ".foreign_key.parent", parent.name, n.parentCol, parent.types},
				{here + ".foreign_key.child", n.name, n.childCol, n.types},
				{here + ".through.parent", th.name, th.thParent, th.types},
				{here + ".through.child", th.name, th.thChild, th.types},
			} {
				if err := need(chk.setting, chk.tbl, chk.types, chk.col); err != nil {
					return nil, err
				}
			}
			if err := checkComparable(ctx, db, here, parent.name+"."+n.parentCol, parent.types[n.parentCol], th.name+"."+th.thParent, th.types[th.thParent]); err != nil {
				return nil, err
			}
			if err := checkComparable(ctx, db, here, th.name+"."+th.thChild, th.types[th.thChild], n.name+"."+n.childCol, n.types[n.childCol]); err != nil {
				return nil, err
			}
			n.through = th
		}
		if r.Deleted != "" {
			if err := need(here+".deleted", n.name, n.types, r.Deleted); err != nil {
				return nil, err
			}
		}
		for j, f := range r.Fields {
			col, _, _ := strings.Cut(f.From, ".")
			if err := need(fmt.Sprintf("%s.fields[%d].from", here, j), n.name, n.types, col); err != nil {
				return nil, err
			}
			if strings.Contains(f.From, ".") && n.types[col] != "jsonb" && n.types[col] != "json" {
				return nil, fmt.Errorf("%w: %s.fields[%d].from %q: column %q of %s is %s, a key path needs jsonb", ErrSpec, here, j, f.From, col, n.name, n.types[col])
			}
			n.checks = n.checks || f.Required || f.Type != ""
		}
		rows, err := db.Query(ctx, pkSQL, n.table)
		if err != nil {
			return nil, fmt.Errorf("read the primary key of %s: %w", n.name, err)
		}
		pk, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("read the primary key of %s: %w", n.name, err)
		}
		n.key = n.childCol
		if len(pk) > 0 {
			n.key = pk[0]
		}
		orderBy := r.OrderBy
		if len(orderBy) == 0 {
			if len(pk) == 0 {
				return nil, fmt.Errorf("%w: %s: table %s has no primary key to order its rows by; set order_by", ErrSpec, here, n.name)
			}
			orderBy = pk
		}
		ordered := map[string]bool{}
		for j, o := range orderBy {
			col, dir, _ := strings.Cut(strings.TrimSpace(o), " ")
			if err := need(fmt.Sprintf("%s.order_by[%d]", here, j), n.name, n.types, col); err != nil {
				return nil, err
			}
			term := q(col)
			if strings.EqualFold(strings.TrimSpace(dir), "desc") {
				term += " DESC"
			}
			n.order = append(n.order, term)
			ordered[col] = true
		}
		// Ties are broken by the primary key: an order that can change
		// between two rebuilds of the same rows would change the document
		// (a new version and event each time).
		for _, col := range pk {
			if !ordered[col] {
				n.order = append(n.order, q(col))
			}
		}
		if n.children, err = c.relNodes(ctx, db, n, r.Relations, n.path+".", here+".relations"); err != nil {
			return nil, err
		}
		for _, ch := range n.children {
			n.checks = n.checks || ch.checks
		}
		out = append(out, n)
	}
	return out, nil
}

// indexedSQL: whether an index of table $1 leads with column $2.
const indexedSQL = `SELECT EXISTS (SELECT FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
WHERE i.indrelid = to_regclass($1) AND a.attname = $2 AND i.indisvalid)`

// unindexedJoins lists the join columns without an index that leads with
// them: each is a scan of its table per root rebuilt (the child's side)
// or per run that resolves captures (the parent's side).
func (c *compiled) unindexedJoins(ctx context.Context, db querier) ([]string, error) {
	var out []string
	check := func(table, name, col, use string) error {
		var ok bool
		if err := db.QueryRow(ctx, indexedSQL, table, col).Scan(&ok); err != nil {
			return fmt.Errorf("read the indexes of %s: %w", name, err)
		}
		if !ok {
			out = append(out, fmt.Sprintf("%s.%s (%s): CREATE INDEX ON %s (%s)", name, col, use, table, q(col)))
		}
		return nil
	}
	var walk func(parent *relNode, ns []*relNode) error
	walk = func(parent *relNode, ns []*relNode) error {
		ptable, pname := c.table, c.spec.Source.Schema+"."+c.spec.Source.Table
		if parent != nil {
			ptable, pname = parent.table, parent.name
		}
		for _, n := range ns {
			if n.through == nil {
				if err := check(n.table, n.name, n.childCol, "read for every document"); err != nil {
					return err
				}
			} else {
				if err := check(n.through.table, n.through.name, n.through.thParent, "read for every document"); err != nil {
					return err
				}
				if err := check(n.through.table, n.through.name, n.through.thChild, "read to find the documents of a changed "+n.name+" row"); err != nil {
					return err
				}
				if err := check(n.table, n.name, n.childCol, "read for every document"); err != nil {
					return err
				}
			}
			if err := check(ptable, pname, n.parentCol, "read to find the documents of a changed "+n.name+" row"); err != nil {
				return err
			}
			if err := walk(n, n.children); err != nil {
				return err
			}
		}
		return nil
	}
	return out, walk(nil, c.rels)
}

// checkComparable refuses a join of two columns PostgreSQL cannot compare.
func checkComparable(ctx context.Context, db querier, at, a, ta, b, tb string) error {
	_, err := db.Exec(ctx, "SELECT NULL::"+ta+" = NULL::"+tb)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return fmt.Errorf("%w: %s: cannot join %s (%s) with %s (%s): %s", ErrSpec, at, a, ta, b, tb, pgErr.Message)
	}
	if err != nil {
		return fmt.Errorf("check the join of %s and %s: %w", a, b, err)
	}
	return nil
}

// relFrom is the FROM and WHERE of n's rows for the parent row pa: the
// related table as alias a (and the join table as t+a).
func (n *relNode) relFrom(pa, a string) string {
	var from string
	if n.through == nil {
		from = " FROM " + n.table + " " + a + " WHERE " + a + "." + q(n.childCol) + " = " + pa + "." + q(n.parentCol)
	} else {
		t := "t" + a
		from = " FROM " + n.through.table + " " + t + " JOIN " + n.table + " " + a + " ON " + a + "." + q(n.childCol) + " = " + t + "." + q(n.through.thChild) +
			" WHERE " + t + "." + q(n.through.thParent) + " = " + pa + "." + q(n.parentCol)
	}
	if d := n.rel.Deleted; d != "" {
		if n.types[d] == "boolean" {
			from += " AND NOT COALESCE(" + a + "." + q(d) + ", false)"
		} else {
			from += " AND " + a + "." + q(d) + " IS NULL"
		}
	}
	return from
}

func (n *relNode) orderBy(a string) string {
	terms := make([]string, len(n.order))
	for i, o := range n.order {
		terms[i] = a + "." + o
	}
	return strings.Join(terms, ", ")
}

// relFieldExpr is a related row's field as jsonb, transforms applied.
func relFieldExpr(b *builder, a string, types map[string]string, f Field) string {
	col, path, hasPath := strings.Cut(f.From, ".")
	v := "to_jsonb(" + a + "." + q(col) + ")"
	if hasPath {
		v = a + "." + q(col)
		if types[col] == "json" {
			v += "::jsonb"
		}
		v += " #> " + b.c(strings.Split(path, "."), "text[]")
	}
	return transform(v, f.Transforms)
}

// alias returns the alias of a relation at depth d.
func relAlias(d int) string { return "r" + strconv.Itoa(d) }

// value is n's value in the object of the parent row pa (depth d): the
// scalar subquery that builds it.
func (n *relNode) value(b *builder, pa string, d int) string {
	a := relAlias(d)
	elem := n.element(b, a, d)
	if n.rel.Type == OneToOne {
		return "(SELECT " + elem + n.relFrom(pa, a) + " ORDER BY " + n.orderBy(a) + " LIMIT 1)"
	}
	if n.rel.Limit == 0 {
		return "(SELECT COALESCE(jsonb_agg(" + elem + " ORDER BY " + n.orderBy(a) + "), '[]'::jsonb)" + n.relFrom(pa, a) + ")"
	}
	// The first Limit rows in order, aggregated in that order.
	return "(SELECT COALESCE(jsonb_agg(z.v ORDER BY z.i), '[]'::jsonb) FROM (SELECT " + elem + " AS v, row_number() OVER (ORDER BY " + n.orderBy(a) + ") AS i" +
		n.relFrom(pa, a) + " ORDER BY " + n.orderBy(a) + " LIMIT " + strconv.Itoa(n.rel.Limit) + ") z)"
}

// element is one related row (alias a, depth d) as it appears in the
// document: an object of its fields and nested relations, or a scalar.
func (n *relNode) element(b *builder, a string, d int) string {
	if n.rel.Variant == VariantScalar {
		return relFieldExpr(b, a, n.types, n.rel.Fields[0])
	}
	var pairs, merges []string
	for _, f := range n.rel.Fields {
		v := relFieldExpr(b, a, n.types, f)
		if !strings.Contains(f.From, ".") && len(f.Transforms) == 0 {
			// A plain column: jsonb_build_object converts it as to_jsonb
			// would, without a jsonb datum built and taken apart (as the
			// root's fields, compile.go).
			v = a + "." + q(f.From)
		}
		pairs = append(pairs, b.c(f.Name, "text"), v)
	}
	for _, ch := range n.children {
		if ch.rel.Variant == VariantFlatten {
			merges = append(merges, ch.flatValue(b, a, d+1))
			continue
		}
		pairs = append(pairs, b.c(ch.rel.Name, "text"), ch.value(b, a, d+1))
	}
	obj := "jsonb_build_object(" + strings.Join(pairs, ", ") + ")"
	for _, m := range merges {
		obj = "(" + obj + " || " + m + ")"
	}
	return obj
}

// flatValue is a flattened one_to_one relation: its object, or its fields
// as nulls when there is no row, to merge into the parent object.
func (n *relNode) flatValue(b *builder, pa string, d int) string {
	nulls := make([]string, 0, 2*len(n.rel.Fields))
	for _, f := range n.rel.Fields {
		nulls = append(nulls, b.c(f.Name, "text"), "NULL::jsonb")
	}
	return "COALESCE(" + n.value(b, pa, d) + ", jsonb_build_object(" + strings.Join(nulls, ", ") + "))"
}

// problem is the first related row in the document under the parent row
// pa (depth d) that breaks a field check, as "relation path [key=value]:
// message"; NULL when none does.
func (n *relNode) problem(b *builder, pa string, d int) string {
	a := relAlias(d)
	var terms []string
	label := b.c(n.path+" ["+n.key+"=", "text") + " || " + a + "." + q(n.key) + "::text || '] '"
	for _, f := range n.rel.Fields {
		v := relFieldExpr(b, a, n.types, f)
		if f.Required {
			terms = append(terms, "CASE WHEN "+v+" IS NULL OR "+v+" = 'null'::jsonb THEN "+label+" || "+b.c(fmt.Sprintf("field %s (%s) is missing", f.Name, f.From), "text")+" END")
		}
		if f.Type != "" {
			terms = append(terms, "CASE WHEN jsonb_typeof("+v+") NOT IN ('null', "+b.c(f.Type, "text")+") THEN "+label+" || "+
				b.c(fmt.Sprintf("field %s (%s): want %s, got ", f.Name, f.From, f.Type), "text")+" || jsonb_typeof("+v+") END")
		}
	}
	for _, ch := range n.children {
		if ch.checks {
			terms = append(terms, ch.problem(b, a, d+1))
		}
	}
	// Only the rows the document holds: the first in order of a
	// one_to_one, the first limit of a one_to_many.
	rows := n.relFrom(pa, a)
	switch {
	case n.rel.Type == OneToOne:
		rows = " FROM (SELECT " + a + ".*" + rows + " ORDER BY " + n.orderBy(a) + " LIMIT 1) " + a
	case n.rel.Limit > 0:
		rows = " FROM (SELECT " + a + ".*" + rows + " ORDER BY " + n.orderBy(a) + " LIMIT " + strconv.Itoa(n.rel.Limit) + ") " + a
	}
	return "(SELECT z.p FROM (SELECT COALESCE(" + strings.Join(terms, ", ") + ") AS p" + rows + ") z WHERE z.p IS NOT NULL LIMIT 1)"
}

// relationColumns are the root's relation values (r1..rn) and problems
// (rp1..rpn) as columns of the chunk's inner select over the root row s.
func (c *compiled) relationColumns(b *builder) (cols []string, pairs []string, merges []string, codes []string, msgs []string) {
	for i, n := range c.rels {
		col := "r" + strconv.Itoa(i+1)
		if n.rel.Variant == VariantFlatten {
			cols = append(cols, n.flatValue(b, "s", 1)+" AS "+col)
			merges = append(merges, "x."+col)
		} else {
			cols = append(cols, n.value(b, "s", 1)+" AS "+col)
			pairs = append(pairs, b.c(n.rel.Name, "text"), "x."+col)
		}
		if n.checks {
			p := "rp" + strconv.Itoa(i+1)
			cols = append(cols, n.problem(b, "s", 1)+" AS "+p)
			codes = append(codes, "WHEN x."+p+" IS NOT NULL THEN 'related_row'")
			msgs = append(msgs, "WHEN x."+p+" IS NOT NULL THEN x."+p)
		}
	}
	return cols, pairs, merges, codes, msgs
}

// relUpsertTail is upsertTail for a relation job: a document that differs
// from the stored one at the same index version, or comes from another
// processor version, is written at the stored version + 1
// (relReturnedVersion; see the top of this file).
const relUpsertTail = `
  ON CONFLICT (source, source_id) DO UPDATE SET
    document = EXCLUDED.document,
    source_version = ` + relReturnedVersion + `,
    version_offset = ` + relReturnedVersion + ` - EXCLUDED.source_version,
    processor_version = EXCLUDED.processor_version, deleted = EXCLUDED.deleted, vanished = false, updated_at = EXCLUDED.updated_at
  WHERE n.source_version < EXCLUDED.source_version + n.version_offset
     OR (n.source_version = EXCLUDED.source_version + n.version_offset
         AND (n.processor_version <> EXCLUDED.processor_version OR n.deleted <> EXCLUDED.deleted OR n.document IS DISTINCT FROM EXCLUDED.document))
     OR (n.vanished AND NOT EXCLUDED.deleted)
  RETURNING n.source_id, n.source_version, n.document, n.deleted`

// relReturnedVersion is the index version a relation job's upsert writes:
// upsertTail's, or the stored version + 1 for a document that differs at
// the same version. A document of another processor version is written one
// above the stored version too: one root version may carry different
// related rows, so the generation it goes to (a rollback's old one) may
// hold that version with other content, and would refuse the same version
// as a conflict.
const relReturnedVersion = `greatest(EXCLUDED.source_version + n.version_offset,
      CASE WHEN n.vanished AND NOT EXCLUDED.deleted THEN n.source_version + 1 END,
      CASE WHEN n.source_version = EXCLUDED.source_version + n.version_offset
                AND (n.processor_version <> EXCLUDED.processor_version OR n.deleted <> EXCLUDED.deleted OR n.document IS DISTINCT FROM EXCLUDED.document)
           THEN n.source_version + 1 END)`

// unpartitioned is c for statements over every partition of the job: no
// single-partition term; a listed partition set becomes a filter term.
func (c *compiled) unpartitioned() *compiled {
	all := *c
	all.spec.Source.Partition = ""
	if p := c.spec.Source.Partition; p != "" && len(c.spec.Source.Partitions) > 0 {
		all.spec.Source.Filter = append(slices.Clone(c.spec.Source.Filter), Condition{Column: p, Op: "in", Values: c.spec.Source.Partitions})
	}
	return &all
}

// relTables lists the related and join tables with the capture nodes each
// feeds, in spec order.
func (c *compiled) relTables() []*relTable {
	var out []*relTable
	byName := map[string]*relTable{}
	add := func(schema, table, node, col string) {
		k := schema + "\x00" + table
		t := byName[k]
		if t == nil {
			t = &relTable{schema: schema, table: table}
			byName[k] = t
			out = append(out, t)
		}
		t.nodes = append(t.nodes, relCapture{node: node, col: col})
	}
	var walk func([]*relNode)
	walk = func(ns []*relNode) {
		for _, n := range ns {
			add(n.rel.Schema, n.rel.Table, n.path, n.childCol)
			if n.through != nil {
				add(n.rel.Through.Schema, n.rel.Through.Table, n.path+"#through", n.through.thParent)
			}
			walk(n.children)
		}
	}
	walk(c.rels)
	return out
}

// relTruncated is the node (and key) of a TRUNCATE's capture: every root
// of the job is rebuilt.
const relTruncated = "*"

// captureHash identifies what a table's capture trigger records: the
// nodes the table feeds and their columns. A trigger installed for another
// hash records the wrong nodes or columns; a change of fields, transforms
// or order does not change it.
func (t *relTable) captureHash() string {
	h := sha256.New()
	// v2: keys written under fixed date, interval and float settings.
	fmt.Fprintf(h, "v2 %q.%q", t.schema, t.table)
	for _, n := range t.nodes {
		fmt.Fprintf(h, " %q:%q", n.node, n.col)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// relFunction names job's capture function and triggers on a table.
func relFunction(job, schema, table string) string {
	h := sha256.Sum256([]byte(job + "\x00" + schema + "\x00" + table))
	return "outboxrelay_rel_" + hex.EncodeToString(h[:6])
}

// sqlLiteral quotes s as a SQL string literal.
func sqlLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// relationTriggerSQL installs, on every related and join table of the
// job, the follow NOTIFY and the capture triggers: statement-level AFTER
// INSERT, UPDATE and DELETE triggers that copy, with one INSERT … SELECT
// per statement, the distinct join values of the changed rows (old and
// new) into batch_relation_changes, and an AFTER TRUNCATE one whose
// capture makes the next run rebuild every root in scope. As the delete capture's, each function
// is the table's own (static SQL, a cached plan) and runs as its owner
// (SECURITY DEFINER with the installer's search_path). Its body carries the
// capture hash: a run refuses a function installed for other relations.
func (c *compiled) relationTriggerSQL(leaves map[string][]string) string {
	var sb strings.Builder
	for _, t := range c.relTables() {
		hash := t.captureHash()
		fn := relFunction(c.spec.Job, t.schema, t.table)
		table := q(t.schema, t.table)
		vals := func(x string) string {
			v := make([]string, len(t.nodes))
			for i, nd := range t.nodes {
				v[i] = "(" + sqlLiteral(nd.node) + ", " + x + "." + q(nd.col) + "::text)"
			}
			return "SELECT DISTINCT " + sqlLiteral(c.spec.Job) + ", v.node, v.key FROM " + x + " CROSS JOIN LATERAL (VALUES " + strings.Join(v, ", ") + ") v(node, key) WHERE v.key IS NOT NULL"
		}
		// The keys are written as text under fixed settings, whatever the
		// writer's session has: ISO dates and timestamps, full float
		// digits, postgres intervals, which read back the same under every
		// session setting of the batcher.
		sb.WriteString(`CREATE OR REPLACE FUNCTION ` + q(fn) + `() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT
    SET datestyle = 'ISO, YMD' SET intervalstyle = 'postgres' SET extra_float_digits = 3 SET timezone = 'UTC' AS $outboxrelay_rel$
BEGIN
    -- outboxrelay relation capture ` + hash + `
    IF TG_OP = 'TRUNCATE' THEN
        INSERT INTO batch_relation_changes (job, node, key) VALUES (` + sqlLiteral(c.spec.Job) + `, '` + relTruncated + `', '` + relTruncated + `');
    ELSIF TG_OP = 'INSERT' THEN
        INSERT INTO batch_relation_changes (job, node, key) ` + vals("outboxrelay_new") + `;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO batch_relation_changes (job, node, key) ` + vals("outboxrelay_old") + `;
    ELSE
        INSERT INTO batch_relation_changes (job, node, key) SELECT DISTINCT * FROM (` + vals("outboxrelay_old") + ` UNION ALL ` + vals("outboxrelay_new") + `) u;
    END IF;
    RETURN NULL;
END $outboxrelay_rel$;
`)
		// A statement names one table: one on the partitioned table fires
		// its triggers only, one on a partition (a write that names it)
		// the partition's. So every partition gets them too, at every level.
		for _, tbl := range append([]string{table}, leaves[table]...) {
			sb.WriteString(`CREATE OR REPLACE TRIGGER ` + q(fn+"_ins") + ` AFTER INSERT ON ` + tbl + `
    REFERENCING NEW TABLE AS outboxrelay_new FOR EACH STATEMENT EXECUTE FUNCTION ` + q(fn) + `();
CREATE OR REPLACE TRIGGER ` + q(fn+"_upd") + ` AFTER UPDATE ON ` + tbl + `
    REFERENCING OLD TABLE AS outboxrelay_old NEW TABLE AS outboxrelay_new FOR EACH STATEMENT EXECUTE FUNCTION ` + q(fn) + `();
CREATE OR REPLACE TRIGGER ` + q(fn+"_del") + ` AFTER DELETE ON ` + tbl + `
    REFERENCING OLD TABLE AS outboxrelay_old FOR EACH STATEMENT EXECUTE FUNCTION ` + q(fn) + `();
CREATE OR REPLACE TRIGGER ` + q(fn+"_trunc") + ` AFTER TRUNCATE ON ` + tbl + `
    FOR EACH STATEMENT EXECUTE FUNCTION ` + q(fn) + `();
CREATE OR REPLACE TRIGGER outboxrelay_follow AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON ` + tbl + `
    FOR EACH STATEMENT EXECUTE FUNCTION outboxrelay_follow_notify();
`)
		}
	}
	return sb.String()
}

// leafPartitionsSQL lists the partitions of table $1 at every level (a
// partition may be partitioned itself; none for a table that is not
// partitioned), as regclass names them.
const leafPartitionsSQL = `SELECT COALESCE(array_agg(pt.relid::regclass::text ORDER BY pt.relid::regclass::text), '{}')
FROM pg_partition_tree(to_regclass($1)) pt WHERE pt.relid <> to_regclass($1)`

// relLeaves reads the partitions (every level) of the related and join tables.
func (c *compiled) relLeaves(ctx context.Context, db querier) (map[string][]string, error) {
	out := map[string][]string{}
	for _, t := range c.relTables() {
		table := q(t.schema, t.table)
		var leaves []string
		if err := db.QueryRow(ctx, leafPartitionsSQL, table).Scan(&leaves); err != nil {
			return nil, fmt.Errorf("read the partitions of %s.%s: %w", t.schema, t.table, err)
		}
		out[table] = leaves
	}
	return out, nil
}

// relTriggerMissingSQL returns the first (table, trigger) of the arrays
// $1, $2 without an enabled trigger of that name on the table whose
// function's body carries the capture hash ($3); nothing when all are
// there. One statement for every table: it runs at the start of every run.
//
// The partitions of a partitioned table need them as well, at every level
// (a write naming a partition, or a partition that is partitioned itself,
// fires that table's statement triggers only), and a trigger
// must fire for ordinary sessions: enabled as origin ('O') or always
// ('A'), not disabled or replica-only.
const relTriggerMissingSQL = `
WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(tbl, trg, hash, n)),
x AS (SELECT u.n, u.trg, u.hash, u.tbl AS name, to_regclass(u.tbl) AS rel FROM u
      UNION ALL
      SELECT u.n, u.trg, u.hash, pt.relid::regclass::text, pt.relid FROM u, pg_partition_tree(to_regclass(u.tbl)) pt
      WHERE pt.relid <> to_regclass(u.tbl))
SELECT x.name, x.trg FROM x
WHERE NOT EXISTS (SELECT FROM pg_trigger tg JOIN pg_proc p ON p.oid = tg.tgfoid
                  WHERE tg.tgrelid = x.rel AND tg.tgname = x.trg AND tg.tgenabled IN ('O', 'A') AND strpos(p.prosrc, x.hash) > 0)
ORDER BY x.n, x.name LIMIT 1`

// checkRelationTriggers refuses an incremental relation job whose capture
// triggers are missing, disabled or were installed for other relations:
// its related changes would never reach the index.
func (c *compiled) checkRelationTriggers(ctx context.Context, db querier) error {
	var tables, triggers, hashes, names []string
	for _, t := range c.relTables() {
		fn := relFunction(c.spec.Job, t.schema, t.table)
		for _, suffix := range []string{"_ins", "_upd", "_del", "_trunc"} {
			tables, triggers, hashes = append(tables, q(t.schema, t.table)), append(triggers, fn+suffix), append(hashes, t.captureHash())
			names = append(names, t.schema+"."+t.table)
		}
	}
	var table, trigger string
	err := db.QueryRow(ctx, relTriggerMissingSQL, tables, triggers, hashes).Scan(&table, &trigger)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("job %s: read the capture triggers of its related tables: %w", c.spec.Job, err)
	}
	name := table
	if i := slices.Index(tables, table); i >= 0 {
		name = names[i]
	}
	return fmt.Errorf("%w: incremental job %s builds documents from %s, but its capture trigger %s is not installed there for these relations "+
		"(missing, disabled, or installed for other relations): changes of that table would never reach the index; "+
		"run `batcher follow-trigger --install --spec <this spec>` (again after a change of the relations' tables, names or joins), or use full mode",
		ErrSpec, c.spec.Job, name, trigger)
}

// resolveSQL turns the job's captures into work: it deletes the captures
// this snapshot sees and inserts the ids of the roots whose documents hold
// the captured rows (through the spec's joins, one subquery per node) into
// batch_relation_work. It returns the captures read and the roots queued.
func (c *compiled) resolveSQL() stmt {
	b := newBuilder()
	job := b.p("job", "text")
	var parts []string
	var walk func([]*relNode)
	walk = func(ns []*relNode) {
		for _, n := range ns {
			keys := "SELECT cap.key AS k FROM cap WHERE cap.node = " + b.c(n.path, "text")
			pk, typ := n.parentKeysOfRows(keys, n.types[n.childCol])
			parts = append(parts, c.rootsOf(b, n, pk, typ))
			if n.through != nil {
				keys := "SELECT cap.key AS k FROM cap WHERE cap.node = " + b.c(n.path+"#through", "text")
				parts = append(parts, c.rootsOf(b, n, keys, n.through.types[n.through.thParent]))
			}
			walk(n.children)
		}
	}
	walk(c.rels)
	// A related table truncated: every root in scope.
	parts = append(parts, "SELECT s."+q(c.spec.Source.ID)+"::text AS k FROM "+c.table+" s WHERE "+c.unpartitioned().scopeWhere(b)+
		" AND EXISTS (SELECT FROM cap WHERE cap.node = '"+relTruncated+"')")
	return b.stmt(`
WITH cap AS MATERIALIZED (DELETE FROM batch_relation_changes WHERE job = ` + job + ` RETURNING node, key),
roots AS (` + strings.Join(parts, "\nUNION\n") + `),
ins AS (INSERT INTO batch_relation_work (job, root_id) SELECT ` + job + `, roots.k FROM roots WHERE roots.k IS NOT NULL ON CONFLICT DO NOTHING RETURNING 1)
SELECT (SELECT count(*) FROM cap), (SELECT count(*) FROM ins)`)
}

// parentKeysOfRows maps keys of n's own rows (values of n.childCol, as
// text of type typ) to values of the parent's join column (n.parentCol),
// and returns them with their type.
//
// A key is read back as a value of the column it was captured from and
// compared with the other column as the document's join compares them
// (the two types may differ, checkComparable): cast to the other column's
// type, a numeric 10.00 captured for an integer join failed the whole
// resolution (and every run after it), a bigint beyond int4 overflowed.
func (n *relNode) parentKeysOfRows(keys, typ string) (string, string) {
	if n.through == nil {
		return keys, typ
	}
	t := n.through
	return "SELECT j." + q(t.thParent) + "::text AS k FROM " + t.table + " j WHERE j." + q(t.thChild) + " IN (SELECT z.k::" + typ + " FROM (" + keys + ") z)",
		t.types[t.thParent]
}

// rootsOf maps values of n.parentCol (keys, a select of text column k,
// values of type typ) to the root ids whose documents hold them, one join
// per level.
func (c *compiled) rootsOf(b *builder, n *relNode, keys, typ string) string {
	p := n.parent
	if p == nil {
		return "SELECT s." + q(c.spec.Source.ID) + "::text AS k FROM " + c.table + " s WHERE s." + q(n.parentCol) +
			" IN (SELECT z.k::" + typ + " FROM (" + keys + ") z) AND " + c.unpartitioned().scopeWhere(b)
	}
	// The parent's rows with these values, as values of its own join column.
	own := "SELECT p." + q(p.childCol) + "::text AS k FROM " + p.table + " p WHERE p." + q(n.parentCol) +
		" IN (SELECT z.k::" + typ + " FROM (" + keys + ") z)"
	pk, pt := p.parentKeysOfRows(own, p.types[p.childCol])
	return c.rootsOf(b, p, pk, pt)
}

// relWorkSQL takes up to $2 roots of job $1's work, deleting them, and
// returns their ids (in the chunk's transaction: a rollback puts them
// back). SKIP LOCKED: a sweeper whose lease was taken over still holding a
// chunk does not block its successor. The rows are deleted by the ctids
// the locking read returned (a TID scan: the rows stay put while locked),
// not by a join on root_id, which the planner, trusting the statistics of
// a queue that was empty when last analyzed, made a nested loop comparing
// every taken root with every queued one.
const relWorkSQL = `
WITH w AS (SELECT ctid AS t FROM batch_relation_work WHERE job = $1 ORDER BY root_id LIMIT $2 FOR UPDATE SKIP LOCKED),
d AS (DELETE FROM batch_relation_work x USING w WHERE x.ctid = w.t RETURNING x.root_id)
SELECT COALESCE(array_agg(root_id ORDER BY root_id), '{}') FROM d`

const (
	// relLockSharedSQL is taken by every chunk of a relation job that
	// writes documents, before its statement reads anything, and
	// relLockSQL by a quarantine retry: the retry waits for the chunks in
	// flight and the chunks after it read its commit, so rebuilds of one
	// root never overlap (see the top of this file).
	relLockSharedSQL = `SELECT pg_advisory_xact_lock_shared(hashtextextended('outboxrelay.rebuild:' || $1, 0))`
	relLockSQL       = `SELECT pg_advisory_xact_lock(hashtextextended('outboxrelay.rebuild:' || $1, 0))`
	// relPendingSQL: whether job $1 has captures or work left.
	relPendingSQL = `SELECT EXISTS (SELECT FROM batch_relation_changes WHERE job = $1) OR EXISTS (SELECT FROM batch_relation_work WHERE job = $1)`
	// relForgetSQL: a full run rebuilds every root, so the captures and
	// work it can see are covered.
	relForgetSQL = `WITH a AS (DELETE FROM batch_relation_changes WHERE job = $1) DELETE FROM batch_relation_work WHERE job = $1`
	// relWorkExistsSQL: whether job $1 has work.
	relWorkExistsSQL = `SELECT EXISTS (SELECT FROM batch_relation_work WHERE job = $1)`
	// relCheckpointSQL counts a relation chunk, fenced by the sweep lease.
	relCheckpointSQL = `
UPDATE batch_sweeps SET rebuilt_count = rebuilt_count + $4, rebuilt_changed = rebuilt_changed + $5, chunks = chunks + 1,
  checkpoint_at = now(), updated_at = now()` + sweepFence
)
