package reconcile_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

func TestMain(m *testing.M) { stack.Main(m) }

// indexDoc writes what the indexer writes: the document plus the reconcile
// fields, at the source version (external), built by processor version v1.
func indexDoc(id string, version int64, deleted bool) *elastic.BulkIndexRequest {
	return indexDocPV(id, version, deleted, "v1")
}

func indexDocPV(id string, version int64, deleted bool, pv string) *elastic.BulkIndexRequest {
	return indexDocOf("src", id, version, deleted, pv)
}

// indexDocOf is indexDocPV for an event of aggregate type typ.
func indexDocOf(typ, id string, version int64, deleted bool, pv string) *elastic.BulkIndexRequest {
	doc := map[string]any{"title": "doc " + id, sink.FieldAggregateType: typ}
	if deleted {
		doc = map[string]any{sink.FieldDeleted: true, sink.FieldAggregateType: typ}
	}
	doc[sink.FieldBucket] = sink.Bucket(id)
	doc[sink.FieldIDV] = sink.IDV(id, version, deleted, pv)
	doc[sink.FieldPV] = pv
	return elastic.NewBulkIndexRequest().Id(id).Version(version).VersionType("external").Doc(doc)
}

func TestReconcileFindsAndRepairsDrift(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testReconcileFindsAndRepairsDrift)
}

func testReconcileFindsAndRepairsDrift(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	index := stack.UniqueName("reconcile")
	_, err = client.CreateIndex(index).BodyString(`{"settings":{"number_of_shards":1,"number_of_replicas":0,"index.gc_deletes":"1s"},"mappings":{"properties":{"_bucket":{"type":"integer"},"_idv":{"type":"long"},"_deleted":{"type":"boolean"}}}}`).Do(ctx)
	require.NoError(t, err)

	const n = 5000
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, CASE WHEN g % 97 = 0 THEN NULL ELSE jsonb_build_object('title', 'doc ' || g) END, 1 + g % 3, 'v1', g % 97 = 0
FROM generate_series(1, $1) g`, n)
	require.NoError(t, err)
	// Another source's rows are not compared.
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version) VALUES ('other', '1', '{}', 9, 'v1')`)
	require.NoError(t, err)

	bulk := client.Bulk().Index(index)
	for g := 1; g <= n; g++ {
		bulk.Add(indexDoc(strconv.Itoa(g), int64(1+g%3), g%97 == 0))
	}
	res, err := bulk.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)

	cfg := reconcile.Config{DB: pool, Search: client, Index: index, Source: "src", Topic: "t"}
	rep, err := reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.True(t, rep.Clean(), "%+v", rep)
	require.EqualValues(t, n, rep.SourceRows)
	require.EqualValues(t, n, rep.IndexDocs)
	require.Zero(t, rep.DocsRead, "a clean index is compared by summaries only")

	// Drift behind the pipeline's back.
	_, err = client.Delete().Index(index).Id("10").Do(ctx) // missing
	require.NoError(t, err)
	_, err = client.Index().Index(index).Id("20").BodyJson(map[string]any{"title": "edited by hand"}).Do(ctx) // internal version + 1: index ahead
	require.NoError(t, err)
	_, err = client.Index().Index(index).Id("x1").BodyJson(map[string]any{"title": "stray", sink.FieldAggregateType: "src"}).Refresh("true").Do(ctx) // extra, no reconcile fields
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE normalized_records SET source_version = source_version + 1 WHERE source = 'src' AND source_id = '40'`) // index behind
	require.NoError(t, err)

	rep, err = reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.False(t, rep.Clean())
	ids := func(ds []reconcile.Drift) []string {
		var out []string
		for _, d := range ds {
			out = append(out, d.ID)
		}
		return out
	}
	require.Equal(t, []string{"10"}, ids(rep.Missing))
	require.Equal(t, []string{"20", "40"}, ids(rep.Stale))
	require.Equal(t, []string{"x1"}, ids(rep.Extra))
	require.True(t, rep.Stale[0].IndexAhead())
	require.False(t, rep.Stale[1].IndexAhead())
	require.LessOrEqual(t, len(rep.DifferingBuckets), 4)
	require.Less(t, rep.DocsRead, int64(n/50), "only the differing buckets are read id by id")

	fixed, err := reconcile.Repair(ctx, cfg, rep)
	require.NoError(t, err)
	require.EqualValues(t, 3, fixed.Enqueued)
	require.Equal(t, 2, fixed.Removed, "the extra and the index-ahead document")

	type event struct {
		ID      string
		Version int64
		Type    string
		Topic   string
	}
	rows, err := pool.Query(ctx, `SELECT aggregate_id, aggregate_version, event_type, topic FROM outbox_event_members ORDER BY aggregate_id`)
	require.NoError(t, err)
	var got []event
	for rows.Next() {
		var e event
		require.NoError(t, rows.Scan(&e.ID, &e.Version, &e.Type, &e.Topic))
		got = append(got, e)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []event{{"10", 2, "upsert", "t"}, {"20", 3, "upsert", "t"}, {"40", 3, "upsert", "t"}}, got)

	for _, id := range []string{"x1", "20"} {
		_, err := client.Get().Index(index).Id(id).Do(ctx)
		require.True(t, elastic.IsNotFound(err), "%s removed from the index: %v", id, err)
	}

	// The pipeline applies the repair events (here by hand, as the indexer
	// would: external versions); they land because Repair waited until the
	// engine forgot the deletes. Afterwards nothing drifts.
	bulk = client.Bulk().Index(index).Add(indexDoc("10", 2, false), indexDoc("20", 3, false), indexDoc("40", 3, false))
	res, err = bulk.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors, "%+v", res.Failed())
	rep, err = reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.True(t, rep.Clean(), "%+v", rep)

	// A partial update by hand keeps the stored _idv but bumps _version:
	// only a full pass, which compares the real versions, sees it.
	_, err = client.Update().Index(index).Id("50").Doc(map[string]any{"title": "patched"}).Refresh("true").Do(ctx)
	require.NoError(t, err)
	full := cfg
	full.Full = true
	rep, err = reconcile.Run(ctx, full)
	require.NoError(t, err)
	require.Len(t, rep.DifferingBuckets, sink.Buckets)
	require.EqualValues(t, n, rep.DocsRead)
	require.Equal(t, []string{"50"}, ids(rep.Stale))
	require.True(t, rep.Stale[0].IndexAhead())
}

// A document built by another processor version than the row's is drift,
// even at the same source version, and Repair replaces it: the engine
// would refuse a re-enqueued event at that version (409), so the document
// goes first, and the event carries the row's processor version.
func TestReconcileFindsDocumentsOfAnotherProcessorVersion(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testReconcileFindsDocumentsOfAnotherProcessorVersion)
}

func testReconcileFindsDocumentsOfAnotherProcessorVersion(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	index := stack.UniqueName("reconcile-pv")
	_, err = client.CreateIndex(index).BodyString(`{"settings":{"number_of_shards":1,"number_of_replicas":0,"index.gc_deletes":"1s"},"mappings":{"properties":{"_bucket":{"type":"integer"},"_idv":{"type":"long"},"_deleted":{"type":"boolean"},"_pv":{"type":"keyword"}}}}`).Do(ctx)
	require.NoError(t, err)

	const n = 2000
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, jsonb_build_object('title', 'DOC ' || g), 1 + g % 3, 'v2', false FROM generate_series(1, $1) g`, n)
	require.NoError(t, err)
	old := map[string]bool{"7": true, "700": true, "1999": true}
	bulk := client.Bulk().Index(index)
	for g := 1; g <= n; g++ {
		id := strconv.Itoa(g)
		pv := "v2"
		if old[id] {
			pv = "v1" // left behind by the previous normalizer, same source version
		}
		bulk.Add(indexDocPV(id, int64(1+g%3), false, pv))
	}
	res, err := bulk.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)

	cfg := reconcile.Config{DB: pool, Search: client, Index: index, Source: "src", Topic: "t", ProcessorVersion: "v2"}
	rep, err := reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.False(t, rep.Clean(), "documents of processor version v1 are drift")
	require.Empty(t, rep.Missing)
	require.Empty(t, rep.Extra)
	var stale []string
	for _, d := range rep.Stale {
		stale = append(stale, d.ID)
		require.Equal(t, "v1", d.IndexPV, d.ID)
		require.Equal(t, "v2", d.SourcePV, d.ID)
		require.Equal(t, d.SourceVersion, d.IndexVersion, d.ID)
		require.True(t, d.OtherPV(), d.ID)
	}
	require.ElementsMatch(t, []string{"7", "700", "1999"}, stale)

	fixed, err := reconcile.Repair(ctx, cfg, rep)
	require.NoError(t, err)
	require.EqualValues(t, 3, fixed.Enqueued)
	require.Equal(t, 3, fixed.Removed, "a document at the source version is removed so the repair event can land")
	rows, err := pool.Query(ctx, `SELECT aggregate_id, aggregate_version, headers->>'ce_processorversion' FROM outbox_event_members ORDER BY aggregate_id`)
	require.NoError(t, err)
	bulk = client.Bulk().Index(index)
	var enqueued []string
	for rows.Next() {
		var id, pv string
		var v int64
		require.NoError(t, rows.Scan(&id, &v, &pv))
		require.Equal(t, "v2", pv, "the repair event of %s carries the row's processor version", id)
		enqueued = append(enqueued, id)
		bulk.Add(indexDocPV(id, v, false, pv)) // as the indexer applies it
	}
	require.NoError(t, rows.Err())
	require.ElementsMatch(t, []string{"7", "700", "1999"}, enqueued)
	res, err = bulk.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors, "%+v", res.Failed())
	rep, err = reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.True(t, rep.Clean(), "%+v", rep)
	require.Zero(t, rep.SourceRowsOtherPV)
}
