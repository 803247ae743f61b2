package reconcile_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

const testMapping = `{"settings":{"number_of_shards":1,"number_of_replicas":0,"index.gc_deletes":"1s"},"mappings":{"properties":{"_bucket":{"type":"integer"},"_idv":{"type":"long"},"_deleted":{"type":"boolean"},"_aggregate_type":{"type":"keyword"}}}}`

// ownedDoc writes what the indexer writes for an event of aggregate type
// typ: the document plus the reconcile fields, at the source version.
func ownedDoc(typ, id string, version int64, deleted bool) *elastic.BulkIndexRequest {
	doc := map[string]any{"title": "doc " + id}
	if deleted {
		doc = map[string]any{sink.FieldDeleted: true}
	}
	doc[sink.FieldBucket] = sink.Bucket(id)
	doc[sink.FieldIDV] = sink.IDV(id, version, deleted, "v1")
	doc[sink.FieldPV] = "v1" // as the batcher's events (processor version v1) are indexed
	doc[sink.FieldAggregateType] = typ
	return elastic.NewBulkIndexRequest().Id(id).Version(version).VersionType("external").Doc(doc)
}

type repairFixture struct {
	pool   *pgxpool.Pool
	client *elastic.Client
	index  string
}

func newRepairFixture(t *testing.T, engineURL string) *repairFixture {
	t.Helper()
	ctx := context.Background()
	client, err := index.NewClient(engineURL)
	require.NoError(t, err)
	f := &repairFixture{pool: stack.Pool(t, stack.Database(t)), client: client, index: stack.UniqueName("reconcile")}
	_, err = client.CreateIndex(f.index).BodyString(testMapping).Do(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = client.DeleteIndex(f.index).Do(context.Background()) })
	return f
}

// rows adds normalized_records rows source/prefix-1..n at version 1 and
// indexes them as the indexer would, with aggregate type source.
func (f *repairFixture) rows(t *testing.T, source, prefix string, n int, inDB bool) {
	t.Helper()
	ctx := context.Background()
	if inDB {
		_, err := f.pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT $1, $2 || g, jsonb_build_object('title', 'doc ' || g), 1, 'v1', false FROM generate_series(1, $3) g`, source, prefix, n)
		require.NoError(t, err)
	}
	bulk := f.client.Bulk().Index(f.index)
	for g := 1; g <= n; g++ {
		bulk.Add(ownedDoc(source, prefix+strconv.Itoa(g), 1, false))
	}
	res, err := bulk.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)
}

func (f *repairFixture) exists(t *testing.T, id string) bool {
	t.Helper()
	_, err := f.client.Get().Index(f.index).Id(id).Do(context.Background())
	if elastic.IsNotFound(err) {
		return false
	}
	require.NoError(t, err)
	return true
}

func extraIDs(rep reconcile.Report) []string {
	var out []string
	for _, d := range rep.Extra {
		out = append(out, d.ID)
	}
	return out
}

// The index holds other producers' documents, a tombstone of an id that
// left normalized_records, and a document whose row is written after the
// comparison: a repair deletes only this source's live extras.
func TestRepairDeletesOnlyThisSourcesLiveExtras(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testRepairDeletesOnlyThisSourcesLiveExtras)
}

func testRepairDeletesOnlyThisSourcesLiveExtras(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	f := newRepairFixture(t, engineURL)
	f.rows(t, "src", "s-", 200, true)
	f.rows(t, "orders", "o-", 40, true)                                                                      // another producer, same index
	f.rows(t, "src", "stray-", 4, false)                                                                     // this source's, not in normalized_records: extras
	res, err := f.client.Bulk().Index(f.index).Add(ownedDoc("src", "gone", 7, true)).Refresh("true").Do(ctx) // a tombstone
	require.NoError(t, err)
	require.False(t, res.Errors)

	cfg := reconcile.Config{DB: f.pool, Search: f.client, Index: f.index, Source: "src", Topic: "t", DeleteGC: 1}
	rep, err := reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, []string{"gone", "stray-1", "stray-2", "stray-3", "stray-4"}, extraIDs(rep), "other producers' documents are not extras")

	// stray-1's row arrives (and is indexed again) after the comparison;
	// stray-2's row arrives, its event still in flight; stray-4 is written
	// again (the delete must not take what the comparison did not see).
	_, err = f.pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
VALUES ('src', 'stray-1', '{"title":"late"}', 2, 'v1', false), ('src', 'stray-2', '{"title":"late"}', 2, 'v1', false)`)
	require.NoError(t, err)
	res, err = f.client.Bulk().Index(f.index).Add(ownedDoc("src", "stray-1", 2, false), ownedDoc("src", "stray-4", 2, false)).Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)

	fixed, err := reconcile.Repair(ctx, cfg, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.RepairResult{Removed: 1, KeptTombstones: 1, KeptChanged: 1, KeptReappeared: 2}, fixed, "only stray-3 removed")
	require.False(t, f.exists(t, "stray-3"))
	for _, id := range []string{"gone", "stray-1", "stray-2", "stray-4", "o-1", "o-40", "s-1"} {
		require.True(t, f.exists(t, id), "%s kept", id)
	}
}

// A job whose table is "t": reconcile derives the source when it is not
// given, and a source without rows is refused instead of reporting every
// document as extra; a repair that would delete a large share of the index
// is refused unless forced.
func TestReconcileSourceAndRepairSafety(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testReconcileSourceAndRepairSafety)
}

func testReconcileSourceAndRepairSafety(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	f := newRepairFixture(t, engineURL)
	f.rows(t, "t", "", 500, true)

	rep, err := reconcile.Run(ctx, reconcile.Config{DB: f.pool, Search: f.client, Index: f.index, Source: "source_records"})
	require.Error(t, err, "%d extras", rep.ExtraCount)
	require.Contains(t, err.Error(), `"t"`, "names the sources present")

	cfg := reconcile.Config{DB: f.pool, Search: f.client, Index: f.index, Topic: "t", DeleteGC: 1}
	rep, err = reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.True(t, rep.Clean(), "%+v", rep)
	require.Equal(t, "t", rep.Source)
	require.EqualValues(t, 500, rep.IndexDocs)

	// 100 of 600 documents are this source's extras: too many to delete
	// without --force.
	f.rows(t, "t", "x-", 100, false)
	cfg.Source = rep.Source
	rep, err = reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, 100, rep.ExtraCount)
	_, err = reconcile.Repair(ctx, cfg, rep)
	require.ErrorIs(t, err, reconcile.ErrRepairTooLarge)
	require.True(t, f.exists(t, "x-1"))
	cfg.Force = true
	fixed, err := reconcile.Repair(ctx, cfg, rep)
	require.NoError(t, err)
	require.Equal(t, 100, fixed.Removed)
	_, err = f.client.Refresh(f.index).Do(ctx)
	require.NoError(t, err)
	rep, err = reconcile.Run(ctx, cfg)
	require.NoError(t, err)
	require.True(t, rep.Clean(), "%+v", rep)
}
