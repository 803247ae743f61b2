// Package reconcile compares the read model in PostgreSQL
// (normalized_records) with the search index and repairs the difference.
//
// Both sides are summarised per bucket — the id's hash modulo
// [sink.Buckets] — as a count and a sum of hash(id, version, deleted,
// processor version).
// PostgreSQL answers with one GROUP BY over normalized_records; the engine
// with one terms aggregation over the fields the indexer writes into every
// document ([sink.FieldBucket], [sink.FieldIDV]). Only buckets whose
// summaries differ are read id by id, from both sides, so a clean index of
// millions of documents costs two aggregations and no scan of documents.
//
// A drifted id is one of:
//   - missing: in normalized_records, not in the index;
//   - stale: in both, but the index holds another version, deleted-ness or
//     processor version (a document built by another normalizer);
//   - extra: in the index, not in normalized_records.
//
// The summaries trust the _idv field stored with each document; a partial
// update made by hand keeps it while bumping the engine's _version, so
// Config.Full compares every document's real _version (a full read of both
// sides) for when the index may have been edited behind the pipeline's back.
//
// [Repair] re-enqueues an outbox event for every missing or stale id, built
// from normalized_records at its current version, so the ordinary pipeline
// (publisher, indexer with external versions) fixes the index; extras are
// deleted from the index directly, with care: an index may hold other
// producers' documents (only those of Config.AggregateType, or without an
// aggregate type, are compared, and only the former deleted), a document
// may be written between the comparison and the delete (deletes carry the
// scroll's if_seq_no/if_primary_term, and extras are re-checked in
// normalized_records), and a tombstone is never deleted (a late replay of an
// older upsert would bring the row back). Reconcile when the pipeline is drained
// (publisher backlog and consumer lag at zero): events still in flight
// show up as drift.
//
//	rep, err := reconcile.Run(ctx, reconcile.Config{DB: pool, Search: es, Index: "records-write", Source: "source_records"})
//	fmt.Println(rep.Clean(), len(rep.Missing), len(rep.Stale), len(rep.Extra))
package reconcile

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/sink"
)

// [sink.Bucket] and [sink.IDV] in SQL: the first 32 bits of md5 as a
// signed int, masked.
const (
	bucketSQL = `((('x' || substr(md5(source_id), 1, 8))::bit(32)::int & 2147483647) % 1024)`
	idvSQL    = `(('x' || substr(md5(source_id || ':' || source_version || ':' || deleted::int || CASE WHEN coalesce(processor_version, '') = '' THEN '' ELSE ':' || processor_version END), 1, 8))::bit(32)::int & 2147483647)::bigint`
)

// Config says what to compare.
type Config struct {
	// DB holds normalized_records. Required.
	DB *pgxpool.Pool
	// Search is the engine client. Required.
	Search *elastic.Client
	// Index is an index or an unfiltered alias (tombstones included), e.g.
	// the write alias "records-write". Required.
	Index string
	// Source is normalized_records.source to compare. "" means the one
	// source normalized_records holds, or, when it holds several, the one
	// whose aggregate type the index holds; [Run] refuses to guess beyond
	// that, and refuses a Source without rows (every document would look
	// extra).
	Source string
	// Topic receives repair events. Default "outboxrelay.records".
	Topic string
	// AggregateType of repair events, and of the documents compared: only
	// documents whose sink.FieldAggregateType is AggregateType, or that have
	// none (written before the indexer recorded it, or by hand), are
	// compared; other producers' documents in the same index are not.
	// Default: Source.
	AggregateType string
	// Limit caps the drifted ids listed per kind (counts stay exact).
	// Default 10,000.
	Limit int
	// DeleteGC is how long the engine remembers a delete (the index's
	// index.gc_deletes). 0 = read it from the index.
	DeleteGC time.Duration
	// Logger, if set, tells what Repair waits for.
	Logger *slog.Logger
	// ProcessorVersion is the version the job's current spec expects (the
	// generation compared is built by it). When set, [Report] counts the
	// normalized rows of another version, and [Repair] replaces documents
	// of another version that sit at the row's source version. "" means no
	// expectation: processor versions still feed the fingerprint, but such
	// documents are only reported.
	ProcessorVersion string
	// Full reads every bucket id by id and compares the engine's real
	// _version, instead of trusting the summaries. The summaries hash the
	// _idv field the indexer stored, so a partial update made by hand
	// (which bumps _version but keeps _idv) only shows up in a full pass.
	Full bool
	// Force lets [Repair] delete more than MaxRemoveShare of the compared
	// documents (and more than MaxRemoveFloor). Without it such a repair
	// is refused with [ErrRepairTooLarge]: it usually means the wrong
	// source or index, not drift.
	Force bool

	afterSummaries func() // tests: runs between the summaries and the drill-down
}

// Limits of a repair without Config.Force: it may always remove up to
// MaxRemoveFloor documents, and beyond that at most MaxRemoveShare of the
// documents compared.
const (
	MaxRemoveFloor = 10
	MaxRemoveShare = 0.05
)

// Sentinel errors.
var (
	// ErrRepairTooLarge: the repair would delete a large share of the
	// index; see Config.Force.
	ErrRepairTooLarge = errors.New("reconcile: repair would delete a large share of the index")
	// ErrSource: Config.Source is empty and cannot be derived, or names a
	// source without rows.
	ErrSource = errors.New("reconcile: source")
)

func (c *Config) validate() error {
	switch {
	case c.DB == nil:
		return errors.New("reconcile: DB is nil")
	case c.Search == nil:
		return errors.New("reconcile: Search is nil")
	case c.Index == "":
		return errors.New("reconcile: Index is empty")
	}
	c.Topic = cmp.Or(c.Topic, "outboxrelay.records")
	c.AggregateType = cmp.Or(c.AggregateType, c.Source)
	c.Limit = cmp.Or(c.Limit, 10_000)
	return nil
}

// Drift is one id that differs.
type Drift struct {
	ID            string `json:"id"`
	SourceVersion int64  `json:"source_version,omitempty"`
	SourceDeleted bool   `json:"source_deleted,omitempty"`
	IndexVersion  int64  `json:"index_version,omitempty"`
	IndexDeleted  bool   `json:"index_deleted,omitempty"`
	SourcePV      string `json:"source_processor_version,omitempty"`
	IndexPV       string `json:"index_processor_version,omitempty"`
	// Where the index holds it and in which state (from the scroll): a
	// repair deletes exactly this state (if_seq_no, if_primary_term) or
	// nothing. IndexAggregateType is "" when the document has none.
	IndexName          string `json:"index_name,omitempty"`
	IndexSeqNo         int64  `json:"index_seq_no,omitempty"`
	IndexPrimaryTerm   int64  `json:"index_primary_term,omitempty"`
	IndexAggregateType string `json:"index_aggregate_type,omitempty"`
}

// IndexAhead reports a document whose version in the index is newer than
// the source's: it was written behind the pipeline's back (e.g. an update
// with internal versioning), so a re-enqueued event alone would be refused
// as stale.
func (d Drift) IndexAhead() bool { return d.IndexVersion > d.SourceVersion }

// OtherPV reports a document at the row's source version built by another
// processor version: an event at that version would be refused by the
// engine (409), so the document must go before the repair event can land.
// Tombstones are never reported so: a delete hides the document whatever
// normalizer wrote the tombstone.
func (d Drift) OtherPV() bool {
	return d.IndexVersion == d.SourceVersion && !d.IndexDeleted && !d.SourceDeleted && d.IndexPV != d.SourcePV
}

// Report is the outcome of [Run].
type Report struct {
	// Source and AggregateType are what was compared (Config.Source may
	// have been derived).
	Source        string `json:"source"`
	AggregateType string `json:"aggregate_type"`
	// SourceRows counts the rows of normalized_records compared,
	// tombstones included; IndexDocs the index's documents of this
	// aggregate type or none, tombstones included. In the buckets that
	// differed both are what the id-by-id read found, not the summaries.
	SourceRows int64 `json:"source_rows"`
	// SourceRowsOtherPV counts the rows of normalized_records built by
	// another processor version than Config.ProcessorVersion: the
	// batcher has not rebuilt them yet. 0 when none is expected.
	SourceRowsOtherPV int64   `json:"source_rows_other_processor_version"`
	IndexDocs         int64   `json:"index_docs"`
	DifferingBuckets  []int   `json:"differing_buckets"`
	MissingCount      int     `json:"missing_count"`
	StaleCount        int     `json:"stale_count"`
	ExtraCount        int     `json:"extra_count"`
	Missing           []Drift `json:"missing"`
	Stale             []Drift `json:"stale"`
	Extra             []Drift `json:"extra"`
	// DocsRead counts documents read id by id (only in differing buckets).
	DocsRead int64         `json:"docs_read"`
	Took     time.Duration `json:"took_ns"`
}

// Clean reports whether nothing drifted. Rows of normalized_records at
// another processor version are not drift of the index (see
// SourceRowsOtherPV).
func (r Report) Clean() bool { return r.MissingCount+r.StaleCount+r.ExtraCount == 0 }

type summary struct {
	count int64
	sum   int64
}

// Run compares the two sides.
func Run(ctx context.Context, cfg Config) (Report, error) {
	if err := cfg.validate(); err != nil {
		return Report{}, err
	}
	start := time.Now()
	var rep Report
	if err := resolveSource(ctx, &cfg); err != nil {
		return rep, err
	}
	rep.Source, rep.AggregateType = cfg.Source, cfg.AggregateType
	own, err := ownDocuments(ctx, cfg)
	if err != nil {
		return rep, err
	}
	dbSide, err := sourceSummaries(ctx, cfg)
	if err != nil {
		return rep, err
	}
	if cfg.ProcessorVersion != "" {
		if err := cfg.DB.QueryRow(ctx, `SELECT count(*) FROM normalized_records WHERE source = $1 AND processor_version IS DISTINCT FROM $2`,
			cfg.Source, cfg.ProcessorVersion).Scan(&rep.SourceRowsOtherPV); err != nil {
			return rep, fmt.Errorf("count rows of another processor version: %w", err)
		}
	}
	ixSide, err := indexSummaries(ctx, cfg, own)
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
	if len(rep.DifferingBuckets) > 0 {
		// The drill-down reads these buckets again, id by id, and counts
		// what it read: the index may have moved since the summaries.
		for _, b := range rep.DifferingBuckets {
			rep.SourceRows -= dbSide[b].count
			rep.IndexDocs -= ixSide[b].count
		}
		if err := drillDown(ctx, cfg, own, &rep); err != nil {
			return rep, err
		}
	}
	rep.Took = time.Since(start)
	return rep, nil
}

func sourceSummaries(ctx context.Context, cfg Config) ([sink.Buckets]summary, error) {
	var out [sink.Buckets]summary
	rows, err := cfg.DB.Query(ctx, `SELECT `+bucketSQL+` AS b, count(*), coalesce(sum(`+idvSQL+`), 0)::bigint
FROM normalized_records WHERE source = $1 GROUP BY 1`, cfg.Source)
	if err != nil {
		return out, fmt.Errorf("summarise normalized_records: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var b int
		var s summary
		if err := rows.Scan(&b, &s.count, &s.sum); err != nil {
			return out, err
		}
		out[b] = s
	}
	return out, rows.Err()
}

func indexSummaries(ctx context.Context, cfg Config, own elastic.Query) ([sink.Buckets]summary, error) {
	var out [sink.Buckets]summary
	agg := elastic.NewTermsAggregation().Field(sink.FieldBucket).Size(sink.Buckets).
		SubAggregation("idv", elastic.NewSumAggregation().Field(sink.FieldIDV))
	res, err := cfg.Search.Search(cfg.Index).Query(own).Size(0).TrackTotalHits(true).
		Aggregation("buckets", agg).Do(ctx)
	if err != nil {
		return out, fmt.Errorf("summarise index %s: %w", cfg.Index, err)
	}
	terms, ok := res.Aggregations.Terms("buckets")
	if !ok {
		return out, fmt.Errorf("summarise index %s: no buckets aggregation in the answer", cfg.Index)
	}
	var counted int64
	for _, item := range terms.Buckets {
		b, err := bucketKey(item.Key)
		if err != nil {
			return out, err
		}
		s := summary{count: item.DocCount}
		if sum, ok := item.Sum("idv"); ok && sum.Value != nil {
			s.sum = int64(*sum.Value)
		}
		out[b] = s
		counted += item.DocCount
	}
	// Documents without a bucket field (written by something else) are
	// extras in no bucket; make them show up as a difference in bucket 0.
	if total := res.TotalHits(); total != counted {
		out[0].count += total - counted
		out[0].sum = -1
	}
	return out, nil
}

func bucketKey(k any) (int, error) {
	switch v := k.(type) {
	case float64:
		if v >= 0 && v < sink.Buckets {
			return int(v), nil
		}
	case json.Number:
		n, err := v.Int64()
		if err == nil && n >= 0 && n < sink.Buckets {
			return int(n), nil
		}
	}
	return 0, fmt.Errorf("index holds a %s value %v outside 0..%d", sink.FieldBucket, k, sink.Buckets-1)
}

type state struct {
	version int64
	deleted bool
	pv      string
}

// indexState is a document as the scroll saw it.
type indexState struct {
	state
	index              string
	seqNo, primaryTerm int64
	aggregateType      string
}

func drillDown(ctx context.Context, cfg Config, own elastic.Query, rep *Report) error {
	buckets := rep.DifferingBuckets
	src := map[string]state{}
	rows, err := cfg.DB.Query(ctx, `SELECT source_id, source_version, deleted, coalesce(processor_version, '') FROM normalized_records
WHERE source = $1 AND `+bucketSQL+` = ANY($2)`, cfg.Source, buckets)
	if err != nil {
		return fmt.Errorf("read drifted buckets from normalized_records: %w", err)
	}
	for rows.Next() {
		var id string
		var s state
		if err := rows.Scan(&id, &s.version, &s.deleted, &s.pv); err != nil {
			rows.Close()
			return err
		}
		src[id] = s
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}

	idx, read, err := scrollBuckets(ctx, cfg, own, buckets)
	if err != nil {
		return err
	}
	rep.DocsRead += read
	rep.SourceRows += int64(len(src))
	rep.IndexDocs += read

	for id, s := range src {
		i, ok := idx[id]
		switch {
		case !ok:
			rep.MissingCount++
			if len(rep.Missing) < cfg.Limit {
				rep.Missing = append(rep.Missing, Drift{ID: id, SourceVersion: s.version, SourceDeleted: s.deleted, SourcePV: s.pv})
			}
		case i.state != s:
			rep.StaleCount++
			if len(rep.Stale) < cfg.Limit {
				rep.Stale = append(rep.Stale, i.drift(Drift{ID: id, SourceVersion: s.version, SourceDeleted: s.deleted, SourcePV: s.pv}))
			}
		}
	}
	for id, i := range idx {
		if _, ok := src[id]; !ok {
			rep.ExtraCount++
			if len(rep.Extra) < cfg.Limit {
				rep.Extra = append(rep.Extra, i.drift(Drift{ID: id}))
			}
		}
	}
	for _, l := range [][]Drift{rep.Missing, rep.Stale, rep.Extra} {
		slices.SortFunc(l, func(a, b Drift) int { return cmp.Compare(a.ID, b.ID) })
	}
	return nil
}

// scrollBuckets reads the documents of the buckets (own ones, tombstones
// included) as the index holds them.
func scrollBuckets(ctx context.Context, cfg Config, own elastic.Query, buckets []int) (map[string]indexState, int64, error) {
	idx := map[string]indexState{}
	var read int64
	q := elastic.NewTermsQuery(sink.FieldBucket, toAny(buckets)...)
	var query elastic.Query = q
	if slices.Contains(buckets, 0) {
		// Bucket 0 also stands for documents without a bucket field.
		query = elastic.NewBoolQuery().Should(q, elastic.NewBoolQuery().MustNot(elastic.NewExistsQuery(sink.FieldBucket)))
	}
	ss := elastic.NewSearchSource().Query(elastic.NewBoolQuery().Filter(own, query)).Version(true).SeqNoAndPrimaryTerm(true).
		FetchSourceContext(elastic.NewFetchSourceContext(true).Include(sink.FieldDeleted, sink.FieldPV, sink.FieldAggregateType))
	scroll := cfg.Search.Scroll(cfg.Index).SearchSource(ss).Size(2000).KeepAlive("2m")
	defer scroll.Clear(context.WithoutCancel(ctx))
	for {
		res, err := scroll.Do(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, read, fmt.Errorf("read drifted buckets from index %s: %w", cfg.Index, err)
		}
		for _, hit := range res.Hits.Hits {
			var doc struct {
				Deleted       bool   `json:"_deleted"`
				PV            string `json:"_pv"`
				AggregateType string `json:"_aggregate_type"`
			}
			if len(hit.Source) > 0 {
				_ = json.Unmarshal(hit.Source, &doc)
			}
			st := indexState{state: state{deleted: doc.Deleted, pv: doc.PV}, index: hit.Index, aggregateType: doc.AggregateType}
			if hit.Version != nil {
				st.version = *hit.Version
			}
			if hit.SeqNo != nil && hit.PrimaryTerm != nil {
				st.seqNo, st.primaryTerm = *hit.SeqNo, *hit.PrimaryTerm
			}
			idx[hit.Id] = st
			read++
		}
	}
	return idx, read, nil
}

func (i indexState) drift(d Drift) Drift {
	d.IndexVersion, d.IndexDeleted, d.IndexPV = i.version, i.deleted, i.pv
	d.IndexName, d.IndexSeqNo, d.IndexPrimaryTerm, d.IndexAggregateType = i.index, i.seqNo, i.primaryTerm, i.aggregateType
	return d
}

func toAny(ints []int) []any {
	out := make([]any, len(ints))
	for i, v := range ints {
		out[i] = v
	}
	return out
}

// RepairResult says what [Repair] did, and what it left alone.
type RepairResult struct {
	Enqueued int64 `json:"enqueued"`
	Removed  int   `json:"removed"`
	// KeptTombstones: extra or index-ahead tombstones. A tombstone is never
	// deleted: a later replay of an older upsert would bring the row back.
	KeptTombstones int `json:"kept_tombstones,omitempty"`
	// KeptUnowned: extras without an aggregate type (or of another one),
	// which may be another producer's.
	KeptUnowned int `json:"kept_unowned,omitempty"`
	// KeptChanged: documents written again since the comparison
	// (if_seq_no/if_primary_term refused the delete).
	KeptChanged int `json:"kept_changed,omitempty"`
	// KeptReappeared: extras whose row is in normalized_records now (its
	// event is on its way).
	KeptReappeared int `json:"kept_reappeared,omitempty"`
}

// Repair re-enqueues outbox events for the missing and stale ids of rep and
// deletes its extras from the index. A stale document that is ahead of the
// source ([Drift.IndexAhead]) is deleted first, so the re-enqueued event
// can land; so is a document of another processor version at the row's
// source version ([Drift.OtherPV]) when the row is at Config.ProcessorVersion
// (the version the compared generation is built by). Re-enqueued events
// carry the row's processor version, so they reach that version's
// generation. A delete made outside the pipeline (by hand, or by Repair)
// leaves a version tombstone the engine keeps for index.gc_deletes; an
// event at the source version would be refused as stale until then, so
// Repair waits that long (plus a refresh) before it enqueues when any
// document is missing or was removed. The indexer itself never deletes
// (see package sink), so a short gc_deletes is safe and makes this fast.
// Lists are capped by Config.Limit: when a count exceeds its list, run
// again after.
//
// Deletes are guarded: only documents of Config.AggregateType, never a
// tombstone, never an id whose row reached normalized_records since the
// comparison, and only in the state the comparison saw
// (if_seq_no/if_primary_term), so a document written since is kept. An id
// whose row arrives while its document is being deleted is re-enqueued. A
// repair that would delete more than MaxRemoveShare of the documents
// compared (and more than MaxRemoveFloor) is refused unless Config.Force.
func Repair(ctx context.Context, cfg Config, rep Report) (RepairResult, error) {
	if err := cfg.validate(); err != nil {
		return RepairResult{}, err
	}
	cfg.Source = cmp.Or(cfg.Source, rep.Source)
	cfg.AggregateType = cmp.Or(cfg.AggregateType, rep.AggregateType, cfg.Source)
	if cfg.Source == "" {
		return RepairResult{}, fmt.Errorf("%w: Source is empty and the report does not name one", ErrSource)
	}
	var res RepairResult
	var remove []Drift
	for _, d := range rep.Extra {
		switch {
		case d.IndexDeleted:
			res.KeptTombstones++
		case d.IndexAggregateType != cfg.AggregateType || d.IndexPrimaryTerm == 0:
			res.KeptUnowned++
		default:
			remove = append(remove, d)
		}
	}
	if len(remove) > 0 {
		back, err := presentIDs(ctx, cfg, remove)
		if err != nil {
			return res, err
		}
		remove = slices.DeleteFunc(remove, func(d Drift) bool { return back[d.ID] })
		res.KeptReappeared = len(back)
	}
	for _, d := range rep.Stale {
		// Ahead of the source, or built by another processor version at the
		// version the source expects: the engine would refuse the repair
		// event (same or lower version), so the document goes first.
		if !d.IndexAhead() && !(d.OtherPV() && cfg.ProcessorVersion != "" && d.SourcePV == cfg.ProcessorVersion) {
			continue
		}
		if d.IndexDeleted || d.IndexPrimaryTerm == 0 {
			res.KeptTombstones++ // the re-enqueued event will be refused: needs an operator
			continue
		}
		remove = append(remove, d)
	}
	// Extras the report could not list are deleted by later passes: count
	// them against the limit now.
	planned := len(remove) + max(rep.ExtraCount-len(rep.Extra), 0)
	if !cfg.Force && planned > MaxRemoveFloor && float64(planned) > MaxRemoveShare*float64(rep.IndexDocs) {
		return res, fmt.Errorf("%w: %d of %d documents of source %q in %s; check Source and Index, or set Force",
			ErrRepairTooLarge, planned, rep.IndexDocs, cfg.Source, cfg.Index)
	}
	var removedExtras []Drift
	if len(remove) > 0 {
		bulk := cfg.Search.Bulk().Refresh("true")
		for _, d := range remove {
			bulk.Add(elastic.NewBulkDeleteRequest().Index(cmp.Or(d.IndexName, cfg.Index)).Id(d.ID).
				IfSeqNo(d.IndexSeqNo).IfPrimaryTerm(d.IndexPrimaryTerm))
		}
		br, err := bulk.Do(ctx)
		if err != nil {
			return res, fmt.Errorf("remove %d documents: %w", len(remove), err)
		}
		for i, item := range br.Items {
			r := item["delete"]
			switch {
			case r == nil:
			case r.Status < 300:
				res.Removed++
				if remove[i].SourceVersion == 0 {
					removedExtras = append(removedExtras, remove[i])
				}
			case r.Status == http.StatusConflict:
				res.KeptChanged++
			case r.Status != http.StatusNotFound:
				return res, fmt.Errorf("remove document %s: status %d", remove[i].ID, r.Status)
			}
		}
	}
	// A row that arrived between the check above and its document's
	// delete: its event may have been refused by the delete's tombstone,
	// so it is sent again (after the engine forgets the delete).
	var arrived map[string]bool
	if len(removedExtras) > 0 {
		var err error
		if arrived, err = presentIDs(ctx, cfg, removedExtras); err != nil {
			return res, err
		}
	}
	if len(remove) > 0 || len(rep.Missing) > 0 {
		if err := waitForgetDeletes(ctx, cfg); err != nil {
			return res, err
		}
	}
	ids := make([]string, 0, len(rep.Missing)+len(rep.Stale))
	for _, d := range rep.Missing {
		ids = append(ids, d.ID)
	}
	for _, d := range rep.Stale {
		ids = append(ids, d.ID)
	}
	for id := range arrived {
		ids = append(ids, id)
	}
	if len(ids) > 0 {
		// The repair id includes the time, so a repair is never mistaken
		// for (and deduplicated against) the original event.
		stamp := strconv.FormatInt(time.Now().UnixNano(), 10)
		err := pgx.BeginFunc(ctx, cfg.DB, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT source_id, source_version, deleted, document, coalesce(processor_version, '') FROM normalized_records
WHERE source = $1 AND source_id = ANY($2)`, cfg.Source, ids)
			if err != nil {
				return err
			}
			var events []outbox.Event
			for rows.Next() {
				var id string
				var version int64
				var deleted bool
				var doc []byte
				var pv string
				if err := rows.Scan(&id, &version, &deleted, &doc, &pv); err != nil {
					rows.Close()
					return err
				}
				ev := outbox.Event{
					ID:    outbox.EventID("repair:"+cfg.Source, id, version, stamp),
					Topic: cfg.Topic, AggregateType: cfg.AggregateType, AggregateID: id, AggregateVersion: version,
					Type: outbox.TypeUpsert, Payload: doc,
				}
				if pv != "" {
					ev.Headers = map[string]string{outbox.HeaderProcessorVersion: pv}
				}
				if deleted {
					ev.Type, ev.Payload = outbox.TypeDelete, nil
				}
				events = append(events, ev)
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			n, err := outbox.Enqueue(ctx, tx, events...)
			res.Enqueued = n
			return err
		})
		if err != nil {
			return res, fmt.Errorf("re-enqueue %d drifted ids: %w", len(ids), err)
		}
	}
	return res, nil
}

// presentIDs returns which of the ids are in normalized_records (for
// cfg.Source) now.
func presentIDs(ctx context.Context, cfg Config, ds []Drift) (map[string]bool, error) {
	ids := make([]string, len(ds))
	for i, d := range ds {
		ids[i] = d.ID
	}
	rows, err := cfg.DB.Query(ctx, `SELECT source_id FROM normalized_records WHERE source = $1 AND source_id = ANY($2)`, cfg.Source, ids)
	if err != nil {
		return nil, fmt.Errorf("re-read %d extra ids from normalized_records: %w", len(ids), err)
	}
	defer rows.Close()
	out := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		out[id] = true
	}
	return out, rows.Err()
}

// waitForgetDeletes waits until the engine has forgotten the deletes made
// so far: index.gc_deletes, then a refresh (tombstones are pruned on
// refresh).
func waitForgetDeletes(ctx context.Context, cfg Config) error {
	gc := cfg.DeleteGC
	if gc == 0 {
		var err error
		if gc, err = indexDeleteGC(ctx, cfg); err != nil {
			return err
		}
	}
	wait := gc + time.Second
	if cfg.Logger != nil {
		cfg.Logger.InfoContext(ctx, "waiting for the engine to forget deletes before re-enqueuing (index.gc_deletes)", slog.Duration("wait", wait))
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
	}
	if _, err := cfg.Search.Refresh(cfg.Index).Do(ctx); err != nil {
		return fmt.Errorf("refresh %s: %w", cfg.Index, err)
	}
	return nil
}

func indexDeleteGC(ctx context.Context, cfg Config) (time.Duration, error) {
	resp, err := cfg.Search.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: "GET",
		Path:   "/" + url.PathEscape(cfg.Index) + "/_settings/index.gc_deletes",
		Params: url.Values{"include_defaults": {"true"}, "flat_settings": {"true"}},
	})
	if err != nil {
		return 0, fmt.Errorf("read index.gc_deletes of %s: %w", cfg.Index, err)
	}
	var body map[string]struct {
		Settings map[string]string `json:"settings"`
		Defaults map[string]string `json:"defaults"`
	}
	if err := json.Unmarshal(resp.Body, &body); err != nil {
		return 0, fmt.Errorf("read index.gc_deletes of %s: %w", cfg.Index, err)
	}
	longest := time.Duration(0)
	for _, idx := range body {
		v, ok := idx.Settings["index.gc_deletes"]
		if !ok {
			v, ok = idx.Defaults["index.gc_deletes"]
		}
		if !ok {
			continue
		}
		d, err := parseESDuration(v)
		if err != nil {
			return 0, fmt.Errorf("index.gc_deletes=%q of %s: %w", v, cfg.Index, err)
		}
		longest = max(longest, d)
	}
	if longest == 0 {
		longest = time.Minute // the engines' default
	}
	return longest, nil
}

// parseESDuration reads the engine's time units ("60s", "1m", "500ms",
// "1d").
func parseESDuration(v string) (time.Duration, error) {
	if n, ok := strings.CutSuffix(v, "d"); ok {
		d, err := strconv.Atoi(n)
		return time.Duration(d) * 24 * time.Hour, err
	}
	return time.ParseDuration(v)
}
