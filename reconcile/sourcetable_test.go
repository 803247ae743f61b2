package reconcile_test

import (
	"context"
	"maps"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// The scope of an incremental job with a filter and an explicit partition
// list: rows hard-deleted, moved out of the filter or out of the partition
// list, a document the index holds without a normalized row, and one
// without an aggregate type are gone; a soft delete and an update no run
// carried yet are behind; a new row is missing, a quarantined one is
// not. RepairGone writes a
// tombstone and a delete event per gone id of the job's own, one version
// above the document's (also when the index is ahead of
// normalized_records), leaves alone a row back in scope since the
// comparison, and writes nothing the second time.
func TestSourceTableFindsGoneRowsAndRepairsThemThroughTheOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 400)
	f.exec(t, `ALTER TABLE source_records ADD COLUMN archived boolean NOT NULL DEFAULT false`)
	f.spec.Mode = batch.ModeIncremental
	f.spec.Vanished = batch.VanishedKeep
	f.spec.Source.Cursor = []string{"change_seq"}
	f.spec.Source.Partition = "tenant_id"
	f.spec.Source.Partitions = []string{"tenant-0", "tenant-1", "tenant-2"}
	f.spec.Source.Filter = []batch.Condition{{Column: "archived", Op: "=", Value: "false"}}
	// A row the normalizer refuses: quarantined, not missing.
	require.EqualValues(t, 1, f.exec(t, `UPDATE source_records SET payload = payload - 'title' WHERE id = (SELECT min(id) FROM source_records WHERE tenant_id = 'tenant-1')`))
	f.run(t)
	f.index(t)
	spec, err := batch.LoadJobSpec(ctx, f.pool, f.spec.Job)
	require.NoError(t, err)
	cfg := reconcile.Config{DB: f.pool, Search: f.client, Index: f.next, Topic: "records-topic"}

	ids := func(sql string) []string {
		t.Helper()
		rows, err := f.pool.Query(ctx, sql)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	inScope := `SELECT id FROM source_records WHERE tenant_id <> 'tenant-3' AND NOT archived AND deleted_at IS NULL ORDER BY id`
	deleted := ids(`DELETE FROM source_records WHERE id IN (` + inScope + ` OFFSET 10 LIMIT 3) RETURNING id::text`)
	archived := ids(`UPDATE source_records SET archived = true WHERE id IN (` + inScope + ` OFFSET 50 LIMIT 2) RETURNING id::text`)
	moved := ids(`UPDATE source_records SET tenant_id = 'tenant-3' WHERE id IN (` + inScope + ` OFFSET 90 LIMIT 1) RETURNING id::text`)
	softDeleted := ids(`UPDATE source_records SET deleted_at = now() WHERE id IN (` + inScope + ` OFFSET 120 LIMIT 1) RETURNING id::text`)
	updated := ids(`UPDATE source_records SET payload = payload || '{"title": "new title"}' WHERE id IN (` + inScope + ` OFFSET 150 LIMIT 1) RETURNING id::text`)
	inserted := ids(`INSERT INTO source_records (id, tenant_id, payload) VALUES (999001, 'tenant-1', '{"title": "new"}') RETURNING id::text`)
	require.Len(t, slices.Concat(deleted, archived, moved, softDeleted, updated, inserted), 9)
	// In the index only: the job's own (a delete the pipeline lost), and
	// one without an aggregate type (someone else's, perhaps).
	res, err := f.client.Bulk().Index(f.next).Refresh("true").
		Add(indexDocOf(f.spec.Source.Table, "999999", 3, false, "v2")).
		Add(elastic.NewBulkIndexRequest().Id("888888").Doc(map[string]any{"title": "no type", sink.FieldBucket: sink.Bucket("888888")})).
		// The index ahead of normalized_records for a deleted row.
		Add(indexDocOf(f.spec.Source.Table, deleted[0], 7, false, "v2")).
		Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)
	normVersion := func(id string) int64 {
		var v int64
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT source_version FROM normalized_records WHERE source = 'source_records' AND source_id = $1`, id).Scan(&v))
		return v
	}
	// The index version each gone document of the job's own must end
	// below: its tombstone's.
	want := map[string]int64{deleted[0]: 8, deleted[2]: normVersion(deleted[2]) + 1, "999999": 4}
	for _, id := range slices.Concat(archived, moved) {
		want[id] = normVersion(id) + 1
	}

	rep, err := reconcile.RunSourceTable(ctx, cfg, spec)
	require.NoError(t, err)
	driftIDs := func(ds []reconcile.Drift) []string {
		out := []string{}
		for _, d := range ds {
			out = append(out, d.ID)
		}
		return out
	}
	sorted := func(l ...[]string) []string { return slices.Sorted(slices.Values(slices.Concat(l...))) }
	require.Equal(t, sorted(deleted, archived, moved, []string{"888888", "999999"}), driftIDs(rep.Gone), "gone")
	require.Equal(t, sorted(softDeleted, updated), driftIDs(rep.Behind), "behind")
	require.Equal(t, inserted, driftIDs(rep.Missing), "missing")
	require.EqualValues(t, 1, rep.Quarantined)
	require.False(t, rep.Clean())

	// A deleted row comes back before the repair: left alone.
	f.exec(t, `INSERT INTO source_records (id, tenant_id, payload) VALUES (`+deleted[1]+`, 'tenant-0', '{"title": "back"}')`)
	outboxBefore := f.exec(t, `SELECT FROM outbox_event_members`)
	fixed, err := reconcile.RepairGone(ctx, cfg, spec, rep)
	require.NoError(t, err)
	require.EqualValues(t, len(want), fixed.Enqueued)
	require.Equal(t, slices.Sorted(maps.Keys(want)), fixed.IDs)
	require.Equal(t, 1, fixed.KeptUnowned)
	require.Equal(t, 1, fixed.KeptBack)

	type event struct {
		ID      string
		Version int64
		Type    string
		Topic   string
		Agg     string
		PV      string
	}
	rows, err := f.pool.Query(ctx, `SELECT aggregate_id, aggregate_version, event_type, topic, aggregate_type, headers->>$1 FROM outbox_event_members
WHERE aggregate_id = ANY($2) AND event_type = 'delete' ORDER BY aggregate_id`, outbox.HeaderProcessorVersion, slices.Collect(maps.Keys(want)))
	require.NoError(t, err)
	events, err := pgx.CollectRows(rows, pgx.RowToStructByPos[event])
	require.NoError(t, err)
	require.Len(t, events, len(want))
	for _, e := range events {
		require.Equal(t, event{ID: e.ID, Version: want[e.ID], Type: "delete", Topic: "records-topic", Agg: "source_records", PV: "v2"}, e)
		var tombstone bool
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT deleted AND vanished AND document IS NULL FROM normalized_records WHERE source = 'source_records' AND source_id = $1`, e.ID).Scan(&tombstone))
		require.True(t, tombstone, "id %s: a vanished tombstone without a document", e.ID)
		require.Equal(t, want[e.ID], normVersion(e.ID))
	}
	require.Equal(t, outboxBefore+int64(len(want)), f.exec(t, `SELECT FROM outbox_event_members`))

	// The same report again: the tombstones are on their way; nothing new.
	again, err := reconcile.RepairGone(ctx, cfg, spec, rep)
	require.NoError(t, err)
	require.Zero(t, again.Enqueued)
	require.Equal(t, len(want), again.Pending)
	require.Equal(t, outboxBefore+int64(len(want)), f.exec(t, `SELECT FROM outbox_event_members`))
}
