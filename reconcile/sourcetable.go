package reconcile

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/sink"
)

// The source-table comparison ([RunSourceTable]) compares the index with
// the job's source table itself instead of normalized_records: a row
// hard-deleted from the source, or moved out of the job's filter, stays live
// in normalized_records and in the index when no run sweeps it
// (incremental jobs, vanished: keep), and the two agree, so [Run] cannot
// see it. Here the scope of the job's spec (batch.CompileScopeRows: its
// table, filter and partition list) is one side, the index's live
// documents of the job's aggregate type the other.
//
// It works as [Run] does: per bucket (the id's hash modulo sink.Buckets),
// a count and a sum of hash(id, index version, live, processor version) on
// both sides (the index version is the source version plus the row's
// version_offset in normalized_records), then id by id only in the buckets
// that differ, a group of buckets at a time (about sourceTableGroupDocs
// ids on each side), so a large table is never held in memory at once.

// sourceTableGroupDocs bounds the documents read id by id per group of
// differing buckets.
const sourceTableGroupDocs = 100_000

// SourceReport is the outcome of [RunSourceTable].
type SourceReport struct {
	Job           string `json:"job"`
	Table         string `json:"table"`
	Source        string `json:"source"`
	AggregateType string `json:"aggregate_type"`
	// SourceRows counts the live rows in the job's scope (not soft-deleted,
	// no open quarantine entry); IndexDocs the index's live documents of
	// the job's aggregate type (or without one). In the buckets that
	// differed both are what the id-by-id read found, not the summaries.
	SourceRows       int64 `json:"source_rows"`
	IndexDocs        int64 `json:"index_docs"`
	DifferingBuckets []int `json:"differing_buckets"`
	// Gone: live in the index, but the source row is gone (hard-deleted)
	// or out of the job's scope (filter, partition list). The key finding:
	// no other check sees it in a vanished: keep job.
	GoneCount int     `json:"gone_count"`
	Gone      []Drift `json:"gone"`
	// Missing: a live row in scope without a live document.
	MissingCount int     `json:"missing_count"`
	Missing      []Drift `json:"missing"`
	// Behind: the document is at an older version than the row (or live
	// while the row is soft-deleted).
	BehindCount int     `json:"behind_count"`
	Behind      []Drift `json:"behind"`
	// Quarantined counts the live rows in scope left out because a run at
	// the job's processor version quarantined them (see batcher
	// quarantine).
	Quarantined int64         `json:"quarantined"`
	DocsRead    int64         `json:"docs_read"`
	Took        time.Duration `json:"took_ns"`
}

// Clean reports whether the index matches the source table.
func (r SourceReport) Clean() bool { return r.GoneCount+r.MissingCount+r.BehindCount == 0 }

// srcRow is a row of the scope as the index should hold it.
type srcRow struct {
	version int64 // source version + version_offset
	deleted bool
}

// RunSourceTable compares the job's scope in its source table (spec, as
// stored: batch.LoadJobSpec) with the index cfg.Index. cfg.Source,
// cfg.AggregateType and cfg.ProcessorVersion default to the spec's.
func RunSourceTable(ctx context.Context, cfg Config, spec batch.Spec) (SourceReport, error) {
	if err := cfg.validate(); err != nil {
		return SourceReport{}, err
	}
	start := time.Now()
	cfg.Source = cmp.Or(cfg.Source, spec.SourceName, spec.Source.Table)
	cfg.AggregateType = cmp.Or(spec.AggregateType, cfg.AggregateType, cfg.Source)
	cfg.ProcessorVersion = cmp.Or(cfg.ProcessorVersion, spec.ProcessorVersion)
	rep := SourceReport{Job: spec.Job, Source: cfg.Source, AggregateType: cfg.AggregateType}
	scope, err := batch.CompileScopeRows(ctx, cfg.DB, spec)
	if err != nil {
		return rep, fmt.Errorf("the scope of job %s: %w", spec.Job, err)
	}
	rep.Table = scope.Table
	own, err := ownDocuments(ctx, cfg)
	if err != nil {
		return rep, err
	}
	live := elastic.NewBoolQuery().Filter(own).MustNot(elastic.NewTermQuery(sink.FieldDeleted, true))
	q := newScopeQuery(scope, cfg, spec.Job)

	var dbSide [sink.Buckets]summary
	rows, err := cfg.DB.Query(ctx, `SELECT `+bucketSQL+`, count(*), coalesce(sum(`+idvSQL+`), 0)::bigint
FROM (SELECT id AS source_id, version AS source_version, false AS deleted, `+q.pv+` AS processor_version FROM (`+q.rows+`) r WHERE NOT r.deleted AND NOT r.quarantined) x
GROUP BY 1`, q.args...)
	if err != nil {
		return rep, fmt.Errorf("summarise the scope of job %s in %s: %w", spec.Job, scope.Table, err)
	}
	for rows.Next() {
		var b int
		var s summary
		if err := rows.Scan(&b, &s.count, &s.sum); err != nil {
			rows.Close()
			return rep, err
		}
		dbSide[b] = s
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return rep, fmt.Errorf("summarise the scope of job %s in %s: %w", spec.Job, scope.Table, err)
	}
	if err := cfg.DB.QueryRow(ctx, `SELECT count(*) FROM (`+q.rows+`) r WHERE NOT r.deleted AND r.quarantined`, q.args...).Scan(&rep.Quarantined); err != nil {
		return rep, fmt.Errorf("count the quarantined rows of job %s: %w", spec.Job, err)
	}
	ixSide, err := indexSummaries(ctx, cfg, live)
	if err != nil {
		return rep, err
	}
	for b := range sink.Buckets {
		rep.SourceRows += dbSide[b].count
		rep.IndexDocs += ixSide[b].count
		if cfg.Full || dbSide[b] != ixSide[b] {
			rep.DifferingBuckets = append(rep.DifferingBuckets, b)
		}
	}
	if cfg.afterSummaries != nil {
		cfg.afterSummaries()
	}
	// The groups read these buckets again, id by id, and count what they
	// read: the index may have moved since the summaries.
	for _, b := range rep.DifferingBuckets {
		rep.SourceRows -= dbSide[b].count
		rep.IndexDocs -= ixSide[b].count
	}
	// Groups of differing buckets, each about sourceTableGroupDocs
	// documents on its larger side.
	var group []int
	var weight int64
	flush := func() error {
		if len(group) == 0 {
			return nil
		}
		err := sourceTableGroup(ctx, cfg, q, own, group, &rep)
		group, weight = nil, 0
		return err
	}
	for _, b := range rep.DifferingBuckets {
		w := max(dbSide[b].count, ixSide[b].count)
		if len(group) > 0 && weight+w > sourceTableGroupDocs {
			if err := flush(); err != nil {
				return rep, err
			}
		}
		group, weight = append(group, b), weight+w
	}
	if err := flush(); err != nil {
		return rep, err
	}
	for _, l := range [][]Drift{rep.Gone, rep.Missing, rep.Behind} {
		slices.SortFunc(l, func(a, b Drift) int { return cmp.Compare(a.ID, b.ID) })
	}
	rep.Took = time.Since(start)
	return rep, nil
}

// scopeQuery is the job's scope with what the comparison needs of each
// row: id, index version, deleted, quarantined (an uncorrelated IN: the
// job's open quarantine entries are read once, into a hash).
type scopeQuery struct {
	rows string
	args []any
	pv   string // the placeholder of the processor version
	next int    // the next free placeholder number
}

func newScopeQuery(scope batch.ScopeRows, cfg Config, job string) scopeQuery {
	n := len(scope.Args)
	ph := func(i int) string { return "$" + strconv.Itoa(n+i) }
	q := scopeQuery{args: append(slices.Clone(scope.Args), cfg.Source, cfg.ProcessorVersion, job), pv: ph(2) + "::text", next: n + 4}
	q.rows = `SELECT s.id, s.version + coalesce(n.version_offset, 0) AS version, s.deleted,
  s.id IN (SELECT bq.source_id FROM batch_quarantine bq WHERE bq.job = ` + ph(3) + `::text AND bq.resolved_at IS NULL
           AND bq.logical_run_id IN (SELECT r.logical_run_id FROM batch_runs r WHERE r.job = ` + ph(3) + `::text AND r.processor_version = ` + ph(2) + `::text)) AS quarantined
FROM (` + scope.SQL + `) s
LEFT JOIN normalized_records n ON n.source = ` + ph(1) + `::text AND n.source_id = s.id`
	return q
}

// sourceTableGroup compares one group of buckets id by id.
func sourceTableGroup(ctx context.Context, cfg Config, q scopeQuery, own elastic.Query, buckets []int, rep *SourceReport) error {
	src := map[string]srcRow{}
	rows, err := cfg.DB.Query(ctx, `SELECT id, version, deleted FROM (`+q.rows+`) r
WHERE NOT r.quarantined AND `+bucketOf("r.id")+` = ANY($`+strconv.Itoa(q.next)+`::int[])`, append(slices.Clone(q.args), buckets)...)
	if err != nil {
		return fmt.Errorf("read differing buckets of the source table: %w", err)
	}
	for rows.Next() {
		var id string
		var s srcRow
		if err := rows.Scan(&id, &s.version, &s.deleted); err != nil {
			rows.Close()
			return err
		}
		src[id] = s
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read differing buckets of the source table: %w", err)
	}
	idx, read, err := scrollBuckets(ctx, cfg, own, buckets)
	if err != nil {
		return err
	}
	rep.DocsRead += read
	add := func(count *int, list *[]Drift, d Drift) {
		*count++
		if len(*list) < cfg.Limit {
			*list = append(*list, d)
		}
	}
	for _, s := range src {
		if !s.deleted {
			rep.SourceRows++
		}
	}
	for id, i := range idx {
		if i.deleted {
			continue
		}
		rep.IndexDocs++
		s, ok := src[id]
		switch {
		case !ok:
			add(&rep.GoneCount, &rep.Gone, i.drift(Drift{ID: id}))
		case s.deleted || i.version < s.version:
			add(&rep.BehindCount, &rep.Behind, i.drift(Drift{ID: id, SourceVersion: s.version, SourceDeleted: s.deleted}))
		}
	}
	for id, s := range src {
		if s.deleted {
			continue
		}
		if i, ok := idx[id]; !ok || i.deleted {
			add(&rep.MissingCount, &rep.Missing, i.drift(Drift{ID: id, SourceVersion: s.version}))
		}
	}
	return nil
}

// bucketOf is bucketSQL over another text expression.
func bucketOf(expr string) string {
	return `((('x' || substr(md5(` + expr + `), 1, 8))::bit(32)::int & 2147483647) % ` + strconv.Itoa(sink.Buckets) + `)`
}

// GoneRepair says what [RepairGone] did.
type GoneRepair struct {
	// Enqueued counts the tombstones written to normalized_records, each
	// with its delete event in the outbox.
	Enqueued int64 `json:"enqueued"`
	// IDs are the first of them (Config.Limit).
	IDs []string `json:"ids,omitempty"`
	// KeptUnowned: documents of another aggregate type or none (another
	// producer's, perhaps); never deleted.
	KeptUnowned int `json:"kept_unowned,omitempty"`
	// KeptBack: the row is in scope again, or its normalized row changed,
	// since the comparison; the pipeline carries it.
	KeptBack int `json:"kept_back,omitempty"`
	// Pending: normalized_records holds a tombstone above the document's
	// version already (a repair or a sweep wrote it); its delete event is on
	// its way, nothing is written again.
	Pending int `json:"pending,omitempty"`
}

// RepairGone deletes the gone documents of rep through the pipeline, as
// the sweep of a full run does: in one transaction per batch of ids, each
// id's row in normalized_records becomes a tombstone (no document,
// deleted, vanished) with one delete event in the outbox, and the
// publisher and the indexer carry the delete. The tombstone's version is
// one above both the normalized row's and the document's version in the
// index, so the engine's external versioning accepts the delete (a
// document without a normalized row gets a tombstone row at its index
// version + 1). The write is fenced: an id whose source row is in scope
// again, or whose normalized row changed since this statement read it, is
// left alone; an id whose normalized row is a tombstone above the document
// already is pending (its delete is on its way): run twice, the second
// writes nothing. Only documents of
// Config.AggregateType are deleted; more than MaxRemoveFloor and
// MaxRemoveShare of the documents compared needs Config.Force. A gone list
// capped by Config.Limit leaves the rest to the next pass.
func RepairGone(ctx context.Context, cfg Config, spec batch.Spec, rep SourceReport) (GoneRepair, error) {
	var res GoneRepair
	if err := cfg.validate(); err != nil {
		return res, err
	}
	cfg.Source = cmp.Or(rep.Source, cfg.Source)
	cfg.AggregateType = cmp.Or(rep.AggregateType, cfg.AggregateType)
	cfg.ProcessorVersion = cmp.Or(cfg.ProcessorVersion, spec.ProcessorVersion)
	var ids []string
	var vers []int64
	for _, d := range rep.Gone {
		if d.IndexAggregateType != cfg.AggregateType {
			res.KeptUnowned++
			continue
		}
		ids, vers = append(ids, d.ID), append(vers, d.IndexVersion)
	}
	if len(ids) == 0 {
		return res, nil
	}
	planned := len(ids) + max(rep.GoneCount-len(rep.Gone), 0)
	if !cfg.Force && planned > MaxRemoveFloor && float64(planned) > MaxRemoveShare*float64(rep.IndexDocs) {
		return res, fmt.Errorf("%w: %d of %d live documents of job %s in %s are gone from %s; check the spec's scope and the index, or set Force",
			ErrRepairTooLarge, planned, rep.IndexDocs, spec.Job, cfg.Index, rep.Table)
	}
	scope, err := batch.CompileScopeRows(ctx, cfg.DB, spec)
	if err != nil {
		return res, fmt.Errorf("the scope of job %s: %w", spec.Job, err)
	}
	sql, bind := repairGoneSQL(scope, cfg)
	const batchSize = 1000
	for lo := 0; lo < len(ids); lo += batchSize {
		hi := min(lo+batchSize, len(ids))
		err := pgx.BeginFunc(ctx, cfg.DB, func(tx pgx.Tx) error {
			var done []string
			var pending int64
			if err := tx.QueryRow(ctx, sql, bind(ids[lo:hi], vers[lo:hi])...).Scan(&done, &pending); err != nil {
				return err
			}
			res.Enqueued += int64(len(done))
			res.Pending += int(pending)
			res.KeptBack += hi - lo - len(done) - int(pending)
			for _, id := range done {
				if len(res.IDs) < cfg.Limit {
					res.IDs = append(res.IDs, id)
				}
			}
			return nil
		})
		if err != nil {
			return res, fmt.Errorf("write tombstones and delete events for %d gone ids: %w", hi-lo, err)
		}
	}
	slices.Sort(res.IDs)
	return res, nil
}

// repairGoneSQL is the statement of [RepairGone]: its last two parameters
// are the ids and their versions in the index. It returns the ids it wrote
// a tombstone for, and how many already had one above the document.
func repairGoneSQL(scope batch.ScopeRows, cfg Config) (string, func(ids []string, vers []int64) []any) {
	n := len(scope.Args)
	ph := func(i int) string { return "$" + strconv.Itoa(n+i) }
	// Parameters: the scope's, the ids ($n+1, ByIDsSQL's own), source,
	// processor version, topic, the ids' index versions, aggregate type,
	// the processor version header's name.
	bind := func(ids []string, vers []int64) []any {
		return append(slices.Clone(scope.Args), ids, cfg.Source, cfg.ProcessorVersion, cfg.Topic, vers, cfg.AggregateType, outbox.HeaderProcessorVersion)
	}
	ids, vers := ph(1), ph(5)
	src, pv := ph(2)+"::text", ph(3)+"::text"
	sql := `
WITH g AS (
  SELECT u.id, u.iver FROM unnest(` + ids + `::text[], ` + vers + `::bigint[]) AS u(id, iver)
  WHERE u.id NOT IN (SELECT p.id FROM (` + scope.ByIDsSQL + `) p)
), cur AS (
  SELECT g.id, g.iver, n.source_version AS nver, n.deleted AS ndel FROM g
  LEFT JOIN normalized_records n ON n.source = ` + src + ` AND n.source_id = g.id
), todo AS (
  -- A tombstone above the document's version is written already: its
  -- delete is on its way.
  SELECT * FROM cur WHERE NOT (coalesce(cur.ndel, false) AND cur.nver > cur.iver)
), up AS (
  UPDATE normalized_records n
  SET document = NULL, deleted = true, source_version = greatest(cur.nver, cur.iver) + 1,
      processor_version = ` + pv + `, vanished = true, updated_at = now()
  FROM todo cur
  WHERE cur.nver IS NOT NULL AND n.source = ` + src + ` AND n.source_id = cur.id
    AND n.source_version = cur.nver AND n.deleted = cur.ndel
  RETURNING n.source_id, n.source_version, n.document, n.deleted
), ins AS (
  INSERT INTO normalized_records AS n (source, source_id, document, source_version, processor_version, deleted, vanished, updated_at)
  SELECT ` + src + `, cur.id, NULL, cur.iver + 1, ` + pv + `, true, true, now() FROM todo cur WHERE cur.nver IS NULL
  ON CONFLICT (source, source_id) DO NOTHING
  RETURNING n.source_id, n.source_version, n.document, n.deleted
), tomb AS (
  SELECT * FROM up UNION ALL SELECT * FROM ins
), ev AS (
` + outbox.InsertEventsSQL(outbox.EventSelect{
		EventID:          `outboxrelay_event_id(` + src + `, source_id, source_version, ` + pv + `)`,
		Topic:            ph(4) + "::text",
		AggregateType:    ph(6) + "::text",
		AggregateID:      "source_id",
		AggregateVersion: "source_version",
		EventType:        `'delete'`,
		Payload:          "to_json(document)",
		Headers:          `jsonb_build_object(` + ph(7) + `::text, ` + pv + `)`,
	}, "tomb") + `
  RETURNING 1
)
SELECT coalesce((SELECT array_agg(source_id) FROM tomb), '{}'), (SELECT count(*) FROM cur) - (SELECT count(*) FROM todo)`
	return sql, bind
}
