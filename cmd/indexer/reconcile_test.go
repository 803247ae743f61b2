package main

import (
	"bytes"
	"context"
	"net/http"
	"strconv"
	"testing"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/sink"
)

func TestMain(m *testing.M) { stack.Main(m) }

// A new user's job on a table named t: `indexer reconcile` without
// --source compares the job's source (the only one there is), and the old
// default --source source_records is refused instead of reporting every
// document as extra.
func TestReconcileCommandOnAJobWhoseTableIsT(t *testing.T) {
	ctx := context.Background()
	dbURL := stack.Database(t)
	pool := stack.Pool(t, dbURL)
	esURL := stack.ElasticsearchURL(t)
	client, err := index.NewClient(esURL)
	require.NoError(t, err)
	alias := stack.UniqueName("records")
	t.Cleanup(func() {
		_, _ = client.PerformRequest(context.Background(), elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/" + alias + "_v1", IgnoreErrors: []int{404}})
	})
	_, err = index.Ensure(ctx, client, alias, alias+"-write", sink.DefaultMapping)
	require.NoError(t, err)
	const n = 300
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 't', g::text, jsonb_build_object('title', 'doc ' || g), 1, 'v1', false FROM generate_series(1, $1) g`, n)
	require.NoError(t, err)
	bulk := client.Bulk().Index(alias + "-write")
	for g := 1; g <= n; g++ {
		id := strconv.Itoa(g)
		bulk.Add(elastic.NewBulkIndexRequest().Id(id).Version(1).VersionType("external").Doc(map[string]any{
			"title": "doc " + id, sink.FieldBucket: sink.Bucket(id), sink.FieldIDV: sink.IDV(id, 1, false, "v1"), sink.FieldPV: "v1", sink.FieldAggregateType: "t",
		}))
	}
	res, err := bulk.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)

	t.Setenv("DATABASE_URL", dbURL)
	t.Setenv("ELASTICSEARCH_URL", esURL)
	t.Setenv("RECONCILE_SOURCE", "")
	run := func(args ...string) (int, string, string) {
		var stdout, stderr bytes.Buffer
		code := cli.Dispatch(ctx, "indexer", "test", []cli.Command{reconcileCommand(&stdout)}, append([]string{"reconcile", "--alias", alias}, args...), &stdout, &stderr)
		return code, stdout.String(), stderr.String()
	}
	code, out, errOut := run()
	require.Zero(t, code, errOut)
	require.Contains(t, out, "no drift")
	require.Regexp(t, `source\s+t\s`, out)

	code, out, errOut = run("--source", "source_records", "--repair")
	require.Equal(t, cli.ExitUsage, code, out)
	require.Contains(t, errOut, `"source_records" has no rows`)
	require.Contains(t, errOut, `"t"`)
	count, err := client.Count(alias).Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n, count, "nothing deleted")
}

// --source-table reads the job's stored spec: without --job it is refused
// before anything is opened, naming why.
func TestReconcileSourceTableNeedsAJob(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
	t.Setenv("ELASTICSEARCH_URL", "http://127.0.0.1:1")
	t.Setenv("JOB", "")
	var stdout, stderr bytes.Buffer
	code := cli.Dispatch(context.Background(), "indexer", "test", []cli.Command{reconcileCommand(&stdout)}, []string{"reconcile", "--source-table"}, &stdout, &stderr)
	require.Equal(t, cli.ExitUsage, code, stderr.String())
	require.Contains(t, stderr.String(), "--source-table needs --job")
}

// reconcile --job compares the generation of the job's live processor
// version (issue 27, item 2): after a rollback to v1 the stored spec still
// says v2 (the version its last run used), but searches read v1, and the
// rows were normalized at v1 again.
func TestReconcileJobComparesTheLiveVersion(t *testing.T) {
	ctx := context.Background()
	dbURL := stack.Database(t)
	pool := stack.Pool(t, dbURL)
	esURL := stack.ElasticsearchURL(t)
	client, err := index.NewClient(esURL)
	require.NoError(t, err)
	alias := stack.UniqueName("records")
	t.Cleanup(func() {
		_, _ = client.PerformRequest(context.Background(), elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/" + alias + "_v1", IgnoreErrors: []int{404}})
	})
	live, err := index.Ensure(ctx, client, alias, alias+"-write", sink.DefaultMapping)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('j', '{"job":"j","processor_version":"v2","source_name":"src"}')`)
	require.NoError(t, err)
	_, err = batch.SetLiveVersion(ctx, pool, "j", "v1", batch.MovedByRollback)
	require.NoError(t, err)
	const n = 50
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version, deleted)
SELECT 'src', g::text, jsonb_build_object('title', 'doc ' || g), 1, 'v1', false FROM generate_series(1, $1) g`, n)
	require.NoError(t, err)
	bulk := client.Bulk().Index(live)
	for g := 1; g <= n; g++ {
		id := strconv.Itoa(g)
		bulk.Add(elastic.NewBulkIndexRequest().Id(id).Version(1).VersionType("external").Doc(map[string]any{
			"title": "doc " + id, sink.FieldBucket: sink.Bucket(id), sink.FieldIDV: sink.IDV(id, 1, false, "v1"), sink.FieldPV: "v1", sink.FieldAggregateType: "src",
		}))
	}
	res, err := bulk.Refresh("true").Do(ctx)
	require.NoError(t, err)
	require.False(t, res.Errors)

	t.Setenv("DATABASE_URL", dbURL)
	t.Setenv("ELASTICSEARCH_URL", esURL)
	t.Setenv("RECONCILE_SOURCE", "")
	t.Setenv("ROUTES", "")
	var stdout, stderr bytes.Buffer
	code := cli.Dispatch(ctx, "indexer", "test", []cli.Command{reconcileCommand(&stdout)}, []string{"reconcile", "--alias", alias, "--job", "j"}, &stdout, &stderr)
	require.Zero(t, code, "stdout: %s\nstderr: %s", stdout.String(), stderr.String())
	require.Contains(t, stdout.String(), "no drift")
}
