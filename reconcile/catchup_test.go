package reconcile_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// rebuildFixture is a demo source table, the job at processor version v2,
// a live generation (empty, v1) and the v2 generation beside it, which
// index fills from normalized_records the way the indexer would.
type rebuildFixture struct {
	pool   *pgxpool.Pool
	client *elastic.Client
	cfg    sink.Config
	spec   batch.Spec
	live   string
	next   string
	// proc, if set, is the Go path's processor of every run.
	proc batch.Processor
}

func newRebuildFixture(t *testing.T, rows int) *rebuildFixture {
	t.Helper()
	ctx := context.Background()
	f := &rebuildFixture{pool: stack.Pool(t, stack.Database(t))}
	require.NoError(t, demo.Seed(ctx, f.pool, demo.SeedOptions{Rows: rows}))
	var err error
	f.client, err = index.NewClient(stack.ElasticsearchURL(t))
	require.NoError(t, err)
	f.cfg = sink.Config{URL: stack.ElasticsearchURL(t), Alias: stack.UniqueName("catchup")}.WithDefaults()
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(f.cfg.Alias + "_*").Do(context.Background()) })
	f.live, err = index.Ensure(ctx, f.client, f.cfg.Alias, f.cfg.WriteAlias, f.cfg.Mapping)
	require.NoError(t, err)
	f.next = index.GenerationIndex(f.cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, f.client, f.next, f.cfg.Mapping, map[string]any{f.next + "-write": map[string]any{"is_write_index": true}}))
	f.spec = batch.DemoSpec()
	f.spec.ProcessorVersion = "v2"
	f.spec.Chunk = batch.ChunkSettings{Size: 100, Min: 100, Max: 100}
	return f
}

// run runs the job once (a new run when the last one finished).
func (f *rebuildFixture) run(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := batch.NewRunner(f.pool, f.spec, batch.Config{Workers: 1, Processor: f.proc})
	require.NoError(t, err)
	_, err = r.Run(ctx, ctx)
	require.NoError(t, err)
}

// index writes every normalized row into the v2 generation at its version
// (external; a row already there at its version answers 409, as a replay).
func (f *rebuildFixture) index(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	rows, err := f.pool.Query(ctx, `SELECT source_id, source_version, deleted, processor_version FROM normalized_records WHERE source = $1`, f.spec.Source.Table)
	require.NoError(t, err)
	type row struct {
		ID      string
		Version int64
		Deleted bool
		PV      string
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	bulk := f.client.Bulk().Index(f.next).Refresh("true")
	for _, r := range all {
		bulk.Add(indexDocOf(f.spec.Source.Table, r.ID, r.Version, r.Deleted, r.PV))
	}
	res, err := bulk.Do(ctx)
	require.NoError(t, err)
	for _, item := range res.Failed() {
		require.Equal(t, http.StatusConflict, item.Status, "%+v", item.Error)
	}
}

func (f *rebuildFixture) exec(t *testing.T, sql string) int64 {
	t.Helper()
	tag, err := f.pool.Exec(context.Background(), sql)
	require.NoError(t, err)
	return tag.RowsAffected()
}

func (f *rebuildFixture) readAlias(t *testing.T) []string {
	t.Helper()
	read, err := index.AliasTargets(context.Background(), f.client, f.cfg.Alias)
	require.NoError(t, err)
	return read
}

// The rebuild's scan reads a row, a writer changes it behind the scanner,
// and after the run rows are soft-deleted, inserted and deleted: the new
// generation matches normalized_records, but not the source. A cutover now
// is refused, naming the count and the fix (the catch-up run); after the
// catch-up it goes ahead. Changes made after the catch-up are in flight
// (writers never stop): counted, not refused.
func TestCutoverAfterTheRebuildWaitsForTheCatchUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 300)
	// While the scan is on its second chunk, five rows of its first chunk
	// (read already) change (the Go path, to act in the middle of the run).
	var calls atomic.Int32
	var changedBehind int64
	f.proc = batch.ProcessorFunc(func(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
		if calls.Add(1) == 2 {
			tag, err := f.pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"title": "changed behind the scanner"}'
WHERE id IN (SELECT id FROM source_records ORDER BY created_at, id LIMIT 5)`)
			if err != nil {
				return nil, err
			}
			changedBehind = tag.RowsAffected()
		}
		out := make([]batch.Result, len(rows))
		for i, r := range rows {
			out[i].Document, _ = json.Marshal(map[string]any{"row": r.Row})
		}
		return out, nil
	})
	f.run(t)
	require.EqualValues(t, 5, changedBehind, "the writer ran during the scan")
	f.index(t)

	// After the run: 3 soft deletes, 4 new rows, 2 hard deletes.
	require.EqualValues(t, 3, f.exec(t, `UPDATE source_records SET deleted_at = now() WHERE id IN (SELECT id FROM source_records ORDER BY id DESC LIMIT 3)`))
	require.NoError(t, demo.Seed(ctx, f.pool, demo.SeedOptions{Rows: 4}))
	require.EqualValues(t, 2, f.exec(t, `DELETE FROM source_records WHERE id IN (SELECT id FROM source_records WHERE deleted_at IS NULL ORDER BY id OFFSET 100 LIMIT 2)`))

	r, err := reconcile.CheckGeneration(ctx, f.cfg, f.pool, f.spec.Job)
	require.NoError(t, err)
	require.True(t, r.SourceCompared)
	require.Equal(t, batch.Behind{Changed: 8, Missing: 4, Gone: 2}, r.Behind)
	require.NotEmpty(t, r.Rebuild)
	require.Empty(t, r.CatchUp)
	require.Zero(t, r.Drift, "the generation matches normalized_records: only the source says it is behind")
	require.Len(t, r.Missing, 1, "%v", r.Missing)
	require.Contains(t, r.Missing[0], "14 row(s) of public.source_records changed after run "+r.Rebuild+" read them")
	require.Contains(t, r.Missing[0], "batcher run --job records")
	require.Contains(t, r.String(), "14 source rows changed since read")

	_, err = reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: f.spec.Job})
	require.True(t, errors.Is(err, index.ErrUnsafeMove), "cutover before the catch-up: %v", err)
	require.ErrorContains(t, err, "14 row(s) of public.source_records changed after run")
	require.Equal(t, []string{f.live}, f.readAlias(t), "nothing moved")

	// The catch-up: the same spec again.
	f.run(t)
	f.index(t)
	r, err = reconcile.CheckGeneration(ctx, f.cfg, f.pool, f.spec.Job)
	require.NoError(t, err)
	require.True(t, r.Ready(), "%v", r.Missing)
	require.Zero(t, r.Behind.Total())
	require.NotEmpty(t, r.CatchUp)
	require.NotEqual(t, r.Rebuild, r.CatchUp)

	// A writer goes on after the catch-up: in flight, not a refusal.
	require.EqualValues(t, 6, f.exec(t, `UPDATE source_records SET payload = payload || '{"title": "in flight"}' WHERE id IN (SELECT id FROM source_records WHERE deleted_at IS NULL ORDER BY id LIMIT 6)`))
	res, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: f.spec.Job})
	require.NoError(t, err)
	require.Equal(t, batch.Behind{Changed: 6}, res.Behind)
	require.Contains(t, res.String(), "6 source rows changed since read")
	require.Equal(t, []string{f.next}, f.readAlias(t))
}

// A rebuild during which nothing changed needs no catch-up run.
func TestCutoverAfterAQuietRebuildNeedsNoCatchUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 250)
	f.exec(t, `UPDATE source_records SET deleted_at = now() WHERE id IN (SELECT id FROM source_records ORDER BY id LIMIT 10)`) // soft-deleted before the run
	f.run(t)
	f.index(t)
	res, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: f.spec.Job})
	require.NoError(t, err)
	require.Zero(t, res.Behind.Total())
	require.Empty(t, res.CatchUp)
	require.Equal(t, []string{f.next}, f.readAlias(t))
}
