package reconcile_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// moveFixture: job j (aggregate type src) live in the bootstrap index at
// v1 (recorded in PostgreSQL), and a complete generation at v2 (10 rows,
// 10 documents, a succeeded run).
type moveFixture struct {
	pool       *pgxpool.Pool
	client     *elastic.Client
	cfg        sink.Config
	live, next string
}

func newMoveFixture(t *testing.T) moveFixture {
	t.Helper()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	client, err := index.NewClient(stack.ElasticsearchURL(t))
	require.NoError(t, err)
	cfg := sink.Config{URL: stack.ElasticsearchURL(t), Alias: stack.UniqueName("cut-fail")}.WithDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })
	live, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	next := index.GenerationIndex(cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, client, next, cfg.Mapping, map[string]any{next + "-write": map[string]any{"is_write_index": true}}))
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('j', '{"job":"j","processor_version":"v2","source_name":"src","aggregate_type":"src"}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('j', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, '{}'::jsonb, 1, 'v2', false FROM generate_series(1, 10) g`)
	require.NoError(t, err)
	_, err = batch.SetLiveVersion(ctx, pool, "j", "v1", batch.MovedByCutover)
	require.NoError(t, err)
	b := client.Bulk().Index(next)
	for g := 1; g <= 10; g++ {
		b.Add(indexDocPV(strconv.Itoa(g), 1, false, "v2"))
	}
	res, err := b.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)
	return moveFixture{pool: pool, client: client, cfg: cfg, live: live, next: next}
}

func (f moveFixture) liveVersion(t *testing.T) string {
	t.Helper()
	v, err := batch.LoadLiveVersion(context.Background(), f.pool, "j")
	require.NoError(t, err)
	return v.ProcessorVersion
}

func (f moveFixture) readAlias(t *testing.T) []string {
	t.Helper()
	read, err := index.AliasTargets(context.Background(), f.client, f.cfg.Alias)
	require.NoError(t, err)
	return read
}

// A step after the _aliases call fails (issue 27 review, item 1): the
// aliases moved, so PostgreSQL records v2 as live all the same, and the
// error says what failed.
func TestCutoverFailingAfterTheAliasMoveRecordsTheLiveVersion(t *testing.T) {
	t.Parallel()
	f := newMoveFixture(t)
	opts := reconcile.WithAfterMove(reconcile.CutoverOptions{DB: f.pool, Job: "j"}, func() error { return errors.New("injected: copy failed") })
	_, err := reconcile.Cutover(context.Background(), f.cfg, opts)
	require.ErrorContains(t, err, "injected: copy failed")
	require.Equal(t, []string{f.next}, f.readAlias(t), "the aliases moved")
	require.Equal(t, "v2", f.liveVersion(t), "searches read v2: recorded as live")
}

// The aliases moved and recording the live version was lost (a process
// that died in between): the automatic cutover finds the generation live
// and records its version (issue 27 review, item 1).
func TestAutoCutoverRecordsAGenerationFoundLive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newMoveFixture(t)
	_, err := index.MoveJob(ctx, f.client, f.pool, f.cfg.Alias, f.cfg.WriteAlias,
		index.JobMove{Type: "src", Target: f.next, JobTypes: []string{"src"}}, index.MoveOptions{Job: "j"})
	require.NoError(t, err)
	require.Equal(t, "v1", f.liveVersion(t), "the move alone records nothing in PostgreSQL")

	actx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- reconcile.AutoCutover(actx, f.cfg, reconcile.AutoCutoverOptions{DB: f.pool, Jobs: []string{"j"}, Interval: 50 * time.Millisecond})
	}()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	require.Eventually(t, func() bool { return f.liveVersion(t) == "v2" }, time.Minute, 20*time.Millisecond)
	var how string
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT how FROM batch_live_version_moves WHERE job = 'j' ORDER BY id DESC LIMIT 1`).Scan(&how))
	require.Equal(t, batch.MovedByAutoCutover, how)
}

// The _aliases call fails (someone moved the aliases meanwhile): the
// target's _meta records no move (issue 27 review, item 5), so the
// automatic cutover still takes it for a candidate, not for a generation
// rolled back from.
func TestCutoverWhoseAliasCallFailsRecordsNoMove(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newMoveFixture(t)
	opts := reconcile.WithBeforeMove(reconcile.CutoverOptions{DB: f.pool, Job: "j"}, func() {
		// Another writer took the write alias: the move's add of it as
		// write index conflicts.
		other := f.cfg.Alias + "_other"
		require.NoError(t, index.Create(ctx, f.client, other, f.cfg.Mapping, nil))
		require.NoError(t, index.UpdateAliases(ctx, f.client, []any{
			map[string]any{"add": map[string]any{"index": f.live, "alias": f.cfg.WriteAlias, "is_write_index": false}},
			map[string]any{"add": map[string]any{"index": other, "alias": f.cfg.WriteAlias, "is_write_index": true}},
		}))
	})
	_, err := reconcile.Cutover(ctx, f.cfg, opts)
	require.ErrorContains(t, err, "someone else moved the aliases meanwhile")
	require.Equal(t, []string{f.live}, f.readAlias(t), "nothing moved")
	gens, err := index.ListGenerations(ctx, f.client, f.next)
	require.NoError(t, err)
	require.Len(t, gens, 1)
	require.Empty(t, gens[0].Meta.CutoverAt, "no cutover recorded")
	require.NotContains(t, gens[0].Meta.Sources, "src")
	require.Equal(t, "v1", f.liveVersion(t))
}

// A forced cutover (the checks refused) that the move itself then refuses
// (a document without a processor version it would hide) writes no
// cutover-forced audit row (issue 27 review, item 6); the forced move that
// goes through writes one.
func TestForcedCutoverIsAuditedOnlyOnceMoved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newMoveFixture(t)
	// Not ready: 11 rows, 10 documents.
	_, err := f.pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted) VALUES ('src', '11', '{}', 1, 'v2', false)`)
	require.NoError(t, err)
	_, err = f.client.Index().Index(f.live).Id("app-1").BodyJson(map[string]any{"title": "app", sink.FieldAggregateType: "src"}).Refresh("true").Do(ctx)
	require.NoError(t, err)
	audits := func() int {
		var n int
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM checkpoint_audit WHERE job = 'j' AND action = 'cutover-forced'`).Scan(&n))
		return n
	}

	_, err = reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "j", Force: true})
	require.ErrorIs(t, err, index.ErrUnsafeMove)
	require.ErrorContains(t, err, "without a processor version")
	require.Equal(t, []string{f.live}, f.readAlias(t), "nothing moved")
	require.Zero(t, audits(), "no audit row for a move that did not happen")

	res, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "j", Force: true, AllowUnversioned: true})
	require.NoError(t, err)
	require.True(t, res.Forced)
	require.Equal(t, []string{f.next}, f.readAlias(t))
	require.Equal(t, 1, audits())
}

// A rollback to a generation whose processor version is unknown (no
// metadata, no run of that generation's name) is refused, --force or not
// (issue 27 review, item 7): nothing moves and "" is never recorded live.
func TestRollbackToAGenerationOfUnknownVersionIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newMoveFixture(t)
	_, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "j"})
	require.NoError(t, err)
	require.Equal(t, "v2", f.liveVersion(t))

	_, err = reconcile.Rollback(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "j", Force: true})
	require.ErrorIs(t, err, index.ErrUnsafeMove)
	require.ErrorContains(t, err, "processor version is unknown")
	require.Equal(t, []string{f.next}, f.readAlias(t), "nothing moved")
	require.Equal(t, "v2", f.liveVersion(t))
}
