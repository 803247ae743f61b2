package manifest

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is what the manifest functions need: a *pgxpool.Pool or a
// *pgx.Conn.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// querier is a DB or a pgx.Tx.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Statements on outboxrelay's own tables. Statements on the user's table are
// built by targetSQL from quoted identifiers; every value is a bind
// parameter.
const (
	insertJobSQL = `
INSERT INTO manifest_jobs (job_id, tenant, spec, chunk_size, item_count, items_hash, content_hash)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id`

	insertItemsSQL = `
INSERT INTO manifest_items (job_id, seq, item_id, revision, fields)
SELECT $1, u.seq, u.item_id, u.revision, u.fields
FROM unnest($2::int[], $3::text[], $4::bigint[], $5::jsonb[]) AS u(seq, item_id, revision, fields)`

	selectJobSQL = `
SELECT job_id, tenant, spec, chunk_size, item_count, items_hash, content_hash, next_index, state,
       conflict, chunks_done, created_at, updated_at, finished_at
FROM manifest_jobs WHERE job_id = $1`

	lockJobSQL = selectJobSQL + ` FOR UPDATE`

	listJobsSQL = `
SELECT job_id, tenant, spec, chunk_size, item_count, items_hash, content_hash, next_index, state,
       conflict, chunks_done, created_at, updated_at, finished_at
FROM manifest_jobs ORDER BY created_at, job_id`

	selectItemsSQL = `
SELECT item_id, revision, fields FROM manifest_items WHERE job_id = $1 ORDER BY seq`

	// verifySQL lists the disagreements between the frozen items
	// [$2, $3) (= [verified, next_index)) and the audit rows from $2 on: an
	// item without audit, an audit row past next_index, or an audit row whose
	// id, revisions or fields differ from its item. The audit's fields are
	// the approved fields the chunk matched (copied from the item, not read
	// back from the row), so a trigger that rewrites a match field or the
	// session's TimeZone cannot make them differ.
	verifySQL = `
WITH i AS (
    SELECT seq, item_id, revision, fields FROM manifest_items
    WHERE job_id = $1 AND seq >= $2 AND seq < $3
), a AS (
    SELECT seq, item_id, before_revision, after_revision, fields FROM manifest_audit
    WHERE job_id = $1 AND seq >= $2
)
SELECT coalesce(i.seq, a.seq), i.seq IS NOT NULL, a.seq IS NOT NULL,
       coalesce(i.item_id, ''), coalesce(a.item_id, ''),
       coalesce(i.revision, 0), coalesce(a.before_revision, 0), coalesce(a.after_revision, 0),
       coalesce(i.fields = a.fields, false)
FROM i FULL JOIN a ON a.seq = i.seq
WHERE i.seq IS NULL OR a.seq IS NULL
   OR a.item_id <> i.item_id OR a.before_revision <> i.revision
   OR a.after_revision <> i.revision + 1 OR a.fields <> i.fields
ORDER BY 1
LIMIT 20`

	insertAuditSQL = `
INSERT INTO manifest_audit (job_id, seq, item_id, chunk, before_revision, after_revision, before_status, after_status, fields, after_fields)
SELECT $1, u.seq, u.item_id, $2, u.before_revision, u.after_revision, $3, $4, u.fields, u.after_fields
FROM unnest($5::int[], $6::text[], $7::bigint[], $8::bigint[], $9::jsonb[], $10::jsonb[])
     AS u(seq, item_id, before_revision, after_revision, fields, after_fields)`

	// advanceSQL is fenced by the next_index the chunk started
	// from: zero rows means someone moved the job under our lock, which
	// cannot happen unless the lock was lost.
	advanceSQL = `
UPDATE manifest_jobs
SET next_index = $3, state = $4, chunks_done = chunks_done + 1, updated_at = now(),
    finished_at = CASE WHEN $4 = 'succeeded' THEN now() END
WHERE job_id = $1 AND next_index = $2`

	markConflictedSQL = `
UPDATE manifest_jobs
SET state = 'conflicted', conflict = $2, updated_at = now(), finished_at = now()
WHERE job_id = $1`

	// columnsSQL resolves the target's columns and their types;
	// $1 is the quoted table name, so to_regclass resolves it exactly as
	// the statements will.
	columnsSQL = `
SELECT a.attname, a.atttypid::regtype::text
FROM pg_attribute a
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY($2)`

	tableExistsSQL = `SELECT to_regclass($1) IS NOT NULL`

	// chunkSettingsSQL starts a chunk transaction: the server ends the
	// session of a drainer that sits idle in it (stuck outside the server)
	// for longer than $1, which rolls the chunk back and frees the job row;
	// values are rendered and read in UTC whoever drains.
	chunkSettingsSQL = `SELECT set_config('idle_in_transaction_session_timeout', $1, true), set_config('TimeZone', 'UTC', true)`

	// reportSettingsSQL: the report renders values in UTC too.
	reportSettingsSQL = `SELECT set_config('TimeZone', 'UTC', true)`
)

// targetSQL holds the statements on the user's table of one job,
// built from quoted identifiers and the id column's type as the catalog
// names it (so the id comparison uses the table's index).
type targetSQL struct {
	table  string // quoted, maybe schema-qualified
	fields []string

	update  string // args: job, from, to, new status, tenant, old status, field keys...
	explain string // args: job, from, to, field keys...
	report  string // args: job, field keys...
	// checkFields: args: the items' fields as jsonb[].
	checkFields string
}

// resolveTarget checks that the table and columns exist and builds
// the statements.
func resolveTarget(ctx context.Context, q querier, t Target) (*targetSQL, error) {
	ident := pgx.Identifier{t.Table}
	if t.Schema != "" {
		ident = pgx.Identifier{t.Schema, t.Table}
	}
	table := ident.Sanitize()
	var exists bool
	if err := q.QueryRow(ctx, tableExistsSQL, table).Scan(&exists); err != nil {
		return nil, fmt.Errorf("look up target table %s: %w", table, err)
	}
	if !exists {
		return nil, fmt.Errorf("target table %s does not exist", table)
	}
	want := append([]string{t.IDColumn, t.TenantColumn, t.RevisionColumn, t.StatusColumn}, t.MatchFields...)
	rows, err := q.Query(ctx, columnsSQL, table, want)
	if err != nil {
		return nil, fmt.Errorf("look up columns of %s: %w", table, err)
	}
	types := map[string]string{}
	var name, typ string
	_, err = pgx.ForEachRow(rows, []any{&name, &typ}, func() error {
		types[name] = typ
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("look up columns of %s: %w", table, err)
	}
	var missing []string
	for _, c := range want {
		if _, ok := types[c]; !ok {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("target table %s has no column(s) %s", table, strings.Join(missing, ", "))
	}
	q1 := func(c string) string { return pgx.Identifier{c}.Sanitize() }
	id, tenant, rev, status := q1(t.IDColumn), q1(t.TenantColumn), q1(t.RevisionColumn), q1(t.StatusColumn)
	// The id type comes from the catalog, not from the file: regtype's
	// output is a valid, quoted type name.
	idType := types[t.IDColumn]

	// fieldsJSON renders the match fields of alias as a jsonb object (what
	// the audit and the messages show); the keys are bind parameters.
	fieldsJSON := func(alias string, firstParam int) string {
		if len(t.MatchFields) == 0 {
			return `'{}'::jsonb`
		}
		parts := make([]string, 0, 2*len(t.MatchFields))
		for i, f := range t.MatchFields {
			parts = append(parts, fmt.Sprintf("$%d::text", firstParam+i), alias+"."+q1(f))
		}
		return "jsonb_build_object(" + strings.Join(parts, ", ") + ")"
	}
	// The match fields are compared as typed values, never as text: the
	// expected values (jsonb) become a record of the target's row type
	// (jsonb_populate_record, PostgreSQL's own conversion), and each column
	// is compared with its type's equality. A timestamptz is the same
	// instant whatever offset the file or the session's TimeZone wrote.
	sameFields := func(a, b string) string {
		if len(t.MatchFields) == 0 {
			return "true"
		}
		parts := make([]string, len(t.MatchFields))
		for i, f := range t.MatchFields {
			parts[i] = fmt.Sprintf("%[1]s.%[3]s IS NOT DISTINCT FROM %[2]s.%[3]s", a, b, q1(f))
		}
		return strings.Join(parts, " AND ")
	}
	// badFields lists the names of the match fields that differ.
	badFields := func(a, b string, firstParam int) string {
		if len(t.MatchFields) == 0 {
			return `'{}'::text[]`
		}
		parts := make([]string, len(t.MatchFields))
		for i, f := range t.MatchFields {
			parts[i] = fmt.Sprintf("CASE WHEN %[1]s.%[3]s IS DISTINCT FROM %[2]s.%[3]s THEN $%[4]d::text END", a, b, q1(f), firstParam+i)
		}
		return "array_remove(ARRAY[" + strings.Join(parts, ", ") + "], NULL)"
	}
	expected := func(fields string) string {
		return fmt.Sprintf("jsonb_populate_record(NULL::%s, %s)", table, fields)
	}

	s := &targetSQL{table: table, fields: t.MatchFields}
	// One set-based conditional UPDATE for the chunk: every condition of the
	// approval in the WHERE clause, the chunk taken from the frozen items by
	// position. RETURNING says which items changed, with the approved fields
	// (what the chunk matched, audited as fields) and the fields as the row
	// holds them after the UPDATE and its triggers (audited as after_fields).
	s.update = fmt.Sprintf(`
UPDATE %[1]s AS t
SET %[5]s = $4, %[4]s = t.%[4]s + 1
FROM manifest_items AS u
CROSS JOIN LATERAL %[8]s AS e
WHERE u.job_id = $1 AND u.seq >= $2 AND u.seq < $3
  AND t.%[2]s = u.item_id::%[6]s
  AND t.%[3]s::text = $5
  AND t.%[5]s::text = $6
  AND t.%[4]s = u.revision
  AND %[9]s
RETURNING u.seq, u.item_id, u.revision, t.%[4]s::bigint, u.fields, %[7]s, to_jsonb(t)`,
		table, id, tenant, rev, status, idType, fieldsJSON("t", 7), expected("u.fields"), sameFields("t", "e"))

	// An id may repeat across tenants (a key of (tenant, id)): the job's
	// tenant's row is the item's; another tenant's explains it only when
	// the job's tenant has none (the row moved to another tenant).
	s.explain = fmt.Sprintf(`
SELECT DISTINCT ON (u.seq) u.seq, u.item_id, u.revision, u.fields,
       t.%[2]s IS NOT NULL, coalesce(t.%[3]s::text, ''), coalesce(t.%[4]s::bigint, 0), coalesce(t.%[5]s::text, ''),
       %[7]s, %[9]s
FROM manifest_items AS u
CROSS JOIN LATERAL %[8]s AS e
LEFT JOIN %[1]s AS t ON t.%[2]s = u.item_id::%[6]s
WHERE u.job_id = $1 AND u.seq >= $2 AND u.seq < $3
ORDER BY u.seq, t.%[3]s::text = (SELECT j.tenant FROM manifest_jobs AS j WHERE j.job_id = $1) DESC NULLS LAST`,
		table, id, tenant, rev, status, idType, fieldsJSON("t", 4), expected("u.fields"), badFields("t", "e", 4))

	// The report compares each committed row with what its chunk left:
	// after_fields (NULL in audit rows written before migration 009, whose
	// fields were the values after the UPDATE). The row is the job's
	// tenant's with the item's id (another tenant's with the same id is not
	// this item; a row moved to another tenant is missing).
	s.report = fmt.Sprintf(`
SELECT j.next_index, j.state, i.seq, i.item_id, a.seq IS NOT NULL,
       coalesce(a.after_revision, i.revision + 1), w.fields,
       t.%[2]s IS NOT NULL, coalesce(t.%[3]s::text, ''), coalesce(t.%[4]s::bigint, 0), coalesce(t.%[5]s::text, ''),
       %[7]s, %[9]s
FROM manifest_jobs AS j
JOIN manifest_items AS i ON i.job_id = j.job_id
LEFT JOIN manifest_audit AS a ON a.job_id = i.job_id AND a.seq = i.seq
CROSS JOIN LATERAL (SELECT coalesce(a.after_fields, a.fields, i.fields) AS fields) AS w
CROSS JOIN LATERAL %[8]s AS e
LEFT JOIN %[1]s AS t ON i.seq < j.next_index AND t.%[2]s = i.item_id::%[6]s AND t.%[3]s::text = j.tenant
WHERE j.job_id = $1
ORDER BY i.seq`,
		table, id, tenant, rev, status, idType, fieldsJSON("t", 2), expected("w.fields"), badFields("t", "e", 2))

	// checkFields converts every item's fields to the column types and
	// compares them with themselves, so a value that does not convert or a
	// type without equality is refused at registration, not at a drain.
	s.checkFields = fmt.Sprintf(`
SELECT count(*) FROM unnest($1::jsonb[]) AS u(fields)
CROSS JOIN LATERAL %[1]s AS e
WHERE NOT (%[2]s)`, expected("u.fields"), sameFields("e", "e"))
	return s, nil
}

// keyArgs appends the match field names, which the statements take as the
// jsonb keys.
func (s *targetSQL) keyArgs(args ...any) []any {
	for _, f := range s.fields {
		args = append(args, f)
	}
	return args
}
