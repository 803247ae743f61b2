package batch

import (
	"context"
	"fmt"
)

// Behind counts the rows of a job's scope whose state in the source table is
// not what normalized_records holds at the spec's processor version: what a
// new run of the job would still have to carry to the index. See
// [CountBehind].
type Behind struct {
	// Changed: the row's version or soft-delete state differs from its
	// normalized row at the processor version (updated or soft-deleted
	// after a run read it).
	Changed int64
	// Missing: live rows without a normalized row (inserted after the
	// boundary of the last run).
	Missing int64
	// Gone: live normalized rows at the processor version whose source row
	// no longer exists or left the scope (hard deletes; only with
	// Spec.Vanished = delete, the only case where a run turns them into
	// deletes).
	Gone int64
}

// Total is Changed + Missing + Gone.
func (b Behind) Total() int64 { return b.Changed + b.Missing + b.Gone }

// CountBehind compares the job's scope in the source table (s's filter and
// explicit partition list; every partition) with normalized_records at
// s.ProcessorVersion. Rows normalized at another processor version are not
// counted (they are not rebuilt yet, which the caller sees in
// normalized_records), nor are rows with an open quarantine entry of a run
// at that version (quarantined, see [ListQuarantine]), nor soft-deleted rows
// the read model has as deleted or not at all (searches find neither). It
// reads the whole scope and the source's normalized rows: one statement
// each, cheap next to a run, not free on a large table.
func CountBehind(ctx context.Context, db DB, s Spec) (Behind, error) {
	var out Behind
	s = s.withDefaults()
	c, err := compile(ctx, db, s)
	if err != nil {
		return out, err
	}
	a := &args{Job: s.Job, Source: s.SourceName, PV: s.ProcessorVersion, PKeys: s.Source.Partitions}
	src, gone := c.behindSQL()
	if err := db.QueryRow(ctx, src.sql, src.bind(a)...).Scan(&out.Changed, &out.Missing); err != nil {
		return out, fmt.Errorf("compare the scope of job %s with normalized_records: %w", s.Job, err)
	}
	if s.Vanished == VanishedDelete {
		if err := db.QueryRow(ctx, gone.sql, gone.bind(a)...).Scan(&out.Gone); err != nil {
			return out, fmt.Errorf("count the vanished rows of job %s: %w", s.Job, err)
		}
	}
	return out, nil
}

// behindSQL returns the two statements of [CountBehind]: over the scope,
// the changed and missing rows; over normalized_records, the gone ones.
// The scope is the sweep's: the filter, and an explicit partition list
// instead of one partition.
func (c *compiled) behindSQL() (src, gone stmt) {
	scope := func(b *builder) string {
		filter := *c
		filter.spec.Source.Partition = ""
		w := filter.scopeWhere(b)
		if p := c.spec.Source.Partition; p != "" && len(c.spec.Source.Partitions) > 0 {
			w += " AND s." + q(p) + " = ANY(" + b.p("pkeys", "text[]") + "::" + c.types[p] + "[])"
		}
		return w
	}
	b := newBuilder()
	where := scope(b)
	src = b.stmt(`
WITH x AS (
  SELECT s.` + q(c.spec.Source.ID) + `::text AS id, s.` + q(c.spec.Source.Version) + `::bigint AS ver, ` + c.deletedExpr() + ` AS del
  FROM ` + c.table + ` s WHERE ` + where + `
), quarantined AS (
  SELECT DISTINCT bq.source_id FROM batch_quarantine bq
  WHERE bq.job = ` + b.p("job", "text") + ` AND bq.resolved_at IS NULL
    AND bq.logical_run_id IN (SELECT r.logical_run_id FROM batch_runs r WHERE r.job = ` + b.p("job", "text") + ` AND r.processor_version = ` + b.p("pv", "text") + `)
)
SELECT count(*) FILTER (WHERE n.source_id IS NOT NULL AND n.processor_version = ` + b.p("pv", "text") + `
                          AND NOT (x.del AND n.deleted)
                          AND (n.source_version - n.version_offset <> x.ver OR n.deleted <> x.del)),
       count(*) FILTER (WHERE n.source_id IS NULL AND NOT x.del)
FROM x
LEFT JOIN normalized_records n ON n.source = ` + b.p("source", "text") + ` AND n.source_id = x.id
WHERE x.id NOT IN (SELECT source_id FROM quarantined)`)

	b = newBuilder()
	where = scope(b)
	gone = b.stmt(`
SELECT count(*) FROM normalized_records n
WHERE n.source = ` + b.p("source", "text") + ` AND n.processor_version = ` + b.p("pv", "text") + ` AND NOT n.deleted
  AND NOT EXISTS (SELECT FROM ` + c.table + ` s WHERE s.` + q(c.spec.Source.ID) + ` = n.source_id::` + c.types[c.spec.Source.ID] + ` AND ` + where + `)`)
	return src, gone
}
