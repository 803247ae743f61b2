package reconcile_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// twoJobs is one alias fed by two jobs: articles (rebuilt at v2) and notes
// (at v1), both live in the generation the indexer created at its start.
type twoJobs struct {
	pool   *pgxpool.Pool
	client *elastic.Client
	cfg    sink.Config
	v1, v2 string
}

const articles, notes = 30, 20

func newTwoJobs(t *testing.T, engineURL string) *twoJobs { return newTwoJobsWith(t, engineURL, false) }

// newTwoJobsWith is newTwoJobs; with untypedV1 the articles' v1 documents
// were indexed before _aggregate_type was recorded (they have none).
func newTwoJobsWith(t *testing.T, engineURL string, untypedV1 bool) *twoJobs {
	t.Helper()
	ctx := context.Background()
	f := &twoJobs{pool: stack.Pool(t, stack.Database(t))}
	var err error
	f.client, err = index.NewClient(engineURL)
	require.NoError(t, err)
	f.cfg = sink.Config{URL: engineURL, Alias: stack.UniqueName("two-jobs")}.WithDefaults()
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(f.cfg.Alias + "_*").Do(context.Background()) })
	f.v1, err = index.Ensure(ctx, f.client, f.cfg.Alias, f.cfg.WriteAlias, f.cfg.Mapping)
	require.NoError(t, err)
	f.v2 = index.GenerationIndex(f.cfg.Alias, "v2")
	require.NoError(t, index.Create(ctx, f.client, f.v2, f.cfg.Mapping, map[string]any{f.v2 + "-write": map[string]any{"is_write_index": true}}))

	f.exec(t, `INSERT INTO batch_jobs (job, spec) VALUES
  ('articles', '{"job":"articles","processor_version":"v2","source_name":"articles","aggregate_type":"articles"}'),
  ('notes', '{"job":"notes","processor_version":"v1","source_name":"notes","aggregate_type":"notes"}')`)
	f.exec(t, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope, created_at) VALUES
  ('articles', 'a1', 'succeeded', 'v1', 'h', '{}', now() - interval '1 hour'),
  ('articles', 'a2', 'succeeded', 'v2', 'h', '{}', now()),
  ('notes', 'n1', 'succeeded', 'v1', 'h', '{}', now())`)
	f.exec(t, fmt.Sprintf(`INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'articles', 'a' || g, '{}'::jsonb, 1, 'v2', false FROM generate_series(1, %d) g
UNION ALL SELECT 'notes', 'n' || g, '{}'::jsonb, 1, 'v1', false FROM generate_series(1, %d) g`, articles, notes))
	old, next := f.client.Bulk().Index(f.v1), f.client.Bulk().Index(f.v2)
	for g := 1; g <= articles; g++ {
		if untypedV1 {
			id := fmt.Sprintf("a%d", g)
			old.Add(elastic.NewBulkIndexRequest().Id(id).Version(1).VersionType("external").
				Doc(map[string]any{"title": "old " + id, sink.FieldBucket: sink.Bucket(id), sink.FieldIDV: sink.IDV(id, 1, false, "")}))
		} else {
			old.Add(indexDocOf("articles", fmt.Sprintf("a%d", g), 1, false, "v1"))
		}
		next.Add(indexDocOf("articles", fmt.Sprintf("a%d", g), 1, false, "v2"))
	}
	for g := 1; g <= notes; g++ {
		old.Add(indexDocOf("notes", fmt.Sprintf("n%d", g), 1, false, "v1"))
	}
	f.bulk(t, old, next)
	return f
}

func (f *twoJobs) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := f.pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

func (f *twoJobs) bulk(t *testing.T, bs ...*elastic.BulkService) {
	t.Helper()
	for _, b := range bs {
		res, err := b.Refresh("true").Do(context.Background())
		require.NoError(t, err)
		require.False(t, res.Errors, "%+v", res.Failed())
	}
}

// search returns, per id the alias finds, how often it is found and the
// processor version of the hit.
func (f *twoJobs) search(t *testing.T) (count map[string]int, pv map[string]string) {
	t.Helper()
	res, err := f.client.Search(f.cfg.Alias).Size(1000).Do(context.Background())
	require.NoError(t, err)
	count, pv = map[string]int{}, map[string]string{}
	for _, h := range res.Hits.Hits {
		var doc struct {
			PV string `json:"_pv"`
		}
		require.NoError(t, json.Unmarshal(h.Source, &doc))
		count[h.Id]++
		pv[h.Id] = doc.PV
	}
	return count, pv
}

// requireFound checks that the alias finds every article at articlePV and
// every note (plus extraNotes) at v1, each once, and nothing else.
func (f *twoJobs) requireFound(t *testing.T, articlePV string, extraNotes ...string) {
	t.Helper()
	count, pv := f.search(t)
	want := map[string]int{}
	for g := 1; g <= articles; g++ {
		want[fmt.Sprintf("a%d", g)] = 1
	}
	for g := 1; g <= notes; g++ {
		want[fmt.Sprintf("n%d", g)] = 1
	}
	for _, id := range extraNotes {
		want[id] = 1
	}
	require.Equal(t, want, count, "every document of both jobs is found exactly once")
	for id, v := range pv {
		if id[0] == 'a' {
			require.Equal(t, articlePV, v, "article %s", id)
		} else {
			require.Equal(t, "v1", v, "note %s", id)
		}
	}
}

// Two jobs feed one alias. The articles job is rebuilt at v2 and cut over:
// searches find the articles at v2 and still every note (which only v1
// holds), each once, and the notes job's later changes (into v1, its
// generation) stay searchable. The rollback of articles (refused while v1
// is stale for it, then allowed once the job ran at v1 again) changes
// nothing for notes.
func TestCutoverOfOneJobKeepsTheOtherJobsDocuments(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testCutoverOfOneJobKeepsTheOtherJobsDocuments)
}

func testCutoverOfOneJobKeepsTheOtherJobsDocuments(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	f := newTwoJobs(t, engineURL)
	f.requireFound(t, "v1")

	res, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles"})
	require.NoError(t, err)
	require.Equal(t, f.v2, res.Index)
	require.Equal(t, []string{f.v1}, res.From)
	require.False(t, res.Whole, "notes still live in v1: the write alias stays")
	f.requireFound(t, "v2")
	write, err := index.AliasTargets(ctx, f.client, f.cfg.WriteAlias)
	require.NoError(t, err)
	require.Equal(t, []string{f.v1}, write)
	gens, err := index.Generations(ctx, f.client, f.cfg.Alias, f.cfg.WriteAlias)
	require.NoError(t, err)
	shows := map[string]string{}
	for _, g := range gens {
		shows[g.Index] = g.Shows
	}
	require.Equal(t, map[string]string{f.v1: "all but articles", f.v2: "articles"}, shows, "what indexer status shows per generation")

	// The notes job goes on at v1: a changed note and a new one land in v1.
	f.bulk(t, f.client.Bulk().Index(f.v1).Add(indexDocOf("notes", "n1", 2, false, "v1"), indexDocOf("notes", "n-new", 1, false, "v1")))
	f.requireFound(t, "v2", "n-new")

	// Rollback of articles: v1 is stale for it (its rows are at v2).
	_, err = reconcile.Rollback(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles"})
	require.True(t, errors.Is(err, index.ErrUnsafeMove), "rollback to a stale generation: %v", err)
	require.ErrorContains(t, err, "not at processor version v1")
	f.requireFound(t, "v2", "n-new")

	// The job ran at v1 again (its rows are back at v1): the rollback goes.
	f.exec(t, `UPDATE normalized_records SET processor_version = 'v1' WHERE source = 'articles'`)
	f.exec(t, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('articles', 'a3', 'succeeded', 'v1', 'h', '{}')`)
	res, err = reconcile.Rollback(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles"})
	require.NoError(t, err)
	require.Equal(t, f.v1, res.Index)
	require.Equal(t, []string{f.v2}, res.From)
	f.requireFound(t, "v1", "n-new")
	read, err := index.AliasTargets(ctx, f.client, f.cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{f.v1}, read, "v2 shows nothing any more: it left the read alias")
}

// A rollback runs the cutover's checks at the version it goes back to: v1
// is stale for the articles job after its cutover to v2 (its rows moved on
// to v2), so the rollback is refused, naming that. --force moves anyway,
// logs it and writes it to checkpoint_audit.
func TestRollbackRefusesAStaleGenerationUnlessForced(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testRollbackRefusesAStaleGenerationUnlessForced)
}

func testRollbackRefusesAStaleGenerationUnlessForced(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	f := newTwoJobs(t, engineURL)
	_, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles"})
	require.NoError(t, err)
	f.requireFound(t, "v2")

	_, err = reconcile.Rollback(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles"})
	require.True(t, errors.Is(err, index.ErrUnsafeMove), "rollback to a stale generation: %v", err)
	require.ErrorContains(t, err, "30 row(s) of normalized_records (source articles) are not at processor version v1")
	require.ErrorContains(t, err, "--force")
	f.requireFound(t, "v2")

	var logs bytes.Buffer
	res, err := reconcile.Rollback(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles", Force: true,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	require.True(t, res.Forced)
	require.Equal(t, f.v1, res.Index)
	f.requireFound(t, "v1")
	require.Contains(t, logs.String(), "rollback forced past the checks")
	require.Contains(t, logs.String(), "job=articles")
	var action, reason string
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT action, reason FROM checkpoint_audit WHERE job = 'articles'`).Scan(&action, &reason))
	require.Equal(t, "rollback-forced", action)
	require.Contains(t, reason, "not at processor version v1")
}

// Documents indexed before _aggregate_type was recorded cannot be told
// apart: a cutover of one job of several would leave the articles' old
// documents showing in v1 beside their v2 ones. It is refused, naming
// them, and nothing moves.
func TestCutoverOfOneJobRefusesDocumentsWithoutAggregateType(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testCutoverOfOneJobRefusesDocumentsWithoutAggregateType)
}

func testCutoverOfOneJobRefusesDocumentsWithoutAggregateType(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	f := newTwoJobsWith(t, engineURL, true)
	count, _ := f.search(t)
	require.Len(t, count, articles+notes)

	_, err := reconcile.Cutover(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles"})
	require.True(t, errors.Is(err, index.ErrUnsafeMove), "cutover: %v", err)
	require.ErrorContains(t, err, fmt.Sprintf("holds %d document(s) without _aggregate_type", articles))
	require.ErrorContains(t, err, "found twice")
	read, err := index.AliasTargets(ctx, f.client, f.cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{f.v1}, read, "nothing moved")
	count, _ = f.search(t)
	require.Len(t, count, articles+notes, "every document found once")
	for id, n := range count {
		require.Equal(t, 1, n, id)
	}
}

// AUTO_CUTOVER of the articles job, with notes on the same alias: the
// automatic cutover moves the articles only, and does not move them back
// after the operator's rollback.
func TestAutoCutoverOfOneJobKeepsTheOtherJobsDocuments(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testAutoCutoverOfOneJobKeepsTheOtherJobsDocuments)
}

func testAutoCutoverOfOneJobKeepsTheOtherJobsDocuments(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	f := newTwoJobs(t, engineURL)
	var logs logBuffer
	actx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- reconcile.AutoCutover(actx, f.cfg, reconcile.AutoCutoverOptions{
			DB: f.pool, Jobs: []string{"articles", "notes"}, Interval: 100 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		})
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	require.Eventually(t, func() bool { return logs.count("the read alias moved to the rebuilt generation") == 1 }, time.Minute, 20*time.Millisecond, logs.String())
	f.requireFound(t, "v2")

	// The operator rolls articles back (forced: v1 is stale for it); the
	// automatic cutover leaves it there, and notes where they are.
	_, err := reconcile.Rollback(ctx, f.cfg, reconcile.CutoverOptions{DB: f.pool, Job: "articles", Force: true})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return logs.count("rolled back from; left to the operator") > 0 }, time.Minute, 20*time.Millisecond, logs.String())
	f.requireFound(t, "v1")
	require.Equal(t, 1, logs.count("the read alias moved"))
	require.Zero(t, logs.count("level=WARN"), logs.String())
}
