package e2e

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// The independent oracle: the whole index, scrolled over a client of its
// own, against the documents computed from source_records by SQL written
// here by hand from demo/job.yaml. It does not use normalized_records, the
// batcher's compiled SQL, reconcile or any of the product's Go code, so a
// wrong transform, a lost update or a stale version fails the test whatever
// the product reports about itself.
//
// The scroll is plain HTTP; its pages go as they are into a temporary
// table of the test's own connection, where PostgreSQL takes them apart and
// compares the documents with the expected ones as jsonb (keys in any
// order, numbers by value). Decoding 190,000 documents in Go in a -race
// test binary took minutes; this takes seconds.

// expectation is what the oracle expects the job to make of a row: the
// processor version and the title field's transforms, written out as SQL
// over the row s.
type expectation struct {
	PV       string
	TitleSQL string
	// ScopeSQL, when set, is the job's filter written out as SQL over the
	// row s: a row outside it must have no live document.
	ScopeSQL string
	// GoneTombstones allows a tombstone for an id the source does not hold
	// in scope (a hard-deleted row, or one that left the filter, whose
	// delete was indexed); without it any such tombstone is a difference.
	GoneTombstones bool
	// VersionAboveSQL, when set, is a condition over the row s: such a row
	// may have an index version above its source version (a row inserted
	// again after a delete, with its version reset, is indexed above its
	// tombstone); its content must still be the expected one. Without it
	// every index version must equal the source version.
	VersionAboveSQL string
}

var (
	// demo/job.yaml: title transforms [trim].
	expectV1 = expectation{PV: "v1", TitleSQL: `btrim(s.payload->>'title')`}
	// The normalizer tests' v2: title transforms [trim, upper].
	expectV2 = expectation{PV: "v2", TitleSQL: `upper(btrim(s.payload->>'title'))`}
)

// oracleFields are the spec's fields the expected-document SQL below is
// written for (name ← from); the oracle refuses a pipeline whose spec has
// others rather than check it against the wrong documents.
var oracleFields = []string{"id←id", "tenant←tenant_id", "title←payload.title", "body←payload.body", "tags←payload.tags", "created_at←created_at"}

// expectedSQL selects, for every source row that must be in the index,
// its id, version, whether it is a tombstone, and the document as the index
// must hold it apart from the reconcile hashes (_bucket, _idv): the
// normalized fields (nulls dropped), or {"_deleted": true} for a
// soft-deleted row; plus the processor version and the aggregate type (the
// table name) the indexer records. A live row the job refuses (title
// missing or not a string, body not a string, tags not an array, payload
// not an object) is quarantined: no row here, and no document allowed.
// $1: the processor version.
func expectedSQL(e expectation) string {
	return `
SELECT s.id::text AS id, s.version, s.deleted_at IS NOT NULL AS deleted,
       coalesce(` + cmp.Or(e.VersionAboveSQL, "false") + `, false) AS above,
       CASE WHEN s.deleted_at IS NOT NULL THEN jsonb_build_object('_deleted', true)
            ELSE jsonb_strip_nulls(jsonb_build_object(
                   'id', s.id,
                   'tenant', s.tenant_id,
                   'title', ` + e.TitleSQL + `,
                   'body', s.payload->'body',
                   'tags', s.payload->'tags',
                   'created_at', s.created_at))
       END || jsonb_build_object('_pv', $1::text, '_aggregate_type', 'source_records') AS doc
FROM source_records s
WHERE (` + cmp.Or(e.ScopeSQL, "true") + `) AND (s.deleted_at IS NOT NULL
   OR (jsonb_typeof(s.payload) = 'object'
       AND jsonb_typeof(s.payload->'title') = 'string'
       AND coalesce(jsonb_typeof(s.payload->'body'), 'null') IN ('null', 'string')
       AND coalesce(jsonb_typeof(s.payload->'tags'), 'null') IN ('null', 'array')))`
}

// versionDiffers: the index version of a differs from the expected e's
// (above it is allowed where e.above).
const versionDiffers = `(e.version IS DISTINCT FROM a.version AND NOT (e.above AND a.version > e.version))`

// compareSQL takes the scrolled pages (table oracle_pages) apart, joins
// their documents with the expected ones and returns each differing id
// with its kind; for the first oracleShown also what differs: the fields
// whose values differ (the whole document when one side has none).
func compareSQL(e expectation) string {
	return `
WITH e AS MATERIALIZED (` + expectedSQL(e) + `),
a AS MATERIALIZED (
  -- _deleted_at is when the indexer wrote a tombstone (for the purge's
  -- horizon): required on every tombstone, its value not predictable.
  SELECT h->>'_id' AS id, (h->>'_version')::bigint AS version, p.tombstone,
         CASE WHEN p.tombstone AND jsonb_typeof(h->'_source'->'_deleted_at') = 'number' THEN (h->'_source') - '_deleted_at'::text ELSE h->'_source' END
           - '_bucket'::text - '_idv'::text AS doc
  FROM oracle_pages p, jsonb_array_elements(p.page::jsonb #> '{hits,hits}') h
),
d AS (
  SELECT coalesce(e.id, a.id) AS id,
         CASE WHEN a.id IS NULL AND e.deleted THEN 'tombstone-missing'
              WHEN a.id IS NULL THEN 'missing'
              WHEN e.id IS NULL AND a.tombstone THEN 'tombstone-unexpected'
              WHEN e.id IS NULL THEN 'unexpected'
              WHEN e.deleted AND NOT a.tombstone THEN 'deleted-visible'
              WHEN a.tombstone AND NOT e.deleted THEN 'tombstone-for-live'
              WHEN ` + versionDiffers + ` THEN CASE WHEN a.tombstone THEN 'tombstone-version' ELSE 'version' END
              ELSE CASE WHEN a.tombstone THEN 'tombstone-content' ELSE 'content' END
         END AS kind,
         e.version AS want_version, a.version AS got_version, e.doc AS want, a.doc AS got
  FROM e FULL JOIN a ON a.id = e.id
  WHERE (a.id IS NULL OR e.id IS NULL OR e.deleted <> a.tombstone OR ` + versionDiffers + ` OR e.doc IS DISTINCT FROM a.doc)
    AND NOT (` + fmt.Sprint(e.GoneTombstones) + ` AND e.id IS NULL AND a.tombstone)
)
SELECT (SELECT count(*) FILTER (WHERE NOT tombstone) FROM a), (SELECT count(*) FILTER (WHERE tombstone) FROM a),
       id, kind, coalesce(want_version, 0), coalesce(got_version, 0),
       CASE WHEN n <= ` + fmt.Sprint(oracleShown) + ` THEN coalesce(want_diff::text, '-') END,
       CASE WHEN n <= ` + fmt.Sprint(oracleShown) + ` THEN coalesce(got_diff::text, '-') END
FROM (SELECT d.*, row_number() OVER (ORDER BY id) AS n,
             CASE WHEN want IS NULL OR got IS NULL THEN want
                  ELSE (SELECT jsonb_object_agg(k, v) FROM jsonb_each(want) w(k, v) WHERE got->k IS DISTINCT FROM v) END AS want_diff,
             CASE WHEN want IS NULL OR got IS NULL THEN got
                  ELSE (SELECT jsonb_object_agg(k, v) FROM jsonb_each(got) g(k, v) WHERE want->k IS DISTINCT FROM v) END AS got_diff
      FROM d) x
RIGHT JOIN (SELECT) one ON true
ORDER BY id`
}

// oracleGrace bounds how long requireIndexMatchesSource checks again.
const oracleGrace = 30 * time.Second

// oracleShown is how many differing ids a failed check prints in full.
const oracleShown = 10

// indexCheck is what checkIndex found.
type indexCheck struct {
	Live, Tombstones int64 // documents seen through the read alias, tombstones through the write alias
	WriteTotal       int64 // documents behind the write alias
	IDs              []string
	byKind           map[string]int
	shown            []string
	Took             time.Duration
}

func (c *indexCheck) ok() bool { return len(c.IDs) == 0 }

func (c *indexCheck) add(kind, id, detail string) {
	c.IDs = append(c.IDs, id)
	c.byKind[kind]++
	if len(c.shown) < oracleShown {
		c.shown = append(c.shown, fmt.Sprintf("%s %s: %s", kind, id, detail))
	}
}

// summary is one line: the counts per kind of difference.
func (c *indexCheck) summary() string {
	if c.ok() {
		return fmt.Sprintf("%d live documents and %d tombstones equal to the source", c.Live, c.Tombstones)
	}
	return fmt.Sprintf("%d differing ids %v (%d live documents seen through the read alias, %d tombstones, %d documents behind the write alias)",
		len(c.IDs), c.byKind, c.Live, c.Tombstones, c.WriteTotal)
}

// String is a bounded diff: the summary, then the first ids.
func (c *indexCheck) String() string {
	if c.ok() {
		return c.summary()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s; the first %d:", c.summary(), len(c.shown))
	for _, s := range c.shown {
		b.WriteString("\n  ")
		b.WriteString(s)
	}
	return b.String()
}

// checkIndex compares the index with the source: every document seen
// through the read alias (scrolled: _id, _version, _source) is a live,
// well-formed row at its version with exactly the expected content, and
// every such row has one; every soft-deleted row is a tombstone behind the
// write alias at its version and invisible through the read alias; the
// write alias holds nothing else.
func (p *pipeline) checkIndex(ctx context.Context, e expectation) *indexCheck {
	tb := p.tb
	tb.Helper()
	start := time.Now()
	var fields []string
	for _, f := range p.spec.Document.Fields {
		fields = append(fields, f.Name+"←"+f.From)
	}
	require.Equal(tb, oracleFields, fields, "the oracle's expected documents are written for these fields of the job spec; a spec with others needs its own SQL")
	require.True(tb, p.spec.Document.DropNulls, "the oracle drops null fields as the spec does")

	es := &searchHTTP{urls: p.searchURLs}
	_, err := es.do(ctx, http.MethodPost, "/"+p.alias+","+p.alias+"-write/_refresh", nil)
	require.NoError(tb, err)
	conn, err := p.pool.Acquire(ctx)
	require.NoError(tb, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `DROP TABLE IF EXISTS oracle_pages; CREATE TEMP TABLE oracle_pages (tombstone boolean NOT NULL, page text NOT NULL)`)
	require.NoError(tb, err)
	defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), `DROP TABLE IF EXISTS oracle_pages`) }()
	store := func(tombstone bool) func(page []byte) error {
		return func(page []byte) error {
			_, err := conn.Exec(ctx, `INSERT INTO oracle_pages VALUES ($1, $2)`, tombstone, string(page))
			return err
		}
	}
	require.NoError(tb, es.scroll(ctx, p.alias, nil, store(false)))
	require.NoError(tb, es.scroll(ctx, p.alias+"-write", map[string]any{"term": map[string]any{"_deleted": true}}, store(true)))

	check := &indexCheck{byKind: map[string]int{}}
	rows, err := conn.Query(ctx, compareSQL(e), e.PV)
	require.NoError(tb, err)
	var id, kind *string
	var wantV, gotV *int64
	var want, got *string
	_, err = pgx.ForEachRow(rows, []any{&check.Live, &check.Tombstones, &id, &kind, &wantV, &gotV, &want, &got}, func() error {
		if id == nil {
			return nil // no difference: the counts only
		}
		detail := fmt.Sprintf("version want %d got %d (0: none)", *wantV, *gotV)
		if want != nil {
			detail += fmt.Sprintf(", fields that differ:\n      want %s\n      got  %s", clip(*want, 1000), clip(*got, 1000))
		}
		check.add(*kind, *id, detail)
		return nil
	})
	require.NoError(tb, err)

	b, err := es.do(ctx, http.MethodGet, "/"+p.alias+"-write/_count", nil)
	require.NoError(tb, err)
	var count struct{ Count int64 }
	require.NoError(tb, json.Unmarshal(b, &count))
	check.WriteTotal = count.Count
	if hidden := check.WriteTotal - (check.Live + check.Tombstones); hidden != 0 {
		check.add("write-alias-count", "-", fmt.Sprintf("%d documents behind the write alias that are neither visible nor tombstones", hidden))
	}
	check.Took = time.Since(start)
	return check
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// searchHTTP is the oracle's own client of the engine: plain HTTP, the
// nodes tried in turn.
type searchHTTP struct {
	urls []string
}

func (c *searchHTTP) do(ctx context.Context, method, path string, body any) ([]byte, error) {
	var b []byte
	if body != nil {
		var err error
		if b, err = json.Marshal(body); err != nil {
			return nil, err
		}
	}
	var errs []string
	for _, u := range c.urls {
		req, err := http.NewRequestWithContext(ctx, method, strings.TrimRight(u, "/")+path, bytes.NewReader(b))
		if err != nil {
			return nil, err
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		out, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, clip(string(out), 500))
		}
		return out, nil
	}
	return nil, fmt.Errorf("%s %s: %s", method, path, strings.Join(errs, "; "))
}

// scrollFilter keeps of a scroll page the scroll id and each hit's _id,
// _version and _source.
const scrollFilter = "filter_path=_scroll_id,hits.hits._id,hits.hits._version,hits.hits._source"

// scroll hands every page of a scroll of index (query q, nil: all) to
// store as the engine sent it; only the scroll id is read here.
func (c *searchHTTP) scroll(ctx context.Context, index string, q any, store func(page []byte) error) error {
	req := map[string]any{"size": 5000, "version": true, "sort": []string{"_doc"}}
	if q != nil {
		req["query"] = q
	}
	page, err := c.do(ctx, http.MethodPost, "/"+index+"/_search?scroll=2m&"+scrollFilter, req)
	for {
		if err != nil {
			return fmt.Errorf("scroll %s: %w", index, err)
		}
		// The page's head: its scroll id, and whether any hit follows.
		var head struct {
			ScrollID string `json:"_scroll_id"`
		}
		d := json.NewDecoder(bytes.NewReader(page))
		if _, err := d.Token(); err != nil { // {
			return fmt.Errorf("scroll %s: %w", index, err)
		}
		for d.More() && head.ScrollID == "" {
			key, err := d.Token()
			if err != nil {
				return fmt.Errorf("scroll %s: %w", index, err)
			}
			if key == "_scroll_id" {
				err = d.Decode(&head.ScrollID)
			} else {
				var skip json.RawMessage
				err = d.Decode(&skip)
			}
			if err != nil {
				return fmt.Errorf("scroll %s: %w", index, err)
			}
		}
		if head.ScrollID == "" {
			return fmt.Errorf("scroll %s: no scroll id in %s", index, clip(string(page), 300))
		}
		if !bytes.Contains(page, []byte(`"_id":`)) {
			_, _ = c.do(context.WithoutCancel(ctx), http.MethodDelete, "/_search/scroll", map[string]any{"scroll_id": head.ScrollID})
			return nil
		}
		if err := store(page); err != nil {
			return fmt.Errorf("scroll %s: store a page: %w", index, err)
		}
		page, err = c.do(ctx, http.MethodPost, "/_search/scroll?"+scrollFilter, map[string]any{"scroll": "2m", "scroll_id": head.ScrollID})
	}
}

// requireIndexMatchesSource checks the index with the oracle until it
// matches or the deadline passes, and fails with the bounded diff then. It
// is called once the pipeline is at rest, so it checks again for at most
// oracleGrace after the first check, whatever the deadline.
func (p *pipeline) requireIndexMatchesSource(ctx context.Context, e expectation, deadline time.Time, procs func() string) *indexCheck {
	p.tb.Helper()
	if d := time.Now().Add(oracleGrace); d.Before(deadline) {
		deadline = d
	}
	for {
		c := p.checkIndex(ctx, e)
		if c.ok() {
			p.tb.Logf("oracle: %s (%s, processor version %s, checked in %s)", c, p.alias, e.PV, c.Took.Round(time.Millisecond))
			return c
		}
		if !time.Now().Before(deadline) {
			require.FailNowf(p.tb, "the index differs from the source", "independent oracle, processor version %s: %s\n%s", e.PV, c, procs())
		}
		p.tb.Logf("oracle: not yet equal: %s", c.summary())
		pause(ctx, time.Second)
	}
}
