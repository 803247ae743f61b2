// Package reconcile compares the read model in PostgreSQL
// (normalized_records) with the search index and repairs the difference.
//
// Both sides are summarised per bucket — the id's hash modulo
// [sink.Buckets] — as a count and a sum of hash(id, version, deleted).
// PostgreSQL answers with one GROUP BY over normalized_records; the engine
// with one terms aggregation over the fields the indexer writes into every
// document ([sink.FieldBucket], [sink.FieldIDV]). Only buckets whose
// summaries differ are read id by id, from both sides, so a clean index of
// millions of documents costs two aggregations and no scan of documents.
//
// A drifted id is one of:
//   - missing: in normalized_records, not in the index;
//   - stale: in both, but the index holds another version or deleted-ness;
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
// deleted from the index directly. Reconcile when the pipeline is drained
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
	idvSQL    = `(('x' || substr(md5(source_id || ':' || source_version || ':' || deleted::int), 1, 8))::bit(32)::int & 2147483647)::bigint`
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
	// Source is normalized_records.source to compare. Required.
	Source string
	// Topic receives repair events. Default "outboxrelay.records".
	Topic string
	// AggregateType of repair events. Default: Source.
	AggregateType string
	// Limit caps the drifted ids listed per kind (counts stay exact).
	// Default 10,000.
	Limit int
	// DeleteGC is how long the engine remembers a delete (the index's
	// index.gc_deletes). 0 = read it from the index.
	DeleteGC time.Duration
	// Logger, if set, tells what Repair waits for.
	Logger *slog.Logger
	// Full reads every bucket id by id and compares the engine's real
	// _version, instead of trusting the summaries. The summaries hash the
	// _idv field the indexer stored, so a partial update made by hand
	// (which bumps _version but keeps _idv) only shows up in a full pass.
	Full bool
}

func (c *Config) validate() error {
	switch {
	case c.DB == nil:
		return errors.New("reconcile: DB is nil")
	case c.Search == nil:
		return errors.New("reconcile: Search is nil")
	case c.Index == "":
		return errors.New("reconcile: Index is empty")
	case c.Source == "":
		return errors.New("reconcile: Source is empty")
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
}

// IndexAhead reports a document whose version in the index is newer than
// the source's: it was written behind the pipeline's back (e.g. an update
// with internal versioning), so a re-enqueued event alone would be refused
// as stale.
func (d Drift) IndexAhead() bool { return d.IndexVersion > d.SourceVersion }

// Report is the outcome of [Run].
type Report struct {
	SourceRows       int64   `json:"source_rows"`
	IndexDocs        int64   `json:"index_docs"`
	DifferingBuckets []int   `json:"differing_buckets"`
	MissingCount     int     `json:"missing_count"`
	StaleCount       int     `json:"stale_count"`
	ExtraCount       int     `json:"extra_count"`
	Missing          []Drift `json:"missing"`
	Stale            []Drift `json:"stale"`
	Extra            []Drift `json:"extra"`
	// DocsRead counts documents read id by id (only in differing buckets).
	DocsRead int64         `json:"docs_read"`
	Took     time.Duration `json:"took_ns"`
}

// Clean reports whether nothing drifted.
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
	dbSide, err := sourceSummaries(ctx, cfg)
	if err != nil {
		return rep, err
	}
	ixSide, err := indexSummaries(ctx, cfg)
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
	if len(rep.DifferingBuckets) > 0 {
		if err := drillDown(ctx, cfg, &rep); err != nil {
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

func indexSummaries(ctx context.Context, cfg Config) ([sink.Buckets]summary, error) {
	var out [sink.Buckets]summary
	agg := elastic.NewTermsAggregation().Field(sink.FieldBucket).Size(sink.Buckets).
		SubAggregation("idv", elastic.NewSumAggregation().Field(sink.FieldIDV))
	res, err := cfg.Search.Search(cfg.Index).Size(0).TrackTotalHits(true).
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
}

func drillDown(ctx context.Context, cfg Config, rep *Report) error {
	buckets := rep.DifferingBuckets
	src := map[string]state{}
	rows, err := cfg.DB.Query(ctx, `SELECT source_id, source_version, deleted FROM normalized_records
WHERE source = $1 AND `+bucketSQL+` = ANY($2)`, cfg.Source, buckets)
	if err != nil {
		return fmt.Errorf("read drifted buckets from normalized_records: %w", err)
	}
	for rows.Next() {
		var id string
		var s state
		if err := rows.Scan(&id, &s.version, &s.deleted); err != nil {
			rows.Close()
			return err
		}
		src[id] = s
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}

	idx := map[string]state{}
	q := elastic.NewTermsQuery(sink.FieldBucket, toAny(buckets)...)
	var query elastic.Query = q
	if slices.Contains(buckets, 0) {
		// Bucket 0 also stands for documents without a bucket field.
		query = elastic.NewBoolQuery().Should(q, elastic.NewBoolQuery().MustNot(elastic.NewExistsQuery(sink.FieldBucket)))
	}
	scroll := cfg.Search.Scroll(cfg.Index).Query(query).Size(2000).Version(true).
		FetchSourceContext(elastic.NewFetchSourceContext(true).Include(sink.FieldDeleted)).KeepAlive("2m")
	defer scroll.Clear(context.WithoutCancel(ctx))
	for {
		res, err := scroll.Do(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("read drifted buckets from index %s: %w", cfg.Index, err)
		}
		for _, hit := range res.Hits.Hits {
			var doc struct {
				Deleted bool `json:"_deleted"`
			}
			if len(hit.Source) > 0 {
				_ = json.Unmarshal(hit.Source, &doc)
			}
			var v int64
			if hit.Version != nil {
				v = *hit.Version
			}
			idx[hit.Id] = state{version: v, deleted: doc.Deleted}
			rep.DocsRead++
		}
	}

	for id, s := range src {
		i, ok := idx[id]
		switch {
		case !ok:
			rep.MissingCount++
			if len(rep.Missing) < cfg.Limit {
				rep.Missing = append(rep.Missing, Drift{ID: id, SourceVersion: s.version, SourceDeleted: s.deleted})
			}
		case i != s:
			rep.StaleCount++
			if len(rep.Stale) < cfg.Limit {
				rep.Stale = append(rep.Stale, Drift{ID: id, SourceVersion: s.version, SourceDeleted: s.deleted, IndexVersion: i.version, IndexDeleted: i.deleted})
			}
		}
	}
	for id, i := range idx {
		if _, ok := src[id]; !ok {
			rep.ExtraCount++
			if len(rep.Extra) < cfg.Limit {
				rep.Extra = append(rep.Extra, Drift{ID: id, IndexVersion: i.version, IndexDeleted: i.deleted})
			}
		}
	}
	for _, l := range [][]Drift{rep.Missing, rep.Stale, rep.Extra} {
		slices.SortFunc(l, func(a, b Drift) int { return cmp.Compare(a.ID, b.ID) })
	}
	return nil
}

func toAny(ints []int) []any {
	out := make([]any, len(ints))
	for i, v := range ints {
		out[i] = v
	}
	return out
}

// RepairResult says what [Repair] did.
type RepairResult struct {
	Enqueued int64 `json:"enqueued"`
	Removed  int   `json:"removed"`
}

// Repair re-enqueues outbox events for the missing and stale ids of rep and
// deletes its extras from the index. A stale document that is ahead of the
// source ([Drift.IndexAhead]) is deleted first, so the re-enqueued event
// can land. A delete made outside the pipeline (by hand, or by Repair)
// leaves a version tombstone the engine keeps for index.gc_deletes; an
// event at the source version would be refused as stale until then, so
// Repair waits that long (plus a refresh) before it enqueues when any
// document is missing or was removed. The indexer itself never deletes
// (see package sink), so a short gc_deletes is safe and makes this fast.
// Lists are capped by Config.Limit: when a count exceeds its list, run
// again after.
func Repair(ctx context.Context, cfg Config, rep Report) (RepairResult, error) {
	if err := cfg.validate(); err != nil {
		return RepairResult{}, err
	}
	var res RepairResult
	remove := slices.Clone(rep.Extra)
	for _, d := range rep.Stale {
		if d.IndexAhead() {
			remove = append(remove, d)
		}
	}
	if len(remove) > 0 {
		bulk := cfg.Search.Bulk().Refresh("true")
		for _, d := range remove {
			bulk.Add(elastic.NewBulkDeleteRequest().Index(cfg.Index).Id(d.ID))
		}
		br, err := bulk.Do(ctx)
		if err != nil {
			return res, fmt.Errorf("remove %d documents: %w", len(remove), err)
		}
		for _, item := range br.Deleted() {
			if item.Status < 300 || item.Status == 404 {
				res.Removed++
			}
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
	if len(ids) > 0 {
		// The repair id includes the time, so a repair is never mistaken
		// for (and deduplicated against) the original event.
		stamp := strconv.FormatInt(time.Now().UnixNano(), 10)
		err := pgx.BeginFunc(ctx, cfg.DB, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT source_id, source_version, deleted, document FROM normalized_records
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
				if err := rows.Scan(&id, &version, &deleted, &doc); err != nil {
					rows.Close()
					return err
				}
				ev := outbox.Event{
					ID:    outbox.EventID("repair:"+cfg.Source, id, version, stamp),
					Topic: cfg.Topic, AggregateType: cfg.AggregateType, AggregateID: id, AggregateVersion: version,
					Type: outbox.TypeUpsert, Payload: doc,
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
