package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// expectedCommentsSQL is the comments of every record that must be live
// in the index, written here from demo/job.yaml's relation (not by the
// compiler): live comments in (created_at, id) order, at most 20, author
// and trimmed body ($1: with created_at too, as v2 has it).
const expectedCommentsSQL = `
SELECT s.id::text, COALESCE((
  SELECT jsonb_agg(jsonb_build_object('author', c.author, 'body', btrim(c.body))
                   || CASE WHEN $1 THEN jsonb_build_object('at', c.created_at) ELSE '{}'::jsonb END ORDER BY c.created_at, c.id)
  FROM (SELECT * FROM record_comments c WHERE c.record_id = s.id AND c.deleted_at IS NULL ORDER BY c.created_at, c.id LIMIT 20) c), '[]')
FROM source_records s
WHERE s.deleted_at IS NULL AND jsonb_typeof(s.payload->'title') = 'string'`

// commentsDiffer compares every live document's comments in the index
// (the read alias) with expectedCommentsSQL, and returns how many differ
// and the first difference.
func (p *pipeline) commentsDiffer(ctx context.Context, withAt bool) (int, string) {
	p.tb.Helper()
	rows, err := p.pool.Query(ctx, expectedCommentsSQL, withAt)
	require.NoError(p.tb, err)
	want := map[string]any{}
	for rows.Next() {
		var id string
		var raw []byte
		require.NoError(p.tb, rows.Scan(&id, &raw))
		var v any
		require.NoError(p.tb, json.Unmarshal(raw, &v))
		want[id] = v
	}
	require.NoError(p.tb, rows.Err())
	got, err := p.tryReadIndex(ctx)
	if err != nil {
		return len(want), "index not readable yet: " + err.Error()
	}
	bad, first := 0, ""
	for id, w := range want {
		d, ok := got[id]
		var g any
		if ok && d.Source["_deleted"] != true {
			g = d.Source["comments"]
		}
		if !reflect.DeepEqual(w, g) {
			bad++
			if first == "" {
				first = fmt.Sprintf("record %s: want comments %v, index has %v", id, w, g)
			}
		}
	}
	return bad, first
}

// tryReadIndex reads every document (tombstones included) through the
// write alias, or says why it could not (an index that does not exist or
// answer yet: its first documents are on their way).
func (p *pipeline) tryReadIndex(ctx context.Context) (map[string]indexDoc, error) {
	out := map[string]indexDoc{}
	scroll := p.es.Scroll(p.alias + "-write").Size(5000).Version(true).KeepAlive("2m")
	defer scroll.Clear(context.WithoutCancel(ctx))
	for {
		res, err := scroll.Do(ctx)
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		for _, h := range res.Hits.Hits {
			var src map[string]any
			if err := json.Unmarshal(h.Source, &src); err != nil {
				return nil, err
			}
			out[h.Id] = indexDoc{Version: *h.Version, Source: src}
		}
	}
}

func (p *pipeline) waitComments(ctx context.Context, timeout time.Duration, withAt bool, procs func() string) {
	p.tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		bad, first := p.commentsDiffer(ctx, withAt)
		if bad == 0 {
			return
		}
		require.Truef(p.tb, time.Now().Before(deadline), "%d records' comments differ after %s; first: %s\n%s", bad, timeout, first, procs())
		pause(ctx, 200*time.Millisecond)
	}
}

// TestRelationsWorkflow is the demo job with its comments relation, as a
// user runs it: `batcher follow-trigger --install`, a follower, the
// publisher and the indexer as real processes. Comments are added to
// records whose rows never change, edited, soft- and hard-deleted, moved
// to another record, truncated; the follower is SIGKILLed in between. Each
// time the index's comments must equal the ones computed from the tables.
// Then the user changes the relation (v2: each comment's created_at too),
// rebuilds into a new generation, cuts over, and follows on at v2.
func TestRelationsWorkflow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const rows = 3000
	p := newPipeline(t, pipelineOptions{TopicPartitions: 3})
	spec, err := batch.LoadSpec(filepath.Join(stack.RepoRoot(), "demo", "job.yaml"))
	require.NoError(t, err)
	p.spec.Document.Relations = spec.Document.Relations
	require.NotEmpty(t, p.spec.Document.Relations, "demo/job.yaml nests the comments")
	p.spec.Mode = batch.ModeIncremental
	p.spec.Source.Cursor = []string{"change_seq"}
	p.spec.Vanished = batch.VanishedDelete
	p.spec.Chunk = batch.ChunkSettings{Size: 500, Min: 100, Max: 2000}
	writeSpec := func(s batch.Spec, name string) string {
		b, err := json.MarshalIndent(s, "", "  ")
		require.NoError(t, err)
		f := filepath.Join(t.TempDir(), name)
		require.NoError(t, os.WriteFile(f, b, 0o644))
		return f
	}
	p.specFile = writeSpec(p.spec, "job.json")
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows, CommentEvery: 3}))

	// Without the capture triggers the job is refused, naming the command.
	refused := testproc.Run(t, time.Minute, p.batcherBin, p.env(), "run", "--spec", p.specFile)
	require.Equal(t, cli.ExitUsage, refused.ExitCode(), refused.Stderr())
	require.Contains(t, refused.Stderr(), "follow-trigger --install")
	tr := testproc.Run(t, time.Minute, p.batcherBin, p.env(), "follow-trigger", "--spec", p.specFile, "--install")
	require.Equal(t, 0, tr.ExitCode(), "follow-trigger --install:\n%s", tr.Stderr())
	require.Contains(t, tr.Stdout(), "public.record_comments")

	ixEnv := []string{"LOG_LEVEL=warn", "SESSION_TIMEOUT=6s", "HEARTBEAT_INTERVAL=1s", "FLUSH_INTERVAL=100ms"}
	pub := p.startPublisher("LOG_LEVEL=warn", "LEASE_TTL=2s", "POLL_INTERVAL=100ms")
	ix := p.startIndexer(ixEnv...)
	fenv := []string{"LEASE_TTL=3s", "FOLLOW_POLL=500ms"}
	f := p.startFollower(fenv...)
	procs := func() string {
		return fmt.Sprintf("follower:\n%s\npublisher:\n%s\nindexer:\n%s", tail(f.Stderr(), 15), tail(pub.Stderr(), 5), tail(ix.Stderr(), 5))
	}
	p.waitComments(ctx, 3*time.Minute, false, procs)

	// Each step changes comments only: no record row changes.
	var versions int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT sum(version) FROM source_records`).Scan(&versions))
	steps := []struct{ name, sql string }{
		{"comments added to records without any", `INSERT INTO record_comments (record_id, author, body) SELECT id, 'new', '  fresh  ' FROM source_records WHERE id % 7 = 1`},
		{"bodies edited", `UPDATE record_comments SET body = body || ' (edited)' WHERE id % 5 = 0`},
		{"soft and hard deletes", `UPDATE record_comments SET deleted_at = now() WHERE id % 11 = 0; DELETE FROM record_comments WHERE id % 13 = 0`},
		{"comments moved to another record", `UPDATE record_comments SET record_id = record_id + 3 WHERE id % 17 = 0`},
		{"more than the limit on one record", `INSERT INTO record_comments (record_id, author, body, created_at) SELECT (SELECT min(id) FROM source_records WHERE deleted_at IS NULL AND payload->>'title' IS NOT NULL), 'many', 'c' || g, now() + g * interval '1 second' FROM generate_series(1, 25) g`},
	}
	for i, st := range steps {
		_, err := p.pool.Exec(ctx, st.sql)
		require.NoError(t, err, st.name)
		if i == 2 {
			// The follower dies; the next one resumes.
			require.NoError(t, f.Signal(syscall.SIGKILL))
			_ = f.Wait(time.Minute)
			f = p.startFollower(fenv...)
		}
		p.waitComments(ctx, 2*time.Minute, false, procs)
	}
	var after int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT sum(version) FROM source_records`).Scan(&after))
	require.Equal(t, versions, after, "no record row changed: every document change came from its comments")
	var outOfOrder int64
	require.NoError(t, p.pool.QueryRow(ctx, `
SELECT count(*) FROM (SELECT aggregate_version, lag(aggregate_version) OVER (PARTITION BY aggregate_id ORDER BY id) AS prev FROM outbox_event_members) e
WHERE e.prev IS NOT NULL AND e.aggregate_version <= e.prev`).Scan(&outOfOrder))
	// The publisher deletes what it sent; whatever is left must grow.
	require.Zero(t, outOfOrder, "a record's event versions only grow")

	// A search finds a record by a comment's text.
	res, err := p.es.Search(p.alias).Query(elastic.NewMatchPhraseQuery("comments.body", "fresh")).Size(0).TrackTotalHits(true).Do(ctx)
	require.NoError(t, err)
	require.Positive(t, res.TotalHits(), "records found by a comment's text")

	// v2: each comment's created_at too. A new processor version rebuilds
	// into a new generation; the user stops following, runs it, cuts over
	// and follows at v2.
	require.NoError(t, f.Signal(syscall.SIGTERM))
	require.NoError(t, f.Wait(time.Minute))
	v2 := p.spec
	v2.ProcessorVersion = "v2"
	rel := v2.Document.Relations[0]
	rel.Fields = append(append([]batch.Field(nil), rel.Fields...), batch.Field{Name: "at", From: "created_at"})
	v2.Document.Relations = []batch.Relation{rel}
	v2File := writeSpec(v2, "job-v2.json")
	b := testproc.Run(t, 3*time.Minute, p.batcherBin, p.env(), "run", "--spec", v2File)
	require.Equal(t, 0, b.ExitCode(), "v2 run (no trigger reinstall: same tables and joins):\n%s", tail(b.Stderr(), 20))
	cut := testproc.Run(t, 4*time.Minute, p.indexerBin, p.env(), "cutover", "--job", p.spec.Job, "--wait", "3m")
	require.Equal(t, 0, cut.ExitCode(), "cutover:\n%s\n%s\n%s", cut.Stdout(), tail(cut.Stderr(), 20), procs())
	requireAliasOn(t, p, index.GenerationIndex(p.alias, "v2"))
	p.specFile = v2File
	f = p.startFollower(fenv...)
	_, err = p.pool.Exec(ctx, `INSERT INTO record_comments (record_id, author, body) SELECT id, 'v2', 'after the cutover' FROM source_records WHERE id % 10 = 3`)
	require.NoError(t, err)
	// Every comment now carries its created_at (as jsonb writes a
	// timestamptz, in the index as the batcher wrote it).
	p.waitComments(ctx, 2*time.Minute, true, procs)
	require.NoError(t, f.Signal(syscall.SIGTERM))
	require.NoError(t, f.Wait(time.Minute))
}
